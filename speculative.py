"""Speculative decoding: a cheap proposer guesses up to k tokens, the target scores all of them in one forward pass,
and the guesses are kept up to the first that is not the token the target draws there, by the rule and the uniform
plain decoding uses (sampling.py). So speculation never changes the output: greedy, or sampled with a seed, it is
plain decoding's token for token, and unseeded a draw from the same distribution. A deterministic guess (prompt
lookup, trees.py's trees) is kept with the target's probability of it, as under the rejection rule of Leviathan et
al. 2023; a sampled draft's somewhat less often. Proposers: a small draft model, or prompt lookup, which copies
what followed the most recent earlier occurrence of the context's last n-gram.

One target forward over a few positions costs about as much as one plain decode step when decoding is bound by
reading the weights (a GPU), but yields between 1 and k + 1 tokens. On a CPU each extra position costs real
arithmetic, which is why the rules here measure costs instead of assuming them. Which proposer pays depends on the
machine and the text, so by default (--speculate auto) each round takes the guess expected to pay best, among
these and the token trees of trees.py, or decodes plainly when none pays (choose.py)."""
import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch still imports: one line and status 130, as cli.run_main says later
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted", file=sys.stderr), os._exit(130)))

import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

import choose
import cli
import generate
import trees
from checkpoint import checkpoint_files, load_model, tokenizer_path
from backend import Backend
from generate import Generation, device_sync, peak_memory_gb
from sampling import NOT_FINITE, Sampling, pick
from guided import Guide
from model import Transformer, kv_bucket
from trees import prompt_lookup, reserve  # noqa: F401 (prompt_lookup: for callers)


def draft_step(draft: Backend, cur: Tensor, input_pos: Tensor, kv_len: int, options: Sampling, u: float,
               bits: Optional[Tensor] = None, sure: bool = False) -> tuple[int, float]:  # cur [1, 1], bits [1, W]
    """One draft token, drawn by the rule and the uniform the target's token there will be drawn with (so that a
    draft that agrees with the target proposes the target's token), and with sure, the draft's own probability of
    it, which the adaptive rule multiplies along the chain (else 1). bits: the grammar's mask, so that it proposes
    allowed tokens."""
    logits = draft.decode(cur, input_pos, None, kv_len)  # [1, V]
    token = pick(logits, [options], [u], generate.allowed(bits, logits.size(-1)))[0]
    return token, float(torch.softmax(logits[0].float(), -1)[max(token, 0)]) if sure else 1.0


@dataclass
class Threshold:
    """Threshold decoding: keep drafting while the draft's cumulative probability of its guesses is at least tau.
    After each round tau moves so that the last drafted token is accepted about as often as it breaks even.
    Drafting it, and verifying one more position, costs c seconds, in which the current rate r (tokens per
    second) would have earned r * c tokens; so it pays when accepted with probability above r * c. Costs and
    rate are measured as the generation runs, so the rule fits the device and the text in hand."""
    tau: float = 0.5
    step: float = 0.2  # how far log(tau) moves per round
    draft_s: float = 0.0  # seconds per draft step
    verify_s: dict = field(default_factory=dict)  # positions verified -> seconds
    round_tokens: float = 0.0
    round_s: float = 0.0

    def breakeven(self) -> float:  # the acceptance probability at which one more draft token pays for itself
        sizes = sorted(self.verify_s)
        per_position = 0.0  # unknown until two sizes are seen: optimism makes the rule try longer drafts
        if len(sizes) > 1:
            per_position = max(0.0, (self.verify_s[sizes[-1]] - self.verify_s[sizes[0]]) / (sizes[-1] - sizes[0]))
        return self.round_tokens / self.round_s * (self.draft_s + per_position)

    def update(self, drafted: int, kept: int, draft_s: float, verify_s: float, round_s: float):
        ema = lambda old, new: new if not old else 0.9 * old + 0.1 * new
        self.draft_s = ema(self.draft_s, draft_s / drafted)
        self.verify_s[drafted + 1] = ema(self.verify_s.get(drafted + 1), verify_s)
        self.round_tokens, self.round_s = ema(self.round_tokens, kept + 1), ema(self.round_s, round_s)
        last_kept = float(kept == drafted)
        self.tau = min(1.0, max(1e-4, self.tau * math.exp(self.step * (self.breakeven() - last_kept))))


@torch.inference_mode()  # as generate
def speculative_generate(model, prompt: list[int], max_new_tokens: int, k: int, *, draft=None,
                         ngram: Optional[int] = None, adaptive: bool = False, eos_ids=None,
                         callback: Optional[Callable] = None, backend: Optional[Backend] = None,
                         draft_backend: Optional[Backend] = None, agree: Optional[Callable] = None,
                         stop: Optional[Callable] = None, cached: int = 0, guide: Optional[Guide] = None,
                         temperature: float = 0.0, top_k: Optional[int] = None, top_p: float = 1.0,
                         seed: Optional[int] = None) -> Generation:
    """Batch-1 generation with a draft model (draft=...) or prompt lookup (ngram=...) proposing up to k tokens a
    round; with adaptive=True the draft's length is chosen each round by threshold decoding. A guess is kept while
    it is the token the target draws there (sampling.py: the same rule and uniform as plain decoding), so the output
    is plain decoding's, token for token, greedy or seeded. callback, if given, sees the new tokens after every
    round. agree(values) -> values, if given, averages the adaptive rule's timings over tensor-parallel ranks, so
    that every rank drafts alike. eos_ids, stop, cached and seed: as generate.generate; backend and draft_backend:
    how each model runs (backend.py). guide: the output matches its grammar. Tokens the grammar forces are output
    as they are and fed to the target ahead of the proposals, in the same pass; proposals stop at the first token
    the grammar rejects (a draft model proposes under the grammar's mask), and the target draws under the mask."""
    if k < 1:
        raise ValueError(f"speculate_k must be at least 1, got {k}")
    if (draft is None) == (ngram is None):
        raise ValueError("speculation needs exactly one proposer: a draft model or prompt lookup")
    options = Sampling(max_new_tokens, temperature, top_k, top_p, seed)
    backend = backend if backend is not None else Backend(model)
    drafter = None if draft is None else draft_backend if draft_backend is not None else Backend(draft)
    device, T, V = model.tok_embeddings.weight.device, len(prompt), model.args.vocab_size
    # a verify pass writes up to k + 1 cache slots past the last kept token
    length = reserve([model, draft], T, max_new_tokens, k + 1, f"speculate_k ({k}) + 1", cached)
    for b in (backend, drafter):
        if b is not None:
            b.begin()
    u = [0.0] * (max_new_tokens + k + 1) if options.greedy else options.uniforms(max_new_tokens + k + 1)
    rule = Threshold() if adaptive and draft is not None else None
    slots = torch.arange(length, device=device)  # positions are slices of this: no allocation or copy per step
    bits = torch.empty(k + 1, guide.words, dtype=torch.int32, device=device) if guide else None
    upload = lambda host: host if device.type == "cpu" else bits[: host.size(0)].copy_(host, non_blocking=True)
    idx = torch.tensor([prompt], device=device)
    if guide is not None:
        guide.reset()
    device_sync(device)
    t0 = time.perf_counter()
    mask = guide.fill_async() if guide is not None else None  # while prefill runs
    logits = backend.prefill(idx[:, cached:], slots[cached:T], None, kv_bucket(T, model.max_seq_length))
    cur = pick(logits, [options], u[:1], None if mask is None else generate.allowed(upload(mask.result()), V))[0]
    if draft is not None:
        drafter.prefill(idx[:, cached:], slots[cached:T], None, kv_bucket(T, draft.max_seq_length))
    device_sync(device)
    prefill_s = time.perf_counter() - t0
    answer, emitted, accepted, drafted = generate.Answer(max_new_tokens, eos_ids, stop, callback), [cur], [0] * (k + 1), 0
    out, eos = answer.out, answer.eos
    consume = (lambda t: t not in eos and (guide.consume(0, t) or guide.complete(0))) if guide is not None else None
    pos = T  # the cache slot of `cur`, the last emitted token, which the target has not seen yet
    while True:
        answer.add(emitted, consume)
        forced = guide.fast_forward(0, min(k, max_new_tokens - len(out))) if guide and not answer.done else []
        out += forced  # output as they are, and fed to the target (and the draft) ahead of this round's proposals
        answer.done |= bool(forced) and (len(out) >= max_new_tokens or guide.complete(0))
        if answer.round():
            break
        f, t_round, masks, n_out = len(forced), time.perf_counter(), None, len(out)
        proposed = []
        if draft is not None:
            t, cum = torch.tensor([[cur]], device=device), 1.0
            for j, token in enumerate(forced):  # the draft reads the forced tokens; its guesses there are moot
                drafter.decode(t, slots[pos + j : pos + j + 1], None, kv_bucket(pos + j + 1, draft.max_seq_length))
                t = torch.tensor([[token]], device=device)
            while len(proposed) < k - f and (rule is None or cum >= rule.tau or not proposed):
                m = len(proposed)
                mask = guide.mask_row(m) if guide is not None else None  # [1, W]: the grammar after m proposals
                if guide is not None and guide.complete(0):
                    break
                nxt, conf = draft_step(drafter, t, slots[pos + f + m : pos + f + m + 1],
                                       kv_bucket(pos + f + m + 1, draft.max_seq_length), options, u[n_out + m],
                                       upload(mask) if mask is not None else None, rule is not None)
                if nxt == NOT_FINITE:
                    break  # a damaged draft proposes nothing more; the target decides
                proposed.append(nxt)
                t = torch.tensor([[nxt]], device=device)
                if guide is not None:
                    guide.consume(0, nxt)  # the mask allowed it
                cum *= conf  # (the adaptive rule's: when to stop drafting)
            if guide is not None:
                masks = guide.rollback(len(proposed))  # [m + 1, W]
        else:  # a miss still proposes one token, so that verify sees at least two positions and compiles once
            proposed = (prompt_lookup(prompt + out, ngram, k - f) or out[-1:])[: k - f]
            if guide is not None:  # up to the first token the grammar rejects
                n_ok, masks = guide.along(proposed)
                proposed = proposed[:n_ok]
        m = len(proposed)
        t_verify = time.perf_counter()
        tokens = torch.tensor([[cur, *forced, *proposed]], device=device)
        logits = backend.verify(tokens, slots[pos : pos + f + m + 1], kv_bucket(pos + f + m + 1, model.max_seq_length))
        picks = pick(logits[-(m + 1):], [options] * (m + 1), u[n_out : n_out + m + 1],  # the round's one host sync
                     None if masks is None else generate.allowed(upload(masks), V))
        n = next((j for j in range(m) if picks[j] != proposed[j]), m)  # the guesses the target draws too
        cur = picks[n]  # (NOT_FINITE ends the next round's add with the error)
        t_accept = time.perf_counter()
        if draft is not None and n == m:  # the draft never saw t, its own last proposal: put it in its cache
            drafter.decode(t, slots[pos + f + m : pos + f + m + 1], None,
                           kv_bucket(pos + f + m + 1, draft.max_seq_length))
        if rule is not None and m > 0:  # under tensor parallelism every rank must draft alike: they share timings
            times = [t_verify - t_round, t_accept - t_verify, time.perf_counter() - t_round]
            rule.update(m, n, *(agree(times) if agree else times))
        accepted[n] += 1
        drafted += m
        emitted = proposed[:n] + [cur]
        pos += f + n + 1
    device_sync(device)
    decode_s = time.perf_counter() - t0 - prefill_s
    n_new = len(out)
    incomplete = [0] if guide is not None and n_new >= max_new_tokens and not eos & set(out) and guide.incomplete(0) \
        else []
    return Generation([generate.cut(out, eos_ids, stop)], T - cached, prefill_s, decode_s, n_new - 1, sum(accepted),
                      peak_memory_gb(device), drafted, accepted, guide.forced if guide else None, incomplete,
                      methods={"draft" if draft is not None else "lookup": n_new - 1} if n_new > 1 else {})


# ---- command line: generate.py's, with a proposer -----------------------------------------------------------------

def load_draft(path, target_dir: Path, model: Transformer, device, dtype, cpu_kernels: str = "auto") -> Transformer:
    """The draft model, checked to share the target's tokenizer and vocabulary."""
    draft_dir, _ = checkpoint_files(path)
    tok = tokenizer_path(draft_dir)
    if not tok.is_file() or tok.read_bytes() != tokenizer_path(target_dir).read_bytes():
        raise ValueError(f"the draft's tokenizer ({tok}) differs from the target's")
    draft = load_model(path, device, dtype, cpu_kernels)
    if draft.args.vocab_size != model.args.vocab_size:
        raise ValueError(f"the draft's vocab_size {draft.args.vocab_size} differs from the target's "
                         f"{model.args.vocab_size}")
    return draft


SPECULATE = ("auto", "draft", "tree", "staged", "lookup", "suffix", "lookahead")  # staged: a tree with a trie's guesses


def make_loop(model: Transformer, *, max_new_tokens: int, speculate: Optional[str] = "auto", draft=None,
              speculate_k: int = 4, ngram: Optional[int] = 3, adaptive: bool = True, max_nodes: int = 32,
              guide: Optional[Guide] = None, backend: Optional[Backend] = None,
              draft_backend: Optional[Backend] = None, parallel=None, chooser: Optional[choose.Chooser] = None,
              **sampling) -> Callable:
    """The decoding loop asked for: loop(prompts, eos_ids=None, callback=None, stop=None, cached=0, seeds=None) ->
    Generation (seeds: one a prompt). backend and draft_backend: how the target and the draft run (backend.py).
    speculate: "auto" (the default: each round the guess expected to pay best, among prompt lookup, lookahead
    and, with a draft model, its chain, tree and staged tree, or plain decoding when none pays; see
    choose.Chooser), None or "plain" (plain decoding, any batch), or one batch-1 proposer: "draft" (a chain from
    the draft model, its length chosen each round if adaptive), "tree" and "staged" (token trees from the draft
    model), "lookup" (prompt lookup over ngram tokens), "suffix" or "lookahead" (token trees without a draft
    model). "auto" decodes plainly with a grammar (guide) and for batches of more than one prompt; under tensor
    parallelism (parallel) it runs the draft's chain, whose timings the ranks share, or without a draft decodes
    plainly. The loop keeps its proposers and measured costs from call to call (a chat's turns), and so does a
    chooser passed in (choose.auto's) from loop to loop; under tensor parallelism the draft is on every rank."""
    speculate = None if speculate == "plain" else speculate
    if speculate is not None and speculate not in SPECULATE:
        raise ValueError(f"unknown speculate {speculate!r}; use one of plain, {', '.join(SPECULATE)}")
    if speculate in ("draft", "tree", "staged") and draft is None:
        raise ValueError(f"speculate={speculate!r} needs a draft model")
    if draft is not None and speculate not in ("auto", "draft", "tree", "staged"):
        raise ValueError("a draft model is used only with speculate='auto', 'draft', 'tree' or 'staged'")
    if speculate == "auto" and parallel:  # each rank would choose from its own timings: the chain agrees on them
        speculate = "draft" if draft is not None else None
    if speculate == "auto" and guide is not None:
        speculate = None
    as_tree = speculate in ("tree", "staged", "suffix", "lookahead")
    if as_tree and guide is not None:
        raise ValueError("token trees do not support guided generation; use speculate='draft' or 'lookup'")
    if as_tree and parallel:  # each rank would choose the tree's size from its own timings
        raise ValueError("token trees are not supported with tensor parallelism")
    backend = backend if backend is not None else Backend(model)
    if draft is not None and draft_backend is None:
        draft_backend = Backend(draft, backend.compiled)
    if speculate is None:
        return generate.plain_loop(model, max_new_tokens=max_new_tokens, guide=guide, backend=backend, **sampling)

    def batch_of_one(prompts: list[list[int]]) -> list[int]:
        if len(prompts) != 1:
            raise ValueError(f"speculative decoding takes one prompt at a time, got {len(prompts)}")
        return prompts[0]
    seed = lambda seeds: {"seed": seeds[0]} if seeds else {}  # noqa: E731
    if speculate == "auto":  # one chooser, with its measured costs and rates, for every call
        chooser, plain = chooser or choose.auto(draft_backend, ngram or 3), generate.plain_loop(
            model, max_new_tokens=max_new_tokens, backend=backend, **sampling)
        return lambda prompts, eos_ids=None, callback=None, stop=None, cached=0, seeds=None: trees.tree_generate(
            model, prompts[0], max_new_tokens, chooser, max_nodes, eos_ids=eos_ids, callback=callback,
            backend=backend, stop=stop, cached=cached, sizer=chooser, **sampling, **seed(seeds)) \
            if len(prompts) == 1 else plain(prompts, eos_ids, callback, stop, cached, seeds)
    if as_tree:  # one proposer and one set of measured costs for every call
        sizer = trees.Sizer()
        proposer = trees.DraftTree(draft_backend, staged=trees.Suffix() if speculate == "staged" else None) \
            if draft is not None else trees.Suffix() if speculate == "suffix" else trees.Lookahead()
        return lambda prompts, eos_ids=None, callback=None, stop=None, cached=0, seeds=None: trees.tree_generate(
            model, batch_of_one(prompts), max_new_tokens, proposer, max_nodes, eos_ids=eos_ids, callback=callback,
            backend=backend, stop=stop, cached=cached, sizer=sizer, method=speculate, **sampling, **seed(seeds))
    agree = (lambda values: parallel.sum(values, mean=True)) if parallel else None
    return lambda prompts, eos_ids=None, callback=None, stop=None, cached=0, seeds=None: speculative_generate(
        model, batch_of_one(prompts), max_new_tokens, speculate_k, draft=draft,
        ngram=(ngram or 3) if speculate == "lookup" else None, adaptive=adaptive, eos_ids=eos_ids, callback=callback,
        backend=backend, draft_backend=draft_backend, agree=agree, stop=stop, cached=cached, guide=guide,
        **sampling, **seed(seeds))


def speculate_of(args) -> str:
    """The method the command line's flags ask for (see make_loop): a forcing flag's, else --speculate's."""
    return "staged" if args.staged else "tree" if args.tree else "draft" if args.fixed_k else "lookup" \
        if args.prompt_lookup else "suffix" if args.suffix else "lookahead" if args.lookahead else args.speculate


def parser():
    p = cli.generate_parser(__doc__)
    p.add_argument("--speculate", default="auto", choices=SPECULATE + ("plain",), help="auto (the default): each "
                   "round the guess expected to pay best, or plain decoding when none does (and always with "
                   "a grammar or a batch); or one method forced: draft (the draft model's chain), tree, staged, "
                   "lookup, suffix, lookahead, or plain")
    p.add_argument("--draft_checkpoint_path", type=Path, help="a small draft model with the same tokenizer: "
                   "its chain and trees join auto's candidates (or --speculate draft, --tree, --staged force one)")
    p.add_argument("--prompt_lookup", type=cli.positive_int, metavar="N", help="no draft model: propose the tokens that "
                   "followed the last earlier occurrence of the context's last N tokens")
    p.add_argument("--speculate_k", type=cli.positive_int, default=5, help="with --speculate draft or "
                   "--prompt_lookup: the most tokens proposed per verify pass; a draft stops earlier when it grows "
                   "unsure, unless --fixed_k")
    p.add_argument("--fixed_k", action="store_true", help="the draft model's chain, always --speculate_k tokens")
    p.add_argument("--tree", action="store_true", help="with --draft_checkpoint_path: the draft proposes a tree (its "
                   "top 4 tokens after each node, the likeliest grown further) instead of a chain")
    p.add_argument("--staged", action="store_true", help="with --tree: each draft pass also runs a guess of what "
                   "follows, from a suffix trie over the text seen, so that where the text repeats one pass grows "
                   "several levels (staged speculation)")
    p.add_argument("--suffix", action="store_true", help="no draft model: propose a tree of the most frequent "
                   "continuations of the context's longest earlier match, from all text seen (the prompt, the output "
                   "and earlier chat turns)")
    p.add_argument("--lookahead", action="store_true", help="no draft model: Jacobi iteration guesses tokens ahead, "
                   "and n-grams from the target's answers and the text propose a tree (lookahead decoding)")
    p.add_argument("--max_nodes", type=cli.positive_int, default=32, help="with auto, --tree, --suffix or --lookahead: "
                   "the most tokens verified per pass; each pass takes the size that measured costs and acceptance "
                   "so far favour")
    return p


def parse_args(argv=None):
    p = parser()
    args = cli.parse_generate_args(argv, p)
    checks = [(not (args.draft_checkpoint_path and args.prompt_lookup), "use --draft_checkpoint_path or "
               "--prompt_lookup, not both"),
              (not args.fixed_k or args.draft_checkpoint_path, "--fixed_k needs --draft_checkpoint_path"),
              (args.batch_size == 1 or not (args.draft_checkpoint_path or args.prompt_lookup or args.suffix
                                            or args.lookahead or args.speculate not in ("auto", "plain")),
               "speculative decoding supports batch size 1 only"),
              (not args.tree or args.draft_checkpoint_path, "--tree needs --draft_checkpoint_path"),
              (not args.staged or args.tree, "--staged needs --tree"),
              (sum(map(bool, (args.suffix, args.lookahead, args.draft_checkpoint_path or args.prompt_lookup))) < 2,
               "--suffix and --lookahead need no other proposer: use one, without --draft_checkpoint_path or "
               "--prompt_lookup"),
              (not (args.tree or args.suffix or args.lookahead) or not args.fixed_k,
               "--fixed_k applies to a chain draft, not a tree"),
              (speculate_of(args) not in ("tree", "staged", "suffix", "lookahead") or not args.guides,
               "token trees do not support guided generation; use a chain draft or --prompt_lookup")]
    checks += [(speculate_of(args) not in ("draft", "tree", "staged") or args.draft_checkpoint_path,
                f"--speculate {speculate_of(args)} needs --draft_checkpoint_path"),
               (args.speculate in ("auto", speculate_of(args)), f"--speculate {args.speculate} and the flag forcing "
                f"{speculate_of(args)} ask for two methods; give one"),
               (speculate_of(args) != "plain" or not args.draft_checkpoint_path,
                "--speculate plain uses no draft model")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    return args


def main(argv=None):
    run_parsed(parse_args(argv))


def run_parsed(args, parallel=None):
    """generate.run for the parsed options, with their proposer (tp.py passes its ranks in parallel)."""
    def loop(model, **options):  # the draft, loaded after the target, on its device and in its dtype
        draft = load_draft(args.draft_checkpoint_path, checkpoint_files(args.checkpoint_path)[0], model,
                           model.norm.weight.device, model.norm.weight.dtype, args.cpu_kernels) \
            if args.draft_checkpoint_path else None
        return make_loop(model, speculate=speculate_of(args), draft=draft, speculate_k=args.speculate_k,
                         ngram=args.prompt_lookup, adaptive=not args.fixed_k, max_nodes=args.max_nodes, **options)
    generate.run(**cli.run_options(args), make_loop=loop, speculate_k=args.speculate_k, parallel=parallel)


if __name__ == "__main__":
    cli.run_main(main)
