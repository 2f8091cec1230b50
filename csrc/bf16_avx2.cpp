// The bf16 product with AVX2 and FMA: bf16 widened to fp32 by one integer unpack (bf16 is the top half of an fp32).
#include "common.h"
#include "kernels.h"


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
void fast_decode::gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
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
