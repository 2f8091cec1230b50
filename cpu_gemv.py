"""Matrix-vector products for decoding on x86 CPUs with AVX2: y = x @ w.T for x [M, K] of a few rows, with w in
bf16, int8 (a scale per row) or int4 (a scale and zero per group), all as this project stores them.

Batch-1 decode is one pass over every weight, so it runs at memory speed only if the multiply keeps up with memory.
torch's CPU kernels do not on AVX2 (no bf16 or int8 dot-product instructions): its bf16 GEMV does about 5 G
weights/s per core even from cache, so two cores read about 19 GB/s where the memory gives ~30. Here: bf16 is
widened to fp32 with one integer unpack (bf16 is the top half of an fp32) and eight FMA chains stay in flight;
int8 is sign-extended and converted; int4 is never widened: x is rounded to int8 per group and maddubs multiplies
32 pairs per instruction. Rows are read front to back, which the hardware prefetcher follows.

The C++ below is compiled once with g++ into ~/.cache/fast-decode and called through ctypes, wrapped as torch ops
so that torch.compile keeps them in the graph. install() plugs them into model.Linear and quantize's layers;
without g++ or AVX2 it returns False and torch's kernels stay."""
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
#include <math.h>
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

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
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

// y[M, N] = x[M, K] @ (w[N, K] * scales[N])^T, x, scales and y bf16, w int8; K a multiple of 8
extern "C" void gemv_int8(const uint16_t* x, const int8_t* w, const uint16_t* scales, uint16_t* y,
                          int64_t M, int64_t N, int64_t K) {
    std::vector<float> xs(M * K);
    for (int64_t i = 0; i < M * K; i++) xs[i] = from_bf16(x[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = to_bf16(dot_i8(&xs[m * K], w + n * K, K) * from_bf16(scales[n]));
}

// int4 weights, w = (q - 8) * scale + zero per group of G (a multiple of 64) along K, two q per byte (low nibble
// first). x is quantized to int8 per group (x ~ d * xq), so that _mm256_maddubs_epi16 multiplies 32 q by 32 xq and
// adds pairs in one instruction, and a group's products add up in 16-bit lanes (at most 4 x 2 x 2 x 15 x 127 <
// 2^15): the weights are never widened to fp32, which is what lets int4 keep up with memory.
// Per group: sum (q - 8) x ~ d * (sum q xq - 8 sum xq).
struct XQ {  // one row of x, prepared for the int4 product
    std::vector<int8_t> even, odd;  // xq at the positions of the low and high nibbles: [K / 2] each
    std::vector<float> d, c, sum;   // per group: the scale d, d * sum xq, and sum x
};

static void prepare(const uint16_t* x, int64_t K, int64_t G, XQ& p) {
    p.even.resize(K / 2); p.odd.resize(K / 2); p.d.resize(K / G); p.c.resize(K / G); p.sum.resize(K / G);
    std::vector<float> v(G);
    for (int64_t g = 0; g < K / G; g++) {
        float amax = 0.f, sum = 0.f;
        for (int64_t j = 0; j < G; j++) {
            v[j] = from_bf16(x[g * G + j]);
            amax = fmaxf(amax, fabsf(v[j]));
            sum += v[j];
        }
        float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int xs = 0;
        for (int64_t j = 0; j < G; j++) {  // element k is in byte k / 2 of the row, low nibble if k is even
            int q = (int)lrintf(v[j] * inv);
            xs += q;
            ((g * G + j) % 2 ? p.odd : p.even)[(g * G + j) / 2] = (int8_t)q;
        }
        p.d[g] = d; p.c[g] = d * xs; p.sum[g] = sum;
    }
}

static inline float dot_i4(const XQ& p, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                           int64_t K, int64_t G) {
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 total = _mm256_setzero_ps();
    float rest = 0.f;
    for (int64_t g = 0; g < K / G; g++) {
        __m256i acc = _mm256_setzero_si256();
        for (int64_t k = g * G / 2; k < (g + 1) * G / 2; k += 32) {  // k: bytes, 64 weights per step
            __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
            __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)&p.even[k])));
            acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)&p.odd[k])));
        }
        float sg = from_bf16(scales[g]);
        __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc, ones));
        total = _mm256_fmadd_ps(f, _mm256_set1_ps(sg * p.d[g]), total);
        rest += from_bf16(zeros[g]) * p.sum[g] - 8.f * sg * p.c[g];
    }
    return hsum(total) + rest;
}

// y[M, N] = x[M, K] @ w^T, w given as packed q [N, K / 2], scales and zeros [N, K / G] (bf16)
extern "C" void gemv_int4(const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                          uint16_t* y, int64_t M, int64_t N, int64_t K, int64_t G) {
    std::vector<XQ> xq(M);
    for (int64_t m = 0; m < M; m++) prepare(x + m * K, K, G, xq[m]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = to_bf16(dot_i4(xq[m], w + n * K / 2, scales + n * (K / G), zeros + n * (K / G), K, G));
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
    dll.gemv_int4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
    return dll


_lib: Optional[ctypes.CDLL] = None
# a torch op, so that torch.compile keeps it in the graph; defined with torch.library.Library rather than the
# @custom_op decorator, whose Python wrapper costs about 25 us a call, as much as a small layer's whole product
_ops = torch.library.Library("fast_decode", "DEF")
_ops.define("gemv_bf16(Tensor x, Tensor w) -> Tensor")
_ops.define("gemv_int8(Tensor x, Tensor w, Tensor scales) -> Tensor")
_ops.define("gemv_int4(Tensor x, Tensor w, Tensor scales, Tensor zeros) -> Tensor")


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


def gemv_int4(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    # x [..., K'] bf16, w [N, K'/2] uint8 (two q per byte), scales and zeros [N, K'/G] bf16 -> [..., N] bf16
    x = x.contiguous()
    k = 2 * w.size(1)
    y = x.new_empty(*x.shape[:-1], w.size(0))
    _lib.gemv_int4(x.data_ptr(), w.data_ptr(), scales.data_ptr(), zeros.data_ptr(), y.data_ptr(), x.numel() // k,
                   w.size(0), k, k // scales.size(1))
    return y


_ops.impl("gemv_bf16", gemv_bf16, "CPU")
_ops.impl("gemv_int4", gemv_int4, "CPU")
_ops.impl("gemv_int8", gemv_int8, "CPU")


@torch.library.register_fake("fast_decode::gemv_bf16")
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.size(0))


@torch.library.register_fake("fast_decode::gemv_int8")
def _(x: Tensor, w: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.size(0))


@torch.library.register_fake("fast_decode::gemv_int4")
def _(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.size(0))


def linear(x: Tensor, w: Tensor) -> Optional[Tensor]:  # x [..., K], w [N, K] -> [..., N], or None: not ours
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.size(1) % 16 or not w.is_contiguous() or \
            x.numel() >= MAX_ROWS * x.size(-1) or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None  # inference only: the op has no backward
    return torch.ops.fast_decode.gemv_bf16(x, w)


def linear_int8(x: Tensor, w: Tensor, scales: Tensor) -> Optional[Tensor]:  # the same for quantize.Int8Linear
    if x.dtype != torch.bfloat16 or scales.dtype != torch.bfloat16 or w.size(1) % 8 or \
            not (w.is_contiguous() and scales.is_contiguous()) or x.numel() >= MAX_ROWS * x.size(-1):
        return None
    return torch.ops.fast_decode.gemv_int8(x, w, scales)


def linear_int4(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor) -> Optional[Tensor]:  # for quantize.Int4Linear
    groupsize = 2 * w.size(1) // scales.size(1)  # 16-bit sums hold a group of at most 256
    if x.dtype != torch.bfloat16 or groupsize % 64 or groupsize > 256 or x.numel() >= MAX_ROWS * x.size(-1) or \
            not (w.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        return None
    return torch.ops.fast_decode.gemv_int4(x, w, scales, zeros)


def install() -> bool:
    """Route the few-row bf16, int8 and int4 CPU products of model.Linear and quantize's Int8Linear and Int4Linear
    through these kernels; False (and no change) if they are unavailable."""
    global _lib
    import model
    import quantize
    _lib = _lib or build()
    if _lib is not None:
        model.Linear.gemv, quantize.Int8Linear.gemv, quantize.Int4Linear.gemv = linear, linear_int8, linear_int4
    return _lib is not None
