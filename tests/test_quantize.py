"""quantize.py and scripts/quantize_checkpoint.py: the int8/int4 numbers, the kernels, GPTQ, and quantized
checkpoints from the command line to load_model."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoint import load_model
from quantize import (GROUPSIZES, Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, gptq_int4,
                      pack_nibbles, quantize_int4, quantize_int8, unpack_nibbles)
from quantize_checkpoint import quantize_checkpoint
from conftest import errors_of
from launcher import command

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(script, *args):
    return command(script, *args, timeout=600, text=True)


@torch.no_grad()
def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- the numbers -------------------------------------------------------------------------------------------------

def test_int8_error_is_at_most_half_a_step_per_row():
    w = torch.randn(48, 80) * torch.rand(48, 1) * 3  # rows with very different ranges
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales.float()[:, None] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("groupsize", GROUPSIZES)
def test_int4_error_is_at_most_half_a_step_per_group(groupsize):
    w = torch.randn(16, 512) + torch.linspace(-2, 2, 512)  # groups off-centre: the zero point matters
    q, scales, zeros = quantize_int4(w, groupsize)
    assert q.max() <= 15 and scales.shape == zeros.shape == (16, 512 // groupsize)
    err = (dequantize_int4(q, scales, zeros) - w).abs()
    step = scales.float().repeat_interleave(groupsize, 1)
    assert (err <= step * 0.5 + 1e-3 * w.abs().amax()).all()  # the bf16-rounded zero point can add a little


def test_int4_pads_a_partial_group_with_zero_columns():
    w = torch.randn(16, 40)
    q, scales, zeros = quantize_int4(w, 32)
    assert q.shape == (16, 64) and scales.shape == (16, 2)
    assert rel_err(dequantize_int4(q, scales, zeros)[:, :40], w) < 0.1


def test_nibble_packing_round_trips():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    assert pack_nibbles(q).shape == (8, 32) and torch.equal(unpack_nibbles(pack_nibbles(q)), q)


# ---- the layers: torch's kernels against the dequantized weights -------------------------------------------------

def int8_layer(w):
    layer = Int8Linear(w.size(1), w.size(0))
    layer.weight, layer.scales = quantize_int8(w)
    return layer, dequantize_int8(layer.weight, layer.scales)


def int4_layer(w, groupsize):
    layer = Int4Linear(w.size(1), w.size(0), groupsize)
    q, layer.scales, layer.zeros = quantize_int4(w, groupsize)
    layer.weight = pack_nibbles(q)
    return layer, dequantize_int4(q, layer.scales, layer.zeros)[:, : w.size(1)]


def test_int8_kernel_matches_the_dequantized_matmul():
    w, x = torch.randn(96, 64), torch.randn(3, 5, 64)
    layer, w_deq = int8_layer(w)
    y = layer(x.bfloat16())  # CPU: torch's _weight_int8pack_mm
    assert y.shape == (3, 5, 96) and y.dtype == torch.bfloat16
    assert rel_err(y, x @ w_deq.T) < 1e-2
    assert rel_err(layer(x), x @ w_deq.T) < 1e-5  # float32: the exact dequantizing path


@pytest.mark.parametrize("shape", [(64, 128), (24, 40), (160, 96)])  # (N, K): 24 and 40 need padding
@pytest.mark.parametrize("groupsize", GROUPSIZES)
def test_int4_kernel_matches_the_dequantized_matmul_for_any_shape(shape, groupsize):
    w, x = torch.randn(*shape), torch.randn(2, 3, shape[1])
    layer, w_deq = int4_layer(w, groupsize)
    assert rel_err(layer(x), x @ w_deq.T) < 1e-5  # unpacked, float32: dequantize per call
    layer.pack()
    y = layer(x.bfloat16())  # packed: torch's _weight_int4pack_mm_for_cpu
    assert y.shape == (2, 3, shape[0])
    assert rel_err(y, x @ w_deq.T) < 1e-2


@cuda
@pytest.mark.parametrize("groupsize", GROUPSIZES)
def test_int4_cuda_kernel_matches_the_dequantized_matmul(groupsize):
    w, x = torch.randn(24, 200), torch.randn(3, 200)
    layer, w_deq = int4_layer(w, groupsize)
    layer = layer.cuda()
    layer.pack()
    assert rel_err(layer(x.cuda().bfloat16()).cpu(), x @ w_deq.T) < 1e-2


# ---- GPTQ ----------------------------------------------------------------------------------------------------------

def test_gptq_beats_round_to_nearest_on_the_calibration_reconstruction_loss():
    torch.manual_seed(0)
    mix = torch.randn(64, 64) / 8 + torch.eye(64)  # correlated input features, as real activations are
    x = torch.randn(2048, 64) @ mix
    w = torch.randn(32, 64)
    loss = lambda w_q: ((x @ w.T - x @ w_q.T) ** 2).mean().item()
    rtn = loss(dequantize_int4(*quantize_int4(w, 32)))
    gptq = loss(dequantize_int4(*gptq_int4(w, x.T @ x, 32)))
    assert gptq < 0.8 * rtn


def test_gptq_keeps_the_int4_grid():
    w, x = torch.randn(16, 128), torch.randn(256, 128)
    q, scales, zeros = gptq_int4(w, x.T @ x, 64)
    assert q.dtype == torch.uint8 and q.max() <= 15 and scales.shape == zeros.shape == (16, 2)


# ---- checkpoints ---------------------------------------------------------------------------------------------------

# relative error of the logits against float32, measured 0.019 / 0.24 / 0.30 on this random model (bf16 weights
# alone: 0.010). Random weights are the worst case for int4: a trained model's error is far smaller (README).
BOUNDS = {"int8": 0.03, "int4": 0.35, "int4-gptq": 0.45}


@pytest.fixture(scope="module")
def quantized(checkpoint, sp_model_path, tmp_path_factory):
    """The tiny test checkpoint in every mode (GPTQ calibrated on a text file)."""
    root = tmp_path_factory.mktemp("quantized")
    calib = root / "calib.txt"
    calib.write_text("\n".join(["def f(x):\n    return x + 1", "the quick brown fox jumps over the lazy dog"] * 200))
    return {mode: quantize_checkpoint(checkpoint, mode, 32, root / mode, [calib.read_text()], samples=8, seq_len=64)
            for mode in BOUNDS}


@pytest.mark.parametrize("mode", BOUNDS)
def test_quantized_logits_stay_close_to_the_float_model(checkpoint, quantized, mode):
    idx = torch.randint(0, 320, (2, 24))
    ref = load_model(checkpoint, "cpu", torch.float32)(idx)
    assert rel_err(load_model(quantized[mode], "cpu", torch.bfloat16)(idx), ref) < BOUNDS[mode]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_path_agrees_with_the_dequantizing_path(quantized, mode):
    idx = torch.randint(0, 320, (2, 24))
    exact = load_model(quantized[mode], "cpu", torch.float32)(idx)
    assert rel_err(load_model(quantized[mode], "cpu", torch.bfloat16)(idx), exact) < 2e-2


def test_checkpoint_records_mode_in_metadata_and_stores_plain_values(quantized):
    with safe_open(quantized["int4"] / "model.safetensors", "pt") as f:
        assert f.metadata()["quantization"] == "int4" and f.metadata()["groupsize"] == "32"
        w = f.get_tensor("layers.0.attention.wqkv.weight")
        assert w.dtype == torch.uint8 and w.shape == (128, 32)  # [N, K/2]: two int4 values a byte
    with safe_open(quantized["int8"] / "model.safetensors", "pt") as f:
        assert f.metadata()["quantization"] == "int8" and "groupsize" not in f.metadata()
        assert f.get_tensor("output.weight").dtype == torch.int8  # the head is quantized too


def test_round_trip_reproduces_the_quantized_weights(checkpoint, quantized):
    """Reload the float model, quantize in memory, and compare with what load_model read from disk."""
    model = load_model(quantized["int8"], "cpu", torch.float32)
    q, scales = quantize_int8(load_model(checkpoint, "cpu", torch.float32).layers[1].feed_forward.w2.weight)
    assert torch.equal(model.layers[1].feed_forward.w2.weight, q)
    assert torch.equal(model.layers[1].feed_forward.w2.scales, scales.float())


@cuda
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_checkpoint_quantized_on_cpu_runs_on_cuda(quantized, mode):
    idx = torch.randint(0, 320, (2, 24))
    on_cpu = load_model(quantized[mode], "cpu", torch.bfloat16)(idx)
    on_gpu = load_model(quantized[mode], "cuda", torch.bfloat16)(idx.cuda()).cpu()
    assert rel_err(on_gpu, on_cpu) < 2e-2


@cuda
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_decode_step_on_cuda_compiled_matches_eager(quantized, mode):
    """Teacher-forced: both see the same tokens, so one flipped near tie (bf16 fused in another order) cannot make
    the rest of the comparison diverge."""
    from backend import Backend, last_logits
    from generate import generate
    model = load_model(quantized[mode], "cuda", torch.bfloat16)
    prompt = [1, 99, 7, 8, 9, 10, 11, 12, 13]
    tokens = generate(model, [prompt], 16, temperature=0.0).rows[0]

    @torch.inference_mode()
    def logits(step):  # -> [16, vocab]; float() copies each step's output out of the CUDA graph's buffer
        model.setup_caches(1, 64)
        model(torch.tensor([prompt], device="cuda"), model.context(torch.arange(len(prompt), device="cuda")))
        return torch.cat([step(model, torch.tensor([[t]], device="cuda"), torch.tensor([len(prompt) + i],
                                                                                      device="cuda"), None, 64).float()
                          for i, t in enumerate(tokens)])
    eager, compiled = logits(last_logits), logits(Backend(model, compile=True).step_last)
    # eager rounds int8's product to bf16 before the scale, compiled sums in float32 (an H200: 1.08e-2 apart)
    assert rel_err(compiled, eager) < 2e-2
    assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9


@cuda
def test_checkpoint_quantized_on_cuda_runs_on_cpu(checkpoint, tmp_path):
    out = quantize_checkpoint(checkpoint, "int4-gptq", 64, tmp_path / "q", ["def f(x): return x\n" * 400],
                              samples=4, seq_len=64, device=torch.device("cuda"))
    idx = torch.randint(0, 320, (1, 16))
    on_gpu = load_model(out, "cuda", torch.bfloat16)(idx.cuda()).cpu()
    assert rel_err(load_model(out, "cpu", torch.bfloat16)(idx), on_gpu) < 2e-2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_generate_cli_runs_a_quantized_checkpoint_compiled(quantized, mode, checkpoint, tmp_path):
    def tokens(*extra):
        out = tmp_path / "metrics.json"
        result = run("generate.py", "--checkpoint_path", quantized[mode], "--max_new_tokens", 6, "--temperature",
                     0, "--ignore_eos", "--device", "cpu", "--metrics_json", out, *extra)
        assert result.returncode == 0, result.stderr
        return json.loads(out.read_text())["samples"][0]["tokens"]
    compiled, eager = tokens("--compile"), tokens()
    assert compiled[0] == eager[0]  # prefill runs uncompiled in both
    # the compiled step fuses the norms and skips bf16 roundings that eager makes, and the quantized products round
    # activations to int8 per block, so a near tie (0.14% apart on this random model in int4 with groups of 32) can
    # go either way: each compiled token must be eager's choice or within 1% of it, on eager's own logits
    from tokenizer import load_tokenizer
    prompt = load_tokenizer(checkpoint / "tokenizer.model").encode("def fibonacci(n):", bos=True)
    model = load_model(quantized[mode], "cpu", torch.bfloat16)
    model.setup_caches(1, 64)
    seq = torch.tensor([prompt + compiled])
    with torch.no_grad():
        logits = torch.cat([model(seq[:, : len(prompt)], model.context(torch.arange(len(prompt))))[:, -1:]] +
                           [model(seq[:, i : i + 1], model.context(torch.tensor([i]))) for i in range(len(prompt), seq.size(1) - 1)],
                           1)[0].float()  # the logits each new token was chosen from, step by step as generate does
    chosen = logits.gather(-1, torch.tensor(compiled)[:, None])[:, 0]
    assert ((logits.max(-1).values - chosen) <= 0.01 * logits.abs().max(-1).values).all()


def test_quantize_cli_writes_a_checkpoint_generate_can_run(checkpoint, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("for i in range(10):\n    print(i)\n" * 200)
    result = run("scripts/quantize_checkpoint.py", "--checkpoint_path", checkpoint, "--mode", "int4-gptq", "--groupsize", 64,
                 "--calibration_file", calib, "--calibration_samples", 4, "--calibration_seq_len", 64,
                 "--out_dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "GPTQ" in result.stderr  # progress
    gen = run("generate.py", "--checkpoint_path", tmp_path / "out", "--max_new_tokens", 4, "--device", "cpu")
    assert gen.returncode == 0, gen.stderr


# ---- bad input -----------------------------------------------------------------------------------------------------

def error_of(result):
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = errors_of(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_unsupported_group_size_is_rejected(checkpoint, tmp_path):
    assert "--groupsize: invalid choice: 48" in error_of(run("scripts/quantize_checkpoint.py", "--checkpoint_path",
                                                             checkpoint, "--mode", "int4", "--groupsize", 48,
                                                             "--out_dir", tmp_path / "q"))


def test_quantizing_a_quantized_checkpoint_is_rejected(quantized, tmp_path):
    assert "already quantized" in error_of(run("scripts/quantize_checkpoint.py", "--checkpoint_path", quantized["int8"],
                                               "--mode", "int4", "--out_dir", tmp_path / "q"))


def test_missing_calibration_file_is_rejected(checkpoint, tmp_path):
    assert "not found" in error_of(run("scripts/quantize_checkpoint.py", "--checkpoint_path", checkpoint, "--mode", "int4-gptq",
                                       "--calibration_file", tmp_path / "nope.txt", "--out_dir", tmp_path / "q"))


def test_quantize_never_overwrites_its_input_or_an_existing_output(checkpoint, quantized, tmp_path):
    before = (checkpoint / "model.safetensors").read_bytes()
    assert "is the input" in error_of(run("scripts/quantize_checkpoint.py", "--checkpoint_path", checkpoint, "--mode", "int8",
                                          "--out_dir", checkpoint))
    assert (checkpoint / "model.safetensors").read_bytes() == before
    assert "not empty" in error_of(run("scripts/quantize_checkpoint.py", "--checkpoint_path", checkpoint, "--mode", "int8",
                                       "--out_dir", quantized["int4"]))


def rewrite_metadata(src, dst, **metadata):
    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, dst / "model.safetensors", metadata={**f.metadata(), **metadata})
    return dst


@pytest.mark.parametrize("metadata, message", [
    (dict(groupsize="64"), "disagree"),  # tensors quantized with group size 32
    (dict(quantization="int8"), "disagree"),  # int4 tensors
    (dict(groupsize="48"), "unknown quantization metadata"),
    (dict(quantization="int3"), "unknown quantization metadata"),
])
def test_metadata_that_does_not_match_the_tensors_is_rejected(quantized, tmp_path, metadata, message):
    bad = rewrite_metadata(quantized["int4"], tmp_path / "bad", **metadata)
    assert message in error_of(run("generate.py", "--checkpoint_path", bad, "--max_new_tokens", 2))
