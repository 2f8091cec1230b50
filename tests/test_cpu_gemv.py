"""cpu_gemv.py: the AVX2 bf16 and int8 decode products give the exact answer rounded to bf16, the int4 one stays
within a percent of it, they decline what they cannot do, and they compile."""
import pytest
import torch
import torch.nn.functional as F

import cpu_gemv
import model as model_py
import quantize
from generate import load_model

pytestmark = pytest.mark.skipif(not cpu_gemv.install(), reason="no AVX2 CPU or no g++ to build the kernel")


@pytest.mark.parametrize("rows,n,k", [(1, 5632, 2048), (3, 7, 32), (8, 1030, 384), (31, 66, 64)])
def test_product_equals_the_fp32_product_rounded_to_bf16(rows, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    exact = (x.double() @ w.double().T).bfloat16().float()
    got = cpu_gemv.linear(x, w).float()
    # one bf16 step (at most 2^-7 relative) when fp32 sums round the other way, plus summation error where terms cancel
    scale = x.double().abs() @ w.double().abs().T
    assert ((got - exact).abs() <= exact.abs() * 2**-7 + scale.float() * 2**-20).all()


@pytest.mark.parametrize("rows,n,k", [(1, 5632, 2048), (3, 7, 40), (8, 1030, 384)])
def test_int8_product_equals_the_scaled_product_rounded_to_bf16(rows, n, k):
    torch.manual_seed(0)
    x, q = torch.randn(rows, k).bfloat16(), torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) / 64).bfloat16()
    w = q.double() * scales.double()[:, None]
    exact = (x.double() @ w.T).bfloat16().float()
    got = cpu_gemv.linear_int8(x, q, scales).float()
    scale = x.double().abs() @ w.abs().T
    assert ((got - exact).abs() <= exact.abs() * 2**-7 + scale.float() * 2**-20).all()


@pytest.mark.parametrize("rows,n,k,groupsize", [(1, 5632, 2048, 128), (3, 7, 256, 64), (8, 1030, 512, 256)])
def test_int4_product_stays_within_a_percent_of_the_dequantized_product(rows, n, k, groupsize):
    # the kernel rounds x to int8 per group (and the result to bf16): about 0.7% here, against ~10% for int4 itself
    torch.manual_seed(0)
    x, q = torch.randn(rows, k).bfloat16(), quantize.quantize_int4(torch.randn(n, k), groupsize)
    exact = x.double() @ quantize.dequantize_int4(*q).double().T
    got = cpu_gemv.linear_int4(x, quantize.pack_nibbles(q[0]), q[1], q[2]).double()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-2


def test_leading_dimensions_and_non_contiguous_inputs_are_kept():
    x, w = torch.randn(2, 3, 64).bfloat16().transpose(0, 1), torch.randn(48, 64).bfloat16()
    assert torch.equal(cpu_gemv.linear(x, w), cpu_gemv.linear(x.contiguous(), w))
    assert cpu_gemv.linear(x, w).shape == (3, 2, 48)


def test_what_the_kernel_cannot_do_is_declined():
    w = torch.randn(48, 64).bfloat16()
    assert cpu_gemv.linear(torch.randn(1, 64), w.float()) is None  # fp32
    assert cpu_gemv.linear(torch.randn(1, 40).bfloat16(), torch.randn(48, 40).bfloat16()) is None  # K % 16
    assert cpu_gemv.linear(torch.randn(32, 64).bfloat16(), w) is None  # prefill-sized: model.Linear uses fp32
    assert cpu_gemv.linear(torch.randn(1, 64).bfloat16(), w.requires_grad_()) is None  # no backward
    q, scales = torch.ones(48, 36, dtype=torch.int8), torch.ones(48).bfloat16()
    assert cpu_gemv.linear_int8(torch.randn(1, 36).bfloat16(), q, scales) is None  # K % 8
    q8 = torch.ones(96, 64, dtype=torch.int8)[::2]
    assert cpu_gemv.linear_int8(torch.randn(1, 64).bfloat16(), q8, scales) is None  # a strided view
    q, scales, zeros = quantize.quantize_int4(torch.randn(48, 64), 32)
    assert cpu_gemv.linear_int4(torch.randn(1, 64).bfloat16(), quantize.pack_nibbles(q), scales, zeros) is None  # G 32


@torch.no_grad()
def test_bf16_model_gives_the_same_tokens_as_with_torchs_kernel(checkpoint, monkeypatch):
    model = load_model(checkpoint, "cpu", torch.bfloat16)
    idx = torch.tensor([[1, 40, 41, 42, 43]])
    model.setup_caches(1, 16)
    ours = torch.cat([model(idx[:, i : i + 1], torch.tensor([i])) for i in range(idx.size(1))], 1).float()
    monkeypatch.setattr(model_py.Linear, "gemv", None)
    torchs = torch.cat([model(idx[:, i : i + 1], torch.tensor([i])) for i in range(idx.size(1))], 1).float()
    assert ((ours - torchs).norm() / torchs.norm()).item() < 1e-2
    assert torch.equal(ours.argmax(-1), torchs.argmax(-1))


@torch.no_grad()
def test_the_op_compiles_into_one_graph():
    linear = model_py.Linear(64, 48, bias=False).bfloat16()
    x = torch.randn(1, 1, 64).bfloat16()
    compiled = torch.compile(lambda x: F.silu(linear(x)), fullgraph=True)  # fullgraph: a graph break would raise
    assert torch.equal(compiled(x), F.silu(cpu_gemv.linear(x, linear.weight)))


def test_without_a_compiler_install_reports_false_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build to fall back on
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_gemv, "_lib", None)
    monkeypatch.setattr(model_py.Linear, "gemv", None)
    monkeypatch.setattr(quantize.Int8Linear, "gemv", None)
    monkeypatch.setattr(quantize.Int4Linear, "gemv", None)
    assert cpu_gemv.install() is False
    assert model_py.Linear.gemv is None and quantize.Int8Linear.gemv is None and quantize.Int4Linear.gemv is None
