"""Generate text: prefill the static KV cache with the prompt, then decode one token per step.

The forward passes run on the backend chosen for the model (backend.py: on a CPU a batch of one is cpu_step.py's
C++ step, one call a token) and each token is drawn by sampling.py's rule. The guided loop is guided.py's; the
command line's options and printing cli.py's."""
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line and status 130, as cli.run_main says later
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted", file=sys.stderr), os._exit(130)))

import time  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402

import cli  # noqa: E402
import guided  # noqa: E402
from cli import (DEFAULT_CHECKPOINT, DTYPES, KV_DTYPES, device_sync, peak_memory_gb, resolve_device,  # noqa: E402, F401
                 weight_bytes)
from backend import Backend  # noqa: E402
from model import Transformer, kv_bucket  # noqa: E402
from sampling import NOT_FINITE, Sampling, pick  # noqa: E402, F401


# ---- what the loops share ------------------------------------------------------------------------------------------

def not_finite(step: int) -> ValueError:
    return ValueError(f"the model's logits became NaN or infinite by new token {step + 1}: the weights or the "
                      f"dtype overflow; try the float32 dtype")


def check_finite(tokens, step: int):  # tokens [B, S]; a host sync, so only every few steps
    if bool((tokens == NOT_FINITE).any()):
        raise not_finite(step)


def streams(options: Sampling, seeds: list) -> Optional[list[list[float]]]:
    """Each row's uniforms (sampling.py), from its seed seeds[b]; None when greedy."""
    if options.greedy:
        return None
    return [replace(options, seed=None if s is None else s % 2**64).uniforms() for s in seeds]


def allowed(bits, vocab_size: int):  # bits [N, W] int32 (a grammar's bitmask) or None -> [N, V] bool or None
    return None if bits is None else guided.allowed_tokens(bits, vocab_size)


def picked(logits, options: Sampling, u: Optional[list], i: int, bits=None):  # logits [B, V] -> [B]
    """Each row's token i from its logits, as sampling.pick draws it; bits [B, W] (a grammar's mask) or None."""
    if u is None:  # greedy: on the device, no sync
        finite = torch.isfinite(logits.sum(-1))
        ok = allowed(bits, logits.size(-1))
        return torch.where(finite, (logits if ok is None else logits.masked_fill(~ok, -float("inf"))).argmax(-1),
                           NOT_FINITE)
    return torch.tensor(pick(logits, [options] * logits.size(0), [row[i] for row in u],
                             allowed(bits, logits.size(-1))), device=logits.device)


class Answer:
    """One answer's bookkeeping in the loops that add tokens a round at a time (speculation, token trees): tokens
    in, "done?" out. It ends at an end-of-sequence id, at max_new_tokens or at a stop string (see stop_strings;
    the check decodes only the round's new text); the callback sees the tokens after every round; a NaN's token
    is the loop's error."""

    def __init__(self, max_new_tokens: int, eos_ids=None, stop: Optional[Callable] = None,
                 callback: Optional[Callable] = None):
        self.out, self.limit, self.eos, self.stop, self.callback = [], max_new_tokens, set(eos_ids or ()), stop, callback
        self.done, self.seen = False, 0

    def add(self, tokens: list[int], each: Optional[Callable] = None):
        """Take tokens up to an end; each(token) -> True ends the answer after that token too (a grammar)."""
        for t in tokens:
            if t == NOT_FINITE:
                raise not_finite(len(self.out))
            self.out.append(t)
            ended = each is not None and each(t)
            if ended or t in self.eos or len(self.out) >= self.limit:
                self.done = True
                return

    def round(self) -> bool:
        """The round is over: the callback, the stop strings; whether the answer is done."""
        if self.callback is not None:
            self.callback(self.out)
        if not self.done and self.stop is not None:
            self.done = self.stop(self.out, len(self.out) - self.seen) < len(self.out)
        self.seen = len(self.out)
        return self.done


# ---- the loop ------------------------------------------------------------------------------------------------------

@dataclass
class Generation:
    """What every loop returns: each row's new tokens (cut before EOS) and the figures, in one schema."""
    rows: list[list[int]]
    prompt_tokens: int  # all rows, padding included
    prefill_s: float  # prefill and the first new token: the time to first token
    decode_s: float  # everything after
    decode_tokens: int  # new tokens after the first, all rows
    forwards: int  # target forward passes after prefill: decode steps, or verify passes
    peak_memory_gb: float
    drafted: int = 0  # speculative: tokens proposed
    accept_histogram: Optional[list[int]] = None  # speculative: [j] = verify passes that kept j proposals
    forced: Optional[int] = None  # guided: new tokens the grammar forced (fed by fast-forward)
    incomplete: list[int] = field(default_factory=list)  # guided: rows cut by max_new_tokens mid-grammar
    tree_sizes: Optional[dict] = None  # token trees: nodes verified per pass -> passes
    methods: Optional[dict] = None  # speculative: new tokens after the first, by the method that made them

    def metrics(self, weight_bytes: int) -> dict:
        """The figures generate.py prints and --metrics_json writes; speculation's are None for plain decoding."""
        rounds = sum(self.accept_histogram) if self.accept_histogram else 0
        kept = sum(j * c for j, c in enumerate(self.accept_histogram or []))
        total_s = self.prefill_s + self.decode_s
        return {"ttft_ms": 1e3 * self.prefill_s,
                "prefill_tokens_per_sec": self.prompt_tokens / self.prefill_s,
                "decode_tokens_per_sec": self.decode_tokens / self.decode_s if self.decode_tokens else 0.0,
                "tokens_per_sec": (self.decode_tokens + len(self.rows)) / total_s,
                "total_s": total_s,
                # each forward reads every weight once, whatever the batch size or the tokens it verifies
                "bandwidth_gb_s": weight_bytes * self.forwards / self.decode_s / 1e9 if self.forwards else 0.0,
                "peak_memory_gb": self.peak_memory_gb,
                "target_forwards": self.forwards + 1,
                "mean_accepted": kept / rounds if rounds else None,  # proposals kept per verify pass
                "mean_drafted": self.drafted / rounds if rounds else None,
                "acceptance_rate": kept / self.drafted if self.drafted else None,
                "accept_histogram": self.accept_histogram, "forced_tokens": self.forced,
                "tree_sizes": self.tree_sizes, "methods": self.methods,
                "incomplete": bool(self.incomplete)}  # guided output cut before its grammar was complete


STOP_CHECK_EVERY = 8  # rows finish at EOS on the device; the host looks only every few steps, as each look syncs


def decode_n_tokens(backend: Backend, out, pos: int, left_pad, eos, callback: Optional[Callable],
                    stop: Optional[Callable], options: Sampling, u: Optional[list]) -> int:
    """Fill out[:, 1:] one token per step (out[:, 0] holds prefill's token, at cache slot pos). eos [E] holds the
    end-of-sequence ids; stop(row) -> the tokens to keep, fewer than len(row) once a stop string shows; u: each
    row's uniforms (None: greedy). Returns the number of columns filled."""
    input_pos = torch.tensor([pos], device=out.device)  # the host counts too, to choose how much cache to read
    done = torch.isin(out[:, 0], eos) if eos is not None else None  # [B]
    if stop is not None and done is None:
        done = torch.zeros_like(out[:, 0], dtype=torch.bool)
    fill = eos[0] if eos is not None else 0  # what a finished row repeats
    for i in range(1, out.size(1)):
        if i % STOP_CHECK_EVERY == 0:
            check_finite(out[:, :i], i - 1)
            if stop is not None:  # text is the host's: decode each row where the loop syncs anyway
                done |= torch.tensor([stop(r) < len(r) for r in out[:, :i].tolist()], device=out.device)
            if done is not None and bool(done.all()):
                return i
        kv_len = kv_bucket(pos + i, backend.model.max_seq_length)
        cur = out[:, i - 1 : i].clamp(min=0)  # a valid id even after NOT_FINITE; the check above stops the loop
        nxt = backend.greedy(cur, input_pos, left_pad, kv_len) if u is None else \
            picked(backend.decode(cur, input_pos, left_pad, kv_len), options, u, i)
        input_pos += 1  # in place: the compiled step reads the same tensor every time
        if done is not None:  # a finished row keeps emitting EOS, so shapes stay fixed
            nxt = torch.where(done, fill, nxt)
            if eos is not None:
                done |= torch.isin(nxt, eos)
        out[:, i] = nxt  # preallocated: no allocation, and nxt's CUDA-graph buffer is free for the next step
        if callback is not None:
            stream(callback, out[0, : i + 1].tolist())
    check_finite(out, out.size(1) - 1)
    return out.size(1)


def stream(callback: Callable, tokens: list[int]):  # the callback syncs every step anyway: check on the host
    if NOT_FINITE in tokens:
        raise not_finite(len(tokens) - 1)
    callback(tokens)


# inference_mode rather than no_grad: tensors made inside skip autograd's bookkeeping, the custom ops its fallback
@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_ids=None,
             callback: Optional[Callable] = None, pad_id: int = 0, backend: Optional[Backend] = None,
             stop: Optional[Callable] = None, cached: int = 0, guide=None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: float = 1.0, seed: Optional[int] = None,
             seeds: Optional[list] = None) -> Generation:
    """Greedy or sampled continuations of a batch of token-id prompts of any lengths (left-padded). A row ends
    at any of eos_ids, or where stop(row) (see stop_strings) cuts it. callback, if given, sees the first row's new
    tokens after every step. cached: the KV cache already holds the first `cached` tokens of the (one) prompt,
    from an earlier call, so prefill computes only the rest (a chat's earlier turns). guide (a guided.Guide): each
    row's output matches its grammar (see guided.generate_guided). backend: how the passes run (default: the
    fastest exact here, backend.py). seed: the rows' sampling seed, or seeds, one a row (None: torch's generator)."""
    options = Sampling(max_new_tokens, temperature, top_k, top_p, seed)
    backend = backend if backend is not None else Backend(model)
    device = model.tok_embeddings.weight.device
    B, T = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a prompt is empty")
    if cached and (B > 1 or not 0 <= cached < T or model.max_seq_length < T + max_new_tokens):
        raise ValueError("cached tokens need one prompt longer than them, in a cache set up to hold it all")
    if T + max_new_tokens > model.args.block_size:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum "
                         f"sequence length {model.args.block_size}")
    if seeds is not None and len(seeds) != B:
        raise ValueError(f"{len(seeds)} seeds for {B} prompts")
    if model.max_batch_size < B or model.max_seq_length < T + max_new_tokens:
        model.setup_caches(B, T + max_new_tokens)
    backend.begin()
    u = streams(options, seeds or [seed] * B)
    idx = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        idx[row, T - len(p):] = torch.tensor(p, device=device)
    left_pad = None
    if any(len(p) < T for p in prompts):
        left_pad = torch.tensor([T - len(p) for p in prompts], device=device)
    if guide is not None:
        answers = [Answer(max_new_tokens, eos_ids, stop, callback if b == 0 else None) for b in range(B)]
        rows, prefill_s, decode_s, forwards, incomplete = guided.generate_guided(
            backend, idx, left_pad, cached, max_new_tokens, eos_ids, guide, device_sync, answers,
            lambda logits, bits, i: picked(logits, options, u, i, bits))
        return Generation([cut(r, eos_ids, stop) for r in rows], B * (T - cached), prefill_s, decode_s,
                          sum(map(len, rows)) - B, forwards, peak_memory_gb(device), forced=guide.forced,
                          incomplete=incomplete)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    eos = torch.tensor(list(eos_ids), device=device) if eos_ids else None  # [E]

    device_sync(device)
    t0 = time.perf_counter()
    logits = backend.prefill(idx[:, cached:], torch.arange(cached, T, device=device), left_pad,
                             kv_bucket(T, model.max_seq_length))
    out[:, 0] = picked(logits, options, u, 0)
    if callback is not None:
        stream(callback, out[0, :1].tolist())
    device_sync(device)
    t1 = time.perf_counter()
    # the loop in one call where it can, and where nothing needs the host between tokens
    can_loop = u is None and callback is None and stop is None
    filled = backend.greedy_loop(out, T, left_pad, eos) if can_loop else None
    if filled is not None:
        check_finite(out[:, :filled], filled - 1)
    else:
        filled = decode_n_tokens(backend, out, T, left_pad, eos, callback, stop, options, u)
    device_sync(device)
    t2 = time.perf_counter()

    rows = [cut(r, eos_ids, stop) for r in out[:, :filled].tolist()]
    return Generation(rows, B * (T - cached), t1 - t0, t2 - t1, B * (filled - 1), filled - 1, peak_memory_gb(device))


def cut(row: list[int], eos_ids, stop: Optional[Callable]) -> list[int]:
    """The row up to (not including) its first end-of-sequence id, and up to the token ending a stop string."""
    end = next((i for i, t in enumerate(row) if t in (eos_ids or ())), len(row))
    return row[: stop(row[:end]) if stop else end]


# ---- the command line: load, generate, print the text and the figures ----------------------------------------------

def plain_loop(model, *, max_new_tokens: int, guide=None, backend: Optional[Backend] = None, parallel=None,
               **sampling) -> Callable:  # loop(prompts, eos_ids, callback, stop, cached, seeds) -> Generation
    backend = backend if backend is not None else Backend(model)  # see speculative.make_loop
    return lambda prompts, eos_ids=None, callback=None, stop=None, cached=0, seeds=None: generate(
        model, prompts, max_new_tokens, eos_ids, callback, backend=backend, stop=stop, cached=cached, guide=guide,
        seeds=seeds, **sampling)


def run(*, checkpoint_path: Path, prompts: list[str], max_new_tokens: int, batch_size: int, num_samples: int = 1,
        seed: int = 1234, device: str = "auto", dtype: str = "bfloat16", threads: Optional[int] = None,
        cpu_kernels: str = "auto", compile: bool = False, compile_prefill: bool = False,
        max_seq_length: Optional[int] = None, kv_cache_dtype: str = "auto", chat: bool = False,
        system: Optional[str] = None, stop: Optional[list[str]] = None, ignore_eos: bool = False,
        grammars: list[str] = (), profile: Optional[Path] = None, metrics_json: Optional[Path] = None,
        make_loop: Callable = plain_loop, speculate_k: int = 0, parallel=None, **sampling):
    """Load, generate num_samples times, print the text and the figures. make_loop: plain_loop or another with its
    keywords (speculative.make_loop); parallel, from tp.py: the rank's device, its loader, sums over the ranks."""
    import checkpoint  # here: it brings the kernel modules, which the library's steps need only when asked for
    dev, dt = parallel.device if parallel else resolve_device(device), DTYPES[dtype]
    config = checkpoint.plan(checkpoint_path, dev, dt)
    tokenizer = checkpoint.load_tokenizer(checkpoint_path, config)
    encoded = [cli.encode_prompt(tokenizer, s, chat, system) for s in prompts]
    guide = guided.make_guide(tokenizer, list(grammars), batch_size, config.vocab_size, speculate_k)  # fails fast
    T = max(len(p) for p in encoded)
    if max_seq_length and max_seq_length > config.block_size:
        raise ValueError(f"--max_seq_length {max_seq_length} exceeds the model's block_size {config.block_size}")
    max_seq_length = max_seq_length or min(T + max_new_tokens, config.block_size)
    if T + max_new_tokens > min(max_seq_length, config.block_size):
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the maximum "
                         f"sequence length {min(max_seq_length, config.block_size)}")
    checkpoint.plan(checkpoint_path, dev, dt, batch_size, max_seq_length, T, parallel.world if parallel else 1,
                    kv_cache_dtype == "int8")  # before anything is allocated
    given, copies = len(prompts), batch_size // len(prompts)
    prompts, encoded = prompts * copies, encoded * copies
    threads = cli.set_threads(threads, parallel.world if parallel else 1) if dev.type == "cpu" else None
    model = (parallel.load_model if parallel else checkpoint.load_model)(checkpoint_path, dev, dt, cpu_kernels)
    model.setup_caches(batch_size, max_seq_length, KV_DTYPES[kv_cache_dtype])
    model_bytes = weight_bytes(model) if not parallel else int(parallel.sum([weight_bytes(model)])[0])
    where = f"{parallel.world} ranks, {dev.type}" if parallel else dev
    backend = Backend(model, compile, compile_prefill)
    print(f"Loaded {checkpoint_path} ({model_bytes / 1e9:.3f} GB of weights read per step) on {where}"
          f"{f' ({threads} threads)' if threads else ''}, {dtype}{cli.kernels_of(model, dev)}"
          f"{'; KV cache int8' if kv_cache_dtype == 'int8' else ''}; running on {backend.describe()}")
    loop = make_loop(model, max_new_tokens=max_new_tokens, guide=guide, backend=backend, parallel=parallel,
                     **sampling)
    torch.manual_seed(seed)
    # copy j of a prompt in sample i draws with seed + i * copies + j: the first with the seed itself, as alone
    seeds = lambda i: [seed + i * copies + b // given for b in range(batch_size)]  # noqa: E731
    compile_s = 0.0
    if compile or compile_prefill:
        t0 = time.perf_counter()  # one untimed run triggers compilation and CUDA-graph capture
        loop(encoded)
        compile_s = time.perf_counter() - t0
        print(f"Compilation time: {compile_s:.2f} s")
    eos_ids, stop_at = None if ignore_eos else tokenizer.eos_ids, cli.stop_strings(tokenizer, stop)
    shown = [""] * len(prompts) if chat else prompts  # a chat prints the answer alone
    streaming = batch_size == 1 and sys.stdout.isatty() and not stop  # a stop string shows only at the end
    results, samples = [], []
    for i in range(num_samples):
        prof = torch.profiler.profile() if profile is not None and i == num_samples - 1 else None
        if prof is not None:
            prof.__enter__()
        if streaming:
            print(shown[0], end="", flush=True)
        result = loop(encoded, eos_ids, cli.make_streamer(tokenizer, encoded[0], eos_ids) if streaming else None,
                      stop_at, 0, seeds(i))
        if prof is not None:
            prof.__exit__(None, None, None)
            cli.write_file(profile, lambda tmp: prof.export_chrome_trace(str(tmp)))
        texts = [cli.new_text(tokenizer, p, r, stop) for p, r in zip(encoded, result.rows)]
        print() if streaming else cli.print_texts(shown, texts)
        figures, rows = cli.report(result, texts, i, num_samples, max_new_tokens, model_bytes, parallel)
        results.append(figures)
        samples += rows
    if metrics_json and (not parallel or parallel.rank == 0):
        cli.write_metrics(metrics_json, results, compile_s=compile_s, samples=samples)


def main(argv=None):
    run(**cli.run_options(cli.parse_generate_args(argv, cli.generate_parser(__doc__))))


if __name__ == "__main__":
    cli.run_main(main)
