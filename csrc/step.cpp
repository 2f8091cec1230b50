// The batch-1 decode step: model.py's forward for one token over kernels.h's Model, on this set's kernels, and the
// greedy loop around it (HOW_IT_WORKS.md, "Batch-1 decoding on a CPU is one C++ call").
#include "common.h"
#include "kernels.h"

// (bf16_bits, to_bf16x8, widen8 and hsum8: common.h's)
static inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
static inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128((__m128i*)p, to_bf16x8(v)); }

// e^x, within 3e-7 relative (2.3e-7 at worst over -87..88): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to r^6, times 2^n
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts: r stays exact
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// model.py's RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, rounded to bf16, times the weight, rounded again
static void rmsnorm(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) s = _mm256_fmadd_ps(widen8(x + i), widen8(x + i), s);
    const __m256 r = _mm256_set1_ps(1.f / sqrtf(hsum8(s) / n + eps));
    for (int64_t i = 0; i < n; i += 8) store8(out + i, _mm256_mul_ps(round8(_mm256_mul_ps(widen8(x + i), r)),
                                                                      widen8(w + i)));
}

static void add(uint16_t* x, const uint16_t* y, int64_t n) {  // x += y, in bf16
    for (int64_t i = 0; i < n; i += 8) store8(x + i, _mm256_add_ps(widen8(x + i), widen8(y + i)));
}

// x [heads, D] rotated in place by model.py's apply_rotary_emb: interleaved pairs, cs [D / 2, 2] cos and sin
static void rope(uint16_t* x, const float* cs, int64_t heads, int64_t D) {
    for (int64_t h = 0; h < heads; h++, x += D)
        for (int64_t i = 0; i < D; i += 8) {  // 4 pairs (a, b): a c - b s and b c + a s
            const __m256 v = widen8(x + i), f = _mm256_loadu_ps(cs + i);
            const __m256 swapped_sin = _mm256_mul_ps(_mm256_permute_ps(v, 0xb1), _mm256_movehdup_ps(f));
            store8(x + i, _mm256_fmaddsub_ps(v, _mm256_moveldup_ps(f), swapped_sin));
        }
}

// model.py's quantize_rows for one position: each block of n values to int8 with one float32 scale
static void quantize_row(const uint16_t* x, int8_t* q, float* scale, int64_t D, int64_t n) {
    for (int64_t b = 0; b < D; b += n, scale++) {
        float m = 0.f;
        for (int64_t i = b; i < b + n; i++) m = fmaxf(m, fabsf(from_bf16(x[i])));
        *scale = m / 127;
        const float d = *scale > 1e-30f ? *scale : 1e-30f;
        for (int64_t i = b; i < b + n; i++) q[i] = (int8_t)nearbyintf(from_bf16(x[i]) / d);
    }
}

// act [hidden] = silu(gate) * up of gu [2 * hidden] (the gate's, then the up's), in fp32, rounded once, as inductor
// fuses it
static void silu_mul(const uint16_t* gu, uint16_t* act, int64_t hidden) {
    for (int64_t j = 0; j < hidden; j += 8) {
        const __m256 g = widen8(&gu[j]), u = widen8(&gu[hidden + j]);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        store8(&act[j], _mm256_mul_ps(s, u));
    }
}

using namespace fast_decode;

// one position's K and V [Hkv, D] into layer l's cache at slot: as they are, or rounded to int8 with their scales
static void store_kv(const Model& m, const Layer& l, const uint16_t* k, const uint16_t* v, int64_t slot) {
    const int64_t D = m.head_dim;
    for (int64_t h = 0; h < m.n_kv_head; h++) {
        const int64_t at = h * m.slots + slot;
        if (!l.ks) {
            memcpy((uint16_t*)l.k + at * D, k + h * D, 2 * D);
            memcpy((uint16_t*)l.v + at * D, v + h * D, 2 * D);
        } else {
            quantize_row(k + h * D, (int8_t*)l.k + at * D, l.ks + at, D, D);
            quantize_row(v + h * D, (int8_t*)l.v + at * D, l.vs + at * m.vb, D, D / m.vb);
        }
    }
}

static void product(const Linear& l, const uint16_t* x, void* y, int64_t f32 = 0, int64_t M = 1) {
    if (l.kind == 0) gemv_bf16(x, (const uint16_t*)l.w, y, M, l.n, l.k, f32);
    else if (l.kind == 1) gemv_int8(x, (const int8_t*)l.w, (const uint16_t*)l.scales, y, M, l.n, l.k, f32);
    else gemv_int4(x, (const uint8_t*)l.w, (const uint16_t*)l.scales, (const uint16_t*)l.zeros, y, M, l.n, l.k, l.group,
                   f32);
}

// logits [vocab] float32 of token at cache slot pos; its K and V are written there, and it attends to the slots
// up to pos (the last `window` of them where the model slides): only those are read, with no mask, where the
// compiled step reads a power-of-two bucket of slots and masks the rest (at 100 positions, 256 a layer)
void fast_decode::decode_step(const Model& m, int64_t token, int64_t pos, float* logits) {
    const int64_t D = m.head_dim, H = m.n_head, Hkv = m.n_kv_head, qn = H * D, kvn = Hkv * D;
    // the products' inputs are as long as the longest stored k, zeros past their own length (int4's padding)
    int64_t cap = m.out.k;
    for (const Linear* l : {&m.layers[0].qkv, &m.layers[0].o, &m.layers[0].w13, &m.layers[0].w2})
        cap = l->k > cap ? l->k : cap;
    static thread_local vec<uint16_t> x, xn, qkv, att, y, gu, act;
    static thread_local vec<uint8_t> mask;
    for (vec<uint16_t>* v : {&xn, &att, &act}) v->assign(cap, 0);
    x.assign(m.embed + token * m.dim, m.embed + (token + 1) * m.dim);
    const int64_t start = m.window && pos >= m.window ? pos + 1 - m.window : 0, L = pos + 1 - start;
    qkv.resize(qn + 2 * kvn), y.resize(m.dim), gu.resize(2 * m.hidden), mask.assign(L, 1);
    const float* cs = m.freqs + pos * D;
    for (int64_t i = 0; i < m.n_layer; i++) {
        const Layer& l = m.layers[i];
        rmsnorm(x.data(), l.attn_norm, xn.data(), m.dim, m.eps);
        product(l.qkv, xn.data(), qkv.data());
        if (l.bqkv) add(qkv.data(), l.bqkv, qn + 2 * kvn);
        uint16_t *q = qkv.data(), *k = q + qn, *v = k + kvn;
        rope(q, cs, H, D);
        rope(k, cs, Hkv, D);
        store_kv(m, l, k, v, pos);
        if (!l.ks)
            attend(q, (uint16_t*)l.k + start * D, (uint16_t*)l.v + start * D, mask.data(), att.data(), 1, H, Hkv, 1,
                   L, D, Hkv * m.slots * D, m.slots * D, 0);
        else
            attend_int8(q, (int8_t*)l.k + start * D, l.ks + start, (int8_t*)l.v + start * D, l.vs + start * m.vb,
                        mask.data(), att.data(), 1, H, Hkv, 1, L, D, Hkv * m.slots * D, m.slots * D, Hkv * m.slots,
                        m.slots, Hkv * m.slots * m.vb, m.slots * m.vb, 0);
        product(l.o, att.data(), y.data());
        add(x.data(), y.data(), m.dim);
        rmsnorm(x.data(), l.ffn_norm, xn.data(), m.dim, m.eps);
        product(l.w13, xn.data(), gu.data());
        silu_mul(gu.data(), act.data(), m.hidden);
        product(l.w2, act.data(), y.data());
        add(x.data(), y.data(), m.dim);
    }
    rmsnorm(x.data(), m.norm, xn.data(), m.dim, m.eps);
    product(m.out, xn.data(), logits, 1);
}

// the rest of a layer for M rows x [M, dim] after their attention att [M, o.k]: the output product and its residual,
// then the feed-forward block and its residual (xn [M, kx], y, gu and act [M, kh]: scratch)
static void layer_rest(const Model& m, const Layer& l, int64_t M, const uint16_t* att, uint16_t* x, uint16_t* xn,
                       int64_t kx, uint16_t* y, uint16_t* gu, uint16_t* act, int64_t kh) {
    product(l.o, att, y, 0, M);
    #pragma omp parallel for if (M >= 64)  // (rows are independent: both threads take a share)
    for (int64_t i = 0; i < M; i++) {
        add(x + i * m.dim, y + i * m.dim, m.dim);
        rmsnorm(x + i * m.dim, l.ffn_norm, xn + i * kx, m.dim, m.eps);
    }
    product(l.w13, xn, gu, 0, M);
    #pragma omp parallel for if (M >= 64)
    for (int64_t i = 0; i < M; i++) silu_mul(gu + i * 2 * m.hidden, act + i * kh, m.hidden);
    product(l.w2, act, y, 0, M);
    #pragma omp parallel for if (M >= 64)
    for (int64_t i = 0; i < M; i++) add(x + i * m.dim, y + i * m.dim, m.dim);
}

// logits [M, vocab] float32 of tokens [M] at cache slots base .. base + M - 1, RoPE positions pos [M] (a token
// tree's depths, or the slots), each attending to the slots its row of mask [M, base + M] holds: a verify pass, or a
// piece of a prompt, each row computing what decode_step computes for it alone (the products of up to 32 rows read
// the weights once for all rows and sum every row as one row alone). No sliding window.
void fast_decode::forward_rows(const Model& m, const int64_t* tokens, const int64_t* pos, int64_t M, int64_t base,
                               const uint8_t* mask, float* logits, int64_t last) {
    const int64_t D = m.head_dim, H = m.n_head, Hkv = m.n_kv_head, qn = H * D, kvn = Hkv * D, L = base + M;
    const Layer& l0 = m.layers[0];
    // each product's input rows as long as its stored k (int4 pads with zeros), so that one call takes all rows
    const int64_t kx = l0.qkv.k, ka = l0.o.k, kh = l0.w2.k, ko = m.out.k;
    static thread_local vec<uint16_t> x, xn, qkv, q, att, ho, y, gu, act, xo;
    xn.assign(M * kx, 0), att.assign(M * ka, 0), act.assign(M * kh, 0), xo.assign(M * ko, 0);
    x.resize(M * m.dim), qkv.resize(M * (qn + 2 * kvn)), q.resize(M * qn), ho.resize(M * qn), y.resize(M * m.dim);
    gu.resize(M * 2 * m.hidden);
    // (in the parallel loops by pointer: there a thread_local's name is each worker's own)
    uint16_t *X = x.data(), *XN = xn.data(), *QKV = qkv.data(), *Q = q.data(), *HO = ho.data(), *ATT = att.data();
    for (int64_t i = 0; i < M; i++) memcpy(&X[i * m.dim], m.embed + tokens[i] * m.dim, 2 * m.dim);
    for (int64_t li = 0; li < m.n_layer; li++) {
        const Layer& l = m.layers[li];
        #pragma omp parallel for if (M >= 64)
        for (int64_t i = 0; i < M; i++) rmsnorm(&X[i * m.dim], l.attn_norm, &XN[i * kx], m.dim, m.eps);
        product(l.qkv, XN, QKV, 0, M);
        #pragma omp parallel for if (M >= 64)
        for (int64_t i = 0; i < M; i++) {  // bias, RoPE and the cache write a row; q to [H, M, D] for attend
            uint16_t *qi = &QKV[i * (qn + 2 * kvn)], *k = qi + qn, *v = k + kvn;
            if (l.bqkv) add(qi, l.bqkv, qn + 2 * kvn);
            rope(qi, m.freqs + pos[i] * D, H, D);
            rope(k, m.freqs + pos[i] * D, Hkv, D);
            for (int64_t h = 0; h < H; h++) memcpy(&Q[(h * M + i) * D], qi + h * D, 2 * D);
            store_kv(m, l, k, v, base + i);
        }
        if (!l.ks)
            attend(Q, (uint16_t*)l.k, (uint16_t*)l.v, mask, HO, 1, H, Hkv, M, L, D, Hkv * m.slots * D, m.slots * D, 0);
        else
            attend_int8(Q, (int8_t*)l.k, l.ks, (int8_t*)l.v, l.vs, mask, HO, 1, H, Hkv, M, L, D, Hkv * m.slots * D,
                        m.slots * D, Hkv * m.slots, m.slots, Hkv * m.slots * m.vb, m.slots * m.vb, 0);
        #pragma omp parallel for if (M >= 64)
        for (int64_t i = 0; i < M; i++)  // [H, M, D] back to rows
            for (int64_t h = 0; h < H; h++) memcpy(&ATT[i * ka + h * D], &HO[(h * M + i) * D], 2 * D);
        layer_rest(m, l, M, ATT, X, XN, kx, y.data(), gu.data(), act.data(), kh);
    }
    const int64_t first = last ? M - 1 : 0;  // the rows whose logits are asked for
    for (int64_t i = first; i < M; i++) rmsnorm(&x[i * m.dim], m.norm, &xo[(i - first) * ko], m.dim, m.eps);
    product(m.out, xo.data(), logits, 1, M - first);
}

// logits [R, vocab] float32 of the rows out [R] names, after B sequences' next tokens: sequence b's lens[b] tokens
// (rows from the sum of the lens before it) at positions pos (consecutive within a sequence), its K and V in the
// blocks its row of table [B, W] names, of layer i's pools k_pools[i] and v_pools[i] [n_blocks, Hkv, bs, D] bf16; the
// new tokens' K and V are written there. The engine's step: decoding rows (one token each) and pieces of prompts in
// one pass, every weight read once for all rows, each row as decode_step computes it alone over a static cache of
// m.slots positions (the products are batch-invariant; the attention runs the decoding rows together and each
// prompt's piece on its own, as attend_paged computes a row alone), so however prompts are cut and batched, each
// token's K, V and logits are the same. No sliding window.
void fast_decode::forward_paged(const Model& m, uint16_t* const* k_pools, uint16_t* const* v_pools, int64_t bs,
                                const int64_t* tokens, const int64_t* pos, const int64_t* lens, const int64_t* table,
                                int64_t B, int64_t W, const int64_t* out, int64_t R, float* logits) {
    const int64_t D = m.head_dim, H = m.n_head, Hkv = m.n_kv_head, qn = H * D, kvn = Hkv * D;
    const Layer& l0 = m.layers[0];
    // each product's input rows as long as its stored k (int4 pads with zeros), so that one call takes all rows
    const int64_t kx = l0.qkv.k, ka = l0.o.k, kh = l0.w2.k, ko = m.out.k;
    static thread_local vec<uint16_t> x, xn, qkv, q, ho, att, y, gu, act, xo;
    // where row i's heads go in q and ho: [ones, H, 1, D] for the sequences of one token (at their rank among
    // them), then [H, n, D] for each longer one (at its own offset): base[i], head stride hs[i]
    static thread_local vec<int64_t> base, hs, seq, ones_table, ones_pos;
    int64_t M = 0, ones = 0;
    for (int64_t b = 0; b < B; b++) M += lens[b], ones += lens[b] == 1;
    base.resize(M), hs.resize(M), seq.resize(M), ones_table.resize(ones * W), ones_pos.resize(ones);
    for (int64_t b = 0, i = 0, one = 0, at = ones * qn; b < B; i += lens[b], b++) {
        if (lens[b] == 1) {
            memcpy(&ones_table[one * W], table + b * W, W * sizeof(int64_t));
            ones_pos[one] = pos[i], base[i] = one++ * qn, hs[i] = D, seq[i] = b;
            continue;
        }
        for (int64_t s = 0; s < lens[b]; s++) base[i + s] = at + s * D, hs[i + s] = lens[b] * D, seq[i + s] = b;
        at += lens[b] * qn;
    }
    xn.assign(M * kx, 0), att.assign(M * ka, 0), act.assign(M * kh, 0), xo.assign(R * ko, 0);
    x.resize(M * m.dim), qkv.resize(M * (qn + 2 * kvn)), q.resize(M * qn), ho.resize(M * qn);
    y.resize(M * m.dim), gu.resize(M * 2 * m.hidden);
    // (in the parallel loops by pointer: there a thread_local's name is each worker's own)
    uint16_t *X = x.data(), *XN = xn.data(), *QKV = qkv.data(), *Q = q.data(), *HO = ho.data(), *ATT = att.data();
    const int64_t *at0 = base.data(), *hs0 = hs.data(), *seq0 = seq.data();
    for (int64_t i = 0; i < M; i++) memcpy(&X[i * m.dim], m.embed + tokens[i] * m.dim, 2 * m.dim);
    for (int64_t li = 0; li < m.n_layer; li++) {
        const Layer& l = m.layers[li];
        #pragma omp parallel for if (M >= 64)
        for (int64_t i = 0; i < M; i++) rmsnorm(&X[i * m.dim], l.attn_norm, &XN[i * kx], m.dim, m.eps);
        product(l.qkv, XN, QKV, 0, M);
        #pragma omp parallel for if (M >= 64)
        for (int64_t i = 0; i < M; i++) {  // bias, RoPE, q to its attention's layout, K and V into the row's block
            uint16_t *qi = &QKV[i * (qn + 2 * kvn)], *k = qi + qn, *v = k + kvn;
            const int64_t block = table[seq0[i] * W + pos[i] / bs], off = pos[i] % bs;
            if (l.bqkv) add(qi, l.bqkv, qn + 2 * kvn);
            rope(qi, m.freqs + pos[i] * D, H, D);
            rope(k, m.freqs + pos[i] * D, Hkv, D);
            for (int64_t h = 0; h < H; h++) memcpy(&Q[at0[i] + h * hs0[i]], qi + h * D, 2 * D);
            for (int64_t h = 0; h < Hkv; h++) {
                const int64_t at = ((block * Hkv + h) * bs + off) * D;
                memcpy(k_pools[li] + at, k + h * D, 2 * D);
                memcpy(v_pools[li] + at, v + h * D, 2 * D);
            }
        }
        if (ones)
            attend_paged(Q, k_pools[li], v_pools[li], ones_table.data(), ones_pos.data(), HO, ones, H, Hkv, 1, D, W,
                         bs, m.slots);
        for (int64_t b = 0, i = 0; b < B; i += lens[b], b++)
            if (lens[b] > 1)
                attend_paged(&Q[at0[i]], k_pools[li], v_pools[li], table + b * W, pos + i, &HO[at0[i]], 1, H, Hkv,
                             lens[b], D, W, bs, m.slots);
        #pragma omp parallel for if (M >= 64)
        for (int64_t i = 0; i < M; i++)  // back to rows
            for (int64_t h = 0; h < H; h++) memcpy(&ATT[i * ka + h * D], &HO[at0[i] + h * hs0[i]], 2 * D);
        layer_rest(m, l, M, ATT, X, XN, kx, y.data(), gu.data(), act.data(), kh);
    }
    for (int64_t r = 0; r < R; r++) rmsnorm(&x[out[r] * m.dim], m.norm, &xo[r * ko], m.dim, m.eps);
    if (R) product(m.out, xo.data(), logits, 1, R);
}

// the greedy token of logits [V]: the first index of the largest (torch.argmax's), or -1 where one is not finite
// (generate.sample's NOT_FINITE), in one pass where torch takes three ops (HOW_IT_WORKS.md, "Batch-1 decoding on a
// CPU is one C++ call")
int64_t fast_decode::greedy(const float* logits, int64_t V) {
    __m256 top = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    __m256i at = _mm256_setzero_si256(), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {  // per lane the first largest: only a strictly larger value moves it
        const __m256 v = _mm256_loadu_ps(logits + i), gt = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
        bad = _mm256_or_ps(bad, _mm256_sub_ps(v, v));  // 0, or NaN from an infinity or a NaN
        top = _mm256_blendv_ps(top, v, gt);
        at = _mm256_blendv_epi8(at, _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), lane), _mm256_castps_si256(gt));
    }
    alignas(32) float tops[8], bads[8];
    alignas(32) int32_t ats[8];
    _mm256_store_ps(tops, top), _mm256_store_ps(bads, bad), _mm256_store_si256((__m256i*)ats, at);
    float best = -INFINITY;
    int64_t pick = 0;
    for (int l = 0; l < 8; l++) {
        if (bads[l] != 0.f) return -1;
        if (tops[l] > best || (tops[l] == best && ats[l] < pick)) best = tops[l], pick = ats[l];
    }
    for (; i < V; i++) {
        if (!isfinite(logits[i])) return -1;
        if (logits[i] > best) best = logits[i], pick = i;
    }
    return pick;
}

// greedy decoding from token at slot pos: a step a token, each fed the last one's pick, into out[0, n), until n
// tokens, one of eos[0, n_eos) or a -1 (a logit not finite). Returns the tokens written. No Python between steps:
// the torch ops generate's loop runs a token have their code and data evicted by the weights.
int64_t fast_decode::decode_greedy(const Model& model, int64_t token, int64_t pos, int64_t n, int64_t* out,
                                   const int64_t* eos, int64_t n_eos, float* logits, int64_t vocab) {
    for (int64_t i = 0; i < n; i++) {
        decode_step(model, token, pos + i, logits);
        token = out[i] = greedy(logits, vocab);
        bool end = token < 0;
        for (int64_t e = 0; e < n_eos; e++) end |= token == eos[e];
        if (end) return i + 1;
    }
    return n;
}
