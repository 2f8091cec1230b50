"""Quantize a float checkpoint's weights into a new checkpoint: int8 per output channel, int4 per group (round to
nearest), or int4 with GPTQ calibrated on text. The formats and layers are in quantize.py.

    python scripts/quantize_checkpoint.py --mode int8          # -> checkpoints/stdlib-target-int8
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import cli  # noqa: E402
from eval import read_texts, stdlib_files  # noqa: E402
from generate import DEFAULT_CHECKPOINT, resolve_device  # noqa: E402
from quantize import GROUPSIZES, MODES, calibration_tokens, gptq_model, quantized_state  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def quantize_checkpoint(checkpoint_path, mode: str, groupsize: int = 128, out_dir=None, calibration_texts=None,
                        samples: int = 128, seq_len: int = 512, device="cpu", force: bool = False,
                        verbose: bool = False) -> Path:
    """Quantize a float checkpoint into out_dir (default: next to it, named after the mode). Returns out_dir.
    GPTQ calibrates on calibration_texts, by default the built-in held-out split."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if mode != "int8" and groupsize not in GROUPSIZES:
        raise ValueError(f"group size {groupsize} is not supported; use one of {', '.join(map(str, GROUPSIZES))}")
    ckpt_dir, weights = checkpoint.checkpoint_files(checkpoint_path)
    if checkpoint.read_quantization(weights):
        raise ValueError(f"{weights} is already quantized ({checkpoint.read_quantization(weights)[0]}); quantize "
                         f"the original float checkpoint instead")
    tag = mode if mode == "int8" else f"{mode}-g{groupsize}"
    out_dir = Path(out_dir) if out_dir else ckpt_dir.parent / f"{ckpt_dir.name}-{tag}"
    checkpoint.check_writable(out_dir, force, [ckpt_dir])

    t0 = time.perf_counter()
    model = checkpoint.load_model(ckpt_dir, device, torch.float32)
    model.output.weight = nn.Parameter(model.output.weight.clone())  # quantized apart from a tied embedding

    def say(msg, end="\n"):
        if verbose:
            print(msg, end=end, file=sys.stderr, flush=True)

    def progress(what):  # a bar that appears once the work reports its size
        bar = None

        def step(i, n):
            nonlocal bar
            bar = bar or tqdm(total=n, desc=what, disable=None if verbose else True)
            bar.update(i - bar.n)
            if i == n:
                bar.close()
        return step
    gptq = None
    if mode == "int4-gptq":
        if calibration_texts is None:
            calibration_texts = read_texts(stdlib_files("heldout"), "the held-out split")
        tokens = calibration_tokens(Tokenizer(checkpoint.tokenizer_path(ckpt_dir)), calibration_texts, samples,
                                    min(seq_len, model.args.block_size)).to(device)
        say(f"GPTQ on {tokens.size(0)} calibration windows of {tokens.size(1)} tokens")
        gptq = gptq_model(model, tokens, groupsize, progress=progress("GPTQ blocks"))
    state = quantized_state(model, "int8" if mode == "int8" else "int4", groupsize, gptq,
                            progress=progress("quantizing layers"))
    metadata = {"quantization": "int8" if mode == "int8" else "int4", "method": "gptq" if gptq else "rtn",
                "source": str(ckpt_dir)}
    if mode != "int8":
        metadata["groupsize"] = str(groupsize)
    checkpoint.save(out_dir, model.args, state, checkpoint.tokenizer_files(ckpt_dir), metadata, force=force,
                    inputs=[ckpt_dir])
    mb = lambda p: p.stat().st_size / 1e6  # noqa: E731
    say(f"Wrote {out_dir / 'model.safetensors'}: {mb(out_dir / 'model.safetensors'):.1f} MB "
        f"(from {mb(weights):.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT,
                   help="float checkpoint directory (default: the built-in target model)")
    p.add_argument("--mode", required=True, choices=MODES, help="int8: per channel; int4: per group, round to "
                   "nearest; int4-gptq: per group, GPTQ on calibration text")
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES, help="int4 group size: 32, 64, 128 or 256 "
                   "(default 128)")
    p.add_argument("--calibration_file", type=Path, help="text for GPTQ (default: the built-in held-out split of "
                   "the Python standard library)")
    p.add_argument("--calibration_samples", type=cli.positive_int, default=128, help="GPTQ calibration windows")
    p.add_argument("--calibration_seq_len", type=cli.positive_int, default=512, help="tokens per calibration "
                   "window")
    p.add_argument("--out_dir", type=Path, help="where to write (default: CHECKPOINT-MODE next to the input)")
    p.add_argument("--force", action="store_true", help="replace an earlier quantized checkpoint in --out_dir "
                   "(refused if the directory holds anything else)")
    p.add_argument("--device", default="auto", help="where GPTQ runs: auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    args = cli.one_line_errors(p).parse_args(argv)
    if args.mode == "int8" and args.groupsize is not None:
        p.error("--groupsize applies to int4 only; int8 has one scale per output channel")
    if args.mode != "int4-gptq" and args.calibration_file:
        p.error("--calibration_file applies to --mode int4-gptq only")
    device = resolve_device(args.device)
    cli.set_threads(args.threads, decode=False)
    if args.calibration_file:
        cli.check_text_file(args.calibration_file, "--calibration_file")
    texts = read_texts([args.calibration_file], args.calibration_file) if args.calibration_file else None
    quantize_checkpoint(args.checkpoint_path, args.mode, args.groupsize or 128, args.out_dir, texts,
                        args.calibration_samples, args.calibration_seq_len, device, args.force, verbose=True)


if __name__ == "__main__":
    cli.run_main(main)
