"""Generate text: prefill the static KV cache with the prompt, then decode one token per step.
The decode step is small and shape-static within a cache-length bucket, so torch.compile (mode="reduce-overhead")
turns it into a CUDA graph that replays every step."""
import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

import tp
from model import ModelArgs, Transformer, kv_bucket
from tokenizer import Tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "stdlib-target"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- loading -----------------------------------------------------------------------------------------------------

def checkpoint_files(checkpoint_path) -> tuple[Path, Path]:
    """The checkpoint's directory and weights file; a ValueError naming what is wrong if it is not one."""
    path = Path(checkpoint_path)
    if not path.exists():
        raise ValueError(f"checkpoint not found: {path}")
    ckpt_dir = path if path.is_dir() else path.parent
    if path.is_dir() and not any(path.iterdir()):
        raise ValueError(f"checkpoint directory is empty: {path}")
    weights = path if path.is_file() else next((ckpt_dir / n for n in ("model.safetensors", "model.pth")
                                                if (ckpt_dir / n).is_file()), None)
    if weights is None or weights.suffix not in (".safetensors", ".pth"):
        raise ValueError(f"not a checkpoint: {path} has no model.safetensors (see scripts/convert_hf_checkpoint.py)")
    if not (ckpt_dir / "config.json").is_file():
        raise ValueError(f"not a checkpoint: {ckpt_dir} has no config.json")
    return ckpt_dir, weights


def load_args(ckpt_dir: Path) -> ModelArgs:
    try:
        return ModelArgs(**json.loads((ckpt_dir / "config.json").read_text()))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{ckpt_dir / 'config.json'} is not a model config: {str(e).splitlines()[0]}") from None


def read_weights(weights: Path, device, dtype) -> dict:
    """Tensors straight from the mmap'd file to the device, one at a time: no second full copy in RAM."""
    cast = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    try:
        if weights.suffix == ".pth":  # never unpickle arbitrary objects
            return {k: cast(t) for k, t in torch.load(weights, mmap=True, weights_only=True).items()}
        with safe_open(weights, framework="pt", device="cpu") as f:
            return {k: cast(f.get_tensor(k)) for k in f.keys()}
    except Exception as e:  # safetensors and torch.load raise many types for truncated or foreign files
        raise ValueError(f"cannot read {weights} (truncated or not a weights file): {str(e).splitlines()[0]}") from None


def read_quantization(weights: Path) -> Optional[tuple[str, int]]:
    """(mode, groupsize) from a quantized checkpoint's safetensors metadata (see quantize.py); None if float."""
    if weights.suffix != ".safetensors":
        return None
    try:
        with safe_open(weights, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        raise ValueError(f"cannot read {weights} (truncated or not a weights file): {str(e).splitlines()[0]}") from None
    mode, groupsize = meta.get("quantization"), meta.get("groupsize", "0")
    if mode is None:
        return None
    if mode not in ("int8", "int4") or mode == "int4" and groupsize not in ("32", "64", "128", "256"):
        raise ValueError(f"{weights} has unknown quantization metadata: quantization={mode!r}, groupsize={groupsize!r}")
    return mode, int(groupsize)


def load_model(checkpoint_path, device="cpu", dtype=torch.bfloat16,
               shard: Optional[tuple[int, int]] = None) -> Transformer:
    """Build the model on the meta device (no memory, no init), then assign the checkpoint's tensors to it.
    shard=(rank, world size) keeps only that rank's tensor-parallel slice (tp.py)."""
    ckpt_dir, weights = checkpoint_files(checkpoint_path)
    args = load_args(ckpt_dir)
    quantization = read_quantization(weights)
    if shard:  # fail before reading anything when the model does not split evenly
        local = tp.local_args(args, shard[1], quantization[1] if quantization and quantization[0] == "int4" else None)
    model = meta_model(args, quantization)
    expected = model.state_dict()
    tied = args.tie_embeddings and not quantization  # a quantized head is stored apart from the embedding
    if tied:
        expected.pop("output.weight")
    state = read_weights(weights, "cpu" if shard else device, dtype)  # mmap'd on CPU until sharded
    what = f"config.json{' and the ' + quantization[0] + ' metadata' if quantization else ''} and {weights.name}"
    for k in sorted(expected.keys() | state.keys()):
        if k not in state or k not in expected:
            problem = "lacks" if k not in state else "has an unexpected"
            raise ValueError(f"{what} disagree: the weights {problem} tensor {k}")
        want, got = expected[k], state[k]
        if got.shape != want.shape or (got.is_floating_point() != want.is_floating_point()) or \
                (not want.is_floating_point() and got.dtype != want.dtype):
            raise ValueError(f"{what} disagree: {k} is {str(got.dtype)[6:]} {tuple(got.shape)}, "
                             f"they need {str(want.dtype)[6:]} {tuple(want.shape)}")
    if shard:
        state, model = tp.shard_state(state, args, *shard, device), meta_model(local, quantization)
    model.load_state_dict(state, assign=True, strict=False)
    if tied:  # assign replaced the shared Parameter, so tie it again
        model.output.weight = model.tok_embeddings.weight
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        import cpu_gemv
        cpu_gemv.install()  # faster bf16, int8 and int4 decode products than torch's, where they can be built
    if quantization:
        from quantize import pack_for_kernels
        pack_for_kernels(model, dtype)
    if shard:
        tp.all_reduce_outputs(model)
    return model.eval()


def meta_model(args: ModelArgs, quantization: Optional[tuple[str, int]]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
        if quantization:  # int8/int4 layers in place of nn.Linear; the file's metadata says which
            from quantize import replace_linears
            replace_linears(model, *quantization)
    return model


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


def sample(logits, temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None):  # [B, V] -> [B]
    if temperature == 0:
        return logits.argmax(-1)
    return draw(logits_to_probs(logits, temperature, top_k, top_p))


def draw(probs):  # [B, V] -> [B]
    # argmax(p / Exp(1)) is an exact draw from p that, unlike torch.multinomial, never syncs with the host
    q = torch.empty_like(probs).exponential_(1).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / q).argmax(-1)


# ---- decoding ----------------------------------------------------------------------------------------------------

def prefill(model, idx, input_pos, left_pad, kv_len, **sampling):  # idx [B, S], input_pos [S], left_pad [B]|None -> [B]
    return sample(model(idx, input_pos, left_pad, kv_len)[:, -1], **sampling)


def decode_one_token(model, cur, input_pos, left_pad, kv_len, **sampling):  # cur [B, 1], input_pos [1] -> [B]
    return sample(model(cur, input_pos, left_pad, kv_len)[:, -1], **sampling)


def compile_step(step: Callable) -> Callable:
    """Compile a decode step whole (no graph breaks), as CUDA graphs on a GPU ("reduce-overhead"). dynamic: one
    compilation serves every cache length kv_bucket picks and every verify length; a CUDA graph is still recorded
    per length, a handful in all."""
    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=True)


STOP_CHECK_EVERY = 8  # rows finish at EOS on the device; the host looks only every few steps, as each look syncs


def decode_n_tokens(model, out, pos: int, left_pad, eos_id: Optional[int], callback: Optional[Callable],
                    **sampling) -> int:
    """Fill out[:, 1:] one token per step (out[:, 0] holds prefill's token, at cache slot pos).
    Returns the number of columns filled."""
    input_pos = torch.tensor([pos], device=out.device)  # the host counts too, to choose how much cache to read
    done = out[:, 0] == eos_id if eos_id is not None else None  # [B]
    for i in range(1, out.size(1)):
        if done is not None and i % STOP_CHECK_EVERY == 0 and bool(done.all()):
            return i
        kv_len = kv_bucket(pos + i, model.max_seq_length)
        nxt = decode_one_token(model, out[:, i - 1 : i], input_pos, left_pad, kv_len, **sampling)
        input_pos += 1  # in place: the compiled step reads the same tensor every time
        if done is not None:  # a finished row keeps emitting EOS, so shapes stay fixed
            nxt = torch.where(done, eos_id, nxt)
            done |= nxt == eos_id
        out[:, i] = nxt  # preallocated: no allocation, and nxt's CUDA-graph buffer is free for the next step
        if callback is not None:
            callback(out[:, : i + 1])
    return out.size(1)


def device_sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: Optional[int] = None,
             callback: Optional[Callable] = None, pad_id: int = 0, **sampling):
    """Greedy or sampled continuations of a batch of token-id prompts of any lengths (left-padded).
    Returns the new tokens of each row (cut before its EOS) and timings."""
    device = model.tok_embeddings.weight.device
    B, T = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if T + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum "
                         f"sequence length {model.args.max_seq_len}")
    if model.max_batch_size < B or model.max_seq_length < T + max_new_tokens:
        model.setup_caches(B, T + max_new_tokens)
    idx = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        idx[row, T - len(p):] = torch.tensor(p, device=device)
    left_pad = None
    if any(len(p) < T for p in prompts):
        left_pad = torch.tensor([T - len(p) for p in prompts], device=device)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)

    device_sync(device)
    t0 = time.perf_counter()
    out[:, 0] = prefill(model, idx, torch.arange(T, device=device), left_pad, kv_bucket(T, model.max_seq_length),
                        **sampling)
    if callback is not None:
        callback(out[:, :1])
    device_sync(device)
    t1 = time.perf_counter()
    steps = decode_n_tokens(model, out, T, left_pad, eos_id, callback, **sampling)
    device_sync(device)
    t2 = time.perf_counter()

    rows = out[:, :steps].tolist()
    if eos_id is not None:
        rows = [r[: r.index(eos_id)] if eos_id in r else r for r in rows]
    return rows, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps - 1, "prompt_tokens": B * T}


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

    def stream(tokens):  # tokens [1, n]: syncs with the device every step, so only used on a terminal
        nonlocal shown
        text = tokenizer.decode(prompt + tokens[0].tolist())
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[shown:], end="", flush=True)
            shown = len(text)
    return stream


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", help="prompt text; repeat the flag for a batch of prompts "
                   "(default: 'def fibonacci(n):')")
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT,
                   help="checkpoint directory: model.safetensors, config.json, tokenizer.model "
                   "(default: the built-in model trained on the Python standard library)")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per row")
    p.add_argument("--num_samples", type=int, default=1, help="how many times to generate (timed separately)")
    p.add_argument("--batch_size", type=int, help="rows per batch: a single prompt is repeated this many times "
                   "(default: the number of prompts)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (exact argmax)")
    p.add_argument("--top_k", type=int, default=200, help="sample only among the k most likely tokens")
    p.add_argument("--top_p", type=float, default=1.0, help="sample only among the most likely tokens that hold "
                   "this much probability mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=1234, help="random seed, for reproducible sampling")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weight and activation dtype")
    p.add_argument("--compile", action="store_true", help='compile the decode step (mode="reduce-overhead", '
                   "fullgraph): CUDA graphs on GPU; compile time is reported apart")
    p.add_argument("--compile_prefill", action="store_true", help="compile prefill, with dynamic shapes "
                   "(one compilation serves every prompt length)")
    p.add_argument("--max_seq_length", type=int, help="KV cache length (default: longest prompt + max_new_tokens)")
    p.add_argument("--profile", type=Path, metavar="PATH", help="write a torch.profiler trace of the last sample "
                   "to PATH (Chrome trace JSON)")
    p.add_argument("--ignore_eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--draft_checkpoint_path", type=Path, help="speculative decoding: a small draft model with "
                   "the same tokenizer proposes --speculate_k tokens, the target verifies them in one pass")
    p.add_argument("--prompt_lookup", type=int, metavar="N", help="speculative decoding without a draft: propose "
                   "the tokens that followed the last earlier occurrence of the context's last N tokens")
    p.add_argument("--speculate_k", type=int, default=5, help="the most tokens proposed per verify pass; a draft "
                   "model stops earlier when it grows unsure (threshold decoding), unless --fixed_k")
    p.add_argument("--fixed_k", action="store_true", help="the draft model always proposes --speculate_k tokens")
    p.add_argument("--metrics_json", type=Path, metavar="PATH", help="write the speed figures and the samples "
                   "as JSON (averaged over the samples after the first)")
    # one line, not argparse's usage block: the error is what the user needs to read
    p.error = lambda msg: sys.exit(f"error: {msg}")
    args = p.parse_args(argv)
    checks = [(args.max_new_tokens >= 1, "--max_new_tokens must be at least 1"),
              (args.num_samples >= 1, "--num_samples must be at least 1"),
              (args.batch_size is None or args.batch_size >= 1, "--batch_size must be at least 1"),
              (args.temperature >= 0, "--temperature must be >= 0"),
              (args.top_k >= 1, "--top_k must be at least 1"),
              (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
              (args.max_seq_length is None or args.max_seq_length >= 1, "--max_seq_length must be at least 1"),
              (args.speculate_k >= 1, "--speculate_k must be at least 1"),
              (args.prompt_lookup is None or args.prompt_lookup >= 1, "--prompt_lookup must be at least 1"),
              (not (args.draft_checkpoint_path and args.prompt_lookup), "use --draft_checkpoint_path or "
               "--prompt_lookup, not both"),
              (not args.fixed_k or args.draft_checkpoint_path, "--fixed_k needs --draft_checkpoint_path"),
              (all(s.strip() for s in args.prompt or ["x"]), "the prompt is empty")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    args.prompt = args.prompt or ["def fibonacci(n):"]
    if args.batch_size is None:
        args.batch_size = len(args.prompt)
    elif len(args.prompt) == 1:
        args.prompt = args.prompt * args.batch_size
    elif args.batch_size != len(args.prompt):
        p.error(f"--batch_size {args.batch_size} does not match the {len(args.prompt)} prompts given")
    if args.batch_size > 1 and (args.draft_checkpoint_path or args.prompt_lookup):
        p.error("speculative decoding supports batch size 1 only")
    return args


def summary(stats: dict, batch_size: int, model_bytes: int, device) -> dict:
    n_new = stats["decode_steps"] + 1
    total_s = stats["prefill_s"] + stats["decode_s"]
    decode_tps = batch_size * stats["decode_steps"] / stats["decode_s"] if stats["decode_steps"] else 0.0
    return {"ttft_ms": 1e3 * stats["prefill_s"],
            "decode_tokens_per_sec": decode_tps,
            "tokens_per_sec": batch_size * n_new / total_s,
            "prefill_tokens_per_sec": stats["prompt_tokens"] / stats["prefill_s"],
            "total_s": total_s,
            # the weights are read once per step whatever the batch size, so bandwidth follows steps per second
            "bandwidth_gb_s": model_bytes * decode_tps / batch_size / 1e9,
            "peak_memory_gb": peak_memory_gb(device)}


def print_summary(m: dict):
    if "acceptance_rate" in m:
        print(f"Speculative: decode {m['decode_tokens_per_sec']:.2f} tokens/sec | overall {m['tokens_per_sec']:.2f} | "
              f"time to first token {m['ttft_ms']:.1f} ms | {m['target_forwards']} target forwards | "
              f"mean drafted / accepted per verify: {m['mean_drafted']:.2f} / {m['mean_accepted']:.2f} | "
              f"acceptance rate: {m['acceptance_rate']:.1%} | "
              f"total: {m['total_s']:.2f} s")
        print(f"Accepted proposals per verify (histogram, 0..k): {m['accept_histogram']}")
        return
    print(f"Time to first token: {m['ttft_ms']:.1f} ms | decode: {m['decode_tokens_per_sec']:.2f} tokens/sec | "
          f"overall: {m['tokens_per_sec']:.2f} tokens/sec | total: {m['total_s']:.2f} s")
    per_rank = m.get("peak_memory_gb_per_rank")
    memory = " / ".join(f"{x:.2f}" for x in per_rank) + " GB per rank" if per_rank else f"{m['peak_memory_gb']:.2f} GB"
    print(f"Bandwidth achieved: {m['bandwidth_gb_s']:.2f} GB/s | peak memory: {memory}")


def main(argv=None):
    global prefill, decode_one_token
    args = parse_args(argv)
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    distributed = tp.init_distributed(device)  # (rank, world, device) under torchrun, else None
    if distributed:
        device = distributed[2]
    ckpt_dir, _ = checkpoint_files(args.checkpoint_path)
    tokenizer = Tokenizer(ckpt_dir / "tokenizer.model")
    prompts = [tokenizer.encode(s, bos=True) for s in args.prompt]
    T = max(len(p) for p in prompts)
    model = load_model(args.checkpoint_path, device, dtype, distributed and distributed[:2])
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(f"tokenizer ({tokenizer.vocab_size} tokens) does not fit the model's vocab_size "
                         f"{model.args.vocab_size}")
    max_seq_length = args.max_seq_length or min(T + args.max_new_tokens, model.args.max_seq_len)
    if T + args.max_new_tokens > min(max_seq_length, model.args.max_seq_len):
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the maximum "
                         f"sequence length {min(max_seq_length, model.args.max_seq_len)}")
    model.setup_caches(args.batch_size, max_seq_length)
    model_bytes = int(tp.world_sum([weight_bytes(model)], device)[0])  # read per step by all ranks together
    where = f"{distributed[1]} ranks, {device.type}" if distributed else device
    print(f"Loaded {args.checkpoint_path} ({model_bytes / 1e9:.3f} GB of weights read per step) on {where}, {args.dtype}")

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    eos_id = None if args.ignore_eos else tokenizer.eos_id
    draft = load_draft(args.draft_checkpoint_path, ckpt_dir, model, device, dtype) \
        if args.draft_checkpoint_path else None
    speculate = draft is not None or args.prompt_lookup is not None
    if speculate:
        import speculative

    def run(eos_id, callback=None):  # one generation -> rows, figures
        if not speculate:
            rows, stats = generate(model, prompts, args.max_new_tokens, eos_id, callback, **sampling)
            return rows, summary(stats, args.batch_size, model_bytes, device)
        row, stats = speculative.speculative_generate(
            model, prompts[0], args.max_new_tokens, args.speculate_k, draft, args.prompt_lookup,
            not args.fixed_k, eos_id, callback and (lambda tokens: callback(torch.tensor([tokens]))), **sampling)
        return [row], speculative_summary(stats, device)

    torch.manual_seed(args.seed)
    compile_s = 0.0
    if args.compile:
        decode_one_token = compile_step(decode_one_token)
        if speculate:
            speculative.draft_step, speculative.verify = map(compile_step, (speculative.draft_step, speculative.verify))
    if args.compile_prefill:
        prefill = torch.compile(prefill, dynamic=True, fullgraph=True)
    if args.compile or args.compile_prefill:
        t0 = time.perf_counter()  # one untimed run triggers compilation and CUDA-graph capture
        run(None)
        compile_s = time.perf_counter() - t0
        print(f"Compilation time: {compile_s:.2f} s")

    stream = args.batch_size == 1 and sys.stdout.isatty()
    results, samples = [], []
    for i in range(args.num_samples):
        profile = args.profile is not None and i == args.num_samples - 1
        prof = torch.profiler.profile() if profile else None
        if prof is not None:
            prof.__enter__()
        if stream:
            print(args.prompt[0], end="", flush=True)
        rows, figures = run(eos_id, make_streamer(tokenizer, prompts[0]) if stream else None)
        if prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(args.profile))
        texts = [tokenizer.decode(p + r)[len(tokenizer.decode(p)):] for p, r in zip(prompts, rows)]
        print("" if stream else "\n\n".join(s + t for s, t in zip(args.prompt, texts)))
        samples += [{"text": t, "tokens": r} for t, r in zip(texts, rows)]
        if distributed:
            figures["peak_memory_gb_per_rank"] = tp.world_gather(figures["peak_memory_gb"])
        results.append(figures)
        print(f"Sample {i + 1}/{args.num_samples}: {args.batch_size} x {max(len(r) for r in rows)} new tokens")
        print_summary(results[-1])
    if args.metrics_json:
        kept = results[1:] or results  # the first sample warms caches and allocators
        metrics = {k: sum(r[k] for r in kept) / len(kept) if isinstance(v, (int, float)) else kept[-1][k]
                   for k, v in results[0].items()}
        metrics.update(compile_s=compile_s, samples=samples)
        if not distributed or distributed[0] == 0:
            args.metrics_json.write_text(json.dumps(metrics, indent=2))
    if distributed:
        tp.finish()


def load_draft(path, target_dir: Path, model: Transformer, device, dtype) -> Transformer:
    """The draft model, checked to share the target's tokenizer and vocabulary, with a cache like the target's."""
    draft_dir, _ = checkpoint_files(path)
    tok = draft_dir / "tokenizer.model"
    if not tok.is_file() or tok.read_bytes() != (target_dir / "tokenizer.model").read_bytes():
        raise ValueError(f"the draft's tokenizer ({draft_dir / 'tokenizer.model'}) differs from the target's")
    draft = load_model(path, device, dtype)
    if draft.args.vocab_size != model.args.vocab_size:
        raise ValueError(f"the draft's vocab_size {draft.args.vocab_size} differs from the target's "
                         f"{model.args.vocab_size}")
    return draft


def speculative_summary(stats: dict, device) -> dict:
    decode_s = stats["total_s"] - stats["prefill_s"]  # the first token comes from prefill, as in summary()
    return {"tokens_per_sec": stats["new_tokens"] / stats["total_s"], "total_s": stats["total_s"],
            "ttft_ms": 1e3 * stats["prefill_s"], "decode_tokens_per_sec": (stats["new_tokens"] - 1) / decode_s,
            "peak_memory_gb": peak_memory_gb(device), "target_forwards": stats["target_forwards"],
            "mean_accepted": stats["mean_accepted"], "mean_drafted": stats["mean_drafted"],
            "acceptance_rate": stats["acceptance_rate"],
            "accept_histogram": stats["accept_histogram"]}


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
    except RuntimeError as e:  # under torchrun, a collective fails when another rank dies or stops answering
        if not tp.dist.is_initialized():
            raise
        sys.exit(f"error: rank {tp.dist.get_rank()} lost contact with the other ranks: {str(e).splitlines()[0]}")
