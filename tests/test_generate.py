"""generate.py as a library: loading, batching, stopping, sampling and compilation."""
import pytest
import torch

import generate as gen
from checkpoint import load_model
from backend import Backend
from generate import generate, weight_bytes
from model import ModelArgs, Transformer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model32(checkpoint):
    return load_model(checkpoint, "cpu", torch.float32)


PROMPTS = [[1, 40, 41, 42], [1] + list(range(50, 70)), [1, 99, 7, 8, 9, 10, 11, 12, 13]]


def test_load_model_materialises_every_weight_in_the_requested_dtype(checkpoint):
    model = load_model(checkpoint, "cpu", torch.bfloat16)
    assert not model.training
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16, name


def test_batch_of_different_length_prompts_equals_each_prompt_alone(model32):
    batched = generate(model32, PROMPTS, 24, temperature=0.0).rows
    alone = [generate(model32, [p], 24, temperature=0.0).rows[0] for p in PROMPTS]
    assert batched == alone


def test_left_padded_rows_get_the_same_logits_as_alone(model32):
    short, long = PROMPTS[0], PROMPTS[1]
    T = len(long)
    idx = torch.tensor([[0] * (T - len(short)) + short, long])
    model32.setup_caches(2, 64)
    padded = model32(idx, model32.context(torch.arange(T), torch.tensor([T - len(short), 0])))[0, -1]
    model32.setup_caches(1, 64)
    alone = model32(torch.tensor([short]), model32.context(torch.arange(len(short))))[0, -1]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_a_cache_that_generate_set_up_stays_usable_outside_it(checkpoint):
    model = load_model(checkpoint, "cpu", torch.float32)  # no cache yet: generate sets one up, in inference mode
    first = generate(model, PROMPTS[:1], 8, temperature=0.0).rows
    cache = model.layers[0].attention.kv_cache.k_cache
    assert not cache.is_inference()
    with torch.no_grad():
        cache.zero_()  # as a caller writing the cache (bench.py fills it with a long context) does
        model(torch.tensor([PROMPTS[0]]), model.context(torch.arange(len(PROMPTS[0]))))
    assert generate(model, PROMPTS[:1], 8, temperature=0.0).rows == first


def test_each_row_stops_at_its_own_eos(model32):
    full = generate(model32, PROMPTS, 30, temperature=0.0).rows
    eos = full[0][5]  # a token that row 0 emits early
    rows = generate(model32, PROMPTS, 30, eos_ids=[eos], temperature=0.0).rows
    assert rows == [r[: r.index(eos)] if eos in r else r for r in full]
    assert len(rows[0]) == full[0].index(eos)


def test_decoding_ends_early_once_every_row_has_stopped(model32):
    full = generate(model32, PROMPTS[:1], 40, temperature=0.0).rows
    result = generate(model32, PROMPTS[:1], 40, eos_ids=[full[0][3]], temperature=0.0)
    assert result.forwards < 39


def test_prompt_plus_max_new_tokens_beyond_the_model_maximum_is_refused(model32):
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        generate(model32, [[1] * 200], model32.args.block_size - 199, temperature=0.0)


def draws(logits, n: int, **options) -> torch.Tensor:  # n tokens drawn from logits [V] by sampling.pick
    from sampling import Sampling, pick
    return torch.tensor(pick(logits.repeat(n, 1), [Sampling(**options)] * n, torch.rand(n).tolist()))


def test_temperature_zero_is_an_exact_argmax():
    from sampling import Sampling, pick
    logits = torch.randn(4, 1000)
    assert pick(logits, [Sampling(temperature=0.0)] * 4, [0.5] * 4) == logits.argmax(-1).tolist()


def test_sampling_draws_from_the_softmax_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    drawn = draws(logits, 40000, temperature=1.0, top_k=None)
    freq = torch.bincount(drawn, minlength=4).float() / drawn.numel()
    torch.testing.assert_close(freq, logits.softmax(-1), atol=0.01, rtol=0)


def test_top_k_samples_only_among_the_k_most_likely():
    torch.manual_seed(0)
    logits = torch.randn(50)
    assert set(draws(logits, 5000, temperature=1.5, top_k=3).tolist()) == set(logits.topk(3).indices.tolist())


@pytest.mark.parametrize("top_p, kept", [(0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_that_reaches_p(top_p, kept):
    torch.manual_seed(0)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draws(logits, 20000, temperature=1.0, top_k=None, top_p=top_p).tolist()) == kept


def test_same_seed_same_samples_other_seed_other_samples(model32):
    run = lambda seed: generate(model32, PROMPTS, 20, temperature=1.0, top_k=50, seed=seed).rows  # noqa: E731
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_a_seeded_row_samples_the_same_alone_and_in_a_batch(model32):
    alone = generate(model32, PROMPTS[:1], 20, temperature=1.0, top_k=50, seed=7).rows[0]
    assert generate(model32, PROMPTS, 20, temperature=1.0, top_k=50, seeds=[7, 8, 9][: len(PROMPTS)]).rows[0] == alone


def test_weight_bytes_counts_every_weight_but_the_untied_embedding_table(model32):
    params = sum(p.numel() for p in model32.parameters())
    assert weight_bytes(model32) == 4 * (params - model32.tok_embeddings.weight.numel())


def decode_logits(step, model, prompt, tokens):  # prompt [1, T], tokens: the fixed continuation fed back
    T = prompt.size(1)
    model.setup_caches(1, 64)
    model(prompt, model.context(torch.arange(T)))
    logits = []
    for i, tok in enumerate(tokens):
        # after two warm-up steps, any compilation would be a per-step recompile
        torch._dynamo.config.error_on_recompile = i >= 2
        logits.append(step(model, torch.tensor([[tok]]), torch.tensor([T + i])).float())
    torch._dynamo.config.error_on_recompile = False
    return torch.cat(logits)  # [len(tokens), vocab]


def test_compiled_decode_step_matches_eager_in_bf16_without_recompiling(checkpoint):
    torch._dynamo.reset()
    model = load_model(checkpoint, "cpu", torch.bfloat16)
    prompt = torch.tensor([PROMPTS[1]])
    tokens = generate(model, prompt.tolist(), 12, temperature=0.0).rows[0]
    step = torch.no_grad()(lambda m, cur, pos: m(cur, m.context(pos))[:, -1])  # the model part of decode_one_token
    eager = decode_logits(step, model, prompt, tokens)
    compiled = decode_logits(torch.compile(step, mode="reduce-overhead", fullgraph=True), model, prompt, tokens)
    # bf16 rounds to 3 significant digits and inductor fuses in a different order: compare relative to the whole
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-2
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def test_compiled_decoding_compiles_once_across_cache_length_buckets():
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=320, n_layer=2, n_head=4, n_kv_head=2, dim=64, block_size=1024)).eval()
    prompt = torch.randint(3, 320, (1, 250)).tolist()
    model.setup_caches(1, 1024)
    eager = generate(model, prompt, 300, temperature=0.0).rows  # reads 256, then 512, then 1024 cache slots
    torch._dynamo.reset()
    counters.clear()
    compiled = Backend(model, compile=True)
    assert generate(model, prompt, 300, backend=compiled, temperature=0.0).rows == eager
    assert counters["stats"]["unique_graphs"] == 1


@cuda
def test_compiled_decoding_on_cuda_replays_cuda_graphs_and_matches_eager(checkpoint):
    from torch._dynamo.utils import counters
    model = load_model(checkpoint, "cuda", torch.float32)
    eager = generate(model, PROMPTS, 40, temperature=0.0).rows
    torch._dynamo.reset()
    counters.clear()
    assert generate(model, PROMPTS, 40, backend=Backend(model, compile=True), temperature=0.0).rows == eager
    assert counters["inductor"]["cudagraph_skips"] == 0  # the whole step is one CUDA graph
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0  # graphs were recorded


@cuda
def test_a_cpu_model_on_a_gpu_machine_compiles_for_the_cpu(model32):
    from torch._dynamo.utils import counters
    eager = generate(model32, PROMPTS, 12, temperature=0.0).rows
    counters.clear()
    assert generate(model32, PROMPTS, 12, backend=Backend(model32, compile=True), temperature=0.0).rows == eager
    assert counters["inductor"]["cudagraph_skips"] == 0  # "reduce-overhead" would have tried, and skipped the CPU


@cuda
def test_seeded_sampling_on_cuda_follows_the_seed(checkpoint):
    from torch._dynamo.utils import counters
    model = load_model(checkpoint, "cuda", torch.float32)
    backend = Backend(model, compile=True)
    counters.clear()

    def run(seed):
        return generate(model, PROMPTS, 30, backend=backend, temperature=1.0, top_k=50, seed=seed).rows
    assert run(1) == run(1)
    assert run(1) != run(2)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_streamed_text_equals_the_final_text_even_for_multibyte_characters(sp_model_path, capsys):
    from cli import make_streamer
    from tokenizer import Tokenizer
    tok = Tokenizer(sp_model_path)
    prompt, continuation = tok.encode("the fox"), tok.encode(" jumps → 世界 over", bos=False)
    assert any(tok.decode([t]) == "" or "\ufffd" in tok.decode([t]) for t in continuation)  # byte-fallback pieces
    stream = make_streamer(tok, prompt)
    for n in range(1, len(continuation) + 1):
        stream(continuation[:n])
    final = tok.decode(prompt + continuation)[len(tok.decode(prompt)):]  # what generate.py prints without streaming
    assert "→ 世界 over" in final
    assert capsys.readouterr().out == final


def python(code: str):
    """code run by a fresh Python in the repository, its stderr shown by pytest where it fails."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], cwd=gen.DEFAULT_CHECKPOINT.parent.parent, capture_output=True,
                       text=True, timeout=600)
    sys.stderr.write(r.stderr)
    return r


def test_importing_generate_changes_no_torch_setting_and_loads_no_kernel_module():
    code = ("import sys, torch; c = torch._dynamo.config; before = (c.specialize_float, "
            "c.use_recursive_dict_tags_for_guards); import generate; "
            "assert (c.specialize_float, c.use_recursive_dict_tags_for_guards) == before, before; "
            "assert not {'cpu_gemv', 'cpu_step', 'cuda_gemv'} & set(sys.modules), sorted(sys.modules)")
    assert python(code).returncode == 0


def test_asking_for_compiled_steps_sets_the_compilers_options_before_the_first_compilation():
    import torch._dynamo.config as config
    Backend(model=None, compile=True)  # torch.compile is lazy: the options are read at the first call, after this
    assert config.specialize_float and config.use_recursive_dict_tags_for_guards


def test_a_compiled_step_takes_python_floats_as_constants():
    """compile_step sets dynamo's options when it is called, and the lazy compilation still reads them: a float
    argument (an eps, a temperature) is a constant in the graph, so a new value compiles the step again."""
    code = ("import torch, backend; from torch._dynamo.utils import counters; "
            "step = backend.compile_step(lambda x, temperature: x * temperature); "
            "[step(torch.ones(4), temperature=t) for t in (0.5, 0.5, 0.7)]; "
            "print(counters['stats']['unique_graphs'])")
    r = python(code)
    assert r.returncode == 0 and r.stdout.split()[-1] == "2"
