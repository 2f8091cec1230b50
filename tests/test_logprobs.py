"""Log-probabilities from the engine: each new token's and, for scoring (echo), each prompt token's, taken from the
logits the engine computed anyway, equal to what one full forward of the model over the text gives."""
import pytest
import torch

from engine import Engine, Request
from sampling import Sampling
from test_engine import pool_is_whole, prompts, tiny


@pytest.fixture(scope="module")
def model():
    return tiny()  # float32, model.py's forward over the pool


def full_logprobs(model, tokens: list[int]) -> torch.Tensor:  # -> [len(tokens), V]: one forward, no cache
    with torch.inference_mode():
        return model(torch.tensor([tokens])).float().log_softmax(-1)[0]


def test_each_new_tokens_logprobs_are_those_of_a_full_forward_over_prompt_and_answer(model):
    engine = Engine(model, blocks=100, block_size=8)
    rs = [Request(p, Sampling(12, temperature=0.0 if i % 2 else 1.0, seed=i, logprobs=3 if i != 2 else None))
          for i, p in enumerate(prompts(3, 5, 5, 40))]
    engine.run(rs)
    for r in rs:
        if r.sampling.logprobs is None:
            assert r.logprobs == []
            continue
        full = full_logprobs(model, r.prompt + r.out)[len(r.prompt) - 1 : -1]  # [len(out), V]: each new token's
        assert len(r.logprobs) == len(r.out) == 12
        for i, (lp, top) in enumerate(r.logprobs):
            assert abs(lp - full[i, r.out[i]].item()) < 1e-5
            want = full[i].topk(3)
            assert [t for t, _ in top] == want.indices.tolist()
            assert max(abs(a - b) for (_, a), b in zip(top, want.values.tolist())) < 1e-5


def test_logprobs_are_the_models_own_distribution_whatever_the_temperature_and_top_k(model):
    def first(**options):
        r = Request([1, 2, 3, 4], Sampling(1, seed=0, logprobs=5, **options))
        Engine(model, blocks=20, block_size=8).run([r])
        return r.logprobs[0][1]
    assert first(temperature=0.0) == first(temperature=1.7, top_k=2) == first(temperature=0.3, top_p=0.2)


def test_prompt_logprobs_match_a_full_forward_even_where_the_prefix_cache_holds_the_prompt(model):
    shared, engine = prompts(4, 1, 40, 40)[0], Engine(model, blocks=100, block_size=8)
    warm = engine.run([Request(shared + [7], Sampling(4, temperature=0))])[0]  # its 5 full blocks stay cached
    scored = Request(shared + [9, 10], Sampling(4, temperature=0, prompt_logprobs=2))
    plain = Request(shared + [9, 10], Sampling(4, temperature=0))
    engine.run([scored, plain])
    assert warm.cached_tokens == 0 and plain.cached_tokens == 40 and scored.cached_tokens == 0
    assert scored.out == plain.out  # scoring changes nothing of the answer
    full = full_logprobs(model, scored.prompt)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(scored.prompt)
    for i, (lp, top) in enumerate(scored.prompt_logprobs[1:], start=1):
        assert abs(lp - full[i - 1, scored.prompt[i]].item()) < 1e-5
        assert [t for t, _ in top] == full[i - 1].topk(2).indices.tolist()
    assert pool_is_whole(engine)


def test_scoring_requests_prefilled_in_chunks_preempted_and_recomputed_note_each_prompt_token_once(model):
    ps = prompts(11, 8, 20, 100)
    engine = Engine(model, blocks=16, max_rows=8, budget=24)  # far less than 8 requests need at once
    rs = engine.run([Request(p, Sampling(30, temperature=0, prompt_logprobs=0)) for p in ps])
    assert engine.stats["preempted"] > 0 and pool_is_whole(engine)
    for r in rs:
        full = full_logprobs(model, r.prompt)
        assert len(r.prompt_logprobs) == len(r.prompt)
        got = torch.tensor([lp for lp, _ in r.prompt_logprobs[1:]])
        assert (got - full[:-1].gather(1, torch.tensor(r.prompt[1:])[:, None])[:, 0]).abs().max() < 1e-5


def test_bf16_prompt_logprobs_on_the_cpp_step_are_the_logits_each_prefix_would_decode_from():
    """On the C++ step each prompt token is a row of its own over the same blocks, computed as alone: token i's
    alternatives are exactly the first new token's of a request whose prompt stops before it."""
    from test_batch_invariance import bf16_model
    model = bf16_model(32, weights="bf16", kv_heads=8, hidden=128)
    engine = Engine(model, blocks=100, max_rows=8)
    assert engine.passes.cpp is not None
    prompt = prompts(12, 1, 150, 150)[0]
    scored = engine.run([Request(prompt, Sampling(1, temperature=0, prompt_logprobs=4))])[0]
    for i in (1, 31, 32, 33, 100, 149):
        alone = engine.run([Request(prompt[:i], Sampling(1, temperature=0, logprobs=4))])[0]
        assert scored.prompt_logprobs[i][1] == alone.logprobs[0][1]
