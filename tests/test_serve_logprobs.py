"""serve.py's log-probabilities, echo and penalties, against the model computed directly: the built-in model in
float32 (model.py's forward over the pool) for exact figures, and a tiny chat model for the chat layout."""
import pytest
import torch

from test_serve import BUILTIN, openai, serving

PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    with serving(BUILTIN, tmp_path_factory.mktemp("serve"), "--dtype", "float32", "--max_rows", 4) as s:
        yield s


@pytest.fixture(scope="module")
def direct():
    from fast_decode import LLM
    return LLM(BUILTIN, dtype="float32", threads=1)


def full_logprobs(llm, ids: list[int]) -> torch.Tensor:  # -> [len(ids), V]: one forward over the text, no cache
    with torch.inference_mode():
        return llm.model(torch.tensor([ids])).float().log_softmax(-1)[0]


def greedy(llm, ids: list[int], n: int, o=None) -> list[int]:
    """n greedy tokens, one full forward each (o: a Sampling whose penalties apply, the plain way)."""
    from test_penalties import reference_adjusted
    out = []
    for _ in range(n):
        x = full_logprobs(llm, ids + out)[-1].tolist()
        x = reference_adjusted(x, o, ids, out) if o is not None else x
        out.append(max(range(len(x)), key=x.__getitem__))
    return out


def test_echoed_prompt_logprobs_are_the_models_own_within_1e_4(fp32, direct):
    ids = direct.tokenizer.encode(PROMPT, bos=True)
    r = fp32.client().completions.create(model="stdlib-target", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp, full = r.choices[0].logprobs, full_logprobs(direct, ids)
    assert r.choices[0].text == direct.tokenizer.decode(ids, specials=False) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    want = full[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (torch.tensor(lp.token_logprobs[1:]) - want).abs().max() < 1e-4
    assert all(max(top.values()) == pytest.approx(full[i].max().item(), abs=1e-4)
               for i, top in enumerate(lp.top_logprobs[1:]))
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[-1] == len(r.choices[0].text) - len(lp.tokens[-1])


def test_echo_is_exact_with_the_prefix_cache_warm(fp32, direct):
    ids = direct.tokenizer.encode(PROMPT * 4, bos=True)  # several full blocks
    c = fp32.client()
    c.completions.create(model="stdlib-target", prompt=ids, max_tokens=1)  # its blocks now cached
    warm = c.completions.create(model="stdlib-target", prompt=ids, max_tokens=1)
    scored = c.completions.create(model="stdlib-target", prompt=ids, max_tokens=1, echo=True, logprobs=1)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    want = full_logprobs(direct, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = scored.choices[0].logprobs.token_logprobs
    assert len(got) == len(ids) + 1 and (torch.tensor(got[1:-1]) - want).abs().max() < 1e-4


def test_each_new_tokens_logprob_is_the_models_own_at_any_temperature(fp32, direct):
    ids = direct.tokenizer.encode(PROMPT, bos=True)
    tokens = greedy(direct, ids, 6)
    full = full_logprobs(direct, ids + tokens)[len(ids) - 1 : -1]
    for temperature in (0, 1.5):
        r = fp32.client().completions.create(model="stdlib-target", prompt=ids, max_tokens=6, logprobs=3,
                                             temperature=temperature, seed=1, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        if temperature == 0:
            assert r.choices[0].text == direct.tokenizer.decode(ids + tokens, specials=False)[len(
                direct.tokenizer.decode(ids, specials=False)):]
            want = full.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            assert (torch.tensor(lp.token_logprobs) - want).abs().max() < 1e-4
        assert all(len(top) == 3 and max(top.values()) == pytest.approx(full_logprobs(direct, ids)[-1].max().item(),
                                                                        abs=1e-4) for top in lp.top_logprobs[:1])


def test_streamed_completion_logprobs_join_to_the_whole_ones(fp32):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2, "echo": True}
    whole = fp32.http("POST", "/v1/completions", body)[1]["choices"][0]
    status, events = fp32.events("/v1/completions", body)
    parts = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert status == 200 and "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole["logprobs"][key]


def test_penalties_and_logit_bias_give_what_the_plain_reference_gives(fp32, direct):
    from sampling import Sampling
    ids = direct.tokenizer.encode(PROMPT, bos=True)
    bias = {direct.tokenizer.encode(" return", bos=False)[0]: 4.0}
    o = Sampling(12, temperature=0, presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.1,
                 logit_bias=bias)
    want = greedy(direct, ids, 12, o)
    r = fp32.client().completions.create(
        model="stdlib-target", prompt=ids, max_tokens=12, temperature=0, presence_penalty=0.6, frequency_penalty=0.9,
        logit_bias={str(t): b for t, b in bias.items()}, extra_body={"repetition_penalty": 1.1, "ignore_eos": True})
    head = len(direct.tokenizer.decode(ids, specials=False))
    assert r.choices[0].text == direct.tokenizer.decode(ids + want, specials=False)[head:]
    assert want != greedy(direct, ids, 12)


def test_chat_logprobs_through_the_sdk_whole_and_streamed(chat_checkpoint, tmp_path):
    with serving(chat_checkpoint, tmp_path) as s:
        args = dict(model="ckpt", messages=[{"role": "user", "content": "hello there"}], max_tokens=8,
                    temperature=0, logprobs=True, top_logprobs=3)
        whole = s.client().chat.completions.create(**args)
        content = whole.choices[0].logprobs.content
        assert "".join(t.token for t in content) == whole.choices[0].message.content
        assert all(len(t.top_logprobs) == 3 and t.logprob == t.top_logprobs[0].logprob and
                   bytes(t.bytes).decode() == t.token for t in content)
        streamed = [t for ch in s.client().chat.completions.create(**args, stream=True)
                    if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
        assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(**{**args, "logprobs": False})
        assert e.value.param == "top_logprobs"


REFUSED = [  # (body, the field the 400 names)
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"echo": "yes"}, "echo"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "a lot"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"max_tokens": 0}, "max_tokens"), ({"suffix": "x"}, "suffix")]


@pytest.mark.parametrize("body,field", REFUSED, ids=[f for _, f in REFUSED])
def test_a_refused_field_is_a_400_naming_it(fp32, body, field):
    status, answer = fp32.http("POST", "/v1/completions", {"prompt": "x", **body})
    assert status == 400 and answer["error"]["param"] == field and answer["error"]["type"] == "invalid_request_error"
