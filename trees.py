"""Token-tree speculative decoding: a proposer guesses a tree of continuations, the target scores every node in one
forward pass (each token sees the context and its own ancestors, at the position its depth gives it), and the
longest path the target agrees with is kept, plus one token of the target's own. A chain of guesses is wasted
after its first miss; a tree spends the same pass on the alternatives (SpecInfer, Miao et al. 2024; EAGLE-2).

Proposers:
- Lookup: prompt lookup's chain (what followed the last earlier occurrence of the context's last n-gram).
- Suffix: the most frequent continuations of the context's longest matching suffix, from a suffix trie over all
  the text seen so far, the prompt and everything generated, across chat turns (SuffixDecoding, Oliaro et al.
  2024). No draft model; strong where the output repeats earlier text: editing code, quoting a document.
- DraftTree: a small draft model expanded top-k per level, only the nodes it is most confident in growing further
  (a dynamic tree, as EAGLE-2): alternatives where the draft hesitates, a long chain where it does not. Staged
  (Spector and Re 2023): the draft's own passes are speculated too, by a suffix trie's guess of what follows the
  draft's best node, so that where the text repeats one draft pass grows several levels.

Lossless: a node's children are tried in order, each accepted with the target's remaining probability of its token
and otherwise removed from that distribution (SpecInfer's multi-candidate rule, with deterministic candidates), so
every emitted token is an exact draw from the target; greedy keeps exactly the target's argmax path.

The tree's size is chosen by cost: a verify pass over n tokens is timed once per size, and each round takes the n
that maximises expected tokens per second, from the proposer's node scores scaled by how well they have predicted
acceptance so far."""
import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

import generate
from backend import Backend
from generate import Generation, device_sync, peak_memory_gb
from model import kv_bucket
from sampling import Sampling, pick


def reserve(models: list, T: int, max_new_tokens: int, extra: int, what: str, cached: int) -> int:
    """Set up each model's cache (None: skip) for the prompt, the new tokens and `extra` slots that a round writes
    past them (`what`, for the error), unless it holds them already; the length."""
    length = T + max_new_tokens + extra
    for m in [m for m in models if m is not None]:
        if length > m.args.block_size:
            raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) + {what} exceeds the maximum "
                             f"sequence length {m.args.block_size}")
        if m.max_batch_size < 1 or m.max_seq_length < length:
            if cached:
                raise ValueError(f"cached tokens need a cache set up to hold the prompt, the new tokens and {what}")
            m.setup_caches(1, length)
    return length


@dataclass
class Tree:
    """Node 0 is the root: the last emitted token, not yet in the target's cache. A node's parent comes before it,
    so its ancestors sit in earlier cache slots. scores[i]: the proposer's estimate that node i is accepted."""
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    scores: list[float] = field(default_factory=lambda: [1.0])
    kids: list[dict] = field(default_factory=lambda: [{}])

    def add(self, parent: int, token: int, score: float) -> int:
        if token in self.kids[parent]:  # the same guess twice is one node
            return self.kids[parent][token]
        self.tokens.append(token), self.parents.append(parent), self.scores.append(score), self.kids.append({})
        self.kids[parent][token] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i in range(1, len(d)):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestry(self) -> Tensor:  # [N, N] bool: [i, j] = node j is node i or one of its ancestors
        a = torch.eye(len(self.tokens), dtype=torch.bool)
        for i in range(1, len(self.tokens)):
            a[i] |= a[self.parents[i]]
        return a

    def best(self, n: int) -> tuple["Tree", list[int]]:
        """The n best-scored nodes as a tree, and their indices here. A child should never outscore its parent (ties
        go to the earlier node), so the n best hold every one's ancestors; a node whose parent is not among them
        (a proposer's scores that break the rule, a NaN) is left out."""
        best = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:n])
        new, where = Tree([self.tokens[0]]), {0: 0}
        for i in best[1:]:
            if self.parents[i] in where:
                where[i] = new.add(where[self.parents[i]], self.tokens[i], self.scores[i])
        return new, list(where)


def tree_inputs(tree: Tree, base: int, rows: range, kv_len: int, window: int, device) -> tuple[Tensor, Tensor]:
    """The mask [S, kv_len] and RoPE positions [S] of the tree's nodes `rows`, the tree in slots base, base + 1, ...:
    each node sees every slot before base (the context) and its ancestors' slots."""
    n, depth = len(tree.tokens), torch.tensor(tree.depths())
    mask = torch.zeros(len(rows), kv_len, dtype=torch.bool)
    mask[:, :base] = True
    mask[:, base : base + n] = tree.ancestry()[rows.start : rows.stop]
    pos = base + depth[rows.start : rows.stop]
    if window:  # a sliding window counts positions, and in a tree those are depths, not slots
        key = torch.arange(kv_len)
        key[base : base + n] = base + depth
        mask &= key > pos[:, None] - window
    return mask.to(device), pos.to(device)


def forward_nodes(backend: Backend, tree: Tree, base: int, rows: range, slots: Tensor) -> Tensor:
    """Run the tree's nodes `rows` through backend's model, writing their KV at slots base + row: the logits after
    each [S, V] (at batch 1 on the C++ step, its buffer: read them before its next pass)."""
    model, device = backend.model, slots.device
    kv_len = kv_bucket(base + len(tree.tokens), model.max_seq_length)
    mask, pos = tree_inputs(tree, base, rows, kv_len, model.args.sliding_window, device)
    tokens = torch.tensor([tree.tokens[rows.start : rows.stop]], device=device)
    return backend.verify(tokens, slots[base + rows.start : base + rows.stop], kv_len, mask, pos)


def walk(tree: Tree, logits: Tensor, options: Sampling, u: list[float]) -> tuple[list[int], int]:
    """The accepted path (node indices from the root) and the target's next token after it. logits [N, V]: the
    target's after each node. Every node's token is drawn as plain decoding draws it at the node's depth (u[d]:
    the uniform of the d-th token after the root), and the path follows the drawn tokens while they are children:
    what plain decoding writes, token for token, and each child kept with the target's probability of it."""
    depth = tree.depths()
    top = pick(logits, [options] * len(depth), [u[d] for d in depth])  # the round's one host sync
    path = [0]
    while top[path[-1]] in tree.kids[path[-1]]:
        path.append(tree.kids[path[-1]][top[path[-1]]])
    return path, top[path[-1]]


def path_to(tree: Tree, node: int) -> list[int]:
    """The tokens from the root's child down to node."""
    path = []
    while node:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def compact(model, base: int, nodes: list[int]):
    """Move the KV entries of the kept nodes (slots base + nodes, increasing) to slots base, base + 1, ... in place,
    so that the cache holds the accepted path as if it had been decoded token by token."""
    if nodes == list(range(len(nodes))):  # a path along the first branch is already in place
        return
    device = model.tok_embeddings.weight.device
    src, dst = torch.tensor(nodes, device=device) + base, torch.arange(len(nodes), device=device) + base
    for layer in model.layers:
        for cache in layer.attention.kv_cache.buffers():  # [B, H_kv, L + 1, D] and an int8 cache's scales [B, H_kv, L + 1]
            cache[:, :, dst] = cache[:, :, src]


# ---- proposers ---------------------------------------------------------------------------------------------------

def prompt_lookup(history: list[int], ngram: int, k: int) -> list[int]:
    """k tokens copied from after the most recent earlier occurrence of history's last n tokens, trying n = ngram
    first and shorter n-grams after it. The copy may run into the tokens it is producing, as in LZ77, so a
    repeating pattern is continued for all k tokens even when its period is short."""
    for n in range(min(ngram, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                return repeated(history[start + n :], k)
    return []


def repeated(seq: list[int], k: int) -> list[int]:
    """seq's first k tokens, seq repeated where it is shorter (a copy running into what it produces)."""
    while len(seq) < k:
        seq = seq + seq[: k - len(seq)]
    return seq[:k]


class Lookup:
    """Prompt lookup as a chain: what followed the most recent earlier occurrence of the context's last n-gram
    (what prompt_lookup finds), each guess scored below the one before it; the Sizer calibrates the scores. An
    index of every n-gram's latest end, brought up to the context as it grows, makes a round's lookup cost O(k)
    instead of a scan of the whole text."""

    def __init__(self, ngram: int = 3):
        self.ngram, self.seen, self.ends = ngram, [], {}  # ends: n-gram -> where it last ended, in seen[:-1]

    def observe(self, context: list[int]):
        if context[: len(self.seen)] != self.seen:  # another text
            self.seen, self.ends = [], {}
        for j in range(max(0, len(self.seen) - 1), len(context) - 1):  # the last token's n-grams wait for the next
            for n in range(1, min(self.ngram, j + 1) + 1):
                self.ends[tuple(context[j - n + 1 : j + 1])] = j
        self.seen = list(context)

    def propose(self, context: list[int], budget: int, worth: Optional[Callable] = None) -> Tree:
        self.observe(context)
        tree, k = Tree([context[-1]]), budget - 1
        for n in range(min(self.ngram, len(context) - 1), 0, -1):
            end = self.ends.get(tuple(context[-n:]))
            if end is not None:
                for i, token in enumerate(repeated(context[end + 1 :], k)):  # a shorter match is a weaker guess
                    tree.add(i, token, 0.9 ** ((i + 1) * self.ngram / n))
                break
        return tree

    def accepted(self, kept: list[int], tree: Tree, p: Optional[Tensor]):  # the next propose() reads the context
        pass


class Suffix:
    """A suffix trie over the text seen so far: a node per distinct substring of up to `depth` tokens, with the
    number of times it occurred. The context's longest suffix (up to `match` tokens) that occurred before with a
    continuation picks the subtree; its most frequent branches become the tree, scored by their relative frequency.
    Kept across generations (chat turns): a prompt that extends the text seen so far adds only its new part."""

    def __init__(self, match: int = 8, depth: int = 32):
        self.match, self.depth = match, depth
        self.kids, self.count, self.level = [{}], [0], [0]
        self.open: list[int] = []  # the nodes of the suffixes still shorter than depth, longest first
        self.seen: list[int] = []

    def extend(self, token: int):
        kids, count, level, grown = self.kids, self.count, self.level, []  # locals: this runs 32 times a token
        for node in self.open + [0]:
            child = kids[node].get(token)
            if child is None:
                child = kids[node][token] = len(kids)
                kids.append({}), count.append(0), level.append(level[node] + 1)
            count[child] += 1
            if level[child] < self.depth:
                grown.append(child)
        self.open = grown
        self.seen.append(token)

    def observe(self, context: list[int]):
        """Bring the trie up to context: its new tokens only, when it extends what was seen."""
        same = len(self.seen)
        if context[:same] != self.seen:  # another text: its suffixes start afresh, the counts stay
            self.open, self.seen = [], []
            same = 0
        for token in context[same:]:
            self.extend(token)

    def propose(self, context: list[int], budget: int, worth: Optional[Callable] = None) -> Tree:
        self.observe(context)
        tree = Tree([context[-1]])
        at = next((n for n in self.open + [0] if self.level[n] <= self.match and self.kids[n] and n), None)
        if at is None:
            return tree
        count, kids = self.count, self.kids
        total = lambda node: sum(count[c] for c in kids[node].values())  # noqa: E731
        # best first: (-score, trie node, tree parent, token), a node's score its parent's times its share of the
        # occurrences that went on; a node's best `budget` children are all the tree could take. The context's own
        # occurrence of the match has not gone on yet.
        heap = [(-count[c] / (count[at] - 1), c, 0, t) for t, c in self.top(at, budget)]
        heapq.heapify(heap)
        while heap and len(tree.tokens) < budget:
            score, node, parent, token = heapq.heappop(heap)
            i, below = tree.add(parent, token, -score), total(node)
            for t, c in self.top(node, budget - len(tree.tokens)):
                heapq.heappush(heap, (score * count[c] / below, c, i, t))
        return tree

    def top(self, node: int, k: int) -> list:  # node's k most frequent children, (token, trie node)
        kids = self.kids[node]
        return list(kids.items()) if len(kids) <= k else heapq.nlargest(k, kids.items(), key=lambda kv: self.count[kv[1]])

    def follow(self, path: list[int], k: int) -> list[int]:
        """Up to k tokens, each the most frequent next one, after the text seen so far followed by path (tokens not
        seen yet, as a draft's guesses are): from the longest suffix with a continuation, as propose starts."""
        for node in self.open + [0]:
            for t in path:
                node = self.kids[node].get(t)
                if node is None:
                    break
            if node and self.level[node] <= self.match and self.kids[node]:
                break
        else:
            return []
        guess = []
        while len(guess) < k and self.kids[node]:
            token, node = max(self.kids[node].items(), key=lambda kv: self.count[kv[1]])
            guess.append(token)
        return guess

    def accepted(self, kept: list[int], tree: Tree, p: Optional[Tensor]):  # the next propose() reads the context
        pass


class Lookahead:
    """Lookahead decoding (Fu et al. 2024), no draft model: Jacobi iteration guesses `window` tokens ahead, and the
    target, verifying them, also says what should follow each guess; n-grams from those answers (and from the text
    so far) fill a pool, and the pool's n-grams that start with the root become branches of the next tree, beside
    the improved guesses. Jacobi guesses alone rarely hold, but the n-grams they leave behind often do."""

    def __init__(self, window: int = 8, n: int = 4, per_key: int = 8):
        self.window, self.n, self.per_key = window, n, per_key
        self.guess: list[int] = []  # for the positions after the root
        self.pool: dict[int, list[tuple]] = {}  # first token -> the n - 1 tokens after it, most recent first
        self.seen = 0  # the context's tokens already in the pool

    def remember(self, gram: list[int]):
        grams = self.pool.setdefault(gram[0], [])
        if tuple(gram[1:]) in grams:
            grams.remove(tuple(gram[1:]))
        grams.insert(0, tuple(gram[1:]))
        del grams[self.per_key :]

    def propose(self, context: list[int], budget: int, worth: Optional[Callable] = None) -> Tree:
        self.seen = min(self.seen, len(context))
        for j in range(max(self.seen, self.n - 1), len(context)):
            self.remember(context[j - self.n + 1 : j + 1])
        self.seen = len(context)
        if len(self.guess) < self.window:  # to start, and after a long acceptance: the text's own tokens
            self.guess += context[-(self.window - len(self.guess)) :]
        tree = Tree([context[-1]])
        for gram in self.pool.get(context[-1], []):
            node = 0
            for i, t in enumerate(gram):
                node = tree.add(node, t, 0.5 ** (i + 1))
        node = 0
        for i, t in enumerate(self.guess):
            node = tree.add(node, t, 0.25 ** (i + 1))
        return tree

    def accepted(self, kept: list[int], tree: Tree, p: Optional[Tensor]):
        """The target's next token after the root and after each guess it saw: the Jacobi step. Its n-grams go to
        the pool, and what it says about the positions after this round's new root are the next guesses. Without
        a verify pass (p None: the round decoded one token plainly) the guesses move up a position."""
        if p is None:
            self.guess = self.guess[1:]
            return
        top, node, answer = p.argmax(-1).tolist(), 0, []
        for t in [None] + self.guess:
            node = node if t is None else tree.kids[node].get(t)
            if node is None:
                break
            answer.append(top[node])  # answer[i]: what follows the root and guesses[:i]
        for i in range(self.n - 1, len(answer)):
            self.remember(self.guess[i - self.n + 1 : i] + [answer[i]])
        self.guess = (answer + self.guess[len(answer) :])[len(kept) :]


class DraftTree:
    """A draft model grows the tree a level per pass: the top_k tokens after each node of the pass, of which the
    `width` the draft is most confident in (the product of its probabilities along the path) form the next pass, up
    to `depth` passes. staged (a Suffix over the text seen): each pass also runs that trie's guess of the `guess`
    tokens after the pass's best node, as a chain under it, scored by the draft's probabilities once the pass has
    run them; where the draft agrees with the guess, the next level starts below it, several levels deeper for one
    pass. The draft's cache follows the target's: after a round it keeps the accepted path."""

    def __init__(self, draft: Backend, top_k: int = 4, width: int = 4, depth: int = 6,
                 staged: Optional[Suffix] = None, guess: int = 4):
        self.draft, self.top_k, self.width, self.depth = draft, top_k, width, depth
        self.staged, self.guess = staged, guess if staged is not None else 0
        self.cached = 0  # the draft's cache holds the context's first `cached` tokens
        self.room = 1 + depth * (width + self.guess)  # cache slots a round writes past the root, at most
        self.pass_s = 0.0  # seconds per draft pass over a level

    def start(self, prompt: list[int], cached: int, slots: Tensor):
        T = len(prompt)
        idx = torch.tensor([prompt], device=slots.device)
        self.draft.begin()
        self.draft.prefill(idx[:, cached:], slots[cached:T], None, kv_bucket(T, self.draft.model.max_seq_length))
        self.cached, self.slots = T, slots

    def propose(self, context: list[int], budget: int, worth: Optional[Callable] = None) -> Tree:
        """worth(gain, seconds), if given, decides whether one more level (a draft pass, for the scores of the
        level it adds, in gain) is worth its time; otherwise the tree grows `depth` levels. Tokens the draft missed
        (rounds without a tree) it reads first, in one pass."""
        base = len(context) - 1  # the root's slot
        behind = Tree([context[self.cached]])  # the tokens the draft has not seen, as a chain ending at the root
        for i, token in enumerate(context[self.cached + 1 :]):
            behind.add(i, token, 1.0)
        t = time.perf_counter()
        p = forward_nodes(self.draft, behind, self.cached, range(len(behind.tokens)), self.slots)[-1:].softmax(-1)
        self.pass_s = self.pass_s or time.perf_counter() - t
        if self.staged is not None:
            self.staged.observe(context)
        tree, ran, leaves = Tree([context[-1]]), [0], []
        self.base, self.grown = base, {0}  # the nodes the draft has seen: their KV is in its cache
        for _ in range(self.depth):  # passes; staged, fewer may reach the depth
            top = p.topk(self.top_k, dim=-1)
            grown = sorted(((tree.scores[f] * q, f, t) for f, row_p, row_t in zip(ran, top.values.tolist(),
                            top.indices.tolist()) for q, t in zip(row_p, row_t) if t not in tree.kids[f]),
                           key=lambda c: -c[0])  # a guess the draft agrees with is a node already
            start = len(tree.tokens)
            frontier = [tree.add(f, t, s) for s, f, t in grown[: self.width]]  # one block of slots: run next
            leaves += grown[self.width :]
            path = path_to(tree, frontier[0]) if frontier else []
            gain = sum(s for s, _, _ in grown[: self.width])
            if not frontier or len(path) >= self.depth or worth and not worth(gain, self.pass_s):
                break
            guessed = self.guess_under(tree, frontier[0], path)
            t = time.perf_counter()
            p = forward_nodes(self.draft, tree, base, range(start, len(tree.tokens)), self.slots).softmax(-1)
            ran = list(range(start, len(tree.tokens)))
            self.grown |= set(ran)
            for i in guessed:  # the draft's probability of each guess, now that it has run them
                parent = tree.parents[i]
                tree.scores[i] = tree.scores[parent] * float(p[parent - start, tree.tokens[i]])
            self.pass_s = time.perf_counter() - t if not self.pass_s else 0.9 * self.pass_s + 0.1 * (
                time.perf_counter() - t)
        for s, f, t in leaves:  # never run by the draft; the round keeps the best-scored nodes of all
            tree.add(f, t, s)
        return tree

    def guess_under(self, tree: Tree, node: int, path: list[int]) -> list[int]:
        """Staged: the trie's guess of what follows node (path: its tokens after the root), added as a chain below
        it, no deeper than the tree may grow; the new nodes."""
        if self.staged is None:
            return []
        added = []
        for token in self.staged.follow(path, min(self.guess, self.depth - len(path))):
            node = tree.add(node, token, 0.0)  # scored once the pass has run it
            added.append(node)
        return added

    def accepted(self, kept: list[int], tree: Tree, p: Optional[Tensor]):
        """kept: the accepted path as this round's tree indices. The draft keeps the part of it that it has seen."""
        seen = 0
        while seen < len(kept) and kept[seen] in self.grown:
            seen += 1
        compact(self.draft.model, self.base, kept[:seen])
        self.cached = self.base + seen


# ---- the tree's size, by cost ------------------------------------------------------------------------------------

@dataclass
class Sizer:
    """Chooses how many of the proposer's nodes the target verifies. A verify pass over n nodes costs cost[n]
    seconds, timed once per size; a round yields 1 + alpha * (the sum of the kept nodes' scores) tokens, where alpha,
    accepted over predicted so far, calibrates the proposer's scores. Each round takes the n with the most tokens
    per second, counting the proposer's own time, and where even the best n loses to plain decoding the proposer
    sits the next rounds out (see pays)."""
    sizes: tuple = (1, 2, 4, 8, 16, 32, 64)
    cost: dict = field(default_factory=dict)
    kept: float = 0.0
    predicted: float = 0.0
    propose_s: float = 0.0
    round_tokens: float = 0.0
    round_s: float = 0.0
    passed: int = 0  # rounds that did not propose
    exploring: bool = False  # this round proposes although the last did not pay
    last: list = field(default_factory=list)  # the last tree's scores, best first
    plain_s: float = 0.0  # seconds per plain decode step, where measured (else cost[1] stands for it)

    def measure(self, backend: Backend, base: int, slots: Tensor, max_nodes: int, plain: bool = True):
        """Time a verify pass over a chain of each size (after a warm-up, which also compiles), at slot base, and
        the plain decode step, if plain."""
        model = backend.model
        for n in [s for s in self.sizes if s < max_nodes] + [max_nodes]:
            chain = Tree([0])
            for i in range(n - 1):
                chain.add(i, 0, 1.0)
            times = []
            for _ in range(3):
                device_sync(slots.device)
                t = time.perf_counter()
                forward_nodes(backend, chain, base, range(n), slots)
                device_sync(slots.device)
                times.append(time.perf_counter() - t)
            self.cost[n] = min(times[1:])
        times, one = [], torch.zeros(1, 1, dtype=torch.long, device=slots.device)
        for _ in range(3 if plain else 0):
            device_sync(slots.device)
            t = time.perf_counter()
            backend.decode(one, slots[base : base + 1], None, kv_bucket(base + 1, model.max_seq_length))
            device_sync(slots.device)
            times.append(time.perf_counter() - t)
        self.plain_s = min(times[1:], default=0.0)

    def alpha(self) -> float:
        return self.kept / self.predicted if self.predicted else 1.0

    def rate(self, scores: list[float], n: int) -> float:  # expected tokens per second verifying the n best
        return (1 + self.alpha() * sum(scores[: n - 1])) / (self.propose_s + self.cost[n])

    def pays(self) -> bool:
        """Whether to propose this round: whether a tree like the last one, at its best size and with the proposer's
        time, beats plain decoding. If not, every 8th round proposes anyway, so that a proposer that starts to
        guess well (the text turns repetitive) is noticed."""
        self.exploring = False
        plain_s = self.plain_s or self.cost.get(1)
        if not self.last or not plain_s or max(self.rate(self.last, n) for n in self.cost) * plain_s > 1:
            return True
        self.passed += 1
        self.exploring = self.passed % 8 == 0
        return self.exploring

    def choose(self, tree: Tree) -> int:
        self.last = scores = sorted(tree.scores[1:], reverse=True)
        sizes = [s for s in sorted(self.cost) if s <= len(tree.tokens)] or [min(self.cost)]
        best = max(sizes, key=lambda s: self.rate(scores, s))
        if best == 1 and self.exploring and len(sizes) > 1:  # a round proposed to learn: verify the guesses
            best = max(sizes[1:], key=lambda s: self.rate(scores, s))
        return min(len(tree.tokens), best)

    def worth(self, gain: float, seconds: float) -> bool:
        """Whether spending seconds more on proposing, for gain more expected score, pays at the recent rate."""
        return not self.round_s or self.alpha() * gain >= self.round_tokens / self.round_s * seconds

    def update(self, tree: Tree, kept: int, propose_s: Optional[float], round_s: float):
        """After a round: the tree verified, the tokens kept from it, the proposer's seconds (None: it sat out)."""
        ema = lambda old, new: new if not old else 0.9 * old + 0.1 * new  # noqa: E731
        if len(tree.tokens) > 1:  # a lone root predicts nothing
            self.kept, self.predicted = ema(self.kept, kept), ema(self.predicted, sum(tree.scores[1:]))
        if propose_s is not None:
            self.propose_s = ema(self.propose_s, propose_s)
        self.round_tokens, self.round_s = ema(self.round_tokens, kept + 1), ema(self.round_s, round_s)


@torch.inference_mode()  # as generate: the compiled steps are shared
def tree_generate(model, prompt: list[int], max_new_tokens: int, proposer, max_nodes: int = 32, *,
                  eos_ids=None, callback: Optional[Callable] = None, backend: Optional[Backend] = None,
                  stop: Optional[Callable] = None, cached: int = 0, sizer: Optional[Sizer] = None,
                  method: str = "tree", temperature: float = 0.0, top_k: Optional[int] = None, top_p: float = 1.0,
                  seed: Optional[int] = None) -> Generation:
    """Batch-1 generation, each round verifying a tree of up to max_nodes tokens from proposer (Lookup, Suffix,
    Lookahead or DraftTree). sizer: keeps the verify costs between calls (they are measured on the first); a
    choose.Chooser is both, and names each round's method itself. method: the name the metrics count the rounds
    that proposed under. eos_ids, callback, stop, cached and seed: as generate.generate; backend: how the target
    runs (backend.py; a DraftTree holds the draft's)."""
    if max_nodes < 1:
        raise ValueError(f"the tree needs at least 1 node, got {max_nodes}")
    options = Sampling(max_new_tokens, temperature, top_k, top_p, seed)
    backend = backend if backend is not None else Backend(model)
    device, T, draft = model.tok_embeddings.weight.device, len(prompt), getattr(proposer, "draft", None)
    # a round writes up to max_nodes slots past the last kept token (a draft's own tree may take more of its cache)
    length = reserve([model, draft.model if draft is not None else None], T, max_new_tokens, max(max_nodes, getattr(proposer, "room", 0)),
                     f"the tree ({max_nodes})", cached)
    slots = torch.arange(length, device=device)
    sizer = sizer if sizer is not None else Sizer()
    u = [0.0] * (max_new_tokens + length) if options.greedy else options.uniforms(max_new_tokens + length)
    backend.begin()
    device_sync(device)
    t0 = time.perf_counter()
    idx = torch.tensor([prompt], device=device)
    cur = pick(backend.prefill(idx[:, cached:], slots[cached:T], None, kv_bucket(T, model.max_seq_length)),
               [options], u[:1])[0]
    if draft is not None:
        proposer.start(prompt, cached, slots)
    device_sync(device)
    prefill_s = time.perf_counter() - t0
    if not sizer.cost:  # once, untimed; slots from T on are free until the first round writes them
        sizer.measure(backend, T, slots, max_nodes)
        t0 = time.perf_counter() - prefill_s
    answer, emitted, accepted, pos, proposed, sizes = generate.Answer(max_new_tokens, eos_ids, stop, callback), [cur], \
        [], T, 0, {}
    out, methods, made = answer.out, {}, None  # the new tokens after the first, by the method of the round that made them
    while True:
        answer.add(emitted, lambda t: made is not None and methods.__setitem__(made, methods.get(made, 0) + 1))
        if answer.round():
            break
        t = time.perf_counter()
        full = proposer.propose(prompt + out, max_nodes, sizer.worth) if sizer.pays() else None
        tree, kept = full.best(sizer.choose(full)) if full is not None else (Tree([out[-1]]), [0])
        t_verify = time.perf_counter()
        if len(tree.tokens) > 1:
            p = forward_nodes(backend, tree, pos, range(len(tree.tokens)), slots)  # [N, V]
            path, nxt = walk(tree, p, options, u[len(out):])
            compact(model, pos, path)
        else:  # nothing to verify: plain decoding's own step; a draft reads the tokens it missed next time
            path, p = [0], None
            logits = backend.decode(torch.tensor([[out[-1]]], device=device), slots[pos : pos + 1], None,
                                    kv_bucket(pos + 1, model.max_seq_length))
            nxt = pick(logits, [options], u[len(out) : len(out) + 1])[0]  # (NOT_FINITE: the next add's error)
        if full is not None:
            proposer.accepted([kept[i] for i in path], tree, p)
        sizer.update(tree, len(path) - 1, t_verify - t if full is not None else None, time.perf_counter() - t)
        accepted += [0] * (len(path) - len(accepted))
        accepted[len(path) - 1] += 1
        proposed += len(tree.tokens) - 1
        sizes[len(tree.tokens)] = sizes.get(len(tree.tokens), 0) + 1
        emitted = [tree.tokens[i] for i in path[1:]] + [nxt]
        made = getattr(sizer, "method", method) if len(tree.tokens) > 1 else "plain"
        pos += len(path)
    device_sync(device)
    decode_s = time.perf_counter() - t0 - prefill_s
    return Generation([generate.cut(out, eos_ids, stop)], T - cached, prefill_s, decode_s, len(out) - 1,
                      sum(accepted), peak_memory_gb(device), proposed, accepted, tree_sizes=dict(sorted(sizes.items())),
                      methods=methods)
