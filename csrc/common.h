// The helpers the kernel files share (internal: kernels.h declares what crosses files). Everything here is static,
// and defined here, so that each file's hot loops inline it (HOW_IT_WORKS.md, "The C++ sources and their build").
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <atomic>
#include <new>
#include <omp.h>
#include <vector>

// Scratch on 64-byte boundaries: malloc promises 16, and a 32-byte load that straddles two cache lines costs two
// (HOW_IT_WORKS.md, "Smaller measurements behind the kernels").
template <typename T> struct Aligned64 {
    typedef T value_type;
    Aligned64() = default;
    template <typename U> Aligned64(const Aligned64<U>&) {}
    T* allocate(size_t n) { return (T*)::operator new(n * sizeof(T), std::align_val_t(64)); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    bool operator==(const Aligned64&) const { return true; }
};
template <typename T> using vec = std::vector<T, Aligned64<T>>;

enum { CHUNK_BYTES = 65536 };  // share_rows' chunk (HOW_IT_WORKS.md, "Smaller measurements behind the kernels")
struct alignas(64) Range { std::atomic<uint64_t> v; };  // front << 32 | back, in units

// the ranges of n units for nt threads (kept between calls: a product runs every step)
[[maybe_unused]] static std::vector<Range>& split_ranges(int64_t n, int nt) {
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
// and a thread the machine slows down is helped instead of waited for (HOW_IT_WORKS.md, "Sharing rows between
// threads").
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

// the weights AHEAD bytes ahead of p (by default), asked for now: the hardware prefetcher alone reads one stream of
// rows slower. Called once per 64 bytes read, or per 32. Non-temporal: weights read once a step would only push out
// what is used again (activations, the cache, the runtime's own data). How far ahead is bandwidth times latency, so
// the AVX-512 set asks further. AHEAD_WEIGHTS 0 turns ahead() off where a prefetch costs a load the products are
// short of (cpu_gemv.targets: cores with less than 48 KB of L1). HOW_IT_WORKS.md, "Prefetching the weights".
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

// y[i .. i + n) = v's first n (at most 8) lanes, as put() writes each: 8 in one store
static inline void put8(void* y, int64_t i, __m256 v, int64_t n, int64_t f32) {
    if (n == 8 && f32) return _mm256_storeu_ps((float*)y + i, v);
    if (n == 8) return _mm_storeu_si128((__m128i*)((uint16_t*)y + i), to_bf16x8(v));
    alignas(32) float o[8];
    _mm256_store_ps(o, v);
    for (int64_t j = 0; j < n; j++) put(y, i + j, o[j], f32);
}

// 8 vectors -> one: lane t is the sum of a[t]'s lanes
static inline __m256 sum8x8(const __m256* a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#ifdef __AVX512F__
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
#endif

#ifdef __AVX512BF16__
// 32 bf16 pairs of w and x multiplied exactly and added into a's 16 fp32 lanes
static inline __m512 dp(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }
#endif
