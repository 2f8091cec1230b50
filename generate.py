"""Generate text: prefill the static KV cache with the prompt, then decode one token per step.
The decode step is small and shape-static within a cache-length bucket, so torch.compile (mode="reduce-overhead")
turns it into a CUDA graph that replays every step; on a CPU, into C++ kernels called from a C++ wrapper, or for a
batch of one, cpu_step.py's step: the whole forward as one C++ call."""
import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

import checkpoint
import cli
import cpu_gemv
import cpu_step
import cuda_gemv
import guided
from checkpoint import load_model
from guided import Guide, allowed_tokens
from model import Transformer, kv_bucket
from tokenizer import Tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "stdlib-target"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
                      f"dtype overflow; try --dtype float32")


def check_finite(tokens, step: int):  # tokens [B, S]; a host sync, so only every few steps
    if bool((tokens == NOT_FINITE).any()):
        raise not_finite(step)


def draw(probs):  # [B, V] -> [B]
    # argmax(p / Exp(1)) is an exact draw from p that, unlike torch.multinomial, never syncs with the host
    q = torch.empty_like(probs).exponential_(1).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / q).argmax(-1)


# ---- the steps -----------------------------------------------------------------------------------------------------

def prefill(model, idx, input_pos, left_pad, kv_len, **sampling):  # idx [B, S], input_pos [S], left_pad [B]|None -> [B]
    return sample(model(idx, input_pos, left_pad, kv_len, last=True)[:, -1], **sampling)


def decode_one_token(model, cur, input_pos, left_pad, kv_len, **sampling):  # cur [B, 1], input_pos [1] -> [B]
    return sample(model(cur, input_pos, left_pad, kv_len)[:, -1], **sampling)


def decode_logits(model, idx, input_pos, left_pad, kv_len):  # idx [B, S], input_pos [S] -> [B, V]
    """The last position's logits: guided decoding samples only once the grammar's mask is ready."""
    return model(idx, input_pos, left_pad, kv_len, last=True)[:, -1]


def pick(logits, bits, **sampling):  # logits [B, V], bits [B, W] int32 (a grammar's bitmask) -> [B]
    return sample(logits, allowed=allowed_tokens(bits, logits.size(-1)), **sampling)


# What a compiled step costs before its first kernel runs, paid every step, and on a CPU nothing hides it (on
# SmolLM2-135M, 30 layers, it was ~1 ms of a 4 ms step):
# - guards: each step re-checks the model's ~500 tensors; with recursive dict tags, a module none of whose
#   attributes was reassigned since the compile passes in one check (tensors changed in place are assumed to keep
#   their dtype, shape and device, as torch's default tag check already assumes);
# - floats: unspecialized, each RMSNorm's eps became a tensor built from a Python float every step; as constants
#   they cost nothing (a new temperature compiles the step again, as a new eps would).
torch._dynamo.config.use_recursive_dict_tags_for_guards = True
torch._dynamo.config.specialize_float = True


def compile_step(step: Callable) -> Callable:
    """Compile a decode step whole (no graph breaks), as CUDA graphs on a GPU ("reduce-overhead"). dynamic: one
    compilation serves every cache length kv_bucket picks and every verify length; a CUDA graph is still recorded
    per length, a handful in all. Without a GPU, inductor's C++ wrapper calls the step's kernels: its Python one
    cost ~1 ms a step, while the other core waits (3-4% of int4 decoding on TinyLlama's shape). Kernels and wrapper
    build apart, so the first compile takes no longer (as one file it took twice as long). The size checks inside
    the step go: they built a string stream per tensor checked, every step. Inductor's own kernels run on one
    thread below 16384 elements a thread: a batch-1 step's norms, RoPE and SiLU are a few thousand values, and
    split across the threads each was one or two parallel regions (~130 a TinyLlama step) for a microsecond of
    work (2 cores, Zen 3, alternating in one process: int4 decode 1.005-1.06x in three runs, int8 1.08x, bf16
    1.005x, batch 8 1.00x)."""
    on_cpu = torch.compile(step, fullgraph=True, dynamic=True,
                           options={"cpp_wrapper": True, "cpp_wrapper_build_separate": True,
                                    "size_asserts": False, "alignment_asserts": False,
                                    "cpp.min_chunk_size": 16384})
    if not torch.cuda.is_available():
        return on_cpu
    # tunes the reductions inductor writes itself: the norms, and any batch-1 matmul not on cuda_gemv.py's kernels
    # (inductor writes those as a reduction, an int8 weight's conversion to bf16 inside it)
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
    """The step functions a loop calls, compiled or not. Built once and passed to the loop, so every loop (plain
    or speculative) runs what was asked for; rebinding module globals would miss a loop that imported a name."""
    prefill: Callable = prefill
    decode: Callable = decode_one_token
    prefill_logits: Callable = decode_logits  # guided decoding: logits first, then the masked pick
    logits: Callable = decode_logits
    pick: Callable = pick
    loop: Optional[Callable] = None  # the whole decode loop in one call where it can (cpu_greedy_loop), else None


def cpu_or(compiled: Callable) -> Callable:
    """decode_one_token as one C++ call (cpu_step.py) for a batch-1 step of a CPU model that step runs exactly
    (without torch.compile's fixed cost per step, see there); anything else through compiled."""
    def decode(model, cur, input_pos, left_pad, kv_len, **sampling):  # cur [B, 1], input_pos [1] -> [B]
        cpu = cpu_step.step(model, input_pos) if cur.shape == (1, 1) and left_pad is None and \
            cur.device.type == "cpu" else None
        if cpu is None:
            return compiled(model, cur, input_pos, left_pad, kv_len, **sampling)
        if sampling.get("temperature", 0.0) == 0:  # the argmax in C++ too: torch's ops on the logits took ~0.2 ms
            return torch.tensor([cpu.greedy(cur, input_pos)])
        return sample(cpu(cur, input_pos), **sampling)

    return decode


def cpu_greedy_loop(model, out, pos: int, left_pad, eos, **sampling) -> Optional[int]:  # out [B, N]
    """decode_n_tokens as one C++ call (cpu_step.decode_greedy) where cpu_or's decode would run the C++ step and its
    greedy pick for every token; the columns filled, or None: generate runs decode_n_tokens instead."""
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
    step = compile_step if compile else (lambda f: f)  # torch.compile is lazy: unused steps cost nothing
    first = compile_prefill if compile_prefill_too else (lambda f: f)
    decode = cpu_or(step(decode_one_token)) if compile else decode_one_token
    return Steps(first(prefill), decode, first(decode_logits), step(decode_logits), step(pick),
                 cpu_greedy_loop if compile else None)


# ---- the loop ------------------------------------------------------------------------------------------------------

@dataclass
class Generation:
    """What a generation returns, plain or speculative: each row's new tokens (cut before EOS) and the figures.
    One type for both loops, so --metrics_json has one schema."""
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
                "accept_histogram": self.accept_histogram,
                "forced_tokens": self.forced,
                "tree_sizes": self.tree_sizes}


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


def device_sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# inference_mode rather than no_grad: tensors made inside skip autograd's bookkeeping altogether, and the custom
# ops its fallback: 0.2-0.35 ms a step, 0.97-0.99x the time of SmolLM2-135M's int4 step (Zen 3)
@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_ids=None,
             callback: Optional[Callable] = None, pad_id: int = 0, steps: Steps = Steps(),
             stop: Optional[Callable] = None, cached: int = 0, guide: Optional[Guide] = None,
             **sampling) -> Generation:
    """Greedy or sampled continuations of a batch of token-id prompts of any lengths (left-padded). A row ends
    at any of eos_ids, or where stop(row) (see stop_strings) cuts it. callback, if given, sees the first row's new
    tokens after every step. cached: the KV cache already holds the first `cached` tokens of the (one) prompt,
    from an earlier call, so prefill computes only the rest (a chat's earlier turns). guide: each row's output
    matches its grammar (see generate_guided)."""
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
        return generate_guided(model, idx, left_pad, cached, max_new_tokens, eos_ids, callback, steps, stop, guide,
                               **sampling)
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


def generate_guided(model: Transformer, idx, left_pad, cached: int, max_new_tokens: int, eos_ids, callback,
                    steps: Steps, stop: Optional[Callable], guide: Guide, **sampling) -> Generation:
    """generate() under grammars (idx [B, T], left-padded). Each step the host needs the sampled tokens to advance
    the matchers: that is the step's one sync. The next mask is computed on a CPU thread while the forward pass
    runs, and is applied on the device in `pick`. At batch 1 the tokens the grammar forces are fed in one forward
    pass with the sampled one (fast-forward). A row ends at EOS, at a stop string, or once its grammar is
    complete."""
    device, (B, T) = idx.device, idx.shape
    eos, fill = set(eos_ids or ()), (list(eos_ids or ()) or [0])[0]
    slots = torch.arange(T + max_new_tokens, device=device)  # positions are slices of this: no allocation
    bits = torch.empty(B, guide.words, dtype=torch.int32, device=device)

    def upload(mask) -> torch.Tensor:  # the host bitmask, on the device (non_blocking: it is pinned)
        return mask.result() if device.type == "cpu" else bits.copy_(mask.result(), non_blocking=True)

    guide.reset()
    rows, done, forwards = [[] for _ in range(B)], [False] * B, 0
    device_sync(device)
    t0 = time.perf_counter()
    mask = guide.fill_async()
    logits = steps.prefill_logits(model, idx[:, cached:], slots[cached:T], left_pad, kv_bucket(T, model.max_seq_length))
    tokens = steps.pick(logits, upload(mask), **sampling).tolist()
    t1 = time.perf_counter()
    pos = T
    while True:
        for b, t in enumerate(tokens):
            if done[b]:
                continue
            if t == NOT_FINITE:
                raise not_finite(len(rows[b]))
            rows[b].append(t)
            if t not in eos:
                guide.consume(b, t)
            done[b] = t in eos or guide.complete(b) or len(rows[b]) >= max_new_tokens or \
                stop is not None and stop(rows[b]) < len(rows[b])
        feed = [[fill if d else t] for t, d in zip(tokens, done)]
        if B == 1 and not done[0]:  # forced tokens go in with the sampled one; batch rows would need own positions
            forced = guide.fast_forward(0, max_new_tokens - len(rows[0]))
            rows[0] += forced
            feed[0] += forced
            done[0] = guide.complete(0) or len(rows[0]) >= max_new_tokens
        if callback is not None:
            stream(callback, rows[0])
        if all(done):
            break
        S = len(feed[0])
        mask = guide.fill_async(done)  # on the CPU thread, while the forward pass runs
        logits = steps.logits(model, torch.tensor(feed, device=device), slots[pos : pos + S], left_pad,
                              kv_bucket(pos + S, model.max_seq_length))
        tokens = steps.pick(logits, upload(mask), **sampling).tolist()
        pos, forwards = pos + S, forwards + 1
    device_sync(device)
    t2 = time.perf_counter()
    incomplete = [b for b, r in enumerate(rows)
                  if len(r) >= max_new_tokens and not eos & set(r) and guide.incomplete(b)]
    return Generation([cut(r, eos_ids, stop) for r in rows], B * (T - cached), t1 - t0, t2 - t1,
                      sum(map(len, rows)) - B, forwards, peak_memory_gb(device), forced=guide.forced,
                      incomplete=incomplete)


def cut(row: list[int], eos_ids, stop: Optional[Callable]) -> list[int]:
    """The row up to (not including) its first end-of-sequence id, and up to the token ending a stop string."""
    end = next((i for i, t in enumerate(row) if t in (eos_ids or ())), len(row))
    return row[: stop(row[:end]) if stop else end]


def stop_strings(tokenizer: Tokenizer, strings: list[str]) -> Optional[Callable]:
    """stop(row) -> how many of the row's tokens to keep: through the token that completes the first of the stop
    strings in the row's text, or all of them. The text is cut before the string later (cut_text)."""
    if not strings:
        return None

    def stop(row: list[int]) -> int:
        if not any(s in tokenizer.decode(row) for s in strings):
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


# ---- command line ------------------------------------------------------------------------------------------------

def weight_bytes(model: Transformer) -> int:
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


def make_streamer(tokenizer: Tokenizer, prompt: list[int]) -> Callable:
    """Print the text as it grows. Decoding the whole sequence each time keeps SentencePiece's spaces right."""
    shown = len(tokenizer.decode(prompt))

    def stream(tokens: list[int]):  # syncs with the device every step, so only used on a terminal
        nonlocal shown
        text = tokenizer.decode(prompt + tokens)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[shown:], end="", flush=True)
            shown = len(text)
    return stream




def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--prompt", action="append", help="prompt text, or - to read it from standard input; repeat "
                   "the flag for a batch of prompts (default: 'def fibonacci(n):')")
    p.add_argument("--prompt_file", type=Path, action="append", metavar="PATH", help="read a prompt from this "
                   "UTF-8 text file; may be repeated, and combined with --prompt")
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT,
                   help="checkpoint directory: model.safetensors, config.json, tokenizer.model "
                   "(default: the built-in model trained on the Python standard library)")
    p.add_argument("--max_new_tokens", type=cli.positive_int, default=200, help="tokens to generate per row")
    p.add_argument("--num_samples", type=cli.positive_int, default=1, help="how many times to generate (each "
                   "timed separately)")
    p.add_argument("--batch_size", type=cli.positive_int, help="rows per batch: a single prompt is repeated this "
                   "many times (default: the number of prompts)")
    p.add_argument("--temperature", type=cli.finite_float, default=0.8, help="0 is greedy (exact argmax)")
    p.add_argument("--top_k", type=cli.positive_int, default=200, help="sample only among the k most likely "
                   "tokens")
    p.add_argument("--top_p", type=cli.finite_float, default=1.0, help="sample only among the most likely tokens "
                   "that hold this much probability mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=1234, help="random seed, for reproducible sampling")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weight and activation dtype")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--cpu_kernels", default="auto", choices=["auto", "off"], help="auto: this CPU's decode "
                   "kernels (cpu_gemv.py) and the prefill dtype measured faster here; off: torch's own kernels")
    p.add_argument("--compile", action="store_true", help='compile the decode step (fullgraph): CUDA graphs on a GPU '
                   '(mode="reduce-overhead"); on a CPU, batch-1 decoding as one C++ call on the kernels '
                   '(cpu_step.py), anything else through a C++ wrapper; the compile time is reported apart')
    p.add_argument("--compile_prefill", action="store_true", help="compile prefill, with dynamic shapes "
                   "(one compilation serves every prompt length)")
    p.add_argument("--max_seq_length", type=cli.positive_int, help="KV cache length (default: longest prompt + "
                   "max_new_tokens)")
    add_kv_cache_option(p)
    p.add_argument("--profile", type=Path, metavar="PATH", help="write a torch.profiler trace of the last sample "
                   "to PATH (Chrome trace JSON)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template, as a user "
                   "turn, and print only the answer")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the prompt")
    p.add_argument("--stop", action="append", metavar="STRING", help="end a row where its text first contains "
                   "STRING (not printed); may be repeated")
    p.add_argument("--ignore_eos", action="store_true", help="keep generating past the end-of-sequence tokens")
    add_guided_options(p)
    p.add_argument("--metrics_json", type=Path, metavar="PATH", help="write the speed figures and the samples "
                   "as JSON (averaged over the samples after the first)")
    return cli.one_line_errors(p)


def add_kv_cache_option(p: argparse.ArgumentParser):
    p.add_argument("--kv_cache_dtype", default="auto", choices=["auto", "int8"], help="auto: the model's dtype; "
                   "int8: about half the memory, keys rounded to int8 with a scale per position and head, values with one per "
                   "32 (on x86 CPUs decode attention reads it as it is; elsewhere it is dequantized every step)")


KV_DTYPES = {"auto": None, "int8": torch.int8}


def add_guided_options(p: argparse.ArgumentParser):
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
    prompts += [cli.check_text_file(f, "--prompt_file").read_text(encoding="utf-8") for f in args.prompt_file or []]
    for s in prompts:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: bytes that were not UTF-8 in the shell's argument
            raise ValueError("the prompt is not valid UTF-8 text") from None
        if not s.strip():
            raise ValueError("the prompt is empty")
    return prompts or ["def fibonacci(n):"]


def parse_args(argv=None, p: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    p = p or parser()
    args = p.parse_args(argv)
    checks = [(args.temperature >= 0, "--temperature must be >= 0"),
              (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
              (args.system is None or args.chat, "--system needs --chat"),
              (all(args.stop or ()), "--stop needs a non-empty string")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    cli.check_output_file(args.metrics_json, "--metrics_json", '"ttft_ms"')
    cli.check_output_file(args.profile, "--profile", '"traceEvents"')
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


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool = False, system: Optional[str] = None) -> list[int]:
    """Plain text with BOS, or a user turn (after a system one) in the model's chat template, whose special
    tokens become their ids."""
    if not chat:
        return tokenizer.encode(text, bos=True)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), bos=False, specials=True)


def print_summary(m: dict):
    print(f"Time to first token: {m['ttft_ms']:.1f} ms | decode: {m['decode_tokens_per_sec']:.2f} tokens/sec | "
          f"overall: {m['tokens_per_sec']:.2f} tokens/sec | total: {m['total_s']:.2f} s")
    per_rank = m.get("peak_memory_gb_per_rank")
    memory = " / ".join(f"{x:.2f}" for x in per_rank) + " GB per rank" if per_rank else f"{m['peak_memory_gb']:.2f} GB"
    print(f"Bandwidth achieved: {m['bandwidth_gb_s']:.2f} GB/s | peak memory: {memory}")
    if m["accept_histogram"] is not None:
        print(f"Speculative: {m['target_forwards']} target forwards | mean drafted / accepted per verify: "
              f"{m['mean_drafted']:.2f} / {m['mean_accepted']:.2f} | acceptance rate: {m['acceptance_rate']:.1%}")
        print(f"Accepted proposals per verify (histogram, 0..k): {m['accept_histogram']}")
    if m.get("tree_sizes"):
        print("Tree size per verify, chosen by measured cost (nodes: passes): "
              + ", ".join(f"{n}: {c}" for n, c in m["tree_sizes"].items()))
    if m["forced_tokens"] is not None:
        print(f"Guided: {m['forced_tokens']:.0f} new tokens forced by the grammar (fed by fast-forward), "
              f"{m['target_forwards']:.0f} forward passes")


def plain_loop(args, model: Transformer, prompts: list[list[int]], parallel=None, guide: Optional[Guide] = None,
               **sampling) -> Callable:
    """The loop run() times: (eos_ids, callback, stop, cached, prompts) -> Generation; chat.py passes each
    turn's prompt and how much of it the cache already holds."""
    steps = build_steps(args.compile, args.compile_prefill)
    return lambda eos_ids, callback, stop=None, cached=0, prompts=prompts: generate(
        model, prompts, args.max_new_tokens, eos_ids, callback, steps=steps, stop=stop, cached=cached, guide=guide,
        **sampling)


def print_texts(prompts: list[str], texts: list[str]):
    if len(texts) == 1:
        print(prompts[0] + texts[0])
    for row, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(texts) > 1:
            print(f"--- prompt {row + 1} of {len(texts)} ---\n{prompt}{text}")


def make_guide(args, tokenizer: Tokenizer, vocab_size: int) -> Optional[Guide]:
    """The matchers for --json_schema, --json, --regex and --grammar, or None."""
    if not args.guides:
        return None
    return Guide(tokenizer, args.guides, args.batch_size, vocab_size, getattr(args, "speculate_k", 0))


def run(args, make_loop: Callable = plain_loop, parallel=None):
    """Load, generate --num_samples times, print the text and the figures. make_loop builds the loop from the
    loaded model (speculative.py passes its own); parallel, from tp.py, holds the rank's device, a sharded loader
    and the collectives that sum figures over the ranks."""
    device, dtype = parallel.device if parallel else resolve_device(args.device), DTYPES[args.dtype]
    config = checkpoint.plan(args.checkpoint_path, device, dtype)
    tokenizer = checkpoint.load_tokenizer(args.checkpoint_path, config)
    encoded = [encode_prompt(tokenizer, s, args.chat, args.system) for s in args.prompt]
    guide = make_guide(args, tokenizer, config.vocab_size)  # before the weights: a bad grammar fails fast
    T = max(len(p) for p in encoded)
    if args.max_seq_length and args.max_seq_length > config.block_size:
        raise ValueError(f"--max_seq_length {args.max_seq_length} exceeds the model's block_size {config.block_size}")
    max_seq_length = args.max_seq_length or min(T + args.max_new_tokens, config.block_size)
    if T + args.max_new_tokens > min(max_seq_length, config.block_size):
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the maximum "
                         f"sequence length {min(max_seq_length, config.block_size)}")
    checkpoint.plan(args.checkpoint_path, device, dtype, args.batch_size, max_seq_length, T,
                    parallel.world if parallel else 1, args.kv_cache_dtype == "int8")  # before anything is allocated
    if len(args.prompt) < args.batch_size:  # one prompt, repeated
        args.prompt, encoded = args.prompt * args.batch_size, encoded * args.batch_size
    prompts = encoded
    if device.type == "cpu":  # after the checks: a warning would only stand in front of their one line
        cli.set_threads(args.threads, parallel.world if parallel else 1)
    model = (parallel.load_model if parallel else load_model)(args.checkpoint_path, device, dtype, args.cpu_kernels)
    model.setup_caches(args.batch_size, max_seq_length, KV_DTYPES[args.kv_cache_dtype])
    model_bytes = weight_bytes(model)
    if parallel:
        model_bytes = int(parallel.sum([model_bytes])[0])  # read per step by all ranks together
    where = f"{parallel.world} ranks, {device.type}" if parallel else device
    kernels = f"; {cpu_gemv.describe(model)}" if device.type == "cpu" else \
        f"; {cuda_gemv.describe(model)}" if device.type == "cuda" else ""
    print(f"Loaded {args.checkpoint_path} ({model_bytes / 1e9:.3f} GB of weights read per step) on {where}, "
          f"{args.dtype}{kernels}{'; KV cache int8' if args.kv_cache_dtype == 'int8' else ''}")

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    loop = make_loop(args, model, prompts, parallel, guide=guide, **sampling)
    torch.manual_seed(args.seed)
    compile_s = 0.0
    if args.compile or args.compile_prefill:
        t0 = time.perf_counter()  # one untimed run triggers compilation and CUDA-graph capture
        loop(None, None)
        compile_s = time.perf_counter() - t0
        print(f"Compilation time: {compile_s:.2f} s")

    eos_ids, stop = None if args.ignore_eos else tokenizer.eos_ids, stop_strings(tokenizer, args.stop)
    shown = [""] * len(args.prompt) if args.chat else args.prompt  # a chat prints the answer alone
    stream = args.batch_size == 1 and sys.stdout.isatty() and not args.stop  # a stop string shows only at the end
    results, samples = [], []
    for i in range(args.num_samples):
        profile = args.profile is not None and i == args.num_samples - 1
        prof = torch.profiler.profile() if profile else None
        if prof is not None:
            prof.__enter__()
        if stream:
            print(shown[0], end="", flush=True)
        result = loop(eos_ids, make_streamer(tokenizer, prompts[0]) if stream else None, stop)
        if prof is not None:
            prof.__exit__(None, None, None)
            cli.write_file(args.profile, lambda tmp: prof.export_chrome_trace(str(tmp)))
        texts = [cut_text(tokenizer.decode(p + r)[len(tokenizer.decode(p)):], args.stop)
                 for p, r in zip(prompts, result.rows)]
        print() if stream else print_texts(shown, texts)
        samples += [{"text": t, "tokens": r} for t, r in zip(texts, result.rows)]
        figures = result.metrics(model_bytes)
        if parallel:
            figures["peak_memory_gb_per_rank"] = parallel.gather(figures["peak_memory_gb"])
        results.append(figures)
        for row in result.incomplete:
            print(f"warning: {f'row {row + 1}' if len(texts) > 1 else 'the output'} reached --max_new_tokens before "
                  f"its grammar was complete; raise --max_new_tokens", file=sys.stderr)
        print(f"Sample {i + 1}/{args.num_samples}: {args.batch_size} x {max(len(r) for r in result.rows)} new tokens")
        print_summary(figures)
    if args.metrics_json and (not parallel or parallel.rank == 0):
        kept = results[1:] or results  # the first sample warms caches and allocators
        metrics = {k: sum(r[k] for r in kept) / len(kept) if isinstance(v, (int, float)) else kept[-1][k]
                   for k, v in results[0].items()}
        metrics.update(compile_s=compile_s, samples=samples)
        cli.write_file(args.metrics_json, lambda tmp: tmp.write_text(json.dumps(metrics, indent=2)))


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    cli.run_main(main)
