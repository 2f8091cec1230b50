"""Generate text: prefill the static KV cache with the prompt, then decode one token per step.

The decode step is small and shape-static within a cache-length bucket, so torch.compile turns it into a CUDA graph
on a GPU and into C++ kernels called from a C++ wrapper on a CPU, where a batch of one runs cpu_step.py's step: the
whole forward as one C++ call. The guided loop is guided.py's; the command line's options and printing cli.py's."""
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line and status 130, as cli.run_main says later
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted", file=sys.stderr), os._exit(130)))

import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402

import cli  # noqa: E402
import guided  # noqa: E402
from cli import (DEFAULT_CHECKPOINT, DTYPES, KV_DTYPES, device_sync, peak_memory_gb, resolve_device,  # noqa: E402, F401
                 weight_bytes)
from model import Transformer, kv_bucket  # noqa: E402


# ---- sampling ----------------------------------------------------------------------------------------------------

def logits_to_probs(logits, temperature: float = 1.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None):  # [B, V] -> [B, V] float32
    logits = logits.float() / max(temperature, 1e-5)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token once the tokens ranked above it already hold top_p of the mass; the top token always stays
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return logits.softmax(-1)


def probs_of(logits, temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None):  # [N, V] -> [N, V] float32
    """The distribution a token is drawn from (speculation's verify passes); greedy is a one-hot distribution, so
    one rule serves both."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.size(-1)).float()
    return logits_to_probs(logits, temperature, top_k, top_p)


def sample(logits, temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
           allowed=None):  # logits [B, V], allowed [B, V] bool or None -> [B]
    """The next token of each row, or NOT_FINITE where the row's logits hold a NaN or an infinity (a damaged
    model, or a dtype that overflows): the loop stops on it instead of printing garbage. allowed (guided
    generation): the tokens the grammar allows; the others get -inf before top-k, top-p and the draw, so the
    distribution is the model's, renormalized over the allowed tokens."""
    finite = torch.isfinite(logits.sum(-1))  # a sum is NaN or inf if any term is; checked before the mask's -inf
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -float("inf"))
    tok = logits.argmax(-1) if temperature == 0 else draw(logits_to_probs(logits, temperature, top_k, top_p))
    return torch.where(finite, tok, NOT_FINITE)


NOT_FINITE = -1


def not_finite(step: int) -> ValueError:
    return ValueError(f"the model's logits became NaN or infinite by new token {step + 1}: the weights or the "
                      f"dtype overflow; try the float32 dtype")


def check_finite(tokens, step: int):  # tokens [B, S]; a host sync, so only every few steps
    if bool((tokens == NOT_FINITE).any()):
        raise not_finite(step)


def draw(probs):  # [B, V] -> [B]
    # argmax(p / Exp(1)) is an exact draw from p that, unlike torch.multinomial, never syncs with the host
    q = torch.empty_like(probs).exponential_(1).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / q).argmax(-1)


def masked(logits, bits):  # logits [N, V], bits [N, W] int32 (a grammar's bitmask) or None -> [N, V]
    return logits if bits is None else logits.masked_fill(~guided.allowed_tokens(bits, logits.size(-1)), -float("inf"))


# ---- the steps: one forward pass each, and what is drawn from it ---------------------------------------------------

def prefill(model, idx, input_pos, left_pad, kv_len, **sampling):  # idx [B, S], input_pos [S], left_pad [B]|None -> [B]
    return sample(model(idx, input_pos, left_pad, kv_len, last=True)[:, -1], **sampling)


def decode_one_token(model, cur, input_pos, left_pad, kv_len, **sampling):  # cur [B, 1], input_pos [1] -> [B]
    return sample(model(cur, input_pos, left_pad, kv_len)[:, -1], **sampling)


def decode_logits(model, idx, input_pos, left_pad, kv_len):  # idx [B, S], input_pos [S] -> [B, V]
    """The last position's logits: guided decoding samples only once the grammar's mask is ready."""
    return model(idx, input_pos, left_pad, kv_len, last=True)[:, -1]


def pick(logits, bits, **sampling):  # logits [B, V], bits [B, W] int32 (a grammar's bitmask) -> [B]
    return sample(logits, allowed=guided.allowed_tokens(bits, logits.size(-1)), **sampling)


def draft_step(draft, cur, input_pos, kv_len, bits=None, **sampling):
    """Speculation: one draft token, the distribution it was drawn from, and the draft's own probability of it
    (from the softmax when greedy), which the adaptive rule multiplies along the draft. bits (guided): the grammar's
    mask, so that the draft proposes only allowed tokens. cur [1, 1], input_pos [1], bits [1, W] -> [1], [1, V], [1]"""
    logits = masked(draft(cur, input_pos, None, kv_len)[:, -1], bits)
    probs = probs_of(logits, **sampling)
    token = draw(probs)
    soft = probs if sampling.get("temperature", 0) > 0 else torch.softmax(logits.float(), -1)
    return token, probs, soft.gather(-1, token[:, None])[:, 0]


def verify(model, tokens, input_pos, kv_len, bits=None, **sampling):  # tokens [1, S], input_pos [S] -> probs [S, V]
    """Speculation: the target's distributions after each token. bits [N, W] (guided): only the last N positions,
    each under the grammar's mask there; rejection sampling against the target's distribution renormalized over
    the allowed tokens keeps the output exactly that distribution."""
    logits = model(tokens, input_pos, None, kv_len)[0]
    return probs_of(logits if bits is None else masked(logits[-bits.size(0):], bits), **sampling)


def tree_probs(model, tokens, input_pos, kv_len, tree_mask, tree_pos, **sampling):  # tokens [1, S] -> probs [S, V]
    """Token trees: the distributions after each node; a row whose logits are not finite comes out NaN."""
    logits = model(tokens, input_pos, None, kv_len, mask=tree_mask, pos=tree_pos)[0]
    return torch.where(torch.isfinite(logits.sum(-1, keepdim=True)), probs_of(logits, **sampling), float("nan"))


def draft_probs(model, tokens, input_pos, kv_len, tree_mask, tree_pos, **sampling):  # [1, S] -> [S, V]
    """tree_probs for a draft model: a function of its own, so that compiled it keeps its own graphs."""
    return tree_probs(model, tokens, input_pos, kv_len, tree_mask, tree_pos, **sampling)


def compile_step(step: Callable) -> Callable:
    """Compile a step whole: CUDA graphs on a GPU, inductor's C++ wrapper on a CPU, each option cutting the fixed
    cost a CPU step pays (HOW_IT_WORKS.md, "The compiled step on a CPU"). dynamic: one compilation serves every
    cache length and verify length."""
    # fewer guards to check per step (an unchanged module passes in one check), floats such as eps as constants
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True  # set where compilation is asked for, not on
    torch._dynamo.config.specialize_float = True  # import: lazy compilation reads them at the first call
    on_cpu = torch.compile(step, fullgraph=True, dynamic=True, options={
        "cpp_wrapper": True, "cpp_wrapper_build_separate": True,  # no Python per step; kernels and wrapper build apart
        "size_asserts": False, "alignment_asserts": False,  # no per-tensor checks every step
        "cpp.min_chunk_size": 16384})  # a batch-1 step's norms and RoPE on one thread: too small to split
    if not torch.cuda.is_available():
        return on_cpu
    # tunes the reductions inductor writes itself: the norms, and any batch-1 matmul not on cuda_gemv.py's kernels
    torch._inductor.config.coordinate_descent_tuning = True
    on_gpu = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=True)

    def run(*args, **kwargs):  # a model on the CPU of a GPU machine keeps the CPU's options
        x = next(a for a in args if isinstance(a, torch.Tensor))
        return (on_gpu if x.is_cuda else on_cpu)(*args, **kwargs)
    return run


def compile_prefill(step: Callable) -> Callable:  # dynamic: one compilation serves every prompt length
    return torch.compile(step, dynamic=True, fullgraph=True)


@dataclass(frozen=True)
class Steps:
    """The step functions every loop calls (plain, guided, speculative, tree), compiled or not, built once by
    build_steps and passed to the loop."""
    prefill: Callable = prefill
    decode: Callable = decode_one_token
    prefill_logits: Callable = decode_logits  # guided decoding: logits first, then the masked pick
    logits: Callable = decode_logits
    pick: Callable = pick
    draft: Callable = draft_step  # speculation with a draft model
    verify: Callable = verify
    tree: Callable = tree_probs  # token trees
    draft_tree: Callable = draft_probs
    loop: Optional[Callable] = None  # the whole plain decode loop in one call where it can (cpu_greedy_loop)


def cpu_or(compiled: Callable) -> Callable:
    """decode_one_token as one C++ call (cpu_step.py) where it runs a batch-1 step exactly; else compiled."""
    import cpu_step  # only where a compiled step was asked for: it needs the CPU kernels
    def decode(model, cur, input_pos, left_pad, kv_len, **sampling):  # cur [B, 1], input_pos [1] -> [B]
        cpu = cpu_step.step(model, input_pos) if cur.shape == (1, 1) and left_pad is None and \
            cur.device.type == "cpu" else None
        if cpu is None:
            return compiled(model, cur, input_pos, left_pad, kv_len, **sampling)
        if sampling.get("temperature", 0.0) == 0:  # the argmax in C++ too: it saves torch's ops on the logits
            return torch.tensor([cpu.greedy(cur, input_pos)])
        return sample(cpu(cur, input_pos), **sampling)
    return decode


def cpu_greedy_loop(model, out, pos: int, left_pad, eos, **sampling) -> Optional[int]:  # out [B, N]
    """decode_n_tokens as one C++ call where cpu_or's decode would run the C++ step and its greedy pick for every
    token: the columns filled, or None, and generate runs decode_n_tokens instead."""
    import cpu_step
    if out.shape[0] != 1 or left_pad is not None or out.device.type != "cpu" or sampling.get("temperature", 0.0) != 0:
        return None
    first = int(out[0, 0])
    cpu = cpu_step.step_for(model)
    if cpu is None or first == NOT_FINITE or (eos is not None and first in eos.tolist()):
        return None  # (a damaged model, or an answer that ended at once: decode_n_tokens says so)
    filled = 1 + cpu.greedy_loop(first, pos, out[0, 1:], eos)
    check_finite(out[:, :filled], filled - 1)
    return filled


def build_steps(compile: bool = False, compile_prefill_too: bool = False) -> Steps:
    """Every step, compiled if asked (lazily); compiled, a CPU model's batch-1 prefill and decoding run in C++."""
    step = compile_step if compile else (lambda f: f)
    first = compile_prefill if compile_prefill_too else (lambda f: f)
    import cpu_step  # prefill and verify passes on its rows where it decodes: they compute what decoding does
    rows = (lambda f: cpu_step.verify_or(step(f), f)) if compile else step
    pre = (lambda f: cpu_step.prefill_or(first(f), f)) if compile else first
    return Steps(pre(prefill), cpu_or(step(decode_one_token)) if compile else decode_one_token,
                 first(decode_logits), step(decode_logits), step(pick), step(draft_step), rows(verify),
                 rows(tree_probs), step(draft_probs), cpu_greedy_loop if compile else None)


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


def decode_n_tokens(model, decode: Callable, out, pos: int, left_pad, eos, callback: Optional[Callable],
                    stop: Optional[Callable] = None, **sampling) -> int:
    """Fill out[:, 1:] one token per step (out[:, 0] holds prefill's token, at cache slot pos). eos [E] holds the
    end-of-sequence ids; stop(row) -> the tokens to keep, fewer than len(row) once a stop string shows.
    Returns the number of columns filled."""
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
        kv_len = kv_bucket(pos + i, model.max_seq_length)
        cur = out[:, i - 1 : i].clamp(min=0)  # a valid id even after NOT_FINITE; the check above stops the loop
        nxt = decode(model, cur, input_pos, left_pad, kv_len, **sampling)
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
             callback: Optional[Callable] = None, pad_id: int = 0, steps: Steps = Steps(),
             stop: Optional[Callable] = None, cached: int = 0, guide=None, **sampling) -> Generation:
    """Greedy or sampled continuations of a batch of token-id prompts of any lengths (left-padded). A row ends
    at any of eos_ids, or where stop(row) (see stop_strings) cuts it. callback, if given, sees the first row's new
    tokens after every step. cached: the KV cache already holds the first `cached` tokens of the (one) prompt,
    from an earlier call, so prefill computes only the rest (a chat's earlier turns). guide (a guided.Guide): each
    row's output matches its grammar (see guided.generate_guided)."""
    device = model.tok_embeddings.weight.device
    B, T = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a prompt is empty")
    if cached and (B > 1 or not 0 <= cached < T or model.max_seq_length < T + max_new_tokens):
        raise ValueError("cached tokens need one prompt longer than them, in a cache set up to hold it all")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if T + max_new_tokens > model.args.block_size:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum "
                         f"sequence length {model.args.block_size}")
    if model.max_batch_size < B or model.max_seq_length < T + max_new_tokens:
        model.setup_caches(B, T + max_new_tokens)
    idx = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        idx[row, T - len(p):] = torch.tensor(p, device=device)
    left_pad = None
    if any(len(p) < T for p in prompts):
        left_pad = torch.tensor([T - len(p) for p in prompts], device=device)
    if guide is not None:
        rows, prefill_s, decode_s, forwards, incomplete = guided.generate_guided(
            model, idx, left_pad, cached, max_new_tokens, eos_ids, callback, steps, stop, guide, device_sync,
            not_finite, **sampling)
        return Generation([cut(r, eos_ids, stop) for r in rows], B * (T - cached), prefill_s, decode_s,
                          sum(map(len, rows)) - B, forwards, peak_memory_gb(device), forced=guide.forced,
                          incomplete=incomplete)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    eos = torch.tensor(list(eos_ids), device=device) if eos_ids else None  # [E]

    device_sync(device)
    t0 = time.perf_counter()
    out[:, 0] = steps.prefill(model, idx[:, cached:], torch.arange(cached, T, device=device), left_pad,
                              kv_bucket(T, model.max_seq_length), **sampling)
    if callback is not None:
        stream(callback, out[0, :1].tolist())
    device_sync(device)
    t1 = time.perf_counter()
    # the loop in one call where it can, and where nothing needs the host between tokens
    can_loop = steps.loop is not None and callback is None and stop is None
    filled = steps.loop(model, out, T, left_pad, eos, **sampling) if can_loop else None
    if filled is None:
        filled = decode_n_tokens(model, steps.decode, out, T, left_pad, eos, callback, stop, **sampling)
    device_sync(device)
    t2 = time.perf_counter()

    rows = [cut(r, eos_ids, stop) for r in out[:, :filled].tolist()]
    return Generation(rows, B * (T - cached), t1 - t0, t2 - t1, B * (filled - 1), filled - 1, peak_memory_gb(device))


def cut(row: list[int], eos_ids, stop: Optional[Callable]) -> list[int]:
    """The row up to (not including) its first end-of-sequence id, and up to the token ending a stop string."""
    end = next((i for i, t in enumerate(row) if t in (eos_ids or ())), len(row))
    return row[: stop(row[:end]) if stop else end]


# ---- the command line: load, generate, print the text and the figures ----------------------------------------------

def plain_loop(model, *, max_new_tokens: int, guide=None, steps: Steps = Steps(), parallel=None,
               **sampling) -> Callable:  # loop(prompts, eos_ids, callback, stop, cached) -> Generation; see make_loop
    return lambda prompts, eos_ids=None, callback=None, stop=None, cached=0: generate(
        model, prompts, max_new_tokens, eos_ids, callback, steps=steps, stop=stop, cached=cached, guide=guide,
        **sampling)


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
    prompts, encoded = prompts * (batch_size // len(prompts)), encoded * (batch_size // len(prompts))
    threads = cli.set_threads(threads, parallel.world if parallel else 1) if dev.type == "cpu" else None
    model = (parallel.load_model if parallel else checkpoint.load_model)(checkpoint_path, dev, dt, cpu_kernels)
    model.setup_caches(batch_size, max_seq_length, KV_DTYPES[kv_cache_dtype])
    model_bytes = weight_bytes(model) if not parallel else int(parallel.sum([weight_bytes(model)])[0])
    where = f"{parallel.world} ranks, {dev.type}" if parallel else dev
    print(f"Loaded {checkpoint_path} ({model_bytes / 1e9:.3f} GB of weights read per step) on {where}"
          f"{f' ({threads} threads)' if threads else ''}, {dtype}{cli.kernels_of(model, dev)}"
          f"{'; KV cache int8' if kv_cache_dtype == 'int8' else ''}")

    loop = make_loop(model, max_new_tokens=max_new_tokens, guide=guide, steps=build_steps(compile, compile_prefill),
                     parallel=parallel, **sampling)
    torch.manual_seed(seed)
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
                      stop_at)
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
