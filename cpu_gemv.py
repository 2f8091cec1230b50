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

The C++ below is compiled once with g++ for the CPU's instruction set into ~/.cache/fast-decode, and reached
through torch ops written in C++ (GLUE, built against this torch), so that torch.compile keeps them in the graph
and calls them with no Python in between. install(model) replaces a bf16 model's linear layers (and quantize.py's
int8 and int4 layers, recognised by their tensors) with layers that send products of few rows here, and joins each
feed-forward's gate and up layers into one product; model.py's attention for a few query rows (decode) runs here
too, over a bf16 KV cache or an int8 one. Products of many rows (prefill) go to torch's GEMM, in bf16 or in fp32,
whichever a measurement on this machine found faster; those of int8 and int4 layers to their kernel instead, in
tiles, where that measured faster still. Without a compiler or a known instruction set, one line on
stderr says so and torch's kernels stay."""
import ctypes
import hashlib
import json
import logging
import os
import platform
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

from model import FeedForward, GateUp, dequantize_rows

PRELUDE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <atomic>
#include <new>
#include <omp.h>
#include <vector>

// Scratch on 64-byte boundaries: malloc promises 16, and a 32-byte load that straddles two cache lines costs two.
// With the vectors wherever malloc put them, the attention at 4k ran 7-17% slower in some processes than others.
template <typename T> struct Aligned64 {
    typedef T value_type;
    Aligned64() = default;
    template <typename U> Aligned64(const Aligned64<U>&) {}
    T* allocate(size_t n) { return (T*)::operator new(n * sizeof(T), std::align_val_t(64)); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    bool operator==(const Aligned64&) const { return true; }
};
template <typename T> using vec = std::vector<T, Aligned64<T>>;

enum { CHUNK_BYTES = 65536 };  // share_rows' chunk: 32 KB and 128 KB were no faster (1.1B int4 step, Zen 3)
struct alignas(64) Range { std::atomic<uint64_t> v; };  // front << 32 | back, in units

// the ranges of n units for nt threads (kept between calls: a product runs every step)
static std::vector<Range>& split_ranges(int64_t n, int nt) {
    static thread_local std::vector<Range> ranges;
    if ((int)ranges.size() < nt) ranges = std::vector<Range>(nt);
    for (int t = 0; t < nt; t++) ranges[t].v.store((uint64_t)(n * t / nt) << 32 | (uint64_t)(n * (t + 1) / nt));
    return ranges;
}

// Inside a parallel region of nt threads: this thread's share of the ranges' units, chunk at a time (see share_rows)
template <typename F>
static void take_shared(std::vector<Range>& ranges, int nt, int64_t chunk, F&& body) {
    for (int i = 0; i < nt; i++) {
        const bool own = i == 0;
        std::atomic<uint64_t>& r = ranges[(omp_get_thread_num() + i) % nt].v;
        for (uint64_t v = r.load(std::memory_order_relaxed);;) {
            const int64_t lo = v >> 32, hi = v & 0xffffffffu, take = chunk < hi - lo ? chunk : hi - lo;
            if (lo >= hi) break;
            const uint64_t next = own ? (uint64_t)(lo + take) << 32 | hi : (uint64_t)lo << 32 | (hi - take);
            if (!r.compare_exchange_weak(v, next, std::memory_order_relaxed)) continue;
            if (own) body(lo, lo + take);
            else body(hi - take, hi);
            v = r.load(std::memory_order_relaxed);
        }
    }
}

// body(a, b) for units [a, b) of [0, n), shared by the team: each thread owns one contiguous range, which it takes
// from the front a chunk (of about `bytes`, at unit_bytes a unit) at a time, and once it runs out it takes chunks
// from the back of the others' ranges. So every thread streams its own rows front to back, as a static split does,
// and a thread the machine slows down is helped instead of waited for: with two halves, one thread finished 15% of
// a product's time before the other, on average, either one (int4, 1.1B, Zen 3 VM).
template <typename F>
static void share_rows(int64_t n, int64_t unit_bytes, int64_t bytes, F&& body) {
    const int nt = omp_get_max_threads();
    const int64_t chunk = bytes / unit_bytes > 1 ? bytes / unit_bytes : 1;
    if (nt == 1 || n <= chunk) return body(0, n);
    std::vector<Range>& ranges = split_ranges(n, nt);  // (a reference: in the region a thread_local is each thread's)
    #pragma omp parallel num_threads(nt)
    take_shared(ranges, nt, chunk, body);
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

// AVX2 helpers, which both kernel sets use
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// unpacklo/hi with zeros put each bf16 in the top half of an fp32: elements 0-3, 8-11 and 4-7, 12-15 of 16
static inline __m256 lo(__m256i w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w)); }
static inline __m256 hi(__m256i w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w)); }

// the weights AHEAD bytes ahead of p (by default), asked for now: with the hardware prefetcher alone a core's one
// stream of rows read 10-15% slower (measured on the bf16 product). Called once per 64 bytes read, or per 32.
// Non-temporal: weights read once a step then only push out what is used again (activations, the cache, the
// runtime's own data); decoding ran 7% (bf16), 5% (int8) and 3-5% (int4) faster than with the T0 hint, on a Zen 3
// CPU. How far ahead is bandwidth times latency: on a Zen 3 (AVX2, ~15 GB/s a core) 1 KB, 2 KB for int4 and int8
// (AHEAD4: the 1.1B int8 step took 0.92-0.98x the time it took 1 KB ahead, in runs alternating the two in both
// orders; 3 and 4 KB were no faster); on a Zen 5 (AVX-512, ~40 GB/s a core) 8 KB: the int8 product read 26% faster
// than 1 KB ahead (12 or 16 KB: no faster), and int4 3-11% faster than 4 KB ahead in minutes when memory was fast
// (0-4% slower when it was slow; decoding 1.13x faster in all). (Its bf16 product reads fastest from the hardware
// prefetcher alone.) On a Zen 4 (AVX-512, 32 KB of L1, one 512-bit load a cycle) the int8 and int4 products are
// short of loads, and a prefetch takes one: with it they ran at 0.86x their speed from L2, and from memory the 1.1B
// shape's products read 1.14x (int8) and 1.2x (int4) as fast from the hardware prefetcher alone (no distance or
// hint, T0 to NTA, 256 B to 32 KB, did better), its decode step 1.04x and 1.06x as fast with memory slow. With memory
// fast too: asked for 2 KB (NTA), 4 KB (T0) or 8 KB (NTA) ahead, TinyLlama's int4 products read 0.82-0.89x as fast
// (99 rounds with the read probe over 45 GB/s; 0.90-0.95x in 401 slower ones). So AHEAD_WEIGHTS 0 turns ahead() off
// there (cpu_gemv.targets: cores with less than 48 KB of L1, as for KV_HINT).
#ifdef __AVX512F__
enum { AHEAD = 8192, AHEAD4 = 8192 };
#else
enum { AHEAD = 1024, AHEAD4 = 2048 };
#endif
#ifndef AHEAD_WEIGHTS
#define AHEAD_WEIGHTS 1
#endif
static inline void ahead(const void* p, int bytes = AHEAD) {
    if (AHEAD_WEIGHTS) _mm_prefetch((const char*)p + bytes, _MM_HINT_NTA);
}

// 8 fp32 -> 8 bf16, rounded to nearest even as to_bf16() does (NaN stays NaN): the 16 bits in each 32-bit lane
static inline __m256i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
static inline __m128i to_bf16x8(__m256 v) {  // packed
    const __m256i b = bf16_bits(v);
    return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

static inline __m256 widen8(__m128i b) {  // 8 bf16 -> 8 fp32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
static inline __m256 widen8(const uint16_t* p) { return widen8(_mm_loadu_si128((const __m128i*)p)); }

// y[i] = v, as bf16, or as fp32 where the caller asked for it (the output head: logits a bf16 step apart tie)
static inline void put(void* y, int64_t i, float v, int64_t f32) {
    if (f32) ((float*)y)[i] = v;
    else ((uint16_t*)y)[i] = to_bf16(v);
}
"""

AVX2 = r"""

// one row of w against one row of x (already fp32, in lo/hi order): 8 independent FMA chains, and the row is
// read front to back, which the hardware prefetcher follows even for short rows
static inline float dot(const float* x, const uint16_t* w, int64_t K) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        ahead(w + k), ahead(w + k + 32);
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(w + k + 16 * c));
            a[2 * c] = _mm256_fmadd_ps(lo(v), _mm256_loadu_ps(x + k + 16 * c), a[2 * c]);
            a[2 * c + 1] = _mm256_fmadd_ps(hi(v), _mm256_loadu_ps(x + k + 16 * c + 8), a[2 * c + 1]);
        }
    }
    for (; k < K; k += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(w + k));
        a[0] = _mm256_fmadd_ps(lo(v), _mm256_loadu_ps(x + k), a[0]);
        a[1] = _mm256_fmadd_ps(hi(v), _mm256_loadu_ps(x + k + 8), a[1]);
    }
    for (int i = 1; i < 8; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    return hsum8(a[0]);
}

// y[M, N] = x[M, K] @ w[N, K]^T, all bf16 and contiguous, accumulated in fp32; K a multiple of 16
extern "C" void gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
                          int64_t f32) {
    static thread_local vec<float> xs_;  // x in fp32 once, in the order lo() and hi() produce the weights
    vec<float>& xs = xs_;
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; i += 16)
        for (int j = 0; j < 8; j++) {
            uint32_t l = x[i + (j < 4 ? j : j + 4)], h = x[i + (j < 4 ? j + 4 : j + 8)];
            l <<= 16; h <<= 16;
            __builtin_memcpy(&xs[i + j], &l, 4);
            __builtin_memcpy(&xs[i + 8 + j], &h, 4);
        }
    share_rows(N, 2 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n = a; n < b; n++)  // each weight row is read from memory once, for every row of x
            for (int64_t m = 0; m < M; m++) put(y, m * N + n, dot(&xs[m * K], w + n * K, K), f32);
    });
}
"""

QUANTIZED = r"""
// The int8 and int4 products, for both instruction sets (AVX2 instructions, and VNNI's dpbusd where present). x is
// rounded to int8 per block (int8: 32 values; int4: the weights' group), x ~ d * xq, so that a block's products are
// integer multiply-adds: 32 at a time by maddubs (or dpbusd) instead of 8 float FMAs after widening each weight.
// That is what lets the quantized products keep up with memory; the rounding costs about 0.5% per product.

struct XQ {  // one row of x rounded to int8 per block of B: xq, and per block the scale d, d * sum xq, and sum x
    vec<int8_t> q;
    vec<float> d, c, sum;
};
// kept from call to call: five allocations a product cost 1.4% of a 1.1B int4 decode step (Zen 5, 1.2% int8)
static thread_local std::vector<XQ> xq_;

// 32 int32 in 4 vectors -> 32 int8 in the same order: the packs work within 128-bit lanes, the permute undoes that
static inline __m256i pack32(const __m256i q[4]) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 64 int8 at p, in place: the 32 at even positions first, then the 32 at odd ones
static inline void even_odd(int8_t* p) {
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i h[2];
    for (int i = 0; i < 2; i++)  // each half as [its evens, its odds]
        h[i] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(p + 32 * i)), split),
                                        0xd8);
    _mm256_storeu_si256((__m256i*)p, _mm256_permute2x128_si256(h[0], h[1], 0x20));
    _mm256_storeu_si256((__m256i*)(p + 32), _mm256_permute2x128_si256(h[0], h[1], 0x31));
}

// span (int4): within every span of 64 values (K a multiple of 64), the 32 at even positions first, then the 32 at
// odd ones, which is where a 32-byte load of packed weights finds them (its low nibbles, then its high ones); span
// 128 (K a multiple of 128) likewise for a 64-byte load. d, c and sum have zeros after the last block, up to a
// multiple of 8 blocks.
static void prepare(const uint16_t* x, int64_t K, int64_t B, int span, XQ& p) {
    const int64_t b8 = (K / B + 7) / 8 * 8;
    p.q.resize(K); p.d.assign(b8, 0.f); p.c.assign(b8, 0.f); p.sum.assign(b8, 0.f);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < K / B; b++) {
        const uint16_t* xb = x + b * B;
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < B; j += 8) {
            __m256 v = widen8(xb + j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
            sum = _mm256_add_ps(sum, v);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        float d = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        __m256i qsum = _mm256_setzero_si256();
        for (int64_t j = 0; j < B; j += 32) {  // rounded to nearest even, as lrintf does
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(widen8(xb + j + 8 * i), _mm256_set1_ps(inv)));
                qsum = _mm256_add_epi32(qsum, q[i]);
            }
            _mm256_storeu_si256((__m256i*)&p.q[b * B + j], pack32(q));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        p.d[b] = d; p.c[b] = d * _mm_cvtsi128_si32(s4); p.sum[b] = hsum8(sum);
    }
    if (span)  // by 64 whatever the block: a 32-byte load of weights holds 64 of them (two groups of 32)
        for (int64_t j = 0; j < K; j += 64) even_odd(&p.q[j]);
    if (span == 128)  // [evens, odds, evens, odds] by 32 -> [evens, odds] by 64: the middle two swap (a last 64
        for (int64_t j = 0; j + 128 <= K; j += 128) {  // stay in 64's order)
            __m256i a = _mm256_loadu_si256((const __m256i*)&p.q[j + 32]);
            _mm256_storeu_si256((__m256i*)&p.q[j + 32], _mm256_loadu_si256((const __m256i*)&p.q[j + 64]));
            _mm256_storeu_si256((__m256i*)&p.q[j + 64], a);
        }
}

// 8 vectors -> one: lane t is the sum of a[t]'s lanes
static inline __m256 sum8x8(const __m256* a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline __m256i sum8x8_i32(const __m256i* a) {
    __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
    __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
    __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                            _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WIDE 1  // 512-bit steps for the int8 and int4 products
#else
#define WIDE 0
#endif
#define FLIP (WIDE * 128)

// int8 w (scale per row) against x in blocks of 32; returns 8 lanes whose sum less FLIP x sum of p.c is the product.
// AVX2: |w| times x with w's sign, as maddubs wants unsigned by signed. AVX-512 VNNI: w + 128 as unsigned (one xor),
// so sum (w + 128) x = sum w x + 128 sum x, the last taken off once a row; 64 weights a step, its 16 int32 sums
// converted and scaled where they lie (lanes 0-7 by the first block's d, 8-15 by the second's). Gathering 8 blocks'
// sums into one vector first took 1.09x the time from L2 (one core) and TinyLlama's int8 decode step 1.03x (Zen 4).
static inline __m256 dot_i8(const XQ& p, const int8_t* w, int64_t K) {
    __m256 total = _mm256_setzero_ps();
    int64_t k = 0;
#if WIDE
    const __m512i flip = _mm512_set1_epi8(-128);
    __m512 wacc = _mm512_setzero_ps();
    for (; k + 256 <= K; k += 256) {
        const __m512 d = _mm512_castps256_ps512(_mm256_loadu_ps(&p.d[k / 32]));
        for (int i = 0; i < 4; i++) {
            ahead(w + k + 64 * i);
            __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w + k + 64 * i), flip);
            __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(&p.q[k + 64 * i]));
            const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(2 * i), _mm256_set1_epi32(2 * i + 1), 1);
            wacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(pick, d), wacc);
        }
    }
    total = _mm256_add_ps(_mm512_castps512_ps256(wacc),
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wacc), 1)));
    if (k < K) {  // the last blocks, fewer than 8 (d is 0 past the last)
        __m256i acc[8];
        for (int i = 0; i < 8; i++) {
            acc[i] = _mm256_setzero_si256();
            if (k + 32 * i >= K) continue;  // nothing read past the row
            __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + k + 32 * i)), _mm256_set1_epi8(-128));
            acc[i] = _mm256_dpbusd_epi32(acc[i], v, _mm256_loadu_si256((const __m256i*)&p.q[k + 32 * i]));
        }
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8_i32(acc)), _mm256_loadu_ps(&p.d[k / 32]), total);
    }
#else
    for (; k < K; k += 32) {
        ahead(w + k, AHEAD4);
        __m256i v = _mm256_loadu_si256((const __m256i*)(w + k)), x = _mm256_loadu_si256((const __m256i*)&p.q[k]);
        __m256i a = _mm256_sign_epi8(v, v), sx = _mm256_sign_epi8(x, v);
#ifdef __AVX512VNNI__
        __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, sx);
#else
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), _mm256_set1_epi16(1));
#endif
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&p.d[k / 32]), total);
    }
#endif
    return total;
}

// 64 packed int4 weights (32 bytes) times 64 int8 x in even-odd order -> 8 int32 sums of 8 products each
static inline __m256i dot64(const uint8_t* w, const int8_t* x) {
    const __m256i nib = _mm256_set1_epi8(15);
    __m256i v = _mm256_loadu_si256((const __m256i*)w);
    __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    __m256i xe = _mm256_loadu_si256((const __m256i*)x), xo = _mm256_loadu_si256((const __m256i*)(x + 32));
#ifdef __AVX512VNNI__
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo)),
                             _mm256_set1_epi16(1));
#endif
}

#if WIDE
// 128 packed int4 weights (64 bytes) times 128 int8 x in even-odd order by 128, added to a's 16 int32 sums. One load
// kept for both nibbles: folded into each use, it was loaded twice.
static inline __m512i dot128(__m512i a, const uint8_t* w, const int8_t* x) {
    __m512i v = _mm512_loadu_si512(w);
    asm("" : "+v"(v));
    const __m512i nib = _mm512_set1_epi8(15);
    a = _mm512_dpbusd_epi32(a, _mm512_and_si512(v, nib), _mm512_loadu_si512(x));
    return _mm512_dpbusd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib), _mm512_loadu_si512(x + 64));
}

// n <= 8 groups' products in 512-bit steps, added to acc: each step's 16 int32 sums converted and scaled where they
// lie (G 64: lanes 0-7 by the first group's scale x d, 8-15 by the second's; G 32: four lanes a group), with no
// horizontal sums. Summing each group's lanes first, then scaling 8 groups at once, read the weights from memory at
// 0.80-0.89x the speed with G 64 and 0.93-0.99x with G 128 (Zen 4, two cores, memory fast; TinyLlama's int4 g64
// decode step took 1.18x the time). G 32 (GGUF's Q4_0 and Q4_1) had 256-bit steps of two groups: 0.65x the speed
// from L2 (one core), and TinyLlama's Q4_0 step took 1.2x the time with memory fast, 1.0-1.15x slow. sd: the 8
// groups' scale x d.
template <int G>
static inline __m512 group_products_wide(const uint8_t* w, const int8_t* x, int n, __m256 sd, __m512 acc) {
    const __m512 s = _mm512_castps256_ps512(sd);
    if constexpr (G >= 128) {
        for (int i = 0; i < n; i++) {
            __m512i a = _mm512_setzero_si512();
            for (int j = 0; j < G / 128; j++) {
                ahead(w + i * G / 2 + 64 * j, AHEAD4);
                a = dot128(a, w + i * G / 2 + 64 * j, x + i * G + 128 * j);
            }
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_permutexvar_ps(_mm512_set1_epi32(i), s), acc);
        }
        return acc;
    }
    int i = 0;
    if (G == 32)  // a step holds four groups, a quarter each
        for (; i + 4 <= n; i += 4) {
            ahead(w + 16 * i, AHEAD4);
            const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(i),
                                                  _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot128(_mm512_setzero_si512(), w + 16 * i, x + 32 * i)),
                                  _mm512_permutexvar_ps(pick, s), acc);
        }
    else  // G 64: a step holds two groups, one in each half
        for (; i + 2 <= n; i += 2) {
            ahead(w + 32 * i, AHEAD4);
            const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(i), _mm256_set1_epi32(i + 1), 1);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot128(_mm512_setzero_si512(), w + 32 * i, x + 64 * i)),
                                  _mm512_permutexvar_ps(pick, s), acc);
        }
    if (i < n) {  // G 32 or 64 with K 64 short of a multiple of 128: the row's last 64 weights (x in 64's order there)
        const __m256i pick = G == 32 ? _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1) : _mm256_set1_epi32(i);
        const __m256 half = _mm256_mul_ps(_mm256_cvtepi32_ps(dot64(w + G / 2 * i, x + G * i)),
                                          _mm256_permutexvar_ps(pick, sd));
        acc = _mm512_add_ps(acc, _mm512_zextps256_ps512(half));
    }
    return acc;
}
#endif

// n <= 8 groups' (G 64 or more) products in 256-bit steps: acc[i] holds group i's in its 8 int32 lanes
template <int G>
static inline void group_sums(const uint8_t* w, const int8_t* x, int n, __m256i* acc) {
    const __m256i nib = _mm256_set1_epi8(15);
    for (int i = 0; i < 8; i++) {
        acc[i] = _mm256_setzero_si256();
        if (i >= n) continue;
        for (int j = 0; j < G / 64; j++) {  // 64 weights per step; unrolled, G being a constant
            const uint8_t* wg = w + i * G / 2 + 32 * j;
            const int8_t* xg = x + i * G + 64 * j;
            if ((G == 64 ? i : j) % 2 == 0) ahead(wg, AHEAD4);  // once a line, and further: 3% faster
            __m256i v = _mm256_loadu_si256((const __m256i*)wg);
            __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            __m256i xe = _mm256_loadu_si256((const __m256i*)xg), xo = _mm256_loadu_si256((const __m256i*)(xg + 32));
#ifdef __AVX512VNNI__
            acc[i] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc[i], lo, xe), hi, xo);
#else
            acc[i] = _mm256_add_epi16(acc[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo)));
#endif
        }
#ifndef __AVX512VNNI__
        acc[i] = _mm256_madd_epi16(acc[i], _mm256_set1_epi16(1));
#endif
    }
}

// int4 w = (q - 8) * scale + zero per group of G (32, 64, 128 or 256) along K, two q per byte (low nibble first). A group's
// products add up in 16-bit lanes (at most G/64 x 2 x 2 x 15 x 127 < 2^15), or in 32-bit ones with dpbusd; per group
// sum (q - 8) x ~ d * (sum q xq) - 8 c. The float work is done 8 groups at a time: the 8 groups' integer sums are
// gathered into one vector, converted and scaled together (each group on its own took 1.08x the time, one core, L2,
// Zen 5). wide: AVX-512 VNNI steps of 128 weights (x in even-odd order by 128): 1.2-1.3x as fast as 256-bit
// steps there (one core, L3); their float work is per step instead (group_products_wide). A row 64 short of a
// multiple of 128 (SmolLM2's 576 columns) ends in a 256-bit step, and with G 32 or 64 the last groups past a
// multiple of 8 are scaled in one masked vector: from L3 (Zen 4, two cores) products of 576 columns read 1.6x as
// fast in groups of 32, 1.2x in groups of 64, as 256-bit steps with those groups in scalars did (SmolLM2's Q4_1
// step: 0.90-0.94x the time). With G 128 the masked groups, though faster from L3, left TinyLlama's int4 step 1.03x
// as long with the memory fast (46 rounds), so they stay scalar there. Returns 8 lanes that add up to the row's
// product.
// 8 groups' scales s and zeros z (from g0): sd = s x d, and rest += z x sum x - 8 s x c
static inline void group_scales(__m256 s, __m256 z, const XQ& p, int64_t g0, __m256* sd, __m256* rest) {
    *sd = _mm256_mul_ps(s, _mm256_loadu_ps(&p.d[g0]));
    *rest = _mm256_fmadd_ps(z, _mm256_loadu_ps(&p.sum[g0]), *rest);
    *rest = _mm256_fnmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(8.f)), _mm256_loadu_ps(&p.c[g0]), *rest);
}

template <int G, bool wide>
static inline __m256 dot_i4(const XQ& p, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, int64_t K) {
    __m256 total = _mm256_setzero_ps(), rest = _mm256_setzero_ps();
#if WIDE
    __m512 wacc = _mm512_setzero_ps();
#endif
    const int64_t groups = K / G;
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        __m256 sd;  // scale * d per group
        if (g0 + 8 <= groups) {
            group_scales(widen8(scales + g0), widen8(zeros + g0), p, g0, &sd, &rest);
#if WIDE
        } else if (G <= 64) {  // the last few groups, masked: nothing read past the row (p's d, c, sum are 0 there)
            const __mmask8 live = (__mmask8)((1u << (groups - g0)) - 1);
            group_scales(widen8(_mm_maskz_loadu_epi16(live, scales + g0)),
                         widen8(_mm_maskz_loadu_epi16(live, zeros + g0)), p, g0, &sd, &rest);
#endif
        } else {
            alignas(32) float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            float r = 0.f;
            for (int64_t g = g0; g < groups; g++) {
                f[g - g0] = from_bf16(scales[g]) * p.d[g];
                r += from_bf16(zeros[g]) * p.sum[g] - 8.f * from_bf16(scales[g]) * p.c[g];
            }
            sd = _mm256_load_ps(f);
            rest = _mm256_add_ps(rest, _mm256_setr_ps(r, 0, 0, 0, 0, 0, 0, 0));
        }
#ifdef __AVX512VNNI__
        if (G == 32 && !wide) {  // two groups a 32-byte step: int32 lanes 0-3 are the first group's, 4-7 the second's
            alignas(32) float f[8];
            _mm256_store_ps(f, sd);
            for (int64_t g = g0; g < groups && g < g0 + 8; g += 2) {
                if ((g - g0) % 4 == 0) ahead(w + g * 16, AHEAD4);
                __m256 s = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(&f[g - g0])),
                                                _mm_broadcast_ss(&f[g - g0 + 1]), 1);
                total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot64(w + g * 16, &p.q[g * 32])), s, total);
            }
            continue;
        }
#else
        if (G == 32) {  // two groups a 32-byte step: bytes 0-15 hold the first's, 16-31 the second's
            const __m256i nib = _mm256_set1_epi8(15);
            __m256i r[4];  // 16-bit sums: 4 products each, 4 of them added below (4 x 4 x 15 x 127 < 2^15)
            for (int i = 0; i < 4; i++) {
                r[i] = _mm256_setzero_si256();
                if (g0 + 2 * i >= groups) continue;
                const uint8_t* wg = w + (g0 + 2 * i) * 16;
                const int8_t* xg = &p.q[(g0 + 2 * i) * 32];
                if (i % 2 == 0) ahead(wg, AHEAD4);
                __m256i v = _mm256_loadu_si256((const __m256i*)wg);
                __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                r[i] = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xg)),
                                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xg + 32))));
            }
            // the 8 groups' sums gathered in one vector, in the order 0, 2, 4, 6, 1, 3, 5, 7, converted and scaled
            // together: 1.2x as fast as converting and scaling each step's pair (one core, weights in cache, Zen 3)
            __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(r[0], r[1]), _mm256_hadd_epi16(r[2], r[3]));
            sd = _mm256_permutevar8x32_ps(sd, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
            total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(h, _mm256_set1_epi16(1))), sd, total);
            continue;
        }
#endif
        __m256i acc[8];
        const int n = groups - g0 < 8 ? groups - g0 : 8;
#if WIDE
        if (wide) {
            // a constant 8 unrolls the steps: with n alone, 1536 columns in groups of 32 read 0.8x as fast from L3
            if (G <= 64 && n == 8) wacc = group_products_wide<G>(w + g0 * G / 2, &p.q[g0 * G], 8, sd, wacc);
            else wacc = group_products_wide<G>(w + g0 * G / 2, &p.q[g0 * G], n, sd, wacc);
            continue;
        }
#endif
        if (n == 8) group_sums<G>(w + g0 * G / 2, &p.q[g0 * G], 8, acc);
        else group_sums<G>(w + g0 * G / 2, &p.q[g0 * G], n, acc);
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8_i32(acc)), sd, total);
    }
#if WIDE
    total = _mm256_add_ps(total, _mm256_add_ps(_mm512_castps512_ps256(wacc),
                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wacc), 1))));
#endif
    return _mm256_add_ps(total, rest);
}

// the output head's int8 product (f32): x kept in fp32, each weight widened, so that logits closer than x's int8
// rounding would move them (a small model's top two) keep their order
static inline float dot_i8_exact(const float* x, const int8_t* w, int64_t K) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
        if (k % 64 == 0) ahead(w + k);  // as the other products: 1.19x as fast on a Zen 5 (512-bit steps: no faster)
        for (int c = 0; c < 4; c++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + k + 8 * c))));
            a[c] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + k + 8 * c), a[c]);
        }
    }
    return hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}

// Many rows of x (prefill, verification): tiles of 2 rows of x by 2 rows of w, as tile_i4 below; out[a][b] =
// x row a . w row b, before w's row scale
static inline void tile_i8(const XQ* xr[2], const int8_t* wr[2], int64_t K, float out[2][2]) {
    __m256 acc[2][2];
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) acc[a][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m256i v[2], av[2];
        for (int b = 0; b < 2; b++)
            v[b] = _mm256_loadu_si256((const __m256i*)(wr[b] + k)), av[b] = _mm256_sign_epi8(v[b], v[b]);
        for (int a = 0; a < 2; a++) {
            __m256i x = _mm256_loadu_si256((const __m256i*)&xr[a]->q[k]);
            __m256 d = _mm256_broadcast_ss(&xr[a]->d[k / 32]);
            for (int b = 0; b < 2; b++) {
                __m256i sx = _mm256_sign_epi8(x, v[b]);
#ifdef __AVX512VNNI__
                __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), av[b], sx);
#else
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(av[b], sx), _mm256_set1_epi16(1));
#endif
                acc[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[a][b]);
            }
        }
    }
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) out[a][b] = hsum8(acc[a][b]);
}

enum { NB = 32 };  // rows of w per task: they stay in L2 while every pair of x rows goes over them

static void gemm_i8(const std::vector<XQ>& xq, const int8_t* w, const uint16_t* scales, void* y, int64_t M, int64_t N,
                    int64_t K, int64_t f32) {
    #pragma omp parallel for schedule(dynamic)
    for (int64_t n0 = 0; n0 < N; n0 += NB)
        for (int64_t m = 0; m < M; m += 2)
            for (int64_t n = n0; n < N && n < n0 + NB; n += 2) {
                const int64_t m1 = m + 1 < M ? m + 1 : m, n1 = n + 1 < N ? n + 1 : n;  // odd ones: twice
                const XQ* xr[2] = {&xq[m], &xq[m1]};
                const int8_t* wr[2] = {w + n * K, w + n1 * K};
                float o[2][2];
                tile_i8(xr, wr, K, o);
                for (int a = 0; a < 2 && m + a < M; a++)
                    for (int b = 0; b < 2 && n + b < N; b++)
                        put(y, (m + a) * N + n + b, o[a][b] * from_bf16(scales[n + b]), f32);
            }
}

// y[M, N] = x[M, K] @ (w[N, K] * scales[N])^T, x, scales and y bf16, w int8; K a multiple of 32
extern "C" void gemv_int8(const uint16_t* x, const int8_t* w, const uint16_t* scales, void* y,
                          int64_t M, int64_t N, int64_t K, int64_t f32) {
    if (f32) {
        static thread_local vec<float> xs_;
        vec<float>& xs = xs_;
        xs.resize(M * K);
        for (int64_t i = 0; i < M * K; i++) xs[i] = from_bf16(x[i]);
        share_rows(N, K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
            for (int64_t n = a; n < b; n++)
                for (int64_t m = 0; m < M; m++)
                    put(y, m * N + n, dot_i8_exact(&xs[m * K], w + n * K, K) * from_bf16(scales[n]), 1);
        });
        return;
    }
    std::vector<XQ>& xq = xq_;  // (by reference in the parallel regions: a thread_local name is each thread's own)
    xq.resize(M);
    #pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) prepare(x + m * K, K, 32, 0, xq[m]);
    if (M > 1) {
        gemm_i8(xq, w, scales, y, M, N, K, f32);
        return;
    }
    float shift = 0.f;  // FLIP x sum of c
    for (int64_t b = 0; FLIP && b < K / 32; b++) shift += FLIP * xq[0].c[b];
    share_rows((N + 7) / 8, 8 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n0 = 8 * a; n0 < 8 * b && n0 < N; n0 += 8) {  // each weight row is read from memory once;
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;                 // 8 rows' sums reduced together
            __m256 t[8];
            for (int64_t i = 0; i < 8; i++) t[i] = dot_i8(xq[0], w + (n0 + (i < rows ? i : 0)) * K, K);
            alignas(32) float o[8];
            _mm256_store_ps(o, sum8x8(t));
            for (int64_t i = 0; i < rows; i++) put(y, n0 + i, (o[i] - shift) * from_bf16(scales[n0 + i]), f32);
        }
    });
}

// One row of x. 8 weight rows at a time, their sums reduced together rather than each at the end of its row:
// 1.09x as fast with the weights in cache (Zen 5).
template <int G, bool wide>
static void gemv_i4(const XQ& xq, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, void* y, int64_t N,
                    int64_t K, int64_t f32) {
    share_rows((N + 7) / 8, 8 * (K / 2 + K / G * 4), CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n0 = 8 * a; n0 < 8 * b && n0 < N; n0 += 8) {
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;
            __m256 t[8];
            for (int64_t i = 0; i < 8; i++) {
                const int64_t n = n0 + (i < rows ? i : 0);  // past N: row n0 again, not stored
                t[i] = dot_i4<G, wide>(xq, w + n * K / 2, scales + n * (K / G), zeros + n * (K / G), K);
            }
            alignas(32) float o[8];
            _mm256_store_ps(o, sum8x8(t));
            for (int64_t i = 0; i < rows; i++) put(y, n0 + i, o[i], f32);
        }
    });
}

// Many rows of x (prefill, verification): a tile of 2 rows of x by 2 rows of w, so that each weight vector
// unpacked serves both rows of x and each x vector loaded serves both rows of w, with 4 accumulators of each kind
// in registers. per[b] points at w row b's scales, 8 x its scales and its zeros as floats (groups padded to a
// multiple of 8 with zeros); out[a][b] = x row a . w row b.
template <int G>
static inline void tile_i4(const XQ* xr[2], const uint8_t* wr[2], const float* per[2][3], int64_t K, float out[2][2]) {
    const __m256i nib = _mm256_set1_epi8(15);
    const int64_t groups = K / G;
    __m256 acc[2][2];
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) acc[a][b] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        for (int a = 0; a < 2; a++)  // zero * sum x - 8 scale * c, 8 groups at once: added lane by lane, as the rest
            for (int b = 0; b < 2; b++) {
                __m256 z = _mm256_loadu_ps(per[b][2] + g0), s8 = _mm256_loadu_ps(per[b][1] + g0);
                acc[a][b] = _mm256_fmadd_ps(z, _mm256_loadu_ps(&xr[a]->sum[g0]), acc[a][b]);
                acc[a][b] = _mm256_fnmadd_ps(s8, _mm256_loadu_ps(&xr[a]->c[g0]), acc[a][b]);
            }
        if (G == 32) {  // two groups a load, as in dot_i4
            for (int64_t g = g0; g < groups && g < g0 + 8; g += 2)
                for (int a = 0; a < 2; a++)
                    for (int b = 0; b < 2; b++) {
                        __m256 s = _mm256_insertf128_ps(_mm256_set1_ps(per[b][0][g] * xr[a]->d[g]),
                                                        _mm_set1_ps(per[b][0][g + 1] * xr[a]->d[g + 1]), 1);
                        __m256i p = dot64(wr[b] + g * 16, &xr[a]->q[g * 32]);
                        acc[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[a][b]);
                    }
            continue;
        }
        for (int64_t g = g0; g < groups && g < g0 + 8; g++) {
            __m256i p[2][2];
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++) p[a][b] = _mm256_setzero_si256();
            for (int j = 0; j < G / 64; j++) {
                __m256i lo[2], hi[2];
                for (int b = 0; b < 2; b++) {
                    __m256i v = _mm256_loadu_si256((const __m256i*)(wr[b] + g * G / 2 + 32 * j));
                    lo[b] = _mm256_and_si256(v, nib), hi[b] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                }
                for (int a = 0; a < 2; a++) {
                    const int8_t* xg = &xr[a]->q[g * G + 64 * j];
                    __m256i xe = _mm256_loadu_si256((const __m256i*)xg);
                    __m256i xo = _mm256_loadu_si256((const __m256i*)(xg + 32));
                    for (int b = 0; b < 2; b++)
#ifdef __AVX512VNNI__
                        p[a][b] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(p[a][b], lo[b], xe), hi[b], xo);
#else
                        p[a][b] = _mm256_add_epi16(p[a][b], _mm256_add_epi16(_mm256_maddubs_epi16(lo[b], xe),
                                                                             _mm256_maddubs_epi16(hi[b], xo)));
#endif
                }
            }
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++) {
#ifndef __AVX512VNNI__
                    p[a][b] = _mm256_madd_epi16(p[a][b], _mm256_set1_epi16(1));
#endif
                    __m256 sd = _mm256_set1_ps(per[b][0][g] * xr[a]->d[g]);
                    acc[a][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[a][b]), sd, acc[a][b]);
                }
        }
    }
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) out[a][b] = hsum8(acc[a][b]);
}

template <int G>
static void gemm_i4(const std::vector<XQ>& xq, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                    void* y, int64_t M, int64_t N, int64_t K, int64_t f32) {
    const int64_t groups = K / G, g8 = (groups + 7) / 8 * 8;
    #pragma omp parallel for schedule(dynamic)
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        const int64_t nb = NB < N - n0 ? NB : N - n0;
        vec<float> f(3 * nb * g8, 0.f);  // per row: scales, 8 x scales, zeros
        for (int64_t n = 0; n < nb; n++)
            for (int64_t g = 0; g < groups; g++) {
                float sc = from_bf16(scales[(n0 + n) * groups + g]);
                f[(3 * n) * g8 + g] = sc, f[(3 * n + 1) * g8 + g] = 8.f * sc;
                f[(3 * n + 2) * g8 + g] = from_bf16(zeros[(n0 + n) * groups + g]);
            }
        for (int64_t m = 0; m < M; m += 2)
            for (int64_t n = 0; n < nb; n += 2) {
                const int64_t m1 = m + 1 < M ? m + 1 : m, n1 = n + 1 < nb ? n + 1 : n;  // odd ones: twice
                const XQ* xr[2] = {&xq[m], &xq[m1]};
                const uint8_t* wr[2] = {w + (n0 + n) * K / 2, w + (n0 + n1) * K / 2};
                const float* per[2][3] = {{&f[3 * n * g8], &f[(3 * n + 1) * g8], &f[(3 * n + 2) * g8]},
                                          {&f[3 * n1 * g8], &f[(3 * n1 + 1) * g8], &f[(3 * n1 + 2) * g8]}};
                float o[2][2];
                tile_i4<G>(xr, wr, per, K, o);
                for (int a = 0; a < 2 && m + a < M; a++)
                    for (int b = 0; b < 2 && n + b < nb; b++) put(y, (m + a) * N + n0 + n + b, o[a][b], f32);
            }
    }
}

// y[M, N] = x[M, K] @ w^T, w given as packed q [N, K / 2], scales and zeros [N, K / G] (bf16); K a multiple of 64
extern "C" void gemv_int4(const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                          void* y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t f32) {
    std::vector<XQ>& xq = xq_;
    xq.resize(M);
    const bool wide = WIDE && M == 1;
    #pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) prepare(x + m * K, K, G, wide ? 128 : 64, xq[m]);
    if (M > 1) {
        if (G == 32) gemm_i4<32>(xq, w, scales, zeros, y, M, N, K, f32);
        else if (G == 64) gemm_i4<64>(xq, w, scales, zeros, y, M, N, K, f32);
        else if (G == 128) gemm_i4<128>(xq, w, scales, zeros, y, M, N, K, f32);
        else gemm_i4<256>(xq, w, scales, zeros, y, M, N, K, f32);
    } else if (G == 32) (wide ? gemv_i4<32, true> : gemv_i4<32, false>)(xq[0], w, scales, zeros, y, N, K, f32);
    else if (G == 64) (wide ? gemv_i4<64, true> : gemv_i4<64, false>)(xq[0], w, scales, zeros, y, N, K, f32);
    else if (G == 128) (wide ? gemv_i4<128, true> : gemv_i4<128, false>)(xq[0], w, scales, zeros, y, N, K, f32);
    else (wide ? gemv_i4<256, true> : gemv_i4<256, false>)(xq[0], w, scales, zeros, y, N, K, f32);
}

// prefill's int4 weights: w [N, K / 2] packed, scales and zeros [N, K / G] -> out [N, K] in fp32 (or bf16), for a
// GEMM of many rows; one pass, 32 weights a step (1.4x as fast as a table lookup per weight, on a Zen 5)
extern "C" void dequantize_int4(const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, void* out,
                                int64_t N, int64_t K, int64_t G, int64_t f32) {
    const __m128i nib = _mm_set1_epi8(15);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < K / G; g++) {
            const __m256 s = _mm256_set1_ps(from_bf16(scales[n * (K / G) + g]));
            const __m256 z = _mm256_set1_ps(from_bf16(zeros[n * (K / G) + g]));
            const uint8_t* wg = w + (n * K + g * G) / 2;
            const int64_t at = n * K + g * G;
            for (int64_t j = 0; j < G / 2; j += 16) {  // 16 bytes: weights at + 2j .. at + 2j + 31, in order
                __m128i b = _mm_loadu_si128((const __m128i*)(wg + j));
                __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
                __m128i q[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
                for (int i = 0; i < 4; i++) {  // (q - 8) * s + z, 8 at a time
                    __m256i qi = _mm256_cvtepu8_epi32(i % 2 ? _mm_srli_si128(q[i / 2], 8) : q[i / 2]);
                    __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(8.f));
                    v = _mm256_fmadd_ps(v, s, z);
                    if (f32) _mm256_storeu_ps((float*)out + at + 2 * j + 8 * i, v);
                    else _mm_storeu_si128((__m128i*)((uint16_t*)out + at + 2 * j + 8 * i), to_bf16x8(v));
                }
            }
        }
}

// ---- attention for a few query rows (decode, verification) over the KV cache (bf16; int8 further down) -----------
// torch's CPU attention costs ~0.2 ms a layer at any context and ~10 ms at 4k; this one streams K and V once per KV
// head for all the query rows that share it (grouped-query attention), split along the context so that every core
// has work, as flash-decoding does, and merges the parts with their softmax maxima.

static inline __m256 exp8(__m256 x) {  // e^x for x <= 0 (x >= -87.3; less gives 0), relative error ~2e-7
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // x - n ln 2, in two parts for precision
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

enum { CHUNK = 256 };  // the fewest cache positions a task takes

// cache positions per task: 256 to 1024, about 16 tasks over `heads` KV heads whatever the count of threads (the
// results do not depend on it). Each task sets up, and starts its streams of K and V cold: at 4096 positions x 4 KV
// heads x 22 layers on a Zen 4 (2 threads), 1024 took 0.95-0.96x the time of 256 from L3 and 0.90-0.97x from memory
// (medians of rounds alternating the two).
static inline int64_t chunk_for(int64_t L, int64_t heads) {
    const int64_t c = (L * heads / 16 + CHUNK - 1) / CHUNK * CHUNK;
    return c < CHUNK ? CHUNK : c > 4 * CHUNK ? 4 * CHUNK : c;
}

// where dimension i is kept in q and in the outputs: 16 at a time in the order that unpacking 16 bf16 under zeros
// gives (lo: 0-3, 8-11; hi: 4-7, 12-15), so that K and V are used as they are loaded
static inline int64_t in16(int64_t i) {
    int64_t j = i % 16;
    return i - j + (j < 4 ? j : j < 8 ? j + 4 : j < 12 ? j - 4 : j);
}

// Bytes [p, end) requested into L2 a few lines per step, paced through the compute: K and V arrive while the FMAs
// run. The hardware prefetcher alone left the widening of each block waiting on memory, and requesting a whole
// block at once did no better.
struct Stream {
    const char *p, *end;
    int64_t per_step;
    Stream(const void* from, int64_t bytes, int64_t steps)
        : p((const char*)from), end((const char*)from + bytes),
          per_step((bytes / 64 + steps - 1) / (steps > 0 ? steps : 1)) {}
    void step() {
        for (int64_t i = 0; i < per_step && p < end; i++, p += 64) _mm_prefetch(p, _MM_HINT_T1);
    }
};

// 16 values of K or V as two fp32 vectors: bf16 unpacked under zeros (dimensions 0-3, 8-11 and 4-7, 12-15), int8
// sign-extended (0-7 and 8-15)
static inline void widen16(const uint16_t* p, __m256* a, __m256* b) {
    __m256i w = _mm256_loadu_si256((const __m256i*)p);
    *a = lo(w), *b = hi(w);
}
static inline void widen16(const int8_t* p, __m256* a, __m256* b) {
    *a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    *b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
}

// s[r] = q_r . k (times scale over int8) for 8 query rows (D apart, each 16 dimensions in the order widen16 gives)
// and one position of K: K is widened in registers, each vector serving the 8 rows, and the 8 sums come out as one
// vector, a position's scores for the 8 rows (also returned)
template <int D, typename T>
static inline __m256 qk_col8(const float* q, const T* k, float scale, float* s) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m256 k0, k1;
        widen16(k + d, &k0, &k1);
        for (int r = 0; r < 8; r++)
            a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d + 8), k1,
                                   _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), k0, a[r]));
    }
    __m256 t = sum8x8(a);
    if constexpr (sizeof(T) == 1) t = _mm256_mul_ps(t, _mm256_set1_ps(scale));  // bf16 q comes scaled
    _mm256_storeu_ps(s, t);
    return t;
}

// o_r += sum_j p[j][r] v_j for RT (1 to 4) rows (p's positions ld apart, o D + 2 apart, o's dimensions in widen16's
// order) over n positions of V (D apart), 16 dimensions at a time: each V vector widened serves RT rows. Each 32
// dimensions have weights of their own, cs apart (an int8 V's scales are in them; 0 for bf16: the same weights).
// ahead steps every 4th position of each pass (pv_steps counts them).
template <int D, int RT, typename T>
static inline void pv_tile16(const float* p, int64_t ld, int64_t cs, const T* v, int64_t n, float* o, Stream* ahead) {
    for (int d = 0; d < D; d += 16) {
        const float* pd = p + d / 32 * cs;
        __m256 acc[RT][2];
        for (int r = 0; r < RT; r++)
            for (int i = 0; i < 2; i++) acc[r][i] = _mm256_loadu_ps(o + r * (D + 2) + d + 8 * i);
        for (int64_t j = 0; j < n; j++) {
            __m256 v0, v1;
            widen16(v + j * D + d, &v0, &v1);
            for (int r = 0; r < RT; r++) {
                __m256 pj = _mm256_broadcast_ss(pd + j * ld + r);
                acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]), acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
            }
            if (j % 4 == 0) ahead->step();
        }
        for (int r = 0; r < RT; r++)
            for (int i = 0; i < 2; i++) _mm256_storeu_ps(o + r * (D + 2) + d + 8 * i, acc[r][i]);
    }
}

#ifdef __AVX512F__
// pv_tile16 in 512-bit vectors, 32 dimensions a step (D 32 or more): half the instructions, and on a Zen 5 512-bit
// FMAs issue at the 256-bit rate (attention over 4096 positions took 0.80x as long). Unpacking 32 bf16 under zeros
// gives dimensions 0-3, 8-11, 16-19, 24-27, then 4-7, 12-15, 20-23, 28-31: o is kept in that order (in32).
static inline int64_t in32(int64_t i) {
    int64_t j = i % 32, lane = j / 8, w = j % 8;
    return i - j + (w < 4 ? 4 * lane + w : 16 + 4 * lane + w - 4);
}

template <int D, int RT>
static inline void pv_tile32(const float* p, int64_t ld, const uint16_t* v, int64_t n, float* o, Stream* ahead) {
    for (int d = 0; d < D; d += 32) {
        __m512 acc[RT][2];
        for (int r = 0; r < RT; r++)
            for (int i = 0; i < 2; i++) acc[r][i] = _mm512_loadu_ps(o + r * (D + 2) + d + 16 * i);
        for (int64_t j = 0; j < n; j++) {
            __m512i w = _mm512_loadu_si512(v + j * D + d);
            __m512 v0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), w));
            __m512 v1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), w));
            for (int r = 0; r < RT; r++) {
                __m512 pj = _mm512_set1_ps(p[j * ld + r]);
                acc[r][0] = _mm512_fmadd_ps(pj, v0, acc[r][0]), acc[r][1] = _mm512_fmadd_ps(pj, v1, acc[r][1]);
            }
            if (j % 4 == 0) ahead->step();
        }
        for (int r = 0; r < RT; r++)
            for (int i = 0; i < 2; i++) _mm512_storeu_ps(o + r * (D + 2) + d + 16 * i, acc[r][i]);
    }
}
static inline int64_t out_slot(int64_t D, int64_t d) { return D >= 32 ? in32(d) : in16(d); }  // where o keeps d
#else
static inline int64_t out_slot(int64_t, int64_t d) { return in16(d); }
#endif
static inline int64_t plain(int64_t, int64_t d) { return d; }  // where o keeps d over an int8 cache

template <int D, int RT>
static inline void pv(const float* p, int64_t ld, int64_t, const uint16_t* v, int64_t n, float* o, Stream* ahead) {
#ifdef __AVX512F__
    if constexpr (D >= 32) return pv_tile32<D, RT>(p, ld, v, n, o, ahead);
#endif
    pv_tile16<D, RT>(p, ld, 0, v, n, o, ahead);
}
template <int D, int RT>
static inline void pv(const float* p, int64_t ld, int64_t cs, const int8_t* v, int64_t n, float* o, Stream* ahead) {
    pv_tile16<D, RT>(p, ld, cs, v, n, o, ahead);
}
// the times pv steps its stream over n positions for R rows (4 at a time): blocks are multiples of 4 positions
template <int D, typename T>
static inline int64_t pv_steps(int64_t n, int64_t R) {
#ifdef __AVX512F__
    constexpr int64_t passes = sizeof(T) == 2 && D >= 32 ? D / 32 : D / 16;
#else
    constexpr int64_t passes = D / 16;
#endif
    return passes * ((R + 3) / 4) * ((n + 3) / 4);
}

// [lo, hi): the positions of [j0, j1) that some row of mask [S, L] attends (lo >= hi: none)
static inline void span(const uint8_t* mask, int64_t S, int64_t L, int64_t j0, int64_t j1, int64_t* lo, int64_t* hi) {
    *lo = j1, *hi = j0;
    for (int64_t s = 0; s < S; s++) {
        const uint8_t* m = mask + s * L;
        int64_t a = j0, b = j1;
        while (a < b && !m[a]) a++;
        while (b > a && !m[b - 1]) b--;
        if (a < b) *lo = a < *lo ? a : *lo, *hi = b > *hi ? b : *hi;
    }
}

// every row sees all of [lo, hi): no masking (a decode step's chunks but maybe the last)
static inline bool sees_all(const uint8_t* mask, int64_t S, int64_t L, int64_t lo, int64_t hi) {
    for (int64_t s = 0; s < S; s++)
        if (memchr(mask + s * L + lo, 0, hi - lo)) return false;
    return true;
}

static inline void clear(float* part, int64_t R, int64_t D) {  // R rows that see nothing yet
    for (int64_t r = 0; r < R; r++) {
        part[r * (D + 2)] = -INFINITY, part[r * (D + 2) + 1] = 0.f;
        for (int d = 0; d < D; d++) part[r * (D + 2) + 2 + d] = 0.f;
    }
}

// One task: the R = (H / Hkv) * S query rows of one KV head, over cache positions [j0, j1) (k and v point at the
// head's position 0, mask at the batch row's [S, L]). Writes per row the softmax maximum m, the sum of e^(s - m),
// and the unnormalized output (D values, in out_slot's order, or plain over int8) to part [R][D + 2]. Only the span
// of positions some row attends is read (a short context in a longer cache skips the rest), in blocks of 8 KB that
// stay in L1 while the rows go over them (8 at a time for the scores, 4 for the weighted sum), widening K and V in
// registers. At 4k positions, an fp32 copy of each block took 28% longer, and leaving the reads to the hardware
// prefetcher 20% longer. Over an int8 cache (T int8_t) ks holds K's scale per position, and vs V's per position and
// 32 dimensions (D / 32 a position): they multiply the scores, and the weights of each 32 dimensions.
template <int D, typename T>
static void attend_chunk(const float* qf, const T* k, const float* ks, const T* v, const float* vs,
                         const uint8_t* mask, int64_t S, int64_t L, int64_t R, int64_t j0, int64_t j1, float* part) {
    constexpr int64_t BJ = 8192 / D / sizeof(T) < CHUNK ? 8192 / D / sizeof(T) : CHUNK;  // positions per block
    static_assert(BJ % 4 == 0, "pv_steps counts whole blocks of 4");
    constexpr int64_t NC = sizeof(T) == 1 ? D / 32 : 0, W = D * sizeof(T);  // V's scales a position; bytes a row
    static thread_local vec<float> sc, pc;  // [n][R8] the scores, then the weights; [NC][n][R8] times V's scales
    int64_t lo, hi;
    span(mask, S, L, j0, j1, &lo, &hi);
    clear(part, R, D);
    if (lo >= hi) return;
    const int64_t n = hi - lo, R8 = (R + 7) / 8 * 8;  // rows past R are padding (q's zero rows)
    sc.resize(n * R8), pc.resize(NC * n * R8);
    static thread_local vec<float> top;  // each row's highest score, kept as the scores come out
    top.assign(R8, -INFINITY);
    // K two blocks ahead of the one computed (already asked for by the previous task, mostly) and all of V during
    // the scores; the next chunk's K during the weighted sum
    const int64_t cols = R8 / 8 * n, early = 2 * BJ < n ? 2 * BJ : n;  // the first two blocks, asked for at once
    for (Stream first(k + lo * D, early * W, 1); first.p < first.end;) first.step();
    // (paced every 4th position: asking every position cost 8% of the kernel in instructions)
    Stream kstream(k + (lo + early) * D, (n - early) * W, cols / 4), vstream(v + lo * D, n * W, cols / 4);
    for (int64_t b = 0; b < n; b += BJ)  // scores: a block of K stays in L1 for every row
        for (int64_t r = 0; r < R8; r += 8) {
            __m256 m = _mm256_loadu_ps(&top[r]);
            for (int64_t j = b; j < b + BJ && j < n; j++) {
                const float scale = NC ? ks[lo + j] : 1.f;
                m = _mm256_max_ps(m, qk_col8<D>(qf + r * D, k + (lo + j) * D, scale, &sc[j * R8 + r]));
                if (j % 4 == 0) kstream.step(), vstream.step();
            }
            _mm256_storeu_ps(&top[r], m);
        }
    const bool all = sees_all(mask, S, L, lo, hi);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t r = 0; r < R8; r += 8) {  // masked to -inf, then e^(s - m): 8 rows at a time
        if (!all)
            for (int64_t j = 0; j < n; j++)
                for (int64_t t = r; t < r + 8 && t < R; t++)
                    if (!mask[(t % S) * L + lo + j]) sc[j * R8 + t] = -INFINITY;
        __m256 mx = _mm256_loadu_ps(&top[r]), sum = _mm256_setzero_ps();  // unmasked, as the scores came
        if (!all) {
            mx = ninf;
            for (int64_t j = 0; j < n; j++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(&sc[j * R8 + r]));
        }
        // a row that sees nothing here: m stays -inf for the merge, and its weights come out 0
        __m256 m = _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ));
        for (int64_t j = 0; j < n; j++) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(&sc[j * R8 + r]), m));
            _mm256_storeu_ps(&sc[j * R8 + r], p);
            sum = _mm256_add_ps(sum, p);
            for (int64_t c = 0; c < NC; c++)
                _mm256_storeu_ps(&pc[(c * n + j) * R8 + r], _mm256_mul_ps(p, _mm256_set1_ps(vs[(lo + j) * NC + c])));
        }
        alignas(32) float mv[8], lv[8];
        _mm256_store_ps(mv, mx), _mm256_store_ps(lv, sum);
        for (int64_t t = 0; t < 8 && r + t < R; t++)
            part[(r + t) * (D + 2)] = mv[t], part[(r + t) * (D + 2) + 1] = lv[t];
    }
    const float* w = NC ? pc.data() : sc.data();
    // all of the next chunk's K (the same thread's next task, mostly), paced through the weighted sum: memory then
    // streams through both phases, where asking for the first two blocks alone left the rest of K to the scores,
    // beside all of V (attention alone at 4096 positions, Zen 3: 0.85-0.94x the time in 7 of 9 runs, level in 2)
    const int64_t next = L - j1 < j1 - j0 ? L - j1 : j1 - j0;
    Stream ns(k + j1 * D, next * W, pv_steps<D, T>(n, R));
    for (int64_t b = 0; b < n; b += BJ)  // the weights times V: a block of V stays in L1 for every row
        for (int64_t r = 0; r < R; r += 4) {
            const float* p = w + b * R8 + r;
            const T* vb = v + (lo + b) * D;
            const int64_t nb = BJ < n - b ? BJ : n - b;
            float* o = part + r * (D + 2) + 2;
            switch (R - r < 4 ? R - r : 4) {
                case 4: pv<D, 4>(p, R8, n * R8, vb, nb, o, &ns); break;
                case 3: pv<D, 3>(p, R8, n * R8, vb, nb, o, &ns); break;
                case 2: pv<D, 2>(p, R8, n * R8, vb, nb, o, &ns); break;
                default: pv<D, 1>(p, R8, n * R8, vb, nb, o, &ns);
            }
        }
}

#ifdef __AVX512F__
// 16 vectors of 16 32-bit words transposed in place: afterwards r[p] lane i is what r[i] lane p was
static inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int g = 0; g < 16; g += 4)  // r[g + o] lane l: word 4l + o of rows g .. g + 3
        for (int o = 0; o < 2; o++) {
            r[g + 2 * o] = _mm512_unpacklo_epi64(t[g + o], t[g + o + 2]);
            r[g + 2 * o + 1] = _mm512_unpackhi_epi64(t[g + o], t[g + o + 2]);
        }
    for (int o = 0; o < 4; o++) {  // the 128-bit lanes of r[o], r[4 + o], r[8 + o], r[12 + o] transposed
        __m512i p0 = _mm512_shuffle_i32x4(r[o], r[4 + o], 0x44), p1 = _mm512_shuffle_i32x4(r[o], r[4 + o], 0xee);
        __m512i p2 = _mm512_shuffle_i32x4(r[8 + o], r[12 + o], 0x44), p3 = _mm512_shuffle_i32x4(r[8 + o], r[12 + o], 0xee);
        t[o] = _mm512_shuffle_i32x4(p0, p2, 0x88), t[4 + o] = _mm512_shuffle_i32x4(p0, p2, 0xdd);
        t[8 + o] = _mm512_shuffle_i32x4(p1, p3, 0x88), t[12 + o] = _mm512_shuffle_i32x4(p1, p3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// 2^x to about 1.2e-4 in the lanes keep sets, 0 in the others and for x <= -125: x rounded to sixteenths by adding
// GRID, 2^(i/16) looked up in registers, and a line for 2^r on |r| <= 1/32. One FMA where a degree-3 polynomial took
// three, besides a max, a roundscale and a scalef: FMAs wait on the units dpbf16 runs on (the bf16 attention over
// 4096 positions x 22 layers, Zen 4: 0.98x the time from L3). The attention's weights are rounded to 8 bits after
// it (bf16, a step of 4e-3, or uint8 over an int8 cache), so a closer 2^x changes nothing they keep.
static constexpr float GRID = 786432.f;  // 1.5 x 2^19: sums near it are rounded to sixteenths
static inline __m512 exp2_grid(__m512 x, __mmask16 keep) {
    const __m512 t = _mm512_add_ps(x, _mm512_set1_ps(GRID));  // i / 16 in its low mantissa bits, over 2^18 + n
    keep = _mm512_mask_cmp_ps_mask(keep, x, _mm512_set1_ps(-125.f), _CMP_GT_OQ);
    const __m512 r = _mm512_sub_ps(x, _mm512_sub_ps(t, _mm512_set1_ps(GRID)));
    const __m512i ti = _mm512_castps_si512(t);
    // a + b r: 2^r on |r| <= 1/32 (minimax relative error), times 2^(i/16)
    const __m512 a = _mm512_setr_ps(1.000117f, 1.044396f, 1.0906353f, 1.1389219f, 1.1893463f, 1.2420031f,
                                    1.2969913f, 1.354414f, 1.414379f, 1.4769989f, 1.5423913f, 1.6106788f,
                                    1.6819896f, 1.7564576f, 1.8342227f, 1.9154306f);
    const __m512 b = _mm512_setr_ps(0.69312f, 0.72380704f, 0.75585272f, 0.78931718f, 0.82426324f, 0.86075649f,
                                    0.89886543f, 0.9386616f, 0.9802197f, 1.0236177f, 1.0689372f, 1.1162631f,
                                    1.1656842f, 1.2172935f, 1.2711877f, 1.327468f);
    const __m512 p = _mm512_fmadd_ps(_mm512_permutexvar_ps(ti, b), r, _mm512_permutexvar_ps(ti, a));
    const __m512i e = _mm512_and_si512(_mm512_slli_epi32(ti, 19), _mm512_set1_epi32(0xff800000));
    return _mm512_castsi512_ps(_mm512_maskz_add_epi32(keep, _mm512_castps_si512(p), e));
}


// One row's scores over a block of positions (nb of BJ in s): those past nb, and those its mask row m hides (m null:
// none), set to -inf. Returns their maximum.
static inline float masked_max(float* s, int64_t nb, int64_t BJ, const uint8_t* m) {
    for (int64_t j = (nb + 15) / 16 * 16; j < BJ; j++) s[j] = -INFINITY;
    if (m)
        for (int64_t j = 0; j < nb; j++)
            if (!m[j]) s[j] = -INFINITY;
    __m512 top = _mm512_loadu_ps(s);
    for (int64_t j = 16; j < BJ; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    return _mm512_reduce_max_ps(top);
}

// A row's running maximum row[0] raised to m, its sum row[1] and output row[2..] rescaled by e^(row[0] - m)
static inline void raise_max(float* row, float m, int64_t D) {
    if (m > row[0]) {
        const float c = expf(row[0] - m);
        row[0] = m, row[1] *= c;
        for (int64_t d = 0; d < D; d++) row[2 + d] *= c;
    }
}
#endif

// where the attention asks for K and V: into L1 (T0), or into L2 (T1) on a core with less L1 (see below)
#ifndef KV_HINT
#define KV_HINT _MM_HINT_T0
#endif

// F<D, n> for n in 1..8 rows, n known only at run time (the attention kernels' row tiles)
#define BY8(F, D, n, ...) switch (n) { \
    case 8: F<D, 8>(__VA_ARGS__); break; case 7: F<D, 7>(__VA_ARGS__); break; case 6: F<D, 6>(__VA_ARGS__); break; \
    case 5: F<D, 5>(__VA_ARGS__); break; case 4: F<D, 4>(__VA_ARGS__); break; case 3: F<D, 3>(__VA_ARGS__); break; \
    case 2: F<D, 2>(__VA_ARGS__); break; default: F<D, 1>(__VA_ARGS__); }

#ifdef __AVX512BF16__
// With AVX512-BF16, dpbf16 multiplies bf16 pairs exactly into fp32: the scores and the weighted sum take half the
// instructions of widening then an FMA, and K and V are never widened. The weights e^(s - m) are rounded to bf16 for
// it, as transformers' eager attention rounds them in a bf16 model. K and V are asked for KV_AHEAD bytes ahead of
// their reads, into L1: over 4096 positions x 22 layers on a Zen 5, 2 and 8 KB ahead took 2-3% longer, 1 and 16 KB 14%,
// the hardware prefetcher alone 73%; the T1 hint 31% longer, NTA the same. A core with less L1 than a Zen 5's 48 KB
// asks into L2 instead (KV_HINT, set by cpu_gemv.targets): on a Zen 4 (32 KB) a block's 8 KB of K and of V with the
// next block's asked for did not fit, and with T1 the attention took 0.64-0.66x the time it took with T0 (over an
// int8 cache, attend_chunk_int8, 0.71x). There, over a cache in 2 MB pages (model.cache_zeros), 7 KB ahead took
// 0.91-0.97x the time of 4 KB (40-60 alternating rounds, memory fast and slow; 5 KB 0.93-0.95x, 6 KB 0.96-0.97x, 8 KB,
// past the block, 1.07x), and the compiled int4 step's extra time at 4096 positions 0.92x (14 rounds): KV_AHEAD is
// 7168 there (cpu_gemv.targets).
#ifndef KV_AHEAD
#define KV_AHEAD 4096
#endif

static inline __m512i pair(const uint16_t* p) {  // two bf16, broadcast
    uint32_t u;
    memcpy(&u, p, 4);
    return _mm512_set1_epi32(u);
}

// The scores' vectors: 16 lanes, padded(RT) rows by E = 16 / padded(RT). Lane r * E + e of a product holds row r's
// sum over K's dimension pairs e, e + E, e + 2E, ..., and after fold_all lane r * E + e holds row r's score at
// position e of E: no transposition of K (16 x 16 words, 8 shuffles a position at 8 rows) and no sums across lanes,
// but E - 1 folds for E positions. Over 4096 positions x 22 layers on a Zen 4 (8 rows): 0.85-0.87x the time of the
// transposition from L3, with the changes to the softmax below.
static constexpr int padded(int rows) { return rows > 4 ? 8 : rows > 2 ? 4 : rows; }  // to a power of 2

// K's E dimension pairs at p, broadcast to every row's lanes
template <int E>
static inline __m512i kpairs(const uint16_t* p) {
    if constexpr (E == 2) {
        int64_t u;
        memcpy(&u, p, 8);
        return _mm512_set1_epi64(u);
    } else if constexpr (E == 4) {
        return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
    } else if constexpr (E == 8) {
        return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
    } else {
        return _mm512_loadu_si512(p);
    }
}

// qv[g][r * E + e]: row r's dimension pair g * E + e of RT rows of bf16 q (D apart); 0 for rows RT .. P - 1
template <int D, int RT>
static inline void arrange_q(const uint16_t* q, uint32_t* qv) {
    constexpr int P = padded(RT), E = 16 / P;
    for (int g = 0; g < D / 2 / E; g++)
        for (int r = 0; r < P; r++)
            for (int e = 0; e < E; e++) {
                uint32_t u = 0;
                if (r < RT) memcpy(&u, q + r * D + 2 * (g * E + e), 4);
                qv[g * 16 + r * E + e] = u;
            }
}

// x's lanes l and l ^ H swapped
template <int H>
static inline __m512 swap_lanes(__m512 x) {
    if constexpr (H == 1) return _mm512_permute_ps(x, 0xb1);
    else if constexpr (H == 2) return _mm512_permute_ps(x, 0x4e);
    else if constexpr (H == 4) return _mm512_shuffle_f32x4(x, x, 0xb1);
    else return _mm512_shuffle_f32x4(x, x, 0x4e);
}

// Lanes with bit H clear: a's lanes l and l ^ H summed; lanes with bit H set: b's
template <int H>
static inline __m512 fold(__m512 a, __m512 b) {
    constexpr __mmask16 set = H == 1 ? 0xaaaa : H == 2 ? 0xcccc : H == 4 ? 0xf0f0 : 0xff00;
    return _mm512_add_ps(_mm512_mask_blend_ps(set, a, b), swap_lanes<H>(_mm512_mask_blend_ps(set, b, a)));
}

// E products (positions 0 .. E - 1) folded into one vector of scores, lane r * E + e: row r at position e
template <int E>
static inline __m512 fold_all(__m512* x) {
    if constexpr (E >= 16)
        for (int t = 0; t < 8; t++) x[t] = fold<8>(x[t], x[t + 8]);
    if constexpr (E >= 8)
        for (int t = 0; t < 4; t++) x[t] = fold<4>(x[t], x[t + 4]);
    if constexpr (E >= 4)
        for (int t = 0; t < 2; t++) x[t] = fold<2>(x[t], x[t + 2]);
    return E >= 2 ? fold<1>(x[0], x[1]) : x[0];
}

// Rows of the scores s (lanes as weights_bf16's) whose maximum mr[r] (log2 units) a seen score passes by more than
// 8: the maximum raised to it, the row's output, its sums in l (returned) and its weights already written (positions
// [0, n) of w) rescaled by 2^(m - new m). Out of line: rare, and inline its registers crowded the loop's.
template <int D, int RT>
__attribute__((noinline)) static __m256 raise_max_bf16(__m512 s, __mmask16 seen, float scale, float* mr, float* part,
                                                       __m256 l, uint16_t* w, int64_t n) {
    constexpr int E = 16 / padded(RT);
    alignas(64) float sv[16];
    _mm512_store_ps(sv, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
    for (int r = 0; r < RT; r++) {
        float x = -INFINITY;
        for (int e = 0; e < E; e++)
            if (seen >> (r * E + e) & 1) x = sv[r * E + e] > x ? sv[r * E + e] : x;
        if (!(x > mr[r] + 8.f)) continue;
        const float f = exp2f(mr[r] - x);  // 0 from -inf: nothing seen before
        mr[r] = x;
        for (int d = 0; d < D; d++) part[r * (D + 2) + 2 + d] *= f;
        l = _mm256_mask_mul_ps(l, ((1u << E / 2) - 1) << (r * E / 2), l, _mm256_set1_ps(f));
        for (int64_t i = 0; i < n; i++) {
            uint16_t& y = w[i / E * 16 + r * E + i % E];
            y = to_bf16(from_bf16(y) * f);
        }
    }
    return l;
}

// The weights of RT rows of q (arranged by arrange_q in qv) over n positions of K (D apart), bf16, into w: E
// positions of every row (lanes as the scores') in each 16 of w. 16 positions at a time: a product of each position
// with q's E pairs broadcast, one dpbf16 for all rows, then E - 1 folds for each E positions, and the softmax taken
// on the scores in registers. Scores come scaled by log2(e) / sqrt(D), the weights being 2^(s - m) for a row's
// running maximum m (row[0] of the rows in part, D + 2 apart), which is raised only when a score passes it by more
// than 8 (weights up to 256): at a row's first 16 positions, and rarely after. The weights, as rounded, are summed
// in l, E / 2 lanes a row. Mask rows m (S of them, L apart, row r0 + r's at (r0 + r) % S; null: every
// position seen) hide positions; so do those past n (weights 0). Asks for K `far` bytes ahead unless far is 0, and,
// vector after vector of every 16 positions, for `per` bytes more of next[0] and of next[1] (the next block's K and
// V past what the reads ask for).
template <int D, int RT>
static inline void weights_bf16(const uint32_t* qv, const uint16_t* k, int64_t n, float scale, const uint8_t* m,
                                int64_t r0, int64_t S, int64_t L, float* part, __m256& sums, uint16_t* w,
                                int64_t far, const char* const* next, int64_t per) {
    constexpr int P = padded(RT), E = 16 / P;
    constexpr __mmask16 rows = (1u << (RT * E)) - 1;  // the lanes of rows, not padding
    static thread_local uint16_t tail[16 * D];  // the last positions, then zeros: no reads past n
    const __m512i row_of = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             __builtin_ctz(E));
    alignas(64) float mr[16];
    for (int r = 0; r < 16; r++) mr[r] = r < RT ? part[r * (D + 2)] : -INFINITY;
    const float iscale = 1.f / scale;  // the test against m on the products as they come
    __m256 l = sums;  // in a register: through memory, each vector's sum waited on the one before it
    const __m256bh ones = (__m256bh)_mm256_set1_epi16(0x3f80);
    __m512 mv = _mm512_permutexvar_ps(row_of, _mm512_load_ps(mr));
    __m512 top = _mm512_mul_ps(_mm512_add_ps(mv, _mm512_set1_ps(8.f)), _mm512_set1_ps(iscale));
    for (int64_t j = 0; j < n; j += 16) {
        const uint16_t* kb = k + j * D;
        if (n - j < 16) {
            memcpy(tail, kb, (n - j) * D * 2);
            memset(tail + (n - j) * D, 0, (16 - (n - j)) * D * 2);
            kb = tail;
        }
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int g = 0; g < D / 2 / E; g++) {
            const __m512i qg = _mm512_loadu_si512(qv + 16 * g);
            // the requests for K spread over the products: all 16 positions' at once took 1.03-1.05x the time over a
            // cache in 2 MB pages, from memory and from L3 (Zen 4, 30-40 alternating rounds)
            if (far)
                for (int e = 0; e < E; e++) _mm_prefetch((const char*)(k + j * D) + far + 64 * (g * E + e), KV_HINT);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = dp(acc[i], kpairs<E>(kb + i * D + 2 * E * g), qg);
        }
        uint32_t seen_r[RT];  // each row's positions j .. j + 15 seen (bits)
        for (int r = 0; r < RT; r++) {
            seen_r[r] = n - j >= 16 ? 0xffff : (1u << (n - j)) - 1;
            if (m) {  // a masked load reads nothing past n
                const __m128i b = _mm_maskz_loadu_epi8(seen_r[r], m + (r0 + r) % S * L + j);
                seen_r[r] = _mm_test_epi8_mask(b, b);
            }
        }
        // the scores and which are seen; their maximum over the 16 positions decides a raise before any weight is
        // written: a row's first maximum is that of its first 16 positions, not of its first E, and its largest weight
        // is then often exactly 1, which bf16 keeps (with the first E, outputs over 19 positions missed the tests'
        // bf16 tolerance)
        __m512 sc[P], top16 = _mm512_set1_ps(-INFINITY);
        __mmask16 seen[P], any = 0;
#pragma GCC unroll 8
        for (int c = 0; c < P; c++) {
            sc[c] = fold_all<E>(acc + c * E);
            if (!m && n - j >= 16) {
                seen[c] = rows;
            } else {
                seen[c] = 0;
                for (int r = 0; r < RT; r++) seen[c] |= (seen_r[r] >> (c * E) & ((1u << E) - 1)) << (r * E);
            }
            top16 = _mm512_mask_max_ps(top16, seen[c], top16, sc[c]), any |= seen[c];
        }
        if (_mm512_mask_cmp_ps_mask(any, top16, top, _CMP_GT_OQ)) {  // rows whose maximum rises
            l = raise_max_bf16<D, RT>(top16, any, scale, mr, part, l, w, j);
            mv = _mm512_permutexvar_ps(row_of, _mm512_load_ps(mr));
            top = _mm512_mul_ps(_mm512_add_ps(mv, _mm512_set1_ps(8.f)), _mm512_set1_ps(iscale));
        }
#pragma GCC unroll 8
        for (int c = 0; c < P; c++) {
            for (int64_t i = per * (j / 16 * P + c); i < per * (j / 16 * P + c + 1); i += 64)
                _mm_prefetch(next[0] + i, KV_HINT), _mm_prefetch(next[1] + i, KV_HINT);
            const __m512 p = exp2_grid(_mm512_fmsub_ps(sc[c], _mm512_set1_ps(scale), mv), seen[c]);
            const __m256bh pb = _mm512_cvtneps_pbh(p);
            l = _mm256_dpbf16_ps(l, pb, ones);  // the weights as rounded: their errors cancel in out / l
            _mm256_storeu_si256((__m256i*)(w + (j / E + c) * 16), (__m256i)pb);
        }
    }
    for (int r = 0; r < RT; r++) part[r * (D + 2)] = mr[r];
    sums = l;
}

// o_r += sum_j p[r][j] v_j for RT rows of bf16 weights (in weights_bf16's order) over n positions of V (D apart),
// o's rows D + 2 apart in in32's order: V's positions j and j + 1 interleaved by one unpack are the pairs dpbf16
// multiplies. With few rows, a pass over the positions takes several 32-dimension blocks (NB), up to 16 sums: each
// sum waits on its previous dpbf16, and 2 or 6 of them left the unit idle (4096 positions on a Zen 5: 1 row of 64
// dimensions 0.89x the time, 3 rows 0.93x, 2 rows of 128 0.74x, 1 row of 256 0.76x; 8 rows keep one block a pass).
// Asks for V `far` bytes ahead unless far is 0.
template <int D, int RT>
static inline void pv_bf16(const uint16_t* p, const uint16_t* v, int64_t n, float* o, int64_t far) {
    constexpr int NB = RT * (D / 32) <= 8 ? D / 32 : 1, E = 16 / padded(RT);
    for (int d0 = 0; d0 < D; d0 += 32 * NB) {
        __m512 acc[RT][NB][2];
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < NB; c++)
                for (int i = 0; i < 2; i++) acc[r][c][i] = _mm512_loadu_ps(o + r * (D + 2) + d0 + 32 * c + 16 * i);
        for (int64_t j = 0; j < n; j += 2) {
            if (far && d0 == 0)
                for (int i = 0; i < D / 16; i++) _mm_prefetch((const char*)(v + j * D) + far + 64 * i, KV_HINT);
            const uint16_t* pj = p + j / E * 16 + j % E;  // row 0's weights at j and j + 1
            for (int c = 0; c < NB; c++) {
                const int d = d0 + 32 * c;
                __m512i w0 = _mm512_loadu_si512(v + j * D + d);
                __m512i w1 = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * D + d) : _mm512_setzero_si512();
                __m512i a = _mm512_unpacklo_epi16(w0, w1), b = _mm512_unpackhi_epi16(w0, w1);
                for (int r = 0; r < RT; r++) {
                    __m512i x = pair(pj + r * E);
                    acc[r][c][0] = dp(acc[r][c][0], a, x), acc[r][c][1] = dp(acc[r][c][1], b, x);
                }
            }
        }
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < NB; c++)
                for (int i = 0; i < 2; i++) _mm512_storeu_ps(o + r * (D + 2) + d0 + 32 * c + 16 * i, acc[r][c][i]);
    }
}


// attend_chunk with dpbf16 (D 32 or more), q bf16, reading K and V side by side a block of 8 KB each at a time with
// the softmax online (as flash attention does): two steady streams keep memory busy; with all of K read before all
// of V, the weighted sum waited on V. Over 4096 positions x 22 layers on a Zen 5 this took 0.69x the time of
// attend_chunk. On a Zen 4, the softmax taken on the scores in weights_bf16's registers took 0.89-0.93x the time of
// a pass of its own over each block's scores from memory (the same from L3), before the scores' vectors held rows by
// positions.
template <int D>
static void attend_chunk_bf16(const uint16_t* q, float scale, const uint16_t* k, const uint16_t* v,
                              const uint8_t* mask, int64_t S, int64_t L, int64_t R, int64_t j0, int64_t j1,
                              float* part) {
    constexpr int64_t BJ = 4096 / D;  // positions per block: 8 KB of K and of V
    static thread_local vec<uint16_t> pb;  // [R / 8][BJ / E][16] a block's weights, 8 rows at a time
    static thread_local vec<uint32_t> qv;  // [R / 8][4 D] q's pairs as weights_bf16 reads them
    static thread_local vec<float> ls;  // [R / 8][8] the weights summed
    int64_t lo, hi;
    span(mask, S, L, j0, j1, &lo, &hi);
    clear(part, R, D);
    if (lo >= hi) return;
    const int64_t tiles = (R + 7) / 8;
    pb.resize(tiles * 8 * BJ), qv.resize(tiles * 4 * D), ls.assign(tiles * 8, 0.f);
    __m256* l = (__m256*)ls.data();
    for (int64_t r = 0; r < R; r += 8) BY8(arrange_q, D, R - r < 8 ? R - r : 8, q + r * D, &qv[r / 8 * 4 * D])
    const uint8_t* m = sees_all(mask, S, L, lo, hi) ? nullptr : mask;
    // With 8 or more rows the softmax takes long enough for memory to go idle: the rows ask for shares of the next
    // block's K and V past KV_AHEAD as their weights come out (4096 positions x 22 layers on a Zen 4: without them,
    // 1.08x the time from memory). With fewer rows the rest of the block is short, and these requests crowded the
    // ones it makes (on a Zen 5, when a pass over the scores of its own took the softmax: 6 rows 0.96-1.04x, 4 rows
    // 1.04x, 1 row 1.16x).
    constexpr int64_t rest = BJ * D * 2 - KV_AHEAD, slots = BJ / 16 * 8;  // a slot: one of 8 vectors of scores
    const int64_t per = R >= 8 ? (rest / 64 + slots - 1) / slots * 64 : 0;
    const float scale2 = scale * 1.44269504f;  // 2^(s log2(e)) = e^s
    for (int64_t b = lo; b < hi; b += BJ) {
        const int64_t nb = BJ < hi - b ? BJ : hi - b;
        const char* next[2] = {(const char*)(k + (b + BJ) * D) + KV_AHEAD, (const char*)(v + (b + BJ) * D) + KV_AHEAD};
        for (int64_t r = 0; r < R; r += 8)
            BY8(weights_bf16, D, R - r < 8 ? R - r : 8, &qv[r / 8 * 4 * D], k + b * D, nb, scale2, m ? m + b : m, r,
                S, L, part + r * (D + 2), l[r / 8], &pb[r * BJ], r ? 0 : KV_AHEAD, next, r ? 0 : per)
        for (int64_t r = 0; r < R; r += 8)
            BY8(pv_bf16, D, R - r < 8 ? R - r : 8, &pb[r * BJ], v + b * D, nb, part + r * (D + 2) + 2,
                r ? 0 : KV_AHEAD)
    }
    for (int64_t r = 0; r < R; r++) {  // the merge's units: m in e's powers; a row's sum from its E / 2 lanes
        const int64_t t = r / 8, E = 16 / padded(R - t * 8 < 8 ? R - t * 8 : 8);
        part[r * (D + 2)] *= 0.693147181f;
        float sum = 0.f;
        for (int64_t e = 0; e < E / 2; e++) sum += ls[t * 8 + r % 8 * E / 2 + e];
        part[r * (D + 2) + 1] = sum;
    }
}
#endif

// Inside a parallel region: out [B, H, S, D] bf16 from the chunks' parts, each row's chunks weighted by e^(m_c - max m);
// slot(D, d): where the parts keep dimension d
template <int64_t (*slot)(int64_t, int64_t)>
static void merge(const float* parts, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t D,
                  int64_t chunks) {
    const int64_t G = H / Hkv, R = G * S;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < B * Hkv * R; i++) {  // merge the chunks of each row: weights e^(m_c - max m)
        int64_t bh = i / R, r = i % R;
        const float* first = &parts[(bh * chunks) * R * (D + 2) + r * (D + 2)];
        float m = -INFINITY, l = 0.f;
        for (int64_t c = 0; c < chunks; c++) m = fmaxf(m, first[c * R * (D + 2)]);
        float o[256] = {};  // D <= 256
        for (int64_t c = 0; c < chunks; c++) {
            const float* pc = first + c * R * (D + 2);
            if (pc[0] == -INFINITY) continue;
            float w = expf(pc[0] - m);
            l += w * pc[1];
            for (int64_t d = 0; d < D; d++) o[d] += w * pc[2 + d];
        }
        int64_t b = bh / Hkv, h = bh % Hkv * G + r / S, s = r % S;
        for (int64_t d = 0; d < D; d++) out[((b * H + h) * S + s) * D + d] = to_bf16(o[slot(D, d)] / l);
    }
}

// out[B, H, S, D] = softmax(q k^T / sqrt(D) + mask) v, bf16; q [B, H, S, D] contiguous; k and v [B, Hkv, L, D]
// with rows of D contiguous and strides kb, kh; mask [B, S, L] bytes (nonzero: attend), batch stride mb (0: shared).
// D one of 64, 128, 256, 32 or 16; H a multiple of Hkv, query head h reading KV head h / (H / Hkv).
extern "C" void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, uint16_t* out,
                       int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t L, int64_t D, int64_t kb, int64_t kh,
                       int64_t mb) {
#ifdef __AVX512BF16__
    const bool fp32 = D < 32;  // attend_chunk_bf16 reads q as it is
#else
    const bool fp32 = true;
#endif
    // attend_chunk holds all of a task's scores at once: CHUNK positions of them
    const int64_t chunk = fp32 ? CHUNK : chunk_for(L, B * Hkv);
    const int64_t G = H / Hkv, R = G * S, chunks = (L + chunk - 1) / chunk, tasks = B * Hkv * chunks;
    // scratch kept between calls (a layer's attention runs every step), named by pointer in the parallel regions:
    // there a thread_local name would be each worker's own
    static thread_local vec<float> qf_, parts_;
    parts_.resize(tasks * R * (D + 2));
    const float scale = 1.f / sqrtf((float)D);
    // q in fp32, scaled, in in16's order, and 8 zero rows: padding. 16 at a time, unpacked as K is: element by
    // element it took 3.6 us of the 15 us a call over 33 positions took (32 heads of 64, Zen 3), a decode step's
    // attention being mostly such fixed costs.
    if (fp32) {
        const int64_t n = B * H * S * D;  // a multiple of 16
        qf_.resize(n + 8 * D);
        memset(&qf_[n], 0, 8 * D * sizeof(float));
        for (int64_t i = 0; i < n; i += 16) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(q + i));
            _mm256_storeu_ps(&qf_[i], _mm256_mul_ps(lo(w), _mm256_set1_ps(scale)));
            _mm256_storeu_ps(&qf_[i + 8], _mm256_mul_ps(hi(w), _mm256_set1_ps(scale)));
        }
    }
    float *qf = qf_.data(), *parts = parts_.data();
    // the tasks shared as products share rows (share_rows): over 4096 positions, 0.97x the time of a static split
    const int nt = omp_get_max_threads();
    std::vector<Range>& ranges = split_ranges(tasks, nt);
    #pragma omp parallel num_threads(nt)  // one region for the tasks and the merge: a second one cost ~4 us a call
    {
        take_shared(ranges, nt, 1, [&](int64_t t, int64_t) {
            int64_t b = t / (Hkv * chunks), h = t / chunks % Hkv, c = t % chunks;
            // the group's query rows are consecutive in q: heads h * G .. h * G + G - 1, each S rows (row r: s = r % S)
            const int64_t q0 = (b * H + h * G) * S * D;
            const uint16_t *kt = k + b * kb + h * kh, *vt = v + b * kb + h * kh;
            const int64_t j0 = c * chunk, j1 = j0 + chunk < L ? j0 + chunk : L;
            float* part = &parts[t * R * (D + 2)];
#ifdef __AVX512BF16__
            const uint16_t* qb = q + q0;
            switch (D) {
                case 64: attend_chunk_bf16<64>(qb, scale, kt, vt, mask + b * mb, S, L, R, j0, j1, part); return;
                case 128: attend_chunk_bf16<128>(qb, scale, kt, vt, mask + b * mb, S, L, R, j0, j1, part); return;
                case 256: attend_chunk_bf16<256>(qb, scale, kt, vt, mask + b * mb, S, L, R, j0, j1, part); return;
                case 32: attend_chunk_bf16<32>(qb, scale, kt, vt, mask + b * mb, S, L, R, j0, j1, part); return;
            }
#endif
            const float* qt = qf + q0;
            const uint8_t* mt = mask + b * mb;
            switch (D) {
                case 64: attend_chunk<64>(qt, kt, nullptr, vt, nullptr, mt, S, L, R, j0, j1, part); break;
                case 128: attend_chunk<128>(qt, kt, nullptr, vt, nullptr, mt, S, L, R, j0, j1, part); break;
                case 256: attend_chunk<256>(qt, kt, nullptr, vt, nullptr, mt, S, L, R, j0, j1, part); break;
                case 32: attend_chunk<32>(qt, kt, nullptr, vt, nullptr, mt, S, L, R, j0, j1, part); break;
                default: attend_chunk<16>(qt, kt, nullptr, vt, nullptr, mt, S, L, R, j0, j1, part);
            }
        });
        #pragma omp barrier
        merge<out_slot>(parts, out, B, H, Hkv, S, D, chunks);
    }
}

#ifdef __AVX512VNNI__
// An int8 KV cache: K and V rounded per position and head to int8 with a float scale, half the bytes of bf16. The
// scores multiply q, rounded to int8 per row, by K with dpbusd, 64 products an instruction (dpbf16 does 32), and the
// weighted sum rounds the block's weights e^(s - m) times V's scales to 8 bits per row, for dpbusd again. Fewer
// instructions as well as fewer bytes: the bf16 kernel above was already bound by its instructions at 4k positions.
// K is asked for KV_AHEAD8 bytes ahead of the scores, and V during the scores, as the same positions of K are read:
// over 4096 positions x 22 layers on a Zen 5, 0.86x the time of asking for V during the weighted sum, 4 KB ahead.
enum { KV_AHEAD8 = 8192 };

static inline __m512i bcast4(const uint8_t* p) {  // four bytes, broadcast
    uint32_t u;
    memcpy(&u, p, 4);
    return _mm512_set1_epi32(u);
}

// s[r][j] = qs[r] ks[j] q_r . k_j for RT rows of q + 128 (uint8, D apart, so that dpbusd's unsigned operand is q) and
// n positions of int8 K (D apart), 16 positions at a time, K transposed in registers (transpose16) so that one dpbusd
// multiplies 4 dimensions of 16 positions by q's broadcast; the 128 sum(k_j) the offset adds is taken off, counted
// by one more dpbusd. Positions past n score -inf.
template <int D, int RT>
static inline void qk_int8(const uint8_t* q, const float* qs, const int8_t* k, const float* ks, int64_t n, float* s,
                           int64_t ld, int64_t far, const int8_t* v) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t j = 0; j < n; j += 16) {
        if (far)
            for (int i = 0; i < D / 4; i++) _mm_prefetch((const char*)(k + j * D) + far + 64 * i, KV_HINT);
        if (far)
            for (int i = 0; i < D / 4; i++) _mm_prefetch((const char*)(v + j * D) + 64 * i, KV_HINT);
        __m512i acc[RT], sum = _mm512_setzero_si512();
        for (int r = 0; r < RT; r++) acc[r] = _mm512_setzero_si512();
        for (int d = 0; d < D; d += 64) {
            __m512i t[16];
            for (int i = 0; i < 16; i++)
                t[i] = j + i < n ? _mm512_loadu_si512(k + (j + i) * D + d) : _mm512_setzero_si512();
            transpose16(t);  // t[p] lane i: dimensions d + 4p .. d + 4p + 3 of position j + i
            for (int p = 0; p < 16; p++) {
                sum = _mm512_dpbusd_epi32(sum, ones, t[p]);
                for (int r = 0; r < RT; r++) acc[r] = _mm512_dpbusd_epi32(acc[r], bcast4(q + r * D + d + 4 * p), t[p]);
            }
        }
        __mmask16 live = n - j >= 16 ? 0xffff : (1u << (n - j)) - 1;
        const __m512 scale = _mm512_maskz_loadu_ps(live, ks + j);
        const __m512i fix = _mm512_slli_epi32(sum, 7);
        for (int r = 0; r < RT; r++) {
            __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], fix));
            _mm512_storeu_ps(s + r * ld + j, _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, x,
                                                               _mm512_mul_ps(scale, _mm512_set1_ps(qs[r]))));
        }
    }
}

// o_r += ws[c][r] sum_j w[c][r][j] v_j for RT rows of uint8 weights over n positions of int8 V (D apart), dimensions
// 32c .. 32c + 31 with their own weights (w's sets cs apart, rows ld apart, zero from n to a multiple of 4; ws's sets
// wcs apart): four positions' bytes interleaved by two unpacks are what dpbusd sums in a lane, and a vector's lanes
// 0-7 hold the first 32 of its 64 dimensions. o (rows D + 2 apart) keeps dimension d + 16l + 4m + i at
// d + 16m + 4l + i in each 64 (see slot8).
template <int D, int RT>
static inline void pv_int8(const uint8_t* w, int64_t cs, int64_t ld, const float* ws, int64_t wcs, const int8_t* v,
                           int64_t n, float* o) {
    for (int h = 0; h < 2 * D / 64; h++) {  // a half of 64 dimensions: the unpacks it needs, for every row
        const int d = h / 2 * 64;
        const uint8_t *w0 = w + d / 32 * cs, *w1 = w0 + cs;
        __m512i acc[RT][2];
        for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int64_t j = 0; j < n; j += 4) {
            __m512i x[4];
            for (int i = 0; i < 4; i++)
                x[i] = j + i < n ? _mm512_loadu_si512(v + (j + i) * D + d) : _mm512_setzero_si512();
            __m512i a, c;
            if (h % 2 == 0) a = _mm512_unpacklo_epi8(x[0], x[1]), c = _mm512_unpacklo_epi8(x[2], x[3]);
            else a = _mm512_unpackhi_epi8(x[0], x[1]), c = _mm512_unpackhi_epi8(x[2], x[3]);
            const __m512i lo = _mm512_unpacklo_epi16(a, c), hi = _mm512_unpackhi_epi16(a, c);
            for (int r = 0; r < RT; r++) {
                uint32_t u;
                memcpy(&u, w1 + r * ld + j, 4);
                const __m512i wr = _mm512_mask_set1_epi32(bcast4(w0 + r * ld + j), 0xff00, u);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], wr, lo), acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], wr, hi);
            }
        }
        for (int r = 0; r < RT; r++) {
            const float* wsr = ws + d / 32 * wcs + r;
            const __m512 scale = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(wsr[0]), _mm512_set1_ps(wsr[wcs]));
            for (int m = 0; m < 2; m++) {
                float* op = o + r * (D + 2) + d + 16 * (2 * (h % 2) + m);
                _mm512_storeu_ps(op, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][m]), scale, _mm512_loadu_ps(op)));
            }
        }
    }
}

static inline int64_t slot8(int64_t, int64_t d) {  // where pv_int8 keeps dimension d
    const int64_t e = d % 64;
    return d - e + (e % 16 / 4) * 16 + e / 16 * 4 + e % 4;
}

// attend_chunk_bf16 over an int8 cache: q as q + 128 in uint8 with qs its scales (times 1/sqrt(D)), K with a scale
// per position (ks), V with one per position and 32 dimensions (vs, D / 32 a position). Blocks of 8 KB of K and of
// V, the softmax online.
template <int D>
static void attend_chunk_int8(const uint8_t* q, const float* qs, const int8_t* k, const float* ks, const int8_t* v,
                              const float* vs, const uint8_t* mask, int64_t S, int64_t L, int64_t R, int64_t j0,
                              int64_t j1, float* part) {
    constexpr int64_t BJ = 8192 / D, NC = D / 32;
    static thread_local vec<float> sc;  // [R][BJ] a block's scores
    static thread_local vec<uint8_t> pb;  // [NC][R][BJ] its weights times V's scales, rounded to 8 bits
    static thread_local vec<float> pw, vsb;  // [NC][R] their scales; [NC][BJ] the block's V scales, 0 past its end
    int64_t lo, hi;
    span(mask, S, L, j0, j1, &lo, &hi);
    clear(part, R, D);
    if (lo >= hi) return;
    sc.resize(R * BJ), pb.resize(NC * R * BJ), pw.resize(NC * R), vsb.resize(NC * BJ);
    const bool all = sees_all(mask, S, L, lo, hi);
    for (int64_t b = lo; b < hi; b += BJ) {
        const int64_t nb = BJ < hi - b ? BJ : hi - b;
        for (int64_t r = 0; r < R; r += 8)
            BY8(qk_int8, D, R - r < 8 ? R - r : 8, q + r * D, qs + r, k + b * D, ks + b, nb, &sc[r * BJ], BJ,
                r ? 0 : KV_AHEAD8, v + b * D)
        float vtop[NC];  // V's scales by 32 dimensions (NC a position, 2-8), 16 positions at a time
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 vbig[NC];
        for (int64_t c = 0; c < NC; c++) vbig[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < BJ; j += 16) {
            const int64_t left = nb - j;  // positions of the block left from j
            __m512 x[NC];
            if (NC == 2) {  // two loads, deinterleaved: cheaper than gathers
                const __mmask16 lo = left >= 8 ? 0xffff : left > 0 ? (1u << 2 * left) - 1 : 0;
                const __mmask16 hi = left >= 16 ? 0xffff : left > 8 ? (1u << 2 * (left - 8)) - 1 : 0;
                const __m512 a = _mm512_maskz_loadu_ps(lo, vs + (b + j) * 2);
                const __m512 c = _mm512_maskz_loadu_ps(hi, vs + (b + j) * 2 + 16);
                const __m512i even = _mm512_slli_epi32(lane, 1);
                x[0] = _mm512_permutex2var_ps(a, even, c);
                x[NC - 1] = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), c);
            } else {
                const __mmask16 live = left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1 : 0;
                const __m512i at = _mm512_mullo_epi32(lane, _mm512_set1_epi32(NC));
                for (int64_t c = 0; c < NC; c++)
                    x[c] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, vs + (b + j) * NC + c, 4);
            }
            for (int64_t c = 0; c < NC; c++)
                vbig[c] = _mm512_max_ps(vbig[c], x[c]), _mm512_storeu_ps(&vsb[c * BJ + j], x[c]);
        }
        for (int64_t c = 0; c < NC; c++) {  // V's scales over the block's largest, times 255: for every row
            vtop[c] = _mm512_reduce_max_ps(vbig[c]);
            const __m512 g = _mm512_set1_ps(vtop[c] > 0.f ? 255.f / vtop[c] : 0.f);
            for (int64_t j = 0; j < BJ; j += 16)
                _mm512_storeu_ps(&vsb[c * BJ + j], _mm512_mul_ps(_mm512_loadu_ps(&vsb[c * BJ + j]), g));
        }
        for (int64_t r = 0; r < R; r++) {
            float* s = &sc[r * BJ];
            const float bm = masked_max(s, nb, BJ, all ? nullptr : mask + (r % S) * L + b);
            float* row = part + r * (D + 2);
            for (int64_t c = 0; c < NC; c++) pw[c * R + r] = 0.f;
            if (bm == -INFINITY) {  // nothing seen in this block: weights 0
                for (int64_t c = 0; c < NC; c++) memset(&pb[(c * R + r) * BJ], 0, BJ);
                continue;
            }
            const float m = fmaxf(row[0], bm);
            raise_max(row, m, D);
            // the weights are e^(s - bm) e^(bm - m): every one times its V scale is at most e^(bm - m) times the
            // block's largest V scale, so e^(s - bm) times V's scale over that largest, times 255, rounds to 8 bits
            // as it comes out, in one pass, and e^(bm - m) goes into the scale pv_int8 multiplies by
            const float e = expf(bm - m);
            for (int64_t c = 0; c < NC; c++) pw[c * R + r] = e * vtop[c] / 255.f;
            const __m512 l2e = _mm512_set1_ps(1.44269504f), m16 = _mm512_set1_ps(bm * 1.44269504f);  // 2^x units
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < BJ; j += 16) {
                __m512 p = exp2_grid(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), l2e, m16), 0xffff);
                sum = _mm512_add_ps(sum, p);
                for (int64_t c = 0; c < NC; c++) {
                    __m512 w = _mm512_mul_ps(p, _mm512_loadu_ps(&vsb[c * BJ + j]));
                    _mm_storeu_si128((__m128i*)&pb[(c * R + r) * BJ + j],
                                     _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(w)));
                }
            }
            row[1] += e * _mm512_reduce_add_ps(sum);
        }
        for (int64_t r = 0; r < R; r += 8)
            BY8(pv_int8, D, R - r < 8 ? R - r : 8, &pb[r * BJ], R * BJ, BJ, &pw[r], R, v + b * D, nb,
                part + r * (D + 2) + 2)
    }
}

// attend() over an int8 cache: k and v [B, Hkv, L, D] int8 (strides kb, kh), K's scales [B, Hkv, L] float (strides
// ksb, ksh), V's [B, Hkv, L, D / 32] (strides vsb, vsh, D / 32, 1); D 64, 128 or 256.
extern "C" void attend_int8(const uint16_t* q, const int8_t* k, const float* ks, const int8_t* v, const float* vs,
                            const uint8_t* mask, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                            int64_t L, int64_t D, int64_t kb, int64_t kh, int64_t ksb, int64_t ksh, int64_t vsb,
                            int64_t vsh, int64_t mb) {
    const int64_t chunk = chunk_for(L, B * Hkv);
    const int64_t G = H / Hkv, R = G * S, chunks = (L + chunk - 1) / chunk, tasks = B * Hkv * chunks, rows = B * H * S;
    static thread_local vec<float> parts_, qs_;
    static thread_local vec<uint8_t> q8_;
    parts_.resize(tasks * R * (D + 2)), qs_.resize(rows), q8_.resize(rows * D);
    auto widen = [](const uint16_t* p) {  // 16 bf16 as fp32
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    };
    for (int64_t i = 0; i < rows; i++) {  // q rounded to int8 per row, offset by 128
        __m512 big = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) big = _mm512_max_ps(big, _mm512_abs_ps(widen(q + i * D + d)));
        const float top = _mm512_reduce_max_ps(big);
        const __m512 f = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
        for (int64_t d = 0; d < D; d += 16) {
            __m512i x = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(widen(q + i * D + d), f)),
                                         _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i*)&q8_[i * D + d], _mm512_cvtusepi32_epi8(x));
        }
        qs_[i] = top / 127.f / sqrtf((float)D);
    }
    float *parts = parts_.data(), *qs = qs_.data();
    const uint8_t* q8 = q8_.data();
    const int nt = omp_get_max_threads();  // the tasks shared as attend's are
    std::vector<Range>& ranges = split_ranges(tasks, nt);
    #pragma omp parallel num_threads(nt)
    {
        take_shared(ranges, nt, 1, [&](int64_t t, int64_t) {
            int64_t b = t / (Hkv * chunks), h = t / chunks % Hkv, c = t % chunks;
            const int64_t q0 = (b * H + h * G) * S;  // the group's first query row
            const int8_t *kt = k + b * kb + h * kh, *vt = v + b * kb + h * kh;
            const float *kst = ks + b * ksb + h * ksh, *vst = vs + b * vsb + h * vsh;
            const int64_t j0 = c * chunk, j1 = j0 + chunk < L ? j0 + chunk : L;
            float* part = &parts[t * R * (D + 2)];
            switch (D) {
                case 64: attend_chunk_int8<64>(q8 + q0 * D, qs + q0, kt, kst, vt, vst, mask + b * mb, S, L, R, j0, j1, part); break;
                case 128: attend_chunk_int8<128>(q8 + q0 * D, qs + q0, kt, kst, vt, vst, mask + b * mb, S, L, R, j0, j1, part); break;
                default: attend_chunk_int8<256>(q8 + q0 * D, qs + q0, kt, kst, vt, vst, mask + b * mb, S, L, R, j0, j1, part);
            }
        });
        #pragma omp barrier
        merge<slot8>(parts, out, B, H, Hkv, S, D, chunks);
    }
}
#else
// attend_int8 without VNNI (AVX2, or AVX-512 without it): attend_chunk over the int8 cache, K and V widened to fp32
// in registers as bf16 ones are, q in fp32 and the weights unrounded: exact attention over the int8 values (up to
// fp32 rounding), reading half the bytes of a bf16 cache instead of a dequantized copy's three times as many.
extern "C" void attend_int8(const uint16_t* q, const int8_t* k, const float* ks, const int8_t* v, const float* vs,
                            const uint8_t* mask, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                            int64_t L, int64_t D, int64_t kb, int64_t kh, int64_t ksb, int64_t ksh, int64_t vsb,
                            int64_t vsh, int64_t mb) {
    const int64_t chunk = CHUNK;  // attend_chunk's score buffer
    const int64_t G = H / Hkv, R = G * S, chunks = (L + chunk - 1) / chunk, tasks = B * Hkv * chunks;
    static thread_local vec<float> qf_, parts_;
    parts_.resize(tasks * R * (D + 2));
    qf_.assign(B * H * S * D + 8 * D, 0.f);  // q in fp32, scaled, and 8 zero rows: padding
    for (int64_t i = 0; i < B * H * S * D; i++) qf_[i] = from_bf16(q[i]) / sqrtf((float)D);
    float *qf = qf_.data(), *parts = parts_.data();
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t b = t / (Hkv * chunks), h = t / chunks % Hkv, c = t % chunks;
            const float* qt = qf + (b * H + h * G) * S * D;
            const int8_t *kt = k + b * kb + h * kh, *vt = v + b * kb + h * kh;
            const float *kst = ks + b * ksb + h * ksh, *vst = vs + b * vsb + h * vsh;
            const int64_t j0 = c * chunk, j1 = j0 + chunk < L ? j0 + chunk : L;
            const uint8_t* mt = mask + b * mb;
            float* part = &parts[t * R * (D + 2)];
            switch (D) {
                case 64: attend_chunk<64>(qt, kt, kst, vt, vst, mt, S, L, R, j0, j1, part); break;
                case 128: attend_chunk<128>(qt, kt, kst, vt, vst, mt, S, L, R, j0, j1, part); break;
                default: attend_chunk<256>(qt, kt, kst, vt, vst, mt, S, L, R, j0, j1, part);
            }
        }
        merge<plain>(parts, out, B, H, Hkv, S, D, chunks);
    }
}
#endif
"""

AVX512 = r"""

// bf16. With AVX512-BF16, dpbf16 multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes: x stays bf16
// and the weights are never widened. Without it, a bf16 widened by a 16-bit shift is its fp32 value.
#ifdef __AVX512BF16__
typedef uint16_t xbf16;
static inline __m512 dp(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }

// AHEAD_BF16: how far ahead (bytes) the product asks for its weights, into L3 (T2); 0, the default, leaves them to
// the hardware prefetcher, fastest on a Zen 5. On a Zen 4 (cpu_gemv.targets: 4096 on cores with less than 48 KB of
// L1) 3-4 KB ahead read TinyLlama's bf16 products from memory 1.05-1.10x as fast, with memory slow and fast; 6-8 KB
// 0.95x, T1 0.92x, NTA 0.84-0.86x, T0 0.79x.
#ifndef AHEAD_BF16
#define AHEAD_BF16 0
#endif
static inline float dot(const uint16_t* x, const uint16_t* w, int64_t K) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)  // 4 chains in flight, the row read front to back
        for (int c = 0; c < 4; c++) {
            if (AHEAD_BF16) _mm_prefetch((const char*)(w + k + 32 * c) + AHEAD_BF16, _MM_HINT_T2);
            a[c] = dp(a[c], _mm512_loadu_si512(w + k + 32 * c), _mm512_loadu_si512(x + k + 32 * c));
        }
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
    static thread_local vec<xbf16> xs_;
    vec<xbf16>& xs = xs_;
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; i++) xs[i] = sizeof(xbf16) == 2 ? x[i] : from_bf16(x[i]);
    share_rows(N, 2 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n = a; n < b; n++)  // each weight row is read from memory once, for every row of x
            for (int64_t m = 0; m < M; m++) put(y, m * N + n, dot(&xs[m * K], w + n * K, K), f32);
    });
}

"""
MAX_ROWS = 32  # products of this many rows or more (prefill) go to torch's GEMM

# The torch ops, in C++: the compiled graph calls them through torch's dispatcher with no Python in between (a
# Python op costs ~9 us a call, and a 22-layer step makes ~130 of them). They call whichever kernel set was loaded
# last, through the pointers set_kernels() was given, so one process can switch sets.
GLUE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

using at::Tensor;
static void* K[6];  // gemv_bf16, gemv_int8, gemv_int4, dequantize_int4, attend, attend_int8 of the loaded set
extern "C" void set_kernels(void** k) { for (int i = 0; i < 6; i++) K[i] = k[i]; }

static Tensor out(const Tensor& x, int64_t n, bool f32) {  // [..., n], bf16 or float32
    auto shape = x.sizes().vec();
    shape.back() = n;
    return at::empty(shape, x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
}

// x [..., K] bf16, w [N, K] bf16 -> [..., N]
static Tensor gemv_bf16(const Tensor& x_, const Tensor& w, bool f32) {
    Tensor x = x_.contiguous(), y = out(x, w.size(0), f32);
    ((void (*)(void*, void*, void*, int64_t, int64_t, int64_t, int64_t))K[0])(
        x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() / w.size(1), w.size(0), w.size(1), f32);
    return y;
}

// x [..., K] bf16, w [N, K] int8, scales [N] bf16 -> [..., N]
static Tensor gemv_int8(const Tensor& x_, const Tensor& w, const Tensor& scales, bool f32) {
    Tensor x = x_.contiguous(), y = out(x, w.size(0), f32);
    ((void (*)(void*, void*, void*, void*, int64_t, int64_t, int64_t, int64_t))K[1])(
        x.data_ptr(), w.data_ptr(), scales.data_ptr(), y.data_ptr(), x.numel() / w.size(1), w.size(0), w.size(1),
        f32);
    return y;
}

// x [..., K'] bf16, w [N, K'/2] uint8 (two q per byte), scales and zeros [N, K'/G] bf16 -> [..., N]
static Tensor gemv_int4(const Tensor& x_, const Tensor& w, const Tensor& scales, const Tensor& zeros, bool f32) {
    Tensor x = x_.contiguous(), y = out(x, w.size(0), f32);
    int64_t k = 2 * w.size(1);
    int64_t g = k / scales.size(1);
    TORCH_CHECK(k % 64 == 0 && g * scales.size(1) == k && (g == 32 || g == 64 || g == 128 || g == 256),
                "gemv_int4: K ", k, " in groups of ", g, "; K must be a multiple of 64 and a group 32 to 256 long");
    ((void (*)(void*, void*, void*, void*, void*, int64_t, int64_t, int64_t, int64_t, int64_t))K[2])(
        x.data_ptr(), w.data_ptr(), scales.data_ptr(), zeros.data_ptr(), y.data_ptr(), x.numel() / k, w.size(0), k,
        k / scales.size(1), f32);
    return y;
}

// w [N, K'/2] uint8, scales and zeros [N, K'/G] bf16 -> [N, K'] float32 (or bf16)
static Tensor dequantize_int4(const Tensor& w, const Tensor& scales, const Tensor& zeros, bool f32) {
    Tensor y = at::empty({w.size(0), 2 * w.size(1)}, w.options().dtype(f32 ? at::kFloat : at::kBFloat16));
    ((void (*)(void*, void*, void*, void*, int64_t, int64_t, int64_t, int64_t))K[3])(
        w.data_ptr(), scales.data_ptr(), zeros.data_ptr(), y.data_ptr(), y.size(0), y.size(1),
        y.size(1) / scales.size(1), f32);
    return y;
}

// q [B, H, S, D] bf16, k and v [B, Hkv, L, D] bf16 (slices of the cache: rows of D contiguous), mask [B|1, 1, S, L]
// bool -> [B, H, S, D]
static Tensor attend(const Tensor& q_, const Tensor& k, const Tensor& v, const Tensor& mask) {
    Tensor q = q_.contiguous();
    int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), L = k.size(2);
    Tensor m = mask.expand({B, 1, S, L}), y = at::empty(q.sizes(), q.options());
    ((void (*)(void*, void*, void*, void*, void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t))K[4])(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr(), y.data_ptr(), B, H, k.size(1), S, L, D, k.stride(0),
        k.stride(1), m.stride(0));
    return y;
}

// attend() over an int8 cache: k and v [B, Hkv, L, D] int8, k_scale [B, Hkv, L, 1] and v_scale [B, Hkv, L, D / 32]
// float32 (slices of the cache)
static Tensor attend_int8(const Tensor& q_, const Tensor& k, const Tensor& ks, const Tensor& v, const Tensor& vs,
                          const Tensor& mask) {
        Tensor q = q_.contiguous();
    int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), L = k.size(2);
    Tensor m = mask.expand({B, 1, S, L}), y = at::empty(q.sizes(), q.options());
    ((void (*)(void*, void*, void*, void*, void*, void*, void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t))K[5])(
        q.data_ptr(), k.data_ptr(), ks.data_ptr(), v.data_ptr(), vs.data_ptr(), m.data_ptr(), y.data_ptr(), B, H,
        k.size(1), S, L, D, k.stride(0), k.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        m.stride(0));
    return y;
}

TORCH_LIBRARY_IMPL(fast_decode, CPU, m) {
    m.impl("gemv_bf16", gemv_bf16);
    m.impl("gemv_int8", gemv_int8);
    m.impl("gemv_int4", gemv_int4);
    m.impl("dequantize_int4", dequantize_int4);
    m.impl("attend", attend);
    m.impl("attend_int8", attend_int8);
}
"""

PROBE_ROWS = 256  # the rows of the product that decides the prefill dtype
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


def l1_data_kb() -> int:
    """The first core's L1 data cache in KB, from Linux's sysfs; 0 where it does not say."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() == "Data":
                return int((index / "size").read_text().strip().rstrip("K"))
        except (OSError, ValueError):
            return 0
    return 0


def targets(flags: set[str]) -> list[tuple[str, str, list[str]]]:
    """(name, source, compiler flags) of every kernel set this CPU runs, the fastest first."""
    out = []
    if AVX512 and {"avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= flags:
        base = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
        extra = [f for f in ("avx512_bf16", "avx512_vnni") if f in flags]
        # less than 48 KB of L1 (a Zen 4): see KV_HINT in the attention, AHEAD_WEIGHTS by ahead(), AHEAD_BF16 by dot()
        small_l1 = ["-DKV_HINT=_MM_HINT_T1", "-DKV_AHEAD=7168", "-DAHEAD_WEIGHTS=0", "-DAHEAD_BF16=4096"]
        small_l1 = small_l1 if 0 < l1_data_kb() < 48 else []
        if extra:  # the plain AVX-512 set too, second: a test can run both
            out.append(("avx512+" + "+".join(f[7:] for f in extra), AVX512,
                        base + ["-m" + f.replace("_", "") for f in extra] + small_l1))
        out.append(("avx512", AVX512, base))
    if {"avx2", "fma"} <= flags:
        out.append(("avx2", AVX2, ["-mavx2", "-mfma"]))
    return out


def compile_once(source: str, flags: list[str]) -> Path:
    """The shared library built from source with g++ and flags, from the cache when built so before."""
    lib = CACHE / f"gemv-{hashlib.sha256((source + ' '.join(flags)).encode()).hexdigest()[:16]}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # build aside, then rename: readers never see half a file
            src = Path(tmp) / "gemv.cpp"
            src.write_text(source)
            subprocess.run([os.environ.get("CXX", "g++"), str(src), *flags, "-o", str(Path(tmp) / "lib.so")],
                           check=True, capture_output=True, text=True)
            os.replace(Path(tmp) / "lib.so", lib)
    return lib


def compile_set(source: str, flags: list[str]) -> Path:
    """One kernel set's shared library, compiled for its instruction set (which this CPU need not have)."""
    return compile_once(PRELUDE + source + QUANTIZED, ["-O3", *flags, "-fopenmp", "-shared", "-fPIC"])


def build(source: str, flags: list[str]) -> ctypes.CDLL:
    """One kernel set, compiled for the CPU's instruction set and loaded."""
    return ctypes.CDLL(str(compile_set(source, flags)))


# torch's C++-extension module guesses a CUDA home when imported (by build_glue, and by inductor's C++ builds), and a
# CUDA build of torch on a machine with no GPU then warns "No CUDA runtime is found" on stderr: noise before every
# run's output (and before a one-line error), about CUDA code that nothing here builds.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def build_glue() -> ctypes.CDLL:
    """The torch ops (GLUE), compiled against this torch's headers and libraries, and registered."""
    from torch.utils import cpp_extension
    torch_lib = str(Path(torch.__file__).parent / "lib")
    # TORCH_VERSION only makes a new torch a new build
    flags = ["-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-DTORCH_VERSION={torch.__version__}",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *[f"-I{p}" for p in cpp_extension.include_paths()], f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
             "-lc10", "-ltorch_cpu"]
    lib = compile_once(GLUE, flags)
    torch.ops.load_library(str(lib))
    return ctypes.CDLL(str(lib))


def build_first(sets: list[tuple[str, str, list[str]]]) -> tuple[ctypes.CDLL, str]:
    """The first of the kernel sets (name, source, flags) that builds, and its name: a g++ too old for one instruction
    set's intrinsics still builds the next, slower set. Raises the last failure when none builds."""
    for i, (name, source, flags) in enumerate(sets):
        try:
            return build(source, flags), name
        except subprocess.CalledProcessError as e:
            if i + 1 == len(sets):
                raise
            print(f"cpu_gemv: the {name} kernels did not build ({compiler_error(e)}); trying {sets[i + 1][0]}",
                  file=sys.stderr)
    raise RuntimeError("no kernel set to build")


def compiler_error(e: subprocess.CalledProcessError) -> str:
    """The compiler's first error (from "error:" on, without the temporary file's path), else its last line."""
    lines = [line.strip() for line in (e.stderr or "").splitlines() if line.strip()]
    errors = [line[line.index("error:"):] for line in lines if "error:" in line]
    return (errors or lines[-1:] or [f"exit status {e.returncode}"])[0]


_lib: Optional[ctypes.CDLL] = None
_glue: Optional[ctypes.CDLL] = None  # built and registered once a process
kernels = "torch"  # what products of few rows run on: a kernel set's name, or torch's own
_why_not = None


def load(name: Optional[str] = None) -> Optional[str]:
    """Build and switch to the CPU's best kernel set (or the one named); its name, or None with one line on stderr
    saying why torch's kernels stay."""
    global _lib, kernels, _why_not
    available = targets(cpu_flags())
    chosen = [t for t in available if name is None or t[0] == name]
    try:
        if not chosen:
            raise RuntimeError(f"no kernels for this CPU ({platform.machine()}: "
                               f"{'no ' + name if name else 'there are kernels for x86 AVX2+FMA and AVX-512 only'})")
        global _glue
        _lib, kernels = build_first(chosen)
        _glue = _glue or build_glue()
        names = ("gemv_bf16", "gemv_int8", "gemv_int4", "dequantize_int4", "attend", "attend_int8")
        _glue.set_kernels((ctypes.c_void_p * 6)(*[ctypes.cast(getattr(_lib, n), ctypes.c_void_p)
                                                  if hasattr(_lib, n) else None for n in names]))
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


# ---- the kernels as torch ops --------------------------------------------------------------------------------------

# torch ops, so that torch.compile keeps them in the graph: defined here, implemented by GLUE once a set is loaded.
# New behaviour takes a new op, never new arguments on an old one: a step inductor compiled and cached before calls
# the op with the arguments it had then (a gemv given one more, defaulted, argument gave NaN from such a cache).
_ops = torch.library.Library("fast_decode", "DEF")
# f32: write the products in float32 instead of bf16 (the output head: see put() in the kernels)
_ops.define("gemv_bf16(Tensor x, Tensor w, bool f32=False) -> Tensor")
_ops.define("gemv_int8(Tensor x, Tensor w, Tensor scales, bool f32=False) -> Tensor")
_ops.define("gemv_int4(Tensor x, Tensor w, Tensor scales, Tensor zeros, bool f32=False) -> Tensor")
_ops.define("attend(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor")
_ops.define("attend_int8(Tensor q, Tensor k, Tensor k_scale, Tensor v, Tensor v_scale, Tensor mask) -> Tensor")
_ops.define("dequantize_int4(Tensor w, Tensor scales, Tensor zeros, bool f32) -> Tensor")


def out(x: Tensor, n: int, f32: bool) -> Tensor:  # [..., n], bf16 or float32: what the products return
    return x.new_empty(*x.shape[:-1], n, dtype=torch.float32 if f32 else x.dtype)


@torch.library.register_fake("fast_decode::gemv_bf16")
def _(x: Tensor, w: Tensor, f32: bool = False) -> Tensor:
    return out(x, w.size(0), f32)


@torch.library.register_fake("fast_decode::gemv_int8")
def _(x: Tensor, w: Tensor, scales: Tensor, f32: bool = False) -> Tensor:
    return out(x, w.size(0), f32)


@torch.library.register_fake("fast_decode::gemv_int4")
def _(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor, f32: bool = False) -> Tensor:
    return out(x, w.size(0), f32)


@torch.library.register_fake("fast_decode::attend")
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("fast_decode::attend_int8")
def _(q: Tensor, k: Tensor, k_scale: Tensor, v: Tensor, v_scale: Tensor, mask: Tensor) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("fast_decode::dequantize_int4")
def _(w: Tensor, scales: Tensor, zeros: Tensor, f32: bool) -> Tensor:
    return w.new_empty(w.size(0), 2 * w.size(1), dtype=torch.float32 if f32 else torch.bfloat16)


def few_rows(x: Tensor) -> bool:  # decode, verification, short prompts; inference only: the ops have no backward
    return x.numel() < MAX_ROWS * x.size(-1) and not (torch.is_grad_enabled() and x.requires_grad)


def rows_of_d(t: Tensor) -> bool:  # [B, H, L, D] with each row of D contiguous, rows D apart
    return t.stride(-1) == 1 and t.stride(-2) == t.size(-1)


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
         enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention, with a few query rows over a bf16 KV cache through attend() (decode and
    verification: q [B, H, S, D] for S < MAX_ROWS, a boolean mask [B|1, 1, S, L]); anything else through torch's."""
    if (attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.size(1) == 1 and q.size(2) < MAX_ROWS
            and q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu" and q.size(-1) in (16, 32, 64, 128, 256)
            and q.size(1) % k.size(1) == 0 and rows_of_d(k) and rows_of_d(v) and k.stride() == v.stride()
            and attn_mask.stride(-1) == 1 and attn_mask.stride(-2) == attn_mask.size(-1)
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return torch.ops.fast_decode.attend(q, k, v, attn_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


def sdpa_int8(q: Tensor, k: Tensor, k_scale: Tensor, v: Tensor, v_scale: Tensor, attn_mask: Tensor,
              enable_gqa: bool) -> Tensor:
    """model.sdpa_int8 (attention over an int8 cache), with a few query rows through attend_int8(); anything else
    (prefill, other head sizes) through model.py's own: dequantize, then sdpa above."""
    if (q.size(2) < MAX_ROWS and q.dtype == torch.bfloat16 and q.device.type == "cpu"
            and q.size(-1) in (64, 128, 256) and q.size(1) % k.size(1) == 0 and rows_of_d(k) and rows_of_d(v)
            and k.stride() == v.stride() and k_scale.size(-1) == 1 and k_scale.stride(-2) == 1
            and v_scale.size(-1) == q.size(-1) // 32 and v_scale.stride(-2) == v_scale.size(-1) and v_scale.stride(-1) == 1
            and attn_mask.dtype == torch.bool and attn_mask.size(1) == 1 and attn_mask.stride(-1) == 1
            and attn_mask.stride(-2) == attn_mask.size(-1) and not (torch.is_grad_enabled() and q.requires_grad)):
        return torch.ops.fast_decode.attend_int8(q, k, k_scale, v, v_scale, attn_mask)
    k, v = dequantize_rows(k, k_scale, q.dtype), dequantize_rows(v, v_scale, q.dtype)
    return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


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
    with the weight converted on the fly. CPUs without bf16 matrix instructions run torch's bf16 GEMM at a fifth
    of its fp32 speed or less; with them bf16 wins (a slow bf16 GEMM takes about a second here). At MAX_ROWS rows
    the two are close (converting the weight costs as much as the product), so that is no place to measure. At
    most 4096 of the weight's rows: speed per FLOP is the same."""
    n = min(n, 4096)
    x, w = torch.randn(PROBE_ROWS, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
    return getattr(torch, fastest(f"{PROBE_ROWS} rows, {n}x{k}", {
        str(dtype)[6:]: (lambda dtype=dtype: F.linear(x.to(dtype), w.to(dtype)))
        for dtype in (torch.float32, torch.bfloat16)}))


def prefill_in_kernel(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a quantized layer (GemvInt8, GemvInt4) multiplies many rows (prefill) faster here in its kernel (x
    rounded to int8, integer multiply-adds) than through torch's GEMM in dtype. On AVX2 the kernel is faster (int4
    about 1.7x, int8 1.2-1.3x at 256-512 rows); a CPU with bf16 matrix tiles may well run torch's faster. Timed on
    at most 4096 of the layer's rows."""
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
    mapped (and zeroed) every call. A 512-token TinyLlama bf16 prefill on a Zen 3 (AVX2), alternating in one
    process: tiles of 4 MB 1.17-1.18x as fast as the whole matrix, 8 MB 1.15x, 2 MB 1.09x, 1 MB 0.96x."""
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
        y = F.linear(x.to(self.dtype), self.weight.to(self.dtype)) * self.scales.to(self.dtype)
        return y.to(torch.float32 if self.f32 else x.dtype)


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
        copy went to fresh pages on every call, where a tile stays in cache and its memory is reused (a 512-token
        prefill ran 1.16x as fast on a Zen 5)."""
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


def joined(a: nn.Module, b: nn.Module) -> Optional[nn.Module]:
    """One layer of a's kind whose outputs are a's, then b's (two layers over the same input), or None where the
    two are not of one kind."""
    cat = lambda t: torch.cat([getattr(a, t), getattr(b, t)])  # noqa: E731
    if type(a) is not type(b) or type(a) not in (GemvBf16, GemvInt8, GemvInt4) or a.dtype != b.dtype:
        return None
    if type(a) is GemvBf16 and a.gemv == b.gemv:
        return GemvBf16(nn.Parameter(cat("weight"), requires_grad=a.weight.requires_grad), a.dtype, a.gemv)
    if type(a) is GemvInt8:
        return GemvInt8(cat("weight"), cat("scales"), a.dtype)
    if type(a) is GemvInt4 and a.in_features == b.in_features and a.scales.size(1) == b.scales.size(1):
        return GemvInt4(SimpleNamespace(in_features=a.in_features, out_features=a.out_features + b.out_features,
                                        weight=cat("weight"), scales=cat("scales"), zeros=cat("zeros")), a.dtype)
    return None


def install(model: nn.Module, name: Optional[str] = None) -> str:
    """Replace the model's CPU linear layers, in place, by ones that run few-row products on this CPU's kernels
    (or the named set) and prefill in the dtype measured faster here. Returns what was chosen, in words."""
    if name or (_lib is None and _why_not is None):  # once a process, unless a set is named
        load(name)
    shapes = [(m.out_features, m.in_features) for m in model.modules() if hasattr(m, "out_features")]
    dtype = prefill_dtype(*max(shapes, key=lambda s: s[0] * s[1])) if shapes else torch.bfloat16
    for parent in list(model.modules()):
        if _lib is not None and getattr(parent, "sdpa", None) is F.scaled_dot_product_attention:
            parent.sdpa = sdpa  # model.py's attention takes its attention function from here
            parent.sdpa_int8 = sdpa_int8
        for child_name, child in parent.named_children():
            new = replacement(child, dtype)
            if new is not None:
                # the output head writes float32 logits: a small model's top two can be closer than a bf16 step
                new.f32 = parent is model and child_name == "output"
                setattr(parent, child_name, new)
    for parent in list(model.modules()):
        for child_name, ff in parent.named_children():
            w13 = joined(ff.w1, ff.w3) if isinstance(ff, FeedForward) else None
            if w13 is not None:
                setattr(parent, child_name, GateUp(w13, ff.w2))
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
