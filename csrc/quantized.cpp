#include "common.h"
#include "kernels.h"
#ifdef __AMX_INT8__
#include "amx.h"
#endif

// The int8 and int4 products, for both instruction sets (AVX2 instructions, and VNNI's dpbusd where present). x is
// rounded to int8 per block (int8: 32 values; int4: the weights' group), x ~ d * xq, so that a block's products are
// integer multiply-adds: 32 at a time by maddubs (or dpbusd) instead of 8 float FMAs after widening each weight.
// That is what lets the quantized products keep up with memory, for a rounding error the tests bound at 1%.

struct XQ {  // one row of x rounded to int8 per block of B: xq, and per block the scale d, d * sum xq, and sum x
    vec<int8_t> q;
    vec<float> d, c, sum;
};
// kept from call to call: allocations a product cost a measurable share of a decode step
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
#define FLIP (WIDE ? 128 : 0)
// a tile of the int8 product (dot_i8): TW weight rows by TR rows of x, their accumulators in registers (AVX2's 16
// hold one weight row's)
#define TW (WIDE ? 4 : 1)
#define TR 4

// int8 w (scale per row) against x in blocks of 32; returns 8 lanes whose sum less FLIP x sum of p.c is the product.
// AVX2: |w| times x with w's sign, as maddubs wants unsigned by signed. AVX-512 VNNI: w + 128 as unsigned (one xor),
// so sum (w + 128) x = sum w x + 128 sum x, the last taken off once a row; 64 weights a step, its 16 int32 sums
// converted and scaled where they lie (lanes 0-7 by the first block's d, 8-15 by the second's),
// which is quicker than gathering 8 blocks' sums into one vector first (HOW_IT_WORKS.md, "The int8 and int4
// products"). A tile of W weight rows by R rows of x: each load of w serves R rows of x, each load of x (and of its
// scales) W rows of w, and every pair's sums run exactly as they would alone: out[r][j] = dot_i8 of x row r, w row j.
template <int W, int R>
static inline void dot_i8(const XQ* const* p, const int8_t* const* w, int64_t K, __m256 out[][W]) {
    __m256 total[R][W];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) total[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
#if WIDE
    const __m512i flip = _mm512_set1_epi8(-128);
    __m512 wacc[R][W];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) wacc[r][j] = _mm512_setzero_ps();
    for (; k + 256 <= K; k += 256) {
        __m512 d[R];
        for (int r = 0; r < R; r++) d[r] = _mm512_castps256_ps512(_mm256_loadu_ps(&p[r]->d[k / 32]));
        for (int i = 0; i < 4; i++) {
            __m512i v[W];
            for (int j = 0; j < W; j++) {
                ahead(w[j] + k + 64 * i);
                v[j] = _mm512_xor_si512(_mm512_loadu_si512(w[j] + k + 64 * i), flip);
            }
            const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(2 * i), _mm256_set1_epi32(2 * i + 1), 1);
            for (int r = 0; r < R; r++) {
                const __m512i xq = _mm512_loadu_si512(&p[r]->q[k + 64 * i]);
                const __m512 ds = _mm512_permutexvar_ps(pick, d[r]);  // the step's two blocks' scales, 8 lanes each
                for (int j = 0; j < W; j++) {
                    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[j], xq);
                    wacc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), ds, wacc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++)
            total[r][j] = _mm256_add_ps(_mm512_castps512_ps256(wacc[r][j]),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wacc[r][j]), 1)));
    if (K - k == 64) {  // the last 2 blocks (SmolLM2's 576): one step, its two halves' sums into lanes 0 and 1
        __m512i v[W];
        for (int j = 0; j < W; j++) v[j] = _mm512_xor_si512(_mm512_loadu_si512(w[j] + k), flip);
        for (int r = 0; r < R; r++) {
            const __m512i xq = _mm512_loadu_si512(&p[r]->q[k]);
            const __m256 d = _mm256_loadu_ps(&p[r]->d[k / 32]);
            for (int j = 0; j < W; j++) {
                const __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[j], xq);
                __m256i h = _mm256_hadd_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
                h = _mm256_hadd_epi32(h, _mm256_setzero_si256());  // lanes 0, 1 and 4, 5: halves of the two sums
                const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_zextsi128_si256(s)), d, total[r][j]);
            }
        }
    } else if (k < K)  // the last blocks, fewer than 8 (d is 0 past the last)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < W; j++) {
                __m256i acc[8];
                for (int i = 0; i < 8; i++) {
                    acc[i] = _mm256_setzero_si256();
                    if (k + 32 * i >= K) continue;  // nothing read past the row
                    __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w[j] + k + 32 * i)),
                                                 _mm256_set1_epi8(-128));
                    acc[i] = _mm256_dpbusd_epi32(acc[i], v, _mm256_loadu_si256((const __m256i*)&p[r]->q[k + 32 * i]));
                }
                total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8_i32(acc)), _mm256_loadu_ps(&p[r]->d[k / 32]),
                                              total[r][j]);
            }
#else
    for (; k < K; k += 32) {
        __m256i v[W], a[W];
        for (int j = 0; j < W; j++) {
            ahead(w[j] + k, AHEAD4);
            v[j] = _mm256_loadu_si256((const __m256i*)(w[j] + k)), a[j] = _mm256_sign_epi8(v[j], v[j]);
        }
        for (int r = 0; r < R; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i*)&p[r]->q[k]);
            const __m256 d = _mm256_broadcast_ss(&p[r]->d[k / 32]);
            for (int j = 0; j < W; j++) {
                __m256i sx = _mm256_sign_epi8(xq, v[j]);
#ifdef __AVX512VNNI__
                __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), a[j], sx);
#else
                __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], sx), _mm256_set1_epi16(1));
#endif
                total[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, total[r][j]);
            }
        }
    }
#endif
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) out[r][j] = total[r][j];
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
// 128 packed int4 weights (64 bytes) -> their low and high nibbles, to multiply x in even-odd order by 128. One load
// kept for both: folded into each use, it was loaded twice.
static inline void nibbles(const uint8_t* w, __m512i* lo, __m512i* hi) {
    __m512i v = _mm512_loadu_si512(w);
    asm("" : "+v"(v));
    const __m512i nib = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(v, nib), *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
}

// n <= 8 groups' products in 512-bit steps, added to acc: each step's 16 int32 sums converted and scaled where they
// lie (G 64: lanes 0-7 by the first group's scale x d, 8-15 by the second's; G 32: four lanes a group; G 128 or more:
// the group's scale broadcast from memory in the FMA), with no horizontal sums: quicker than summing each group's
// lanes first, and than 256-bit steps for G 32 (GGUF's Q4_0 and Q4_1); HOW_IT_WORKS.md, "The int8 and int4
// products". A tile of W weight rows (w[v]) by R rows of x (x[r]; sd[v][r] the 8 groups' scale x d of the pair,
// added to acc[v][r]): each weight vector loaded and split into nibbles serves all R rows of x, each x vector loaded
// all W weight rows, and every pair's sums run exactly as they would alone.
template <int G, int W, int R>
static inline void group_products_wide(const uint8_t* const* w, const int8_t* const* x, int n, const __m256 (*sd)[R],
                                       __m512 (*acc)[R]) {
    __m512i lo[W], hi[W];
    if constexpr (G >= 128) {
        alignas(32) float sm[W][R][8];
        for (int v = 0; v < W; v++)
            for (int r = 0; r < R; r++) _mm256_store_ps(sm[v][r], sd[v][r]);
        for (int i = 0; i < n; i++) {
            __m512i a[W][R];
            for (int v = 0; v < W; v++)
                for (int r = 0; r < R; r++) a[v][r] = _mm512_setzero_si512();
            for (int j = 0; j < G / 128; j++) {
                for (int v = 0; v < W; v++) {
                    ahead(w[v] + i * G / 2 + 64 * j, AHEAD4);
                    nibbles(w[v] + i * G / 2 + 64 * j, &lo[v], &hi[v]);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t* xr = x[r] + i * G + 128 * j;
                    const __m512i xe = _mm512_loadu_si512(xr), xo = _mm512_loadu_si512(xr + 64);
                    for (int v = 0; v < W; v++)
                        a[v][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[v][r], lo[v], xe), hi[v], xo);
                }
            }
            for (int v = 0; v < W; v++)
                for (int r = 0; r < R; r++)
                    acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[v][r]), _mm512_set1_ps(sm[v][r][i]), acc[v][r]);
        }
        return;
    }
    // a step's 128 weights hold G 32: four groups, a quarter each; G 64: two, one in each half
    constexpr int per = 128 / G;
    int i = 0;
    for (; i + per <= n; i += per) {
        for (int v = 0; v < W; v++) {
            ahead(w[v] + G / 2 * i, AHEAD4);
            nibbles(w[v] + G / 2 * i, &lo[v], &hi[v]);
        }
        const __m512i pick = G == 32 ? _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1,
                                                                                                 2, 2, 2, 2, 3, 3, 3, 3))
                                     : _mm512_inserti64x4(_mm512_set1_epi32(i), _mm256_set1_epi32(i + 1), 1);
        for (int r = 0; r < R; r++) {
            const int8_t* xr = x[r] + G * i;
            const __m512i xe = _mm512_loadu_si512(xr), xo = _mm512_loadu_si512(xr + 64);
            for (int v = 0; v < W; v++) {
                const __m512i a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[v], xe), hi[v],
                                                      xo);
                acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a),
                                            _mm512_permutexvar_ps(pick, _mm512_castps256_ps512(sd[v][r])), acc[v][r]);
            }
        }
    }
    if (i < n) {  // G 32 or 64 with K 64 short of a multiple of 128: the row's last 64 weights (x in 64's order there)
        const __m256i pick = G == 32 ? _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1) : _mm256_set1_epi32(i);
        const __m256i nib = _mm256_set1_epi8(15);
        __m256i lo4[W], hi4[W];
        for (int v = 0; v < W; v++) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(w[v] + G / 2 * i));
            lo4[v] = _mm256_and_si256(b, nib), hi4[v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
        }
        for (int r = 0; r < R; r++) {
            const int8_t* xr = x[r] + G * i;
            const __m256i xe = _mm256_loadu_si256((const __m256i*)xr), xo = _mm256_loadu_si256((const __m256i*)(xr + 32));
            for (int v = 0; v < W; v++) {
                const __m256i a = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo4[v], xe), hi4[v],
                                                      xo);
                const __m256 half = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_permutexvar_ps(pick, sd[v][r]));
                acc[v][r] = _mm512_add_ps(acc[v][r], _mm512_zextps256_ps512(half));
            }
        }
    }
}
#endif

// n <= 8 groups' (G 64 or more) products in 256-bit steps (without VNNI): acc[i] holds group i's in its 8 int32 lanes
template <int G>
static inline void group_sums(const uint8_t* w, const int8_t* x, int n, __m256i* acc) {
    const __m256i nib = _mm256_set1_epi8(15);
    for (int i = 0; i < 8; i++) {
        acc[i] = _mm256_setzero_si256();
        if (i >= n) continue;
        for (int j = 0; j < G / 64; j++) {  // 64 weights per step; unrolled, G being a constant
            const uint8_t* wg = w + i * G / 2 + 32 * j;
            const int8_t* xg = x + i * G + 64 * j;
            if ((G == 64 ? i : j) % 2 == 0) ahead(wg, AHEAD4);  // once a line
            __m256i v = _mm256_loadu_si256((const __m256i*)wg);
            __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            __m256i xe = _mm256_loadu_si256((const __m256i*)xg), xo = _mm256_loadu_si256((const __m256i*)(xg + 32));
            acc[i] = _mm256_add_epi16(acc[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo)));
        }
        acc[i] = _mm256_madd_epi16(acc[i], _mm256_set1_epi16(1));
    }
}

// int4 w = (q - 8) * scale + zero per group of G (32, 64, 128 or 256) along K, two q per byte (low nibble first). A group's
// products add up in 16-bit lanes (at most G/64 x 2 x 2 x 15 x 127 < 2^15), or in 32-bit ones with dpbusd; per group
// sum (q - 8) x ~ d * (sum q xq) - 8 c. The float work is done 8 groups at a time: the 8 groups' integer sums are
// gathered into one vector, converted and scaled together, the last few past a multiple of 8 in scalars (dot_i4,
// which returns 8 lanes that add up to the row's product).
// AVX-512 VNNI (dot_i4_wide): steps of 128 weights (x in even-odd order by 128), their float work per step instead
// (group_products_wide); a row 64 short of a multiple of 128 (SmolLM2's 576 columns) ends in a 256-bit step, and the
// last groups past a multiple of 8 are scaled in one masked vector. HOW_IT_WORKS.md, "The int8 and int4 products".
// 8 groups' scales s and zeros z (from g0): sd = s x d, and rest += z x sum x - 8 s x c
static inline void group_scales(__m256 s, __m256 z, const XQ& p, int64_t g0, __m256* sd, __m256* rest) {
    *sd = _mm256_mul_ps(s, _mm256_loadu_ps(&p.d[g0]));
    *rest = _mm256_fmadd_ps(z, _mm256_loadu_ps(&p.sum[g0]), *rest);
    *rest = _mm256_fnmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(8.f)), _mm256_loadu_ps(&p.c[g0]), *rest);
}

#if WIDE
// dot_i4 in AVX-512 VNNI steps of 128 weights (x in even-odd order by 128), their float work per step
// (group_products_wide), for a tile of W weight rows (w[v], scales[v], zeros[v]) by R rows of x (p[r]): each weight
// row's scales and zeros widened once for all R, each pair's sums run exactly as they would alone. out[v][r]: 8
// lanes that add up to the product of x row r and weight row v.
template <int G, int W, int R>
static inline void dot_i4_wide(const XQ* const* p, const uint8_t* const* w, const uint16_t* const* scales,
                               const uint16_t* const* zeros, int64_t K, __m256 (*out)[R]) {
    __m256 rest[W][R];
    __m512 wacc[W][R];
    for (int v = 0; v < W; v++)
        for (int r = 0; r < R; r++) rest[v][r] = _mm256_setzero_ps(), wacc[v][r] = _mm512_setzero_ps();
    const int64_t groups = K / G;
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        __m256 sd[W][R];  // scale * d per group
        const __mmask8 live = (__mmask8)(g0 + 8 <= groups ? 0xff : (1u << (groups - g0)) - 1);
        for (int v = 0; v < W; v++) {  // the last few groups masked: nothing read past the row (p's d, c, sum are 0)
            const __m256 s = widen8(_mm_maskz_loadu_epi16(live, scales[v] + g0));
            const __m256 z = widen8(_mm_maskz_loadu_epi16(live, zeros[v] + g0));
            for (int r = 0; r < R; r++) group_scales(s, z, *p[r], g0, &sd[v][r], &rest[v][r]);
        }
        const int n = groups - g0 < 8 ? groups - g0 : 8;
        const int8_t* x[R];
        const uint8_t* wg[W];
        for (int r = 0; r < R; r++) x[r] = &p[r]->q[g0 * G];
        for (int v = 0; v < W; v++) wg[v] = w[v] + g0 * G / 2;
        // a constant 8 unrolls the steps, which n alone does not
        if (G <= 64 && n == 8) group_products_wide<G, W, R>(wg, x, 8, sd, wacc);
        else group_products_wide<G, W, R>(wg, x, n, sd, wacc);
    }
    for (int v = 0; v < W; v++)
        for (int r = 0; r < R; r++)
            out[v][r] = _mm256_add_ps(
                _mm256_add_ps(_mm512_castps512_ps256(wacc[v][r]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wacc[v][r]), 1))),
                rest[v][r]);
}
#else
template <int G>
static inline __m256 dot_i4(const XQ& p, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, int64_t K) {
    __m256 total = _mm256_setzero_ps(), rest = _mm256_setzero_ps();
    const int64_t groups = K / G;
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        __m256 sd;  // scale * d per group
        if (g0 + 8 <= groups) {
            group_scales(widen8(scales + g0), widen8(zeros + g0), p, g0, &sd, &rest);
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
            // together: quicker than converting and scaling each step's pair
            __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(r[0], r[1]), _mm256_hadd_epi16(r[2], r[3]));
            sd = _mm256_permutevar8x32_ps(sd, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
            total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(h, _mm256_set1_epi16(1))), sd, total);
            continue;
        }
        __m256i acc[8];
        const int n = groups - g0 < 8 ? groups - g0 : 8;
        if (n == 8) group_sums<G>(w + g0 * G / 2, &p.q[g0 * G], 8, acc);
        else group_sums<G>(w + g0 * G / 2, &p.q[g0 * G], n, acc);
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8_i32(acc)), sd, total);
    }
    return _mm256_add_ps(total, rest);
}
#endif

// the output head's int8 product (f32): x kept in fp32, each weight widened, so that logits closer than x's int8
// rounding would move them (a small model's top two) keep their order. R rows of x at once share each widened
// weight, each row's sums run exactly as they would alone: out[r] = the product of row r (x + r * K).
template <int R>
static inline void dot_i8_exact(const float* x, const int8_t* w, int64_t K, float* out) {
    __m256 a[R][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (k % 64 == 0) ahead(w + k);  // as the other products do
        __m256 v[4];
        for (int c = 0; c < 4; c++)
            v[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + k + 8 * c))));
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) a[r][c] = _mm256_fmadd_ps(v[c], _mm256_loadu_ps(x + r * K + k + 8 * c), a[r][c]);
    }
    for (int r = 0; r < R; r++)
        out[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
}

#ifdef __AVX512BF16__
// 32 int8 weights -> 32 bf16 in order, exactly (an int8 has at most 8 significant bits, as bf16 holds). Its fp32 is
// its bf16 with 16 zero bits below, so one permute takes the upper halves of both: quicker than cvtne2ps2bf16.
static inline __m512i bf16_of_i8(const int8_t* w) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))));
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                         31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd, _mm512_castps_si512(hi));
}

// The output head's int8 product (f32) with dpbf16: x as it came (bf16) and each weight made bf16, both exact, so
// every product is exact as in dot_i8_exact, but 32 of them an instruction into 16 fp32 lanes, one chain per pair
// of rows. A tile of W weight rows by R rows of x: each weight vector made serves R rows, each x vector W weight
// rows, and every pair's sums run exactly as they would alone: out[r][j], 8 lanes that add up to x row r (at
// x + r * K) times w row j.
template <int W, int R>
static inline void dot_i8_bf16(const uint16_t* x, const int8_t* const* w, int64_t K, __m256 out[][8]) {
    __m512 acc[R][W];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i v[W];
        for (int j = 0; j < W; j++) {
            if (k % 64 == 0) ahead(w[j] + k);
            v[j] = bf16_of_i8(w[j] + k);
        }
        for (int r = 0; r < R; r++) {
            const __m512i xr = _mm512_loadu_si512(x + r * K + k);
            for (int j = 0; j < W; j++) acc[r][j] = dp(acc[r][j], v[j], xr);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++)
            out[r][j] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][j]),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][j]), 1)));
}

// gemv_int8's f32 product with dpbf16. 8 weight rows at a time stay in L1 while tiles of 2 weight rows by 8 rows of
// x (then 4, 2, 1 for the last few) go over them; a lone row takes one weight row at a time, one stream through
// memory (two interleaved read slower from memory). The 8 rows' sums are reduced and scaled together.
static void head_i8_bf16(const uint16_t* x, const int8_t* w, const uint16_t* scales, float* y, int64_t M, int64_t N,
                         int64_t K) {
    constexpr int W = 2, R = 8;
    share_rows((N + 7) / 8, 8 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n0 = 8 * a; n0 < 8 * b && n0 < N; n0 += 8) {
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;
            const __mmask8 live = (__mmask8)((1u << rows) - 1);
            const int8_t* wr[8];
            for (int64_t i = 0; i < 8; i++) wr[i] = w + (n0 + (i < rows ? i : 0)) * K;  // past N: row n0 again
            const __m256 s = widen8(_mm_maskz_loadu_epi16(live, scales + n0));
            for (int64_t m = 0; m < M;) {
                const int64_t r = M - m >= R ? R : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
                const uint16_t* xm = x + m * K;
                __m256 t[R][8];
                if (r == 1)
                    for (int64_t i = 0; i < 8; i++) dot_i8_bf16<1, 1>(xm, wr + i, K, (__m256(*)[8])&t[0][i]);
                else
                    for (int64_t i = 0; i < 8; i += W) {
                        if (r == R) dot_i8_bf16<W, R>(xm, wr + i, K, (__m256(*)[8])&t[0][i]);
                        else if (r == 4) dot_i8_bf16<W, 4>(xm, wr + i, K, (__m256(*)[8])&t[0][i]);
                        else dot_i8_bf16<W, 2>(xm, wr + i, K, (__m256(*)[8])&t[0][i]);
                    }
                for (int64_t j = 0; j < r; j++, m++)
                    _mm256_mask_storeu_ps(y + m * N + n0, live, _mm256_mul_ps(sum8x8(t[j]), s));
            }
        }
    });
}
#endif

// y[M, N] = x[M, K] @ (w[N, K] * scales[N])^T, x, scales and y bf16, w int8; K a multiple of 32
#ifdef __AMX_INT8__
// int8 with AMX (the avx512+...+amx set): tdpbssd multiplies 16 weight rows by a block of 32 int8 (the A tile,
// straight from w) by x's block rounded to int8 (the B tile: the block's 8 quads by g rows of x, packed once a call)
// into 16 x g exact int32 block sums. Each is converted and added times x's block scale into its pair's fp32 sum,
// block after block, then scaled by the weight row's: the same operations in the same order for a row of x whatever
// rows share the call, so batch 1 computes what a batch or a prompt does. Tiles: 0 and 1 C (16 weight rows each),
// 2 and 3 their A, 4 B; 5, 6 and 7 the C and B of a second block.
static TileConfig int8_tiles(int64_t g) {
    TileConfig c = tiles(g, 2, 32);  // A: a block of 32 int8 a row
    c.rows[4] = c.rows[7] = 8;  // B: the block's 8 quads
    return c;
}

// x's rows rounded to int8 as B tiles: per group of g rows (the last padded with zeros), per quad of K, the group's
// rows' quads
static void pack_quads(const std::vector<XQ>& xq, int64_t M, int64_t K, int64_t g, vec<uint32_t>& xb) {
    xb.assign((M + g - 1) / g * (K / 4) * g, 0);
    for (int64_t m = 0; m < M; m++) {
        const uint32_t* q = (const uint32_t*)xq[m].q.data();
        uint32_t* to = &xb[m / g * (K / 4) * g + m % g];
        for (int64_t p = 0; p < K / 4; p++) to[p * g] = q[p];
    }
}

// a block's int32 sums c (as gemv_int8_amx stores them) converted and added times x's scales d into acc: for one
// row of x, the 32 weight rows' side by side (acc[0], acc[1])
static inline void sums_into(__m512* acc, const int32_t* c, const float* d) {
    const __m512 db = _mm512_set1_ps(d[0]);
    for (int h = 0; h < 2; h++) acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * h)), db, acc[h]);
}

// for 16 weight rows of more rows of x: c [16][16] (weight row, row of x), acc[r] weight row r's
static inline void sums16_into(__m512* acc, const int32_t* c, const float* d) {
    const __m512 db = _mm512_load_ps(d);
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), db, acc[r]);
}

// The output head's int8 product (f32) with AMX: each block of 32 weight rows made bf16 (exactly, bf16_of_i8) in
// scratch, then the bf16 product's tiles (amx.h's tile32) over it: every product exact, one fp32 chain per output
// along K whatever the rows beside it, then the weight row's scale.
static void head_i8_amx(const uint16_t* x, const int8_t* w, const uint16_t* scales, float* y, int64_t M, int64_t N,
                        int64_t K) {
    const int64_t groups = (M + 15) / 16, g = (M + groups - 1) / groups, steps = K / 32;
    static thread_local vec<uint32_t> xb_;
    vec<uint32_t>& xb = xb_;
    pack_pairs(x, M, K, g, xb);
    share_tiles((N + 31) / 32, 32 * K, tiles_for(g), [&](int64_t a, int64_t b) {
        static thread_local vec<uint16_t> wb_;
        vec<uint16_t>& wb = wb_;  // the block's weights as bf16, rows past N zeros
        wb.resize(32 * K);
        alignas(64) float out[2][16][16];
        for (int64_t blk = a; blk < b; blk++) {
            const int64_t n0 = 32 * blk, rows = N - n0 < 32 ? N - n0 : 32;
            for (int64_t r = 0; r < 32; r++)
                for (int64_t k = 0; k < K; k += 32)
                    _mm512_storeu_si512(&wb[r * K + k], r < rows ? bf16_of_i8(w + (n0 + r) * K + k)
                                                                 : _mm512_setzero_si512());
            for (int64_t grp = 0; grp < groups; grp++) {
                tile32(wb.data(), wb.data() + 16 * K, &xb[grp * steps * 16 * g], g, K, &out[0][0][0]);
                put_block(y, &out[0][0][0], g, grp * g, M, N, n0, rows, scales, 1);
            }
        }
    });
}

static void gemv_int8_amx(const std::vector<XQ>& xq, const int8_t* w, const uint16_t* scales, void* y, int64_t M,
                          int64_t N, int64_t K, int64_t f32) {
    const int64_t groups = (M + 15) / 16, g = (M + groups - 1) / groups, nb = K / 32;  // g <= 16 rows each
    static thread_local vec<uint32_t> xb_;
    static thread_local vec<float> d_;
    vec<uint32_t>& xb = xb_;  // per group of g rows, block, quad: the group's rows' quads (zeros past M)
    vec<float>& d = d_;  // per group, block: its rows' scales in 16 lanes (zeros past the group)
    pack_quads(xq, M, K, g, xb);
    d.assign(groups * nb * 16, 0.f);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) d[(m / g * nb + b) * 16 + m % g] = xq[m].d[b];
    share_tiles((N + 31) / 32, 32 * K, int8_tiles(g), [&](int64_t a, int64_t e) {
        alignas(64) int32_t c[32 * 16] = {};
        alignas(64) float o[32 * 16];
        static thread_local vec<int8_t> pad_;  // the last rows past N, as zeros
        for (int64_t blk = a; blk < e; blk++) {
            const int64_t n0 = 32 * blk, rows = N - n0 < 32 ? N - n0 : 32;
            const int8_t* w0 = w + n0 * K;
            if (rows < 32) {
                vec<int8_t>& pad = pad_;
                pad.assign(32 * K, 0);
                memcpy(pad.data(), w0, rows * K);
                w0 = pad.data();
            }
            for (int64_t grp = 0; grp < groups; grp++) {
                const uint32_t* xg = &xb[grp * nb * 8 * g];
                const float* dg = &d[grp * nb * 16];
                // a decode step's: the next block's line of each row asked for as this one's are read (tile loads
                // of rows K apart waited on memory, whose prefetcher does not see them coming)
                const bool ahead = groups <= 2 && grp == 0;
                if (g > 1) {  // 16 weight rows at a time: their 16 sums' vectors stay in registers (32 spilled)
                    for (int h = 0; h < 2; h++) {
                        const int8_t* wh = w0 + 16 * h * K;
                        __m512 acc[16];
                        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                        for (int64_t b = 0; b < nb; b += 2) {  // two blocks a step, in C tiles 0 and 5
                            const bool two = b + 1 < nb;
                            if (ahead && h == 0)
                                for (int r = 0; r < 32; r++)
                                    _mm_prefetch((const char*)(w0 + 32 * K + r * K + 32 * b), _MM_HINT_T0);
                            _tile_zero(0);
                            _tile_loadd(4, xg + b * 8 * g, 4 * g);
                            _tile_loadd(2, wh + 32 * b, K);
                            _tile_dpbssd(0, 2, 4);
                            if (two) {
                                _tile_zero(5);
                                _tile_loadd(7, xg + (b + 1) * 8 * g, 4 * g);
                                _tile_loadd(3, wh + 32 * (b + 1), K);
                                _tile_dpbssd(5, 3, 7);
                            }
                            _tile_stored(0, c, 64);
                            sums16_into(acc, c, dg + 16 * b);
                            if (two) {
                                _tile_stored(5, c, 64);
                                sums16_into(acc, c, dg + 16 * (b + 1));
                            }
                        }
                        for (int r = 0; r < 16; r++) _mm512_store_ps(o + 16 * (16 * h + r), acc[r]);
                    }
                    put_block(y, o, g, grp * g, M, N, n0, rows, scales, f32);
                    continue;
                }
                // one row of x: both halves a pass, the 32 sums side by side (acc[0], acc[1] by weight row); two
                // blocks a step, in C tiles 0, 1 and 5, 6: the second's products run while the first's sums are
                // stored and scaled
                __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int64_t b = 0; b < nb; b += 2) {
                    const bool two = b + 1 < nb;
                    if (ahead)
                        for (int r = 0; r < 32; r++)
                            _mm_prefetch((const char*)(w0 + 32 * K + r * K + 32 * b), _MM_HINT_T0);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(4, xg + b * 8 * g, 4 * g);
                    _tile_loadd(2, w0 + 32 * b, K);
                    _tile_dpbssd(0, 2, 4);
                    _tile_loadd(3, w0 + 16 * K + 32 * b, K);
                    _tile_dpbssd(1, 3, 4);
                    if (two) {
                        _tile_zero(5);
                        _tile_zero(6);
                        _tile_loadd(7, xg + (b + 1) * 8 * g, 4 * g);
                        _tile_loadd(2, w0 + 32 * (b + 1), K);
                        _tile_dpbssd(5, 2, 7);
                        _tile_loadd(3, w0 + 16 * K + 32 * (b + 1), K);
                        _tile_dpbssd(6, 3, 7);
                    }
                    _tile_stored(0, c, 4);
                    _tile_stored(1, c + 16, 4);
                    sums_into(acc, c, dg + 16 * b);
                    if (two) {
                        _tile_stored(5, c, 4);
                        _tile_stored(6, c + 16, 4);
                        sums_into(acc, c, dg + 16 * (b + 1));
                    }
                }
                for (int h = 0; h < 2; h++) _mm512_store_ps(o + 16 * h, acc[h]);
                put_block(y, o, g, grp * g, M, N, n0, rows, scales, f32);
            }
        }
    });
}
#endif

void fast_decode::gemv_int8(const uint16_t* x, const int8_t* w, const uint16_t* scales, void* y,
                          int64_t M, int64_t N, int64_t K, int64_t f32) {
    if (f32) {
#ifdef __AMX_INT8__
        return head_i8_amx(x, w, scales, (float*)y, M, N, K);
#endif
#ifdef __AVX512BF16__
        return head_i8_bf16(x, w, scales, (float*)y, M, N, K);
#else
        // rows of x a pass: their accumulators and the widened w in registers, their fp32 rows in L1
        constexpr int64_t XR = WIDE ? 4 : 2;
        static thread_local vec<float> xs_;
        vec<float>& xs = xs_;
        xs.resize(M * K);
        for (int64_t i = 0; i < M * K; i++) xs[i] = from_bf16(x[i]);
        share_rows(N, K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
            if (M == 1) {  // batch-1 decode: the weights in one stream
                for (int64_t n = a; n < b; n++) {
                    float o;
                    dot_i8_exact<1>(&xs[0], w + n * K, K, &o);
                    put(y, n, o * from_bf16(scales[n]), 1);
                }
                return;
            }
            for (int64_t n0 = a; n0 < b; n0 += 8)  // 8 weight rows at a time stay in L1 for every pass of x
                for (int64_t m = 0; m < M;) {  // XR rows of x a pass (2 of a long row), the last few one by one
                    const int64_t r = M - m >= XR && K <= 1024 ? XR : M - m >= 2 ? 2 : 1;
                    for (int64_t n = n0; n < b && n < n0 + 8; n++) {
                        float o[XR];
                        if (r == XR) dot_i8_exact<XR>(&xs[m * K], w + n * K, K, o);
                        else if (r == 2) dot_i8_exact<2>(&xs[m * K], w + n * K, K, o);
                        else dot_i8_exact<1>(&xs[m * K], w + n * K, K, o);
                        for (int64_t j = 0; j < r; j++) put(y, (m + j) * N + n, o[j] * from_bf16(scales[n]), 1);
                    }
                    m += r;
                }
        });
        return;
#endif
    }
    std::vector<XQ>& xq = xq_;  // (by reference in the parallel regions: a thread_local name is each thread's own)
    static thread_local vec<float> shift_;
    vec<float>& shift = shift_;  // per row of x: FLIP x sum of c
    xq.resize(M), shift.resize(M);
    #pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        prepare(x + m * K, K, 32, 0, xq[m]);
        shift[m] = 0.f;
        for (int64_t b = 0; FLIP && b < K / 32; b++) shift[m] += FLIP * xq[m].c[b];
    }
#ifdef __AMX_INT8__
    return gemv_int8_amx(xq, w, scales, y, M, N, K, f32);
#endif
    // Each weight row is read from memory once, 8 rows' sums reduced together. Several rows of x (a batch, a verify
    // pass) go over the 8 rows while they are in cache, in tiles of TW weight rows by TR rows of x, each summed
    // exactly as it would be alone: a row's result does not depend on the rows beside it, so verifying a token
    // computes what decoding it does.
    share_rows((N + 7) / 8, 8 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n0 = 8 * a; n0 < 8 * b && n0 < N; n0 += 8) {
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;
            const int8_t* wr[8];
            for (int64_t i = 0; i < 8; i++) wr[i] = w + (n0 + (i < rows ? i : 0)) * K;  // past N: row n0 again
            for (int64_t m = 0; m < M;) {
                const int64_t r = M - m >= TR ? TR : 1;  // TR rows of x a pass, the last few one by one
                const XQ* xr[TR];
                for (int64_t j = 0; j < TR; j++) xr[j] = &xq[m + j < M ? m + j : m];
                __m256 t[TR][8], u[TR][TW];
                if (r == TR)
                    for (int64_t i = 0; i < 8; i += TW) {
                        dot_i8<TW, TR>(xr, wr + i, K, u);
                        for (int64_t j = 0; j < TR; j++)
                            for (int64_t c = 0; c < TW; c++) t[j][i + c] = u[j][c];
                    }
                else  // one weight row at a time, a single stream through memory: quicker where w is not cached
                    for (int64_t i = 0; i < 8; i++) dot_i8<1, 1>(xr, wr + i, K, (__m256(*)[1])&t[0][i]);
                for (int64_t j = 0; j < r; j++, m++) {
                    alignas(32) float o[8];
                    _mm256_store_ps(o, sum8x8(t[j]));
                    for (int64_t i = 0; i < rows; i++)
                        put(y, m * N + n0 + i, (o[i] - shift[m]) * from_bf16(scales[n0 + i]), f32);
                }
            }
        }
    });
}

// R rows of x (m on) over weight rows n0 .. n0 + 7 (the first `rows` of them stored; past N: row n0 again), the 8
// rows' sums reduced together rather than each at the end of its row. With VNNI and several rows of x, two weight
// rows at a time: each x vector loaded serves both.
template <int G, int R>
static inline void rows_i4(const XQ* xq, int64_t m, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                           void* y, int64_t N, int64_t K, int64_t n0, int64_t rows, int64_t f32) {
    __m256 t[R][8];
#if WIDE
    constexpr int W = R > 1 ? 2 : 1;  // a lone row: one weight row at a time, one stream through memory
    const XQ* xr[R];
    for (int j = 0; j < R; j++) xr[j] = xq + m + j;
    for (int64_t i = 0; i < 8; i += W) {
        const uint8_t* wn[W];
        const uint16_t *sn[W], *zn[W];
        for (int v = 0; v < W; v++) {
            const int64_t n = n0 + (i + v < rows ? i + v : 0);
            wn[v] = w + n * K / 2, sn[v] = scales + n * (K / G), zn[v] = zeros + n * (K / G);
        }
        __m256 o[W][R];
        dot_i4_wide<G, W, R>(xr, wn, sn, zn, K, o);
        for (int v = 0; v < W; v++)
            for (int j = 0; j < R; j++) t[j][i + v] = o[v][j];
    }
#else
    for (int64_t i = 0; i < 8; i++) {
        const int64_t n = n0 + (i < rows ? i : 0);
        t[0][i] = dot_i4<G>(xq[m], w + n * K / 2, scales + n * (K / G), zeros + n * (K / G), K);
    }
#endif
    for (int j = 0; j < R; j++) put8(y, (m + j) * N + n0, sum8x8(t[j]), rows, f32);
}

// 8 weight rows at a time. Several rows of x (a batch, a verify pass) go over them while they are in cache, each
// summed exactly as it would be alone: a row's result does not depend on the rows beside it. With AVX-512 VNNI in
// tiles of 4 rows of x (then 2, then 1 for the last few), each weight vector loaded and split serving all of them;
// else one row at a time.
template <int G>
static void gemv_i4(const XQ* xq, int64_t M, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, void* y,
                    int64_t N, int64_t K, int64_t f32) {
    constexpr int R = WIDE ? 4 : 1;
    share_rows((N + 7) / 8, 8 * (K / 2 + K / G * 4), CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n0 = 8 * a; n0 < 8 * b && n0 < N; n0 += 8) {
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;
            int64_t m = 0;
            for (; m + R <= M; m += R) rows_i4<G, R>(xq, m, w, scales, zeros, y, N, K, n0, rows, f32);
            if constexpr (R > 2)
                for (; m + 2 <= M; m += 2) rows_i4<G, 2>(xq, m, w, scales, zeros, y, N, K, n0, rows, f32);
            if (m < M) rows_i4<G, 1>(xq, m, w, scales, zeros, y, N, K, n0, rows, f32);
        }
    });
}

static constexpr int64_t NB = 32;  // rows of w per task: they stay in L2 while every pair of x rows goes over them
static constexpr int64_t VERIFY_ROWS = 32;  // int4 products of up to this many rows (a verify pass) sum each row alone

// Many rows of x (prefill): a tile of 2 rows of x by 2 rows of w, so that each weight vector
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

#ifdef __AMX_INT8__
// int4 with AMX (G of 64 or more): tdpbusd multiplies 16 weight rows' q (0..15, unsigned) by 64 of x rounded to int8
// per group (signed). The A tile: a block of 32 weight rows unpacked once into scratch, each 32 packed bytes as
// their 32 low nibbles then their 32 high ones, which is x's order by 64 (prepare's span 64); the B tile: x's quads
// by g rows, packed once a call. A group's G / 64 steps add into exact int32 sums; then per group, in one fp32 chain
// per output: acc += sum x (s d), acc += z x sum x, acc += -8 s x c (sum (q - 8) x ~ d sum q xq - 8 c). The same
// operations in the same order for a row of x whatever rows share the call. Tiles: 0, 1 C; 2, 3 A; 4 B; 5, 6, 7
// the C and B of a second group.
static TileConfig int4_tiles(int64_t g) { return tiles(g, 2, 64); }

// rows [32][K / 2] of packed q -> u [32][K] unpacked in x's order by 64 (low nibbles, then high ones)
static inline void unpack32(const uint8_t* w, int64_t rows, int64_t K, uint8_t* u) {
    const __m512i nib = _mm512_set1_epi8(15);
    for (int64_t r = 0; r < 32; r++) {
        uint8_t* to = u + r * K;
        if (r >= rows) {
            memset(to, 0, K);
            continue;
        }
        const uint8_t* from = w + r * (K / 2);
        int64_t j = 0;
        for (; j + 64 <= K / 2; j += 64) {  // 64 bytes: 128 weights, two spans of 64
            const __m512i b = _mm512_loadu_si512(from + j);
            const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
            _mm512_storeu_si512(to + 2 * j, _mm512_shuffle_i64x2(lo, hi, 0x44));
            _mm512_storeu_si512(to + 2 * j + 64, _mm512_shuffle_i64x2(lo, hi, 0xee));
        }
        if (j < K / 2) {  // a last span of 64
            const __m256i b = _mm256_loadu_si256((const __m256i*)(from + j)), n = _mm256_set1_epi8(15);
            _mm256_storeu_si256((__m256i*)(to + 2 * j), _mm256_and_si256(b, n));
            _mm256_storeu_si256((__m256i*)(to + 2 * j + 32), _mm256_and_si256(_mm256_srli_epi16(b, 4), n));
        }
    }
}

static void gemv_int4_amx(const std::vector<XQ>& xq, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                          void* y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t f32) {
    const int64_t groups = (M + 15) / 16, g = (M + groups - 1) / groups, ng = K / G;  // g <= 16 rows of x each
    static thread_local vec<uint32_t> xb_;
    static thread_local vec<float> dcs_;
    vec<uint32_t>& xb = xb_;  // per group of g rows, quad of K: the rows' quads (zeros past M)
    vec<float>& dcs = dcs_;  // per group of rows, group of K: d, c and sum x of its rows, 16 lanes each
    pack_quads(xq, M, K, g, xb);
    dcs.assign(groups * ng * 48, 0.f);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < ng; b++) {
            float* at = &dcs[(m / g * ng + b) * 48 + m % g];
            at[0] = xq[m].d[b], at[16] = xq[m].c[b], at[32] = xq[m].sum[b];
        }
    share_tiles((N + 31) / 32, 16 * K, int4_tiles(g), [&](int64_t a, int64_t e) {
        static thread_local vec<uint8_t> u_;
        static thread_local vec<float> sz_;
        vec<uint8_t>& u = u_;  // the block's q, unpacked
        vec<float>& sz = sz_;  // the block's scales [32][ng], then its zeros [32][ng], as fp32
        u.resize(32 * K), sz.resize(64 * ng);
        const __m512i by_row = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                                                    15), _mm512_set1_epi32((int)ng));
        alignas(64) int32_t c[32 * 16] = {};
        alignas(64) float o[32 * 16];
        for (int64_t blk = a; blk < e; blk++) {
            const int64_t n0 = 32 * blk, rows = N - n0 < 32 ? N - n0 : 32;
            unpack32(w + n0 * (K / 2), rows, K, u.data());
            for (int64_t i = 0; i < 32 * ng; i += 16) {  // rows past N: zeros
                const int64_t n = rows * ng - i < 16 ? (rows * ng - i > 0 ? rows * ng - i : 0) : 16;
                _mm512_storeu_ps(&sz[i], widen16(scales + n0 * ng + i, n));
                _mm512_storeu_ps(&sz[32 * ng + i], widen16(zeros + n0 * ng + i, n));
            }
            for (int64_t grp = 0; grp < groups; grp++) {
                const uint32_t* xg = &xb[grp * (K / 4) * g];
                if (g > 1) {  // 16 weight rows at a time: their 16 sums' vectors stay in registers (32 spilled)
                    for (int h = 0; h < 2; h++) {
                        const uint8_t* uh = &u[16 * h * K];
                        __m512 acc[16];
                        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                        for (int64_t b = 0; b < ng; b++) {
                            _tile_zero(0);
                            for (int64_t k = b * G; k < (b + 1) * G; k += 64) {
                                _tile_loadd(4, xg + k / 4 * g, 4 * g);
                                _tile_loadd(2, uh + k, K);
                                _tile_dpbusd(0, 2, 4);
                            }
                            _tile_stored(0, c, 64);
                            const float* v = &dcs[(grp * ng + b) * 48];  // as scale_group (below) takes them
                            const float* sb = &sz[b + 16 * h * ng];
                            const __m512 d = _mm512_load_ps(v), cx = _mm512_load_ps(v + 16);
                            const __m512 sx = _mm512_load_ps(v + 32);
                            #pragma GCC unroll 16
                            for (int r = 0; r < 16; r++) {
                                const __m512 s = _mm512_set1_ps(sb[r * ng]);
                                const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
                                acc[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(s, d), acc[r]);
                                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sb[(32 + r) * ng]), sx, acc[r]);
                                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(-8.f)), cx, acc[r]);
                            }
                        }
                        for (int r = 0; r < 16; r++) _mm512_store_ps(o + 16 * (16 * h + r), acc[r]);
                    }
                    put_block(y, o, g, grp * g, M, N, n0, rows, nullptr, f32);
                    continue;
                }
                // one row of x: both halves a pass, the 32 sums side by side (acc[0], acc[1] by weight row)
                __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                auto scale_group = [&](int64_t b) {  // group b's 32 int32 sums in c into acc
                    const float* v = &dcs[(grp * ng + b) * 48];  // d, c, sum x by row of x
                    const float* sb = &sz[b];  // weight row r's scale sb[r ng], its zero sb[(32 + r) ng]
                    for (int h = 0; h < 2; h++) {
                        const __m512 s = _mm512_i32gather_ps(by_row, sb + 16 * h * ng, 4);
                        const __m512 z = _mm512_i32gather_ps(by_row, sb + (32 + 16 * h) * ng, 4);
                        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(v[0]));
                        acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * h)), sd, acc[h]);
                        acc[h] = _mm512_fmadd_ps(z, _mm512_set1_ps(v[32]), acc[h]);
                        const __m512 s8 = _mm512_mul_ps(s, _mm512_set1_ps(-8.f));
                        acc[h] = _mm512_fmadd_ps(s8, _mm512_set1_ps(v[16]), acc[h]);
                    }
                };
                // two groups a step, in C tiles 0, 1 and 5, 6: the second's products run while the first's sums
                // are stored and scaled
                for (int64_t b = 0; b < ng; b += 2) {
                    const bool two = b + 1 < ng;
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int64_t k = b * G; k < (b + 1) * G; k += 64) {
                        _tile_loadd(4, xg + k / 4 * g, 4 * g);
                        _tile_loadd(2, &u[k], K);
                        _tile_dpbusd(0, 2, 4);
                        _tile_loadd(3, &u[16 * K + k], K);
                        _tile_dpbusd(1, 3, 4);
                    }
                    if (two) {
                        _tile_zero(5);
                        _tile_zero(6);
                        for (int64_t k = (b + 1) * G; k < (b + 2) * G; k += 64) {
                            _tile_loadd(7, xg + k / 4 * g, 4 * g);
                            _tile_loadd(2, &u[k], K);
                            _tile_dpbusd(5, 2, 7);
                            _tile_loadd(3, &u[16 * K + k], K);
                            _tile_dpbusd(6, 3, 7);
                        }
                    }
                    _tile_stored(0, c, 4);
                    _tile_stored(1, c + 16, 4);
                    scale_group(b);
                    if (two) {
                        _tile_stored(5, c, 4);
                        _tile_stored(6, c + 16, 4);
                        scale_group(b + 1);
                    }
                }
                for (int h = 0; h < 2; h++) _mm512_store_ps(o + 16 * h, acc[h]);
                put_block(y, o, g, grp * g, M, N, n0, rows, nullptr, f32);
            }
        }
    });
}
#endif

// y[M, N] = x[M, K] @ w^T, w given as packed q [N, K / 2], scales and zeros [N, K / G] (bf16); K a multiple of 64
void fast_decode::gemv_int4(const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros,
                          void* y, int64_t M, int64_t N, int64_t K, int64_t G, int64_t f32) {
    std::vector<XQ>& xq = xq_;
    xq.resize(M);
#ifdef __AMX_INT8__
    if (G >= 64) {  // every row count on the tiles (a group of 32 is half a tile's row: the kernels below)
        #pragma omp parallel for schedule(static) if (M > 1)
        for (int64_t m = 0; m < M; m++) prepare(x + m * K, K, G, 64, xq[m]);
        return gemv_int4_amx(xq, w, scales, zeros, y, M, N, K, G, f32);
    }
#endif
    const bool wide = WIDE && M <= VERIFY_ROWS;
    #pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) prepare(x + m * K, K, G, wide ? 128 : 64, xq[m]);
    if (M > VERIFY_ROWS) {  // prefill: tiles, each row's sums in another order than alone
        if (G == 32) gemm_i4<32>(xq, w, scales, zeros, y, M, N, K, f32);
        else if (G == 64) gemm_i4<64>(xq, w, scales, zeros, y, M, N, K, f32);
        else if (G == 128) gemm_i4<128>(xq, w, scales, zeros, y, M, N, K, f32);
        else gemm_i4<256>(xq, w, scales, zeros, y, M, N, K, f32);
    } else if (G == 32) gemv_i4<32>(xq.data(), M, w, scales, zeros, y, N, K, f32);
    else if (G == 64) gemv_i4<64>(xq.data(), M, w, scales, zeros, y, N, K, f32);
    else if (G == 128) gemv_i4<128>(xq.data(), M, w, scales, zeros, y, N, K, f32);
    else gemv_i4<256>(xq.data(), M, w, scales, zeros, y, N, K, f32);
}

// prefill's int4 weights: w [N, K / 2] packed, scales and zeros [N, K / G] -> out [N, K] in fp32 (or bf16), for a
// GEMM of many rows; one pass, 32 weights a step (quicker than a table lookup per weight)
void fast_decode::dequantize_int4(const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, void* out,
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
