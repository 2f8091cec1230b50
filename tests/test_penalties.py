"""logit_bias, the presence, frequency and repetition penalties and min_p: exact against a plain reference, per
request, and without changing what the requests batched beside one get."""
import math

import pytest
import torch

from engine import Engine, Request
from sampling import OptionError, Sampling, adjusted, pick
from test_engine import alone, prompts, tiny


def reference_adjusted(logits: list[float], o: Sampling, prompt: list[int], out: list[int]) -> list[float]:
    """One row's logits token by token, as the options' definitions read: bias added, then the repetition penalty
    on every token of prompt or answer, then the presence and frequency penalties on the answer's."""
    x, bias = list(logits), dict(o.logit_bias or ())
    for t in range(len(x)):
        x[t] += bias.get(t, 0.0)
        if t in prompt or t in out:
            x[t] = x[t] / o.repetition_penalty if x[t] > 0 else x[t] * o.repetition_penalty
        if t in out:
            x[t] -= o.frequency_penalty * out.count(t) + o.presence_penalty
    return x


OPTIONS = [dict(logit_bias={3: 5.0, 7: -100.0}), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
           dict(repetition_penalty=1.3), dict(frequency_penalty=-0.5, presence_penalty=0.4, repetition_penalty=0.8,
                                              logit_bias={0: 2.0})]


@pytest.mark.parametrize("options", OPTIONS)
def test_adjusted_logits_equal_the_token_by_token_reference(options):
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 3  # [N, V]
    rows = [Sampling(**options), Sampling(), Sampling(**options)]
    seen = [([1, 2, 2], [3, 5, 5, 5]), None, ([], [7, 7, 11])]
    got = adjusted(logits, rows, seen)
    assert torch.equal(got[1], logits[1])  # a row without options is left as it was
    for i in (0, 2):
        want = torch.tensor(reference_adjusted(logits[i].tolist(), rows[i], *seen[i]))
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)


def test_greedy_rows_take_the_argmax_of_their_adjusted_logits():
    torch.manual_seed(1)
    logits = torch.randn(1, 12)
    o = Sampling(temperature=0, frequency_penalty=2.0, logit_bias={11: 1.0})
    out = [int(logits.argmax())] * 2
    want = max(range(12), key=lambda t: reference_adjusted(logits[0].tolist(), o, [], out)[t])
    assert pick(logits, [o], [0.5], seen=[([], out)]) == [want] != [int(logits.argmax())]


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_draws_follow_the_distribution_without_the_tokens_below_min_p_of_the_likeliest(min_p):
    logits = torch.tensor([[2.0, 1.5, 1.4, 0.3, -0.2, 0.9, -1.0, 0.0, 1.1, -3.0, 0.5, 0.2]])  # [1, V]
    p = (logits[0] / 0.9).softmax(-1)
    want = torch.where(p >= min_p * p.max(), p, 0.0)
    want /= want.sum()
    rows = [Sampling(temperature=0.9, top_k=None, min_p=min_p, seed=i) for i in range(6000)]
    drawn = pick(logits.expand(len(rows), -1), rows, [r.uniforms(1)[0] for r in rows])
    freq = torch.bincount(torch.tensor(drawn), minlength=12) / len(rows)
    assert freq[want == 0].sum() == 0 and (freq - want).abs().max() < 0.025


def reference_penalized(model, prompt: list[int], n: int, o: Sampling) -> list[int]:
    """Greedy decoding with the options, one full forward a token: the plain way."""
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out]))[0, -1].tolist()
            x = reference_adjusted(logits, o, prompt, out)
            out.append(max(range(len(x)), key=x.__getitem__))
    return out


def test_a_penalized_request_batched_with_others_is_exact_and_leaves_theirs_unchanged():
    model = tiny()
    ps = prompts(2, 5, 5, 40)
    o = Sampling(20, temperature=0, presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.2,
                 logit_bias={5: 0.3})
    engine = Engine(model, blocks=100, block_size=8)
    rs = engine.run([Request(ps[0], o)] + [Request(p, Sampling(20, temperature=0)) for p in ps[1:]])
    assert rs[0].out == reference_penalized(model, ps[0], 20, o) != alone(model, ps[0], 20)
    assert [r.out for r in rs[1:]] == [alone(model, p, 20) for p in ps[1:]]


@pytest.mark.parametrize("options, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs")])
def test_options_out_of_range_are_refused_naming_the_option(options, field):
    with pytest.raises(OptionError) as e:
        Sampling(**options)
    assert e.value.param == field and field in str(e.value)


def test_a_logit_bias_past_the_vocabulary_is_refused_when_the_request_is_checked():
    engine = Engine(tiny(), blocks=10, block_size=8)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add(Request([1, 2], Sampling(4, logit_bias={64: 1.0})))
    assert not engine.has_work()
