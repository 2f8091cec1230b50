"""Matrix-vector products for decoding on CPUs: y = x @ w.T for x [M, K] of a few rows, with w in bf16, int8 (a
scale per row) or int4 (a scale and zero per group), all as this project stores them, and attention for a few query
rows, on C++ kernels (csrc/) for the instruction set the CPU has: AVX2+FMA, or AVX-512 (with the BF16 dot product
and VNNI where present).

Batch-1 decode is one pass over every weight, so it runs at memory speed only if the multiply keeps up with memory,
which torch's CPU kernels do not on AVX2 (HOW_IT_WORKS.md, "CPU decode kernels"). The kernels are compiled with g++
the first time they are asked for (load, install), into ~/.cache/fast-decode, and reached through torch ops
(csrc/ops.cpp) so that torch.compile keeps them in the graph. install(model) replaces a bf16 model's linear layers
(and quantize.py's int8 and int4 layers, recognised by their tensors) with layers that send products of few rows
there, and joins each feed-forward's gate and up layers into one product; model.py's attention for a few query rows
runs there too, over a bf16 KV cache or an int8 one. Products of many rows (prefill) go to torch's GEMM in bf16 or
fp32, or to the int8 and int4 kernels, whichever a measurement on this machine found faster. Without a compiler or
a known instruction set, one line on stderr says so and torch's kernels stay."""
import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import KVCache, dequantize_rows

MAX_ROWS = 32  # products of more rows than this (prefill) go to torch's GEMM; a token tree verifies up to 32
PROBE_ROWS = 256  # the rows of the product that decides the prefill dtype
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fast-decode"
CSRC = Path(__file__).resolve().parent / "csrc"
SET_SOURCES = ("quantized.cpp", "attention.cpp", "step.cpp", "kernel_set.cpp")  # every kernel set's, after its bf16


# ---- which kernels this CPU can run ------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them. torch's ATEN_CPU_CAPABILITY=avx2 (or default) hides the newer
    ones here too, so that one setting runs an AVX-512 machine as an AVX2 one; =avx512 hides AMX."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    flags = next((set(l.split(":", 1)[1].split()) for l in lines if l.split(":")[0].strip() in ("flags", "Features")),
                 set())
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability == "avx512":  # AVX-512 without AMX's tiles
        flags = {f for f in flags if not f.startswith("amx")}
    if capability in ("avx2", "default"):
        flags = {f for f in flags if not f.startswith("avx512")} - ({"avx2"} if capability == "default" else set())
    return flags


def amx_granted() -> bool:
    """Whether Linux lets this process use AMX's tiles: it must ask once (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA), and a kernel or VM may refuse."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


def l1_data_kb() -> int:
    """The first core's L1 data cache in KB, from Linux's sysfs; 0 where it does not say."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() == "Data":
                return int((index / "size").read_text().strip().rstrip("K"))
        except (OSError, ValueError):
            return 0
    return 0


def targets(flags: set[str]) -> list[tuple[str, list[Path], list[str]]]:
    """(name, sources, compiler flags) of every kernel set this CPU runs, the fastest first."""
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= flags:
        sources = [CSRC / "bf16_avx512.cpp", *(CSRC / s for s in SET_SOURCES)]
        base = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
        extra = [f for f in ("avx512_bf16", "avx512_vnni") if f in flags]
        # cores with less than 48 KB of L1 prefetch otherwise: HOW_IT_WORKS.md, "Prefetching the weights on a small L1"
        small_l1 = ["-DKV_HINT=_MM_HINT_T1", "-DKV_AHEAD=7168", "-DAHEAD_WEIGHTS=0", "-DAHEAD_BF16=4096"]
        small_l1 = small_l1 if 0 < l1_data_kb() < 48 else []
        if extra and {"amx_tile", "amx_bf16"} <= flags and amx_granted():  # AMX for the bf16, int8 and int4 products
            out.append(("avx512+" + "+".join(f[7:] for f in extra) + "+amx", sources,
                        base + ["-m" + f.replace("_", "") for f in extra] + ["-mamx-tile", "-mamx-bf16"] +
                        (["-mamx-int8"] if "amx_int8" in flags else []) + small_l1))
        if extra:  # the plain AVX-512 set too, second: a test can run both
            out.append(("avx512+" + "+".join(f[7:] for f in extra), sources,
                        base + ["-m" + f.replace("_", "") for f in extra] + small_l1))
        out.append(("avx512", sources, base))
    if {"avx2", "fma"} <= flags:
        out.append(("avx2", [CSRC / "bf16_avx2.cpp", *(CSRC / s for s in SET_SOURCES)], ["-mavx2", "-mfma"]))
    return out


# ---- the build ---------------------------------------------------------------------------------------------------

def library(sources: list[Path], flags: list[str]) -> Path:
    """Where the cache keeps the library built from sources with flags: named by a hash of the sources, the headers
    they include (csrc/*.h) and the flags (which hold the torch version, for the ops)."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in [*sources, *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return CACHE / f"{sources[0].stem}-{digest.hexdigest()[:16]}.so"


def compile_once(sources: list[Path], flags: list[str], announce=lambda: None) -> Path:
    """The shared library g++ builds from the repository's sources (in place: an error names their file and line)
    with flags, from the cache when built so before; announce() is called before a build."""
    lib, cxx = library(sources, flags), os.environ.get("CXX", "g++")
    if not lib.exists():
        if shutil.which(cxx) is None:
            raise FileNotFoundError(cxx)
        announce()
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # built aside, then renamed: no reader sees half a file
            subprocess.run([cxx, *map(str, sources), *flags, "-o", f"{tmp}/lib.so"],
                           check=True, capture_output=True, text=True)
            os.replace(f"{tmp}/lib.so", lib)
    return lib


def set_flags(flags: list[str]) -> list[str]:
    """A kernel set's full compiler flags, given its instruction set's."""
    return ["-O3", *flags, "-fopenmp", "-shared", "-fPIC"]


def compile_set(sources: list[Path], flags: list[str], announce=lambda: None) -> Path:
    """One kernel set's shared library, compiled for its instruction set (which this CPU need not have)."""
    return compile_once(sources, set_flags(flags), announce)


def ops_build() -> tuple[list[Path], list[str]]:
    """The torch ops' sources and flags: built against this torch's headers and libraries. torch's C++-extension
    module warns of a missing CUDA when imported on a CUDA build without a GPU: about code nothing here builds."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
        includes = cpp_extension.include_paths()
    finally:
        log.setLevel(level)
    torch_lib = str(Path(torch.__file__).parent / "lib")
    return [CSRC / "ops.cpp"], ["-O2", "-std=c++20", "-shared", "-fPIC", f"-DTORCH_VERSION={torch.__version__}",
                                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                                *[f"-isystem{p}" for p in includes], f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
                                "-lc10", "-ltorch_cpu"]


def build_first(sets: list[tuple[str, list[Path], list[str]]], announce=lambda: None) -> tuple[Path, str]:
    """The first of the kernel sets (name, sources, flags) that builds, and its name: a g++ too old for one instruction
    set's intrinsics still builds the next, slower set. Raises the last failure when none builds."""
    for i, (name, sources, flags) in enumerate(sets):
        try:
            return compile_set(sources, flags, announce), name
        except subprocess.CalledProcessError as e:
            if i + 1 == len(sets):
                raise
            print(f"cpu_gemv: the {name} kernels did not build ({compiler_error(e)}); trying {sets[i + 1][0]}",
                  file=sys.stderr)
    raise RuntimeError("no kernel set to build")


def compiler_error(e: subprocess.CalledProcessError) -> str:
    """The compiler's first error, with its file and line, else its last line."""
    lines = [line.strip() for line in (e.stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines[-1:] or [f"exit status {e.returncode}"])[0]


_lib: Optional[Path] = None  # the kernel set loaded, or None: torch's kernels
_ops: Optional[Path] = None  # the torch ops' library, loaded once a process
kernels = "torch"  # what products of few rows run on: a kernel set's name, or torch's own
_why_not = None


def load(name: Optional[str] = None) -> Optional[str]:
    """Build (the first time: one line on stderr says so) and switch to the CPU's best kernel set (or the one named);
    its name, or None with one line on stderr saying why torch's kernels stay."""
    global _lib, _ops, kernels, _why_not
    chosen = [t for t in targets(cpu_flags()) if name is None or t[0] == name]
    try:
        if not chosen:
            raise RuntimeError(f"no kernels for this CPU ({platform.machine()}: "
                               f"{'no ' + name if name else 'there are kernels for x86 AVX2+FMA and AVX-512 only'})")
        said = []

        def announce():  # one line, before the first build of this call
            if not said:
                cxx = os.environ.get("CXX", "g++")
                print(f"cpu_gemv: compiling the {chosen[0][0]} kernels with {cxx} into {CACHE}", file=sys.stderr)
                said.append(True)
        if _ops is None:
            _ops = compile_once(*ops_build(), announce)
            torch.ops.load_library(str(_ops))
            register_fakes()
        _lib, kernels = build_first(chosen, announce)
        torch.ops.fast_decode.use_kernels(str(_lib))
        return kernels
    except FileNotFoundError:
        why = f"no C++ compiler ({os.environ.get('CXX', 'g++')} not found)"
    except subprocess.CalledProcessError as e:
        why = f"the kernels did not build: {compiler_error(e)}"
    except (RuntimeError, OSError) as e:
        why = str(e)
    if why != _why_not:  # once per reason, not once per model
        print(f"cpu_gemv: using torch's CPU kernels: {why}", file=sys.stderr)
    _lib, kernels, _why_not = None, "torch", why
    return None


# ---- the kernels as torch ops (defined in csrc/ops.cpp): their output shapes, for torch.compile ------------------

def out(x: Tensor, n: int, f32: bool) -> Tensor:  # [..., n], bf16 or float32: what the products return
    return x.new_empty(*x.shape[:-1], n, dtype=torch.float32 if f32 else x.dtype)


def register_fakes():
    fake = torch.library.register_fake
    fake("fast_decode::gemv_bf16")(lambda x, w, f32=False: out(x, w.size(0), f32))
    fake("fast_decode::gemv_int8")(lambda x, w, scales, f32=False: out(x, w.size(0), f32))
    fake("fast_decode::gemv_int4")(lambda x, w, scales, zeros, f32=False: out(x, w.size(0), f32))
    fake("fast_decode::attend")(lambda q, k, v, mask: torch.empty_like(q, memory_format=torch.contiguous_format))
    fake("fast_decode::attend_int8")(lambda q, k, k_scale, v, v_scale, mask:
                                     torch.empty_like(q, memory_format=torch.contiguous_format))
    fake("fast_decode::attend_paged")(lambda q, k_pool, v_pool, table, pos, slots:
                                      torch.empty_like(q, memory_format=torch.contiguous_format))
    fake("fast_decode::dequantize_int4")(lambda w, scales, zeros, f32: w.new_empty(
        w.size(0), 2 * w.size(1), dtype=torch.float32 if f32 else torch.bfloat16))
    fake("fast_decode::gemm_int8")(lambda x, w, scales, dtype: x.new_empty(*x.shape[:-1], w.size(0), dtype=dtype))


def few_rows(x: Tensor) -> bool:  # decode, verification, short prompts; inference only: the ops have no backward
    return x.numel() <= MAX_ROWS * x.size(-1) and not (torch.is_grad_enabled() and x.requires_grad)


def rows_of_d(t: Tensor) -> bool:  # [B, H, L, D] with each row of D contiguous, rows D apart
    return t.stride(-1) == 1 and t.stride(-2) == t.size(-1)


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
         enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention, with a few query rows over a bf16 KV cache through attend() (decode and
    verification: q [B, H, S, D] for S <= MAX_ROWS, a boolean mask [B|1, 1, S, L]); anything else through torch's."""
    if (attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.size(1) == 1 and q.size(2) <= MAX_ROWS
            and q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu"
            and q.size(-1) in (16, 32, 64, 128, 256) and q.size(1) % k.size(1) == 0 and rows_of_d(k) and rows_of_d(v)
            and k.stride() == v.stride() and attn_mask.stride(-1) == 1 and attn_mask.stride(-2) == attn_mask.size(-1)
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return torch.ops.fast_decode.attend(q, k, v, attn_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


def sdpa_int8(q: Tensor, k: Tensor, k_scale: Tensor, v: Tensor, v_scale: Tensor, attn_mask: Tensor,
              enable_gqa: bool) -> Tensor:
    """model.sdpa_int8 (attention over an int8 cache), with a few query rows through attend_int8(); anything else
    (prefill, other head sizes) through model.py's own: dequantize, then sdpa above."""
    if (q.size(2) <= MAX_ROWS and q.dtype == torch.bfloat16 and q.device.type == "cpu"
            and q.size(-1) in (64, 128, 256) and q.size(1) % k.size(1) == 0 and rows_of_d(k) and rows_of_d(v)
            and k.stride() == v.stride() and k_scale.size(-1) == 1 and k_scale.stride(-2) == 1
            and v_scale.size(-1) == q.size(-1) // 32 and v_scale.stride(-2) == v_scale.size(-1)
            and v_scale.stride(-1) == 1 and attn_mask.dtype == torch.bool and attn_mask.size(1) == 1
            and attn_mask.stride(-1) == 1 and attn_mask.stride(-2) == attn_mask.size(-1)
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return torch.ops.fast_decode.attend_int8(q, k, k_scale, v, v_scale, attn_mask)
    k, v = dequantize_rows(k, k_scale, q.dtype), dequantize_rows(v, v_scale, q.dtype)
    return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


class KernelCache(KVCache):
    """model.py's static KV cache, attended through the kernels above (install makes it the model's cache_type)."""
    sdpa = staticmethod(sdpa)
    sdpa_int8 = staticmethod(sdpa_int8)


def attend_paged(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, pos: Tensor, slots: int) -> Tensor:
    """Attention for a few query rows of many sequences over paged.py's block pool: q [B, H, S, D], k_pool and v_pool
    [n_blocks, Hkv, block_size, D], table [B, W] int64 each row's blocks in position order, pos [B, S] int64 each
    query's position (it sees positions 0 .. pos of its row) -> [B, H, S, D]. Through the attend_paged kernel where
    it runs (bf16 on the CPU): each row then comes out bit for bit as attend() computes it alone over a static cache
    of `slots` positions, with no copy of the rows' histories. Anything else through torch's attention over the
    rows' blocks gathered."""
    if (_lib is not None and q.dtype == k_pool.dtype == v_pool.dtype == torch.bfloat16 and q.device.type == "cpu"
            and q.size(-1) in (16, 32, 64, 128, 256) and q.size(2) <= MAX_ROWS and q.size(1) % k_pool.size(1) == 0
            and k_pool.size(2) in (16, 32, 64, 128, 256)  # block sizes that divide every chunk of the kernel's
            and k_pool.is_contiguous() and v_pool.is_contiguous()
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return torch.ops.fast_decode.attend_paged(q, k_pool, v_pool, table, pos, slots)
    return attend_paged_reference(q, k_pool, v_pool, table, pos)


def attend_paged_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, pos: Tensor) -> Tensor:
    """attend_paged in torch: the blocks each row reads gathered end to end, masked past each query's position."""
    size, n = k_pool.size(2), int(pos.max()) // k_pool.size(2) + 1  # the blocks some row reads
    blocks = table[:, :n].clamp(0, k_pool.size(0) - 1)  # ids past a row's last position are masked, whatever they are
    k, v = (pool[blocks].transpose(1, 2).flatten(2, 3).to(q.dtype) for pool in (k_pool, v_pool))  # [B, Hkv, n size, D]
    mask = torch.arange(n * size, device=q.device) <= pos[..., None]  # [B, S, n size]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.size(1) != k.size(1))


# ---- prefill: bf16, fp32 or the kernels, measured -----------------------------------------------------------------

def fastest(what: str, candidates: dict) -> str:
    """The name of the fastest of the candidates (callables, each run three times: a warm-up, then the better of
    two), for `what` on this machine: timed once per machine, torch and thread count, and cached beside the
    kernels."""
    key = f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {what}"
    path = CACHE / "prefill_dtype.json"
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    if key not in verdicts:
        seconds = {}
        for name, run in candidates.items():
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            seconds[name] = min(times[1:])
        verdicts[key] = min(seconds, key=seconds.get)
        try:
            CACHE.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(verdicts, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs the measurement next time
    return verdicts[key]


def prefill_dtype(n: int, k: int) -> torch.dtype:
    """The faster dtype here for a prefill-sized product (PROBE_ROWS rows) with a bf16 [n, k] weight: bf16, or fp32
    with the weight converted on the fly: CPUs without bf16 matrix instructions run torch's bf16 GEMM far slower
    than its fp32 one (HOW_IT_WORKS.md, "Which kernels, and prefill on a CPU"). At MAX_ROWS rows the two are close
    (converting the weight costs as much as the product), so that is no place to measure. At most 4096 of the
    weight's rows: speed per FLOP is the same."""
    n = min(n, 4096)
    x, w = torch.randn(PROBE_ROWS, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
    return getattr(torch, fastest(f"{PROBE_ROWS} rows, {n}x{k}", {
        str(dtype)[6:]: (lambda dtype=dtype: F.linear(x.to(dtype), w.to(dtype)))
        for dtype in (torch.float32, torch.bfloat16)}))


def prefill_in_kernel(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a quantized layer (GemvInt8, GemvInt4) multiplies many rows (prefill) faster here in its kernel (x
    rounded to int8, integer multiply-adds) than through torch's GEMM in dtype: which one wins depends on the CPU
    (HOW_IT_WORKS.md, "Which kernels, and prefill on a CPU"). Timed on at most 4096 of the layer's rows."""
    n = min(layer.weight.size(0), 4096)
    if isinstance(layer, GemvInt8):
        probe, what = GemvInt8(layer.weight[:n], layer.scales[:n], dtype), "int8"
    else:
        probe = GemvInt4(SimpleNamespace(in_features=layer.in_features, out_features=n, weight=layer.weight[:n],
                                         scales=layer.scales[:n], zeros=layer.zeros[:n]), dtype)
        what = f"int4 groups of {2 * layer.weight.size(1) // layer.scales.size(1)}"
    x = torch.randn(PROBE_ROWS, layer.weight.size(1) if what == "int8" else layer.in_features, dtype=torch.bfloat16)

    def run(kernel: bool):
        probe.kernel_prefill = kernel
        with torch.no_grad():
            probe(x)
    return fastest(f"{PROBE_ROWS} rows, {what}, {n}x{x.size(1)}, else {str(dtype)[6:]}",
                   {"kernel": lambda: run(True), "torch": lambda: run(False)}) == "kernel"


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), platform.machine())


# ---- layers --------------------------------------------------------------------------------------------------------

class GemvBf16(nn.Module):
    """A bf16 nn.Linear without bias: few rows through the kernel (when built), more in the measured dtype."""
    def __init__(self, weight: nn.Parameter, dtype: torch.dtype, gemv: bool):
        super().__init__()
        self.weight, self.dtype, self.gemv = weight, dtype, gemv
        self.f32 = False  # float32 products: install sets it for the output head

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if self.gemv and few_rows(x):
            return torch.ops.fast_decode.gemv_bf16(x, self.weight, self.f32)
        if self.dtype == torch.float32 and self.weight.dtype == torch.bfloat16 and TILE_BYTES:
            y = linear_f32_tiles(x, self.weight)
        else:
            y = F.linear(x.to(self.dtype), self.weight.to(self.dtype))
        return y.to(torch.float32 if self.f32 else x.dtype)


TILE_BYTES = 4 << 20  # fp32 weights converted at a time (0: the whole matrix at once)


def linear_f32_tiles(x: Tensor, w: Tensor) -> Tensor:  # [..., K] x bf16 [N, K] -> [..., N] float32
    """Many rows times a bf16 weight in fp32, the weight converted a tile of rows at a time, so that the GEMM reads
    each converted tile from cache: the whole matrix converted at once went to memory and back, into pages freshly
    mapped (and zeroed) every call (HOW_IT_WORKS.md, "Which kernels, and prefill on a CPU")."""
    x, rows = x.float(), max(1, TILE_BYTES // (4 * w.size(1)))
    return torch.cat([F.linear(x, w[i:i + rows].float()) for i in range(0, w.size(0), rows)], dim=-1)


class GemvInt8(nn.Module):
    """quantize.py's int8 layer (weight int8 [N, K], scales bf16 [N]): few rows through the kernel; more through it
    too where that measured faster (kernel_prefill), else through torch's GEMM in the measured dtype (its own int8
    matmul runs a quarter as fast on AVX2)."""
    def __init__(self, weight: Tensor, scales: Tensor, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.f32 = False
        self.kernel_prefill = False  # many rows through the kernel too: install sets it where that measured faster

    def forward(self, x: Tensor) -> Tensor:
        if few_rows(x) or (self.kernel_prefill and not (torch.is_grad_enabled() and x.requires_grad)):
            return torch.ops.fast_decode.gemv_int8(x, self.weight, self.scales, self.f32)
        # the int8 weight holds its values exactly in either dtype; the scale, per output, applies after the product
        if torch.is_grad_enabled() and x.requires_grad:  # torch's ops, which have a backward
            y = F.linear(x.to(self.dtype), self.weight.to(self.dtype)) * self.scales.to(self.dtype)
        else:  # one op, which a compiled prefill runs as it is (HOW_IT_WORKS.md, "Which kernels, and prefill on a CPU")
            y = torch.ops.fast_decode.gemm_int8(x, self.weight, self.scales, self.dtype)
        return y.to(torch.float32 if self.f32 else x.dtype)


def int4_rows_alone(m: nn.Module) -> bool:
    """Whether an int4 layer's kernel computes each row as it would alone for any number of rows: on AMX's tiles
    (groups of 64 or more); elsewhere for up to 32 rows, more going to a GEMM's tiles."""
    return kernels.endswith("+amx") and "amx_int8" in cpu_flags() and 2 * m.weight.size(1) // m.scales.size(1) >= 64


class GemvInt4(nn.Module):
    """quantize.py's int4 layer in its stored layout (weight uint8 [N, K'/2], scales and zeros bf16 [N, K'/G]):
    few rows through the kernel; more through it too where that measured faster (kernel_prefill), else by
    dequantizing (one pass, in C) to the measured dtype for torch's GEMM."""
    def __init__(self, m: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = m.in_features, m.out_features, dtype
        self.register_buffer("weight", m.weight)
        self.register_buffer("scales", m.scales)
        self.register_buffer("zeros", m.zeros)
        self.f32 = False
        self.kernel_prefill = False  # many rows through the kernel too: install sets it where that measured faster

    def forward(self, x: Tensor) -> Tensor:
        k = 2 * self.weight.size(1)
        x2 = F.pad(x.reshape(-1, x.size(-1)), (0, k - x.size(-1)))  # the weight's zero columns meet zero inputs
        if few_rows(x) or (self.kernel_prefill and not (torch.is_grad_enabled() and x.requires_grad)):
            y = torch.ops.fast_decode.gemv_int4(x2, self.weight, self.scales, self.zeros, self.f32)
        else:
            y = self.dequantized_product(x2).to(torch.float32 if self.f32 else x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_product(self, x: Tensor) -> Tensor:  # [M, K'] -> [M, N] in self.dtype
        """x @ w.T through torch's GEMM, w dequantized about 4 MB of rows at a time: dequantized whole, a full-size
        copy went to fresh pages on every call, where a tile stays in cache and its memory is reused."""
        f32 = self.dtype == torch.float32
        rows = max(64, (4 << 20) // (x.size(-1) * (4 if f32 else 2)) // 64 * 64)
        x = x.to(self.dtype)
        return torch.cat([F.linear(x, torch.ops.fast_decode.dequantize_int4(
            self.weight[n:n + rows], self.scales[n:n + rows], self.zeros[n:n + rows], f32))
            for n in range(0, self.weight.size(0), rows)], dim=-1)


def replacement(m: nn.Module, dtype: torch.dtype) -> Optional[nn.Module]:
    """The layer that takes m's place, or None to leave m. Layers are told apart by their tensors: nn.Linear's
    weight, quantize.py's int8 weight and scales, or its int4 weight, scales and zeros in the stored layout."""
    w = getattr(m, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 2 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    if isinstance(m, nn.Linear) and m.bias is None and w.dtype == torch.bfloat16:
        return GemvBf16(w, dtype, _lib is not None and w.size(1) % 16 == 0)
    if _lib is None:
        return None  # the quantized layers' own paths are torch's kernels already
    scales, zeros = getattr(m, "scales", None), getattr(m, "zeros", None)
    if w.dtype == torch.int8 and isinstance(scales, Tensor) and w.size(1) % 32 == 0 and zeros is None:
        return GemvInt8(w, scales, dtype)
    if w.dtype == torch.uint8 and isinstance(scales, Tensor) and isinstance(zeros, Tensor) and \
            getattr(m, "scales_and_zeros", None) is None:
        groupsize = 2 * w.size(1) // scales.size(1)  # the kernel's 16-bit sums hold a group of at most 256
        if groupsize in (32, 64, 128, 256) and w.size(1) % 32 == 0:  # x is reordered 64 values at a time
            return GemvInt4(m, dtype)
    return None


def install(model: nn.Module, name: Optional[str] = None) -> str:
    """Replace the model's CPU linear layers, in place, by ones that run few-row products on this CPU's kernels
    (or the named set) and prefill in the dtype measured faster here. Returns what was chosen, in words."""
    if name or (_lib is None and _why_not is None):  # once a process, unless a set is named
        load(name)
    shapes = [(m.out_features, m.in_features) for m in model.modules() if hasattr(m, "out_features")]
    dtype = prefill_dtype(*max(shapes, key=lambda s: s[0] * s[1])) if shapes else torch.bfloat16
    if _lib is not None and getattr(model, "cache_type", None) is KVCache:
        model.cache_type = KernelCache  # model.py's caches from here on are attended by the kernels
        if model.max_seq_length:  # one set up before: made again, as this type
            model.setup_caches(model.max_batch_size, model.max_seq_length)
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            new = replacement(child, dtype)
            if new is not None:
                # the output head writes float32 logits: a small model's top two can be closer than a bf16 step
                new.f32 = parent is model and child_name == "output"
                setattr(parent, child_name, new)
    for kind in (GemvInt8, GemvInt4):  # measured on the largest layer of each kind
        layers = [m for m in model.modules() if isinstance(m, kind)]
        faster = bool(layers) and prefill_in_kernel(max(layers, key=lambda m: m.weight.numel()), dtype)
        for m in layers:
            m.kernel_prefill = faster
    return describe(model)


def describe(model: nn.Module) -> str:
    """Which kernels the model's CPU products run on, and the prefill dtype, in words."""
    layers = [m for m in model.modules() if isinstance(m, (GemvBf16, GemvInt8, GemvInt4))]
    gemv = [m for m in layers if getattr(m, "gemv", True)]
    if not layers:
        return "CPU kernels: torch's"
    dtypes = {str(m.dtype)[6:] for m in layers if not getattr(m, "kernel_prefill", False)}
    prefill = [f"prefill in {dtypes.pop()}"] if dtypes else []
    kinds = [kind for kind, c in (("int8", GemvInt8), ("int4", GemvInt4))
             if any(isinstance(m, c) and m.kernel_prefill for m in layers)]
    if kinds:
        prefill.append(f"{' and '.join(kinds)} prefill in the kernels")
    return ", ".join([f"CPU kernels: {kernels if gemv else 'torch'}", *prefill])
