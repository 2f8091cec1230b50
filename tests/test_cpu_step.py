"""cpu_step.py: the batch-1 decode step as one C++ call gives model.py's logits on the same kernels, for every
weight kind, cache kind and attention variant it takes; generate's compiled decoding runs it and gives eager's
tokens; what it cannot run exactly goes to the compiled step."""
import pytest
import torch

import cpu_gemv
import cpu_step
import generate as gen
import quantize
from backend import Backend
from checkpoint import load_model
from generate import DEFAULT_CHECKPOINT, generate
from model import ModelArgs, RMSNorm, Transformer
from sampling import Sampling, pick

pytestmark = pytest.mark.skipif(cpu_gemv.load() is None, reason="no kernels for this CPU or no g++")
TARGETS = [name for name, _, _ in cpu_gemv.targets(cpu_gemv.cpu_flags())]


@pytest.fixture(params=TARGETS)
def kernels(request):  # every kernel set this CPU runs: on an AVX-512 machine the AVX2 one too
    assert cpu_gemv.load(request.param) == request.param
    yield request.param
    cpu_gemv.load()


@pytest.fixture(autouse=True)
def two_threads():  # the products and the attention split their work between threads, as decode runs them
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    yield
    torch.set_num_threads(threads)


def tiny(mode: str = "bf16", kv=None, **kw) -> Transformer:
    """A random 2-layer model with weights of kind mode, on this CPU's kernels, its cache set up."""
    torch.manual_seed(0)
    args = ModelArgs(**{**dict(vocab_size=320, n_layer=2, n_head=4, n_kv_head=2, dim=256, intermediate_size=512,
                                block_size=256), **kw})
    state = Transformer(args).state_dict()
    if args.qkv_bias:
        state = {k: torch.randn_like(v) / 4 if k.endswith("bqkv") else v for k, v in state.items()}
    model = Transformer(args)
    if mode == "bf16":
        state = {k: v.bfloat16() for k, v in state.items()}
    else:
        ref = Transformer(args)
        ref.load_state_dict(state)
        state = quantize.quantized_state(ref, mode, 32)
        quantize.install(model, mode, 32)
    model.load_state_dict(state, assign=True)
    cpu_gemv.install(model.eval())
    model.setup_caches(1, 256, kv)
    return model


@torch.inference_mode()
def logits_both_ways(model: Transformer, prompt_len: int = 9, steps: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """(model.py's logits, the C++ step's) for `steps` decode steps after a random prompt, each fed its argmax."""
    prompt = torch.randint(0, model.args.vocab_size, (1, prompt_len))
    model(prompt, model.context(torch.arange(prompt_len), kv_len=model.max_seq_length))
    step, out, cur = cpu_step.step_for(model), [], torch.tensor([[5]])
    assert step is not None
    for pos in range(prompt_len, prompt_len + steps):
        ref = model(cur, model.context(torch.tensor([pos])))[:, -1].float()  # writes the slot, which the step then writes again
        got = step(cur, torch.tensor([pos])).clone()  # the step's buffer, which the next step rewrites
        out.append((ref, got))
        cur = ref.argmax(-1, keepdim=True)
    return out


def close(ref: torch.Tensor, got: torch.Tensor) -> bool:
    # bf16 activations round at the same points, but RoPE, the norms' sums and SiLU in another order
    return ((got - ref).norm() / ref.norm()).item() < 1e-2 and torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4"])
def test_the_step_gives_model_py_logits_for_each_weight_kind(mode, kernels):
    assert all(close(ref, got) for ref, got in logits_both_ways(tiny(mode)))


def test_the_step_gives_model_py_logits_over_an_int8_cache(kernels):
    assert all(close(ref, got) for ref, got in logits_both_ways(tiny("int4", kv=torch.int8)))


@pytest.mark.parametrize("kv", [None, torch.int8])
def test_a_sliding_window_hides_the_old_positions_as_model_py_does(kv):
    # 9 prompt positions and a window of 4: the steps attend to the last 4 slots only
    model = tiny(sliding_window=4, kv=kv)
    assert all(close(ref, got) for ref, got in logits_both_ways(model))


def test_q_k_v_biases_and_one_kv_head_are_taken_as_model_py_takes_them():
    assert all(close(ref, got) for ref, got in logits_both_ways(tiny("int8", qkv_bias=True, n_kv_head=1)))


def test_decoding_runs_the_step_and_gives_model_py_s_tokens(monkeypatch):
    model = load_model(DEFAULT_CHECKPOINT, "cpu", torch.bfloat16)
    prompts = [[1, 40, 41, 42], [1, 99, 7, 8, 9, 10, 11, 12, 13]]
    eager = [generate(model, [p], 40, temperature=0.0, backend=Backend(model, cpp=False)).rows[0] for p in prompts]
    calls = []
    for name in ("__call__", "greedy"):  # logits to sample from, or the greedy pick
        run = getattr(cpu_step.Step, name)
        monkeypatch.setattr(cpu_step.Step, name, lambda self, *a, run=run: calls.append(1) or run(self, *a))
    backend = Backend(model)
    shown = []  # a callback sees each token as it comes: a step at a time from Python
    assert [generate(model, [p], 40, backend=backend, temperature=0.0, callback=shown.append).rows[0]
            for p in prompts] == eager
    assert len(calls) == 2 * 39 and len(shown) == 2 * 40  # every token after prefill's


def test_greedy_decoding_without_a_callback_is_one_c_plus_plus_loop_with_eager_tokens(monkeypatch):
    model = load_model(DEFAULT_CHECKPOINT, "cpu", torch.bfloat16)
    eager = generate(model, [[1, 40, 41, 42]], 40, temperature=0.0, backend=Backend(model, cpp=False)).rows[0]
    loops = []
    run = cpu_step.Step.greedy_loop
    monkeypatch.setattr(cpu_step.Step, "greedy_loop", lambda self, *a: loops.append(run(self, *a)) or loops[-1])
    monkeypatch.setattr(cpu_step.Step, "__call__", lambda *a: pytest.fail("a step from Python"))
    monkeypatch.setattr(cpu_step.Step, "greedy", lambda *a: pytest.fail("a step from Python"))
    result = generate(model, [[1, 40, 41, 42]], 40, temperature=0.0)
    assert result.rows[0] == eager and loops == [39] and result.forwards == 39


def test_the_c_plus_plus_loop_stops_at_an_end_of_sequence_id_as_the_loop_in_python_does():
    model = load_model(DEFAULT_CHECKPOINT, "cpu", torch.bfloat16)
    eager = Backend(model, cpp=False)
    free = generate(model, [[1, 40, 41, 42]], 40, temperature=0.0, backend=eager).rows[0]
    want = generate(model, [[1, 40, 41, 42]], 40, eos_ids=[free[2]], temperature=0.0, backend=eager)  # free[2] ends it
    looped = generate(model, [[1, 40, 41, 42]], 40, eos_ids=[free[2]], temperature=0.0)
    assert looped.rows == want.rows == [free[:2]]
    assert looped.forwards == 2  # the steps to the end and no more


def test_the_c_plus_plus_loop_stops_at_a_nan_with_the_loop_s_error():
    model = tiny()
    model.layers[1].feed_forward.w2.weight.data[3, 5] = float("nan")
    # the prompt's token comes from prefill's (torch's) forward, which already sees the NaN: feed the C++ loop a
    # clean first token, as a model that goes wrong only later would
    out = torch.tensor([[5, 0, 0, 0]])
    with torch.inference_mode(), pytest.raises(ValueError, match="NaN or infinite by new token 2"):
        filled = Backend(model).greedy_loop(out, 3, None, None)
        gen.check_finite(out[:, :filled], filled - 1)
    assert out[0, 1].item() == gen.NOT_FINITE


def test_batches_and_models_the_step_cannot_run_take_model_py_s_forward():
    model = tiny()
    forward, backend = [], Backend(model)
    model_step = backend.step_last
    backend.step_last = lambda *a: forward.append(1) or model_step(*a)
    with torch.inference_mode():
        backend.decode(torch.tensor([[3]]), torch.tensor([0]), None, 256)
        assert forward == []
        model.setup_caches(2, 256)
        backend.decode(torch.tensor([[3], [4]]), torch.tensor([0]), None, 256)  # a batch
        assert forward == [1]
        model.setup_caches(1, 256)
        backend.decode(torch.tensor([[3]]), torch.tensor([0]), torch.tensor([0]), 256)  # left padding
        assert forward == [1, 1]
    assert cpu_step.step_for(load_model(DEFAULT_CHECKPOINT, "cpu", torch.float32)) is None  # float32
    assert cpu_step.step_for(load_model(DEFAULT_CHECKPOINT, "cpu", torch.bfloat16, "off")) is None  # torch's kernels
    model.layers[1].attention.wo.register_forward_hook(lambda *a: None)  # e.g. tensor parallelism's all-reduce
    assert cpu_step.step_for(model) is None


def test_the_backend_builds_its_step_again_for_a_new_cache_and_each_answer():
    model = tiny()
    backend = Backend(model)
    first = backend.cpp()
    assert backend.cpp() is first  # within an answer
    model.setup_caches(1, 128)
    second = backend.cpp()  # a new cache
    assert second is not first
    backend.begin()  # a new answer
    assert backend.cpp() is not second
    with torch.inference_mode():
        second(torch.tensor([[3]]), torch.tensor([0]))
    assert model.layers[0].attention.kv_cache.k_cache[0, :, 0].ne(0).any()  # the new cache's first slot written
    assert all(close(ref, got) for ref, got in logits_both_ways(model))


def test_the_greedy_pick_is_torch_argmax_first_of_equals_and_minus_one_for_a_nan_or_an_infinity():
    step = cpu_step.step_for(tiny())
    torch.manual_seed(0)
    for V in (320, 32000, 32003):  # a tail past the last 8
        logits = torch.randn(1, V)
        first = V // 3 // 8 * 8 + 3
        logits[0, [first, first + 64, V // 2, V - 1]] = logits.max() + 1  # equal largest: argmax takes the first
        assert step.cpp.greedy(logits) == logits.argmax(-1).item() == first
        logits[0, V - 1] = logits.max() + 1  # the last one, in the tail where V is not a multiple of 8
        assert step.cpp.greedy(logits) == V - 1
        for bad in (float("nan"), float("inf"), -float("inf")):
            for at in (7, V - 1):
                damaged = logits.clone()
                damaged[0, at] = bad
                assert step.cpp.greedy(damaged) == gen.NOT_FINITE == pick(damaged, [Sampling(temperature=0)], [0])[0]


def test_greedy_decoding_takes_the_step_s_pick_and_sampling_takes_its_logits():
    model = tiny()
    backend = Backend(model)
    backend.step_last = lambda *a: pytest.fail("model.py's forward ran")
    with torch.inference_mode():
        step = cpu_step.step_for(model)
        want = step(torch.tensor([[3]]), torch.tensor([0])).argmax(-1)
        model.setup_caches(1, 256)
        got = backend.greedy(torch.tensor([[3]]), torch.tensor([0]), None, 256)
        assert torch.equal(got, want)
        model.setup_caches(1, 256)
        logits = backend.decode(torch.tensor([[3]]), torch.tensor([0]), None, 256)
        assert torch.equal(logits, step_logits(model))


def step_logits(model: Transformer) -> torch.Tensor:  # the first step's logits after token 3, on a fresh cache
    model.setup_caches(1, 256)
    return cpu_step.step_for(model)(torch.tensor([[3]]), torch.tensor([0]))


def test_a_token_or_position_outside_the_model_is_an_error_not_a_read_out_of_bounds():
    step = cpu_step.step_for(tiny())
    with pytest.raises(ValueError, match="outside the model"):
        step(torch.tensor([[320]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside the model"):
        step(torch.tensor([[3]]), torch.tensor([256]))
    with pytest.raises(ValueError, match="outside the model"):  # the loop's last position past the cache
        step.greedy_loop(3, 250, torch.zeros(7, dtype=torch.int64), None)


def test_an_unchanged_model_passes_the_step_s_check_and_nothing_is_said(capsys):
    assert cpu_step.step_for(tiny("int4")) is not None
    assert capsys.readouterr().err == ""


def test_the_step_s_check_leaves_the_cache_as_it_was():
    model = tiny(kv=torch.int8)
    with torch.inference_mode():
        model(torch.randint(0, 320, (1, 9)), model.context(torch.arange(9)))  # a prompt in the slots the check writes and reads
    before = [t.clone() for t in model.buffers()]
    assert cpu_step.step_for(model) is not None
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def test_a_changed_model_py_forward_takes_model_py_s_forward_and_one_line_says_why(monkeypatch, capsys):
    # a fork that edits model.py's forward and not the C++ step: here every RMSNorm's output scaled
    norm = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: norm(self, x) * 1.5)
    model = tiny()
    eager = generate(model, [[1, 40, 41, 42]], 12, temperature=0.0, backend=Backend(model, cpp=False)).rows[0]
    assert generate(model, [[1, 40, 41, 42]], 12, temperature=0.0).rows[0] == eager
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cpu_step")]
    assert cpu_step.step_for(model) is None
    assert len(said) == 1 and said[0].startswith("cpu_step: the C++ step does not match model.py's forward (logits ")
