"""The engine: many requests through one paged KV cache give each request what it would get alone."""
import random

import pytest
import torch

import cpu_gemv

from engine import Engine, Request
from sampling import Sampling
from backend import Backend
from generate import generate
from model import ModelArgs, Transformer
from test_batch_invariance import kernels  # noqa: F401 (a fixture: every kernel set this CPU runs)


def tiny(seed=0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    args = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, dim=32, intermediate_size=64, block_size=1024)
    model = Transformer(ModelArgs(**{**args, **overrides})).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.setup_caches(1, args["block_size"])
    return model


def alone_lone_reference(model, prompt, n) -> list[int]:
    """What the engine's C++ step must equal for a prompt alone: generate()'s tokens, whose prefill runs in the
    step's pieces too, whatever the CPU's kernels."""
    return alone(model, prompt, n, compiled=True)


def alone(model, prompt, n, compiled: bool = False) -> list[int]:
    """generate()'s greedy tokens for the prompt by itself (compiled: on the backend generate.py runs, on the CPU
    kernels the C++ step; else model.py's forward)."""
    return generate(model, [prompt], n, temperature=0, backend=Backend(model, cpp=compiled)).rows[0]


def prompts(seed: int, count: int, lo: int = 1, hi: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def pool_is_whole(engine: Engine) -> bool:
    return engine.pool.available() == engine.pool.n_blocks and not engine.running and not engine.waiting


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def expected(model):
    ps = prompts(1, 12)
    return ps, [alone(model, p, 24) for p in ps]


def test_greedy_requests_in_one_batch_match_each_run_alone(model, expected):
    ps, want = expected
    engine = Engine(model, blocks=200, block_size=8)
    done = engine.run([Request(p, Sampling(24, temperature=0)) for p in ps])
    assert [r.out for r in done] == want
    assert all(r.finish_reason == "length" for r in done) and pool_is_whole(engine)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requests_arriving_while_others_decode_get_the_same_tokens(model, expected, seed):
    ps, want = expected
    rng, engine = random.Random(seed), Engine(model, blocks=200, block_size=8, max_rows=5, budget=16)
    order, live = list(range(len(ps))), {}
    rng.shuffle(order)
    while order or engine.has_work():
        for _ in range(rng.randint(0, 3)):  # some join at each step, in a random order
            if order:
                i = order.pop()
                live[i] = engine.add(Request(ps[i], Sampling(24, temperature=0)))
        engine.step()
    assert [live[i].out for i in range(len(ps))] == want and pool_is_whole(engine)


def test_long_prompts_prefill_in_chunks_within_the_step_budget(model):
    ps = prompts(2, 4, 90, 120)
    engine = Engine(model, blocks=100, block_size=8, max_rows=4, budget=8)
    done = engine.run([Request(p, Sampling(10, temperature=0)) for p in ps])
    assert [r.out for r in done] == [alone(model, p, 10) for p in ps]
    assert engine.stats["steps"] >= sum(map(len, ps)) // 8


def test_a_full_pool_preempts_the_newest_request_and_recomputes_it(model, expected):
    ps, want = expected
    engine = Engine(model, blocks=24, block_size=8, max_rows=8)  # far less than 12 requests need at once
    done = engine.run([Request(p, Sampling(24, temperature=0)) for p in ps])
    assert engine.stats["preempted"] > 0
    assert [r.out for r in done] == want and pool_is_whole(engine)


def test_once_requests_ran_to_their_length_a_small_pool_admits_only_what_it_can_finish(model, expected):
    ps, want = expected
    engine = Engine(model, blocks=24, block_size=8, max_rows=8)  # far less than 12 requests need at once
    engine.run([Request(ps[0], Sampling(24, temperature=0))])  # it wrote all 24 tokens it could
    done = engine.run([Request(p, Sampling(24, temperature=0)) for p in ps])
    assert engine.stats["preempted"] == 0 and engine.stats["waited"] == 0
    assert [r.out for r in done] == want and pool_is_whole(engine)


def test_the_pool_admits_by_the_share_of_max_new_tokens_finished_requests_wrote(model):
    ps = prompts(5, 8, 8, 8)  # a block of 8 each, and 40 tokens to write (6 blocks in all, each)
    for wrote, admitted in ((100, 2), (0, 8)):  # all of it: 2 fit to the end; none: all 8 start at once
        engine = Engine(model, blocks=16, block_size=8, max_rows=8)
        engine.written = [wrote, 100]
        for p in ps:
            engine.add(Request(p, Sampling(40, temperature=0)))
        engine.step()
        assert len(engine.running) == admitted


def test_a_row_short_of_a_block_waits_for_one_rather_than_being_recomputed(model):
    a, b = prompts(12, 1, 15, 15)[0], prompts(13, 1, 9, 9)[0]
    engine = Engine(model, blocks=5, block_size=8)  # b's third block is a's third until a finishes
    done = engine.run([Request(a, Sampling(10, temperature=0)), Request(b, Sampling(12, temperature=0))])
    assert engine.stats["preempted"] == 0 and engine.stats["waited"] > 0
    assert [r.out for r in done] == [alone(model, a, 10), alone(model, b, 12)] and pool_is_whole(engine)


def test_a_shared_system_prompt_is_prefilled_once(model):
    system = prompts(3, 1, 500, 500)[0]
    questions = prompts(4, 32, 5, 20)
    engine = Engine(model, blocks=400, block_size=16, max_rows=32, budget=4096)  # all 32 at once could fit
    done = engine.run([Request(system + q, Sampling(4, temperature=0)) for q in questions])
    # the first computes the 31 full blocks of the system prompt; the others wait for them and share them
    assert engine.stats["cached_tokens"] >= 0.95 * 31 * 500 and all(r.cached_tokens == 496 for r in done[1:])
    for r, q in list(zip(done, questions))[:3]:
        assert r.out == alone(model, system + q, 4)
    assert pool_is_whole(engine)


def test_a_cancelled_request_gives_its_blocks_back_at_once(model):
    engine = Engine(model, blocks=50, block_size=8)
    a = engine.add(Request(prompts(5, 1, 60, 60)[0], Sampling(30, temperature=0)))
    b = engine.add(Request([1, 2, 3]))
    engine.step()
    used = engine.pool.in_use()
    engine.cancel(a)
    assert a.finish_reason == "cancelled" and engine.pool.in_use() == used - 8  # its 60 tokens' 8 blocks
    engine.cancel(b)
    assert pool_is_whole(engine)


def test_bad_requests_are_refused_and_leave_the_engine_as_it_was(model):
    engine = Engine(model, blocks=20, block_size=8)
    for bad, what in ((Request([]), "empty"), (Request([1] * 1000, Sampling(100, temperature=0)), "context"),
                      (Request([1] * 100, Sampling(100, temperature=0)), "pool")):
        with pytest.raises(ValueError, match=what):
            engine.add(bad)
    assert not engine.has_work() and pool_is_whole(engine)


def test_sampled_requests_with_a_seed_are_reproducible_whatever_shares_their_batch(model):
    def sampled(others: int) -> list[int]:
        engine = Engine(model, blocks=100, block_size=8)
        rs = [Request([5, 6, 7], Sampling(20, temperature=1.0, top_k=None, seed=42))]
        rs += [Request(p, Sampling(20, temperature=0.8, top_k=10)) for p in prompts(6, others)]
        return engine.run(rs)[0].out
    assert sampled(0) == sampled(5) and len(set(sampled(0))) > 1


@pytest.mark.parametrize("options", [dict(temperature=0.7), dict(temperature=1.0, top_k=4),
                                     dict(temperature=1.0, top_p=0.6), dict(temperature=1.3, top_k=6, top_p=0.5)])
def test_the_draws_follow_the_filtered_distribution(options):
    from conftest import reference_probs
    from sampling import pick
    logits = torch.tensor([[2.0, 1.5, 1.4, 0.3, -0.2, 0.9, -1.0, 0.0, 1.1, -3.0, 0.5, 0.2]])  # [1, V]
    want = reference_probs(logits, options["temperature"], options.get("top_k"), options.get("top_p", 1.0))[0]
    rows = [Sampling(**{"top_k": None, **options}, seed=i) for i in range(6000)]
    drawn = pick(logits.expand(len(rows), -1), rows, [r.uniforms(1)[0] for r in rows])
    seen = torch.bincount(torch.tensor(drawn), minlength=12) / len(rows)
    assert seen[want == 0].sum() == 0  # nothing outside the top_k and the nucleus
    assert (seen - want).abs().max() < 0.025  # 6,000 draws: a frequency's spread is about 0.006


def test_a_draw_never_lands_on_a_token_of_probability_zero_at_either_end_or_between():
    from sampling import draw
    p = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    ends = [draw(p, 1.0, u) for u in (0.0, 1 - 2**-52)]  # the largest and smallest 1 - u
    seen = torch.bincount(torch.tensor([draw(p, 1.0, u) for u in torch.rand(4000).tolist()] + ends), minlength=7)
    assert set(seen.nonzero().flatten().tolist()) == {2, 4} and abs(seen[2] / 4002 - 0.25) < 0.03


def test_end_of_sequence_and_stop_limits_end_each_request_by_itself(model, expected):
    ps, want = expected
    eos = want[0][5]
    engine = Engine(model, blocks=200, block_size=8)
    done = engine.run([Request(ps[0], Sampling(24, temperature=0), eos_ids=(eos,)),
                       Request(ps[1], Sampling(3, temperature=0))])
    assert done[0].out == want[0][: want[0].index(eos)] and done[0].finish_reason == "stop"
    assert done[1].out == want[1][:3] and done[1].finish_reason == "length"


# bfloat16 on the CPU kernels: the engine's rows run the C++ step (cpu_step.py) over the pool, decoding rows together
# and prompts in pieces (Step.piece positions), whose products and attention do not depend on the rows beside them
# (test_batch_invariance.py); a lone run (generate.py) prefills in such pieces too.
# So each request's output is the lone one's token for token, however its prompt was cut, shared or recomputed.
@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_bf16_requests_joining_at_any_step_match_each_run_alone(kernels, weights):
    from test_batch_invariance import bf16_model
    model = bf16_model(32, weights=weights, kv_heads=8)  # 8 KV heads: a lone 1024-slot cache splits in 768s
    ps = prompts(7, 8, 20, 400)
    rng, engine, live = random.Random(0), Engine(model, blocks=200, max_rows=8), []
    # decode steps as one C++ call over the pool, as the compiled batch-1 step is; where that step cannot run the
    # model (int4 here: its hidden size is no multiple of 64), both run model.py's forward
    assert (engine.passes.cpp is not None) == (weights != "int4") and engine.passes.cache.attend is cpu_gemv.attend_paged
    want = [(alone_lone_reference if engine.passes.cpp is not None else alone)(model, p, 24) for p in ps]
    for p in ps:
        live.append(engine.add(Request(p, Sampling(24, temperature=0))))
        for _ in range(rng.randint(0, 3)):
            engine.step()
    while engine.has_work():
        engine.step()
    assert [r.out for r in live] == want and pool_is_whole(engine)


@pytest.fixture(scope="module", params=["bf16", "int8", "int4"])
def bf16_on_kernels(request):
    from test_batch_invariance import bf16_model
    model = bf16_model(32, weights=request.param, kv_heads=8, hidden=128)  # int4's step: hidden a multiple of 64
    assert Engine(model, blocks=8).passes.cpp is not None  # the engine's rows on the C++ step
    return model


def test_bf16_prompts_prefilled_in_chunks_of_any_size_match_each_run_alone(bf16_on_kernels):
    ps = prompts(8, 4, 90, 200)
    engine = Engine(bf16_on_kernels, blocks=100, max_rows=4, budget=23)  # chunks cut off the 32-position pieces
    done = engine.run([Request(p, Sampling(12, temperature=0)) for p in ps])
    assert [r.out for r in done] == [alone_lone_reference(bf16_on_kernels, p, 12) for p in ps]
    assert engine.stats["steps"] >= sum(map(len, ps)) // 23 and pool_is_whole(engine)


def test_bf16_prompts_sharing_cached_blocks_match_each_run_alone(bf16_on_kernels):
    system, questions = prompts(9, 1, 300, 300)[0], prompts(10, 5, 5, 40)
    engine = Engine(bf16_on_kernels, blocks=200, max_rows=8)
    done = engine.run([Request(system + q, Sampling(12, temperature=0)) for q in questions])
    assert all(r.cached_tokens == 288 for r in done[1:])  # 18 blocks: a piece of 32 cut at 16
    assert [r.out for r in done] == [alone_lone_reference(bf16_on_kernels, system + q, 12) for q in questions]


def test_bf16_requests_preempted_and_recomputed_match_each_run_alone(bf16_on_kernels):
    ps = prompts(11, 8, 20, 100)
    engine = Engine(bf16_on_kernels, blocks=16, max_rows=8)  # far less than 8 requests need at once
    done = engine.run([Request(p, Sampling(30, temperature=0)) for p in ps])
    assert engine.stats["preempted"] > 0 and pool_is_whole(engine)
    assert [r.out for r in done] == [alone_lone_reference(bf16_on_kernels, p, 30) for p in ps]


def batch_py(tmp_path, lines: str, *flags):  # -> (the finished process, the answers it wrote)
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    prompts, out = tmp_path / "p.jsonl", tmp_path / "a.jsonl"
    prompts.write_text(lines)
    result = subprocess.run([sys.executable, str(root / "batch.py"), "--prompts_file", str(prompts), "--output",
                             str(out), "--dtype", "float32", *map(str, flags)], capture_output=True, text=True,
                            timeout=300, cwd=root)
    return result, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_batch_py_answers_every_line_of_a_file_as_json_lines(tmp_path):
    lines = '{"prompt": "def f(x):"}\n{"prompt": "import os", "max_new_tokens": 3}\n{"prompt": "x" }\n'
    result, answers = batch_py(tmp_path, lines, "--temperature", 0, "--max_new_tokens", 6)
    assert result.returncode == 0, result.stderr
    assert [a["prompt"] for a in answers] == ["def f(x):", "import os", "x"]
    assert [a["usage"]["completion_tokens"] for a in answers] == [6, 3, 6]
    assert all(a["finish_reason"] == "length" for a in answers) and "3 requests" in result.stderr


def test_batch_py_takes_the_sampling_flags_of_every_command_stop_strings_included(tmp_path):
    result, answers = batch_py(tmp_path, "def f(x):\nimport os\n", "--temperature", 0, "--max_new_tokens", 40,
                               "--stop", "\n")
    assert result.returncode == 0, result.stderr
    assert len(answers) == 2 and all("\n" not in a["text"] and a["finish_reason"] == "stop" for a in answers), answers
    (tmp_path / "bad").mkdir()
    bad, _ = batch_py(tmp_path / "bad", "x\n", "--temperature", -1)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("--temperature must be a finite number >= 0, got -1.0")


def test_batch_py_fails_in_one_line_when_every_request_is_refused_but_still_writes_them(tmp_path):
    import json
    lines = "".join(json.dumps({"prompt": w * 60}) + "\n" for w in ("word ", "more "))
    result, answers = batch_py(tmp_path, lines, "--max_seq_length", 32)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: every request was refused")
    assert [a["finish_reason"] for a in answers] == ["error", "error"]


def test_batch_py_takes_penalties_and_writes_logprobs(tmp_path):
    lines = '{"prompt": "def f(x):"}\n{"prompt": "def f(x):", "frequency_penalty": 2.0, "logit_bias": {"3": -100}}\n'
    result, answers = batch_py(tmp_path, lines, "--temperature", 0, "--max_new_tokens", 6, "--logprobs", 1)
    assert result.returncode == 0, result.stderr
    assert answers[0]["text"] != answers[1]["text"] and not answers[1]["text"].startswith("\n")  # token 3: "\n"
    assert all(len(a["logprobs"]) == 6 and len(a["logprobs"][0][1]) == 1 for a in answers)
