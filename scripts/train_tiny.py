"""Train the built-in models from scratch on the Python standard library: a SentencePiece tokenizer, then a
target and a draft Llama that share it, each written as a native checkpoint. Deterministic given --seed.

    python scripts/train_tiny.py --out_dir /tmp/retrain  # the shipped pair: about 75 minutes on 2 CPU cores
    python scripts/train_tiny.py --smoke --out_dir /tmp/tiny   # a few steps of a toy config, for tests
"""
import argparse
import io
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import checkpoint  # noqa: E402
import cli  # noqa: E402
from eval import perplexity, stdlib_files  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

# name: (model shape, training steps, peak learning rate). Batches are 16 x 256 tokens.
CONFIGS = {
    "target": (dict(dim=384, n_layer=8, n_head=6, n_kv_head=2, intermediate_size=1024), 800, 2e-3),
    # the draft has under 1/8 of the target's non-embedding parameters
    "draft": (dict(dim=192, n_layer=4, n_head=3, n_kv_head=1, intermediate_size=448), 1000, 3e-3),
}
SMOKE = {name: (dict(dim=32, n_layer=2, n_head=2, n_kv_head=1, intermediate_size=64), 12, 3e-3)
         for name in CONFIGS}
BLOCK_SIZE = 1024  # the models' context


def chunks(texts, max_chars=2000):
    """Whole lines in pieces of at most max_chars: SentencePiece trains on bounded 'sentences', and keeping the
    newlines inside them is what lets it learn code layout."""
    for text in texts:
        buf = ""
        for line in text.splitlines(keepends=True):
            if buf and len(buf) + len(line) > max_chars:
                yield buf
                buf = ""
            buf += line
        if buf:
            yield buf


def train_tokenizer(texts, vocab_size: int, path: Path) -> Tokenizer:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=chunks(texts), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, max_sentence_length=4096,
        # code: keep every space (indentation), no dummy prefix, newline as one token, digits split
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=["\n"],
        num_threads=1, minloglevel=2)  # one thread: the same merges on every run
    path.write_bytes(buf.getvalue())
    return Tokenizer(path)


def encode_corpus(tokenizer: Tokenizer, texts) -> torch.Tensor:  # -> [n_tokens] int64: BOS file EOS BOS file EOS ...
    return torch.tensor([i for t in texts for i in tokenizer.encode(t, bos=True) + [tokenizer.eos_id]])


def init_weights(model: Transformer):
    for name, p in model.named_parameters():
        if p.dim() == 1:
            continue  # RMSNorm gains stay 1
        std = 0.02
        if name.endswith(("wo.weight", "w2.weight")):  # residual outputs: keep the sum over layers at unit scale
            std /= math.sqrt(2 * model.args.n_layer)
        nn.init.normal_(p, 0.0, std)


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train(name, args: ModelArgs, data, steps, peak_lr, seed, batch_size, seq_len) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_body = n_params - model.tok_embeddings.weight.numel() * (1 if args.tie_embeddings else 2)
    print(f"{name}: {n_params / 1e6:.2f}M parameters ({n_body / 1e6:.2f}M without embeddings), {steps} steps")
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc=name, disable=None)  # on a terminal; in a log, a line every 20 steps
    for step in bar:
        starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
        batch = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])  # [B, seq_len + 1]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not bar.disable:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        elif step % 20 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - t0
            tps = (step + 1) * batch_size * seq_len / elapsed
            eta = elapsed / (step + 1) * (steps - step - 1)
            print(f"{name} step {step:5d}/{steps} loss {loss.item():.4f} lr {group['lr']:.2e} "
                  f"{tps:.0f} tokens/s ETA {eta / 60:.1f} min", flush=True)
    return model.eval()


def training_memory(args: ModelArgs, batch_size: int, seq_len: int) -> int:
    """Bytes, roughly: float32 weights, gradients and Adam's two moments, and the activations kept for the
    backward pass (per token and layer: the residual stream, norms, q/k/v, attention scores and the MLP)."""
    params = args.vocab_size * args.dim + args.n_layer * (4 * args.dim ** 2 + 3 * args.dim * args.intermediate_size)
    per_token = args.n_layer * (14 * args.dim + 4 * args.intermediate_size + 2 * args.n_head * seq_len)
    return 16 * params + 4 * batch_size * seq_len * (per_token + 3 * args.vocab_size)


def check_plan(args):
    """Everything that could stop the run, checked before the minutes of tokenizing and training."""
    cli.require([(259 < args.vocab_size <= 1_000_000, "--vocab_size must be between 260 and 1000000 (the 256 "
                  "bytes and three special pieces come first)"),
                 (args.seq_len <= BLOCK_SIZE, f"--seq_len must be at most {BLOCK_SIZE}, the models' context"),
                 (not args.out_dir.exists() or args.out_dir.is_dir(), f"--out_dir {args.out_dir} is not a directory")])
    for name, (shape, _, _) in (SMOKE if args.smoke else CONFIGS).items():
        checkpoint.check_writable(args.out_dir / f"stdlib-{name}", args.force, extra=["train.json"])
        need = training_memory(ModelArgs(vocab_size=args.vocab_size, **shape), args.batch_size, args.seq_len)
        if need > cli.available_memory():
            raise ValueError(f"training the {name} model at --batch_size {args.batch_size} --seq_len {args.seq_len} "
                             f"needs about {need / 1e9:.1f} GB, and {cli.available_memory() / 1e9:.1f} GB is "
                             f"available; lower --batch_size or --seq_len")


def save_checkpoint(model: Transformer, tokenizer_path: Path, out: Path, info: dict, force: bool):
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("output.weight")  # the same tensor as tok_embeddings.weight
    checkpoint.save(out, model.args, state, tokenizer_path, extra={"train.json": json.dumps(info, indent=2) + "\n"},
                    force=force)


def unigram_perplexity(train_ids: torch.Tensor, heldout_ids: torch.Tensor, vocab_size: int) -> float:
    """The baseline the models must beat by far: token frequencies of the training split, add-one smoothed."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[heldout_ids].mean().item())


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--out_dir", type=Path, default=ROOT / "checkpoints", help="writes stdlib-target/ and "
                   "stdlib-draft/ here")
    p.add_argument("--seed", type=int, default=0, help="seeds initialisation and batch order")
    p.add_argument("--vocab_size", type=cli.positive_int, default=8000, help="SentencePiece vocabulary size")
    p.add_argument("--batch_size", type=cli.positive_int, default=16, help="sequences per step")
    p.add_argument("--seq_len", type=cli.positive_int, default=256, help="tokens per training sequence")
    p.add_argument("--steps", type=cli.positive_int, help="override the number of steps of both models")
    p.add_argument("--smoke", action="store_true", help="toy model sizes and a few steps, in about a minute")
    p.add_argument("--force", action="store_true", help="replace checkpoints that an earlier run wrote in --out_dir")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads (default: the physical cores)")
    args = cli.one_line_errors(p).parse_args(argv)
    check_plan(args)
    cli.set_threads(args.threads, decode=False)
    t_start = time.perf_counter()
    train_texts = [f.read_text(encoding="utf-8") for f in stdlib_files("train")]
    heldout_texts = [f.read_text(encoding="utf-8") for f in stdlib_files("heldout")]
    if args.smoke:
        train_texts, heldout_texts = train_texts[:40], heldout_texts[:4]
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer never goes to --out_dir: a file there may be the user's
        tok_path = Path(tmp) / "tokenizer.model"
        try:
            tokenizer = train_tokenizer(train_texts, args.vocab_size, tok_path)
        except RuntimeError as e:  # e.g. a vocabulary larger than the corpus can fill
            raise ValueError(f"SentencePiece training failed: {cli.first_line(e)}") from None
        data = encode_corpus(tokenizer, train_texts)
        heldout = encode_corpus(tokenizer, heldout_texts)
        print(f"corpus: {len(train_texts)} train files ({len(data)} tokens), {len(heldout_texts)} held-out files "
              f"({len(heldout)} tokens), tokenizer {tokenizer.vocab_size} pieces")
        unigram = unigram_perplexity(data, heldout, tokenizer.vocab_size)
        for name, (shape, steps, lr) in (SMOKE if args.smoke else CONFIGS).items():
            steps = args.steps or steps
            margs = ModelArgs(vocab_size=tokenizer.vocab_size, block_size=BLOCK_SIZE, tie_embeddings=True, **shape)
            t0 = time.perf_counter()
            model = train(name, margs, data, steps, lr, args.seed, args.batch_size, args.seq_len)
            train_s = time.perf_counter() - t0
            ppl, n = perplexity(model, tokenizer, heldout_texts, seq_len=512)
            print(f"{name}: held-out perplexity {ppl:.3f} over {n} tokens (unigram baseline {unigram:.1f}), "
                  f"trained in {train_s / 60:.1f} min")
            info = dict(steps=steps, peak_lr=lr, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                        train_minutes=round(train_s / 60, 2), heldout_ppl_fp32=round(ppl, 4), heldout_tokens=n,
                        unigram_ppl=round(unigram, 2), train_tokens=len(data))
            save_checkpoint(model, tok_path, args.out_dir / f"stdlib-{name}", info, args.force)
    print(f"done in {(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    cli.run_main(main)
