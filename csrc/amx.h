// AMX's tiles, which the avx512+...+amx kernel set's bf16 and int8 products share: a tile configuration, and
// share_rows (common.h) with it loaded by each thread once a call.
#pragma once
#include "common.h"

// palette 1: up to 8 tiles of `rows` rows, `colsb` bytes a row (at most 16 and 64)
struct alignas(64) TileConfig {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// body(a, b) as share_rows runs it, each thread's tiles configured as c first and released after: torch's own GEMMs
// (oneDNN) use the tiles too, between our calls, on the same threads. Once a thread, not once a chunk: loading the
// configuration cost as much as a chunk's own reads (a third of the bf16 output head's time at batch 1).
template <typename F>
static void share_tiles(int64_t n, int64_t unit_bytes, const TileConfig& c, F&& body) {
    const int nt = omp_get_max_threads();
    const int64_t chunk = CHUNK_BYTES / unit_bytes > 1 ? CHUNK_BYTES / unit_bytes : 1;
    if (nt == 1 || n <= chunk) {
        _tile_loadconfig(&c);
        body(0, n);
        return _tile_release();
    }
    std::vector<Range>& ranges = split_ranges(n, nt);
    #pragma omp parallel num_threads(nt)
    {
        _tile_loadconfig(&c);
        take_shared(ranges, nt, chunk, body);
        _tile_release();
    }
}

// a [16][16] -> r[j] = column j: unpacks within 128-bit lanes (columns 4L + c of 4 rows in lane L), then 128-bit
// lanes across vectors
static inline void transpose16(const float* a, __m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        const __m512 p = _mm512_load_ps(a + 16 * i), q = _mm512_load_ps(a + 16 * (i + 1));
        t[i] = _mm512_unpacklo_ps(p, q), t[i + 1] = _mm512_unpackhi_ps(p, q);
    }
    for (int i = 0; i < 16; i += 4) {  // u[i + c] lane L: column 4L + c of rows i .. i + 3
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        const __m512 p0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), p1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xee);
        const __m512 p2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const __m512 p3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xee);
        r[c] = _mm512_shuffle_f32x4(p0, p2, 0x88), r[4 + c] = _mm512_shuffle_f32x4(p0, p2, 0xdd);
        r[8 + c] = _mm512_shuffle_f32x4(p1, p3, 0x88), r[12 + c] = _mm512_shuffle_f32x4(p1, p3, 0xdd);
    }
}

// y[i .. i + n) = v's first n (at most 16) lanes, as put() writes each
static inline void put16(void* y, int64_t i, __m512 v, int64_t n, int64_t f32) {
    put8(y, i, _mm512_castps512_ps256(v), n < 8 ? n : 8, f32);
    if (n > 8) put8(y, i + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), n - 8, f32);
}

// Tiles for g rows of x: 16 rows of 4 g bytes each (C: g fp32 or int32 sums; B: g bf16 pairs or int8 quads), but
// tiles a and a + 1 (A: 16 weight rows), a_bytes a row
static TileConfig tiles(int64_t g, int a, int a_bytes) {
    TileConfig c = {};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = t == a || t == a + 1 ? a_bytes : 4 * g;
    return c;
}

// 16 bf16 at p (past n: zeros) -> fp32
static inline __m512 widen16(const uint16_t* p, int64_t n) {
    const __m256i b = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// A block's sums into y: o [2][16][16] (weight row by row of x) or, for one row of x (g 1), [32]; weight rows
// n0 .. n0 + rows of x's rows m0 .. m0 + g (those below M), each times its weight row's scale where scales is given
static inline void put_block(void* y, const float* o, int64_t g, int64_t m0, int64_t M, int64_t N, int64_t n0,
                             int64_t rows, const uint16_t* scales, int64_t f32) {
    for (int64_t h = 0; h < 2 && 16 * h < rows; h++) {
        const int64_t n = rows - 16 * h < 16 ? rows - 16 * h : 16;
        const __m512 sc = scales ? widen16(scales + n0 + 16 * h, n) : _mm512_set1_ps(1.f);  // (times 1: exact)
        __m512 r[16];
        if (g == 1) r[0] = _mm512_load_ps(o + 16 * h);
        else transpose16(o + 256 * h, r);
        for (int64_t j = 0; j < g && m0 + j < M; j++)
            put16(y, (m0 + j) * N + n0 + 16 * h, _mm512_mul_ps(r[j], sc), n, f32);
    }
}

// The bf16 tiles (tdpbf16ps), which the bf16 product and the int8 output head share. Tiles: 0 and 1 C (two groups of
// 16 weight rows), 2 and 3 their A, 4 B; 5, 6 and 7 the same for a last 16 of K.
static TileConfig tiles_for(int64_t g) {
    TileConfig c = tiles(g, 2, 64);
    c.colsb[5] = c.colsb[6] = 32, c.rows[7] = 8;  // A of a last 16 of K: 16 bf16 a row; its B: 8 pairs
    return c;
}

// 32 weight rows (w0: the first 16, w1: the next 16) by g rows of x packed as xb (per step of 32 along K: 16 rows of
// g pairs), into out [2][16][16] (weight row, row of x), or for one row of x [32].
static inline void tile32(const uint16_t* w0, const uint16_t* w1, const uint32_t* xb, int64_t g, int64_t K,
                          float* out) {
    _tile_zero(0);
    _tile_zero(1);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32, xb += 16 * g) {
        _tile_loadd(4, xb, 4 * g);
        _tile_loadd(2, w0 + k, 2 * K);
        _tile_dpbf16ps(0, 2, 4);
        _tile_loadd(3, w1 + k, 2 * K);
        _tile_dpbf16ps(1, 3, 4);
    }
    if (k < K) {  // the last 16 of K: 8 pairs
        _tile_loadd(7, xb, 4 * g);
        _tile_loadd(5, w0 + k, 2 * K);
        _tile_dpbf16ps(0, 5, 7);
        _tile_loadd(6, w1 + k, 2 * K);
        _tile_dpbf16ps(1, 6, 7);
    }
    if (g == 1) {  // one row of x: its 32 sums side by side, nothing to transpose
        _tile_stored(0, out, 4);
        _tile_stored(1, out + 16, 4);
        return;
    }
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
}

// x [M, K] bf16 as B tiles: per group of g rows of x (the last padded with zeros), per step of 32 along K, per pair
// of K, the group's rows' pairs
static void pack_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t g, vec<uint32_t>& xb) {
    const int64_t groups = (M + g - 1) / g, steps = (K + 31) / 32;
    xb.resize(groups * steps * 16 * g);
    const uint32_t* x2 = (const uint32_t*)x;  // pairs of bf16
    // pair p of row m: step p / 16, its row p % 16, so p g + m % g in the group; past M and K zeros. Groups of 16
    // rows 16 pairs at a time, transposed in registers; a prompt's rows on every thread.
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t grp = 0; grp < groups; grp++) {
        uint32_t* to = &xb[grp * steps * 16 * g];
        const int64_t m0 = grp * g, rows = M - m0 < g ? M - m0 : g;
        if (g == 16 && rows == 16 && K % 32 == 0) {
            alignas(64) float a[16][16];
            for (int64_t st = 0; st < steps; st++) {
                for (int i = 0; i < 16; i++)
                    _mm512_store_ps(a[i], _mm512_castsi512_ps(_mm512_loadu_si512(x2 + (m0 + i) * (K / 2) + 16 * st)));
                __m512 r[16];
                transpose16(&a[0][0], r);
                for (int j = 0; j < 16; j++) _mm512_store_si512(to + 256 * st + 16 * j, _mm512_castps_si512(r[j]));
            }
            continue;
        }
        memset(to, 0, 4 * steps * 16 * g);
        for (int64_t i = 0; i < rows; i++)
            for (int64_t p = 0; p < K / 2; p++) to[p * g + i] = x2[(m0 + i) * (K / 2) + p];
    }
}
