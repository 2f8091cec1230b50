"""Matrix-vector products for decoding on CPUs: y = x @ w.T for x [M, K] of a few rows, with w in bf16, int8 (a
scale per row) or int4 (a scale and zero per group), all as this project stores them, for the instruction set the
CPU has: AVX2+FMA, or AVX-512 (with the BF16 dot product and VNNI where present).

Batch-1 decode is one pass over every weight, so it runs at memory speed only if the multiply keeps up with memory.
torch's CPU kernels do not on AVX2 (no bf16 or int8 dot-product instructions): its bf16 GEMV does about 5 G
weights/s per core even from cache, so two cores read about 19 GB/s where the memory gives ~30. Here: bf16 is
widened to fp32 with one integer unpack (bf16 is the top half of an fp32), or multiplied in pairs by
_mm512_dpbf16_ps; int8 is sign-extended and converted; int4 is never widened: x is rounded to int8 per group and
maddubs or dpbusd multiply 4-bit weights by 8-bit activations. Rows are read front to back, which the
hardware prefetcher follows.

The C++ below is compiled once with g++ for the CPU's instruction set into ~/.cache/fast-decode and called through
ctypes, wrapped as torch ops so that torch.compile keeps them in the graph. install(model) replaces a bf16 model's
linear layers (and quantize.py's int8 and int4 layers, recognised by their tensors) with layers that send products
of few rows here. Products of many rows (prefill) go to torch's GEMM, in bf16 or in fp32, whichever a measurement
on this machine found faster. Without a compiler or a known instruction set, one line on stderr says so and torch's
kernels stay."""
import ctypes
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <vector>

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

// y[i] = v, as bf16, or as fp32 where the caller asked for it (the output head: logits a bf16 step apart tie)
static inline void put(void* y, int64_t i, float v, int64_t f32) {
    if (f32) ((float*)y)[i] = v;
    else ((uint16_t*)y)[i] = to_bf16(v);
}

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
"""

AVX2 = r"""
#include <immintrin.h>

// unpacklo/hi with zeros put each bf16 in the top half of an fp32: elements 0-3, 8-11 and 4-7, 12-15 of 16
static inline __m256 lo(__m256i w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w)); }
static inline __m256 hi(__m256i w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w)); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// one row of w against one row of x (already fp32, in lo/hi order): 8 independent FMA chains, and the row is
// read front to back, which the hardware prefetcher follows even for short rows
static inline float dot(const float* x, const uint16_t* w, int64_t K) {
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
    return hsum(a[0]);
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


// int4 weights, w = (q - 8) * scale + zero per group of G (a multiple of 64) along K, two q per byte (low nibble
// first). x is quantized to int8 per group (x ~ d * xq), so that _mm256_maddubs_epi16 multiplies 32 q by 32 xq and
// adds pairs in one instruction, and a group's products add up in 16-bit lanes (at most 4 x 2 x 2 x 15 x 127 <
// 2^15): the weights are never widened to fp32, which is what lets int4 keep up with memory.
// Per group: sum (q - 8) x ~ d * (sum q xq - 8 sum xq).
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


// y[M, N] = x[M, K] @ w[N, K]^T, all bf16 and contiguous, accumulated in fp32; K a multiple of 16
extern "C" void gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
                          int64_t f32) {
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
        for (int64_t m = 0; m < M; m++) put(y, m * N + n, dot(&xs[m * K], w + n * K, K), f32);
}
"""

DRIVERS = r"""
// the int8 and int4 products over all rows, around each instruction set's dot_i8 and dot_i4
// y[M, N] = x[M, K] @ (w[N, K] * scales[N])^T, x, scales and y bf16, w int8; K a multiple of 8
extern "C" void gemv_int8(const uint16_t* x, const int8_t* w, const uint16_t* scales, void* y,
                          int64_t M, int64_t N, int64_t K, int64_t f32) {
    std::vector<float> xs(M * K);
    for (int64_t i = 0; i < M * K; i++) xs[i] = from_bf16(x[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) put(y, m * N + n, dot_i8(&xs[m * K], w + n * K, K) * from_bf16(scales[n]), f32);
}

// y[M, N] = x[M, K] @ w^T, w given as packed q [N, K / 2], scales and zeros [N, K / G] (bf16)
extern "C" void gemv_int4(const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                          void* y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t f32) {
    std::vector<XQ> xq(M);
    for (int64_t m = 0; m < M; m++) prepare(x + m * K, K, G, xq[m]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            put(y, m * N + n, dot_i4(xq[m], w + n * K / 2, scales + n * (K / G), zeros + n * (K / G), K, G), f32);
}
"""

AVX512 = r"""
#include <immintrin.h>

// bf16. With AVX512-BF16, dpbf16 multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes: x stays bf16
// and the weights are never widened. Without it, a bf16 widened by a 16-bit shift is its fp32 value.
#ifdef __AVX512BF16__
typedef uint16_t xbf16;
static inline __m512 dp(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }

static inline float dot(const uint16_t* x, const uint16_t* w, int64_t K) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)  // 4 chains in flight, the row read front to back
        for (int c = 0; c < 4; c++)
            a[c] = dp(a[c], _mm512_loadu_si512(w + k + 32 * c), _mm512_loadu_si512(x + k + 32 * c));
    for (; k < K; k += 32) {  // K is a multiple of 16: the last step may be half a vector, masked to zeros
        __mmask32 m = K - k >= 32 ? 0xffffffffu : 0xffffu;
        a[0] = dp(a[0], _mm512_maskz_loadu_epi16(m, w + k), _mm512_maskz_loadu_epi16(m, x + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}
#else
typedef float xbf16;
static inline __m512 widen(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline float dot(const float* x, const uint16_t* w, int64_t K) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(widen(w + k + 16 * c), _mm512_loadu_ps(x + k + 16 * c), a[c]);
    for (; k < K; k += 16) a[0] = _mm512_fmadd_ps(widen(w + k), _mm512_loadu_ps(x + k), a[0]);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}
#endif

// y[M, N] = x[M, K] @ w[N, K]^T, all bf16 and contiguous, accumulated in fp32; K a multiple of 16
extern "C" void gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
                          int64_t f32) {
    std::vector<xbf16> xs(M * K);
    for (int64_t i = 0; i < M * K; i++) xs[i] = sizeof(xbf16) == 2 ? x[i] : from_bf16(x[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)  // each weight row is read from memory once, for every row of x
        for (int64_t m = 0; m < M; m++) put(y, m * N + n, dot(&xs[m * K], w + n * K, K), f32);
}

// int8: sign-extended and converted 16 at a time; K a multiple of 8, the last 8 masked
static inline float dot_i8(const float* x, const int8_t* w, int64_t K) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int c = 0; c < 4; c++) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k + 16 * c))));
            a[c] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + k + 16 * c), a[c]);
        }
    for (; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? 0xffff : 0xff;
        __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w + k)));
        a[0] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(m, x + k), a[0]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}


// int4 (see prepare): 256-bit vectors, which measured faster here than 512-bit ones (a group of 64 to 256 weights is
// only 32 to 128 bytes, so wider vectors leave more work per group). With VNNI one dpbusd multiplies 32 unsigned
// nibbles by 32 signed xq and adds them in fours into int32 lanes; without, maddubs adds pairs into 16-bit lanes
// (at most 4 x 2 x 2 x 15 x 127 < 2^15 per group) and one madd per group widens them.
static inline float dot_i4(const XQ& p, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                           int64_t K, int64_t G) {
    const __m256i nib = _mm256_set1_epi8(15);
    __m256 total = _mm256_setzero_ps();
    float rest = 0.f;
    for (int64_t g = 0; g < K / G; g++) {
        __m256i acc = _mm256_setzero_si256();
        for (int64_t k = g * G / 2; k < (g + 1) * G / 2; k += 32) {  // k: bytes, 64 weights per step
            __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
            __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            __m256i xe = _mm256_loadu_si256((const __m256i*)&p.even[k]), xo = _mm256_loadu_si256((const __m256i*)&p.odd[k]);
#ifdef __AVX512VNNI__
            acc = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, xe), hi, xo);
#else
            acc = _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo)));
#endif
        }
#ifndef __AVX512VNNI__
        acc = _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
        float sg = from_bf16(scales[g]);
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(sg * p.d[g]), total);
        rest += from_bf16(zeros[g]) * p.sum[g] - 8.f * sg * p.c[g];
    }
    return _mm512_reduce_add_ps(_mm512_zextps256_ps512(total)) + rest;
}

"""
MAX_ROWS = 32  # products of this many rows or more (prefill) go to torch's GEMM
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fast-decode"


# ---- which kernels this CPU can run ------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them. torch's ATEN_CPU_CAPABILITY=avx2 (or default) hides the newer
    ones here too, so that one setting runs an AVX-512 machine as an AVX2 one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    flags = next((set(l.split(":", 1)[1].split()) for l in lines if l.split(":")[0].strip() in ("flags", "Features")),
                 set())
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability in ("avx2", "default"):
        flags = {f for f in flags if not f.startswith("avx512")} - ({"avx2"} if capability == "default" else set())
    return flags


def targets(flags: set[str]) -> list[tuple[str, str, list[str]]]:
    """(name, source, compiler flags) of every kernel set this CPU runs, the fastest first."""
    out = []
    if AVX512 and {"avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= flags:
        base = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
        extra = [f for f in ("avx512_bf16", "avx512_vnni") if f in flags]
        if extra:  # the plain AVX-512 set too, second: a test can run both
            out.append(("avx512+" + "+".join(f[7:] for f in extra), AVX512,
                        base + ["-m" + f.replace("_", "") for f in extra]))
        out.append(("avx512", AVX512, base))
    if {"avx2", "fma"} <= flags:
        out.append(("avx2", AVX2, ["-mavx2", "-mfma"]))
    return out


def build(source: str, flags: list[str]) -> ctypes.CDLL:
    """The compiled kernels, from the cache when this source was built with these flags before."""
    flags = ["-O3", *flags, "-fopenmp", "-shared", "-fPIC"]
    source = PRELUDE + source + DRIVERS
    lib = CACHE / f"gemv-{hashlib.sha256((source + ' '.join(flags)).encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # build aside, then rename: readers never see half a file
            src = Path(tmp) / "gemv.cpp"
            src.write_text(source)
            subprocess.run([os.environ.get("CXX", "g++"), *flags, str(src), "-o", str(Path(tmp) / "lib.so")],
                           check=True, capture_output=True, text=True)
            os.replace(Path(tmp) / "lib.so", lib)
    dll = ctypes.CDLL(str(lib))
    dll.gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    dll.gemv_int8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    dll.gemv_int4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
    return dll


_lib: Optional[ctypes.CDLL] = None
kernels = "torch"  # what products of few rows run on: a kernel set's name, or torch's own
_why_not = None


def load(name: Optional[str] = None) -> Optional[str]:
    """Build and switch to the CPU's best kernel set (or the one named); its name, or None with one line on stderr
    saying why torch's kernels stay."""
    global _lib, kernels, _why_not
    available = targets(cpu_flags())
    chosen = [t for t in available if name is None or t[0] == name][:1]
    try:
        if not chosen:
            raise RuntimeError(f"no kernels for this CPU ({platform.machine()}: "
                               f"{'no ' + name if name else 'there are kernels for x86 AVX2+FMA and AVX-512 only'})")
        _lib, kernels = build(*chosen[0][1:]), chosen[0][0]
        return kernels
    except FileNotFoundError:
        why = f"no C++ compiler ({os.environ.get('CXX', 'g++')} not found)"
    except subprocess.CalledProcessError as e:
        why = f"the kernels did not build: {(e.stderr or '').strip().splitlines()[-1:] or e.returncode}"
    except (RuntimeError, OSError) as e:
        why = str(e)
    if why != _why_not:  # once per reason, not once per model
        print(f"cpu_gemv: using torch's CPU kernels: {why}", file=sys.stderr)
    _lib, kernels, _why_not = None, "torch", why
    return None


# ---- the kernels as torch ops --------------------------------------------------------------------------------------

# a torch op, so that torch.compile keeps it in the graph; defined with torch.library.Library rather than the
# @custom_op decorator, whose Python wrapper costs about 25 us a call, as much as a small layer's whole product
_ops = torch.library.Library("fast_decode", "DEF")
# f32: write the products in float32 instead of bf16 (the output head: see put() in the kernels)
_ops.define("gemv_bf16(Tensor x, Tensor w, bool f32=False) -> Tensor")
_ops.define("gemv_int8(Tensor x, Tensor w, Tensor scales, bool f32=False) -> Tensor")
_ops.define("gemv_int4(Tensor x, Tensor w, Tensor scales, Tensor zeros, bool f32=False) -> Tensor")


def out(x: Tensor, n: int, f32: bool) -> Tensor:  # [..., n], bf16 or float32
    return x.new_empty(*x.shape[:-1], n, dtype=torch.float32 if f32 else x.dtype)


def gemv_bf16(x: Tensor, w: Tensor, f32: bool = False) -> Tensor:  # x [..., K] bf16, w [N, K] bf16 -> [..., N]
    x = x.contiguous()  # few tensor calls: at 1-2 us each they add up over a small model's ~40 products per step
    y = out(x, w.size(0), f32)
    _lib.gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // w.size(1), *w.shape, f32)
    return y


def gemv_int8(x: Tensor, w: Tensor, scales: Tensor, f32: bool = False) -> Tensor:
    # x [..., K] bf16, w [N, K] int8, scales [N] bf16 -> [..., N]
    x = x.contiguous()
    y = out(x, w.size(0), f32)
    _lib.gemv_int8(x.data_ptr(), w.data_ptr(), scales.data_ptr(), y.data_ptr(), x.numel() // w.size(1), *w.shape,
                   f32)
    return y


def gemv_int4(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor, f32: bool = False) -> Tensor:
    # x [..., K'] bf16, w [N, K'/2] uint8 (two q per byte), scales and zeros [N, K'/G] bf16 -> [..., N]
    x = x.contiguous()
    k = 2 * w.size(1)
    y = out(x, w.size(0), f32)
    _lib.gemv_int4(x.data_ptr(), w.data_ptr(), scales.data_ptr(), zeros.data_ptr(), y.data_ptr(), x.numel() // k,
                   w.size(0), k, k // scales.size(1), f32)
    return y


_ops.impl("gemv_bf16", gemv_bf16, "CPU")
_ops.impl("gemv_int4", gemv_int4, "CPU")
_ops.impl("gemv_int8", gemv_int8, "CPU")


@torch.library.register_fake("fast_decode::gemv_bf16")
def _(x: Tensor, w: Tensor, f32: bool = False) -> Tensor:
    return out(x, w.size(0), f32)


@torch.library.register_fake("fast_decode::gemv_int8")
def _(x: Tensor, w: Tensor, scales: Tensor, f32: bool = False) -> Tensor:
    return out(x, w.size(0), f32)


@torch.library.register_fake("fast_decode::gemv_int4")
def _(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor, f32: bool = False) -> Tensor:
    return out(x, w.size(0), f32)


def few_rows(x: Tensor) -> bool:  # decode, verification, short prompts; inference only: the ops have no backward
    return x.numel() < MAX_ROWS * x.size(-1) and not (torch.is_grad_enabled() and x.requires_grad)


# ---- prefill: bf16 or fp32, measured -------------------------------------------------------------------------------

def prefill_dtype(n: int, k: int) -> torch.dtype:
    """The faster dtype here for a product of MAX_ROWS rows with a bf16 [n, k] weight: bf16, or fp32 with the
    weight converted on the fly. CPUs without bf16 matrix instructions run torch's bf16 GEMM at about 1 GFLOP/s
    against 100+ in fp32; with them bf16 wins. Timed once per machine, torch and shape, cached beside the kernels."""
    key = f"{cpu_name()}, torch {torch.__version__}, " \
          f"{torch.get_num_threads()} threads, {n}x{k}"
    path = CACHE / "prefill_dtype.json"
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):
        verdicts = {}
    if key not in verdicts:
        x, w = torch.randn(MAX_ROWS, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            times = []
            for _ in range(3):  # the first run warms up; a slow bf16 GEMM takes about a second at most
                t0 = time.perf_counter()
                F.linear(x.to(dtype), w.to(dtype))
                times.append(time.perf_counter() - t0)
            seconds[str(dtype)[6:]] = min(times[1:])
        verdicts[key] = min(seconds, key=seconds.get)
        try:
            CACHE.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(verdicts, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs the measurement next time
    return getattr(torch, verdicts[key])


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
        return F.linear(x.to(self.dtype), self.weight.to(self.dtype)).to(torch.float32 if self.f32 else x.dtype)


class GemvInt8(nn.Module):
    """quantize.py's int8 layer (weight int8 [N, K], scales bf16 [N]): few rows through the kernel, more through
    torch's int8 matmul, which reads the int8 weight directly."""
    def __init__(self, weight: Tensor, scales: Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.f32 = False

    def forward(self, x: Tensor) -> Tensor:
        if few_rows(x):
            return torch.ops.fast_decode.gemv_int8(x, self.weight, self.scales, self.f32)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.size(-1)), self.weight, self.scales)
        return y.view(*x.shape[:-1], self.weight.size(0)).to(torch.float32 if self.f32 else x.dtype)


class GemvInt4(nn.Module):
    """quantize.py's int4 layer in its stored layout (weight uint8 [N, K'/2], scales and zeros bf16 [N, K'/G]):
    few rows through the kernel, more by dequantizing to the measured dtype, w = (q - 8) * scale + zero."""
    def __init__(self, m: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = m.in_features, m.out_features, dtype
        self.register_buffer("weight", m.weight)
        self.register_buffer("scales", m.scales)
        self.register_buffer("zeros", m.zeros)
        self.f32 = False

    def forward(self, x: Tensor) -> Tensor:
        k = 2 * self.weight.size(1)
        x2 = F.pad(x.reshape(-1, x.size(-1)), (0, k - x.size(-1)))  # the weight's zero columns meet zero inputs
        if few_rows(x):
            y = torch.ops.fast_decode.gemv_int4(x2, self.weight, self.scales, self.zeros, self.f32)
        else:
            q = torch.stack([self.weight & 15, self.weight >> 4], -1).view(self.out_features, -1, k // self.scales.size(1))
            w = ((q.to(self.dtype) - 8) * self.scales[..., None].to(self.dtype) + self.zeros[..., None].to(self.dtype))
            y = F.linear(x2.to(self.dtype), w.flatten(1)).to(torch.float32 if self.f32 else x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


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
    if w.dtype == torch.int8 and isinstance(scales, Tensor) and w.size(1) % 8 == 0 and zeros is None:
        return GemvInt8(w, scales)
    if w.dtype == torch.uint8 and isinstance(scales, Tensor) and isinstance(zeros, Tensor) and \
            getattr(m, "scales_and_zeros", None) is None:
        groupsize = 2 * w.size(1) // scales.size(1)  # the kernel's 16-bit sums hold a group of at most 256
        if groupsize % 64 == 0 and groupsize <= 256:
            return GemvInt4(m, dtype)
    return None


def install(model: nn.Module, name: Optional[str] = None) -> str:
    """Replace the model's CPU linear layers, in place, by ones that run few-row products on this CPU's kernels
    (or the named set) and prefill in the dtype measured faster here. Returns what was chosen, in words."""
    if name or (_lib is None and _why_not is None):  # once a process, unless a set is named
        load(name)
    shapes = [(m.out_features, m.in_features) for m in model.modules() if hasattr(m, "out_features")]
    dtype = prefill_dtype(*max(shapes, key=lambda s: s[0] * s[1])) if shapes else torch.bfloat16
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            new = replacement(child, dtype)
            if new is not None:
                # the output head writes float32 logits: a small model's top two can be closer than a bf16 step
                new.f32 = parent is model and child_name == "output"
                setattr(parent, child_name, new)
    return describe(model)


def describe(model: nn.Module) -> str:
    """Which kernels the model's CPU products run on, and the prefill dtype, in words."""
    layers = [m for m in model.modules() if isinstance(m, (GemvBf16, GemvInt8, GemvInt4))]
    gemv = [m for m in layers if getattr(m, "gemv", True)]
    if not layers:
        return "CPU kernels: torch's"
    dtypes = {str(m.dtype)[6:] for m in layers if hasattr(m, "dtype")}
    return f"CPU kernels: {kernels if gemv else 'torch'}" + (f", prefill in {dtypes.pop()}" if dtypes else "")
