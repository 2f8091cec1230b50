"""A bf16 matrix-vector product for x86 CPUs with AVX2, for decoding: y = x @ w.T with x [M, K] of a few rows.

Batch-1 decode is one pass over every weight, so it can run at memory speed only if the multiply keeps up with
memory. torch's bf16 GEMV on AVX2 (no bf16 instructions) does about 5 G weights/s per core, even with the weights
in cache: two cores then read about 19 GB/s, well short of what the memory delivers. This kernel widens bf16 to
fp32 with one integer unpack (bf16 is the top half of an fp32) and keeps eight FMA chains in flight, so it is
bound by memory instead: about 30 GB/s of weights on the development machine against torch's 16-20.

The C++ below is compiled once with g++ into ~/.cache/fast-decode and called through ctypes, wrapped as a torch
custom op so that torch.compile keeps it in the graph. install() plugs it into model.Linear; without g++ or AVX2,
install() returns False and model.Linear keeps torch's kernel."""
import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <vector>

// unpacklo/hi with zeros put each bf16 in the top half of an fp32: elements 0-3, 8-11 and 4-7, 12-15 of 16
static inline __m256 lo(__m256i w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w)); }
static inline __m256 hi(__m256i w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w)); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does; NaN stays NaN
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

// one row of w against one row of x (already fp32, in lo/hi order): 8 independent FMA chains, and the row is
// read front to back, which the hardware prefetcher follows even for short rows
static inline uint16_t dot(const float* x, const uint16_t* w, int64_t K) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(w + k + 16 * c));
            a[2 * c] = _mm256_fmadd_ps(lo(v), _mm256_loadu_ps(x + k + 16 * c), a[2 * c]);
            a[2 * c + 1] = _mm256_fmadd_ps(hi(v), _mm256_loadu_ps(x + k + 16 * c + 8), a[2 * c + 1]);
        }
    for (; k < K; k += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
        a[0] = _mm256_fmadd_ps(lo(v), _mm256_loadu_ps(x + k), a[0]);
        a[1] = _mm256_fmadd_ps(hi(v), _mm256_loadu_ps(x + k + 8), a[1]);
    }
    for (int i = 1; i < 8; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    return to_bf16(hsum(a[0]));
}

// the same for int8 weights, x in plain order: a sign-extending load and a conversion per 8 weights
static inline float dot_i8(const float* x, const int8_t* w, int64_t K) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int c = 0; c < 8; c++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + k + 8 * c))));
            a[c] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + k + 8 * c), a[c]);
        }
    for (; k < K; k += 8) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + k))));
        a[0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + k), a[0]);
    }
    for (int i = 1; i < 8; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    return hsum(a[0]);
}

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

// y[M, N] = x[M, K] @ (w[N, K] * scales[N])^T, x, scales and y bf16, w int8; K a multiple of 8
extern "C" void gemv_int8(const uint16_t* x, const int8_t* w, const uint16_t* scales, uint16_t* y,
                          int64_t M, int64_t N, int64_t K) {
    std::vector<float> xs(M * K);
    for (int64_t i = 0; i < M * K; i++) xs[i] = from_bf16(x[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = to_bf16(dot_i8(&xs[m * K], w + n * K, K) * from_bf16(scales[n]));
}

// y[M, N] = x[M, K] @ w[N, K]^T, all bf16 and contiguous, accumulated in fp32; K a multiple of 16
extern "C" void gemv_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K) {
    std::vector<float> xs(M * K);  // x in fp32 once, in the order lo() and hi() produce the weights
    for (int64_t i = 0; i < M * K; i += 16)
        for (int j = 0; j < 8; j++) {
            uint32_t l = x[i + (j < 4 ? j : j + 4)], h = x[i + (j < 4 ? j + 4 : j + 8)];
            l <<= 16; h <<= 16;
            __builtin_memcpy(&xs[i + j], &l, 4);
            __builtin_memcpy(&xs[i + 8 + j], &h, 4);
        }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)  // each weight row is read from memory once, for every row of x
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot(&xs[m * K], w + n * K, K);
}
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 32  # model.Linear multiplies 32 or more rows in fp32 with torch's GEMM instead


def build() -> Optional[ctypes.CDLL]:
    """The compiled kernel, from the cache when this source was built before; None without AVX2 or g++."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fast-decode"
    lib = cache / f"gemv_bf16-{hashlib.sha256((SOURCE + ' '.join(FLAGS)).encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: readers never see half a file
                src = Path(tmp) / "gemv_bf16.cpp"
                src.write_text(SOURCE)
                subprocess.run([os.environ.get("CXX", "g++"), *FLAGS, str(src), "-o", str(Path(tmp) / "lib.so")],
                               check=True, capture_output=True)
                os.replace(Path(tmp) / "lib.so", lib)
        except (OSError, subprocess.CalledProcessError):
            return None
    dll = ctypes.CDLL(str(lib))
    dll.gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    dll.gemv_int8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    return dll


_lib: Optional[ctypes.CDLL] = None
# a torch op, so that torch.compile keeps it in the graph; defined with torch.library.Library rather than the
# @custom_op decorator, whose Python wrapper costs about 25 us a call, as much as a small layer's whole product
_ops = torch.library.Library("fast_decode", "DEF")
_ops.define("gemv_bf16(Tensor x, Tensor w) -> Tensor")
_ops.define("gemv_int8(Tensor x, Tensor w, Tensor scales) -> Tensor")


def gemv_bf16(x: Tensor, w: Tensor) -> Tensor:  # x [..., K] bf16, w [N, K] bf16, contiguous -> [..., N] bf16
    x = x.contiguous()  # few tensor calls: at 1-2 us each they add up over a small model's ~40 products per step
    y = x.new_empty(*x.shape[:-1], w.size(0))
    _lib.gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // w.size(1), *w.shape)
    return y


def gemv_int8(x: Tensor, w: Tensor, scales: Tensor) -> Tensor:  # x [..., K] bf16, w [N, K] int8, scales [N] bf16
    x = x.contiguous()
    y = x.new_empty(*x.shape[:-1], w.size(0))
    _lib.gemv_int8(x.data_ptr(), w.data_ptr(), scales.data_ptr(), y.data_ptr(), x.numel() // w.size(1), *w.shape)
    return y


_ops.impl("gemv_bf16", gemv_bf16, "CPU")
_ops.impl("gemv_int8", gemv_int8, "CPU")


@torch.library.register_fake("fast_decode::gemv_bf16")
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.size(0))


@torch.library.register_fake("fast_decode::gemv_int8")
def _(x: Tensor, w: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.size(0))


def linear(x: Tensor, w: Tensor) -> Optional[Tensor]:  # x [..., K], w [N, K] -> [..., N], or None: not ours
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.size(1) % 16 or not w.is_contiguous() or \
            x.numel() >= MAX_ROWS * x.size(-1) or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None  # inference only: the op has no backward
    return torch.ops.fast_decode.gemv_bf16(x, w)


def linear_int8(x: Tensor, w: Tensor, scales: Tensor) -> Optional[Tensor]:  # the same for quantize.Int8Linear
    if x.dtype != torch.bfloat16 or scales.dtype != torch.bfloat16 or w.size(1) % 8 or x.numel() >= MAX_ROWS * x.size(-1):
        return None
    return torch.ops.fast_decode.gemv_int8(x, w, scales)


def install() -> bool:
    """Route the few-row bf16 and int8 CPU products of model.Linear and quantize.Int8Linear through these kernels;
    False (and no change) if they are unavailable."""
    global _lib
    import model
    import quantize
    _lib = _lib or build()
    if _lib is not None:
        model.Linear.gemv, quantize.Int8Linear.gemv = linear, linear_int8
    return _lib is not None
