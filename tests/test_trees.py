"""trees.py: token-tree speculative decoding, lossless with every proposer."""
import random

import pytest
import torch

import trees
from backend import Backend
from checkpoint import load_model
from conftest import convert, reference_probs, save_hf_llama
from generate import generate
from model import ModelArgs, Transformer
from sampling import Sampling
from test_speculative import chi_square_p_value
from trees import DraftTree, Sizer, Suffix, Tree, compact, forward_nodes, tree_generate, walk


@pytest.fixture(scope="module")
def pair(tmp_path_factory, sp_model_path, checkpoint):
    """The tiny target checkpoint and a smaller, differently seeded draft with the same tokenizer."""
    hf = tmp_path_factory.mktemp("hf_tree_draft")
    save_hf_llama(hf, sp_model_path, seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return checkpoint, convert(hf, tmp_path_factory.mktemp("tree_draft") / "ckpt")


def tiny(seed=0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    args = dict(vocab_size=8, n_layer=1, n_head=2, dim=16, intermediate_size=32, block_size=64)
    model = Transformer(ModelArgs(**{**args, **overrides})).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model


def greedy(model, prompt, n):
    return generate(model, [prompt], n, temperature=0).rows[0]


class Oracle:
    """Knows the greedy continuation and hides it in a random tree: the right token at a random child position
    among wrong siblings, the branch cut at a random depth, so rounds accept partly and along any branch."""

    def __init__(self, answer: list[int], prompt_len: int, vocab: int, seed: int = 0):
        self.answer, self.T, self.vocab, self.rng = answer, prompt_len, vocab, random.Random(seed)

    def propose(self, context, budget, worth=None):
        tree, node, done = Tree([context[-1]]), 0, len(context) - self.T
        for want in self.answer[done : done + self.rng.randint(0, 6)]:
            wrong = [t for t in self.rng.sample(range(self.vocab), 3) if t != want]
            children = wrong[: self.rng.randint(0, 2)] + [want]
            self.rng.shuffle(children)
            nodes = {t: tree.add(node, t, 0.5) for t in children}
            node = nodes[want]
        return tree

    def accepted(self, kept, tree, p):
        pass


def test_a_tree_node_sees_only_its_ancestors():
    """Each node's logits equal those of its own path decoded alone, whatever its siblings and cousins hold."""
    model = tiny()
    model.setup_caches(1, 32)
    prompt = [1, 2, 3]
    tree = Tree([4])
    a = tree.add(0, 5, 0.5)
    b = tree.add(0, 6, 0.5)
    c = tree.add(a, 7, 0.5)
    d = tree.add(b, 1, 0.5)
    with torch.no_grad():
        model(torch.tensor([prompt]), model.context(torch.arange(3)))
        p = forward_nodes(Backend(model), tree, 3, range(5), torch.arange(32)).softmax(-1)
        for node, path in ((c, [4, 5, 7]), (d, [4, 6, 1]), (b, [4, 6])):
            alone = reference_probs(tiny()(torch.tensor([prompt + path]))[:, -1], temperature=1.0)[0]
            torch.testing.assert_close(p[node], alone, atol=1e-5, rtol=1e-4)


def test_compact_moves_the_accepted_path_into_consecutive_slots():
    model = tiny()
    model.setup_caches(1, 16)
    cache = model.layers[0].attention.kv_cache
    cache.k_cache[0, :, :, 0] = torch.arange(17.0)
    compact(model, 4, [0, 2, 5])
    assert cache.k_cache[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 7]


def test_best_keeps_the_highest_scores_and_every_ancestor():
    tree = Tree([9])
    a, b = tree.add(0, 1, 0.6), tree.add(0, 2, 0.3)
    tree.add(a, 3, 0.5), tree.add(b, 4, 0.1)
    best, kept = tree.best(3)
    assert kept == [0, 1, 3] and best.tokens == [9, 1, 3] and best.parents == [-1, 0, 1]


def test_greedy_walk_follows_the_targets_argmax_and_ends_with_its_next_token():
    tree = Tree([0])
    a, b = tree.add(0, 1, 0.5), tree.add(0, 2, 0.5)
    c = tree.add(b, 3, 0.5)
    p = torch.zeros(4, 5)
    p[0, 2] = p[b, 3] = p[c, 4] = p[a, 0] = 1.0
    assert walk(tree, p, Sampling(temperature=0), [0.5] * 4) == ([0, b, c], 4)


def test_suffix_proposes_the_most_frequent_continuation_first():
    suffix = Suffix(depth=4)  # shallow, so that all the branches fit
    text = [7, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 5, 1, 2]  # (5, 1, 2) is new; after (1, 2): 3 twice, 4 once
    tree = suffix.propose(text, 8)
    first = tree.kids[0]
    assert set(first) == {3, 4} and tree.scores[first[3]] == pytest.approx(2 / 3)
    assert tree.tokens[1] == 3  # best first


def test_suffix_reads_only_the_new_part_of_an_extended_context():
    suffix = Suffix()
    suffix.observe([5, 6, 7])
    suffix.observe([5, 6, 7, 5, 6])
    assert suffix.seen == [5, 6, 7, 5, 6] and suffix.count[suffix.kids[0][5]] == 2


def test_suffix_starts_afresh_on_another_text_and_keeps_what_it_learned():
    suffix = Suffix()
    suffix.observe([5, 6, 7, 8])
    tree = suffix.propose([1, 5, 6], 4)  # another conversation, which quotes the first
    assert tree.tokens[1:] == [7, 8]


def test_greedy_suffix_decoding_is_identical_to_plain_greedy(pair):  # compiled: see the recompile test
    target = load_model(pair[0], "cpu", torch.float32)
    prompt = [1, 20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21]
    out = tree_generate(target, prompt, 30, Suffix(), 16, temperature=0)
    assert out.rows[0] == greedy(target, prompt, 30)


@pytest.mark.parametrize("compiled", [False, True])
def test_greedy_lookahead_decoding_is_identical_to_plain_greedy(pair, compiled):
    target = load_model(pair[0], "cpu", torch.float32)
    prompt = [1, 20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21]
    out = tree_generate(target, prompt, 40, trees.Lookahead(), 16, backend=Backend(target, compile=compiled),
                        temperature=0)
    assert out.rows[0] == greedy(target, prompt, 40)


def test_lookahead_pools_the_texts_ngrams_and_proposes_those_after_the_root():
    look = trees.Lookahead(window=2, n=3)
    tree = look.propose([5, 6, 7, 9, 5, 6, 8, 5], 16)  # after 5: (6, 8) most recently, (6, 7) before
    assert look.pool[5] == [(6, 8), (6, 7)]
    assert tree.tokens[1:4] == [6, 8, 7] and tree.parents[1:4] == [0, 1, 1]


def test_lookahead_takes_the_targets_answers_as_its_next_guesses_and_pools_their_ngrams():
    look = trees.Lookahead(window=3, n=2)
    look.guess = [4, 4, 4]
    tree = look.propose([1, 2, 3], 16)  # root 3, then the guesses 4, 4, 4 as a chain
    chain = [0, tree.kids[0][4], tree.kids[tree.kids[0][4]][4]]
    chain.append(tree.kids[chain[-1]][4])
    p = torch.zeros(len(tree.tokens), 8)
    for node, answer in zip(chain, (5, 6, 7, 1)):  # after 3: 5; after 3 4: 6; after 3 4 4: 7; after 3 4 4 4: 1
        p[node, answer] = 1.0
    look.accepted([0], tree, p)  # none kept: the next root is 5, at the guesses' first position
    assert look.guess == [6, 7, 1] and (6,) in look.pool[4] and (7,) in look.pool[4]


@pytest.mark.parametrize("compiled, staged", [(False, False), (False, True), (True, True)])
def test_greedy_draft_tree_is_identical_to_plain_greedy(pair, compiled, staged):
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    prompt = [1, 17, 42, 99, 7, 17, 42, 99]
    proposer = DraftTree(Backend(draft, compile=compiled), staged=Suffix() if staged else None)
    out = tree_generate(target, prompt, 40, proposer, 16, backend=Backend(target, compile=compiled), temperature=0)
    assert out.rows[0] == greedy(target, prompt, 40)
    assert sum(out.accept_histogram) == out.forwards and sum(out.tree_sizes.values()) == out.forwards


def test_oracle_tree_over_an_int8_cache_is_identical_to_plain_greedy_over_one(pair):
    # the accepted branches' entries are moved down the cache with their scales
    target = load_model(pair[0], "cpu", torch.bfloat16)
    target.setup_caches(1, 64, torch.int8)
    prompt = [1, 8, 30, 4]
    answer = greedy(target, prompt, 100)
    out = tree_generate(target, prompt, 100, Oracle(answer, len(prompt), target.args.vocab_size), 16,
                        sizer=Sizer(cost={16: 1.0}), temperature=0)
    assert target.layers[0].attention.kv_cache.k_cache.dtype == torch.int8
    assert out.rows[0] == answer


def test_suffix_follow_guesses_the_most_frequent_tokens_after_the_text_and_a_path():
    suffix = Suffix()
    suffix.observe([7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3, 4, 6, 1])
    assert suffix.follow([2], 3) == [3, 4, 9]  # after (1, 2): 3; after (1, 2, 3): 4 twice, 5 once; then (..., 4): 9
    assert suffix.follow([8], 3) == []  # (1, 8) and (8) never occurred


def test_a_staged_draft_grows_text_seen_before_in_fewer_passes(pair):
    """The target as its own draft (made confident: its logits scaled up, the argmax unchanged), asked again what
    it answered before (an earlier chat turn, in the trie): the trie's guesses are what the draft would say, so a
    pass that runs them reaches several levels, and the same output takes fewer draft passes."""
    target, same = load_model(pair[0], "cpu", torch.float32), load_model(pair[0], "cpu", torch.float32)
    same.output.weight.data *= 50
    prompt = [1, 5, 9, 33]
    answer, passes = greedy(target, prompt, 30), {}
    for staged in (None, Suffix()):
        if staged is not None:
            staged.observe(prompt + answer)
        calls = []
        sizer = Sizer(cost={16: 1.0})
        sizer.worth = lambda gain, seconds: True  # every level, whatever it costs
        counted = Backend(same)
        verify = counted.verify
        counted.verify = lambda *a, **k: calls.append(1) or verify(*a, **k)  # noqa: E731 (the draft's passes)
        proposer = DraftTree(counted, top_k=2, width=1, depth=6, staged=staged)
        assert tree_generate(target, prompt, 30, proposer, 16, sizer=sizer, temperature=0).rows[0] == answer
        passes[staged is not None] = len(calls)
    assert passes[True] < passes[False] * 0.7, passes


def test_a_draft_tree_from_the_target_itself_is_accepted_to_its_full_depth(pair):
    """A chain of the draft's top tokens with their runners-up beside it: the target, being the draft, keeps the
    whole chain every round, which it can only do if the draft's cache follows the accepted paths."""
    target, same = load_model(pair[0], "cpu", torch.float32), load_model(pair[0], "cpu", torch.float32)
    sizer = Sizer(cost={16: 1.0})
    sizer.worth = lambda gain, seconds: True  # every level, whatever it costs
    out = tree_generate(target, [1, 5, 9], 30, DraftTree(Backend(same), top_k=2, width=1, depth=4), 16, sizer=sizer,
                        temperature=0)
    assert out.rows[0] == greedy(target, [1, 5, 9], 30)
    assert out.accept_histogram == [0, 0, 0, 0, out.forwards]


def test_a_draft_that_does_not_pay_sits_out_rounds_and_catches_up_after(pair):
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    sizer = Sizer(cost={1: 1.0, 2: 50.0})  # verifying a guess costs 50 plain steps: it never pays
    out = tree_generate(target, [1, 17, 42, 99, 7], 40, DraftTree(Backend(draft)), 16, sizer=sizer, temperature=0)
    assert out.rows[0] == greedy(target, [1, 17, 42, 99, 7], 40)
    grown = sum(c for n, c in out.tree_sizes.items() if n > 1)
    assert out.tree_sizes[1] >= 5 * grown > 0


def test_kv_compaction_keeps_200_tokens_after_partial_acceptances_identical(pair):
    target = load_model(pair[0], "cpu", torch.float32)
    prompt = [1, 8, 30, 4]
    answer = greedy(target, prompt, 200)
    out = tree_generate(target, prompt, 200, Oracle(answer, len(prompt), target.args.vocab_size), 16,
                        sizer=Sizer(cost={16: 1.0}), temperature=0)
    assert out.rows[0] == answer
    assert out.forwards < 150 and sum(out.accept_histogram[1:]) > 20  # rounds did keep branches, partly


@torch.no_grad()
def exact_joint(target, prompt: list[int], sampling: dict) -> torch.Tensor:  # -> [V * V]
    """The target's exact joint distribution of the second and third tokens sampled after prompt (vocabulary 8)."""
    p1 = reference_probs(target(torch.tensor([prompt]))[:, -1], **sampling)[0]  # [V]
    p2 = reference_probs(target(torch.tensor([prompt + [x] for x in range(8)]))[:, -1], **sampling)  # [V, V]
    p3 = reference_probs(target(torch.tensor([prompt + [x, y] for x in range(8) for y in range(8)]))[:, -1],
                         **sampling).view(8, 8, 8)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten()


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_sampled_tree_speculation_has_the_target_distribution(sampling):
    """The second and third sampled tokens after a fixed prompt, which one round over a two-level tree decides,
    2000 times, against the exact joint distribution of the target (the first comes from prefill)."""
    target, prompt = tiny(), [1, 2, 3]
    joint = exact_joint(target, prompt, sampling)  # [V * V] over tokens 2 and 3

    class Branchy:  # children 0, 3, 5 of the root and 1, 6 under each: acceptance must be exact along any of them
        def propose(self, context, budget, worth=None):
            tree = Tree([context[-1]])
            for t in (0, 3, 5):
                child = tree.add(0, t, 0.5)
                tree.add(child, 1, 0.2), tree.add(child, 6, 0.2)
            return tree

        def accepted(self, kept, tree, p):
            pass

    counts, sizer = torch.zeros(64), Sizer(cost={10: 1.0})
    torch.manual_seed(0)
    for _ in range(2000):
        out = tree_generate(target, prompt, 3, Branchy(), 10, sizer=sizer, **sampling).rows[0]
        counts[out[1] * 8 + out[2]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3


def test_seeded_tree_speculation_writes_plain_decodings_tokens(pair):
    """Every node's token is drawn as plain decoding draws it at that depth, so with a seed a tree, whatever its
    proposer, writes what plain sampling writes."""
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    prompt, sampling = [1, 20, 21, 22, 23, 24, 20, 21, 22], dict(temperature=0.9, top_k=20, top_p=0.95)
    for seed in (1, 2):
        plain = generate(target, [prompt], 24, seed=seed, **sampling).rows[0]
        for proposer in (Suffix(), trees.Lookahead(), DraftTree(Backend(draft))):
            assert tree_generate(target, prompt, 24, proposer, 16, seed=seed, **sampling).rows[0] == plain


def test_sizer_picks_a_big_tree_when_verifying_is_cheap_and_a_small_one_when_not():
    tree = Tree([0])
    for i in range(15):
        tree.add(i, 1, 0.9 ** (i + 1))
    flat = Sizer(cost={1: 1.0, 4: 1.0, 16: 1.05})
    steep = Sizer(cost={1: 1.0, 4: 4.0, 16: 16.0})
    assert flat.choose(tree) == 16 and steep.choose(tree) == 1


def test_compiled_tree_verification_does_not_recompile_between_rounds(pair):
    from torch._dynamo.utils import counters
    target = load_model(pair[0], "cpu", torch.float32)
    backend = Backend(target, compile=True)
    prompt = [1, 20, 21, 22, 20, 21, 22, 20]
    torch._dynamo.reset()
    counters.clear()
    out = tree_generate(target, prompt, 20, Suffix(), 16, backend=backend, temperature=0).rows[0]
    frames = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        out2 = tree_generate(target, prompt, 20, Suffix(), 16, backend=backend, temperature=0).rows[0]
    assert out == out2 == greedy(target, prompt, 20) and len(out) == 20
    assert counters["stats"]["unique_graphs"] == frames


def test_a_proposer_that_does_not_pay_sits_out_seven_rounds_in_eight_and_its_8th_tree_is_verified():
    tree = Tree([0])
    tree.add(0, 1, 0.1)
    sizer = Sizer(cost={1: 1.0, 2: 5.0})
    assert sizer.pays() and sizer.choose(tree) == 1  # the first round proposes; its guess is not worth verifying
    rounds = [sizer.pays() for _ in range(8)]
    assert rounds == [False] * 7 + [True] and sizer.choose(tree) == 2


def test_sizer_calibrates_its_scores_by_what_was_accepted_and_ignores_rounds_without_guesses():
    sizer, guess = Sizer(), Tree([0])
    guess.add(0, 1, 0.8)
    sizer.update(guess, 0, 0.0, 1.0)  # predicted 0.8, none kept
    sizer.update(Tree([0]), 0, None, 1.0)
    assert sizer.alpha() == 0.0 and sizer.predicted == pytest.approx(0.8)


# ---- the command line --------------------------------------------------------------------------------------------

def test_cli_suffix_reports_the_tree_sizes_it_chose(pair, tmp_path):
    import json
    from test_speculative import run_cli
    out = tmp_path / "m.json"
    result = run_cli("--checkpoint_path", pair[0], "--suffix", "--max_nodes", 8, "--max_new_tokens", 16,
                     "--temperature", 0, "--ignore_eos", "--metrics_json", out)
    assert result.returncode == 0, result.stderr
    assert "Tree size per verify, chosen by measured cost" in result.stdout
    metrics = json.loads(out.read_text())
    assert sum(metrics["tree_sizes"].values()) == metrics["target_forwards"] - 1
    assert all(int(n) <= 8 for n in metrics["tree_sizes"]) and len(metrics["samples"][0]["tokens"]) == 16


def test_cli_staged_draft_tree_matches_plain_greedy(pair):
    from test_speculative import run_cli
    # float32: the tree's many-row verification and one-row decoding sum in different orders, and in bf16 a near
    # tie in this random model can tip either way
    args = ("--checkpoint_path", pair[0], "--max_new_tokens", 16, "--temperature", 0, "--ignore_eos",
            "--dtype", "float32")
    tree, plain = run_cli(*args, "--draft_checkpoint_path", pair[1], "--tree", "--staged"), run_cli(*args)
    assert tree.returncode == 0 and plain.returncode == 0, tree.stderr + plain.stderr
    text = lambda r: r.stdout.split("Sample 1/1")[0].split("\n", 1)[1]  # noqa: E731  (the text, not the load line)
    assert text(tree) == text(plain)


@pytest.mark.parametrize("flags, message", [(("--tree",), "--tree needs --draft_checkpoint_path"),
                                            (("--staged",), "--staged needs --tree"),
                                            (("--suffix", "--lookahead"), "need no other proposer"),
                                            (("--suffix", "--json"), "do not support guided generation")])
def test_cli_rejects_bad_tree_flags(pair, flags, message):
    from test_speculative import one_line_error, run_cli
    assert message in one_line_error(run_cli("--checkpoint_path", pair[0], *flags))


def test_the_best_nodes_leave_out_a_node_whose_parent_is_not_among_them():
    """A proposer whose child outscores its parent (or a NaN score) must not break a round: the node goes too."""
    tree = Tree([1])
    a = tree.add(0, 2, 0.2)
    tree.add(a, 3, 0.9)  # outscores its parent
    tree.add(0, 4, 0.5)
    best, kept = tree.best(3)  # the root, the child that outscores its parent, and 4
    assert kept == [0, 3] and best.tokens == [1, 4]


def test_lookups_index_guesses_what_prompt_lookup_finds_as_the_text_grows():
    rng = random.Random(0)
    for _ in range(100):
        text = [rng.randrange(rng.choice([3, 5, 20])) for _ in range(rng.randint(1, 60))]
        lookup = trees.Lookup(rng.choice([1, 2, 3]))
        for cut in range(1, len(text) + 1):  # one Lookup over the growing text, as a generation feeds it
            k = rng.randint(1, 12)
            assert lookup.propose(text[:cut], k + 1).tokens[1:] == trees.prompt_lookup(text[:cut], lookup.ngram, k)
        other = [rng.randrange(5) for _ in range(20)]  # another text: the index starts afresh
        assert lookup.propose(other, 9).tokens[1:] == trees.prompt_lookup(other, lookup.ngram, 8)


def test_the_figures_say_so_when_no_round_proposed_anything(capsys):
    import cli

    class Never(trees.Sizer):  # every round decodes plainly
        def pays(self):
            return False
    out = trees.tree_generate(tiny(), [1, 2, 3], 6, trees.Lookup(), 8, sizer=Never(), temperature=0)
    cli.print_summary(out.metrics(0))
    assert "acceptance rate: none proposed" in capsys.readouterr().out
