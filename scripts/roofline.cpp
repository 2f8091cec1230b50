// The compute ceilings scripts/roofline.py sets a model's products against: how many multiply-adds a second this CPU
// does with the instructions the kernels use (csrc/quantized.cpp's int8 ones: VNNI's dpbusd, or AVX2's maddubs added
// in 16 bits; csrc/bf16_*.cpp's: AVX512-BF16's dpbf16, or float FMAs), on registers alone. Built with a kernel set's
// flags, run on every OpenMP thread. Prints "int8 RATE" and "bf16 RATE".
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
constexpr int64_t STEPS = 1 << 24;  // about 50 ms a run: a moment's hiccup on a shared host changes little

// CHAINS accumulators a thread, init(i) each, every step a[i] = madd(a[i], x) with x hidden from the compiler once
// a step (so nothing is hoisted or folded). Returns a word of their sum, which the caller uses: nothing is removed.
template <class V, class X, class Init, class Madd, class Add>
static int64_t chains(X x, Init init, Madd madd, Add add) {
    V a[CHAINS];
    for (int i = 0; i < CHAINS; i++) a[i] = init(i);
    for (int64_t n = 0; n < STEPS; n++) {
        for (int i = 0; i < CHAINS; i++) a[i] = madd(a[i], x);
        asm volatile("" : "+x"(x));
    }
    for (int i = 1; i < CHAINS; i++) a[0] = add(a[0], a[i]);
    int64_t word;
    memcpy(&word, &a[0], sizeof word);
    return word;
}

// multiply-adds a second over all threads of `macs` a chain's step: the best of 3 runs
template <class Steps>
static double rate(Steps steps, double macs) {
    double best = 0;
    for (int run = 0; run < 3; run++) {
        double t = now();
        int64_t keep = 0;
#pragma omp parallel reduction(+ : keep)
        keep += steps();
        t = now() - t;
        double r = macs * CHAINS * STEPS * omp_get_max_threads() / t;
        if (r > best) best = r;
        if (keep == 42) puts("");
    }
    return best;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr double INT8_MACS = 64;
static int64_t int8_steps() {
    return chains<__m512i>(_mm512_set1_epi8(3), [](int i) { return _mm512_set1_epi32(i); },
                           [](__m512i a, __m512i x) { return _mm512_dpbusd_epi32(a, x, x); }, _mm512_add_epi32);
}
#else  // 32 products a step as the AVX2 kernels make them: maddubs, added in 16 bits (widened once a group)
constexpr double INT8_MACS = 32;
static int64_t int8_steps() {
    return chains<__m256i>(_mm256_set1_epi8(3), [](int i) { return _mm256_set1_epi16(i); },
                           [](__m256i a, __m256i x) { return _mm256_add_epi16(a, _mm256_maddubs_epi16(a, x)); },
                           _mm256_add_epi16);
}
#endif

#if defined(__AVX512BF16__)
constexpr double BF16_MACS = 32;
static int64_t bf16_steps() {
    return chains<__m512>(_mm512_set1_epi16(0x3f80), [](int i) { return _mm512_set1_ps(i); },
                          [](__m512 a, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)x); },
                          _mm512_add_ps);
}
#elif defined(__AVX512F__)  // bf16 widened to float, then FMAs
constexpr double BF16_MACS = 16;
static int64_t bf16_steps() {
    return chains<__m512>(_mm512_set1_ps(1e-9f), [](int i) { return _mm512_set1_ps(i); },
                          [](__m512 a, __m512 x) { return _mm512_fmadd_ps(x, x, a); }, _mm512_add_ps);
}
#else
constexpr double BF16_MACS = 8;
static int64_t bf16_steps() {
    return chains<__m256>(_mm256_set1_ps(1e-9f), [](int i) { return _mm256_set1_ps(i); },
                          [](__m256 a, __m256 x) { return _mm256_fmadd_ps(x, x, a); }, _mm256_add_ps);
}
#endif

int main() {
    printf("int8 %.4g\n", rate(int8_steps, INT8_MACS));
    printf("bf16 %.4g\n", rate(bf16_steps, BF16_MACS));
    return 0;
}
