// The bf16 product with AVX-512: pairs multiplied by dpbf16 where the CPU has AVX512-BF16, else widened to fp32.
#include "common.h"
#include "kernels.h"


// bf16. With AVX512-BF16, dpbf16 multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes: x stays bf16
// and the weights are never widened. Without it, a bf16 widened by a 16-bit shift is its fp32 value.
#ifdef __AVX512BF16__
typedef uint16_t xbf16;

// AHEAD_BF16: how far ahead (bytes) the product asks for its weights, into L3 (T2); 0, the default, leaves them to
// the hardware prefetcher (cpu_gemv.targets: 4096 on cores with less than 48 KB of L1). HOW_IT_WORKS.md,
// "Prefetching the weights".
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
void fast_decode::gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
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

