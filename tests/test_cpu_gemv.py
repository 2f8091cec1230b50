"""cpu_gemv.py: for every kernel set this CPU runs, the bf16 decode product gives the exact answer rounded to
bf16, the int8 and int4 ones stay within a percent of it, and attention for a few query rows equals torch's; the layers it installs decline what they cannot do,
compile into one graph, and give a model the tokens torch's kernels give; without a compiler torch's stay."""
import json
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_gemv
import quantize
from checkpoint import load_model
from model import KVCache, dequantize_rows, quantize_rows

TARGETS = [name for name, _, _ in cpu_gemv.targets(cpu_gemv.cpu_flags())]
pytestmark = pytest.mark.skipif(not TARGETS or cpu_gemv.load() is None, reason="no kernels for this CPU or no g++")


@pytest.fixture(autouse=True)
def two_threads():
    """The kernels split rows and positions among threads and merge what each found: tested with two threads at
    least, as decode runs them, even where the tests run one thread each (pytest -n 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=TARGETS)
def kernels(request):
    assert cpu_gemv.load(request.param) == request.param
    yield request.param
    cpu_gemv.load()


def within_a_bf16_step(got, exact, x, w):
    # one bf16 step (at most 2^-7 relative) when fp32 sums round the other way, plus summation error where terms cancel
    scale = x.double().abs() @ w.double().abs().T
    return ((got.float() - exact).abs() <= exact.abs() * 2**-7 + scale.float() * 2**-20).all()


@pytest.mark.parametrize("rows,n,k", [(1, 5632, 2048), (3, 7, 32), (8, 1030, 384), (31, 66, 64), (2, 9, 48)])
def test_bf16_product_equals_the_fp32_product_rounded_to_bf16(kernels, rows, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    exact = (x.double() @ w.double().T).bfloat16().float()
    assert within_a_bf16_step(torch.ops.fast_decode.gemv_bf16(x, w), exact, x, w)


@pytest.mark.parametrize("rows,n,k", [(1, 5632, 2048), (1, 64, 96), (1, 5, 32), (1, 203, 2080), (3, 7, 64), (8, 1030, 384)])
def test_int8_product_stays_within_a_percent_of_the_scaled_product(kernels, rows, n, k):
    # the kernel rounds x to int8 per block of 32 (as llama.cpp's Q8_0 does): about 0.5% here
    torch.manual_seed(0)
    x, q = torch.randn(rows, k).bfloat16(), torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) / 64).bfloat16()
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    got = torch.ops.fast_decode.gemv_int8(x, q, scales).double()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-2


# one row: K a multiple of 128 or 64 short of one (the last group alone), every group size (32: GGUF's Q4_0 and
# Q4_1 blocks, in SmolLM2's 576 and 1536 columns), rows and groups in whole blocks of 8 and not; more: tiles of 2 x 2
@pytest.mark.parametrize("rows,n,k,groupsize", [(1, 5632, 2048, 128), (1, 7, 192, 64), (1, 5, 64, 64),
                                                (1, 64, 1024, 256), (1, 33, 2176, 64), (3, 7, 256, 64),
                                                (8, 1030, 512, 256), (64, 71, 1152, 128), (33, 40, 192, 64),
                                                (1, 960, 576, 32), (1, 9, 1536, 32), (1, 5, 64, 32),
                                                (5, 40, 576, 32), (2, 3, 320, 32), (1, 301, 1408, 128),
                                                (1, 203, 2560, 256)])
def test_int4_product_stays_within_a_percent_of_the_dequantized_product(kernels, rows, n, k, groupsize):
    # the kernel rounds x to int8 per group (and the result to bf16): about 0.7% here, against ~10% for int4 itself
    torch.manual_seed(0)
    x, q = torch.randn(rows, k).bfloat16(), quantize.quantize_int4(torch.randn(n, k), groupsize)
    exact = x.double() @ quantize.dequantize_int4(*q).double().T
    got = torch.ops.fast_decode.gemv_int4(x, quantize.pack_nibbles(q[0]), q[1], q[2]).double()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-2


def test_work_taken_from_a_slowed_thread_is_done_once_as_one_thread_would_do_it(kernels):
    # seven threads on fewer cores: the system stops some of them mid-product, and the others take their rows (or
    # attention's chunks); two inputs in turn, so that a part left undone cannot pass for the last call's result
    torch.manual_seed(0)
    xs, qs = torch.randn(2, 1, 2048).bfloat16(), torch.randn(2, 1, 32, 1, 64).bfloat16()
    w, q8 = torch.randn(1003, 2048).bfloat16(), torch.randint(-127, 128, (1003, 2048), dtype=torch.int8)
    q4 = quantize.quantize_int4(torch.randn(1003, 2048), 128)
    scales = (torch.rand(1003) / 64).bfloat16()
    k, v = torch.randn(1, 4, 1024, 64).bfloat16(), torch.randn(1, 4, 1024, 64).bfloat16()
    mask = torch.ones(1, 1, 1, 1024, dtype=torch.bool)
    ops = torch.ops.fast_decode
    work = [lambda i: ops.gemv_bf16(xs[i], w), lambda i: ops.gemv_int8(xs[i], q8, scales),
            lambda i: ops.gemv_int8(xs[i], q8, scales, True),
            lambda i: ops.gemv_int4(xs[i], quantize.pack_nibbles(q4[0]), q4[1], q4[2]),
            lambda i: ops.attend(qs[i], k, v, mask)]
    torch.set_num_threads(1)
    alone = [[f(i) for i in range(2)] for f in work]
    torch.set_num_threads(7)
    for n in range(50):
        assert all(torch.equal(f(n % 2), a[n % 2]) for f, a in zip(work, alone))


def installed(layer: nn.Module) -> nn.Module:
    holder = nn.Sequential(layer)
    cpu_gemv.install(holder)
    return holder[0]


@torch.no_grad()
def test_leading_dimensions_and_non_contiguous_inputs_are_kept():
    layer = installed(nn.Linear(64, 48, bias=False).bfloat16())
    x = torch.randn(2, 3, 64).bfloat16().transpose(0, 1)
    assert isinstance(layer, cpu_gemv.GemvBf16) and layer.gemv
    assert torch.equal(layer(x), layer(x.contiguous())) and layer(x).shape == (3, 2, 48)


@torch.no_grad()
def test_what_the_kernels_cannot_do_is_left_to_torch():
    assert not installed(nn.Linear(40, 48, bias=False).bfloat16()).gemv  # K % 16
    assert isinstance(installed(nn.Linear(64, 48, bias=False)), nn.Linear)  # fp32
    assert isinstance(installed(nn.Linear(64, 48, bias=True).bfloat16()), nn.Linear)  # a bias
    assert isinstance(installed(quantize.Int8Linear(48, 40)), quantize.Int8Linear)  # int8 needs K % 32
    int4 = quantize.Int4Linear(96, 48, 32)  # the kernel reads 64 weights at a time: K % 64
    q, int4.scales, int4.zeros = quantize.quantize_int4(torch.randn(48, 96), 32)
    int4.weight = quantize.pack_nibbles(q)
    assert installed(int4) is int4
    layer = installed(nn.Linear(64, 48, bias=False).bfloat16())
    with torch.enable_grad():  # the ops have no backward: training takes torch's path
        x = torch.randn(1, 64).bfloat16().requires_grad_()
        assert layer(x).grad_fn is not None


@torch.no_grad()
def test_many_rows_go_to_torchs_gemm_in_the_measured_dtype():
    layer = installed(nn.Linear(64, 48, bias=False).bfloat16())
    x = torch.randn(cpu_gemv.MAX_ROWS + 1, 64).bfloat16()
    expected = F.linear(x.to(layer.dtype), layer.weight.to(layer.dtype)).bfloat16()
    assert layer.dtype in (torch.bfloat16, torch.float32) and torch.equal(layer(x), expected)


@pytest.mark.parametrize("f32", [True, False])
def test_int4_weights_dequantize_for_prefill_as_quantize_py_does(kernels, f32):
    torch.manual_seed(0)
    q, scales, zeros = quantize.quantize_int4(torch.randn(70, 256), 64)
    got = torch.ops.fast_decode.dequantize_int4(quantize.pack_nibbles(q), scales, zeros, f32)
    exact = quantize.dequantize_int4(q, scales, zeros)
    assert got.dtype == (torch.float32 if f32 else torch.bfloat16)
    assert torch.allclose(got.float(), exact if f32 else exact.bfloat16().float(), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def quantized_layers():  # int8 and int4 layers of 48 x 128, and their weights dequantized
    torch.manual_seed(0)
    int8 = quantize.Int8Linear(128, 48)
    int8.weight, int8.scales = quantize.quantize_int8(torch.randn(48, 128))
    int4 = quantize.Int4Linear(128, 48, 64)
    q, int4.scales, int4.zeros = quantize.quantize_int4(torch.randn(48, 128), 64)
    int4.weight = quantize.pack_nibbles(q)
    return ((int8, quantize.dequantize_int8(int8.weight, int8.scales)),
            (int4, quantize.dequantize_int4(q, int4.scales, int4.zeros)))


@torch.no_grad()
def test_many_rows_of_quantized_layers_go_to_the_kernel_or_to_torchs_gemm_in_the_measured_dtype():
    x = torch.randn(cpu_gemv.MAX_ROWS + 3, 128).bfloat16()
    for layer, w in quantized_layers():
        ours = installed(layer)
        exact = x.double() @ w.double().T
        assert isinstance(ours, (cpu_gemv.GemvInt8, cpu_gemv.GemvInt4))
        for kernel_prefill in (False, True):  # the weight converted for torch's GEMM, and the kernel
            ours.kernel_prefill = kernel_prefill
            assert ((ours(x).double() - exact).norm() / exact.norm()).item() < 1e-2


@torch.no_grad()
@pytest.mark.parametrize("kernel_prefill", [False, True])
def test_a_compiled_prefill_runs_the_ops_an_eager_one_runs(kernel_prefill):
    # inductor would put its own int8 weight-only matmul in place of torch's path (the weight converted, then the
    # GEMM), another kernel than the one measured faster: a compiled prefill must run what eager runs
    from torch._inductor.utils import run_and_get_code
    ops = {("int8", False): "gemm_int8", ("int8", True): "gemv_int8", ("int4", False): "dequantize_int4",
           ("int4", True): "gemv_int4"}
    for (layer, _), kind in zip(quantized_layers(), ("int8", "int4")):
        ours = installed(layer)
        ours.kernel_prefill = kernel_prefill
        x = torch.randn(1, cpu_gemv.MAX_ROWS + 8, 128).bfloat16()
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(ours, dynamic=True, fullgraph=True), x)
        assert torch.equal(got, ours(x))
        assert f"fast_decode.{ops[kind, kernel_prefill]}" in "\n".join(code) and "int8pack" not in "\n".join(code)


def test_a_bf16_prefill_in_fp32_tiles_gives_the_whole_matrix_product(monkeypatch):
    x, w = torch.randn(2, 40, 96).bfloat16(), torch.randn(100, 96).bfloat16()
    monkeypatch.setattr(cpu_gemv, "TILE_BYTES", 4 * 96 * 7)  # 7 rows a tile: 15 tiles, the last of 2 rows
    y = cpu_gemv.linear_f32_tiles(x, w)
    assert y.dtype == torch.float32 and y.shape == (2, 40, 100)
    torch.testing.assert_close(y, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["bf16", "int8", "int4"])
def test_the_gate_and_up_joined_at_load_give_the_outputs_of_the_two_apart(mode):
    from checkpoint import join_gate_up
    from model import FeedForward, ModelArgs
    torch.manual_seed(0)
    linear = lambda k, n: nn.Linear(k, n, bias=False)  # noqa: E731
    apart = nn.ModuleDict({"w1": linear(128, 192), "w3": linear(128, 192), "w2": linear(192, 128)}).bfloat16()
    ff = FeedForward(ModelArgs(dim=128, intermediate_size=192, n_head=2)).bfloat16()
    if mode != "bf16":
        quantize.install(apart, mode, 64)
        quantize.install(ff, mode, 64)
        for m in apart.values():
            w = torch.randn(m.out_features, m.in_features)
            if mode == "int8":
                m.weight, m.scales = quantize.quantize_int8(w)
            else:
                q, m.scales, m.zeros = quantize.quantize_int4(w, 64)
                m.weight = quantize.pack_nibbles(q)
    block = lambda m: nn.ModuleList([nn.ModuleDict({"feed_forward": m})])  # noqa: E731 (names as in a model)
    block(ff).load_state_dict(join_gate_up(block(apart).state_dict(), 128, torch.bfloat16), assign=True)
    w1, w3, w2 = (installed(apart[name]) for name in ("w1", "w3", "w2"))
    joined = installed(ff)
    assert type(joined.w13) is type(w1) and joined.w13.weight.size(0) == 2 * w1.weight.size(0)
    for rows in (1, 3):  # decode and verification: through the kernel, bit for bit
        x = torch.randn(rows, 128).bfloat16()
        assert torch.equal(joined(x), w2(F.silu(w1(x)) * w3(x)))
    x = torch.randn(cpu_gemv.MAX_ROWS + 1, 128).bfloat16()
    # prefill: install picks the kernel or GEMM per shape by timing, so the joined and the separate layers may differ
    # in that choice here (each way's rounding of x is its own); so both sides take the same way, each way in turn
    for kernel_prefill in ((False, True) if mode != "bf16" else (False,)):
        for layer in (w1, w3, w2, joined.w13, joined.w2):
            layer.kernel_prefill = kernel_prefill
        apart_out = w2(F.silu(w1(x)) * w3(x))
        assert ((joined(x) - apart_out).float().norm() / apart_out.float().norm()).item() < 1e-2


def test_quantized_prefill_takes_the_path_measured_faster_here(monkeypatch):
    for (layer, _), kind in zip(quantized_layers(), ("int8", "int4")):
        for faster in (True, False):
            monkeypatch.setattr(cpu_gemv, "prefill_in_kernel", lambda layer, dtype: faster)
            ours = installed(layer)
            assert ours.kernel_prefill is faster
            assert (f"{kind} prefill in the kernels" in cpu_gemv.describe(nn.Sequential(ours))) is faster


def test_the_prefill_measurement_times_both_paths_once_and_keeps_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_gemv, "CACHE", tmp_path)
    ours = installed(quantized_layers()[1][0])
    first = cpu_gemv.prefill_in_kernel(ours, torch.float32)
    verdicts = json.loads((tmp_path / "prefill_dtype.json").read_text())
    # installing the layer measured its own prefill dtype too (bf16 on a CPU with bf16 matrix instructions)
    [key] = [k for k in verdicts if "int4 groups of 64" in k and k.endswith("else float32")]
    assert verdicts[key] == ("kernel" if first else "torch")
    verdicts[key] = "torch" if first else "kernel"  # the opposite verdict, to see that the next call reads it
    (tmp_path / "prefill_dtype.json").write_text(json.dumps(verdicts))
    assert cpu_gemv.prefill_in_kernel(ours, torch.float32) is not first


@torch.no_grad()
@pytest.mark.parametrize("mode", ["bf16", "int8", "int4"])
def test_a_model_gives_the_tokens_torchs_kernels_give(checkpoint, tmp_path, mode, kernels):
    from quantize_checkpoint import quantize_checkpoint
    path = checkpoint if mode == "bf16" else quantize_checkpoint(checkpoint, mode, 64, out_dir=tmp_path / mode)
    ours, torchs = (load_model(path, "cpu", torch.bfloat16, k) for k in ("auto", "off"))
    assert cpu_gemv.describe(ours).startswith(f"CPU kernels: {kernels}") and "torch" in cpu_gemv.describe(torchs)
    assert ours.cache_type is cpu_gemv.KernelCache and torchs.cache_type is KVCache  # whose attention: the kernels'

    idx = torch.tensor([[1, 40, 41, 42, 43]])
    for m in (ours, torchs):
        m.setup_caches(1, 16)
    logits = [torch.cat([m(idx[:, i : i + 1], m.context(torch.tensor([i]))) for i in range(idx.size(1))], 1).float()
              for m in (ours, torchs)]
    # int8, int4: the kernels round activations to int8 per block, about 1% per product, which adds up over layers
    assert ((logits[0] - logits[1]).norm() / logits[1].norm()).item() < (2e-2 if mode == "bf16" else 5e-2)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@torch.no_grad()
def test_the_ops_compile_into_one_graph():
    layer = installed(nn.Linear(64, 48, bias=False).bfloat16())
    x = torch.randn(1, 1, 64).bfloat16()
    compiled = torch.compile(lambda x: F.silu(layer(x)), fullgraph=True)  # fullgraph: a graph break would raise
    assert torch.equal(compiled(x), F.silu(torch.ops.fast_decode.gemv_bf16(x, layer.weight)))


def test_without_a_compiler_torchs_kernels_stay_and_one_line_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_gemv, "CACHE", tmp_path)  # no cached build to fall back on
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    try:
        cpu_gemv.load()
        layer = installed(nn.Linear(64, 48, bias=False).bfloat16())
        assert not layer.gemv and cpu_gemv.kernels == "torch"
        assert capsys.readouterr().err.strip() == \
            f"cpu_gemv: using torch's CPU kernels: no C++ compiler ({tmp_path / 'no-such-compiler'} not found)"
    finally:
        monkeypatch.undo()
        cpu_gemv.load()


def broken_source(tmp_path):  # a kernel set that does not build: its source's second line stops the compiler
    (tmp_path / "broken.cpp").write_text("// a kernel set for a CPU g++ does not know\n#error no such intrinsic\n")
    return [tmp_path / "broken.cpp"]


def test_a_kernel_set_that_does_not_build_gives_way_to_the_next_and_one_line_says_so(tmp_path, monkeypatch, capsys):
    best = cpu_gemv.targets(cpu_gemv.cpu_flags())[0]
    monkeypatch.setattr(cpu_gemv, "targets", lambda flags: [("broken", broken_source(tmp_path), []), best])
    try:
        assert cpu_gemv.load() == best[0] == cpu_gemv.kernels
        # a line saying that g++ compiles (the broken set is not in the cache), then the error, with its file and line
        *compiling, err = capsys.readouterr().err.strip().splitlines()
        assert compiling == [f"cpu_gemv: compiling the broken kernels with g++ into {cpu_gemv.CACHE}"]
        assert err.startswith(f"cpu_gemv: the broken kernels did not build ({tmp_path / 'broken.cpp'}:2:")
        assert "no such intrinsic" in err and err.endswith(f"); trying {best[0]}")
    finally:
        monkeypatch.undo()
        cpu_gemv.load()


def test_when_no_kernel_set_builds_torchs_kernels_stay_and_one_line_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_gemv, "targets", lambda flags: [("broken", broken_source(tmp_path), [])])
    monkeypatch.setattr(cpu_gemv, "_why_not", None)  # the line comes once per reason a process
    try:
        assert cpu_gemv.load() is None and cpu_gemv.kernels == "torch"
        *_, err = capsys.readouterr().err.strip().splitlines()
        assert err.startswith("cpu_gemv: using torch's CPU kernels: the kernels did not build: ")
        assert f"{tmp_path / 'broken.cpp'}:2:" in err and "no such intrinsic" in err
    finally:
        monkeypatch.undo()
        cpu_gemv.load()


def test_the_first_build_says_so_in_one_line_and_a_cached_one_says_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_gemv, "CACHE", tmp_path)
    best = cpu_gemv.targets(cpu_gemv.cpu_flags())[-1]  # the quickest to build
    monkeypatch.setattr(cpu_gemv, "targets", lambda flags: [best])
    try:
        assert cpu_gemv.load() == best[0]
        assert capsys.readouterr().err.strip() == f"cpu_gemv: compiling the {best[0]} kernels with g++ into {tmp_path}"
        assert cpu_gemv.load() == best[0] and capsys.readouterr().err == ""
    finally:
        monkeypatch.undo()
        cpu_gemv.load()


def test_importing_cpu_gemv_builds_nothing_and_leaves_the_loggers_alone():
    code = ("import logging, sys, cpu_gemv; "
            "assert cpu_gemv.kernels == 'torch' and cpu_gemv._lib is None; "
            "assert logging.getLogger('torch.utils.cpp_extension').level == logging.NOTSET")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cpu_gemv.CSRC.parent)
    assert run.returncode == 0, run.stderr


def test_the_cpu_features_choose_the_kernel_sets():
    names = lambda flags: [t[0] for t in cpu_gemv.targets(flags)]  # noqa: E731
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    assert names({"avx2", "fma"}) == ["avx2"]
    assert names({"sse4_2", "avx"}) == []
    assert names(avx512 | {"avx512_bf16", "avx512_vnni"}) == ["avx512+bf16+vnni", "avx512", "avx2"]
    assert names(avx512 | {"avx512_vnni"}) == ["avx512+vnni", "avx512", "avx2"]
    assert names(avx512) == ["avx512", "avx2"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 kernel sets")
def test_every_x86_kernel_set_compiles_here_even_those_this_cpu_cannot_run(monkeypatch):
    # g++ builds AVX-512 code on any x86 machine: a set that only an AVX-512 CPU runs still fails here if it breaks;
    # with either L1 size (the attention's prefetch hint), and with VNNI but no BF16
    every = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    for l1 in (32, 48):
        monkeypatch.setattr(cpu_gemv, "l1_data_kb", lambda: l1)
        for name, sources, flags in cpu_gemv.targets(every) + cpu_gemv.targets(every - {"avx512_bf16"})[:1]:
            assert cpu_gemv.compile_set(sources, flags).stat().st_size > 0, name


@pytest.mark.parametrize("flag", ["-DKV_HINT=_MM_HINT_T1", "-DKV_AHEAD=7168", "-DAHEAD_WEIGHTS=0", "-DAHEAD_BF16=4096"])
def test_a_core_with_less_than_48_kb_of_l1_gets_its_own_prefetch_settings(monkeypatch, flag):
    # the KV cache into L2 and 7 KB ahead, no int8/int4 weights asked for ahead, bf16 weights 4 KB ahead into L3
    # (see cpu_gemv)
    every = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    hinted = lambda: [flag in flags for _, _, flags in cpu_gemv.targets(every)]  # noqa: E731
    monkeypatch.setattr(cpu_gemv, "l1_data_kb", lambda: 32)
    assert hinted() == [True, False, False]
    for kb in (48, 0):  # 48 KB or more; sysfs silent
        monkeypatch.setattr(cpu_gemv, "l1_data_kb", lambda: kb)
        assert not any(hinted())


@pytest.mark.parametrize("rows,n,k", [(1, 5632, 2048), (3, 7, 64)])  # K a multiple of 16 (bf16) and 32 (int8)
def test_float32_products_keep_what_bf16_would_round_away(kernels, rows, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    got = torch.ops.fast_decode.gemv_bf16(x, w, True)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-16 + 1e-3).all()  # far finer than a bf16 step
    q, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n) / 64).bfloat16()
    got = torch.ops.fast_decode.gemv_int8(x, q, scales, True)  # the output head's: x not rounded to int8
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-16 + 1e-3).all()


def attention_case(B, H, Hkv, S, L, D, pad=None, cache=None):
    """q [B, H, S, D] (a transposed view, as the model has it), k and v slices of a longer cache, and the model's
    mask: causal over the last S positions, each row's first pad[b] slots hidden (a query still sees itself)."""
    q = torch.randn(B, S, H, D).bfloat16().transpose(1, 2)
    k, v = (torch.randn(B, Hkv, (cache or L) + 1, D).bfloat16()[:, :, :L] for _ in range(2))
    pos, slots = torch.arange(L - S, L), torch.arange(L)
    mask = slots <= pos[:, None]  # [S, L]
    if pad is None:
        return q, k, v, mask[None, None]
    mask = mask & ((slots >= torch.tensor(pad)[:, None, None]) | (slots == pos[:, None]))  # [B, S, L]
    return q, k, v, mask[:, None]


@pytest.mark.parametrize("B,H,Hkv,S,L,D,pad", [
    (1, 32, 4, 1, 256, 64, None),  # TinyLlama's decode step
    (1, 9, 3, 1, 4100, 64, None),  # SmolLM2's heads at 4k context, the last block of 4 positions
    (1, 32, 8, 1, 1000, 128, None),  # Llama 3 8B's decode step: 4 query rows per KV head, 128 dimensions
    (1, 12, 2, 1, 200, 64, None),  # 6 query rows per KV head: scored as 8, two of them padding
    (3, 6, 2, 5, 600, 64, [0, 3, 300]),  # verification of 5 tokens, left padding; row 2's first chunk all hidden
    (2, 4, 4, 7, 19, 128, [1, 0]),  # multi-head, 128 dimensions, a context shorter than 8 positions past a block
    (1, 8, 1, 3, 40, 32, None),  # multi-query
    (1, 4, 2, 1, 33, 16, None),  # two query rows per KV head, 16 dimensions
    (1, 8, 4, 1, 300, 128, None),  # two query rows per KV head, 128 dimensions
    (2, 2, 2, 1, 70, 256, [5, 0]),  # multi-head decode: one query row per KV head, 256 dimensions
])
def test_attention_for_few_rows_equals_torchs_to_a_bf16_step(kernels, B, H, Hkv, S, L, D, pad):
    torch.manual_seed(0)
    q, k, v, mask = attention_case(B, H, Hkv, S, L, D, pad, cache=L + 50)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    got = cpu_gemv.sdpa(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
    assert got.shape == exact.shape and got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 2e-3).all()


@pytest.mark.parametrize("late", [False, True])
def test_attention_follows_scores_far_above_the_first_ones(kernels, late):
    # the kernel keeps each row's running maximum and rescales what it summed when a score passes it by far: a key
    # that scores 22-53 above the rest (by head) takes nearly all the weight, first in the cache or late in a block
    torch.manual_seed(0)
    q, k, v, mask = attention_case(1, 8, 2, 1, 300, 64, cache=350)
    at = 170 if late else 0
    k[:, :, at] = (q.float().mean(1) * 40 / q.float().mean(1).norm(dim=-1, keepdim=True) * 8 ** 0.5).bfloat16()
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    got = cpu_gemv.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 2e-3).all()


def in_a_longer_cache(q: torch.Tensor, scale: torch.Tensor, spare: int):  # [B, H, L, D], [B, H, L, n] as cache slices
    B, H, L, D = q.shape
    qc, sc = torch.zeros(B, H, L + spare, D, dtype=q.dtype), torch.zeros(B, H, L + spare, scale.size(-1))
    qc[:, :, :L], sc[:, :, :L] = q, scale
    return qc[:, :, :L], sc[:, :, :L]


@pytest.mark.parametrize("B,H,Hkv,S,L,D,pad", [
    (1, 32, 4, 1, 4100, 64, None),  # TinyLlama's decode step at 4k context
    (3, 6, 2, 5, 600, 64, [0, 3, 300]),  # verification of 5 tokens, left padding
    (2, 4, 4, 7, 19, 128, [1, 0]),  # 128 dimensions, a context shorter than a block
    (2, 2, 2, 1, 70, 256, [5, 0]),  # 256 dimensions
    (1, 8, 1, 3, 40, 32, None),  # 32 dimensions: dequantized, then the bf16 kernel
])
def test_attention_over_an_int8_cache_stays_near_exact(kernels, B, H, Hkv, S, L, D, pad):
    # with AVX512-VNNI the kernel also rounds q to int8 per row and the weights to 8 bits per block of positions:
    # 0.8-1.4% here, where random keys spread the weights evenly (the worst case for 8 bits); without VNNI it widens
    # K and V to fp32 and only its bf16 output rounds, as when 32 dimensions are dequantized for the bf16 kernel
    torch.manual_seed(0)
    q, k, v, mask = attention_case(B, H, Hkv, S, L, D, pad, cache=L + 50)
    (k8, ks), (v8, vs) = (in_a_longer_cache(*quantize_rows(t, n), 50) for t, n in ((k, D), (v, min(32, D))))
    kd, vd = (dequantize_rows(t, s, torch.float64) for t, s in ((k8, ks), (v8, vs)))
    exact = F.scaled_dot_product_attention(q.double(), kd, vd, attn_mask=mask, enable_gqa=True)
    got = cpu_gemv.sdpa_int8(q, k8, ks, v8, vs, attn_mask=mask, enable_gqa=H != Hkv)
    assert got.shape == exact.shape and got.dtype == torch.bfloat16
    rounded = "vnni" in kernels.split("+") and D >= 64
    assert ((got.double() - exact).norm() / exact.norm()).item() < (2e-2 if rounded else 5e-3)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_every_kernel_set_reads_an_int8_cache_in_place(kernels, D, monkeypatch):
    # the fallback dequantizes the whole cache every step: it would pass the accuracy test above as well
    def dequantized(*args):
        raise AssertionError("the int8 cache was dequantized")
    monkeypatch.setattr(cpu_gemv, "dequantize_rows", dequantized)
    q, k, v, mask = attention_case(1, 8, 2, 1, 300, D)
    (k8, ks), (v8, vs) = (in_a_longer_cache(*quantize_rows(t, n), 50) for t, n in ((k, D), (v, 32)))
    assert cpu_gemv.sdpa_int8(q, k8, ks, v8, vs, attn_mask=mask, enable_gqa=True).isfinite().all()


def test_attention_the_kernel_cannot_do_is_torchs():
    q, k, v, mask = attention_case(1, 4, 2, 40, 60, 64)  # 40 query rows: prefill
    assert torch.equal(cpu_gemv.sdpa(q, k, v, attn_mask=mask, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    q, k, v, mask = attention_case(1, 4, 2, 1, 60, 48)  # 48 dimensions
    assert torch.equal(cpu_gemv.sdpa(q, k, v, attn_mask=mask, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


@torch.no_grad()
def test_the_output_head_gives_float32_logits(checkpoint, kernels):
    model = load_model(checkpoint, "cpu", torch.bfloat16)  # cpu_gemv installed: the head writes float32
    model.setup_caches(1, 16)
    logits = model(torch.tensor([[1, 5, 9]]), model.context(torch.arange(3), last=True))
    assert logits.dtype == torch.float32 and logits.shape == (1, 1, model.args.vocab_size)
    assert logits.bfloat16().float().ne(logits).any()  # values bf16 could not hold


def test_aten_cpu_capability_avx512_hides_amx(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert not any(f.startswith("amx") for f in cpu_gemv.cpu_flags())
    assert not any(name.endswith("+amx") for name, _, _ in cpu_gemv.targets(cpu_gemv.cpu_flags()))
