"""choose.py: speculation that picks its method each round from what each has earned, and stays lossless."""
import random

import pytest
import torch

import choose
from checkpoint import load_model
from choose import Chooser
from test_speculative import chi_square_p_value, pair  # noqa: F401 (a fixture)
from test_trees import exact_joint, greedy, tiny
from backend import Backend
from sampling import Sampling
from trees import DraftTree, Lookup, Suffix, Tree, path_to, tree_generate, walk

GREEDY = Sampling(temperature=0)

V = 50  # the vocabulary of the model-free texts below


def periodic(context: list[int]) -> int:  # a text that repeats every 7 tokens
    return context[-7]


NOISE = random.Random(0).choices(range(V), k=1000)


def scrambled(context: list[int]) -> int:  # a text nothing predicts: noise, shifted by the token before
    return (NOISE[len(context)] + context[-1]) % V


def drive(chooser: Chooser, following, prompt: list[int], n: int, max_nodes: int = 16) -> list[tuple[str, int]]:
    """tree_generate's rounds without a model: following(context) is the target's greedy next token, proposing
    takes no time and a round takes what chooser.cost says its verify pass costs. Each round's method and its new
    tokens."""
    context, rounds = list(prompt), []
    while len(context) < len(prompt) + n:
        full = chooser.propose(context, max_nodes, chooser.worth) if chooser.pays() else None
        tree, kept = full.best(chooser.choose(full)) if full is not None else (Tree([context[-1]]), [0])
        p = torch.zeros(len(tree.tokens), V)
        for node in range(len(tree.tokens)):
            p[node, following(context + path_to(tree, node))] = 1.0
        path, nxt = walk(tree, p, GREEDY, [0.0] * len(tree.tokens))
        if full is not None:
            chooser.accepted([kept[i] for i in path], tree, p if len(tree.tokens) > 1 else None)
        chooser.update(tree, len(path) - 1, 0.0 if full is not None else None, chooser.cost_of(len(tree.tokens)))
        rounds.append((chooser.method if len(tree.tokens) > 1 else "plain", len(path)))
        context += [tree.tokens[i] for i in path[1:]] + [nxt]
    return rounds


def share(rounds, *methods) -> float:
    return sum(n for m, n in rounds if m in methods) / sum(n for _, n in rounds)


COSTS = {1: 1.0, 2: 1.3, 4: 1.6, 8: 2.2, 16: 3.5}  # seconds per verify pass over as many nodes


class Wrong:
    """A proposer that always guesses a long chain of wrong tokens."""
    def propose(self, context, budget, worth=None):
        tree = Tree([context[-1]])
        for i in range(budget - 1):
            tree.add(i, V - 1, 0.9)  # never in the periodic text
        return tree

    def accepted(self, kept, tree, p):
        pass


def with_costs(chooser: Chooser) -> Chooser:
    chooser.cost.update(COSTS)
    return chooser


def test_the_chooser_picks_lookup_on_a_repetitive_text():
    chooser = with_costs(Chooser({"wrong": Wrong(), "lookup": Lookup()}))
    rounds = drive(chooser, periodic, [3, 9, 4, 12, 5, 8, 11] * 2, 200)
    assert [m for m, _ in rounds[-5:]] == ["lookup"] * 5 and share(rounds, "lookup") > 0.9


def test_the_chooser_decodes_plainly_where_no_proposer_can_guess():
    chooser = with_costs(choose.auto())
    rounds = drive(chooser, scrambled, [3, 9, 4, 12, 5, 8, 11], 200)
    assert share(rounds, "plain") > 0.85
    assert all((n, 8) in chooser.predicted for n in ("lookup", "lookahead"))  # each guess was judged


class Fixed:
    """A proposer that always guesses the same chain, each node with the same score."""
    def __init__(self, tokens: list[int], score: float):
        self.tokens, self.score = tokens, score

    def propose(self, context, budget, worth=None):
        tree = Tree([context[-1]])
        for i, token in enumerate(self.tokens[: budget - 1]):
            tree.add(i, token, self.score)
        return tree

    def accepted(self, kept, tree, p):
        pass


def test_the_first_round_decodes_plainly_as_no_guess_has_a_record():
    chooser = with_costs(Chooser({"long": Fixed([1, 2, 3, 4, 5, 6, 7], 0.8)}))
    assert chooser.propose([0], 16).tokens == [0] and chooser.method == "plain"


def test_each_round_verifies_the_guess_expected_to_yield_most_per_second():
    chooser = with_costs(Chooser({"short": Fixed([1], 0.9), "long": Fixed([1, 2, 3, 4, 5, 6, 7], 0.8)}))
    chooser.propose([0], 16)
    tree = chooser.propose([9], 16)  # another text: no record yet, each node counts as half its score
    assert chooser.method == "long" and tree.tokens == [9, 1, 2, 3, 4, 5, 6, 7]  # 3.8 tokens for 2.2 s


def test_a_guess_expected_to_lose_to_plain_decoding_is_not_verified():
    chooser = with_costs(Chooser({"weak": Fixed([1, 2, 3], 0.1)}))  # 1.05 tokens for 1.3 s: plain's 1 for 1 s wins
    chooser.propose([0], 16)
    assert chooser.propose([9], 16).tokens == [9] and chooser.method == "plain"


def test_guesses_are_judged_on_the_rounds_they_sat_out():
    chooser = with_costs(Chooser({"lookup": Lookup()}))
    drive(chooser, scrambled, [3, 9, 4, 12, 5, 8, 11], 100)
    kept = chooser.kept[("lookup", 8)]
    assert chooser.predicted[("lookup", 8)] > 0 and kept < 0.5  # lookup's guesses were judged, and rarely held


def test_by_default_a_repetitive_text_runs_on_guesses():
    rounds = drive(with_costs(choose.auto()), periodic, [3, 9, 4, 12, 5, 8, 11] * 2, 200)
    assert share(rounds, "plain") < 0.1


def test_a_proposer_that_stops_paying_is_dropped():
    chooser = with_costs(Chooser({"lookup": Lookup()}))
    text = lambda context: periodic(context) if len(context) < 120 else scrambled(context)  # noqa: E731
    rounds = drive(chooser, text, [3, 9, 4, 12, 5, 8, 11] * 2, 400)
    turn = next(i for i, r in enumerate(rounds) if sum(n for _, n in rounds[: i + 1]) + 14 >= 120)
    assert all(m == "lookup" for m, _ in rounds[turn - 5 : turn])  # while the text repeats
    assert share(rounds[turn + 20 :], "plain") > 0.9


def test_a_proposer_that_starts_to_pay_is_noticed_without_verifying_it():
    chooser = with_costs(Chooser({"lookup": Lookup()}))
    text = lambda context: scrambled(context) if len(context) < 100 else periodic(context)  # noqa: E731
    rounds = drive(chooser, text, [3, 9, 4, 12, 5, 8, 11], 300)
    turn = next(i for i, r in enumerate(rounds) if sum(n for _, n in rounds[: i + 1]) + 7 >= 100)
    assert share(rounds[turn - 10 : turn], "plain") == 1.0  # not verified while the text was noise
    assert [m for m, _ in rounds[turn + 15 : turn + 20]] == ["lookup"] * 5  # and chosen soon after it repeats


class WrongDraft(DraftTree):
    """A draft model's method, without a model, that always guesses wrong."""
    def __init__(self):
        self.depth, self.room, self.cached, self.draft = 6, 0, 0, None

    def propose(self, context, budget, worth=None):
        return Wrong().propose(context, 7)

    def accepted(self, kept, tree, p):
        pass


def test_a_draft_method_is_not_tried_while_the_cheap_guesses_yield_more_than_it_could():
    chooser = with_costs(Chooser({"lookup": Lookup(), "draft": WrongDraft()}))
    rounds = drive(chooser, periodic, [3, 9, 4, 12, 5, 8, 11] * 2, 200)
    assert "draft" not in {m for m, _ in rounds}  # lookup keeps 15 a round; 7 tokens at most, in 2.2 s, could not pay


def test_a_draft_method_that_loses_its_trial_is_tried_ever_less_often():
    rounds = drive(with_costs(Chooser({"draft": WrongDraft()})), scrambled, [3, 9, 4, 12, 5, 8, 11], 300)
    trials = [i for i, (m, _) in enumerate(rounds) if m == "draft" and (i == 0 or rounds[i - 1][0] != "draft")]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert trials[0] == 15 and len(trials) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # from round 16 on
    assert all(rounds[i + 1][0] == "draft" != rounds[i + 2][0] for i in trials)  # 2 rounds each


# ---- on models: lossless, whatever is chosen ----------------------------------------------------------------------

class Rotating(Chooser):
    """Each round the next candidate or plain decoding, in turn: the methods interleave as much as they can."""
    def propose(self, context, budget, worth=None):
        names, self.rounds = ["plain", *self.cheap, *self.drafts], self.rounds + 1
        self.method = names[self.rounds % len(names)]
        if self.method in self.drafts:  # exploring: verified whatever its scores say
            self.sizers[self.method].exploring = True
            return self.drafts[self.method].propose(context, budget, self.sizers[self.method].worth)
        guess = self.cheap[self.method].propose(context, budget) if self.method != "plain" else Tree([context[-1]])
        return guess.best(budget)[0]  # (Lookahead may guess more)


def rotating(draft=None) -> Chooser:
    found = choose.auto(Backend(draft) if draft is not None else None)
    return Rotating(found.cheap | {"suffix": Suffix()} | found.drafts)


def test_greedy_auto_with_a_draft_is_identical_to_plain_greedy(pair):  # noqa: F811
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    chooser, prompt, used = rotating(draft), [1, 17, 42, 99, 7, 17, 42, 99], set()
    for n in (40, 60):  # a second call keeps the chooser, as a chat's turns do
        out = tree_generate(target, prompt, n, chooser, 16, sizer=chooser, temperature=0)
        assert out.rows[0] == greedy(target, prompt, n)
        used |= set(out.methods)
    assert used == {"lookup", "suffix", "lookahead", "draft", "tree", "staged", "plain"}


def test_greedy_auto_without_a_draft_is_identical_to_plain_greedy(pair):  # noqa: F811
    target = load_model(pair[0], "cpu", torch.float32)
    prompt = [1, 20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21]
    for chooser in (rotating(), choose.auto()):
        out = tree_generate(target, prompt, 40, chooser, 16, sizer=chooser, temperature=0)
        assert out.rows[0] == greedy(target, prompt, 40)


def test_the_methods_count_every_new_token_once(pair):  # noqa: F811
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    chooser = rotating(draft)
    out = tree_generate(target, [1, 20, 21, 22, 20, 21, 22, 20], 37, chooser, 16, sizer=chooser, temperature=0)
    assert sum(out.methods.values()) == out.decode_tokens == 36 and len(out.methods) > 2
    assert out.metrics(0)["methods"] == out.methods


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_sampled_auto_has_the_target_distribution(sampling):
    """The second and third sampled tokens after a fixed prompt, 2000 times, against the target's exact joint
    distribution, while the chooser moves between proposers whose verification costs nothing."""
    target, prompt = tiny(), [1, 2, 3]
    joint = exact_joint(target, prompt, sampling)  # [V * V] over tokens 2 and 3
    chooser, counts, guessed = rotating(), torch.zeros(64), 0
    chooser.cost.update({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    torch.manual_seed(0)
    for _ in range(2000):
        out = tree_generate(target, prompt, 3, chooser, 8, sizer=chooser, **sampling)
        counts[out.rows[0][1] * 8 + out.rows[0][2]] += 1
        guessed += out.drafted > 0
    assert guessed > 1000  # most runs verified guesses
    assert chi_square_p_value(counts, joint) > 1e-3


# ---- the command line --------------------------------------------------------------------------------------------

def test_cli_chooses_by_default_and_keeps_plain_greedy_output(pair):  # noqa: F811
    from test_speculative import run_cli
    args = ("--checkpoint_path", pair[0], "--max_new_tokens", 16, "--temperature", 0, "--ignore_eos",
            "--dtype", "float32")
    auto, plain = run_cli(*args, "--draft_checkpoint_path", pair[1]), run_cli(*args, "--speculate", "plain")
    assert auto.returncode == 0 and plain.returncode == 0, auto.stderr + plain.stderr
    text = lambda r: r.stdout.split("Sample 1/1")[0].split("\n", 1)[1]  # noqa: E731  (the text, not the load line)
    assert text(auto) == text(plain)
    assert "\nmethods: " in auto.stdout and "methods:" not in plain.stdout


@pytest.mark.parametrize("flags, method", [(("--prompt_lookup", 2), "lookup"), (("--suffix",), "suffix"),
                                           (("--speculate", "lookahead"), "lookahead")])
def test_cli_flags_still_force_one_method(pair, flags, method):  # noqa: F811
    from test_speculative import run_cli
    r = run_cli("--checkpoint_path", pair[0], *flags, "--max_new_tokens", 12, "--temperature", 0, "--ignore_eos")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("methods: "))
    assert set(part.split()[0] for part in line[len("methods: "):].split(", ")) <= {method, "plain"}


@pytest.mark.parametrize("flags, message", [(("--speculate", "tree"), "--speculate tree needs --draft_checkpoint_path"),
                                            (("--speculate", "suffix", "--prompt_lookup", 2), "two methods"),
                                            (("--speculate", "lookup", "--batch_size", 2), "batch size 1")])
def test_cli_rejects_contradicting_methods(pair, flags, message):  # noqa: F811
    from test_speculative import one_line_error, run_cli
    assert message in one_line_error(run_cli("--checkpoint_path", pair[0], *flags))
