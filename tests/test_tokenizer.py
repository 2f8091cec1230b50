import os
import random
import shutil

import pytest

from tokenizer import Tokenizer, load_tokenizer

TEXT = "héllo → 世界\n  def f(x):\n\treturn the 42"
N_RANKS = 296  # 256 bytes + len(conftest.TIKTOKEN_MERGES)


@pytest.fixture(params=["sp", "tiktoken"])
def tok(request, sp_model_path, tiktoken_model_path):
    return Tokenizer(sp_model_path if request.param == "sp" else tiktoken_model_path)


def test_round_trip_including_non_ascii(tok):
    assert tok.decode(tok.encode(TEXT, bos=False)) == TEXT
    assert tok.encode(TEXT)[1:] == tok.encode(TEXT, bos=False)


def test_bos_prepended_only_when_asked(tok):
    with_bos, without = tok.encode("the fox"), tok.encode("the fox", bos=False)
    assert with_bos == [tok.bos_id] + without
    assert tok.bos_id not in without


def test_encode_returns_python_ints_within_vocab(tok):
    ids = tok.encode(TEXT)
    assert all(type(i) is int and 0 <= i < tok.vocab_size for i in ids)


def test_sentencepiece_special_ids(sp_model_path):
    tok = Tokenizer(sp_model_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 320)


def test_tiktoken_special_ids_follow_ranks(tiktoken_model_path):
    tok = Tokenizer(tiktoken_model_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (N_RANKS, N_RANKS + 1, N_RANKS + 256)
    assert tok.decode([N_RANKS + 9]) == "<|eot_id|>"
    assert tok.decode([N_RANKS + 255]) == "<|reserved_special_token_250|>"


def test_tiktoken_uses_merges(tiktoken_model_path):
    tok = Tokenizer(tiktoken_model_path)
    assert tok.encode(" the", bos=False) == [256 + 4]  # rank of b" the"


def test_special_token_text_in_prompt_is_plain_text(tok):
    prompt = "<|begin_of_text|><|eot_id|></s><s>"
    ids = tok.encode(prompt, bos=False)
    is_tiktoken = tok.vocab_size == N_RANKS + 256
    specials = set(range(N_RANKS, tok.vocab_size)) if is_tiktoken else {0, 1, 2}  # sp: unk/bos/eos
    assert not specials & set(ids)
    assert tok.decode(ids) == prompt


def test_decode_special_ids_does_not_crash(tok):
    assert isinstance(tok.decode([tok.bos_id, tok.eos_id] + tok.encode("the", bos=False)), str)


def test_backend_detected_from_content_not_name(tmp_path, sp_model_path, tiktoken_model_path):
    shutil.copy(tiktoken_model_path, tmp_path / "tokenizer.model")
    shutil.copy(sp_model_path, tmp_path / "foo.txt")
    tt, sp = Tokenizer(tmp_path / "tokenizer.model"), load_tokenizer(str(tmp_path / "foo.txt"))
    assert tt.vocab_size == N_RANKS + 256 and tt.bos_id == N_RANKS
    assert sp.vocab_size == 320 and sp.bos_id == 1
    assert tt.encode(TEXT) == Tokenizer(tiktoken_model_path).encode(TEXT)
    assert sp.encode(TEXT) == Tokenizer(sp_model_path).encode(TEXT)


@pytest.mark.parametrize("case", ["missing", "empty", "whitespace", "random_bytes", "text",
                                  "bad_rank_line", "directory"])
def test_bad_file_raises_one_line_value_error_naming_path(tmp_path, tiktoken_model_path, case):
    path = tmp_path / f"{case}.model"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "whitespace":
        path.write_text("\n  \n")
    elif case == "random_bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif case == "text":
        path.write_text("hello world\nthis is not a tokenizer\n")
    elif case == "bad_rank_line":
        path.write_text(tiktoken_model_path.read_text() + "!!notbase64 7\n")
    elif case == "directory":
        os.mkdir(path)
    with pytest.raises(ValueError) as err:
        Tokenizer(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg


@pytest.mark.parametrize("text", ["世界", "é→😀"])
def test_decode_of_truncated_multibyte_prefix_does_not_raise(tok, text):
    ids = tok.encode(text, bos=False)
    assert len(ids) > len(text)  # byte-level pieces, so some prefixes end mid UTF-8 sequence
    prefixes = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    assert all(isinstance(p, str) for p in prefixes)
    assert any("\ufffd" in p for p in prefixes)
    assert prefixes[-1] == text


# ---- tokenizer.json (Hugging Face tokenizers), its companions, and chat templates ---------------------------------

MIXED = ("Grüße, 世界! Привет мир. مرحبا 👋🏽🚀 naïve café\n"
         "def f(x):\n    return {'a': [1, 2.5e-3]}  # ok\n\tprint(f'{x!r}')\r\n<|im_end|> end")


def test_tokenizer_json_ids_match_transformers_on_multilingual_code_and_emoji(hf_tokenizer_dir):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    ours = Tokenizer(hf_tokenizer_dir / "tokenizer.json")
    text = MIXED.replace("<|im_end|>", "")  # transformers turns typed special names into ids; see the next test
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"]) == text


def test_special_names_typed_in_a_prompt_stay_text_but_become_ids_in_a_chat(hf_tokenizer_dir):
    tok = Tokenizer(hf_tokenizer_dir / "tokenizer.json")
    end = tok.token_id("<|im_end|>")
    assert end not in tok.encode("say <|im_end|> now")
    assert end in tok.encode("say <|im_end|> now", specials=True)


def test_every_eos_id_is_read_from_tokenizer_and_generation_config(hf_tokenizer_dir):
    tok = Tokenizer(hf_tokenizer_dir / "tokenizer.json")
    assert tok.eos_ids == [tok.token_id("<|im_end|>"), 0]  # eos_token first, then generation_config's others
    assert tok.bos_id is None  # this model has no BOS: its post-processor adds none, so neither do we


def test_backend_is_chosen_by_content_not_name(hf_tokenizer_dir, tmp_path):
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.model")
    assert Tokenizer(tmp_path / "tokenizer.model").encode("the fox") == \
        Tokenizer(hf_tokenizer_dir / "tokenizer.json").encode("the fox")


TEMPLATES = {
    "chatml": None,  # the fixture's own
    "loopcontrols_tojson_and_trim": (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
        "  [{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n"
        "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}{{ bos_token or '' }}{{ eos_token }}"),
    "strftime_now": "Today is {{ strftime_now('%d %B %Y') }}.{% for m in messages %} {{ m.content }}{% endfor %}",
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va? 👋"},
            {"role": "tool", "content": "hidden"}, {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "Et \"toi\"?"}]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(hf_tokenizer_dir, name, add_generation_prompt):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    tok = Tokenizer(hf_tokenizer_dir / "tokenizer.json")
    if TEMPLATES[name]:
        ref.chat_template = tok.chat_template = TEMPLATES[name]
    for messages in (MESSAGES, MESSAGES[1:2]):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt) == want


def test_chat_template_raise_exception_is_one_error_line(hf_tokenizer_dir):
    tok = Tokenizer(hf_tokenizer_dir / "tokenizer.json")
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}"
    with pytest.raises(ValueError, match="chat template failed: roles must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_chat_template_runs_sandboxed(hf_tokenizer_dir):
    tok = Tokenizer(hf_tokenizer_dir / "tokenizer.json")
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="chat template failed"):
        tok.apply_chat_template(MESSAGES)


def test_chat_template_from_chat_template_jinja_wins(hf_tokenizer_dir, tmp_path):
    for f in hf_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    assert tok.apply_chat_template(MESSAGES[1:2]) == "<user>Ça va? 👋"


def test_chat_without_template_is_refused(sp_model_path):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(sp_model_path).apply_chat_template(MESSAGES)


def test_a_tokenizer_json_that_adds_bos_matches_transformers(hf_tokenizer_dir, tmp_path):
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer
    hf = HFTokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    hf.save(str(tmp_path / "tokenizer.json"))  # as Llama-3's tokenizer.json adds <|begin_of_text|>
    config = json.loads((hf_tokenizer_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    ours, ref = Tokenizer(tmp_path / "tokenizer.json"), AutoTokenizer.from_pretrained(tmp_path)
    text = MIXED.replace("<|im_end|>", "")
    assert ours.encode(text) == ref(text)["input_ids"] and ours.encode(text)[0] == ours.bos_id == 0
    assert ours.encode(text, bos=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_config_nested_too_deeply_is_refused_not_a_recursion_error(hf_tokenizer_dir, tmp_path):
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[" * 100000)
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON: it is nested too deeply"):
        Tokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("kind", ["tokenizer.json", "tiktoken"])
def test_the_text_of_new_tokens_leaves_special_tokens_out_and_the_ids_keep_them(kind, hf_tokenizer_dir,
                                                                                 tiktoken_model_path):
    import cli
    tok = Tokenizer(hf_tokenizer_dir / "tokenizer.json" if kind == "tokenizer.json" else tiktoken_model_path)
    names = ["<|im_end|>", "<|im_start|>"] if kind == "tokenizer.json" else ["<|eot_id|>", "<|start_header_id|>"]
    prompt = tok.encode("the fox", bos=False)
    row = tok.encode(f"jumps{names[0]}\n{names[1]}over", bos=False, specials=True)
    assert {tok.token_id(n) for n in names} <= set(row)  # the ids are there
    assert cli.new_text(tok, prompt, row) == "jumps\nover"
    assert names[0] in tok.decode(row)  # decode shows them unless asked not to


def test_sampling_defaults_are_what_generation_config_names_and_the_sampler_takes_the_valid_ones(tmp_path):
    import json

    from sampling import with_defaults
    from tokenizer import sampling_defaults
    assert sampling_defaults(tmp_path) == {}  # no file: none
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.2, "top_p": 1.5, "top_k": 0, "do_sample": True, "eos_token_id": 2}))
    model = sampling_defaults(tmp_path)
    assert model == {"temperature": 0.2, "top_p": 1.5, "top_k": 0}
    assert with_defaults({}, model) == {"temperature": 0.2, "top_k": 0, "top_p": 1.0}  # 1.5 is no probability
    assert with_defaults({"temperature": 0.7, "top_k": None}, model) == {"temperature": 0.7, "top_k": 0, "top_p": 1.0}
