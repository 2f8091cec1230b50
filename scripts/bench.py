"""Decoding benchmark: how close each configuration comes to the machine's memory bandwidth.

One command, one device, one run. It first measures the ceilings, memory copy bandwidth (bytes read plus bytes
written by a large tensor copy) and bf16 matmul FLOP/s, then runs every configuration in a fresh process (so
peak memory, compile time and dynamo state belong to that configuration alone): model shapes with random
weights, bf16 / int8 / int4 weights, eager / compiled, batch 1 / 8, prompts of 16 / 1024 tokens. It prints a
Markdown table, writes JSON, and saves a PNG plot when matplotlib is installed."""
import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import generate as gen  # noqa: E402
from bench_quantize import cpu_name, random_checkpoint  # noqa: E402
from model import transformer_configs  # noqa: E402
from generate import DEFAULT_CHECKPOINT, device_sync, load_model, peak_memory_gb, resolve_device, weight_bytes  # noqa: E402

SHAPES = {"cpu": ["built-in", "TinyLlama-1.1B"], "cuda": ["built-in", "TinyLlama-1.1B", "Llama-2-7b"]}
INT4_GROUPSIZE = 128


def timed(f, repeats: int, device) -> float:  # median seconds of f()
    f()
    times = []
    for _ in range(repeats):
        device_sync(device)
        t0 = time.perf_counter()
        f()
        device_sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device, gib: float) -> float:
    """Bytes read plus bytes written per second by one large copy: the practical ceiling for streaming weights."""
    src = torch.ones(int(gib * 2**30) // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 10, device)


def matmul_flops(device, n: int) -> dict:
    """FLOP/s of an [n, n] @ [n, n] product in bf16 and fp32. Prefill's ceiling is the faster of the two: on a CPU
    without bf16 matrix instructions, model.Linear multiplies bf16 prefill in fp32."""
    flops = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        flops[str(dtype)[6:]] = 2 * n**3 / timed(lambda: a @ b, 3, device)
    return flops


def checkpoint(shape: str, weights: str, work: Path) -> Path:
    """The built-in target or a named shape with random weights, quantized as asked; cached in `work`."""
    base = DEFAULT_CHECKPOINT if shape == "built-in" else work / shape
    if shape != "built-in" and not base.exists():
        random_checkpoint(shape, base)
    if weights == "bf16":
        return base
    out = work / f"{shape}-{weights}"
    if not out.exists():
        from quantize import quantize_checkpoint
        quantize_checkpoint(base, weights, INT4_GROUPSIZE, out_dir=out)
    return out


def matmul_weights(a) -> int:  # weights one token multiplies; prefill does 2 FLOPs per weight per token
    per_layer = a.dim * (a.n_head + 2 * a.n_kv_head) * a.head_dim + a.n_head * a.head_dim * a.dim
    return a.n_layer * (per_layer + 3 * a.dim * a.intermediate_size) + a.dim * a.vocab_size


def run_one(cfg: dict) -> dict:
    """One configuration, in this process: greedy decoding of random prompts, median over `repeats` runs."""
    device = resolve_device(cfg["device"])
    torch.manual_seed(0)
    model = load_model(cfg["checkpoint"], device, torch.bfloat16)
    if cfg["compiled"]:
        gen.decode_one_token = gen.compile_step(gen.decode_one_token)
    prompt = min(cfg["prompt"], model.args.max_seq_len - cfg["new_tokens"])  # the built-in model stops at 1024
    prompts = torch.randint(3, model.args.vocab_size, (cfg["batch"], prompt)).tolist()
    model.setup_caches(cfg["batch"], prompt + cfg["new_tokens"])
    t0 = time.perf_counter()
    gen.generate(model, prompts, cfg["new_tokens"], temperature=0)  # warm-up; compiles when compiled
    first_s = time.perf_counter() - t0
    runs = [gen.generate(model, prompts, cfg["new_tokens"], temperature=0)[1] for _ in range(cfg["repeats"])]
    decode = statistics.median(r["decode_steps"] / r["decode_s"] for r in runs)  # steps per second
    prefill_s = statistics.median(r["prefill_s"] for r in runs)
    run_s = statistics.median(r["prefill_s"] + r["decode_s"] for r in runs)
    return {"prompt": prompt, "ttft_ms": 1e3 * prefill_s, "prefill_tok_s": cfg["batch"] * prompt / prefill_s,
            "decode_tok_s": cfg["batch"] * decode, "bandwidth_gb_s": weight_bytes(model) * decode / 1e9,
            "weight_gb": weight_bytes(model) / 1e9, "peak_memory_gb": peak_memory_gb(device),
            "prefill_flops_per_token": 2 * matmul_weights(model.args),
            "compile_s": max(first_s - run_s, 0.0) if cfg["compiled"] else 0.0}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--shapes", nargs="+", choices=["built-in", *transformer_configs],
                   help="default: the built-in target, TinyLlama-1.1B, and Llama-2-7b on GPU")
    p.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4"], choices=["bf16", "int8", "int4"])
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompts", nargs="+", type=int, default=[16, 1024], help="prompt lengths in tokens")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the median is reported")
    p.add_argument("--work_dir", type=Path, default=Path("/tmp/fast-decode-bench"), help="random checkpoints")
    p.add_argument("--quick", action="store_true", help="shapes larger than the built-in one at batch 1 with the "
                   "shortest prompt only (on a CPU, their long prefills take many minutes)")
    p.add_argument("--json", type=Path, default=Path("bench.json"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration given as JSON
    args = p.parse_args()
    device = resolve_device(args.device)
    if args.one:
        cfg = json.loads(args.one)
        if cfg == "ceilings":
            cfg = {"copy": copy_bandwidth(device, 4 if device.type == "cuda" else 1),
                   "matmul": matmul_flops(device, 8192 if device.type == "cuda" else 1024)}
        else:
            cfg = run_one(cfg)
        print(json.dumps(cfg))
        return
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()}, {torch.get_num_threads()} threads"
    ceilings = one_process(device, "ceilings")  # in a child: on Linux a child inherits its parent's peak RSS
    copy_bw, matmul = ceilings["copy"], ceilings["matmul"]
    flops = max(matmul.values())
    print(f"{machine}: copy bandwidth {copy_bw / 1e9:.1f} GB/s; matmul " +
          ", ".join(f"{k} {v / 1e12:.3f} TFLOP/s" for k, v in matmul.items()))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape, weights, mode, batch, prompt in itertools.product(args.shapes or SHAPES.get(device.type, SHAPES["cpu"]),
                                                                 args.weights, args.modes, args.batches, args.prompts):
        if args.quick and shape != "built-in" and (batch > min(args.batches) or prompt > min(args.prompts)):
            continue
        cfg = dict(device=str(device), checkpoint=str(checkpoint(shape, weights, args.work_dir)), batch=batch,
                   prompt=prompt, compiled=mode == "compiled", new_tokens=args.new_tokens, repeats=args.repeats)
        row = dict(shape=shape, weights=weights, mode=mode, batch=batch, **one_process(device, cfg))
        row["pct_copy"] = 100 * row["bandwidth_gb_s"] * 1e9 / copy_bw
        row["pct_flops"] = 100 * row["prefill_tok_s"] * row["prefill_flops_per_token"] / flops
        rows.append(row)
        print_row(row, header=len(rows) == 1)
    results = {"machine": machine, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "copy_bandwidth_gb_s": copy_bw / 1e9, "matmul_tflops": {k: v / 1e12 for k, v in matmul.items()},
               "rows": rows}
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.json.with_suffix(".png"))


def one_process(device, cfg) -> dict:
    """Run `--one cfg` in a fresh process, so that its memory, compile time and dynamo state are its own."""
    done = subprocess.run([sys.executable, __file__, "--device", str(device), "--one", json.dumps(cfg)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {cfg} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def print_row(r: dict, header: bool):
    if header:
        print("\n| shape | weights | mode | batch | prompt | TTFT ms | prefill tok/s | % of matmul | decode tok/s "
              "| GB/s | % of copy | peak GB | compile s |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {r['shape']} | {r['weights']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r['ttft_ms']:.1f} | "
          f"{r['prefill_tok_s']:.0f} | {r['pct_flops']:.0f}% | {r['decode_tok_s']:.1f} | {r['bandwidth_gb_s']:.1f} | {r['pct_copy']:.0f}% | "
          f"{r['peak_memory_gb']:.2f} | {r['compile_s']:.0f} |", flush=True)


def plot(results: dict, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in results["rows"] if r["batch"] == 1 and r["prompt"] == min(x["prompt"] for x in results["rows"])]
    labels = [f"{r['shape']}\n{r['weights']} {r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.8), 4))
    ax.bar(range(len(rows)), [r["pct_copy"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("% of copy bandwidth (batch 1 decode)")
    ax.set_title(f"{results['machine']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
