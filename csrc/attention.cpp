#include "common.h"
#include "kernels.h"

// Attention for a few query rows (decode, verification) over the KV cache (bf16; int8 further down). torch's CPU
// attention has a high fixed cost a layer and reads slowly at long contexts; this one streams K and V once per KV
// head for all the query rows that share it (grouped-query attention), split along the context so that every core
// has work, as flash-decoding does, and merges the parts with their softmax maxima. HOW_IT_WORKS.md, "Attention for
// a few query rows".

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

static constexpr int64_t CHUNK = 256;  // the fewest cache positions a task takes

// cache positions per task: 256 to 1024, about 16 tasks over `heads` KV heads for a full cache of `slots` positions,
// whatever the count of threads. Each task sets up, and starts its streams of K and V cold, so longer tasks are
// quicker at long contexts. From the cache's size, not the context's: a row's parts, and so its rounding, are then
// the same in a decode step and in a verify pass a few positions longer.
static inline int64_t chunk_for(int64_t slots, int64_t heads) {
    const int64_t c = (slots * heads / 16 + CHUNK - 1) / CHUNK * CHUNK;
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
// pv_tile16 in 512-bit vectors, 32 dimensions a step (D 32 or more): half the instructions, where 512-bit FMAs
// issue at the 256-bit rate. Unpacking 32 bf16 under zeros
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

// A token tree's node sees its context, then its ancestors' slots, with other nodes' slots between; decoding its path
// one token at a time would have the same positions consecutive. A task's sums over its positions come out the same
// whatever lies masked between them (they add zeros), but which task, and so which part of the merge, a position
// falls in must be decoding's: a row's n-th visible position goes to the task holding position n. Returns mask
// [S, L] with each row's positions kept in this task [j0, j1) so (a copy, or mask itself where every row is a
// prefix [0, x): decoding, a chain's verification), and in *end how far past j1 they reach.
static const uint8_t* virtual_rows(const uint8_t* mask, int64_t S, int64_t L, int64_t j0, int64_t j1, int64_t* end) {
    static thread_local vec<uint8_t> rows;
    *end = j1;
    auto prefix = [&](const uint8_t* m) {  // the length of m's leading run, or -1 where m sees more after it
        int64_t x = 0;
        while (x < L && m[x]) x++;
        for (int64_t j = x; j < L; j++)
            if (m[j]) return (int64_t)-1;
        return x;
    };
    bool tree = false;
    for (int64_t s = 0; s < S && !tree; s++) tree = prefix(mask + s * L) < 0;
    if (!tree) return mask;
    rows.assign(S * L, 0);
    for (int64_t s = 0; s < S; s++)
        for (int64_t j = 0, n = 0; j < L; j++)  // n: the visible position j is, counted as decoding counts
            if (mask[s * L + j]) {
                if (n >= j0 && n < j1) rows[s * L + j] = 1, *end = j + 1 > *end ? j + 1 : *end;
                n++;
            }
    return rows.data();
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
// registers (quicker than an fp32 copy of each block), K and V asked for ahead of the reads. Over an int8 cache
// (T int8_t) ks holds K's scale per position, and vs V's per position and
// 32 dimensions (D / 32 a position): they multiply the scores, and the weights of each 32 dimensions.
template <int D, typename T>
static void attend_chunk(const float* qf, const T* k, const float* ks, const T* v, const float* vs,
                         const uint8_t* mask, int64_t S, int64_t L, int64_t R, int64_t j0, int64_t j1, float* part) {
    constexpr int64_t BJ = 8192 / D / sizeof(T) < CHUNK ? 8192 / D / sizeof(T) : CHUNK;  // positions per block
    static_assert(BJ % 4 == 0, "pv_steps counts whole blocks of 4");
    constexpr int64_t NC = sizeof(T) == 1 ? D / 32 : 0, W = D * sizeof(T);  // V's scales a position; bytes a row
    static thread_local vec<float> sc, pc;  // [n][R8] the scores, then the weights; [NC][n][R8] times V's scales
    int64_t lo, hi, end;
    mask = virtual_rows(mask, S, L, j0, j1, &end);
    span(mask, S, L, j0, end, &lo, &hi);
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
    // (paced every 4th position: asking every position costs instructions)
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
    // beside all of V
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
// three, besides a max, a roundscale and a scalef: FMAs wait on the units dpbf16 runs on. The attention's weights
// are rounded to 8 bits after
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

// Where a task's K (or V) rows lie, D values each: position j at at(j), consecutive within every run of 16 positions
// from a multiple of 16. A contiguous cache (blocks null), or a paged one read where it lies, with no copy: position
// first + j in block blocks[(first + j) / bs] of the pool, stride values from one block to the next.
struct Rows {
    const uint16_t* p;
    int64_t D, first = 0, n = 0;  // n: the positions held (paged), for the requests ahead
    const int64_t* blocks = nullptr;
    int64_t bs = 0, stride = 0;
    const uint16_t* at(int64_t j) const {
        if (!blocks) return p + j * D;
        j += first;
        return p + blocks[j / bs] * stride + j % bs * D;
    }
    Rows from(int64_t b) const {  // the same rows from position b on (paged: b a multiple of 16)
        Rows r = *this;
        if (blocks) r.first += b, r.n -= b;
        else r.p += b * D;
        return r;
    }
    const char* ahead(int64_t j, int64_t bytes) const {  // `bytes` past position j's row, or null past the rows held
        if (!blocks) return (const char*)(p + j * D) + bytes;
        const int64_t i = j + bytes / (2 * D);
        return i < n ? (const char*)at(i) + bytes % (2 * D) : nullptr;
    }
};

#ifdef __AVX512BF16__
// With AVX512-BF16, dpbf16 multiplies bf16 pairs exactly into fp32: the scores and the weighted sum take half the
// instructions of widening then an FMA, and K and V are never widened. The weights e^(s - m) are rounded to bf16 for
// it, as transformers' eager attention rounds them in a bf16 model. K and V are asked for KV_AHEAD bytes ahead of
// their reads, into L1; a core with less than 48 KB of L1, where a block's K and V with the next block's do not fit,
// asks into L2 instead (KV_HINT) and further ahead (KV_AHEAD 7168, both set by cpu_gemv.targets). HOW_IT_WORKS.md,
// "Attention for a few query rows".
#ifndef KV_AHEAD
#define KV_AHEAD 4096
#endif

static inline __m512i pair(const uint16_t* p) {  // two bf16, broadcast
    uint32_t u;
    memcpy(&u, p, 4);
    return _mm512_set1_epi32(u);
}

// The scores' vectors: 16 lanes, P rows by E = 16 / P, of which RT hold query rows. Lane r * E + e of a product
// holds row r's sum over K's dimension pairs e, e + E, e + 2E, ..., and after fold_all lane r * E + e holds row r's
// score at position e of E: no transposition of K (16 x 16 words, 8 shuffles a position at 8 rows) and no sums
// across lanes, but E - 1 folds for E positions, quicker than the transposition. P depends on the query heads per KV
// head alone, never on how many positions are asked: a row's score is summed in the same order whether it comes
// alone (decode) or with others (verification), so that both give the same bits.
static constexpr int padded(int rows) { return rows > 4 ? 8 : rows > 2 ? 4 : rows; }  // to a power of 2

// F<D, P, n> for n in 1..P rows, P (1, 2, 4 or 8) and n known only at run time
#define BYP(F, D, P, n, ...) switch ((P) * 8 + (n)) { \
    case 64 + 8: F<D, 8, 8>(__VA_ARGS__); break; case 64 + 7: F<D, 8, 7>(__VA_ARGS__); break; \
    case 64 + 6: F<D, 8, 6>(__VA_ARGS__); break; case 64 + 5: F<D, 8, 5>(__VA_ARGS__); break; \
    case 64 + 4: F<D, 8, 4>(__VA_ARGS__); break; case 64 + 3: F<D, 8, 3>(__VA_ARGS__); break; \
    case 64 + 2: F<D, 8, 2>(__VA_ARGS__); break; case 64 + 1: F<D, 8, 1>(__VA_ARGS__); break; \
    case 32 + 4: F<D, 4, 4>(__VA_ARGS__); break; case 32 + 3: F<D, 4, 3>(__VA_ARGS__); break; \
    case 32 + 2: F<D, 4, 2>(__VA_ARGS__); break; case 32 + 1: F<D, 4, 1>(__VA_ARGS__); break; \
    case 16 + 2: F<D, 2, 2>(__VA_ARGS__); break; case 16 + 1: F<D, 2, 1>(__VA_ARGS__); break; \
    default: F<D, 1, 1>(__VA_ARGS__); }

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
template <int D, int P, int RT>
static inline void arrange_q(const uint16_t* q, uint32_t* qv) {
    constexpr int E = 16 / P;
    for (int g = 0; g < D / 2 / E; g++)
        for (int r = 0; r < P; r++)
            for (int e = 0; e < E; e++) {
                uint32_t u = 0;
                if (r < RT) memcpy(&u, q + r * D + 2 * (g * E + e), 4);
                qv[g * 16 + r * E + e] = u;
            }
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
template <int D, int P, int RT>
__attribute__((noinline)) static __m256 raise_max_bf16(__m512 s, __mmask16 seen, float scale, float* mr, float* part,
                                                       __m256 l, uint16_t* w, int64_t n) {
    constexpr int E = 16 / P;
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
template <int D, int P, int RT>
static inline void weights_bf16(const uint32_t* qv, const Rows& k, int64_t n, float scale, const uint8_t* m,
                                int64_t r0, int64_t S, int64_t L, float* part, __m256& sums, uint16_t* w,
                                int64_t far, const char* const* next, int64_t per) {
    constexpr int E = 16 / P;
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
        const uint16_t* kb = k.at(j);
        const char* ka = far ? k.ahead(j, far) : nullptr;
        if (n - j < 16) {
            memcpy(tail, kb, (n - j) * D * 2);
            memset(tail + (n - j) * D, 0, (16 - (n - j)) * D * 2);
            kb = tail;
        }
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int g = 0; g < D / 2 / E; g++) {
            const __m512i qg = _mm512_loadu_si512(qv + 16 * g);
            // the requests for K spread over the products: all 16 positions' at once were slower
            if (ka)
                for (int e = 0; e < E; e++) _mm_prefetch(ka + 64 * (g * E + e), KV_HINT);
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
            l = raise_max_bf16<D, P, RT>(top16, any, scale, mr, part, l, w, j);
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
// sum waits on its previous dpbf16, and fewer of them leave the unit idle (8 rows keep one block a pass).
// Asks for V `far` bytes ahead unless far is 0.
template <int D, int P, int RT>
static inline void pv_bf16(const uint16_t* p, const Rows& v, int64_t n, float* o, int64_t far) {
    constexpr int NB = RT * (D / 32) <= 8 ? D / 32 : 1, E = 16 / P;
    for (int d0 = 0; d0 < D; d0 += 32 * NB) {
        __m512 acc[RT][NB][2];
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < NB; c++)
                for (int i = 0; i < 2; i++) acc[r][c][i] = _mm512_loadu_ps(o + r * (D + 2) + d0 + 32 * c + 16 * i);
        const uint16_t* run = nullptr;  // positions j - j % 16 on
        for (int64_t j = 0; j < n; j += 2) {
            if (j % 16 == 0) run = v.at(j);
            const char* va = far && d0 == 0 ? v.ahead(j, far) : nullptr;
            if (va)
                for (int i = 0; i < D / 16; i++) _mm_prefetch(va + 64 * i, KV_HINT);
            const uint16_t *pj = p + j / E * 16 + j % E, *vj = run + j % 16 * D;  // row 0's weights at j and j + 1
            for (int c = 0; c < NB; c++) {
                const int d = d0 + 32 * c;
                __m512i w0 = _mm512_loadu_si512(vj + d);
                __m512i w1 = j + 1 < n ? _mm512_loadu_si512(vj + D + d) : _mm512_setzero_si512();
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


// A token tree's node sees its context, then its ancestors' slots, with its siblings' slots between them. Decoding
// its path one token at a time would have those same positions consecutive, and dpbf16 adds V's positions in pairs
// and the weights in groups of 16 counted from a block's start: the node's sums came out in another order than
// decoding's. So a mask row that is no prefix [0, x) is taken apart: the tile (below) runs its positions up to the
// block that holds x, as decoding would, and gathered_row the rest, its visible positions copied together in
// order. tree_from_[s]: where mask row s goes over to gathered_row in this task, or -1; mask_rows_: the mask with
// those rows cleared from there on (the tile adds nothing for them past it); mask_tree_rows returns it, or mask
// itself where every row is a prefix (decoding, a chain's verification).
static thread_local vec<int64_t> tree_from_;
static thread_local vec<uint8_t> mask_rows_;

template <int64_t BJ>
static const uint8_t* mask_tree_rows(const uint8_t* mask, int64_t S, int64_t L, int64_t j0, int64_t j1) {
    tree_from_.clear();
    for (int64_t s = 0; s < S; s++) {
        const uint8_t* m = mask + s * L;
        int64_t x = 0, n = 0;
        while (x < L && m[x]) x++;
        n = x;
        for (int64_t j = x; j < L; j++) n += m[j] != 0;
        if (n == x || x >= j1) continue;  // a prefix here: the tile runs it
        if (tree_from_.empty()) {
            tree_from_.assign(S, -1);
            mask_rows_.resize(S * L);
            memcpy(mask_rows_.data(), mask, S * L);
        }
        const int64_t from = j0 + ((x > j0 ? x : j0) - j0) / BJ * BJ;
        tree_from_[s] = n > j0 ? from : -1;  // none of its n positions in this task: it sees nothing here
        memset(&mask_rows_[s * L + from], 0, L - from);
    }
    return tree_from_.empty() ? mask : mask_rows_.data();
}

// One row of q over the virtual positions [b0, e) of mask row m (the visible positions in order: position i < x as
// it is, the rest the visible slots after x), their K and V copied into consecutive rows, in blocks from b0 as the
// tile's: a lone row's tile of P lanes, row 0. lanes: the row's E / 2 sums of weights, in and out.
template <int D, int P, int RT>
static void gathered_row(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint8_t* m, int64_t L,
                         int64_t b0, int64_t e, float scale2, float* part, float* lanes) {
    constexpr int64_t BJ = 4096 / D;
    constexpr int E = 16 / P;
    static thread_local vec<uint16_t> kg, vg, w;
    static thread_local vec<uint32_t> qv;
    int64_t x = 0;
    while (x < L && m[x]) x++;
    kg.resize(0), vg.resize(0);
    for (int64_t i = b0 < x ? b0 : x, j = i; i < e && j < L; j++) {  // i: virtual position, at slot j
        if (j >= x && !m[j]) continue;
        if (i >= b0) kg.insert(kg.end(), k + j * D, k + (j + 1) * D), vg.insert(vg.end(), v + j * D, v + (j + 1) * D);
        i++;
    }
    const int64_t n = (int64_t)kg.size() / D;
    w.resize(P * BJ), qv.resize(4 * D);
    arrange_q<D, P, 1>(q, qv.data());
    alignas(32) float l8[8] = {};
    for (int i = 0; i < E / 2; i++) l8[i] = lanes[i];
    __m256 l = _mm256_load_ps(l8);
    const char* next[2] = {(const char*)kg.data(), (const char*)vg.data()};
    for (int64_t b = 0; b < n; b += BJ) {
        const int64_t nb = BJ < n - b ? BJ : n - b;
        weights_bf16<D, P, 1>(qv.data(), Rows{kg.data() + b * D, D}, nb, scale2, nullptr, 0, 1, 0, part, l, w.data(), 0,
                              next, 0);
        pv_bf16<D, P, 1>(w.data(), Rows{vg.data() + b * D, D}, nb, part + 2, 0);
    }
    _mm256_store_ps(l8, l);
    for (int i = 0; i < E / 2; i++) lanes[i] = l8[i];
}

// attend_chunk with dpbf16 (D 32 or more), q bf16, reading K and V side by side a block of 8 KB each at a time with
// the softmax online (as flash attention does): two steady streams keep memory busy; with all of K read before all
// of V, the weighted sum waited on V. The softmax is taken on the scores in weights_bf16's registers rather than in
// a pass of its own over each block's scores. HOW_IT_WORKS.md, "Attention for a few query rows".
template <int D>
static void attend_chunk_bf16(const uint16_t* q, float scale, const Rows& k, const Rows& v,
                              const uint8_t* mask, int64_t S, int64_t L, int64_t G, int64_t R, int64_t j0,
                              int64_t j1, float* part, bool prefix) {  // prefix: every mask row is one (paged)
    constexpr int64_t BJ = 4096 / D;  // positions per block: 8 KB of K and of V
    static thread_local vec<uint16_t> pb;  // [tiles][P][BJ] a block's weights, a tile of P rows at a time
    static thread_local vec<uint32_t> qv;  // [tiles][4 D] q's pairs as weights_bf16 reads them
    static thread_local vec<float> ls;  // [tiles][8] the weights summed
    const int64_t P = padded(G < 8 ? G : 8), E = 16 / P, tiles = (R + P - 1) / P;  // P (see padded): from G alone
    if (prefix) tree_from_.clear();
    const uint8_t* rows = prefix ? mask : mask_tree_rows<BJ>(mask, S, L, j0, j1);  // or with a tree's rows cleared
    const int64_t* tree = tree_from_.empty() ? nullptr : tree_from_.data();
    int64_t lo, hi;
    span(rows, S, L, j0, j1, &lo, &hi);
    clear(part, R, D);
    if (lo >= hi && !tree) return;
    pb.resize(tiles * P * BJ), qv.resize(tiles * 4 * D), ls.assign(tiles * 8, 0.f);
    // (by pointer from here: each use of a thread_local's name looks its address up)
    uint16_t* pw = pb.data();
    uint32_t* qp = qv.data();
    float* sums = ls.data();
    __m256* l = (__m256*)sums;
    for (int64_t r = 0; r < R; r += P) BYP(arrange_q, D, P, R - r < P ? R - r : P, q + r * D, &qp[r / P * 4 * D])
    const uint8_t* m = lo < hi && sees_all(rows, S, L, lo, hi) ? nullptr : rows;
    // With 8 or more rows the softmax takes long enough for memory to go idle: the rows ask for shares of the next
    // block's K and V past KV_AHEAD as their weights come out. With fewer rows the rest of the block is short, and
    // these requests would crowd the ones it makes. (Not over a paged cache: its next block lies elsewhere.)
    constexpr int64_t rest = BJ * D * 2 - KV_AHEAD, slots = BJ / 16 * 8;  // a slot: one of 8 vectors of scores
    const int64_t per = R >= 8 && !k.blocks ? (rest / 64 + slots - 1) / slots * 64 : 0;
    const float scale2 = scale * 1.44269504f;  // 2^(s log2(e)) = e^s
    for (int64_t b = lo; b < hi; b += BJ) {
        const int64_t nb = BJ < hi - b ? BJ : hi - b;
        const char* next[2] = {k.ahead(b + BJ, KV_AHEAD), v.ahead(b + BJ, KV_AHEAD)};
        const Rows kb = k.from(b), vb = v.from(b);
        for (int64_t r = 0; r < R; r += P)
            BYP(weights_bf16, D, P, R - r < P ? R - r : P, &qp[r / P * 4 * D], kb, nb, scale2, m ? m + b : m,
                r, S, L, part + r * (D + 2), l[r / P], &pw[r * BJ], r ? 0 : KV_AHEAD, next, r ? 0 : per)
        for (int64_t r = 0; r < R; r += P)
            BYP(pv_bf16, D, P, R - r < P ? R - r : P, &pw[r * BJ], vb, nb, part + r * (D + 2) + 2,
                r ? 0 : KV_AHEAD)
    }
    for (int64_t r = 0; r < R && tree; r++)  // a tree's nodes (a contiguous cache's): the rest
        if (tree[r % S] >= 0)
            BYP(gathered_row, D, P, 1, q + r * D, k.p, v.p, mask + r % S * L, L, tree[r % S], j1, scale2,
                part + r * (D + 2), &sums[r / P * 8 + r % P * E / 2])
    for (int64_t r = 0; r < R; r++) {  // the merge's units: m in e's powers; a row's sum from its E / 2 lanes
        const int64_t t = r / P;
        part[r * (D + 2)] *= 0.693147181f;
        float sum = 0.f;
        for (int64_t e = 0; e < E / 2; e++) sum += sums[t * 8 + r % P * E / 2 + e];
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

// Whether attend's tasks run attend_chunk (q in fp32) rather than attend_chunk_bf16, which reads q as it is
static inline bool fp32_chunks(int64_t D) {
#ifdef __AVX512BF16__
    return D < 32;
#else
    (void)D;
    return true;
#endif
}

// The cache positions of a task, for a cache of `slots` positions a KV head: attend_chunk holds all of a task's
// scores at once (CHUNK of them); attend_chunk_bf16's chunks come from the cache's size (chunk_for)
static inline int64_t chunk_of(int64_t D, int64_t slots, int64_t Hkv) {
    return fp32_chunks(D) ? CHUNK : chunk_for(slots, Hkv);
}

// What one task reads: k and v at its KV head's position 0 (rows of D contiguous), mask at its batch row's [S, L],
// and its positions [j0, j1)
struct TaskInput {
    Rows k, v;
    const uint8_t* mask;
    int64_t L, j0, j1;
    bool prefix = false;  // every mask row a prefix [0, x) (no token tree)
};

// attend's work, whichever way the cache is laid out: the tasks (batch row, KV head, chunk of `chunk` positions out
// of L, and with many query positions a group of ROWS of them of one query head), each over what input(b, h, j0, j1,
// s0, sn) returns for it (the mask of rows s0 .. s0 + sn - 1), then the merge, in one parallel region. Both attend
// and attend_paged run through here, so that a row's parts, and so its bits, cannot differ between them: a row's
// sums are its own, whichever rows share its task.
// a prompt's piece: 3 tasks a chunk (SmolLM2's KV heads) left a thread idle, and a group reads only what it sees
constexpr int64_t ROWS = 32;
template <typename F>
static void attend_tasks(const uint16_t* q, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t L,
                         int64_t D, int64_t chunk, F&& input) {
    const bool fp32 = fp32_chunks(D);
    const int64_t G = H / Hkv, R = G * S, chunks = (L + chunk - 1) / chunk, per = (S + ROWS - 1) / ROWS;
    const int64_t groups = S >= 2 * ROWS ? G * per : 1, tasks = B * Hkv * chunks * groups;
    // scratch kept between calls (a layer's attention runs every step), named by pointer in the parallel regions:
    // there a thread_local name would be each worker's own
    static thread_local vec<float> qf_, parts_;
    parts_.resize(B * Hkv * chunks * R * (D + 2));  // a group writes its rows of its chunk's part
    const float scale = 1.f / sqrtf((float)D);
    // q in fp32, scaled, in in16's order, and 8 zero rows: padding. 16 at a time, unpacked as K is: a decode step's
    // attention at short contexts is mostly such fixed costs.
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
    // the tasks shared as products share rows (share_rows)
    const int nt = omp_get_max_threads();
    std::vector<Range>& ranges = split_ranges(tasks, nt);
    #pragma omp parallel num_threads(nt)  // one region for the tasks and the merge: a second one costs a call
    {
        take_shared(ranges, nt, 1, [&](int64_t task, int64_t) {
            const int64_t t = task / groups, b = t / (Hkv * chunks), h = t / chunks % Hkv, c = t % chunks;
            // the KV head's query rows are consecutive in q: heads h * G .. h * G + G - 1, each S rows (row r: s =
            // r % S); this task's are rn of them from r0, positions s0 .. s0 + Sg - 1 (all of them: Sg S, rn R)
            const int64_t g = task % groups, s0 = groups > 1 ? g % per * ROWS : 0;
            const int64_t Sg = groups > 1 ? (S - s0 < ROWS ? S - s0 : ROWS) : S, rn = groups > 1 ? Sg : R;
            const int64_t r0 = groups > 1 ? g / per * S + s0 : 0, q0 = (b * H + h * G) * S * D + r0 * D;
            const TaskInput in = input(b, h, c * chunk, c * chunk + chunk < L ? c * chunk + chunk : L, s0, Sg);
            const uint16_t *kt = in.k.p, *vt = in.v.p;  // (attend_chunk: a contiguous cache)
            const uint8_t* mt = in.mask;
            const int64_t Lt = in.L, j0 = in.j0, j1 = in.j1;
            float* part = &parts[(t * R + r0) * (D + 2)];
#ifdef __AVX512BF16__
            const uint16_t* qb = q + q0;
            const bool pre = in.prefix;
            switch (D) {
                case 64: attend_chunk_bf16<64>(qb, scale, in.k, in.v, mt, Sg, Lt, G, rn, j0, j1, part, pre); return;
                case 128: attend_chunk_bf16<128>(qb, scale, in.k, in.v, mt, Sg, Lt, G, rn, j0, j1, part, pre); return;
                case 256: attend_chunk_bf16<256>(qb, scale, in.k, in.v, mt, Sg, Lt, G, rn, j0, j1, part, pre); return;
                case 32: attend_chunk_bf16<32>(qb, scale, in.k, in.v, mt, Sg, Lt, G, rn, j0, j1, part, pre); return;
            }
#endif
            const float* qt = qf + q0;
            switch (D) {
                case 64: attend_chunk<64>(qt, kt, nullptr, vt, nullptr, mt, Sg, Lt, rn, j0, j1, part); break;
                case 128: attend_chunk<128>(qt, kt, nullptr, vt, nullptr, mt, Sg, Lt, rn, j0, j1, part); break;
                case 256: attend_chunk<256>(qt, kt, nullptr, vt, nullptr, mt, Sg, Lt, rn, j0, j1, part); break;
                case 32: attend_chunk<32>(qt, kt, nullptr, vt, nullptr, mt, Sg, Lt, rn, j0, j1, part); break;
                default: attend_chunk<16>(qt, kt, nullptr, vt, nullptr, mt, Sg, Lt, rn, j0, j1, part);
            }
        });
        #pragma omp barrier
        merge<out_slot>(parts, out, B, H, Hkv, S, D, chunks);
    }
}

// out[B, H, S, D] = softmax(q k^T / sqrt(D) + mask) v, bf16; q [B, H, S, D] contiguous; k and v [B, Hkv, L, D]
// with rows of D contiguous and strides kb, kh; mask [B, S, L] bytes (nonzero: attend), batch stride mb (0: shared).
// D one of 64, 128, 256, 32 or 16; H a multiple of Hkv, query head h reading KV head h / (H / Hkv).
void fast_decode::attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, uint16_t* out,
                       int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t L, int64_t D, int64_t kb, int64_t kh,
                       int64_t mb) {
    const int64_t chunk = chunk_of(D, kh / D, Hkv);
    attend_tasks(q, out, B, H, Hkv, S, L, D, chunk, [&](int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t s0,
                                                         int64_t) {
        return TaskInput{Rows{k + b * kb + h * kh, D}, Rows{v + b * kb + h * kh, D}, mask + b * mb + s0 * L, L, j0, j1};
    });
}

// One task of attend_paged: the positions of [j0, j1) that batch row b's queries see (up to its furthest pos), of KV
// head h, as positions 0 .. n - 1 with their mask rows. No bit changes: the chunk routines read only positions some
// row sees, in blocks counted from the first (j0: every mask row is a prefix), and a chunk nobody sees adds nothing
// to the merge. A chunk is whole blocks (block_size divides it). dpbf16's routine reads K and V where they lie, 16
// positions at a time; attend_chunk (no AVX512-BF16, or D 16) reads a contiguous copy, one memcpy a block.
static TaskInput paged_task(const uint16_t* kp, const uint16_t* vp, const int64_t* table, const int64_t* pos,
                            int64_t Hkv, int64_t S0, int64_t D, int64_t W, int64_t bs, int64_t b, int64_t h,
                            int64_t j0, int64_t j1, int64_t s0, int64_t S) {  // b's queries s0 .. s0 + S - 1 of S0
    static thread_local vec<uint16_t> kc, vc;
    static thread_local vec<uint8_t> mc;
    const int64_t* p = pos + b * S0 + s0;
    int64_t end = j0;  // past the furthest position a row sees, in [j0, j1]
    for (int64_t s = 0; s < S; s++) end = p[s] + 1 > end ? p[s] + 1 : end;
    const int64_t n = (end < j1 ? end : j1) - j0;
    mc.resize(S * n);
    for (int64_t s = 0; s < S; s++)
        for (int64_t j = 0; j < n; j++) mc[s * n + j] = j0 + j <= p[s];
    const int64_t* blocks = table + b * W + j0 / bs;
    if (!fp32_chunks(D)) {
        const int64_t stride = Hkv * bs * D;
        return TaskInput{Rows{kp + h * bs * D, D, 0, n, blocks, bs, stride},
                         Rows{vp + h * bs * D, D, 0, n, blocks, bs, stride}, mc.data(), n, 0, n, true};
    }
    kc.resize(n * D), vc.resize(n * D);
    for (int64_t j = 0; j < n; j += bs) {
        const int64_t at = (blocks[j / bs] * Hkv + h) * bs * D, m = bs < n - j ? bs : n - j;
        memcpy(&kc[j * D], kp + at, m * D * sizeof(uint16_t));
        memcpy(&vc[j * D], vp + at, m * D * sizeof(uint16_t));
    }
    return TaskInput{Rows{kc.data(), D}, Rows{vc.data(), D}, mc.data(), n, 0, n};
}

// attend for B rows over a paged cache: k and v pools [n_blocks, Hkv, bs, D], table [B, W] each row's blocks in
// position order, pos [B, S] each query's position (it sees positions 0 .. pos). Each row comes out as attend
// computes it alone over a contiguous cache of `slots` positions (the chunks are that cache's). Returns 0, or the
// chunk when bs is no multiple of 16 dividing it (nothing computed).
int64_t fast_decode::attend_paged(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* table,
                                  const int64_t* pos, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                                  int64_t D, int64_t W, int64_t bs, int64_t slots) {
    const int64_t chunk = chunk_of(D, slots, Hkv);
    if (bs < 16 || bs % 16 || chunk % bs) return chunk;
    int64_t L = 0;  // the positions some row sees: rows with fewer have empty tasks at the end
    for (int64_t i = 0; i < B * S; i++) L = pos[i] + 1 > L ? pos[i] + 1 : L;
    attend_tasks(q, out, B, H, Hkv, S, L, D, chunk, [&](int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t s0,
                                                         int64_t sn) {
        return paged_task(kp, vp, table, pos, Hkv, S, D, W, bs, b, h, j0, j1, s0, sn);
    });
    return 0;
}

#ifdef __AVX512VNNI__
// An int8 KV cache: K and V rounded per position and head to int8 with a float scale, half the bytes of bf16. The
// scores multiply q, rounded to int8 per row, by K with dpbusd, 64 products an instruction (dpbf16 does 32), and the
// weighted sum rounds the block's weights e^(s - m) times V's scales to 8 bits per row, for dpbusd again. Fewer
// instructions as well as fewer bytes: the bf16 kernel above was already bound by its instructions at 4k positions.
// K is asked for KV_AHEAD8 bytes ahead of the scores, and V during the scores, as the same positions of K are read
// (quicker than asking for V during the weighted sum).
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
    static thread_local vec<float> pw, vsb, vsg;  // [NC][R] their scales; [NC][BJ] the block's V scales, 0 past its
                                                    // end; the same times 255 over a row's largest
    int64_t lo, hi;
    span(mask, S, L, j0, j1, &lo, &hi);
    clear(part, R, D);
    if (lo >= hi) return;
    sc.resize(R * BJ), pb.resize(NC * R * BJ), pw.resize(NC * R), vsb.resize(NC * BJ), vsg.resize(NC * BJ);
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
        for (int64_t r = 0; r < R; r++) {
            const uint8_t* mr = all ? nullptr : mask + (r % S) * L + b;
            // V's scales over the largest of those the row sees, times 255: the row's own, so that a row comes out
            // the same whatever other rows see (decoding and verification agree)
            for (int64_t c = 0; c < NC; c++) {
                vtop[c] = 0.f;
                if (!mr) vtop[c] = _mm512_reduce_max_ps(vbig[c]);
                for (int64_t j = 0; mr && j < nb; j++)
                    if (mr[j] && vsb[c * BJ + j] > vtop[c]) vtop[c] = vsb[c * BJ + j];
                const __m512 g = _mm512_set1_ps(vtop[c] > 0.f ? 255.f / vtop[c] : 0.f);
                for (int64_t j = 0; j < BJ; j += 16)
                    _mm512_storeu_ps(&vsg[c * BJ + j], _mm512_mul_ps(_mm512_loadu_ps(&vsb[c * BJ + j]), g));
            }
            float* s = &sc[r * BJ];
            const float bm = masked_max(s, nb, BJ, mr);
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
                    __m512 w = _mm512_mul_ps(p, _mm512_loadu_ps(&vsg[c * BJ + j]));
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
void fast_decode::attend_int8(const uint16_t* q, const int8_t* k, const float* ks, const int8_t* v, const float* vs,
                            const uint8_t* mask, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S,
                            int64_t L, int64_t D, int64_t kb, int64_t kh, int64_t ksb, int64_t ksh, int64_t vsb,
                            int64_t vsh, int64_t mb) {
    const int64_t chunk = chunk_for(kh / D, Hkv);
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
void fast_decode::attend_int8(const uint16_t* q, const int8_t* k, const float* ks, const int8_t* v, const float* vs,
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
