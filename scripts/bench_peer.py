"""bench.py --peer llama.cpp: this project and llama.cpp on the same weights, side by side. Our side runs in a child
process of bench.py (--serve) that loads and compiles once and then measures whenever asked; llama.cpp's side is
llama-bench (see llama_cpp.py). Each round runs every measurement of one side right beside the other's, with read
probes around our decode, and every other round in reverse; the rows are the medians of the rounds."""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_gemv  # noqa: E402
import llama_cpp  # noqa: E402
from bench import COPY_GIB, checkpoint, read_bandwidth  # noqa: E402
from checkpoint import load_model, read_config  # noqa: E402
from backend import Backend  # noqa: E402
from generate import generate, resolve_device, weight_bytes  # noqa: E402

BENCH = Path(__file__).with_name("bench.py")  # its --serve runs serve_peer in a child process
# "kept": our decode at depth over our decode after KEPT_CONTEXT tokens (half the depth, if less), in this many
# pairs of decodes of this many tokens (or --new_tokens, if fewer)
KEPT_PAIRS, KEPT_TOKENS, KEPT_CONTEXT = 5, 16, 100


def kept(rate, long: list[int], n: int, depth: int) -> float:
    """The median of KEPT_PAIRS pairs' ratios (%) of our decode of n tokens after depth tokens of context (long's
    first depth, already in the cache) to one after KEPT_CONTEXT of them (half the depth, if less) right after it.
    rate(ids, n, cached) -> tokens/s."""
    # each pair a second or two long: on a shared VM the memory changed speed between a short decode and a decode at
    # depth ten seconds apart in most rounds (read probes around them), which made their ratio 54-143%
    short = min(KEPT_CONTEXT, depth // 2)
    return statistics.median(100 * rate(long[:depth + 1], n, depth) / rate(long[:short + 1], n, short)
                             for _ in range(KEPT_PAIRS))


def serve_peer(cfg: dict):
    """A child process of ours for --peer: load and compile once, warm up, then one measurement per line on stdin
    ("decode", "prefill", "depth_decode" or "kept"), as one JSON number: decode is batch 1, new_tokens after a
    one-token prompt; prefill a `prefill`-token prompt; depth_decode new_tokens after `depth` tokens of context (all
    three in tokens/s); kept (see kept). That context is random keys and values written straight into the cache:
    attention's cost depends on its length, not its values, and prefilling 4k tokens would take minutes per round."""
    device = resolve_device(cfg["device"])
    torch.manual_seed(0)
    model = load_model(cfg["checkpoint"], device, torch.bfloat16, cfg["cpu_kernels"])
    steps, n, depth = Backend(model, compile=True), cfg["new_tokens"], cfg["depth"]
    vocab = model.args.vocab_size
    model.setup_caches(1, max(cfg["prefill"], depth + 1) + n, torch.int8 if cfg.get("kv_int8") else None)
    prompt = torch.randint(3, vocab, (cfg["prefill"],)).tolist()
    long = torch.randint(3, vocab, (depth + 1,)).tolist()

    def rate(ids: list[int], tokens: int, cached: int = 0) -> float:  # decode tokens/s
        r = generate(model, [ids], tokens, backend=steps, temperature=0, cached=cached)
        return r.forwards / r.decode_s

    def measure(kind: str) -> float:
        # untimed first, as llama-bench warms up before each measurement: while the other side ran, the OS may have
        # dropped the weights' pages from its cache (seen on a VM), and a timed step would read them from disk
        generate(model, [prompt[:1]], 8, backend=steps, temperature=0)
        if kind == "decode":
            return rate(prompt[:1], n)
        if kind == "prefill":
            return cfg["prefill"] / generate(model, [prompt], 1, backend=steps, temperature=0).prefill_s
        with torch.no_grad():
            for layer in model.layers:
                c = layer.attention.kv_cache
                for t in (c.k_cache, c.v_cache):
                    t[:, :, :depth].random_(-127, 128) if t.dtype == torch.int8 else t[:, :, :depth].normal_()
                for t in (c.k_scale, c.v_scale) if c.k_scale is not None else ():
                    t[:, :, :depth] = 1 / 64  # values of about the size normal_() gives
        if kind == "depth_decode":
            return rate(long, n, depth)
        return kept(rate, long, min(KEPT_TOKENS, n), depth)

    for kind in ("decode", "prefill", "depth_decode", "kept")[:4 if depth else 2]:  # compiles every step and length
        measure(kind)
    print(json.dumps({"ready": True, "weight_bytes": weight_bytes(model), "kernels": cpu_gemv.describe(model)}),
          flush=True)
    for line in sys.stdin:
        print(json.dumps(measure(line.strip())), flush=True)


class Child:
    """serve_peer in a child process: one compile, then a measurement whenever asked."""
    def __init__(self, device, cfg: dict, threads):
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: compile warnings cannot fill it and stall
        self.p = subprocess.Popen([sys.executable, str(BENCH), "--device", str(device), "--serve", json.dumps(cfg),
                                   *(["--threads", str(threads)] if threads else [])],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.info = self.read()

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            self.err.seek(0)
            last = (self.err.read().strip().splitlines() or [f"exit status {self.p.wait()}"])[-1]
            raise ValueError(f"our side of --peer failed: {last}")
        return json.loads(line)

    def measure(self, kind: str) -> float:
        self.p.stdin.write(kind + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def busy_core() -> subprocess.Popen:
    """--background_load: a process that keeps one core busy, as other work on a desktop would."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def peer_models(args, tools: Path, cache: int) -> list[tuple[str, Path, Path, str]]:
    """(our weights, our checkpoint, llama.cpp's GGUF file, its type) per comparison: a random checkpoint of the
    shape in each weight format and its GGUF (bf16, int8 vs Q8_0, int4 vs Q4_0), or with --gguf a real model's
    file as llama.cpp reads it and as this project imports it (convert_gguf.py; cached in the work folder)."""
    if args.gguf:
        from convert_gguf import convert_gguf, open_gguf
        ckpt = args.work_dir / f"{args.gguf.stem}-imported"
        if not (ckpt / "model.safetensors").is_file():
            convert_gguf(args.gguf, ckpt)
        if read_config(ckpt).block_size < cache:
            raise ValueError(f"{args.gguf.name} holds {read_config(ckpt).block_size} tokens of context; --prefill, or "
                             f"--depth plus --new_tokens, need {cache}: lower them")
        kind = open_gguf(args.gguf).fields.get("general.file_type")
        kind = gguf.LlamaFileType(int(kind.parts[-1][0])).name.removeprefix("MOSTLY_") if kind else "GGUF"
        return [("imported", ckpt, args.gguf, kind)]
    shape = (args.shapes or ["TinyLlama-1.1B"])[0]
    return [(weights, checkpoint(shape, weights, args.work_dir, cache),
             llama_cpp.llama_gguf(tools, checkpoint(shape, "bf16", args.work_dir, cache), weights, args.work_dir),
             llama_cpp.QUANT[weights]) for weights in args.weights]


def round_plan(depth: bool, mirrored: bool) -> list[tuple[str, str]]:
    """One round of --peer: (side, measurement) in order. Each of our measurements runs right beside llama.cpp's
    same one, our short decode between two read probes: on a shared host the memory's speed moves within seconds,
    and a pair ten seconds apart gave decode ratios from 0.63 to 1.28 in one run. Every other round runs in reverse,
    so that a steady drift in the memory's speed favours neither side. The probes are numbered in the order of an
    unmirrored round."""
    plan = [("theirs", "decode"), ("read", "0"), ("ours", "decode"), ("read", "1")]
    plan += [("ours", "depth_decode"), ("ours", "kept"), ("theirs", "depth_decode")] if depth else []
    plan += [("theirs", "prefill"), ("ours", "prefill")]
    return plan[::-1] if mirrored else plan


def memory_changed(probes: list[float]) -> bool:
    """Whether the read probes around our decode differ by more than a quarter: the memory changed speed during it,
    and its "% of read" says little."""
    return max(probes) > 1.25 * min(probes)


def theirs_measure(args, tools: Path, gguf_path: Path, threads: int, kind: str) -> float:
    """llama-bench's tokens/s for one of serve_peer's measurements, on as many tokens and threads"""
    q8 = args.kv_cache_dtype == "int8"
    if kind == "prefill":
        return llama_cpp.llama_bench(tools, gguf_path, threads, args.prefill, 0, kv_q8=q8)["prefill"]
    depth = args.depth if kind == "depth_decode" else 0  # at depth, its untimed prefill of the context warms it up
    return llama_cpp.llama_bench(tools, gguf_path, threads, 0, args.new_tokens, depth, warmup=not depth,
                                 kv_q8=q8)["decode"]


def peer(args, device, tools: Path) -> list[dict]:
    """Ours against llama.cpp on the same weights, per weight format (see peer_models): decode, prefill and decode
    at depth, in rounds that alternate the two (see round_plan), with and without a busy core."""
    threads = args.threads or torch.get_num_threads()
    rows, kv_int8 = [], args.kv_cache_dtype == "int8"
    cache = max(args.prefill, args.depth + 1) + args.new_tokens
    for weights, ckpt, gguf_path, theirs in peer_models(args, tools, cache):
        for load in ([False, True] if args.background_load else [False]):
            # the long context only on an idle machine: llama-bench prefills it again every round, minutes here
            depth = 0 if load else args.depth
            cfg = dict(device=str(device), checkpoint=str(ckpt), cpu_kernels=args.cpu_kernels,
                       new_tokens=args.new_tokens, prefill=args.prefill, depth=depth, kv_int8=kv_int8)
            busy = busy_core() if load else None
            try:
                ours = Child(device, cfg, args.threads)
                rounds, reads = [], []
                for i in tqdm(range(args.rounds), desc=f"{weights}{', busy core' if load else ''}", disable=None):
                    a, b, probes = {}, {}, [0.0, 0.0]
                    for side, kind in round_plan(bool(depth), mirrored=i % 2 == 1):
                        if side == "ours":
                            a[kind] = ours.measure(kind)
                        elif side == "read":
                            # on a shared host the memory's read speed swings by half within minutes: one probe at
                            # the start made "% of read" say 57% in one run, 94% in the next
                            probes[int(kind)] = read_bandwidth(device, COPY_GIB[device.type == "cuda"])
                        else:
                            b[kind] = theirs_measure(args, tools, gguf_path, threads, kind)
                    rounds.append((a, b))
                    reads.append(probes)
                ours.close()
            finally:
                if busy:
                    busy.kill()
            kv = (", KV int8", ", KV Q8_0") if kv_int8 else ("", "")
            row = dict(weights=weights + kv[0], theirs=theirs + kv[1], load=load, rounds=rounds,
                       weight_bytes=ours.info["weight_bytes"], kernels=ours.info["kernels"])
            for key in rounds[0][1]:
                row[key] = statistics.median(a[key] for a, _ in rounds)
                row[f"llama_{key}"] = statistics.median(b[key] for _, b in rounds)
                row[f"{key}_ratio"] = statistics.median(a[key] / b[key] for a, b in rounds)
            if depth:  # the median of the rounds' medians of their pairs' ratios
                row["depth_kept"] = statistics.median(a["kept"] for a, _ in rounds)
            row["read_rounds_gb_s"] = [[r / 1e9 for r in probes] for probes in reads]  # before and after our decode
            row["read_gb_s"] = statistics.median(statistics.mean(probes) for probes in reads) / 1e9
            row["pct_read"] = statistics.median(100 * row["weight_bytes"] * a["decode"] / statistics.mean(probes)
                                                for (a, _), probes in zip(rounds, reads))
            row["memory_changed_rounds"] = [i for i, probes in enumerate(reads) if memory_changed(probes)]
            rows.append(row)
            print_peer(row, header=len(rows) == 1, depth=args.depth, prefill=args.prefill)
    changed = [f"{r['weights']}{', busy core' if r['load'] else ''} {len(r['memory_changed_rounds'])} of "
               f"{len(r['rounds'])}" for r in rows if r["memory_changed_rounds"]]
    if changed:
        print(f"\n* the read probes before and after our decode differed by more than a quarter in some rounds "
              f"({', '.join(changed)}): the memory changed speed during them", flush=True)
    return rows


def print_peer(r: dict, header: bool, depth: int, prefill: int):
    if header:
        d = f" | decode at {depth}: ours | llama.cpp | ratio | ours, {depth} vs {min(KEPT_CONTEXT, depth // 2)}" \
            if depth else ""
        print(f"\n| weights | llama.cpp | CPU | decode tok/s: ours | llama.cpp | ratio | ours GB/s | read GB/s "
              f"| % of read | prefill {prefill} tok/s: ours | llama.cpp | ratio{d} |")
        print("| --- | --- | --- |" + " ---: |" * (9 + (4 if depth else 0)))
    d = (f" | {r['depth_decode']:.1f} | {r['llama_depth_decode']:.1f} | {r['depth_decode_ratio']:.2f} | "
         f"{r['depth_kept']:.0f}%" if "depth_decode" in r else " | | | |") if depth else ""
    print(f"| {r['weights']} | {r['theirs']} | {'one core busy' if r['load'] else 'idle'} | {r['decode']:.1f} | "
          f"{r['llama_decode']:.1f} | {r['decode_ratio']:.2f} | {r['weight_bytes'] * r['decode'] / 1e9:.1f} | "
          f"{r['read_gb_s']:.1f} | {r['pct_read']:.0f}%{'*' if r['memory_changed_rounds'] else ''} | "
          f"{r['prefill']:.1f} | {r['llama_prefill']:.1f} | "
          f"{r['prefill_ratio']:.2f}{d} |",
          flush=True)

