"""Many requests at once: iteration-level scheduling (Orca, Yu et al. 2022) over the paged KV cache of paged.py.

Every step, finished requests leave and waiting ones join, as far as the pool keeps room for what the running ones
are expected to write. The rows that are decoding advance one token each in one forward pass (every weight read
once for all of them); prompts are prefilled in chunks within a token budget per step, so one long prompt never
holds the others up for its whole prefill. When the pool runs out of blocks, rows wait for one with their KV kept
while the others go on; only when none could go on does the newest running request give its blocks back and wait
to be recomputed (preemption). A prompt whose leading blocks some earlier request already filled starts from there
(prefix sharing). Each request keeps its own sampling options, stop strings, end-of-sequence ids and grammar."""
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from backend import Paged
from paged import BlockPool, block_hash
from sampling import NOT_FINITE, Sampling, logprobs, pick


@dataclass(eq=False)
class Request:
    """One prompt and how to continue it (its options, checked when built; stop strings cut the text before them);
    the engine fills in the rest. grammar: llguidance's text (from guided.grammars)."""
    prompt: list[int]
    sampling: Sampling = Sampling(temperature=0)
    eos_ids: tuple = ()
    grammar: Optional[str] = None
    out: list[int] = field(default_factory=list)  # the new tokens, without an end-of-sequence one
    finish_reason: Optional[str] = None  # "stop", "length", "incomplete" (see emit), "cancelled" or "error"; None
    # while it runs
    error: Optional[str] = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (the first admission's)
    blocks: list = field(default_factory=list)  # its block table
    hashes: list = field(default_factory=list)  # the content hash of each of its full blocks
    computed: int = 0  # tokens whose K and V are in its blocks
    times: dict = field(default_factory=dict)  # "arrived", "first" (token), "finished": time.perf_counter()
    matcher: object = None
    uniforms: Optional[list] = None  # one per new token, from its seed (sampling.py)
    keep: Optional[Callable] = None  # stop strings: (row, new tokens) -> the tokens to keep
    logprobs: list = field(default_factory=list)  # out[i]'s (log-probability, alternatives), if sampling.logprobs
    prompt_logprobs: list = field(default_factory=list)  # prompt[i]'s, if sampling.prompt_logprobs (None first)

    @property
    def tokens(self) -> list[int]:  # what its KV must hold before it samples the next token
        return self.prompt + self.out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def scoring(self) -> bool:  # its prompt's log-probabilities are still to compute: it shares no cached blocks
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)


class Engine:
    """The scheduler and its forward passes. model: a Transformer whose setup_caches was called (its RoPE table
    bounds the context); tokenizer: for stop strings and grammars. blocks x block_size: the pool (default: room
    for max_rows sequences of 40% of the context, and for one of all of it); max_rows: rows per step; budget:
    tokens per step."""

    def __init__(self, model, tokenizer=None, *, blocks: Optional[int] = None, block_size: int = 16,
                 max_rows: int = 64, budget: int = 512, kv_dtype: Optional[torch.dtype] = None):
        if max_rows < 1 or budget < max_rows:
            raise ValueError(f"max_rows must be at least 1 and budget at least max_rows, got {max_rows}, {budget}")
        self.model, self.tokenizer, self.max_rows, self.budget = model, tokenizer, max_rows, budget
        self.context = model.max_seq_length
        if not self.context:
            raise ValueError("the engine needs the model's RoPE table: call model.setup_caches first")
        blocks = blocks or max(max_rows * self.context * 2 // (5 * block_size), -(-self.context // block_size))
        self.pool = BlockPool(blocks, block_size)
        kv_dtype = kv_dtype or model.norm.weight.dtype
        self.passes = Paged(model, self.pool, kv_dtype, max_rows)  # how its forward passes run (backend.py)
        self.waiting: deque = deque()
        self.running: list[Request] = []
        self.grammar_tokenizer = None
        self.written = [0.0, 0.0]  # tokens that finished requests wrote, and their max_new_tokens, the latest
        # weighing most (each finish discounts the earlier ones by 2%: a server follows its traffic as it changes)
        self.computing: dict = {}  # hash of a full prompt block -> the admitted request that is computing it
        self.stats = dict(steps=0, prompt_tokens=0, cached_tokens=0, prefilled=0, generated=0, preempted=0,
                          waited=0, peak_blocks=0, decode_s=0.0, prefill_s=0.0)  # prefilled: tokens computed in
        # chunks; waited: decoding rows that waited a step for a block; prefill_s: the steps with prompt tokens (the
        # decoding rows in them as well: one pass), decode_s the others

    # ---- requests ------------------------------------------------------------------------------------------------

    def add(self, r: Request) -> Request:
        """Queue r; a request that can never run raises ValueError and leaves the engine as it was."""
        self.check(r)
        r.times["arrived"] = time.perf_counter()
        self.waiting.append(r)
        return r

    def check(self, r: Request):
        """ValueError if r can never run; else readies its grammar's matcher, its uniforms and its stop strings.
        Touches nothing else of the engine's (a server checks requests in its own threads)."""
        options = r.sampling
        if not r.prompt:
            raise ValueError("a prompt is empty")
        if len(r.prompt) + options.max_new_tokens > self.context:
            raise ValueError(f"prompt ({len(r.prompt)} tokens) + max_new_tokens ({options.max_new_tokens}) exceeds "
                             f"the context of {self.context} tokens")
        if -(-(len(r.prompt) + options.max_new_tokens) // self.pool.block_size) > self.pool.n_blocks:
            raise ValueError(f"the request needs more KV blocks than the pool holds ({self.pool.n_blocks})")
        vocab = self.model.args.vocab_size
        if options.logit_bias and max(t for t, _ in options.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names a token past the vocabulary (0..{vocab - 1})")
        if r.grammar is not None and r.matcher is None:
            r.matcher = self.matcher(r.grammar)
        if not options.greedy and r.uniforms is None:
            r.uniforms = options.uniforms()
        if options.stop:
            from cli import stop_strings
            r.keep = stop_strings(self.tokenizer, options.stop)

    def matcher(self, grammar: str):
        import guided
        llg = guided._llguidance()
        if self.grammar_tokenizer is None:  # (built once, before a server's threads check grammars)
            self.grammar_tokenizer = guided.llg_tokenizer(self.tokenizer, self.model.args.vocab_size)
        m = llg.LLMatcher(self.grammar_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the grammar cannot be used with this tokenizer: {m.get_error().splitlines()[0]}")
        return m

    def cancel(self, r: Request):
        """Stop r now, wherever it is; its blocks go back to the pool at once."""
        if r in self.waiting:
            self.waiting.remove(r)
        self.finish(r, "cancelled")

    def finish(self, r: Request, reason: str, error: Optional[str] = None):
        if r.finished:
            return
        r.finish_reason, r.error, r.times["finished"] = reason, error, time.perf_counter()
        if reason in ("stop", "length"):
            self.written = [0.98 * self.written[0] + len(r.out), 0.98 * self.written[1] + r.sampling.max_new_tokens]
        if r in self.running:
            self.running.remove(r)
        self.release(r)

    def release(self, r: Request):  # r's blocks back to the pool, and the blocks it was to fill to nobody
        self.pool.release(r.blocks)
        r.blocks, r.hashes, r.computed = [], [], 0
        for h in [h for h, owner in self.computing.items() if owner is r]:
            del self.computing[h]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (request, tokens to compute). Decoding rows first, one token each, with a block for it
        where it needs one, oldest first; then prefill chunks of the running requests and of newly admitted ones,
        oldest first, while budget and rows last."""
        short = self.give_blocks([r for r in self.running if self.decoding(r)])
        work = [(r, 1) for r in self.running if self.decoding(r) and r not in short]
        left = self.budget - len(work)
        for r in self.running:
            if left > 0 and not self.decoding(r):
                n = min(len(r.tokens) - r.computed, left)
                work.append((r, n))
                left -= n
        while self.waiting and left > 0 and len(self.running) < self.max_rows and self.admit(self.waiting[0]):
            r = self.waiting.popleft()
            self.running.append(r)
            n = min(len(r.tokens) - r.computed, left)
            work.append((r, n))
            left -= n
        return work

    def give_blocks(self, rows: list[Request]) -> list[Request]:
        """A block for each row whose blocks are full, oldest first: those the pool runs short for wait a step with
        their KV kept (the rows that go on finish and give theirs back), unless no running request could go on: then
        the newest gives its blocks back and is recomputed later (preemption). Returns the rows that wait."""
        short = [r for r in rows if r.computed == len(r.blocks) * self.pool.block_size]
        while short and self.pool.available():
            short.pop(0).blocks.append(self.pool.take())
        while short and len(short) == len(self.running):
            self.preempt(short.pop())
            while short and self.pool.available():
                short.pop(0).blocks.append(self.pool.take())
        self.stats["waited"] += len(short)
        return short

    def decoding(self, r: Request) -> bool:  # its next token's input is its last one
        return r.computed == len(r.tokens) - 1

    def admit(self, r: Request) -> bool:
        """Blocks for all of r's tokens: those its prefix shares with earlier requests, found by content, and new
        ones for the rest, if the pool has them and keeps a spare per running row and room for what the running
        rows and r are expected to write (growth)."""
        size, tokens = self.pool.block_size, r.tokens
        full = (len(tokens) - 1) // size  # the last token is always computed: its logits give the next one
        hashes, parent = [], 0
        for i in range(full):
            parent = block_hash(parent, tuple(tokens[i * size : (i + 1) * size]))
            hashes.append(parent)
        hits = 0
        while hits < full and not r.scoring and self.pool.by_hash.get(hashes[hits]) is not None:
            hits += 1  # (cached blocks hold K and V, not the logits a scoring request reads)
        if hits < full and not r.scoring and hashes[hits] in self.computing:  # another request is filling it: wait
            return False
        need = -(-len(tokens) // size) - hits
        cached = sum(1 for i in range(hits) if self.pool.refs[self.pool.by_hash[hashes[i]]] == 0)
        room = self.pool.available() - cached - need
        if room < len(self.running) or room < self.growth(r, need + hits):
            return False
        blocks = []
        for i in range(hits):
            block = self.pool.find(hashes[i], hashes[i - 1] if i else 0, tuple(tokens[i * size : (i + 1) * size]))
            if block is None:  # a hash that collided: compute from here
                break
            blocks.append(block)
        shared = len(blocks)
        r.blocks = blocks + [self.pool.take() for _ in range(-(-len(tokens) // size) - shared)]
        r.hashes, r.computed = hashes[:shared], shared * size
        self.computing.update((h, r) for h in hashes[shared:])
        if not r.out:  # the first admission's figures (a preempted request finds its own blocks)
            r.cached_tokens = r.computed
            self.stats["prompt_tokens"] += len(r.prompt)
            self.stats["cached_tokens"] += r.computed
        return True

    def growth(self, new: Request, blocks: int) -> int:
        """The most blocks the running requests and new (holding blocks once admitted) will need beyond those they
        hold at any step ahead, if each writes the share of its max_new_tokens that finished requests wrote, one
        token a step, and gives its own blocks back when done. Admitting only within it spares recomputation."""
        if not self.written[0]:
            return 0
        share, size = self.written[0] / self.written[1], self.pool.block_size
        steps = lambda r: math.ceil(share * (r.sampling.max_new_tokens - len(r.out)))  # noqa: E731
        rows = [(len(r.tokens), len(r.blocks), sum(1 for b in r.blocks if self.pool.refs[b] == 1), steps(r))
                for r in self.running]  # (tokens, blocks held, blocks freed when done, steps left)
        rows.append((len(new.tokens), blocks, blocks, steps(new)))
        most = 0
        for t in {left - 1 for *_, left in rows if left > 0}:  # just before a row is done: a peak
            most = max(most, sum(-(-(n + t) // size) - held if t < left else -own for n, held, own, left in rows))
        return most

    def preempt(self, r: Request):
        """Give r's blocks back and queue it first, to be recomputed: its tokens so far stay, so the recompute
        continues where it was (and finds its full blocks again while nothing has reused them)."""
        self.running.remove(r)
        self.release(r)
        self.waiting.appendleft(r)
        self.stats["preempted"] += 1

    # ---- a step ----------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule, run the forward passes, sample: the requests that got a token or finished this step."""
        work = self.schedule()
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.pool.in_use())
        if not work:
            return []
        self.stats["steps"] += 1
        t0 = time.perf_counter()
        last, scored = self.passes.step([(r.tokens[r.computed : r.computed + n], r.computed, r.blocks, r.scoring)
                                         for r, n in work])  # [P, V]: the logits after each part
        due = []  # the rows that get a token: their whole text is in the cache
        for i, (r, n) in enumerate(work):
            if scored[i] is not None:
                self.score(r, scored[i])
            if r.computed + n == len(r.tokens):
                due.append(i)
        # (the passes queue work on a GPU: there the time is rough) a step with prompt tokens counts as prefill
        prefilled = sum(n for r, n in work if not (n == 1 and self.decoding(r)))
        self.stats["prefill_s" if prefilled else "decode_s"] += time.perf_counter() - t0
        self.stats["prefilled"] += prefilled
        for r, n in work:
            r.computed += n
            self.register(r)
        rows = last if len(due) == len(work) else last[due]  # [N, V]
        due = [work[i][0] for i in due]
        if due:  # every row's check and pick together (sampling.pick), its grammar's mask applied first
            masks, ok = [self.allowed(r, rows.size(-1)) for r in due], None  # [V] bool, or None without a grammar
            if any(m is not None for m in masks):
                every = torch.ones(rows.size(-1), dtype=torch.bool, device=rows.device)
                ok = torch.stack([every if m is None else m for m in masks])
            u = [r.uniforms[len(r.out)] if r.uniforms else 0.0 for r in due]
            options = [r.sampling for r in due]
            seen = [(r.prompt, r.out) if r.sampling.adjusts else None for r in due]
            tokens = pick(rows, options, u, ok, seen)
            lps = self.logprobs(rows, due, tokens)
            for r, token, lp in zip(due, tokens, lps):
                self.emit(r, None if token == NOT_FINITE else token, lp)
        return due

    def logprobs(self, rows, due: list[Request], tokens: list[int]) -> list:  # rows [N, V] -> each row's or None
        asked = [i for i, r in enumerate(due) if r.sampling.logprobs is not None]
        if not asked:
            return [None] * len(due)
        k = max(due[i].sampling.logprobs for i in asked)
        got = dict(zip(asked, logprobs(rows[asked], [tokens[i] for i in asked], k)))
        return [(got[i][0], got[i][1][: r.sampling.logprobs]) if i in got else None for i, r in enumerate(due)]

    def score(self, r: Request, out):  # out [n, V]: the logits after each token of the chunk just computed
        """Note the log-probability of each prompt token that out predicts (the first token's: None)."""
        start = r.computed  # out[j]: the distribution of token start + j + 1
        if not r.prompt_logprobs:
            r.prompt_logprobs.append(None)
        a, b = len(r.prompt_logprobs), min(len(r.prompt), start + out.size(0) + 1)
        if b > a:
            r.prompt_logprobs += logprobs(out[a - 1 - start : b - 1 - start], r.prompt[a:b], r.sampling.prompt_logprobs)

    def allowed(self, r: Request, vocab: int):  # -> [V] bool, the tokens r's grammar allows now; None: no grammar
        import guided
        if r.matcher is None:
            return None
        bits = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        r.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), 4 * bits.size(1))
        return guided.allowed_tokens(bits.to(self.model.norm.weight.device), vocab)[0]

    def register(self, r: Request):  # its blocks filled this step, now shareable by content
        size, tokens = self.pool.block_size, r.tokens
        while len(r.hashes) < r.computed // size:
            i = len(r.hashes)
            parent = r.hashes[-1] if r.hashes else 0
            content = tuple(tokens[i * size : (i + 1) * size])
            r.hashes.append(block_hash(parent, content))
            self.pool.register(r.blocks[i], r.hashes[-1], parent, content)
            if self.computing.get(r.hashes[-1]) is r:
                del self.computing[r.hashes[-1]]

    def emit(self, r: Request, token: Optional[int], lp=None):
        """Give r its next token (None: its logits were not finite) and its logprobs (lp, where asked), and decide
        whether r is done."""
        if token is None:
            return self.finish(r, "error", "the model's logits became NaN or infinite: the weights or the dtype "
                                           "overflow; try the float32 dtype")
        r.times.setdefault("first", time.perf_counter())
        if r.matcher is not None and not r.matcher.consume_token(token):
            return self.finish(r, "error", f"the grammar rejected token {token}: {r.matcher.get_error()}")
        if token in r.eos_ids:
            return self.finish(r, "stop")
        r.out.append(token)
        if lp is not None:
            r.logprobs.append(lp)
        self.stats["generated"] += 1
        keep = r.keep(r.out, 1) if r.keep is not None else len(r.out)
        if keep < len(r.out):
            del r.out[keep:], r.logprobs[keep:]
            return self.finish(r, "stop")
        if r.matcher is not None and r.matcher.is_stopped():
            return self.finish(r, "stop")
        if len(r.out) >= r.sampling.max_new_tokens:  # "incomplete": cut before its grammar was satisfied
            self.finish(r, "incomplete" if r.matcher is not None and not r.matcher.is_accepting() else "length")

    def run(self, requests: list[Request], progress: Optional[Callable] = None) -> list[Request]:
        """Add every request and step until all are done; progress(request) as each finishes."""
        for r in requests:
            self.add(r)
        while self.has_work():
            for r in self.step():
                if r.finished and progress is not None:
                    progress(r)
        return requests
