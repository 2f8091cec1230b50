"""One execution path: a request gets the same tokens through every entry point, alone or batched, speculated or
not (backend.py chooses how the passes run, sampling.py draws every token)."""
import pytest

from conftest import needs_smollm2
from generate import DEFAULT_CHECKPOINT as BUILTIN

DRAFT = BUILTIN.parent / "stdlib-draft"
PROMPTS = ["def parse(line):", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def llm():
    from fast_decode import LLM
    return LLM(BUILTIN, draft=DRAFT)


def test_a_seeded_request_samples_the_same_through_every_loop_and_the_engine(llm):
    o = dict(temperature=0.9, top_k=50, top_p=0.9, seed=7, max_new_tokens=32)
    plain = llm.generate(PROMPTS[0], speculate="plain", **o).tokens
    for speculate in ("auto", "draft", "tree", "staged", "lookup", "suffix", "lookahead"):
        assert llm.generate(PROMPTS[0], speculate=speculate, **o).tokens == plain, speculate
    many = llm.generate_many(PROMPTS, progress=False, **o)  # in a batch with others
    assert many[0].tokens == plain and len(set(plain)) > 1


def test_top_p_alone_samples_the_same_alone_and_in_a_batch(llm):
    o = dict(temperature=1.0, top_k=None, top_p=0.8, seed=11, max_new_tokens=24)
    alone = [llm.generate(p, speculate="plain", **o).tokens for p in PROMPTS]
    assert [c.tokens for c in llm.generate_many(PROMPTS, progress=False, **o)] == alone


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4"])
def test_greedy_tokens_are_the_same_alone_speculated_and_batched(mode, tmp_path):
    """Prompts shorter and longer than a prefill piece (512 positions; int4's 32 off AMX) and than the engine's chunk
    (512 tokens a step), alone, speculated and as one batch."""
    from fast_decode import LLM
    from quantize_checkpoint import quantize_checkpoint
    path = BUILTIN if mode == "bf16" else quantize_checkpoint(BUILTIN, mode, 32, out_dir=tmp_path)
    llm = LLM(path)
    long = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(40))  # about 750 tokens
    prompts = PROMPTS + [long + "\ndef g(x):"]
    assert len(llm.tokenizer.encode(prompts[-1])) > 512
    alone = [llm.generate(p, temperature=0, max_new_tokens=24, speculate="plain").tokens for p in prompts]
    assert [llm.generate(p, temperature=0, max_new_tokens=24).tokens for p in prompts] == alone  # speculated
    assert [c.tokens for c in llm.generate_many(prompts, temperature=0, max_new_tokens=24, progress=False)] == alone


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_a_lone_greedy_request_is_the_same_through_generate_and_the_engine(cpu_kernels):
    from fast_decode import LLM
    llm = LLM(BUILTIN, cpu_kernels=cpu_kernels)
    for p in PROMPTS:
        alone = llm.generate(p, temperature=0, max_new_tokens=24, speculate="plain").tokens
        assert llm.generate_many([p], temperature=0, max_new_tokens=24, progress=False)[0].tokens == alone


@needs_smollm2
def test_smollm2_int4_answers_a_chat_the_same_through_chat_and_the_engine(smollm2_imports):
    """The quick start's conversion: LLM.chat (what chat.py runs) and the engine (what serve.py and batch.py run)."""
    from fast_decode import LLM
    llm = LLM(smollm2_imports["int4"])
    questions = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]
    alone = [llm.chat([{"role": "user", "content": q}], temperature=0, max_new_tokens=24).text for q in questions]
    many = llm.generate_many(questions, chat=True, temperature=0, max_new_tokens=24, progress=False)
    assert [c.text for c in many] == alone and all(alone)


def test_no_module_of_the_model_is_assigned_to_while_it_runs(monkeypatch):
    """Every pass is described by its model.Context: nothing on the model is swapped per step, in the engine (over
    the paged pool through model.py's forward), in speculation, or in a compiled run."""
    import torch

    from backend import Backend
    from checkpoint import load_model
    from engine import Engine, Request
    from generate import generate
    from sampling import Sampling
    from speculative import speculative_generate
    pooled, target, draft = (load_model(p, "cpu", dt) for p, dt in ((BUILTIN, torch.float32), (BUILTIN, torch.bfloat16),
                                                                       (DRAFT, torch.bfloat16)))
    for m in (pooled, target, draft):
        m.setup_caches(1, 256)
    compiled = Backend(pooled, compile=True)
    watched, assigned = {m for model in (pooled, target, draft) for m in model.modules()}, []
    setattr_ = torch.nn.Module.__setattr__

    def spy(self, name, value):
        if self in watched:
            assigned.append(f"{type(self).__name__}.{name}")
        setattr_(self, name, value)
    monkeypatch.setattr(torch.nn.Module, "__setattr__", spy)
    engine = Engine(pooled, max_rows=4, budget=64)
    engine.run([Request([1, 5, 9, 13] * k, Sampling(12, temperature=0)) for k in range(1, 5)])
    speculative_generate(target, [1, 20, 21, 22, 20, 21], 24, 3, draft=draft, temperature=0)
    generate(pooled, [[1, 20, 21, 22]], 12, backend=compiled, temperature=0)
    assert assigned == []


def test_a_bad_sampling_option_gets_the_same_words_from_the_library_and_the_command_lines(llm):
    from conftest import errors_of
    from engine import Engine, Request
    from launcher import command
    from sampling import Sampling
    with pytest.raises(ValueError) as library:
        llm.generate(PROMPTS[0], temperature=-1.0)
    with pytest.raises(ValueError) as engine:  # the engine's requests hold a Sampling, checked when built
        Engine(llm.model, blocks=8).add(Request([1, 2], Sampling(temperature=-1.0)))
    said = str(library.value)
    assert said == str(engine.value) == "temperature must be a finite number >= 0, got -1.0"
    for script in ("generate.py", "chat.py", "speculative.py"):
        r = command(script, "--checkpoint_path", BUILTIN, "--temperature", "-1", text=True)
        assert r.returncode == 2 and errors_of(r.stderr)[-1].endswith(f"--{said}"), (script, r.stderr)
