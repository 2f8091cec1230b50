"""speculative.py: lossless speculative decoding with a draft model or prompt lookup."""
import json

import pytest
import torch

import speculative
from backend import Backend
from conftest import convert, errors_of, reference_probs, save_hf_llama
from checkpoint import load_model
from generate import generate
from launcher import command
from model import ModelArgs, Transformer
from speculative import prompt_lookup, speculative_generate


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test that counts were drawn from probs; cells expected below 5 are merged into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)])
def test_seeded_speculation_writes_plain_decodings_tokens(pair, sampling):
    """A guess is kept only where it is the token plain decoding draws there with the same uniform: with a seed,
    a draft model's chain, adaptive or not, and prompt lookup write what plain sampling writes, token for token."""
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    prompt = [1, 20, 21, 22, 23, 24, 20, 21, 22]
    for seed in (3, 4, 5):
        plain = generate(target, [prompt], 24, seed=seed, **sampling).rows[0]
        for how in (dict(draft=draft), dict(draft=draft, adaptive=True), dict(ngram=2)):
            assert speculative_generate(target, prompt, 24, 3, seed=seed, **how, **sampling).rows[0] == plain


def test_prompt_lookup_proposes_what_followed_the_last_match():
    assert prompt_lookup([5, 6, 7, 1, 2, 5, 6, 9, 5, 6], 2, 3) == [9, 5, 6]  # the most recent earlier match
    assert prompt_lookup([1, 2, 3, 4], 2, 3) == []


def test_prompt_lookup_backs_off_to_shorter_ngrams():
    assert prompt_lookup([1, 2, 3, 9, 3], 2, 2) == [9, 3]  # no earlier (9, 3); the 1-gram 3 matched


def test_prompt_lookup_continues_a_short_period_for_all_k_tokens():
    assert prompt_lookup([1, 2, 1, 2], 2, 5) == [1, 2, 1, 2, 1]
    assert prompt_lookup([7, 1, 2, 3, 1, 2], 2, 5) == [3, 1, 2, 3, 1]


def test_threshold_drafts_longer_while_the_last_token_is_kept_and_shorter_when_not():
    cheap, costly = speculative.Threshold(), speculative.Threshold()
    for _ in range(20):  # a draft step costs 1% of a round here, and a third of it there
        cheap.update(drafted=3, kept=3, draft_s=0.003, verify_s=0.1, round_s=0.103)
        costly.update(drafted=3, kept=1, draft_s=0.3, verify_s=0.6, round_s=0.9)
    assert cheap.tau < 0.5 < costly.tau


def test_threshold_breakeven_is_the_rate_times_the_cost_of_one_more_token():
    rule = speculative.Threshold()
    rule.update(drafted=1, kept=1, draft_s=0.01, verify_s=0.02, round_s=0.03)  # 2 tokens in 30 ms
    assert rule.breakeven() == pytest.approx(2 / 0.03 * 0.01)  # one size seen: verify's growth is unknown yet
    rule.update(drafted=3, kept=1, draft_s=0.03, verify_s=0.04, round_s=0.07)  # 4 positions cost 20 ms more
    rate = rule.round_tokens / rule.round_s
    assert rule.breakeven() == pytest.approx(rate * (0.01 + 0.02 / 2))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, sp_model_path, checkpoint):
    """The tiny target checkpoint and a smaller, differently seeded draft with the same tokenizer."""
    hf = tmp_path_factory.mktemp("hf_draft")
    save_hf_llama(hf, sp_model_path, seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return checkpoint, convert(hf, tmp_path_factory.mktemp("draft") / "ckpt")


def greedy(model, prompt, n):
    return generate(model, [prompt], n, temperature=0).rows[0]


@pytest.mark.parametrize("k, adaptive", [(1, False), (3, False), (5, False), (5, True)])
def test_greedy_speculation_with_a_draft_is_identical_to_plain_greedy(pair, k, adaptive):
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    prompt = [1, 17, 42, 99, 7]
    result = speculative_generate(target, prompt, 40, k, draft=draft, adaptive=adaptive, temperature=0)
    assert result.rows[0] == greedy(target, prompt, 40)
    assert sum(result.accept_histogram) == result.forwards


def test_a_draft_equal_to_the_target_is_always_accepted(pair):
    target, same = load_model(pair[0], "cpu", torch.float32), load_model(pair[0], "cpu", torch.float32)
    result = speculative_generate(target, [1, 5, 9], 25, 4, draft=same, temperature=0)
    assert result.metrics(0)["acceptance_rate"] == 1.0 and result.accept_histogram[:4] == [0, 0, 0, 0]
    assert result.rows[0] == greedy(target, [1, 5, 9], 25)


def test_greedy_prompt_lookup_is_identical_to_plain_greedy(pair):
    target = load_model(pair[0], "cpu", torch.float32)
    prompt = [1, 20, 21, 22, 23, 24, 20, 21, 22, 23, 24, 20, 21]
    assert speculative_generate(target, prompt, 30, 4, ngram=2, temperature=0).rows[0] == greedy(target, prompt, 30)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9),
                                      dict(temperature=1.0, adaptive=True)])
def test_sampled_speculation_has_the_target_distribution(sampling):
    """Two sampled tokens after a fixed prompt, 3000 times, against the exact joint distribution of the target."""
    torch.manual_seed(0)
    args = dict(vocab_size=8, n_layer=1, n_head=2, dim=16, intermediate_size=32, block_size=32)
    target, draft = Transformer(ModelArgs(**args)).eval(), Transformer(ModelArgs(**args)).eval()
    for m in (target, draft):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.5)
    prompt = [1, 2, 3]
    dist = {k: v for k, v in sampling.items() if k != "adaptive"}
    with torch.no_grad():
        first = reference_probs(target(torch.tensor([prompt]))[:, -1], **dist)[0]  # [V]
        seconds = reference_probs(target(torch.tensor([prompt + [x] for x in range(8)]))[:, -1], **dist)
    joint = (first[:, None] * seconds).flatten()  # [V * V]
    counts = torch.zeros(64)
    for _ in range(3000):
        out = speculative_generate(target, prompt, 2, 2, draft=draft, **sampling).rows[0]
        counts[out[0] * 8 + out[1]] += 1
    assert chi_square_p_value(counts, joint) > 1e-3


@pytest.mark.parametrize("adaptive", [False, True])
def test_compiled_speculation_does_not_recompile_between_steps(pair, adaptive):
    from torch._dynamo.utils import counters
    target, draft = (load_model(c, "cpu", torch.float32) for c in pair)
    backends = dict(backend=Backend(target, compile=True), draft_backend=Backend(draft, compile=True))
    torch._dynamo.reset()
    counters.clear()  # other tests compile too
    expected = greedy(target, [1, 2, 3], 30)
    run = lambda: speculative_generate(target, [1, 2, 3], 30, 3, draft=draft, adaptive=adaptive,  # noqa: E731
                                       temperature=0, **backends).rows[0]
    out = run()
    frames = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        out2 = run()
    assert counters["stats"]["unique_graphs"] == frames == 2  # one draft step, one verify for every length
    assert out == out2 == expected


def test_quantized_target_and_draft_keep_greedy_output(pair, tmp_path):
    from quantize_checkpoint import quantize_checkpoint
    target = load_model(quantize_checkpoint(pair[0], "int8", out_dir=tmp_path / "t"), "cpu", torch.bfloat16)
    draft = load_model(quantize_checkpoint(pair[1], "int4", 32, out_dir=tmp_path / "d"), "cpu", torch.bfloat16)
    out = speculative_generate(target, [1, 8, 30], 20, 3, draft=draft, temperature=0).rows[0]
    assert out == greedy(target, [1, 8, 30], 20)


# ---- the command line --------------------------------------------------------------------------------------------

def run_cli(*args):
    return command("speculative.py", *args, text=True)


def test_cli_reports_acceptance_statistics(pair, tmp_path):
    out = tmp_path / "m.json"
    result = run_cli("--checkpoint_path", pair[0], "--draft_checkpoint_path", pair[1], "--speculate", "draft",
                     "--speculate_k", 3, "--max_new_tokens", 12, "--temperature", 0, "--ignore_eos", "--metrics_json",
                     out)
    assert result.returncode == 0, result.stderr
    assert "acceptance rate" in result.stdout and "methods: draft 11 tokens\n" in result.stdout
    metrics = json.loads(out.read_text())
    from test_cli import METRICS
    assert set(metrics) == METRICS  # the schema of plain decoding
    assert len(metrics["accept_histogram"]) == 4 and len(metrics["samples"][0]["tokens"]) == 12


def test_cli_fixed_k_drafts_k_tokens_every_round(pair, tmp_path):
    out = tmp_path / "m.json"
    result = run_cli("--checkpoint_path", pair[0], "--draft_checkpoint_path", pair[1], "--speculate_k", 3,
                     "--fixed_k", "--max_new_tokens", 12, "--temperature", 0, "--ignore_eos", "--metrics_json", out)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["mean_drafted"] == 3


def test_compile_prefill_compiles_speculative_decodings_prefill_too(pair):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    speculative.main(["--checkpoint_path", str(pair[0]), "--prompt_lookup", "2", "--max_new_tokens", "4",
                      "--temperature", "0", "--compile_prefill", "--dtype", "float32"])
    assert counters["stats"]["unique_graphs"] >= 1 and counters["stats"]["calls_captured"] > 0


def one_line_error(result):
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = errors_of(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_cli_rejects_a_draft_with_another_tokenizer(pair, tiktoken_model_path, tmp_path):
    import shutil
    other = tmp_path / "draft"
    shutil.copytree(pair[1], other)
    shutil.copy(tiktoken_model_path, other / "tokenizer.model")
    assert "tokenizer" in one_line_error(run_cli("--checkpoint_path", pair[0], "--draft_checkpoint_path", other))


def test_cli_rejects_a_draft_with_another_vocabulary(pair, sp_model_path, tmp_path):
    hf = tmp_path / "hf"
    save_hf_llama(hf, sp_model_path, vocab_size=384)  # the same tokenizer fits, the vocabularies differ
    other = convert(hf, tmp_path / "draft")
    assert "vocab_size" in one_line_error(run_cli("--checkpoint_path", pair[0], "--draft_checkpoint_path", other))


@pytest.mark.parametrize("flags, message", [(("--speculate_k", 0), "at least 1"),
                                            (("--batch_size", 2), "batch size 1")])
def test_cli_rejects_bad_speculation_flags(pair, flags, message):
    result = run_cli("--checkpoint_path", pair[0], "--draft_checkpoint_path", pair[1], *flags)
    assert message in one_line_error(result)


def test_cli_rejects_fixed_k_without_a_draft(pair):
    result = run_cli("--checkpoint_path", pair[0], "--prompt_lookup", 2, "--fixed_k")
    assert "--fixed_k needs --draft_checkpoint_path" in one_line_error(result)
