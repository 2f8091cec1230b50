// The compute ceilings scripts/roofline.py sets a model's products against: how many multiply-adds a second this CPU
// does with the instructions the kernels use (csrc/quantized.cpp's int8 ones: VNNI's dpbusd, or AVX2's maddubs added
// in 16 bits; csrc/bf16_*.cpp's: AVX512-BF16's dpbf16, or float FMAs), on registers alone. Built with a kernel set's
// flags, run on every OpenMP thread. Prints "int8 RATE" and "bf16 RATE".
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>

#include <chrono>

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// independent accumulators a thread: more than latency x throughput of each instruction, fewer than the registers
#ifdef __AVX512F__
constexpr int CHAINS = 12;
#else
constexpr int CHAINS = 10;
#endif
constexpr int64_t STEPS = 1 << 22;

// multiply-adds a second over all threads of one step per chain, `macs` a step: the best of 3 runs
template <class Step>
static double rate(Step step, double macs) {
    double best = 0;
    for (int run = 0; run < 3; run++) {
        double t = now();
        int64_t keep = 0;
#pragma omp parallel reduction(+ : keep)
        keep += step();
        t = now() - t;
        double r = macs * CHAINS * STEPS * omp_get_max_threads() / t;
        if (r > best) best = r;
        if (keep == 42) puts("");  // the sums are used: the loops are not removed
    }
    return best;
}

static int64_t int8_steps() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i a[CHAINS], x = _mm512_set1_epi8(3), w = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_epi32(i);
    for (int64_t n = 0; n < STEPS; n++) {
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
        asm volatile("" : "+v"(x));
    }
    for (int i = 1; i < CHAINS; i++) a[0] = _mm512_add_epi32(a[0], a[i]);
    return _mm512_reduce_add_epi32(a[0]);
#else  // 32 products a step as the AVX2 kernels make them: maddubs, added in 16 bits (widened once a group)
    __m256i a[CHAINS], x = _mm256_set1_epi8(3);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_epi16(i);
    for (int64_t n = 0; n < STEPS; n++) {
        for (int i = 0; i < CHAINS; i++) a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(a[i], x));  // each its own
        asm volatile("" : "+x"(x));
    }
    for (int i = 1; i < CHAINS; i++) a[0] = _mm256_add_epi16(a[0], a[i]);
    return _mm256_extract_epi16(a[0], 0);
#endif
}

static int64_t bf16_steps() {
#if defined(__AVX512BF16__)
    __m512 a[CHAINS];
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), w = x;
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_setzero_ps();
    for (int64_t n = 0; n < STEPS; n++) {
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpbf16_ps(a[i], w, x);
        asm volatile("" : "+v"(x));
    }
    for (int i = 1; i < CHAINS; i++) a[0] = _mm512_add_ps(a[0], a[i]);
    return (int64_t)_mm512_reduce_add_ps(a[0]);
#elif defined(__AVX512F__)
    __m512 a[CHAINS], x = _mm512_set1_ps(1e-9f), w = x;
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_setzero_ps();
    for (int64_t n = 0; n < STEPS; n++) {
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_fmadd_ps(w, x, a[i]);
        asm volatile("" : "+v"(x));
    }
    for (int i = 1; i < CHAINS; i++) a[0] = _mm512_add_ps(a[0], a[i]);
    return (int64_t)_mm512_reduce_add_ps(a[0]);
#else
    __m256 a[CHAINS], x = _mm256_set1_ps(1e-9f), w = x;
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_setzero_ps();
    for (int64_t n = 0; n < STEPS; n++) {
        for (int i = 0; i < CHAINS; i++) a[i] = _mm256_fmadd_ps(w, x, a[i]);
        asm volatile("" : "+x"(x));
    }
    for (int i = 1; i < CHAINS; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    return (int64_t)_mm_cvtss_f32(_mm256_castps256_ps128(a[0]));
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr double INT8_MACS = 64;
#else
constexpr double INT8_MACS = 32;
#endif
#if defined(__AVX512BF16__)
constexpr double BF16_MACS = 32;
#elif defined(__AVX512F__)
constexpr double BF16_MACS = 16;
#else
constexpr double BF16_MACS = 8;
#endif

int main() {
    printf("int8 %.4g\n", rate(int8_steps, INT8_MACS));
    printf("bf16 %.4g\n", rate(bf16_steps, BF16_MACS));
    return 0;
}
