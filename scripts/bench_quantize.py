"""Quantization benchmark: size on disk, decode speed and held-out perplexity of every quantization mode, measured
in one run on one machine, for the built-in target model and a 1.1B-parameter Llama shape with random weights.
Prints a Markdown table (speeds also as ratios to bf16) and writes the figures as JSON."""
import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import cli  # noqa: E402
from checkpoint import load_model, read_config  # noqa: E402
from cpu_gemv import cpu_name  # noqa: E402
from eval import perplexity, read_texts, stdlib_files  # noqa: E402
from backend import Backend  # noqa: E402
from generate import DEFAULT_CHECKPOINT, generate, resolve_device  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from quantize_checkpoint import quantize_checkpoint  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

# (row label, quantize.py mode, group size, GPTQ calibration: "heldout" or "train")
ROWS = [("bf16", None, None, None), ("int8", "int8", None, None), ("int4-g32", "int4", 32, None),
        ("int4-g128", "int4", 128, None), ("int4-gptq-g128", "int4-gptq", 128, "heldout"),
        ("int4-gptq-g128, train-split calibration", "int4-gptq", 128, "train")]


def random_checkpoint(name: str, out_dir: Path, block_size: int = 0, device="cpu") -> Path:
    """A checkpoint of a named shape (or the built-in one) with N(0, 0.02) weights and the built-in tokenizer, and
    a context of block_size if given: speed needs no training. The weights are drawn on `device`, in bf16, with no
    default initialization first (in float32, an 8B shape's would take 32 GB)."""
    args = read_config(DEFAULT_CHECKPOINT) if name == "built-in" else ModelArgs.from_name(name)
    args = dataclasses.replace(args, block_size=block_size or args.block_size)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(torch.bfloat16)
    if args.tie_embeddings:  # to_empty gives the shared Parameter two copies: tie them again
        model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    state = model.state_dict()
    if args.tie_embeddings:
        state.pop("output.weight")
    return checkpoint.save(out_dir, args, state, DEFAULT_CHECKPOINT / checkpoint.TOKENIZER)


def decode_speed(ckpt: Path, device, new_tokens: int, repeats: int, compile: bool) -> float:
    """Median batch-1 greedy decode tokens/sec over `repeats` runs, after one warm-up (and compile) run."""
    model = load_model(ckpt, device, torch.bfloat16)
    steps = Backend(model, compile=compile, cpp=compile)
    try:
        prompt = [Tokenizer(ckpt / checkpoint.TOKENIZER).encode("def fibonacci(n):", bos=True)]
        generate(model, prompt, new_tokens, backend=steps, temperature=0)
        rates = []
        for _ in range(repeats):
            r = generate(model, prompt, new_tokens, backend=steps, temperature=0)
            rates.append(r.forwards / r.decode_s)
        return statistics.median(rates)
    finally:
        torch._dynamo.reset()


def kernel_table(shape: str):
    """Batch-1 time of each layer kind of a named shape, for bf16 and each quantized kernel, as GB/s of the bytes
    the layer stores; and a plain read of a 1 GB tensor, the machine's practical bandwidth."""
    from quantize import Int4Linear, Int8Linear, pack_nibbles, quantize_int4, quantize_int8
    a = ModelArgs.from_name(shape)
    layers = {"wqkv": ((a.n_head + 2 * a.n_kv_head) * a.head_dim, a.dim), "w13": (2 * a.intermediate_size, a.dim),
              "w2": (a.dim, a.intermediate_size), "output": (a.vocab_size, a.dim)}

    def seconds(f, n=50):
        for _ in range(5):
            f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n
    big = torch.randn(2**28)
    print(f"\nplain read (sum of a 1 GB float32 tensor): {big.numel() * 4 / seconds(big.sum, 10) / 1e9:.1f} GB/s")
    print("\n| layer [N, K] | bf16 GB/s | int8 GB/s | int4-g32 GB/s | int4-g128 GB/s |\n|---|---|---|---|---|")
    for name, (n, k) in layers.items():
        w, x = torch.randn(n, k) * 0.02, torch.randn(1, k, dtype=torch.bfloat16)
        bf16 = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        int8 = Int8Linear(k, n)
        int8.weight, int8.scales = quantize_int8(w)
        cells = [bf16, int8]
        for g in (32, 128):
            int4 = Int4Linear(k, n, g)
            q, int4.scales, int4.zeros = quantize_int4(w, g)
            int4.weight = pack_nibbles(q)
            int4.pack()
            cells.append(int4)
        with torch.no_grad():
            rates = [sum(t.numel() * t.element_size() for t in m.buffers()) + sum(
                t.numel() * t.element_size() for t in m.parameters()) for m in cells]
            rates = [b / seconds(lambda: m(x)) / 1e9 for b, m in zip(rates, cells)]
        print(f"| {name} [{n}, {k}] | " + " | ".join(f"{r:.1f}" for r in rates) + " |")


def quantized(ckpt: Path, mode, groupsize, calibration, work: Path, samples: int, seq_len: int, device) -> Path:
    if mode is None:
        return ckpt
    texts = None
    if calibration:
        files = stdlib_files(calibration)
        if calibration == "train":  # every 20th training file: about as much text as the held-out split
            files = files[::20]
        texts = read_texts(files, calibration)
    out = work / f"{ckpt.name}-{mode}-{groupsize}-{calibration}"
    return quantize_checkpoint(ckpt, mode, groupsize or 128, out, texts, samples, seq_len, device)


def main():
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--device", default="cpu", help="where to decode: cpu, cuda or cuda:N")
    p.add_argument("--large", default="TinyLlama-1.1B", help="named shape for the random-weight model")
    p.add_argument("--new_tokens", type=cli.positive_int, default=100, help="tokens decoded per timed run "
                   "(built-in model)")
    p.add_argument("--large_new_tokens", type=cli.positive_int, default=32, help="tokens decoded per timed run "
                   "(large model)")
    p.add_argument("--repeats", type=cli.positive_int, default=3, help="timed runs per figure (the median is "
                   "reported)")
    p.add_argument("--compile", action="store_true", help="also time the compiled decode step")
    p.add_argument("--skip_large", action="store_true", help="only the built-in model")
    p.add_argument("--quick", action="store_true", help="a check that everything runs, in about a minute: the "
                   "built-in model only, 32 tokens, one timed run, perplexity on 8 held-out files, GPTQ on 16 "
                   "windows; its figures are rough")
    p.add_argument("--kernels", action="store_true", help="only time each layer kind of the large shape, per kernel")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    p.add_argument("--json", type=Path, default=Path("bench_quantize.json"), help="where to write the figures")
    args = cli.one_line_errors(p).parse_args()
    device = resolve_device(args.device)
    cli.set_threads(args.threads)
    if args.kernels:
        return kernel_table(args.large)
    cli.check_output_file(args.json, "--json", '"machine"')
    if args.quick:
        args.skip_large, args.new_tokens, args.repeats = True, 32, 1
    samples, seq_len = (16, 256) if args.quick else (128, 512)
    results = {"machine": torch.cuda.get_device_name(device) if device.type == "cuda" else
               f"{cpu_name()}, {torch.get_num_threads()} threads",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": {}}
    heldout = read_texts(stdlib_files("heldout")[: 8 if args.quick else None], "the held-out split")
    tokenizer = Tokenizer(DEFAULT_CHECKPOINT / "tokenizer.model")
    rows = [r for r in ROWS if not (args.quick and r[3] == "train")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        large = None if args.skip_large else random_checkpoint(args.large, work / "large")
        for label, mode, groupsize, calibration in tqdm(rows, desc="quantization modes", disable=None):
            row = results["rows"][label] = {}
            small = quantized(DEFAULT_CHECKPOINT, mode, groupsize, calibration, work, samples, seq_len, "cpu")
            row["size_mb"] = (small / "model.safetensors").stat().st_size / 1e6
            row["ppl"], _ = perplexity(load_model(small, "cpu", torch.float32), tokenizer, heldout)
            row["tok_s"] = decode_speed(small, device, args.new_tokens, args.repeats, False)
            if args.compile:
                row["tok_s_compiled"] = decode_speed(small, device, args.new_tokens, args.repeats, True)
            if large and calibration != "train":  # the calibration text does not change the speed
                big = quantized(large, mode, groupsize, calibration, work, 8, 256, "cpu")
                row["large_size_mb"] = (big / "model.safetensors").stat().st_size / 1e6
                row["large_tok_s"] = decode_speed(big, device, args.large_new_tokens, args.repeats, False)
                if args.compile:
                    row["large_tok_s_compiled"] = decode_speed(big, device, args.large_new_tokens, args.repeats,
                                                               True)
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=2)))
    print_table(results, args.large)


def print_table(results: dict, large: str):
    rows = results["rows"]
    base = rows["bf16"]
    cols = [k for k in ("tok_s", "tok_s_compiled", "large_tok_s", "large_tok_s_compiled") if k in base]
    names = {"tok_s": "built-in tok/s", "tok_s_compiled": "built-in tok/s, compiled",
             "large_tok_s": f"{large} tok/s", "large_tok_s_compiled": f"{large} tok/s, compiled"}
    print(f"\n{results['machine']}, torch {results['torch']}, {results['date']}; batch 1, greedy, bf16 activations\n")
    head = ["mode", "built-in MB"] + (["1.1B MB"] if "large_size_mb" in base else []) + \
        [names[c] for c in cols] + ["held-out ppl"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for label, r in rows.items():
        cells = [label, f"{r['size_mb']:.1f}"]
        if "large_size_mb" in base:
            cells.append(f"{r['large_size_mb']:.0f}" if "large_size_mb" in r else "")
        for c in cols:
            cells.append(f"{r[c]:.1f} ({r[c] / base[c]:.2f}x)" if c in r else "")
        cells.append(f"{r['ppl']:.3f} ({100 * (r['ppl'] / base['ppl'] - 1):+.2f}%)")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    cli.run_main(main)
