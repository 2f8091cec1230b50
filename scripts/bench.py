"""Decoding benchmark: how close each configuration comes to the machine's memory bandwidth.

One command, one device, one run. It first measures the ceilings, memory copy bandwidth (bytes read plus bytes
written by a large tensor copy) and matmul FLOP/s, then runs every configuration in a fresh process (so peak
memory, compile time and dynamo state belong to that configuration alone): model shapes with random weights,
bf16 / int8 / int4 weights, eager / compiled, batch 1 / 8, prompts of 16 / 1024 tokens; Hugging Face
transformers on the same shapes beside them; and a short context in a 2k and a 32k cache. With --guided, every run
of ours is followed by the same generation under a JSON schema, and a table compares the two. Each configuration
measures the copy bandwidth again right after its runs, and its "% of copy" is against that. It prints Markdown
tables, writes JSON, and saves a PNG plot when matplotlib is installed. With --peer llama.cpp it runs instead the
same random checkpoint in this project and in llama.cpp (see scripts/llama_cpp.py), in alternating rounds; with
--gguf too, a real model's GGUF file in llama.cpp and its import in this project."""
import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import cli  # noqa: E402
import cpu_gemv  # noqa: E402
import cuda_gemv  # noqa: E402
from bench_quantize import random_checkpoint  # noqa: E402
import guided  # noqa: E402
import llama_cpp  # noqa: E402
from checkpoint import huge_page_block, load_model, load_tokenizer, read_config  # noqa: E402
from backend import Backend  # noqa: E402
from generate import (DEFAULT_CHECKPOINT, device_sync, generate, peak_memory_gb,  # noqa: E402
                      resolve_device, weight_bytes)
from model import transformer_configs  # noqa: E402

SHAPES = {"cpu": ["built-in", "TinyLlama-1.1B"], "cuda": ["built-in", "TinyLlama-1.1B", "Llama-2-7b"]}
INT4_GROUPSIZE = 128
# --guided: a long list of records, so that a model writes structure (forced keys, enums, bounded numbers) all along
# and the list cannot be closed before the run's last token
RECORDS = {"type": "array", "minItems": 1000, "items": {"type": "object", "additionalProperties": False,
                                      "required": ["id", "name", "tags", "score"],
                                      "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                     "name": {"type": "string", "maxLength": 12},
                                                     "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                              "maxItems": 3},
                                                     "score": {"type": "number", "minimum": 0, "maximum": 1,
                                                               "multipleOf": 0.125}}}}
COPY_GIB = {False: 1, True: 4}  # keyed by "on a GPU": well past the last-level cache either way


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


def probe_ones(gib: float, device) -> torch.Tensor:
    """float32 ones to probe the memory with. On a CPU in 2 MB pages where Linux gives them, as the weights are
    (checkpoint.into_huge_pages): in 4 KB pages a 1 GiB sum read 49-54 GB/s where one in 2 MB pages read 57-66, in
    the same minutes (2-core Zen 4 VM, fast memory), so a probe in 4 KB pages overstates our % of read."""
    n = int(gib * 2**30) // 4
    memory = huge_page_block(4 * n) if device.type == "cpu" else None
    return torch.ones(n, device=device) if memory is None else memory.view(torch.float32).fill_(1.0)


PROBES: dict = {}  # (device, GiB, slot) -> the probe's memory, for the life of the process


def kept_ones(gib: float, device, slot: int = 0) -> torch.Tensor:
    """probe_ones, made once per process and slot, and kept. On a VM whose balloon driver reports freed memory to
    the host (virtio free page reporting, about two seconds after the free), freeing a 1 GiB probe slowed the memory
    for about half a second two seconds later: TinyLlama's bf16 decode steps of about 60 ms took 70-106 ms in that
    half second after 7 of 8 probes (2-core Zen 4 VM, memory slow), which landed in whatever was measured after the
    probe: our decode, in every round of --peer. After a kept probe the steps took as long as after none."""
    key = (str(device), gib, slot)
    if key not in PROBES:
        PROBES[key] = probe_ones(gib, device)
    return PROBES[key]


def copy_bandwidth(device, gib: float) -> float:
    """Bytes read plus bytes written per second by one large copy: the practical ceiling for streaming weights."""
    src, dst = kept_ones(gib, device, 0), kept_ones(gib, device, 1)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 10, device)


def read_bandwidth(device, gib: float) -> float:
    """Bytes per second a large float32 sum reads: the ceiling for decoding, which reads weights and writes little."""
    src = kept_ones(gib, device)
    return src.numel() * 4 / timed(lambda: src.sum(), 10, device)


def matmul_flops(device, n: int) -> dict:
    """FLOP/s of an [n, n] @ [n, n] product in bf16 and fp32. Prefill's ceiling is the faster of the two: on a CPU
    without bf16 matrix instructions, model.Linear multiplies bf16 prefill in fp32."""
    flops = {}
    for dtype in (torch.bfloat16, torch.float32):
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        device_sync(device)
        t0 = time.perf_counter()
        a @ b
        device_sync(device)
        first = time.perf_counter() - t0  # a product that takes seconds (bf16 without bf16 instructions): one is enough
        flops[str(dtype)[6:]] = 2 * n**3 / (first if first > 0.5 else timed(lambda: a @ b, 3, device))
    return flops


def checkpoint(shape: str, weights: str, work: Path, cache: int = 0, device="cpu") -> Path:
    """The built-in target or a named shape with random weights, quantized as asked; cached in `work`. A cache
    longer than the shape's context gets random weights of the shape with that context: speed needs no training.
    The weights are drawn and quantized on `device`."""
    if shape == "built-in" and not cache:
        base = DEFAULT_CHECKPOINT
    else:
        block_size = max(cache, read_config(DEFAULT_CHECKPOINT).block_size if shape == "built-in" else 0)
        base = work / f"{shape}-{block_size}" if block_size else work / shape
        if not base.exists():
            random_checkpoint(shape, base, block_size, device)
    out = base if weights == "bf16" else work / f"{base.name}-{weights}"
    if not out.exists():
        from quantize_checkpoint import quantize_checkpoint
        quantize_checkpoint(base, weights, INT4_GROUPSIZE, out_dir=out, device=device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the GPU's memory is the measured runs' (each in a child process), not this one's
    return out


def matmul_weights(a) -> int:  # weights one token multiplies; prefill does 2 FLOPs per weight per token
    per_layer = a.dim * (a.n_head + 2 * a.n_kv_head) * a.head_dim + a.n_head * a.head_dim * a.dim
    return a.n_layer * (per_layer + 3 * a.dim * a.intermediate_size) + a.dim * a.vocab_size


def run_one(cfg: dict) -> dict:
    """One configuration, in this process: greedy decoding of random prompts after a warm-up (and compile) run,
    medians over `repeats` runs. The copy bandwidth is measured again after each run, and each run's bandwidth is
    compared with its own: this VM's bandwidth drifts by a third within minutes."""
    device = resolve_device(cfg["device"])
    torch.manual_seed(0)
    cfg["compiled"] = cfg["mode"] == "compiled"
    weights, flops_per_token, run = (run_transformers if cfg["impl"] == "transformers" else run_ours)(cfg, device)
    t0 = time.perf_counter()
    run()
    first_s = time.perf_counter() - t0
    runs, copies = [], []
    for i in range(cfg["repeats"]):
        runs.append(run())  # {"ttft_s", "decode_tok_s" (steps per second), "total_s"}
        if i == 0:  # every allocation has happened by now, and the copy's buffers would count
            peak = peak_memory_gb(device)
        copies.append(copy_bandwidth(device, COPY_GIB[device.type == "cuda"]))
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    guided_figures = {k: med(k) for k in runs[0] if k.startswith("guided_")}
    return {**guided_figures, "prompt": cfg["prompt"], "kernels": cfg.get("kernels", "torch"), "ttft_ms": 1e3 * med("ttft_s"), "prefill_tok_s": cfg["batch"] * cfg["prompt"] /
            med("ttft_s"), "decode_tok_s": cfg["batch"] * med("decode_tok_s"),
            "bandwidth_gb_s": weights * med("decode_tok_s") / 1e9, "weight_gb": weights / 1e9,
            "copy_gb_s": statistics.median(copies) / 1e9,
            "pct_copy": 100 * statistics.median(weights * r["decode_tok_s"] / c for r, c in zip(runs, copies)),
            "peak_memory_gb": peak, "prefill_flops_per_token": flops_per_token,
            "compile_s": max(first_s - med("total_s"), 0.0) if cfg["compiled"] else 0.0}


def run_ours(cfg: dict, device):
    """(weight bytes, prefill FLOPs per token, one timed greedy generation) for this project's model."""
    model = load_model(cfg["checkpoint"], device, torch.bfloat16, cfg["cpu_kernels"])
    steps = Backend(model, compile=cfg["compiled"], cpp=cfg["compiled"])  # eager: model.py's forward alone
    cfg["prompt"] = min(cfg["prompt"], model.args.block_size - cfg["new_tokens"])  # the built-in model stops at 1024
    prompts = torch.randint(3, model.args.vocab_size, (cfg["batch"], cfg["prompt"])).tolist()
    model.setup_caches(cfg["batch"], cfg.get("cache") or cfg["prompt"] + cfg["new_tokens"])
    cfg["kernels"] = cpu_gemv.describe(model) if device.type == "cpu" else \
        cuda_gemv.describe(model) if device.type == "cuda" else "torch"
    if cfg.get("guided"):  # with fast-forward, and without it: then every pass is one token, as in plain decoding
        tokenizer, schema = load_tokenizer(Path(cfg["checkpoint"]), model.args), json.dumps(RECORDS)
        guides = [guided.Guide(tokenizer, [guided.json_schema(schema)], cfg["batch"], model.args.vocab_size,
                               fast_forward=ff) for ff in (True, False)]

    def run():
        r = generate(model, prompts, cfg["new_tokens"], backend=steps, temperature=0)
        out = {"ttft_s": r.prefill_s, "decode_tok_s": r.forwards / r.decode_s, "total_s": r.prefill_s + r.decode_s}
        if cfg.get("guided"):  # the same prompts under the schema, right after: they see the same machine
            g, m = (generate(model, prompts, cfg["new_tokens"], backend=steps, temperature=0, guide=x) for x in guides)
            out.update(guided_tok_s=g.decode_tokens / g.decode_s, guided_plain_tok_s=r.decode_tokens / r.decode_s,
                       guided_forced=g.forced / sum(map(len, g.rows)), guided_mask_steps_s=m.forwards / m.decode_s,
                       total_s=sum(x.prefill_s + x.decode_s for x in (r, g, m)))
        return out
    return weight_bytes(model), 2 * matmul_weights(model.args), run


def run_transformers(cfg: dict, device):
    """The same for the shape in Hugging Face transformers' LlamaForCausalLM (random bf16 weights), through its
    own generate(): eager with its default dynamic cache, or compiled as its documentation recommends, with a
    static cache and forward compiled with mode="reduce-overhead". A streamer timestamps each token."""
    from transformers import LlamaConfig, LlamaForCausalLM
    a = read_config(Path(cfg["checkpoint"]))
    config = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.intermediate_size,
                         num_hidden_layers=a.n_layer, num_attention_heads=a.n_head, num_key_value_heads=a.n_kv_head,
                         head_dim=a.head_dim, max_position_embeddings=a.block_size, rms_norm_eps=a.norm_eps,
                         tie_word_embeddings=a.tie_embeddings)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    if cfg["compiled"]:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(3, a.vocab_size, (cfg["batch"], cfg["prompt"]), device=device)
    n = cfg["new_tokens"]

    class Stamps:  # generate() calls put() with the prompt, then once per new token
        def __init__(self):
            self.times = []

        def put(self, _):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run():
        stamps, t0 = Stamps(), time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, streamer=stamps)  # a streamer takes batch 1 only
        device_sync(device)
        t1, first = time.perf_counter(), stamps.times[1]
        return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (t1 - first), "total_s": t1 - t0}
    embedding = 0 if a.tie_embeddings else a.vocab_size * a.dim
    return 2 * (sum(p.numel() for p in model.parameters()) - embedding), 2 * matmul_weights(a), run


def main():
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--shapes", nargs="+", choices=["built-in", *transformer_configs],
                   help="model shapes (default: the built-in target, TinyLlama-1.1B, and Llama-2-7b on a GPU)")
    p.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4"], choices=["bf16", "int8", "int4"],
                   help="weight formats to run")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                   help="eager, or the decode step compiled as generate.py --compile does")
    p.add_argument("--batches", nargs="+", type=cli.positive_int, default=[1, 8], help="batch sizes")
    p.add_argument("--prompts", nargs="+", type=cli.positive_int, default=[16, 1024], help="prompt lengths in tokens")
    p.add_argument("--new_tokens", type=cli.positive_int, default=64, help="tokens decoded per timed run")
    p.add_argument("--repeats", type=cli.positive_int, default=3, help="timed runs per configuration; the median "
                   "is reported")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--work_dir", type=Path, default=Path("/tmp/fast-decode-bench"), help="where the random-weight "
                   "checkpoints are written, and kept for the next run")
    p.add_argument("--quick", action="store_true", help="shapes larger than the built-in one at batch 1 with the "
                   "shortest prompt only, plus one long prefill in bf16 compiled (on a CPU, long prefills take minutes)")
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                   help="run Hugging Face transformers beside ours (bf16, batch 1, the short prompt)")
    p.add_argument("--long_cache", action=argparse.BooleanOptionalAction, default=True,
                   help="decode a 100-token context in a 2k and a 32k cache (bf16, compiled, batch 1)")
    p.add_argument("--guided", action="store_true", help="after each run of ours, the same prompts under a JSON "
                   "schema (a list of records): decode speed with and without it, and the share of forced tokens")
    p.add_argument("--cpu_kernels", default="auto", choices=["auto", "off"], help="auto: cpu_gemv.py's kernels for "
                   "this CPU and the prefill dtype measured faster here; off: torch's own kernels")
    p.add_argument("--peer", choices=["llama.cpp"], help="instead of the grid: this project against llama.cpp on the "
                   "same random checkpoint (GGUF BF16, Q8_0, Q4_0 for --weights bf16, int8, int4), batch-1 decode, "
                   "prefill and decode at --depth, in alternating rounds; llama.cpp is built once from the "
                   "llama-cpp-python source package unless --llama_cpp names a build")
    p.add_argument("--llama_cpp", type=Path, help="a folder holding llama-bench and llama-quantize")
    p.add_argument("--gguf", type=Path, help="--peer: a real model's GGUF file instead of random weights; llama.cpp "
                   "runs the file, this project its import by convert_gguf.py (int4 from Q4_0/Q4_1, int8 from Q8_0)")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="--peer: rounds of measurements, each of "
                   "ours beside llama.cpp's; medians are reported, and the median of the per-round ratios")
    p.add_argument("--prefill", type=cli.positive_int, default=512, help="--peer: prompt tokens for the prefill speed")
    p.add_argument("--depth", type=int, default=4096, help="--peer: decode after this many tokens of context too "
                   "(0: not)")
    p.add_argument("--kv_cache_dtype", default="auto", choices=["auto", "int8"], help="--peer: our KV cache in "
                   "int8 (see generate.py) and llama.cpp's in Q8_0 (with its flash attention); auto: bf16 and F16")
    p.add_argument("--background_load", action="store_true", help="--peer: every measurement again with one core "
                   "kept busy by another process")
    p.add_argument("--json", type=Path, default=Path("bench.json"), help="where to write the figures (and a PNG "
                   "plot beside it)")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # internal: our side of --peer
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration given as JSON
    args = cli.one_line_errors(p).parse_args()
    device = resolve_device(args.device)
    args.threads = cli.set_threads(args.threads) if device.type == "cpu" else args.threads
    if args.depth < 0:
        cli.fail(f"--depth must be 0 or more, got {args.depth}")
    if args.gguf and not args.peer:
        cli.fail("--gguf is for --peer llama.cpp: the grid runs random weights of named shapes")
    if args.kv_cache_dtype != "auto" and not args.peer:
        cli.fail("--kv_cache_dtype is for --peer llama.cpp: the grid runs the model's own cache dtype")
    if args.gguf and not args.gguf.is_file():  # before llama.cpp is built, which takes minutes
        cli.fail(f"--gguf {args.gguf} {'is not a file' if args.gguf.exists() else 'not found'}")
    if args.peer or args.serve:  # here, not at the top: bench_peer.py imports this file's ceilings
        from bench_peer import peer, serve_peer
    if args.serve:
        return serve_peer(json.loads(args.serve))
    if args.one:
        cfg = json.loads(args.one)
        if cfg == "ceilings":
            cfg = {"copy": copy_bandwidth(device, COPY_GIB[device.type == "cuda"]),
                   "read": read_bandwidth(device, COPY_GIB[device.type == "cuda"]),
                   "matmul": matmul_flops(device, 8192 if device.type == "cuda" else 1024)}
        else:
            cfg = run_one(cfg)
        print(json.dumps(cfg))
        return
    cli.check_output_file(args.json, "--json", '"machine"')
    cli.check_output_file(args.json.with_suffix(".png"), "--json", "Matplotlib")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{cpu_gemv.cpu_name()}, {torch.get_num_threads()} threads"
    ceilings = one_process(device, "ceilings", args.threads)  # in a child: on Linux a child inherits its parent's peak RSS
    copy_bw, read_bw, matmul = ceilings["copy"], ceilings["read"], ceilings["matmul"]
    flops = max(matmul.values())
    print(f"{machine}: copy bandwidth {copy_bw / 1e9:.1f} GB/s, read bandwidth {read_bw / 1e9:.1f} GB/s; matmul " +
          ", ".join(f"{k} {v / 1e12:.3f} TFLOP/s" for k, v in matmul.items()))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.peer:
        tools = args.llama_cpp or llama_cpp.build_llama_cpp(log=lambda m: print(m, file=sys.stderr))
        rows = peer(args, device, tools)
        results = {"machine": machine, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                   "read_bandwidth_gb_s": read_bw / 1e9, "copy_bandwidth_gb_s": copy_bw / 1e9,
                   "llama_cpp": llama_cpp.version(tools), "peer_rows": rows}
        cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=2)))
        return
    rows, long_rows = [], []
    for cfg in tqdm(configs(args, device), desc="configurations", disable=None):
        path = checkpoint(cfg["shape"], cfg["weights"], args.work_dir, cfg.get("cache", 0), device)
        row = dict(cfg, **one_process(device, dict(cfg, device=str(device), checkpoint=str(path)), args.threads))
        row["pct_run_copy"] = 100 * row["bandwidth_gb_s"] * 1e9 / copy_bw
        row["pct_flops"] = 100 * row["prefill_tok_s"] * row["prefill_flops_per_token"] / flops
        if "cache" in cfg:
            long_rows.append(row)
        else:
            rows.append(row)
            print_row(row, header=len(rows) == 1)
    print_long_cache(long_rows)
    print_guided(rows)
    results = {"machine": machine, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "copy_bandwidth_gb_s": copy_bw / 1e9, "read_bandwidth_gb_s": read_bw / 1e9, "matmul_tflops": {k: v / 1e12 for k, v in matmul.items()},
               "rows": rows, "long_cache_rows": long_rows}
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=2)))
    plot(results, args.json.with_suffix(".png"))


def configs(args, device) -> list[dict]:
    """Every configuration of the run: ours over the whole grid, transformers beside it (bf16, batch 1, the short
    prompt), and the long-cache pair (a 100-token context in a 2k and a 32k cache)."""
    shapes = args.shapes or SHAPES.get(device.type, SHAPES["cpu"])
    common = dict(new_tokens=args.new_tokens, repeats=args.repeats, cpu_kernels=args.cpu_kernels)
    ours = dict(guided=True) if args.guided else {}
    out = []
    for shape, weights, mode, batch, prompt in itertools.product(shapes, args.weights, args.modes, args.batches,
                                                                 args.prompts):
        small = shape == "built-in" or batch == min(args.batches) and prompt == min(args.prompts)
        prefill_row = weights == "bf16" and mode == "compiled" and batch == min(args.batches)  # prefill's FLOP/s
        if args.quick and not (small or prefill_row):
            continue
        out.append(dict(impl="ours", shape=shape, weights=weights, mode=mode, batch=batch, prompt=prompt, **common,
                        **ours))
    if args.transformers:
        out += [dict(impl="transformers", shape=shape, weights="bf16", mode=mode, batch=1, prompt=min(args.prompts),
                     **common) for shape in shapes for mode in args.modes]
    if args.long_cache:
        out += [dict(impl="ours", shape=shape, weights="bf16", mode="compiled", batch=1, prompt=100, cache=cache,
                     **common) for shape in shapes for cache in (2048, 32768)]
    return out


def one_process(device, cfg, threads) -> dict:
    """Run `--one cfg` in a fresh process, so that its memory, compile time and dynamo state are its own."""
    done = subprocess.run([sys.executable, __file__, "--device", str(device), "--one", json.dumps(cfg),
                           *(["--threads", str(threads)] if threads else [])], capture_output=True, text=True)
    if done.returncode != 0:
        what = cfg if isinstance(cfg, str) else " ".join(f"{k}={cfg[k]}" for k in ("shape", "impl", "weights", "mode",
                                                                                "batch", "prompt"))
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ValueError(f"the configuration {what} failed: {last}")
    return json.loads(done.stdout.splitlines()[-1])


def print_row(r: dict, header: bool):
    if header:
        print("\n| shape | impl | kernels | weights | mode | batch | prompt | TTFT ms | prefill tok/s | % of matmul "
              "| decode tok/s | GB/s | copy GB/s | % of copy | peak GB | compile s |")
        print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    kernels = r["kernels"].removeprefix("CPU kernels: ")
    print(f"| {r['shape']} | {r['impl']} | {kernels} | {r['weights']} | {r['mode']} | {r['batch']} | {r['prompt']} | "
          f"{r['ttft_ms']:.1f} | {r['prefill_tok_s']:.0f} | {r['pct_flops']:.0f}% | {r['decode_tok_s']:.1f} | "
          f"{r['bandwidth_gb_s']:.1f} | {r['copy_gb_s']:.1f} | {r['pct_copy']:.0f}% | {r['peak_memory_gb']:.2f} | "
          f"{r['compile_s']:.0f} |", flush=True)


def print_long_cache(rows: list[dict]):
    """Decode speed with a short context in a long cache, against the same context in a 2k cache."""
    if not rows:
        return
    print("\n| shape | cache | context | decode tok/s | vs 2k cache | peak GB |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    base = {r["shape"]: r["decode_tok_s"] for r in rows if r["cache"] == 2048}
    for r in rows:
        print(f"| {r['shape']} | {r['cache']} | {r['prompt']} | {r['decode_tok_s']:.1f} | "
              f"{100 * r['decode_tok_s'] / base[r['shape']]:.0f}% | {r['peak_memory_gb']:.2f} |", flush=True)


def print_guided(rows: list[dict]):
    """Each run of ours against the same run under the JSON schema: decode tokens per second, counting every new
    token (a forced one too), and the share of forced tokens; then steps per second with fast-forward off, where
    every step is one token as in plain decoding, so that the ratio is what the mask costs a step."""
    rows = [r for r in rows if "guided_tok_s" in r]
    if not rows:
        return
    print("\n| shape | weights | mode | batch | decode tok/s | guided tok/s | ratio | forced | steps/s | "
          "guided steps/s, no fast-forward | ratio |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | "
          "---: | ---: |")
    for r in rows:
        plain, steps = r["guided_plain_tok_s"], r["decode_tok_s"] / r["batch"]
        print(f"| {r['shape']} | {r['weights']} | {r['mode']} | {r['batch']} | {plain:.1f} | {r['guided_tok_s']:.1f} | "
              f"{r['guided_tok_s'] / plain:.2f} | {100 * r['guided_forced']:.0f}% | {steps:.1f} | "
              f"{r['guided_mask_steps_s']:.1f} | {r['guided_mask_steps_s'] / steps:.2f} |", flush=True)


def plot(results: dict, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in results["rows"] if r["batch"] == 1 and r["prompt"] == min(x["prompt"] for x in results["rows"])]
    labels = [f"{r['shape']} {r['impl']}\n{r['weights']} {r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.8), 4))
    ax.bar(range(len(rows)), [r["pct_copy"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("% of copy bandwidth (batch 1 decode)")
    ax.set_title(f"{results['machine']}, {results['date']}")
    fig.tight_layout()
    cli.write_file(path, lambda tmp: fig.savefig(tmp, format="png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    cli.run_main(main)
