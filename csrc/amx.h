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
