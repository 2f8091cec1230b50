// The bf16 product with AVX-512: pairs multiplied by dpbf16 where the CPU has AVX512-BF16, else widened to fp32.
#include "common.h"
#include "kernels.h"
#ifdef __AMX_BF16__
#include "amx.h"
#endif


// bf16. With AVX512-BF16, dpbf16 multiplies 32 bf16 pairs exactly and adds them into 16 fp32 lanes: x stays bf16
// and the weights are never widened. Without it, a bf16 widened by a 16-bit shift is its fp32 value.
#ifdef __AVX512BF16__
// AHEAD_BF16: how far ahead (bytes) the product asks for its weights, into L3 (T2); 0, the default, leaves them to
// the hardware prefetcher (cpu_gemv.targets: 4096 on cores with less than 48 KB of L1). HOW_IT_WORKS.md,
// "Prefetching the weights".
#ifndef AHEAD_BF16
#define AHEAD_BF16 0
#endif

// (fold: common.h's, as attention's score lanes use it)

// A tile of 8 weight rows (w[v]) by R rows of x (x[r]), K long: out[r] lane v = x row r . w row v. Each pair is one
// chain of dpbf16 over steps of 32 pairs (the last masked to 16 where K is an odd multiple of 16), its 16 lanes
// then summed as (l, l ^ 8), (l, l ^ 4), (l, l ^ 2), (l, l ^ 1), folded 8 weight rows together: the same bits
// whatever the tile, so a row's product does not depend on the rows beside it (batch invariance). Each weight vector
// loaded serves R rows of x and each x vector 8 weight rows, 8 R sums in flight. ahead: ask for the weights
// AHEAD_BF16 bytes ahead (the first tile over them; the next ones find them in cache).
template <int R>
static inline void tile8(const uint16_t* const* x, const uint16_t* const* w, int64_t K, __m256* out, bool ahead) {
    __m512 acc[R][8];
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) acc[r][v] = _mm512_setzero_ps();
    auto step = [&](int64_t k, __mmask32 m, bool pre) {
        __m512i xv[R];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) xv[r] = _mm512_maskz_loadu_epi16(m, x[r] + k);
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            if (pre) _mm_prefetch((const char*)(w[v] + k) + AHEAD_BF16, _MM_HINT_T2);
            const __m512i wv = _mm512_maskz_loadu_epi16(m, w[v] + k);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) acc[r][v] = dp(acc[r][v], wv, xv[r]);
        }
    };
    int64_t k = 0;
    if (AHEAD_BF16 && ahead)
        for (; k + 32 <= K; k += 32) step(k, 0xffffffffu, true);
    else
        for (; k + 32 <= K; k += 32) step(k, 0xffffffffu, false);
    if (k < K) step(k, 0xffffu, false);
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) {
        __m512 a[4], b[2];
        for (int i = 0; i < 4; i++) a[i] = fold<8>(acc[r][i], acc[r][i + 4]);
        for (int i = 0; i < 2; i++) b[i] = fold<4>(a[i], a[i + 2]);
        const __m512 c = fold<2>(b[0], b[1]);  // lanes 2v, 2v + 1: weight row v's last two partial sums
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        out[r] = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, fold<1>(c, c)));
    }
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

#ifdef __AVX512BF16__
// tile8's sum for one row of x and one weight row, the same bits (_mm512_reduce_add_ps adds lanes l and l ^ 8, then
// l ^ 4, l ^ 2, l ^ 1, as the folds do): a lone row of x takes the weight rows one at a time, one stream through
// memory, quicker there than 8 rows read side by side
static inline float dot1(const uint16_t* x, const uint16_t* w, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (AHEAD_BF16) _mm_prefetch((const char*)(w + k) + AHEAD_BF16, _MM_HINT_T2);
        acc = dp(acc, _mm512_loadu_si512(w + k), _mm512_loadu_si512(x + k));
    }
    if (k < K) acc = dp(acc, _mm512_maskz_loadu_epi16(0xffffu, w + k), _mm512_maskz_loadu_epi16(0xffffu, x + k));
    return _mm512_reduce_add_ps(acc);
}
#endif

#ifdef __AMX_BF16__
// AMX (cpu_gemv.targets: where the CPU has it and Linux lets this process use it). One tdpbf16ps multiplies a
// 16 x 32 bf16 tile A by a 32 x 16 one B into 16 x 16 fp32 sums C. The weights are A, straight from w (16 rows of 32,
// a row apart), so nothing is repacked; x, small, is packed once a call as B: per step of 32 along K, 16 pairs by
// up to 16 rows of x. C is then weight row by row of x, written out transposed. Each sum is one chain of tdpbf16ps
// over K, whatever the rows beside it: the same bits for a row alone (batch 1) as in a batch or a prompt.

// two groups of rows of x a pass (K a multiple of 32): tiles 0-3 C, 4 and 5 A (the two 16 weight rows), 6 and 7 B
// (the two groups), so that 4 tile loads serve 4 tdpbf16ps instead of 3 serving 2
static TileConfig pair_tiles(int64_t g) { return tiles(g, 4, 64); }

// tile32 for two groups of x (xa, xb) at once under pair_tiles: out [4][16][16], the first group's two then the
// second's. Each sum is the same chain as tile32's.
static inline void tile32x2(const uint16_t* w0, const uint16_t* w1, const uint32_t* xa, const uint32_t* xb,
                            int64_t g, int64_t K, float* out) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32, xa += 16 * g, xb += 16 * g) {
        _tile_loadd(4, w0 + k, 2 * K);
        _tile_loadd(6, xa, 4 * g);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, w1 + k, 2 * K);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(7, xb, 4 * g);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
    _tile_stored(2, out + 512, 64);
    _tile_stored(3, out + 768, 64);
}

static void gemv_amx(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K, int64_t f32) {
    const int64_t groups = (M + 15) / 16, g = (M + groups - 1) / groups, steps = (K + 31) / 32;  // g <= 16 rows each
    static thread_local vec<uint32_t> xb_;
    vec<uint32_t>& xb = xb_;  // (by reference in the parallel region: a thread_local name is each thread's own)
    pack_pairs(x, M, K, g, xb);
    const int64_t blocks = (N + 31) / 32;
    const bool pairs = groups > 1 && K % 32 == 0;
    share_tiles(blocks, 64 * K, pairs ? pair_tiles(g) : tiles_for(g), [&](int64_t a, int64_t b) {
        alignas(64) float out[4][16][16];
        static thread_local vec<uint16_t> pad_;  // the last rows past N, as zeros
        for (int64_t blk = a; blk < b; blk++) {
            const int64_t n0 = 32 * blk, rows = N - n0 < 32 ? N - n0 : 32;
            const uint16_t* w0 = w + n0 * K;
            if (rows < 32) {
                vec<uint16_t>& pad = pad_;
                pad.assign(32 * K, 0);
                memcpy(pad.data(), w0, 2 * rows * K);
                w0 = pad.data();
            }
            auto emit = [&](int64_t grp, const float* o) { put_block(y, o, g, grp * g, M, N, n0, rows, nullptr, f32); };
            for (int64_t grp = 0; grp < groups;) {
                const uint32_t* xg = &xb[grp * steps * 16 * g];
                if (!pairs) {
                    tile32(w0, w0 + 16 * K, xg, g, K, &out[0][0][0]);
                    emit(grp++, &out[0][0][0]);
                    continue;
                }
                const bool two = grp + 1 < groups;  // a last group alone: paired with itself
                tile32x2(w0, w0 + 16 * K, xg, two ? xg + steps * 16 * g : xg, g, K, &out[0][0][0]);
                emit(grp++, &out[0][0][0]);
                if (two) emit(grp++, &out[2][0][0]);
            }
        }
    });
}
#endif

// y[M, N] = x[M, K] @ w[N, K]^T, all bf16 and contiguous, accumulated in fp32; K a multiple of 16
void fast_decode::gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K,
                          int64_t f32) {
#ifdef __AMX_BF16__
    return gemv_amx(x, w, y, M, N, K, f32);
#endif
#ifdef __AVX512BF16__
    if (M == 1)
        return share_rows(N, 2 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
            for (int64_t n = a; n < b; n++) put(y, n, dot1(x, w + n * K, K), f32);
        });
    // 8 weight rows at a time, read from memory once, stay in cache while tiles of 3 rows of x (then 2, 1) go over
    share_rows((N + 7) / 8, 16 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n0 = 8 * a; n0 < 8 * b && n0 < N; n0 += 8) {
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;
            const uint16_t* wr[8];
            for (int64_t i = 0; i < 8; i++) wr[i] = w + (n0 + (i < rows ? i : 0)) * K;  // past N: row n0 again
            for (int64_t m = 0; m < M;) {
                const int64_t r = M - m >= 3 ? 3 : M - m;
                const uint16_t* xr[3] = {x + m * K, x + (m + (r > 1)) * K, x + (m + 2 * (r > 2)) * K};
                __m256 o[3];
                if (r == 3) tile8<3>(xr, wr, K, o, m == 0);
                else if (r == 2) tile8<2>(xr, wr, K, o, m == 0);
                else tile8<1>(xr, wr, K, o, m == 0);
                for (int64_t j = 0; j < r; j++) put8(y, (m + j) * N + n0, o[j], rows, f32);
                m += r;
            }
        }
    });
#else
    static thread_local vec<xbf16> xs_;
    vec<xbf16>& xs = xs_;
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; i++) xs[i] = from_bf16(x[i]);
    share_rows(N, 2 * K, CHUNK_BYTES, [&](int64_t a, int64_t b) {
        for (int64_t n = a; n < b; n++)  // each weight row is read from memory once, for every row of x
            for (int64_t m = 0; m < M; m++) put(y, m * N + n, dot(&xs[m * K], w + n * K, K), f32);
    });
#endif
}
