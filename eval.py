"""Perplexity of a checkpoint on a text file, a folder of files, or the built-in held-out split of the Python
standard library (the text the built-in models were not trained on)."""
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line and status 130, as cli.run_main says later
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted", file=sys.stderr), os._exit(130)))

import argparse  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import checkpoint  # noqa: E402
import cli  # noqa: E402
from checkpoint import checkpoint_files, load_model  # noqa: E402
from generate import DEFAULT_CHECKPOINT, DTYPES, resolve_device  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402


def stdlib_files(split: str) -> list[Path]:
    """The running interpreter's standard library *.py files, split by a hash of each file's relative path: the
    same split on every machine with the same Python. Left out: site-packages, the test suites, and pydoc_data,
    which is generated English documentation (760 KB), not code."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "pydoc_data"}
    files = sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))
    heldout = lambda f: hashlib.sha256(f.relative_to(root).as_posix().encode()).digest()[0] < 13  # ~5%
    return [f for f in files if heldout(f) == (split == "heldout")]


def read_texts(files: list[Path], source) -> list[str]:
    """The files' text; refused if one is binary or not UTF-8, or if they are too large to tokenize here."""
    available = cli.available_memory()
    for f in files:
        cli.check_text_file(f, "text file", available)
        available -= 8 * f.stat().st_size
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    if not any(t.strip() for t in texts):
        raise ValueError(f"no text to evaluate in {source}")
    return texts


def windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive windows of seq_len + 1 tokens overlapping by one: every token after the first is predicted once."""
    return [ids[i : i + seq_len + 1] for i in range(0, max(len(ids) - 1, 1), seq_len)]


def batches(tokenizer: Tokenizer, texts: list[str], seq_len: int, batch_size: int, device):
    """(inputs [B, W], targets [B, W]) with -100 where a right-padded row has nothing to predict."""
    encoded = [tokenizer.encode(t, bos=True) for t in texts]
    if sum(len(e) - 1 for e in encoded) < 2:
        raise ValueError("the text is shorter than 2 tokens")
    chunks = [w for e in encoded for w in windows(e, seq_len) if len(w) > 1]
    for b in range(0, len(chunks), batch_size):
        batch = chunks[b : b + batch_size]
        width = max(len(c) for c in batch)
        ids = torch.tensor([c + [0] * (width - len(c)) for c in batch], device=device)
        lens = torch.tensor([len(c) for c in batch], device=device)
        pad = torch.arange(width - 1, device=device) >= lens[:, None] - 1  # [B, width - 1]
        yield ids[:, :-1], ids[:, 1:].masked_fill(pad, -100), (b + len(batch), len(chunks))


@torch.no_grad()
def perplexity(model, tokenizer: Tokenizer, texts: list[str], seq_len: int = 512, batch_size: int = 8,
               progress: bool = False) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over every predicted token, and the number of those tokens."""
    nll, count, bar = 0.0, 0, None
    for inputs, target, (done, total) in batches(tokenizer, texts, seq_len, batch_size, model.norm.weight.device):
        logits = model(inputs).float()  # the cache-free causal forward: pads on the right never matter
        nll += F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
        if not math.isfinite(nll):
            raise ValueError("the model's logits became NaN or infinite; try --dtype float32")
        bar = bar or tqdm(total=total, desc="windows", unit="", disable=None if progress else True)
        bar.update(done - bar.n)
        bar.set_postfix(ppl=f"{math.exp(nll / count):.3f}", refresh=False)
    if bar is not None:
        bar.close()
    return math.exp(nll / count), count


@torch.no_grad()
def greedy_agreement(model, draft, tokenizer: Tokenizer, texts: list[str], seq_len: int = 512,
                     batch_size: int = 8) -> float:
    """Fraction of positions where the draft's argmax equals the model's: a first guess at how many of a
    draft's proposals greedy speculative decoding would accept."""
    same, count = 0, 0
    for inputs, target, _ in batches(tokenizer, texts, seq_len, batch_size, model.norm.weight.device):
        agree = model(inputs).argmax(-1) == draft(inputs).argmax(-1)
        same += int((agree & (target != -100)).sum())
        count += int((target != -100).sum())
    return same / count


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--checkpoint_path", type=Path, default=DEFAULT_CHECKPOINT, help="checkpoint directory "
                   "(default: the built-in target model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", type=Path, help="a text file, or a folder whose files are all evaluated")
    src.add_argument("--heldout", action="store_true", help="the built-in held-out split of the Python stdlib "
                     "(the default when --text is not given)")
    p.add_argument("--max_files", type=cli.positive_int, help="evaluate only the first N files (sorted by path)")
    p.add_argument("--draft", type=Path, help="also report how often this draft checkpoint's greedy token "
                   "equals the model's")
    p.add_argument("--seq_len", type=cli.positive_int, help="tokens per evaluation window (default: 512, or the "
                   "model's block_size if smaller)")
    p.add_argument("--batch_size", type=cli.positive_int, default=8, help="windows per forward pass")
    cli.add_device_options(p, dtype="float32")  # (bfloat16 matmuls are slow on many CPUs)
    args = cli.one_line_errors(p).parse_args(argv)
    device = resolve_device(args.device)
    if args.text is not None and not args.text.exists():
        p.error(f"--text {args.text} not found")
    if args.text is None:
        files = stdlib_files("heldout")
    elif args.text.is_dir():
        files = sorted(f for f in args.text.rglob("*") if f.is_file())
    else:
        files = [args.text]
    texts = read_texts(files[: args.max_files], args.text or "the held-out split")
    if args.draft:
        checkpoint_files(args.draft)  # fail before the long evaluation, not after
    config = checkpoint.plan(args.checkpoint_path, device, DTYPES[args.dtype])
    args.seq_len = args.seq_len or min(512, config.block_size)
    checkpoint.plan(args.checkpoint_path, device, DTYPES[args.dtype], args.batch_size, args.seq_len, args.seq_len)
    if args.seq_len > config.block_size:
        p.error(f"--seq_len {args.seq_len} exceeds the model's maximum {config.block_size}")
    tokenizer = checkpoint.load_tokenizer(args.checkpoint_path, config)
    if device.type == "cpu":
        cli.set_threads(args.threads, decode=False)
    print(f"Evaluating {args.checkpoint_path} on {len(texts)} file(s), {sum(map(len, texts)) / 1e6:.1f} M "
          f"characters")
    model = load_model(args.checkpoint_path, device, DTYPES[args.dtype], args.cpu_kernels)
    ppl, n = perplexity(model, tokenizer, texts, args.seq_len, args.batch_size, progress=True)
    print(f"{args.checkpoint_path}: {n} tokens evaluated, perplexity {ppl:.4f}")
    if args.draft:
        draft = load_model(args.draft, model.norm.weight.device, DTYPES[args.dtype], args.cpu_kernels)
        if draft.args.vocab_size != model.args.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the model's "
                             f"({model.args.vocab_size})")
        agreement = greedy_agreement(model, draft, tokenizer, texts, args.seq_len, args.batch_size)
        print(f"greedy agreement with {args.draft}: {agreement:.4f}")


if __name__ == "__main__":
    cli.run_main(main)
