"""The batch-1 CPU decode step two ways, alternating in one process: cpu_step.py's one C++ call, and the step
torch.compile makes of model.py's decode step (its C++ wrapper), on the same model, kernels and cache. Prints
each checkpoint's median step time both ways and the ratio, compiled / C++ (above 1: the C++ step is faster)."""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402
import cpu_step  # noqa: E402
from checkpoint import load_model  # noqa: E402
from cpu_gemv import cpu_name  # noqa: E402
from backend import compile_step, last_logits  # noqa: E402
from generate import DEFAULT_CHECKPOINT, weight_bytes  # noqa: E402
from model import kv_bucket  # noqa: E402


def seconds_per_step(decode, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        decode()
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def compare(path: Path, context: int, rounds: int, steps: int) -> dict:
    model = load_model(path, "cpu", torch.bfloat16)
    model.setup_caches(1, context + 64)  # as generate.py sets it up for 64 new tokens
    model(torch.randint(0, model.args.vocab_size, (1, context)), model.context(torch.arange(context), kv_len=context))
    cpp = cpu_step.step_for(model)
    if cpp is None:
        raise ValueError(f"{path}: cpu_step cannot run this model here (see cpu_step.step_for: bf16 activations, "
                         f"this CPU's kernels, a head size the attention kernel takes)")
    compiled = compile_step(lambda *a: last_logits(*a).argmax(-1))  # model.py's step, compiled, and its pick
    cur, pos, kv_len = torch.tensor([[5]]), torch.tensor([context]), kv_bucket(context + 1, context + 64)
    ways = {"compiled": lambda: compiled(model, cur, pos, None, kv_len),
            "C++": lambda: cpp.greedy(cur, pos)}  # as generate picks greedy tokens
    for run in ways.values():  # compiles, and warms both
        seconds_per_step(run, 3)
    times = {name: [] for name in ways}
    for r in range(rounds):  # every other round in reverse: a drift in the memory's speed favours neither
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            times[name].append(seconds_per_step(ways[name], steps))
    ratios = [a / b for a, b in zip(times["compiled"], times["C++"])]
    return {"checkpoint": str(path), "weight_gb": weight_bytes(model) / 1e9, "context": context,
            "compiled_ms": [1e3 * t for t in times["compiled"]], "cpp_ms": [1e3 * t for t in times["C++"]],
            "ratio": statistics.median(ratios), "ratios": ratios}


def main(argv=None):
    p = cli.one_line_errors(argparse.ArgumentParser(description=cli.summary(__doc__)))
    p.add_argument("--checkpoint_path", type=Path, nargs="+", default=[DEFAULT_CHECKPOINT])
    p.add_argument("--context", type=cli.positive_int, default=100, help="positions in the cache before the step")
    p.add_argument("--rounds", type=cli.positive_int, default=8)
    p.add_argument("--steps", type=cli.positive_int, default=20, help="decode steps timed per round and way")
    p.add_argument("--threads", type=cli.positive_int)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    cli.check_output_file(args.json, "--json", '"cpp_ms"')
    for path in args.checkpoint_path:
        if not (path / "config.json").is_file():
            raise ValueError(f"--checkpoint_path {path}: no checkpoint there (no config.json)")
    cli.set_threads(args.threads)
    results = [compare(path, args.context, args.rounds, args.steps) for path in args.checkpoint_path]
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; batch 1, "
          f"{args.context} positions of context, medians of {args.rounds} rounds of {args.steps} steps\n")
    print("| checkpoint | GB a step | compiled ms | C++ ms | compiled / C++ | rounds |\n|---|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {Path(r['checkpoint']).name} | {r['weight_gb']:.3f} | {statistics.median(r['compiled_ms']):.2f} | "
              f"{statistics.median(r['cpp_ms']):.2f} | {r['ratio']:.3f} | "
              f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f} |")
    if args.json:
        cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=2)))


if __name__ == "__main__":
    cli.run_main(main)
