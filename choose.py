"""Speculation that chooses its method itself. Proposers without a draft model cost next to nothing to ask, so every
round asks them all, and once the text has gone on, scores every guess against what came: each is judged on every
round, verified or not, and the round verifies the guess of the one that has lately yielded the most tokens per
second, or decodes plainly when none beats that. A draft model's passes cost real time, so its methods are tried
now and then, and run while they yield more than the rest."""
import bisect
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional

from torch import Tensor

from trees import DraftTree, Lookahead, Lookup, Sizer, Suffix, Tree, forward_nodes


class Chooser:
    """Candidate proposers (name -> Lookup, Suffix, Lookahead or DraftTree) behind the proposer and sizer interfaces of
    trees.tree_generate; each round's pick is `method`. The verify costs, measured once, are shared; each draft
    candidate has its own Sizer, which picks how many of its nodes to verify.

    Cheap candidates (no draft model): every round each proposes, and its guess waits until the text has gone past
    it. Then, for each size the verify costs were measured at, the tokens it would have had kept cut to that size
    (the nodes the text follows among its best-scored ones) and the sum of those nodes' scores go into running
    averages (plain means over the first 1 / weight guesses, so that the first guess weighs no more than the next): their ratio, alpha, calibrates the candidate's scores at that size. A round's guess cut to a size is
    expected to yield 1 + alpha x its scores, in the verify cost of that size plus the rounds' measured overhead;
    the round verifies the guess and size expected to yield the most tokens per second if that beats plain
    decoding's measured round by `margin`, else it decodes plainly. Nothing needs exploring: a candidate that sat
    out is judged all the same. (With sampling the text that came is one draw, so a tree's alternatives are
    undercounted a little.)

    Draft candidates are tried `trial` rounds at a time, from round 16 on, in rounds where no cheap guess pays, if
    the best they could do (every guess kept, one draft pass a level) beats the latest rounds without them and plain
    decoding. One runs a round while its tokens per second over its rounds (by the clock) beats those and any
    cheap guess that pays; one that falls behind waits `retry` rounds for its next trial, twice as long after every
    trial it loses, up to `longest`, and the draft model's other methods wait as long. Candidates that sat a round
    out stay correct: suffix tries and n-gram pools read the context when next asked, Lookahead's guesses are
    dropped (their positions have passed), and draft trees on one draft model share its cache position."""

    def __init__(self, candidates: dict, retry: int = 16, longest: int = 256, weight: float = 0.1, trial: int = 2,
                 margin: float = 1.25):
        if not candidates:
            raise ValueError("the chooser needs at least one proposer")
        self.retry, self.longest, self.weight, self.trial, self.margin = retry, longest, weight, trial, margin
        self.cheap = {n: p for n, p in candidates.items() if not isinstance(p, DraftTree)}
        self.drafts = {n: p for n, p in candidates.items() if isinstance(p, DraftTree)}
        self.cost: dict = {}  # nodes verified -> seconds, shared by every candidate's Sizer
        self.sizers = {name: Sizer(cost=self.cost) for name in self.drafts}  # a draft tree's size, as forced
        self.kept: dict = {}  # (cheap candidate, size) -> average tokens its guesses cut to size had kept
        self.predicted: dict = {}  # (cheap candidate, size) -> and the average sum of their scores
        self.judged: dict = {}  # (cheap candidate, size) -> how many of its guesses were judged
        self.pending: list = []  # the cheap candidates' Guesses the text has not gone past yet
        self.rates: dict = {}  # draft candidate -> tokens per second over its rounds, once it has run
        self.wait, self.due = dict.fromkeys(self.drafts, retry), dict.fromkeys(self.drafts, 16)  # trials: spacing, next
        self.rounds, self.method, self.trying, self.left, self.recent = 0, "plain", "", 0, 0.0  # recent: tokens/s
        # of the latest rounds without a draft, by the clock
        self.plain_s = self.draft_s = self.ask_s = self.extra_s = 0.0  # a plain round's, a draft pass's, asking's,
        self.room = max([p.room for p in self.drafts.values()], default=0)  # and a verify round's overhead, seconds

    def start(self, prompt: list[int], cached: int, slots: Tensor):
        first, *others = self.drafts.values()  # one draft model: one prefill for all
        first.start(prompt, cached, slots)
        for p in others:
            p.cached, p.slots = first.cached, slots

    @property
    def draft(self):
        return next(iter(self.drafts.values())).draft if self.drafts else None

    def measure(self, backend, base: int, slots: Tensor, max_nodes: int, plain: bool = True):
        """The target's verify costs and plain step (Sizer.measure), and a draft pass over one token."""
        sizer = Sizer(cost=self.cost)
        sizer.measure(backend, base, slots, max_nodes, plain)
        self.plain_s = sizer.plain_s
        for d in list(self.drafts.values())[:1]:  # slot base is free in the draft's cache too
            times = []
            for _ in range(3):
                t = time.perf_counter()
                forward_nodes(d.draft, Tree([0]), base, range(1), slots)
                times.append(time.perf_counter() - t)
            self.draft_s = min(times[1:])

    def cost_of(self, nodes: int) -> float:  # sizes between the measured ones cost as the next larger
        return self.cost[min((s for s in self.cost if s >= nodes), default=max(self.cost))]

    def round_s(self, nodes: int) -> float:  # what a round verifying `nodes` (1: plain decoding) takes, less asking
        return self.cost_of(nodes) + self.extra_s if nodes > 1 else self.plain_s or self.cost_of(1)

    def plain_rate(self) -> float:
        return 1 / (self.ask_s + self.round_s(1))

    def expect(self, guess: "Guess", size: int) -> float:
        """The tokens per second of verifying guess cut to size: 1 + alpha x the scores of the nodes it would
        verify, over the round's seconds, where alpha (the candidate's tokens kept over its scores, at that size,
        over the guesses judged so far; 0.5 before any) calibrates the scores."""
        key, n = (guess.name, size), min(size, len(guess.tree.tokens))
        alpha = self.kept[key] / self.predicted[key] if self.predicted.get(key) else 0.5
        return (1 + alpha * guess.summed[n - 1]) / (self.ask_s + self.round_s(n))

    def pays(self) -> bool:  # every round proposes: propose() decides, a lone root meaning plain decoding
        return True

    def propose(self, context: list[int], budget: int, worth: Optional[Callable] = None) -> Tree:
        self.rounds += 1
        self.judge(context)
        t, guesses, sizes, seen = time.perf_counter(), [], sorted(s for s in self.cost if s > 1), list(context)
        for name, proposer in self.cheap.items():
            tree = proposer.propose(context, budget)
            if len(tree.tokens) > 1:
                guesses.append(Guess.of(name, seen, tree, sizes))
        self.pending += guesses
        if self.rounds > 1:  # the first round also reads the prompt into the trie and the indexes
            self.ask_s = ema(self.ask_s, time.perf_counter() - t)
        expect = {(g, s): self.expect(g, s) for g in guesses for s in sizes}
        best = max(expect, key=expect.get, default=None)
        # a margin over plain decoding, as the best of many noisy estimates tends to be one that came out high
        pays = best is not None and expect[best] > self.margin * self.plain_rate() and self.rounds > 1  # 1: no record
        bar = max(self.recent, self.plain_rate(), expect[best] if pays else 0.0)
        trial = None if pays else self.trial_due(bar)  # a draft model is tried where nothing cheap pays
        if trial:
            self.trying, self.left = trial, self.trial
        ahead = max(self.rates, key=self.rates.get, default=None)
        if self.left > 0 or ahead is not None and self.rates[ahead] > bar:
            self.left = max(0, self.left - 1)
            return self.run_draft(self.trying or ahead, context, budget)
        if not pays:
            self.method = "plain"
            return Tree([context[-1]])
        self.method = best[0].name
        return best[0].tree.best(best[1])[0]

    def judge(self, context: list[int]):
        """Score the guesses the text has gone past: at each size, the tokens it would have had kept cut to that size
        (the nodes the text follows, among its best-scored ones), and their scores, into the candidate's record. A
        size is judged as soon as its outcome is known: the text left the cut tree, or ran past its last node."""
        waiting = []
        for g in self.pending:
            if context[: len(g.seen)] != g.seen:  # another text: the guess cannot be judged
                continue
            path, ended = [0], False
            for token in context[len(g.seen) :]:
                child = g.tree.kids[path[-1]].get(token)
                if child is None:
                    ended = True
                    break
                path.append(child)
            # the tree cut to a size holds path[:i] while the size is above reach[i - 1]
            reach = list(accumulate((g.rank[node] for node in path), max))
            left = []
            for size in g.sizes:
                inside = bisect.bisect_left(reach, size)  # the path's nodes in the tree cut to size
                goes_on = min((g.rank[c] for c in g.tree.kids[path[inside - 1]].values()), default=size) < size
                if inside == len(path) and not ended and goes_on and len(context) - len(g.seen) < 64:
                    left.append(size)  # the text has not got past the cut tree yet
                    continue
                key = (g.name, size)
                self.judged[key] = n = self.judged.get(key, 0) + 1
                w = max(self.weight, 1 / n)  # the plain mean until there are 1 / weight: the first guess is no prior
                self.kept[key] = self.average(self.kept.get(key), inside - 1, w)
                self.predicted[key] = self.average(self.predicted.get(key), g.summed[min(size, len(g.rank)) - 1], w)
            if left:
                g.sizes = left
                waiting.append(g)
        self.pending = waiting

    def trial_due(self, bar: float) -> Optional[str]:
        """A draft candidate whose trial is due and whose best case beats bar (tokens per second); None if none."""
        if self.left > 0:
            return None
        for name, d in self.drafts.items():
            best_case = (1 + d.depth) / (self.ask_s + d.depth * self.draft_s + self.round_s(d.depth + 1))
            if self.due[name] <= self.rounds and name not in self.rates and best_case > bar:
                return name
        return None

    def run_draft(self, name: str, context: list[int], budget: int) -> Tree:
        self.method, self.sizers[name].exploring = name, name == self.trying  # a trial verifies whatever it scores
        return self.drafts[name].propose(context, budget, self.sizers[name].worth)

    def worth(self, gain: float, seconds: float) -> bool:
        return self.sizers[self.method].worth(gain, seconds)

    def choose(self, tree: Tree) -> int:  # a cheap guess comes cut to its size already
        return self.sizers[self.method].choose(tree) if self.method in self.drafts else len(tree.tokens)

    def accepted(self, kept: list[int], tree: Tree, p: Optional[Tensor]):
        if self.method != "plain":
            (self.cheap | self.drafts)[self.method].accepted(kept, tree, p)

    def update(self, tree: Tree, kept: int, propose_s: Optional[float], round_s: float):
        """After a round: the clock's overhead of the round, a draft candidate's rate and trial, and the candidates
        that sat it out brought up."""
        name, n = self.method, len(tree.tokens)
        if name not in self.drafts:
            self.recent = self.average(self.recent or None, (kept + 1) / round_s)
            spent = round_s - self.ask_s - (self.cost_of(n) if n > 1 else 0.0)
            if n > 1:  # from 0, so that one slow round does not start it
                self.extra_s = 0.9 * self.extra_s + 0.1 * max(0.0, spent)
            else:
                self.plain_s = ema(self.plain_s, spent)
        else:
            self.sizers[name].update(tree, kept, propose_s, round_s)
            self.rates[name] = self.average(self.rates.get(name), (kept + 1) / round_s)
            bar = max(self.recent, self.plain_rate())
            if self.left == 0 and (name == self.trying or self.rates[name] <= bar):  # a trial's end, or behind
                won = self.rates[name] > bar
                self.wait[name] = self.retry if won else min(2 * self.wait[name], self.longest)
                self.due[name], self.trying = self.rounds + self.wait[name], ""
                for other in self.drafts if not won else ():  # one draft model: its other methods wait as long
                    self.due[other] = max(self.due[other], self.due[name])
                if not won:
                    del self.rates[name]
        for other, proposer in (self.cheap | self.drafts).items():
            if other == name:
                continue
            if isinstance(proposer, Lookahead):
                proposer.guess = []
            if isinstance(proposer, DraftTree) and name in self.drafts:
                proposer.cached = self.drafts[name].cached  # its cache holds what the chosen one's holds

    def average(self, old: Optional[float], new: float, weight: Optional[float] = None) -> float:
        weight = self.weight if weight is None else weight
        return new if old is None else (1 - weight) * old + weight * new


@dataclass(eq=False)  # hashable: a key of the round's expectations
class Guess:
    """A cheap candidate's guess, waiting to be judged: rank[node] is its place when best-scored first (as Tree.best
    picks, the root 0), summed[k] the scores of its k best nodes after the root, sizes the sizes not judged yet."""
    name: str
    seen: list  # the context it guessed after
    tree: Tree
    rank: list
    summed: list
    sizes: list

    @staticmethod
    def of(name: str, seen: list[int], tree: Tree, sizes: list[int]) -> "Guess":
        order = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], i))
        rank = [0] * len(order)
        for r, node in enumerate(order):
            rank[node] = r
        return Guess(name, seen, tree, rank, list(accumulate((tree.scores[i] for i in order[1:]), initial=0.0)), sizes)


def ema(old: float, new: float) -> float:
    return new if not old else 0.9 * old + 0.1 * new


def auto(draft=None, ngram: int = 3, **options) -> Chooser:
    """The candidates that can run: prompt lookup and lookahead always; with a draft model also its chain, its tree
    and its staged tree (with a suffix trie's guesses). A suffix trie is not a candidate of its own: reading every
    token into it costs more a round than its guesses win over prompt lookup's (PERFORMANCE.md), though
    --speculate suffix still forces it. draft: the draft model's Backend; options: Chooser's."""
    found = {"lookup": Lookup(ngram), "lookahead": Lookahead()}
    if draft is not None:
        found.update(draft=DraftTree(draft, top_k=1, width=1), tree=DraftTree(draft),
                     staged=DraftTree(draft, staged=Suffix()))
    return Chooser(found, **options)
