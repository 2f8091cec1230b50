"""fast_decode.py, the Python API: LLM loads a checkpoint once, generate and chat take keyword arguments and return
Completions; on the built-in models, float32 where tokens are compared exactly."""
import json
import re
from pathlib import Path

import pytest
import torch

import generate
from conftest import needs_smollm2
from fast_decode import LLM, Completion

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFT = ROOT / "checkpoints" / "stdlib-target", ROOT / "checkpoints" / "stdlib-draft"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm():
    return LLM(TARGET, draft=DRAFT, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def plain(llm):
    return llm.generate(PROMPT, max_new_tokens=24, temperature=0, speculate="plain")


def test_plain_greedy_gives_generate_generates_tokens_and_text(llm, plain):
    ids = llm.tokenizer.encode(PROMPT, bos=True)
    assert plain.tokens == generate.generate(llm.model, [ids], 24, temperature=0.0).rows[0]
    assert plain.text == llm.tokenizer.decode(ids + plain.tokens)[len(llm.tokenizer.decode(ids)):]
    assert plain.finish_reason == "length" and plain.metrics["decode_tokens_per_sec"] > 0


@pytest.mark.parametrize("speculate", ["auto", "draft", "tree", "staged", "lookup", "suffix", "lookahead", None])
def test_every_speculation_gives_the_plain_greedy_tokens(llm, plain, speculate):
    fast = llm.generate(PROMPT, max_new_tokens=24, temperature=0, speculate=speculate)
    assert fast.tokens == plain.tokens
    assert fast.metrics["target_forwards"] <= plain.metrics["target_forwards"]


def test_by_default_speculation_chooses_its_method_and_counts_the_tokens_each_made(llm, plain):
    fast = llm.generate(PROMPT, max_new_tokens=24, temperature=0)
    assert fast.tokens == plain.tokens and sum(fast.metrics["methods"].values()) == 23
    assert plain.metrics["methods"] is None  # plain decoding chose nothing


def test_regex_guided_output_matches_the_pattern(llm):
    out = llm.generate("settings = ", max_new_tokens=40, temperature=0, regex=r'\{"debug": (true|false)\}')
    assert re.fullmatch(r'\{"debug": (true|false)\}', out.text) and out.finish_reason == "stop"


def test_schema_guided_output_is_json_of_the_schema(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = llm.generate("x = ", max_new_tokens=40, temperature=0, json_schema=schema)
    assert list(json.loads(out.text)) == ["n"]


def test_guided_output_cut_by_max_new_tokens_is_incomplete(llm):
    out = llm.generate("x = ", max_new_tokens=3, temperature=0, json_schema={"type": "object", "properties": {
        "a_rather_long_name": {"type": "string"}}, "required": ["a_rather_long_name"]})
    assert out.finish_reason == "incomplete" and out.metrics["incomplete"]


def test_a_list_of_prompts_is_a_batch_with_one_completion_each(llm, plain):
    outs = llm.generate([PROMPT, "import os\n"], max_new_tokens=24, temperature=0)
    assert isinstance(outs, list) and all(isinstance(o, Completion) for o in outs)
    assert outs[0].tokens == plain.tokens and len(outs[1].tokens) == 24


@pytest.mark.parametrize("speculate", ["auto", "draft", "plain"])  # token trees, a draft's chain, plain decoding
def test_stop_strings_cut_the_text_and_end_with_reason_stop(llm, plain, speculate):
    needle = plain.text[5:8]
    out = llm.generate(PROMPT, max_new_tokens=24, temperature=0, stop=[needle], speculate=speculate)
    assert out.text == plain.text[: plain.text.find(needle)] and out.finish_reason == "stop"


def test_the_callback_sees_the_text_grow(llm, plain):
    seen = []
    llm.generate(PROMPT, max_new_tokens=24, temperature=0, callback=seen.append)
    assert seen[-1] == plain.text and all(plain.text.startswith(s) for s in seen)


def test_chat_renders_the_messages_through_the_template(chat_checkpoint):
    chat = LLM(chat_checkpoint, dtype="float32", device="cpu")
    messages = [{"role": "user", "content": "hi"}]
    ids = chat.tokenizer.encode(chat.tokenizer.apply_chat_template(messages), bos=False, specials=True)
    out = chat.chat(messages, max_new_tokens=8, temperature=0)
    assert out.tokens == generate.generate(chat.model, [ids], 8, chat.tokenizer.eos_ids, temperature=0.0).rows[0]
    assert chat.generate("hi", chat=True, max_new_tokens=8, temperature=0).tokens == out.tokens


def test_chat_on_a_model_without_a_template_is_refused(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("options, problem", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(speculate="chain"), "speculate"), (dict(stop="x"), "stop"), (dict(seed=2**70), "seed"),
    (dict(json=True, regex="a+"), "at most one"), (dict(regex="[a-"), "invalid regex"),
    (dict(system="be brief"), "system needs chat")])
def test_a_bad_keyword_is_a_value_error_naming_the_problem(llm, options, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(PROMPT, **options)


def test_an_int8_kv_cache_stays_int8_through_a_batch_and_speculation():
    small = LLM(DRAFT, device="cpu", kv_cache_dtype="int8", max_seq_length=64)
    small.generate([PROMPT, PROMPT], max_new_tokens=8, temperature=0)
    small.generate(PROMPT, max_new_tokens=80, temperature=0, speculate="lookup")  # a longer cache than asked for
    assert small.model.layers[0].attention.kv_cache.k_cache.dtype == torch.int8


def test_speculating_with_a_draft_needs_one():
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(DRAFT, device="cpu").generate(PROMPT, max_new_tokens=4, speculate="draft")


def test_a_bad_load_keyword_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="dtype"):
        LLM(TARGET, dtype="fp8")


def python_example(readme: str) -> str:
    """The first ```python block after a heading that names Python."""
    found = re.search(r"^#+ [^\n]*Python[^\n]*\n.*?```python\n(.*?)```", readme, re.S | re.M)
    assert found, "README.md has no ```python block under a heading that names Python"
    return found.group(1)


@needs_smollm2
def test_the_readme_python_example_runs(smollm2_imports, monkeypatch, capsys):
    code = python_example((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "checkpoints/SmolLM2-135M-Instruct" in code  # the chat model the README names, here the test's import
    monkeypatch.chdir(ROOT)
    exec(compile(code.replace("checkpoints/SmolLM2-135M-Instruct", str(smollm2_imports["int4"])), "README.md",
                 "exec"), {})
    assert capsys.readouterr().out.strip()


def test_many_prompts_each_keep_their_own_schema_and_a_bad_one_fails_alone(llm):
    import jsonschema
    schemas = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False},
               {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}]
    outs = llm.generate_many([{"prompt": "x = ", "json_schema": schemas[0]}, {"prompt": "y = ", "json_schema":
                             schemas[1]}, {"prompt": "z = ", "json_schema": "{not json"}, "w = "],
                             max_new_tokens=40, temperature=0, progress=False)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
    assert outs[2].finish_reason == "error" and "JSON" in outs[2].error and outs[2].tokens == []
    assert outs[3].finish_reason == "length" and len(outs[3].tokens) == 40


def test_many_prompts_with_one_too_long_run_the_rest(llm):
    outs = llm.generate_many(["def f():", "x " * 5000, "import os"], max_new_tokens=8, temperature=0,
                             progress=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"] and "context" in outs[1].error
    assert outs[0].tokens == llm.generate("def f():", max_new_tokens=8, temperature=0).tokens


def test_many_prompts_sharing_a_header_prefill_it_once(llm):
    header = "import os\nimport sys\n\n" * 20
    outs = llm.generate_many([header + f"def f{i}(x):" for i in range(4)], max_new_tokens=4, temperature=0,
                             progress=False)
    assert all(o.metrics["cached_tokens"] >= 0.9 * o.metrics["prompt_tokens"] - 16 for o in outs[1:])
    assert outs[3].tokens == llm.generate(header + "def f3(x):", max_new_tokens=4, temperature=0).tokens


def test_a_bad_sampling_option_in_one_prompt_of_many_fails_that_prompt_alone(llm):
    done = llm.generate_many(["def f(x):", {"prompt": "def g(x):", "top_p": 0}], max_new_tokens=4, progress=False)
    assert done[0].finish_reason == "length" and done[1].finish_reason == "error"
    assert done[1].error == "top_p must be in (0, 1], got 0"


@pytest.mark.parametrize("call", ["generate", "generate_many"])
def test_an_unknown_keyword_is_a_value_error_with_the_closest_known_one(llm, call):
    prompt = PROMPT if call == "generate" else [PROMPT]
    with pytest.raises(ValueError, match=re.escape(f"{call} takes no keyword 'max_tokens'; did you mean "
                                                   "'max_new_tokens'?")):
        getattr(llm, call)(prompt, max_tokens=4)


def test_an_unknown_keyword_in_one_prompt_of_many_fails_that_prompt_alone(llm):
    done = llm.generate_many(["def f(x):", {"prompt": "def g(x):", "temprature": 0}], max_new_tokens=4,
                             progress=False)
    assert done[0].finish_reason == "length" and done[1].finish_reason == "error"
    assert done[1].error == "a prompt of generate_many takes no keyword 'temprature'; did you mean 'temperature'?"


def greedy_by_default(folder: Path) -> Path:
    """The built-in target with a generation_config.json whose temperature is 0."""
    folder.mkdir(exist_ok=True)
    for f in TARGET.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0}))
    return folder


def test_sampling_not_given_is_the_models_generation_config_alone_and_in_a_batch(tmp_path):
    llm = LLM(greedy_by_default(tmp_path / "ckpt"), dtype="float32", device="cpu")
    greedy = llm.generate(PROMPT, max_new_tokens=16, temperature=0, speculate="plain").tokens
    assert llm.generate(PROMPT, max_new_tokens=16, seed=3, speculate="plain").tokens == greedy
    assert llm.generate_many([PROMPT], max_new_tokens=16, seed=3, progress=False)[0].tokens == greedy
    assert llm.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=3, speculate="plain").tokens != greedy


def test_logprobs_and_penalties_run_through_the_engine_one_prompt_as_many(llm, plain):
    scored = llm.generate(PROMPT, max_new_tokens=24, temperature=0, logprobs=2, prompt_logprobs=0)
    assert scored.tokens == plain.tokens and len(scored.logprobs) == 24 and scored.prompt_logprobs[0] is None
    assert all(top[0] == (t, lp) for t, (lp, top) in zip(scored.tokens, scored.logprobs))  # greedy: the likeliest
    ids = llm.tokenizer.encode(PROMPT, bos=True)
    with torch.inference_mode():
        full = llm.model(torch.tensor([ids])).float().log_softmax(-1)[0]
    assert abs(scored.prompt_logprobs[1][0] - full[0, ids[1]].item()) < 1e-4
    penalized = llm.generate(PROMPT, max_new_tokens=24, temperature=0, frequency_penalty=1.5)
    assert penalized.tokens != plain.tokens and penalized.logprobs is None
    many = llm.generate([PROMPT, "import os"], max_new_tokens=24, temperature=0, frequency_penalty=1.5, progress=False)
    assert many[0].tokens == penalized.tokens


def test_options_only_the_engine_applies_refuse_speculation_and_callbacks(llm):
    with pytest.raises(ValueError, match="neither speculates nor calls back"):
        llm.generate(PROMPT, logprobs=1, speculate="draft")
    with pytest.raises(ValueError, match="neither speculates nor calls back"):
        llm.generate(PROMPT, presence_penalty=1.0, callback=print)
