"""Session-scoped tiny tokenizer files, shared by tests that need a real tokenizer."""
import base64
import io
import random

import pytest
import sentencepiece as spm

WORDS = ("the quick brown fox jumps over lazy dog model token layer attention cache "
         "def return import class self for in range if else print value list dict").split()
CODE = ["def f(x):\n    return x + 1", "for i in range(10):\n    print(i)", "import torch as t"]

# Multi-byte tokens for the tiktoken fixture; each is reachable by merging earlier ones.
TIKTOKEN_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b" a", b"an", b"and",
                   b" and", b"er", b"re", b"on", b" o", b"of", b" of", b"en", b"at", b" in",
                   b"ou", b"is", b" is", b"it", b"es", b"ed", b" w", b" s", b" c", b"or",
                   b"  ", b"    ", b"de", b"def", b" f", b"()", b"):", b"\n ", b"\n    ", b"ret"]


def _corpus():
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    return lines + CODE * 20


@pytest.fixture(scope="session")
def sp_model_path(tmp_path_factory):
    """Tiny Llama-style SentencePiece BPE model (unk=0, bos=1, eos=2, byte fallback)."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, model_type="bpe", vocab_size=320,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="session")
def tiktoken_model_path(tmp_path_factory):
    """Tiny Llama-3-style rank file: all 256 bytes, then TIKTOKEN_MERGES (296 ranks)."""
    tokens = [bytes([b]) for b in range(256)] + TIKTOKEN_MERGES
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


# ---- tiny random Llama checkpoints -------------------------------------------------------------------------------

TINY_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.1)  # larger than the default so logits are far from ties


def save_hf_llama(path, tokenizer_path, seed=0, **overrides):
    """A randomly initialised transformers LlamaForCausalLM, saved with save_pretrained (float32)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()
    model.save_pretrained(path)
    shutil.copy(tokenizer_path, path / "tokenizer.model")
    return model


def convert(hf_dir, out_dir):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from convert_hf_checkpoint import convert_hf_checkpoint
    convert_hf_checkpoint(hf_dir, out_dir)
    return out_dir


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, sp_model_path):
    """A converted native checkpoint of a tiny GQA Llama with the SentencePiece fixture tokenizer."""
    hf_dir = tmp_path_factory.mktemp("hf")
    save_hf_llama(hf_dir, sp_model_path)
    return convert(hf_dir, tmp_path_factory.mktemp("native") / "ckpt")


def errors_of(stderr: str) -> list[str]:
    """stderr's lines less warnings (a busy machine adds one about threads): what bad input must reduce to one."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]


# ---- a tokenizer.json model folder, as Hugging Face repos ship them -----------------------------------------------

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json (GPT-2 style, like SmolLM2's and Qwen's) with ChatML specials, its
    tokenizer_config.json (chat template, BOS/EOS names) and a generation_config.json listing two EOS ids."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=HF_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    d = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(d / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory, hf_tokenizer_dir):
    """A converted tiny random Llama whose tokenizer is the tokenizer.json fixture, with its chat template."""
    import shutil
    hf_dir = tmp_path_factory.mktemp("hf_chat")
    save_hf_llama(hf_dir, hf_tokenizer_dir / "tokenizer.json", vocab_size=400, bos_token_id=None, eos_token_id=2)
    (hf_dir / "tokenizer.model").unlink()
    for f in hf_tokenizer_dir.iterdir():
        shutil.copy(f, hf_dir / f.name)
    return convert(hf_dir, tmp_path_factory.mktemp("native_chat") / "ckpt")
