"""Speculation that chooses its method itself: each round, the proposer (or plain decoding) that has recently
yielded the most tokens per second on this machine, model and text, with the others retried now and then."""
import math
from typing import Callable, Optional

from torch import Tensor

from trees import DraftTree, Lookahead, Lookup, Sizer, Suffix, Tree


class Chooser:
    """Candidate proposers (name -> Lookup, Suffix, Lookahead or DraftTree) behind the proposer and sizer interfaces of
    trees.tree_generate: pays() picks the round's method, and the round goes to that candidate and its own Sizer
    (its acceptance calibration), while the verify costs, measured once, are shared.

    A round's rate is its tokens (kept + 1) over its seconds: the candidate's measured proposing time plus the
    measured cost of verifying as many nodes as it sent. The verify cost is the one measured up front, not the
    round's wall time, so that a busy moment on the machine does not steer the choice. Each candidate keeps an
    average of its rounds' rates; plain decoding's rate is one over its measured step. A candidate not run yet
    counts as infinitely fast, so each is tried (`trial` rounds in a row); then the fastest runs, and plain
    decoding when no candidate beats it. A candidate that is not the fastest is tried again after `retry` rounds, and every retry that leaves it
    behind doubles its wait (up to `longest` rounds): one that stopped paying costs little, and one that starts to
    pay (the text turns repetitive) is noticed. Candidates that sat a round out stay correct: the suffix trie and
    the n-gram pools read the context when next asked, Lookahead's guesses are dropped (their positions have
    passed), and draft trees on one draft model share its cache position."""

    def __init__(self, candidates: dict, retry: int = 16, longest: int = 256, weight: float = 0.3, trial: int = 3):
        if not candidates:
            raise ValueError("the chooser needs at least one proposer")
        self.candidates, self.retry, self.longest, self.weight, self.trial = candidates, retry, longest, weight, trial
        self.trying, self.left = "plain", 0  # the candidate on trial, and its trial's rounds still to run
        self.cost: dict = {}  # nodes verified -> seconds, shared by every candidate's Sizer
        self.sizers = {name: Sizer(cost=self.cost) for name in candidates}
        self.rates: dict = {}  # name -> tokens per second, once it has run
        self.wait = dict.fromkeys(candidates, retry)
        self.due = dict.fromkeys(candidates, 0)  # the round of its next retry
        self.rounds, self.method, self.plain_s = 0, "plain", 0.0  # plain_s: a decode step's seconds, once measured
        self.drafts = [p for p in candidates.values() if isinstance(p, DraftTree)]
        self.draft = self.drafts[0].draft if self.drafts else None
        self.room = max([p.room for p in self.drafts], default=0)

    def start(self, prompt: list[int], cached: int, slots: Tensor, prefill_step: Callable):
        self.drafts[0].start(prompt, cached, slots, prefill_step)  # one draft model: one prefill for all
        for p in self.drafts[1:]:
            p.cached, p.slots = self.drafts[0].cached, slots

    def measure(self, *args, **sampling):
        sizer = next(iter(self.sizers.values()))
        sizer.measure(*args, **sampling)
        self.plain_s = sizer.plain_s

    def cost_of(self, nodes: int) -> float:  # sizes between the measured ones cost as the next larger
        return self.cost[min((s for s in self.cost if s >= nodes), default=max(self.cost))]

    def plain_rate(self) -> float:
        return 1 / (self.plain_s or self.cost_of(1))

    def pays(self) -> bool:
        """Pick this round's method (self.method); False for plain decoding."""
        self.rounds += 1
        if self.left > 0:
            self.left -= 1
            self.method = self.trying
            return True
        untried = [n for n in self.candidates if n not in self.rates]
        best = max(self.rates, key=self.rates.get, default="plain")
        best = best if self.rates.get(best, 0) > self.plain_rate() else "plain"
        due = [n for n in self.rates if n != best and self.due[n] <= self.rounds]
        if untried:
            best, due = untried[0], []
        self.method = min(due, key=self.due.get) if due else best
        if due or untried:  # a trial runs a few rounds, as some proposers guess better once they have run
            self.trying, self.left = self.method, self.trial - 1
        if self.method != "plain":  # a trial verifies its guesses even if their scores say they do not pay
            self.sizers[self.method].exploring = bool(due or untried)
        return self.method != "plain"

    def propose(self, context: list[int], budget: int, worth: Optional[Callable] = None) -> Tree:
        return self.candidates[self.method].propose(context, budget, worth)

    def worth(self, gain: float, seconds: float) -> bool:
        return self.sizers[self.method].worth(gain, seconds)

    def choose(self, tree: Tree) -> int:
        return self.sizers[self.method].choose(tree)

    def accepted(self, kept: list[int], tree: Tree, p: Tensor):
        self.candidates[self.method].accepted(kept, tree, p)

    def update(self, tree: Tree, kept: int, propose_s: Optional[float], round_s: float):
        """After a round (see Sizer.update): the chosen candidate's rate and retry wait; the others brought up."""
        name, chosen = self.method, self.candidates.get(self.method)
        if chosen is not None:
            self.sizers[name].update(tree, kept, propose_s, round_s)
            rate = (kept + 1) / ((propose_s or 0.0) + self.cost_of(len(tree.tokens)))
            old = self.rates.get(name)
            self.rates[name] = rate if old is None else (1 - self.weight) * old + self.weight * rate
            ahead = self.rates[name] > max([self.plain_rate()] + [r for n, r in self.rates.items() if n != name])
            if self.left == 0:  # judged at the end of a trial
                self.wait[name] = self.retry if ahead else min(2 * self.wait[name], self.longest)
                self.due[name] = self.rounds + self.wait[name]
        for other in self.candidates.values():
            if other is chosen:
                continue
            if isinstance(other, Lookahead):
                other.guess = []
            if isinstance(other, DraftTree) and isinstance(chosen, DraftTree):
                other.cached = chosen.cached  # its cache holds what the chosen one's holds: no tokens to re-read


def auto(draft=None, step: Optional[Callable] = None, ngram: int = 3, **options) -> Chooser:
    """The candidates that can run: prompt lookup, a suffix trie and lookahead always; with a draft model also its
    chain, its tree and its staged tree (which shares the suffix trie). The cheap ones come first, as every
    candidate is tried once in this order. options: Chooser's."""
    trie = Suffix()
    found = {"lookup": Lookup(ngram), "suffix": trie, "lookahead": Lookahead()}
    if draft is not None:
        kw = {} if step is None else {"step": step}
        found.update(draft=DraftTree(draft, top_k=1, width=1, **kw), tree=DraftTree(draft, **kw),
                     staged=DraftTree(draft, staged=trie, **kw))
    return Chooser(found, **options)
