"""cuda_gemv.py's Triton kernels for decoding: on a CPU through Triton's interpreter (each kernel's arithmetic,
block by block, for a few block shapes), and on an NVIDIA GPU for real (autotuned, in the model)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import cuda_gemv  # noqa: E402
import quantize  # noqa: E402

# With a GPU the kernels run for real (below); Triton 3.6's interpreter fails there on any loop to a run-time bound
# under NumPy 2.5 (a one-element array where it wants a scalar)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                                  reason="Triton is not installed, or a GPU runs the kernels for real")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or cuda_gemv.triton is None,
                                reason="needs an NVIDIA GPU and Triton")

# Runs in a child process: TRITON_INTERPRET is read when a kernel is defined, and this process may have imported
# cuda_gemv already. Prints the largest error of each case relative to the largest output.
INTERPRETED = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import cuda_gemv as cg, quantize
torch.manual_seed(0)
errors = []
for kind, M, N, K, BN, BK in json.loads(sys.argv[2]):
    w, x = torch.randn(N, K), torch.randn(M, K).bfloat16()
    y, grid = torch.empty(M, N, dtype=torch.bfloat16), (M * -(-N // BN),)
    if kind == "bf16":
        w = w.bfloat16()
        cg.gemv_bf16_kernel[grid](x, w, y, M, N, K, BLOCK_N=BN, BLOCK_K=BK)
    else:
        q, s = quantize.quantize_int8(w)
        cg.gemv_int8_kernel[grid](x, q.view(torch.int32), s, y, M, N, K, BLOCK_N=BN, BLOCK_K=BK)
        w = quantize.dequantize_int8(q, s)
    ref = x.float() @ w.float().T
    errors.append(((y.float() - ref).abs().max() / ref.abs().max()).item())
print(json.dumps(errors))
"""


def interpreted(cases: list, script: str = INTERPRETED) -> list[float]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", script, str(ROOT), json.dumps(cases)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


PAGED = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import cpu_gemv, cuda_gemv
torch.manual_seed(0)
errors = []
for B, H, Hkv, S, D, size, n in json.loads(sys.argv[2]):
    q = torch.randn(B, S, H, D).bfloat16().transpose(1, 2)  # [B, H, S, D] as model.py passes it: a view
    k, v = (torch.randn(n, Hkv, size, D).bfloat16() for _ in range(2))
    table = torch.stack([torch.randperm(n)[:4] for _ in range(B)])  # [B, 4]: each row's blocks, out of order
    pos = torch.tensor([[min(4 * size - 1, 5 + 17 * b + s) for s in range(S)] for b in range(B)])  # [B, S]
    ref = cpu_gemv.attend_paged_reference(q.float(), k, v, table, pos)
    out = cuda_gemv.attend_paged(q, k, v, table, pos).float()
    errors.append(((out - ref).abs().max() / ref.abs().max()).item())
print(json.dumps(errors))
"""


@needs_triton
def test_paged_attention_kernel_matches_the_gathered_reference():
    # decode rows with 3 query heads a KV head; a chunk of 3 positions, no grouping; 2 heads a KV head, D 32
    cases = [(3, 6, 2, 1, 64, 16, 9), (2, 4, 4, 3, 32, 16, 6), (2, 9, 3, 1, 64, 16, 5)]
    errors = interpreted(cases, PAGED)
    assert len(errors) == 3 and max(errors) < 1e-2  # bf16 output
    assert not cuda_gemv.pages_ok(48, 16) and not cuda_gemv.pages_ok(64, 12) and cuda_gemv.pages_ok(64, 16) == (
        cuda_gemv.triton is not None)


# rows not a multiple of the block, several rows of x, K a multiple of 4 but not of the block
SHAPES = [(1, 40, 320, 8, 256), (3, 17, 1028, 4, 512), (2, 64, 256, 16, 1024)]


@needs_triton
def test_int8_kernel_matches_the_dequantized_product():
    errors = interpreted([("int8", *s) for s in SHAPES])
    assert len(errors) == 3 and max(errors) < 1e-2  # bf16 output: its rounding is ~0.4% of the largest value


@needs_triton
def test_bf16_kernel_matches_the_product():
    errors = interpreted([("bf16", *s) for s in SHAPES])
    assert len(errors) == 3 and max(errors) < 1e-2


def test_install_leaves_cpu_layers_alone():
    layer = torch.nn.Linear(64, 32, bias=False)
    model = torch.nn.Sequential(layer, quantize.Int8Linear(64, 32))
    assert cuda_gemv.install(model) == 0 and model[0] is layer


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, cuda_gemv.MAX_ROWS + 1])  # decode, a verify pass, prefill (cuBLAS)
def test_cuda_layers_match_the_reference_product(rows):
    torch.manual_seed(0)
    w = torch.randn(300, 1000, device="cuda")
    x = torch.randn(rows, 1000, device="cuda", dtype=torch.bfloat16)
    q8, s8 = quantize.quantize_int8(w)
    for layer, ref in ((cuda_gemv.GemvInt8(q8, s8), quantize.dequantize_int8(q8, s8)),
                       (cuda_gemv.GemvBf16(w.bfloat16()), w.bfloat16())):
        with torch.inference_mode():
            y = layer(x).float()
        ref = x.float() @ ref.float().T
        assert y.shape == (rows, 300) and (y - ref).abs().max() < 1e-2 * ref.abs().max()


@needs_cuda
def test_model_on_cuda_runs_the_kernels_bf16_and_int8_but_int4_on_torchs(tmp_path):
    from checkpoint import load_model
    from generate import DEFAULT_CHECKPOINT
    sys.path.insert(0, str(ROOT / "scripts"))
    from quantize_checkpoint import quantize_checkpoint
    model = load_model(DEFAULT_CHECKPOINT, "cuda", torch.bfloat16)
    assert isinstance(model.layers[0].attention.wqkv, cuda_gemv.GemvBf16)
    assert isinstance(model.layers[0].feed_forward.w13, cuda_gemv.GemvBf16)
    assert cuda_gemv.describe(model) == "CUDA kernels: Triton for bf16"
    model = load_model(quantize_checkpoint(DEFAULT_CHECKPOINT, "int8", out_dir=tmp_path / "int8"), "cuda")
    assert isinstance(model.output, cuda_gemv.GemvInt8) and isinstance(model.layers[0].feed_forward.w13,
                                                                       cuda_gemv.GemvInt8)
    model = load_model(quantize_checkpoint(DEFAULT_CHECKPOINT, "int4", 64, out_dir=tmp_path / "int4"), "cuda")
    assert isinstance(model.output, quantize.Int4Linear) and model.output.scales_and_zeros is not None


@needs_cuda
def test_compiled_bf16_decoding_keeps_the_kernels_in_the_cuda_graph_and_matches_eager():
    from torch._dynamo.utils import counters
    from checkpoint import load_model
    from backend import Backend
    from generate import DEFAULT_CHECKPOINT, generate
    from tokenizer import Tokenizer
    model = load_model(DEFAULT_CHECKPOINT, "cuda", torch.bfloat16)
    prompt = [Tokenizer(DEFAULT_CHECKPOINT / "tokenizer.model").encode("def fibonacci(n):", bos=True)]
    eager = generate(model, prompt, 32, temperature=0.0).rows
    counters.clear()
    assert generate(model, prompt, 32, backend=Backend(model, compile=True), temperature=0.0).rows == eager
    assert counters["inductor"]["cudagraph_skips"] == 0  # the custom ops do not split the step's CUDA graph
