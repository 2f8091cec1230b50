"""What every command shares. Bad input ends in one line on stderr and exit status 2, Ctrl-C in one line and
status 130; options are checked before any work starts; an output file replaces only an earlier output of the
same kind; the CPU thread count is set once, from the cores other work leaves free. Also generate.py's and
speculative.py's command line: their options, the run that loads, times and prints, and its metrics file."""
import argparse
import difflib
import json
import logging
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

BAD_INPUT, INTERRUPTED = 2, 130
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "stdlib-target"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_DTYPES = {"auto": None, "int8": torch.int8}
OLDEST_TORCH = "2.11"  # the oldest torch the tests pass on (2.11.0, 2.13.0); 2.5 lacks options and ops used here


def fail(msg: str):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT)


if torch.__version__ < OLDEST_TORCH:  # checked on import, before any module sets an option this torch lacks
    fail(f"torch {OLDEST_TORCH} or newer is needed; this is torch {torch.__version__}")


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def run_main(main: Callable, *args):
    """Call main(*args) the way every entry point does: bad input is one line and status 2, Ctrl-C is one line
    and status 130; what was printed before either stays."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the entry point's quiet handler covered the imports
    # a CUDA build of torch without a GPU warns of CUDA_HOME when the kernels or inductor build C++: noise before a
    # command's output about CUDA code that nothing here builds (a command's choice, so not done on import)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        main(*args)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    except (ValueError, OSError) as e:  # UnicodeError, json errors and file errors are among these
        fail(first_line(e))
    except (MemoryError, torch.OutOfMemoryError):
        fail("out of memory: lower --batch_size or --max_seq_length, or use a quantized checkpoint")


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: the description --help prints."""
    return " ".join(doc.split("\n\n")[0].split())


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.error = lambda msg: fail(msg + suggestion(p, msg))  # one line, not argparse's usage block
    p.formatter_class = ShowDefaults
    return p


class ShowDefaults(argparse.HelpFormatter):
    """--help gives each option's default, where it has one its text does not state already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS or \
                "default" in text or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def suggestion(p: argparse.ArgumentParser, msg: str) -> str:
    """For an unknown option, the closest known one: "; did you mean --max_new_tokens?"."""
    if not msg.startswith("unrecognized arguments:"):
        return ""
    for word in msg.split(":", 1)[1].split():
        close = difflib.get_close_matches(word.split("=")[0], list(p._option_string_actions), n=1, cutoff=0.6)
        if word.startswith("-") and close:
            return f"; did you mean {close[0]}?"
    return ""


def require(checks: list[tuple[bool, str]]):
    """Raise ValueError with the message of the first check that fails."""
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def whole_number(text: str, lo: int, hi: int) -> int:  # argparse names the option in front of the message
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}" if value < lo else
                                         f"must be at most {hi}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1, 2**31 - 1)


def whole_or_zero(text: str) -> int:
    return whole_number(text, 0, 2**31 - 1)


def seed(text: str) -> int:  # what torch.manual_seed takes
    return whole_number(text, 0, 2**64 - 1)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


# ---- files ---------------------------------------------------------------------------------------------------------

def check_output_file(path: Optional[Path], flag: str, marker: str):
    """Raise unless `path` can be written now: its folder exists and is writable, and the path is new or holds an
    earlier output of this flag (`marker` appears in its first megabyte). Called before any long work."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")
    if path.exists():
        with open(path, "rb") as f:
            if marker.encode() not in f.read(1 << 20):
                raise ValueError(f"{flag} {path} exists and is not an earlier output of {flag}; "
                                 f"choose another path")


def write_file(path: Path, write: Callable[[Path], None]):
    """Write beside `path`, then rename: a crash or Ctrl-C leaves the old file or none, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_text_file(path: Path, what: str, available: Optional[int] = None) -> Path:
    """Raise unless `path` is a UTF-8 text file that fits in memory several times over (it is read whole, then
    tokenized: the token ids take several times the text's size)."""
    if not path.is_file():
        raise ValueError(f"{what} {path} not found")
    size = path.stat().st_size
    available = available if available is not None else available_memory()
    if size * 8 > available:
        raise ValueError(f"{what} {path} is {size / 1e9:.1f} GB; reading and tokenizing it needs about "
                         f"{size * 8 / 1e9:.1f} GB, and {available / 1e9:.1f} GB is available")
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        (head[: -4] if len(head) == 1 << 16 else head).decode("utf-8")  # a cut may fall inside a character
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    if b"\0" in head:
        raise ValueError(f"{what} {path} is binary, not text")
    return path


def available_memory(device: Optional[torch.device] = None) -> int:
    """Bytes that can be allocated now on `device` (the CPU by default)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # no /proc (macOS): all of RAM


# ---- devices and figures -------------------------------------------------------------------------------------------

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda, cuda:N or mps)") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise ValueError(f"device {name!r} is not available on this machine")
    return device


def weight_bytes(model) -> int:
    """Bytes one decode step must read: every weight once. An untied embedding table is not read whole, one row
    per token, so it is left out; the KV cache and RoPE table are not weights."""
    tied = model.output.weight is model.tok_embeddings.weight  # a quantized head is never tied
    skip = {"freqs_cis"} | (set() if tied else {"tok_embeddings.weight"})
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return sum(t.numel() * t.element_size() for n, t in tensors if n not in skip and "kv_cache" not in n)


def peak_memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 1e9
    status = Path("/proc/self/status")
    if status.exists():  # Linux: VmHWM is this process's peak; ru_maxrss would include a parent's, kept across exec
        return next(int(l.split()[1]) for l in status.read_text().splitlines() if l.startswith("VmHWM")) * 1024 / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e9  # macOS: bytes


def device_sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def kernels_of(model, device) -> str:  # what a "Loaded" line says of the kernels
    if device.type == "cpu":
        import cpu_gemv
        return f"; {cpu_gemv.describe(model)}"
    if device.type == "cuda":
        import cuda_gemv
        return f"; {cuda_gemv.describe(model)}"
    return ""


# ---- threads -------------------------------------------------------------------------------------------------------

def physical_cores() -> int:
    """Cores this process may run on, not counting SMT siblings: a second thread per core adds no bandwidth."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        cores, block = set(), {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            if ":" in line:
                key, value = (s.strip() for s in line.split(":", 1))
                block[key] = value
            elif block:
                if int(block.get("processor", -1)) in cpus:
                    cores.add((block.get("physical id"), block.get("core id", block.get("processor"))))
                block = {}
        return max(1, min(len(cores), len(cpus)))
    except (OSError, ValueError):
        return max(1, len(cpus))


def busy_threads(samples: int = 5) -> int:
    """Threads of other processes running right now: the fewest seen in a few looks at /proc/stat, less this one."""
    try:
        seen = []
        for _ in range(samples):
            stat = Path("/proc/stat").read_text()
            seen.append(int(next(l.split()[1] for l in stat.splitlines() if l.startswith("procs_running"))) - 1)
            time.sleep(0.02)
        return max(0, min(seen))
    except (OSError, StopIteration, ValueError):
        return 0


warned = False  # set_threads has warned of other programs' threads


def set_threads(threads: Optional[int], share: int = 1, decode: bool = True) -> int:
    """Use `threads` CPU threads, or by default the physical cores that other programs leave free, split among
    `share` processes on one machine. Decode runs one parallel region per layer, and each waits for its slowest
    thread: a thread that has to share its core with other work stalls all of them, so before decoding say so once,
    with what was chosen."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    others = max(0, busy_threads() - (share - 1)) if decode else 0  # less the other ranks, loading too
    free = max(1, min(physical_cores(), cores - others) // share)
    chosen = threads or (free if decode else max(1, physical_cores() // share))
    torch.set_num_threads(chosen)
    global warned
    others, warned = (0 if warned else others), warned or bool(others)  # said once a process, not every load
    if others and not threads:
        print(f"warning: {others} thread(s) of other programs are running on this machine's {cores} CPUs, so "
              f"decoding uses {chosen} thread(s) (--threads to choose)", file=sys.stderr, flush=True)
    elif others and chosen * share + others > cores:  # the fix, unless it is what was asked for already
        fix = f"; pass --threads {free} or stop them" if free < chosen else "; stop them for full speed"
        print(f"warning: {others} thread(s) of other programs are running on this machine's {cores} CPUs; decode "
              f"with {chosen} threads can be many times slower while they do{fix}", file=sys.stderr, flush=True)
    return chosen


# ---- generate.py's and speculative.py's command line ---------------------------------------------------------------

def generate_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=summary(doc))
    p.add_argument("--prompt", action="append", help="prompt text, or - to read it from standard input; repeat "
                   "the flag for a batch of prompts (default: 'def fibonacci(n):')")
    p.add_argument("--prompt_file", type=Path, action="append", metavar="PATH", help="read a prompt from this "
                   "UTF-8 text file; may be repeated, and combined with --prompt")
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT,
                   help="checkpoint directory: model.safetensors, config.json, tokenizer.model "
                   "(default: the built-in model trained on the Python standard library)")
    p.add_argument("--num_samples", type=positive_int, default=1, help="how many times to generate (each "
                   "timed separately)")
    p.add_argument("--batch_size", type=positive_int, help="rows per batch: a single prompt is repeated this "
                   "many times (default: the number of prompts)")
    add_sampling_options(p)
    add_device_options(p)
    p.add_argument("--compile", action="store_true", help="a GPU's fast path: torch.compile the steps model.py "
                   "runs, as CUDA graphs (the compile time is reported apart). A CPU needs no flag: a batch of one "
                   "runs as one C++ call a token (cpu_step.py) by default; with --cpu_kernels off this compiles "
                   "model.py's forward with inductor's C++ wrapper")
    p.add_argument("--compile_prefill", action="store_true", help="compile prefill, with dynamic shapes "
                   "(one compilation serves every prompt length)")
    p.add_argument("--max_seq_length", type=positive_int, help="KV cache length (default: longest prompt + "
                   "max_new_tokens)")
    add_kv_cache_option(p)
    p.add_argument("--profile", type=Path, metavar="PATH", help="write a torch.profiler trace of the last sample "
                   "to PATH (Chrome trace JSON)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template, as a user "
                   "turn, and print only the answer")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the prompt")
    add_guided_options(p)
    p.add_argument("--metrics_json", type=Path, metavar="PATH", help="write the speed figures and the samples "
                   "as JSON (averaged over the samples after the first)")
    return one_line_errors(p)


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens: int = 200, temperature: float = 0.8,
                         default_seed: Optional[int] = 1234):
    """The sampling flags, the same in every command; each command's own defaults. temperature, top_k and top_p
    stay None when not given: sampling_options fills them from the model's defaults, else the command's."""
    from sampling import FALLBACK
    p.sampling_fallback = {**FALLBACK, "temperature": temperature}
    model = "default: the checkpoint's generation_config.json, else %s"
    p.add_argument("--max_new_tokens", type=positive_int, default=max_new_tokens, help="new tokens per answer, at "
                   "most")
    p.add_argument("--temperature", type=finite_float, help=f"0 is greedy (exact argmax) ({model % temperature})")
    p.add_argument("--top_k", type=whole_or_zero, help="sample only among the k most likely tokens, 0: all "
                   f"({model % FALLBACK['top_k']})")
    p.add_argument("--top_p", type=finite_float, help="sample only among the most likely tokens that hold this much "
                   f"probability mass, in (0, 1] ({model % FALLBACK['top_p']})")
    p.add_argument("--seed", type=seed, default=default_seed, help="random seed, for reproducible sampling")
    p.add_argument("--stop", action="append", metavar="STRING", help="end an answer where its text first contains "
                   "STRING (not printed); may be repeated")
    p.add_argument("--ignore_eos", action="store_true", help="keep generating past the end-of-sequence tokens")


def add_device_options(p: argparse.ArgumentParser, dtype: str = "bfloat16"):
    """Where and how the model runs, the same in every command."""
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES), help="weight and activation dtype (default: "
                   "%(default)s)")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: the physical cores other "
                   "programs leave free)")
    p.add_argument("--cpu_kernels", default="auto", choices=["auto", "off"], help="auto: this CPU's decode "
                   "kernels (cpu_gemv.py) and the prefill dtype measured faster here; off: torch's own kernels")


def add_kv_cache_option(p: argparse.ArgumentParser):
    p.add_argument("--kv_cache_dtype", default="auto", choices=["auto", "int8"], help="auto: the model's dtype; "
                   "int8: about half the memory, keys rounded to int8 with a scale per position and head, values "
                   "with one per 32 (on x86 CPUs decode attention reads it as it is; elsewhere it is dequantized "
                   "every step)")


def add_guided_options(p: argparse.ArgumentParser):
    import guided
    g = p.add_argument_group("guided generation", "the output always matches: give one for all prompts, or one "
                             "per prompt (in the order of the prompts); a row ends once its grammar is complete")
    g.add_argument("--json_schema", dest="guides", action="append", type=guided.json_schema, metavar="FILE_OR_JSON",
                   help="a JSON schema, as a file or as JSON text")
    g.add_argument("--json", action="store_true", help="a JSON object or array, with any content")
    g.add_argument("--regex", dest="guides", action="append", type=guided.regex, metavar="PATTERN",
                   help="a regular expression the whole output matches")
    g.add_argument("--grammar", dest="guides", action="append", type=guided.lark, metavar="FILE.lark",
                   help="a Lark grammar (llguidance's dialect: a start rule, /regex/ terminals)")


def read_prompts(args) -> list[str]:
    """--prompt texts (- reads standard input) and --prompt_file contents, in that order."""
    prompts = [sys.stdin.read() if s == "-" else s for s in args.prompt or []]
    prompts += [check_text_file(f, "--prompt_file").read_text(encoding="utf-8") for f in args.prompt_file or []]
    for s in prompts:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: bytes that were not UTF-8 in the shell's argument
            raise ValueError("the prompt is not valid UTF-8 text") from None
        if not s.strip():
            raise ValueError("the prompt is empty")
    return prompts or ["def fibonacci(n):"]


def sampling_options(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The sampling options checked as every entry point checks them (sampling.Sampling), named as flags; those
    not given are the checkpoint's defaults (generation_config.json), else the command's."""
    from sampling import OptionError, Sampling, with_defaults
    from tokenizer import sampling_defaults
    try:
        model = sampling_defaults(args.checkpoint_path)
    except ValueError as e:  # a generation_config.json that is not JSON: the run would fail at the tokenizer
        p.error(str(e))
    for name, value in with_defaults(vars(args), model, p.sampling_fallback).items():
        setattr(args, name, value)
    try:
        Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, getattr(args, "seed", None),
                 getattr(args, "stop", None), bool(getattr(args, "ignore_eos", False)), **engine_sampling(args))
    except OptionError as e:
        p.error(f"--{e}")


def engine_sampling(args: argparse.Namespace) -> dict:  # the flags only the engine takes (batch.py's), given
    names = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")
    return {k: getattr(args, k) for k in names if hasattr(args, k)}


def parse_generate_args(argv, p: argparse.ArgumentParser) -> argparse.Namespace:
    import guided
    args = p.parse_args(argv)
    sampling_options(p, args)
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    check_output_file(args.metrics_json, "--metrics_json", '"ttft_ms"')
    check_output_file(args.profile, "--profile", '"traceEvents"')
    args.guides = ([guided.any_json()] if args.json else []) + (args.guides or [])
    args.prompt = read_prompts(args)  # one prompt stays one until run() has checked the batch fits in memory
    if args.batch_size is None:
        args.batch_size = len(args.prompt)
    elif len(args.prompt) > 1 and args.batch_size != len(args.prompt):
        p.error(f"--batch_size {args.batch_size} does not match the {len(args.prompt)} prompts given")
    if len(args.guides) not in (0, 1, args.batch_size):
        p.error(f"{len(args.guides)} of --json_schema, --json, --regex and --grammar for {args.batch_size} prompts: "
                f"give one for all, or one per prompt")
    return args


def run_options(args: argparse.Namespace) -> dict:
    """generate.run's keywords from generate.py's parsed options."""
    keep = ("checkpoint_path", "max_new_tokens", "num_samples", "batch_size", "temperature", "top_k", "top_p", "seed",
            "device", "dtype", "threads", "cpu_kernels", "compile", "compile_prefill", "max_seq_length",
            "kv_cache_dtype", "profile", "chat", "system", "stop", "ignore_eos", "metrics_json")
    return {**{k: getattr(args, k) for k in keep}, "prompts": args.prompt, "grammars": args.guides}


# ---- text: the prompt in, the answer out (the commands' and fast_decode.py's) -----------------------------------------------

def stop_strings(tokenizer, strings: Optional[list[str]]) -> Optional[Callable]:
    """stop(row, new=None) -> how many of the row's tokens to keep: through the token that completes the first of
    the stop strings in the row's text, or all of them. new: the row's last tokens, after a prefix known to hold no
    stop string; then only a tail of the text is decoded (a step costs the same however long the row). The text is
    cut before the string later (cut_text)."""
    if not strings:
        return None
    longest = max(map(len, strings))

    def tail(row: list[int], new: int) -> str:  # a tail of the text that holds any string the new tokens complete
        new = max(new, 1)
        n, added = new + longest + 8, len(tokenizer.decode(row[-new:]))
        while n < len(row):
            text = tokenizer.decode(row[-n:])  # its first characters may decode otherwise than in the whole text
            if len(text) > added + longest + 4:  # (a cut character: up to 4 more)
                return text
            n *= 2
        return tokenizer.decode(row)

    def stop(row: list[int], new: Optional[int] = None) -> int:
        if not any(s in (tokenizer.decode(row) if new is None else tail(row, new)) for s in strings):
            return len(row)
        lo, hi = 1, len(row)  # a string, once in the text of a prefix, stays in the text of longer ones
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if any(s in tokenizer.decode(row[:mid]) for s in strings) else (mid + 1, hi)
        return lo
    return stop


def cut_text(text: str, strings: Optional[list[str]]) -> str:
    """The text before the first stop string (the stop string is not part of the answer)."""
    return text[: min([text.find(s) for s in strings or () if s in text], default=len(text))]


def new_text(tokenizer, prompt: list[int], row: list[int], stop: Optional[list[str]] = None) -> str:
    """The text the row adds to the prompt (decoded together: SentencePiece's spaces depend on what precedes),
    without special tokens, as a reader sees it (the ids keep them)."""
    whole = tokenizer.decode(prompt + row, specials=False)
    return cut_text(whole[len(tokenizer.decode(prompt, specials=False)):], stop)


def encode_prompt(tokenizer, text: str, chat: bool = False, system: Optional[str] = None) -> list[int]:
    """Plain text with BOS, or a user turn (after a system one) in the model's chat template, whose special
    tokens become their ids."""
    if not chat:
        return tokenizer.encode(text, bos=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), bos=False, specials=True)


# ---- what a run prints and writes ---------------------------------------------------------------------------------

def report(result, texts: list[str], i: int, num_samples: int, max_new_tokens: int, model_bytes: int,
           parallel=None) -> tuple[dict, list[dict]]:
    """Print what sample i of num_samples made, beside its text: a warning per row cut mid-grammar, the count and
    the figures. Returns the figures and each row's text, tokens and finish_reason."""
    for row in result.incomplete:
        print(f"warning: {f'row {row + 1}' if len(texts) > 1 else 'the output'} is incomplete: it reached "
              f"--max_new_tokens before its grammar was complete", file=sys.stderr)
    figures = result.metrics(model_bytes)
    if parallel:
        figures["peak_memory_gb_per_rank"] = parallel.gather(figures["peak_memory_gb"])
    print(f"Sample {i + 1}/{num_samples}: {len(texts)} x {max(len(r) for r in result.rows)} new tokens"
          f"{' (incomplete)' if result.incomplete else ''}")
    print_summary(figures)
    return figures, [{"text": t, "tokens": r, "finish_reason": finish_reason(result, row, max_new_tokens)}
                     for row, (t, r) in enumerate(zip(texts, result.rows))]


def finish_reason(result, row: int, max_new_tokens: int) -> str:
    """"incomplete": guided output cut by max_new_tokens mid-grammar; "length": cut by max_new_tokens; "stop":
    ended at EOS, at a stop string, or with its grammar complete."""
    if row in result.incomplete:
        return "incomplete"
    return "length" if len(result.rows[row]) >= max_new_tokens else "stop"


def write_metrics(path: Path, results: list[dict], **extra):
    kept = results[1:] or results  # the first sample warms caches and allocators
    metrics = {k: sum(r[k] for r in kept) / len(kept) if isinstance(v, (int, float)) and not isinstance(v, bool)
               else kept[-1][k] for k, v in results[0].items()}
    metrics.update(extra)
    write_file(path, lambda tmp: tmp.write_text(json.dumps(metrics, indent=2)))


def print_summary(m: dict):
    print(f"Time to first token: {m['ttft_ms']:.1f} ms | decode: {m['decode_tokens_per_sec']:.2f} tokens/sec | "
          f"overall: {m['tokens_per_sec']:.2f} tokens/sec | total: {m['total_s']:.2f} s")
    per_rank = m.get("peak_memory_gb_per_rank")
    memory = " / ".join(f"{x:.2f}" for x in per_rank) + " GB per rank" if per_rank else f"{m['peak_memory_gb']:.2f} GB"
    print(f"Bandwidth achieved: {m['bandwidth_gb_s']:.2f} GB/s | peak memory: {memory}")
    if m["accept_histogram"] is not None:
        rate = "none proposed" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.1%}"
        print(f"Speculative: {m['target_forwards']} target forwards | mean drafted / accepted per verify: "
              f"{m['mean_drafted']:.2f} / {m['mean_accepted']:.2f} | acceptance rate: {rate}")
        print(f"Accepted proposals per verify (histogram, 0..k): {m['accept_histogram']}")
    if m.get("tree_sizes"):
        print("Tree size per verify, chosen by measured cost (nodes: passes): "
              + ", ".join(f"{n}: {c}" for n, c in m["tree_sizes"].items()))
    if m.get("methods"):  # speculative: which method made how many of the new tokens after the first
        made = [f"{name} {n}" for name, n in sorted(m["methods"].items(), key=lambda kv: -kv[1])]
        print(f"methods: {made[0]} tokens" + "".join(f", {x}" for x in made[1:]))
    if m["forced_tokens"] is not None:
        print(f"Guided: {m['forced_tokens']:.0f} new tokens forced by the grammar (fed by fast-forward), "
              f"{m['target_forwards']:.0f} forward passes")


def print_texts(prompts: list[str], texts: list[str]):
    if len(texts) == 1:
        print(prompts[0] + texts[0])
    for row, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(texts) > 1:
            print(f"--- prompt {row + 1} of {len(texts)} ---\n{prompt}{text}")


def make_streamer(tokenizer, prompt: list[int], eos_ids=None) -> Callable:
    """Print the text as it grows, up to the first end-of-sequence token (a finished row repeats it, and a chat
    template's end-of-turn token would show). Decoding the whole sequence keeps SentencePiece's spaces right."""
    shown, eos = len(tokenizer.decode(prompt, specials=False)), set(eos_ids or ())

    def stream(tokens: list[int]):  # syncs with the device every step, so only used on a terminal
        nonlocal shown
        end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        text = tokenizer.decode(prompt + tokens[:end], specials=False)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[shown:], end="", flush=True)
            shown = max(shown, len(text))
    return stream
