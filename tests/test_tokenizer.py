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
