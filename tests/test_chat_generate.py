"""generate.py with real-model tokenizers: chat templates, several end-of-sequence ids, stop strings, and a
prompt whose start is already in the KV cache."""
import random

import pytest
import torch

import generate
from checkpoint import load_model, load_tokenizer, read_config
from cli import cut_text, encode_prompt, stop_strings


def greedy(model, prompt, n=24, **kw):
    return generate.generate(model, [prompt], n, temperature=0.0, **kw).rows[0]


def test_chat_prompt_is_the_rendered_template_with_special_ids(chat_checkpoint):
    tok = load_tokenizer(chat_checkpoint, read_config(chat_checkpoint))
    ids = encode_prompt(tok, "hi", chat=True, system="Be brief.")
    assert tok.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                              "<|im_start|>assistant\n"
    assert ids.count(tok.token_id("<|im_start|>")) == 3


def test_generation_ends_at_any_of_several_eos_ids(chat_checkpoint):
    model = load_model(chat_checkpoint, "cpu", torch.float32)
    prompt = [5, 6, 7, 8]
    row = greedy(model, prompt)
    first = next(i for i, t in enumerate(row) if i >= 3 and t not in row[:i])  # an id not seen before
    assert greedy(model, prompt, eos_ids=[399, row[first]]) == row[:first]
    assert greedy(model, prompt, eos_ids=[399]) == row[: row.index(399)] if 399 in row else row


def test_stop_string_cuts_the_row_and_the_text(chat_checkpoint):
    model = load_model(chat_checkpoint, "cpu", torch.float32)
    tok = load_tokenizer(chat_checkpoint, read_config(chat_checkpoint))
    prompt = tok.encode("the quick brown fox")
    row = greedy(model, prompt, n=40)
    text = tok.decode(row)
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    kept = greedy(model, prompt, n=40, stop=stop_strings(tok, [needle]))
    assert needle in tok.decode(kept) and needle not in tok.decode(kept[:-1])  # through the completing token
    assert cut_text(tok.decode(kept), [needle]) == text[: text.find(needle)]


@pytest.mark.parametrize("fixture", ["checkpoint", "chat_checkpoint"])  # SentencePiece with bytes; byte-level BPE
def test_a_stop_check_of_the_new_token_finds_what_a_check_of_the_whole_text_finds(fixture, request):
    path = request.getfixturevalue(fixture)
    tok, rng = load_tokenizer(path, read_config(path)), random.Random(0)
    for _ in range(12):
        row = [rng.randrange(tok.vocab_size) for _ in range(120)]  # any ids: cut characters, spaces, specials
        text = tok.decode(row)
        strings = [text[i : i + rng.randint(1, 6)] for i in rng.sample(range(len(text) // 2), 2)]
        stop = stop_strings(tok, strings)
        whole = next((i for i in range(1, len(row) + 1) if stop(row[:i]) < i), None)
        assert whole is not None and next(i for i in range(1, len(row) + 1) if stop(row[:i], 1) < i) == whole
        assert stop(row[:whole], 1) == stop(row[:whole]) < whole


def test_prefill_of_only_the_new_tokens_matches_a_full_prefill(chat_checkpoint):
    model = load_model(chat_checkpoint, "cpu", torch.float32)
    model.setup_caches(1, 128)
    first = [5, 6, 7, 8, 9]
    reply = greedy(model, first, n=10)
    turn2 = first + reply + [11, 12, 13]
    cached = len(first) + len(reply) - 1  # the last new token was sampled, never fed back
    reused = generate.generate(model, [turn2], 12, temperature=0.0, cached=cached)
    assert reused.prompt_tokens == len(turn2) - cached
    model.setup_caches(1, 128)  # a fresh cache: everything prefilled
    assert reused.rows[0] == greedy(model, turn2, n=12)
