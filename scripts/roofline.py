"""How fast a model could decode on this CPU, and how near the engine comes: the ceiling memory sets on one row (every
weight read once a token) and the one the multiply-add units set on many (every weight multiplied once a row), both
measured here, against the engine's decode step timed with 1 row and with --rows rows.

    python scripts/roofline.py --checkpoint_path checkpoints/smollm2-int4 --rows 16

The ceilings bound the weights' reads and products alone; a step also attends over the KV cache, normalizes and
samples, which a short --context keeps small. A model that fits in the last-level cache reads faster than memory."""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402
import cpu_gemv  # noqa: E402
from bench import read_bandwidth  # noqa: E402
from checkpoint import load_model  # noqa: E402
from engine import Engine, Request  # noqa: E402
from sampling import Sampling  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "roofline.cpp"


def peaks() -> dict:
    """Multiply-adds a second of the int8 and the bf16 instruction the loaded kernel set uses, on every thread."""
    name = cpu_gemv.kernels
    flags = next((f for n, _, f in cpu_gemv.targets(cpu_gemv.cpu_flags()) if n == name), None)
    if flags is None:
        raise ValueError(f"the C++ kernels are not in use here ({name}): there is nothing to set against a ceiling")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([os.environ.get("CXX", "g++"), "-O3", *flags, "-fopenmp", str(SOURCE), "-o",
                            f"{tmp}/roofline"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise ValueError(f"{SOURCE.name} did not build: {cpu_gemv.compiler_error(e)}") from None
        except FileNotFoundError:
            raise ValueError(f"no C++ compiler ({os.environ.get('CXX', 'g++')} not found)") from None
        out = subprocess.run([f"{tmp}/roofline"], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}).stdout
    return {k: float(v) for k, v in (line.split() for line in out.splitlines())}


def products(model) -> list:
    """(layer, columns K it multiplies, which ceiling bounds it) of every product a decode step runs, in order."""
    out = []
    for m in model.modules():
        if isinstance(m, cpu_gemv.GemvInt4):
            out.append((m, 2 * m.weight.size(1), "int8"))  # x rounded to int8 meets the 4-bit weights in dpbusd
        elif isinstance(m, cpu_gemv.GemvInt8):  # the f32 head multiplies in bf16: every product exact
            out.append((m, m.weight.size(1), "bf16" if m.f32 else "int8"))
        elif isinstance(m, cpu_gemv.GemvBf16):
            out.append((m, m.weight.size(1), "bf16"))
    return out


def seconds_per_step(model, rows: int, context: int, steps: int, rounds: int) -> float:
    """Median seconds of the engine's decode step for `rows` requests, each `context` tokens in (distinct random
    prompts: no prefix is shared), over `rounds` rounds of `steps` steps."""
    g = torch.Generator().manual_seed(rows)
    new = steps * (rounds + 1) + 8  # the warm steps, the timed ones, and room: no row may finish while timed
    requests = [Request(torch.randint(3, model.args.vocab_size, (context,), generator=g).tolist(),
                        Sampling(new, temperature=0)) for _ in range(rows)]
    engine = Engine(model, max_rows=rows, blocks=rows * math.ceil((context + new) / 16) + 1)
    for r in requests:
        engine.add(r)
    while engine.waiting or not all(engine.decoding(r) for r in engine.running):  # the prompts in, and a warm step
        engine.step()
    for _ in range(steps):
        engine.step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times.append((time.perf_counter() - t0) / steps)
    if len(engine.running) != rows:
        raise RuntimeError(f"{rows - len(engine.running)} of {rows} rows finished while timed")
    return statistics.median(times)


@torch.inference_mode()
def measure(path: Path, rows: int, context: int, rounds: int, ceilings: dict) -> dict:
    model = load_model(path, "cpu", torch.bfloat16)
    layers = products(model)
    if not layers:
        raise ValueError(f"--checkpoint_path {path}: none of its products runs on the C++ kernels here")
    steps = 8
    longest = context + steps * (rounds + 1) + 16  # seconds_per_step's requests, with room
    if longest > model.args.block_size:
        raise ValueError(f"--context {context}: with the steps timed, past {path.name}'s context of "
                         f"{model.args.block_size} tokens")
    model.setup_caches(1, longest)
    macs = sum(m.weight.size(0) * k for m, k, _ in layers)  # a row's multiply-adds, padding included
    weights = cli.weight_bytes(model)
    # a VM's memory changes speed within minutes: read just before and just after the 1-row steps, which it bounds
    probes = [read_bandwidth(torch.device("cpu"), 1.0)]
    one = seconds_per_step(model, 1, context, steps, rounds)
    probes.append(read_bandwidth(torch.device("cpu"), 1.0))
    many, read = seconds_per_step(model, rows, context, steps, rounds), statistics.mean(probes)
    floor = sum(m.weight.size(0) * k / ceilings[kind] for m, k, kind in layers)  # a row's seconds at the ceilings
    return {"checkpoint": str(path), "weight_mb": weights / 1e6, "macs_per_token": macs, "rows": rows,
            "context": context, "read_bytes_per_s": probes, "one_row_tokens_per_s": 1 / one,
            "one_row_read_share": weights / one / read,
            "memory_ceiling_tokens_per_s": read / weights, "rows_tokens_per_s": rows / many,
            "rows_macs_per_s": rows * macs / many, "rows_compute_share": floor * rows / many,
            "compute_ceiling_tokens_per_s": 1 / floor}


def main(argv=None):
    p = cli.one_line_errors(argparse.ArgumentParser(description=cli.summary(__doc__)))
    p.add_argument("--checkpoint_path", type=Path, nargs="+", default=[cli.DEFAULT_CHECKPOINT])
    p.add_argument("--rows", type=cli.positive_int, default=16, help="rows of the batched products (at most "
                   f"{cpu_gemv.MAX_ROWS}: more are prefill, which runs other kernels)")
    p.add_argument("--context", type=cli.positive_int, default=64, help="tokens each row holds before the steps")
    p.add_argument("--rounds", type=cli.positive_int, default=5, help="rounds of 8 steps; the median round counts")
    p.add_argument("--threads", type=cli.positive_int)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.rows > cpu_gemv.MAX_ROWS:
        raise ValueError(f"--rows {args.rows}: at most {cpu_gemv.MAX_ROWS}")
    cli.check_output_file(args.json, "--json", '"rows_macs_per_s"')
    for path in args.checkpoint_path:
        if not (path / "config.json").is_file():
            raise ValueError(f"--checkpoint_path {path}: no checkpoint there (no config.json)")
    cli.set_threads(args.threads)
    if cpu_gemv.load() is None:
        raise ValueError("the C++ kernels do not run here: there is nothing to set against a ceiling")
    ceilings = peaks()
    results = [measure(path, args.rows, args.context, args.rounds, ceilings) for path in args.checkpoint_path]
    print(f"\n{cpu_gemv.cpu_name()}, {cpu_gemv.kernels} kernels, {torch.get_num_threads()} threads: int8 "
          f"multiply-adds {ceilings['int8'] / 1e9:.0f} G/s, bf16 {ceilings['bf16'] / 1e9:.0f} G/s; {args.context} "
          "tokens of context a row. Shares: the ceiling's time for the weights over the step's.\n")
    print(f"| checkpoint | MB a token | MMAC a token | memory GB/s | 1 row tok/s | of memory's ceiling | {args.rows} "
          "rows tok/s | GMAC/s | of compute's ceiling | compute's ceiling tok/s | ceiling / 1 row |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {Path(r['checkpoint']).name} | {r['weight_mb']:.1f} | {r['macs_per_token'] / 1e6:.1f} | "
              f"{'-'.join(f'{b / 1e9:.0f}' for b in r['read_bytes_per_s'])} | "
              f"{r['one_row_tokens_per_s']:.0f} | {100 * r['one_row_read_share']:.0f}% | "
              f"{r['rows_tokens_per_s']:.0f} | {r['rows_macs_per_s'] / 1e9:.0f} | "
              f"{100 * r['rows_compute_share']:.0f}% | {r['compute_ceiling_tokens_per_s']:.0f} | "
              f"{r['compute_ceiling_tokens_per_s'] / r['one_row_tokens_per_s']:.2f}x |")
    if args.json:
        cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(
            {"macs_per_s": ceilings, "threads": torch.get_num_threads(),
             "models": results}, indent=2)))


if __name__ == "__main__":
    cli.run_main(main)
