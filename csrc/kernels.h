// Everything that crosses a boundary between the C++ files: the entry points of a kernel set (one shared library
// per instruction set, built from bf16_*.cpp, quantized.cpp, attention.cpp, step.cpp and kernel_set.cpp) and the
// batch-1 step's view of a model. ops.cpp, the torch side, reaches a set only through the KernelSet it exports.
// Tensors are raw pointers here, row-major and contiguous unless a stride says otherwise; bf16 is uint16_t.
// See HOW_IT_WORKS.md, "The C++ sources and their build".
#pragma once
#include <stdint.h>

namespace fast_decode {

// ---- the batch-1 step's model (step.cpp runs model.py's forward for one token over it) -----------------------------

// one layer's product: kind 0 bf16 w [n, k], 1 int8 w [n, k] and scales [n], 2 int4 w [n, k / 2] and scales and
// zeros [n, k / group]; k is the stored length (int4 pads the input to it with zeros)
struct Linear {
    int64_t kind, n, k, group;
    const void *w, *scales, *zeros;
};
struct Layer {
    const uint16_t *attn_norm, *ffn_norm, *bqkv;  // bqkv: null without a bias
    Linear qkv, o, w13, w2;
    void *k, *v;  // the cache's first row: [Hkv, slots, D] bf16, or int8 with the scales below
    float *ks, *vs;  // [Hkv, slots, 1] and [Hkv, slots, vb]; null for a bf16 cache
};
struct Model {
    int64_t n_layer, dim, n_head, n_kv_head, head_dim, hidden, slots, window, vb;
    float eps;
    const uint16_t *embed, *norm;  // [vocab, dim], [dim]
    const float* freqs;  // [positions, head_dim / 2, 2]
    Linear out;
    const Layer* layers;  // [n_layer]
};

// ---- a kernel set's entry points ------------------------------------------------------------------------------

#pragma GCC visibility push(hidden)  // each set's own: two sets loaded in one process never see each other's

// y[M, N] = x[M, K] @ w[N, K]^T, x and w bf16, accumulated in fp32; y bf16, or float32 where f32; K a multiple of 16
void gemv_bf16(const uint16_t* x, const uint16_t* w, void* y, int64_t M, int64_t N, int64_t K, int64_t f32);

// y[M, N] = x[M, K] @ (w[N, K] * scales[N])^T, w int8, scales bf16; K a multiple of 32
void gemv_int8(const uint16_t* x, const int8_t* w, const uint16_t* scales, void* y, int64_t M, int64_t N, int64_t K,
               int64_t f32);

// y[M, N] = x[M, K] @ w^T, w as packed q [N, K / 2] (low nibble first), scales and zeros [N, K / G] bf16:
// w = (q - 8) * scale + zero per group of G (32, 64, 128 or 256); K a multiple of 64
void gemv_int4(const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, void* y, int64_t M,
               int64_t N, int64_t K, int64_t G, int64_t f32);

// gemv_int4's w, scales and zeros -> out [N, K] in float32 (or bf16), for a GEMM of many rows
void dequantize_int4(const uint8_t* w, const uint16_t* scales, const uint16_t* zeros, void* out, int64_t N, int64_t K,
                     int64_t G, int64_t f32);

// out [B, H, S, D] = softmax(q k^T / sqrt(D), masked) v for q [B, H, S, D] bf16 and k, v [B, Hkv, L, D] bf16 (rows
// of D contiguous; kb, kh: the strides of b and of a KV head, in elements), mask [B, S, L] bool (mb: its stride of
// b, 0 to share one); H a multiple of Hkv, D 16 to 256, S <= 32
void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, uint16_t* out, int64_t B,
            int64_t H, int64_t Hkv, int64_t S, int64_t L, int64_t D, int64_t kb, int64_t kh, int64_t mb);

// attend() for B rows over a paged cache: k_pool and v_pool [n_blocks, Hkv, bs, D] bf16, table [B, W] each row's
// block ids in position order (position p in block table[b, p / bs] at p % bs), pos [B, S] each query's position (it
// sees positions 0 .. pos[b, s] of its row). Each row comes out bit for bit as attend() computes it alone over a
// contiguous cache of `slots` positions a KV head (kh = slots * D) holding the same K and V. Returns 0; or, where bs
// is no multiple of 16 that divides the chunk of positions a task takes, that chunk, and computes nothing.
int64_t attend_paged(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, const int64_t* table,
                     const int64_t* pos, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t D,
                     int64_t W, int64_t bs, int64_t slots);

// attend() over an int8 cache: k and v [B, Hkv, L, D] int8, ks [B, Hkv, L] and vs [B, Hkv, L, D / 32] float32
// scales (ksb, ksh, vsb, vsh: their strides of b and of a head); D 64, 128 or 256
void attend_int8(const uint16_t* q, const int8_t* k, const float* ks, const int8_t* v, const float* vs,
                 const uint8_t* mask, uint16_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t L,
                 int64_t D, int64_t kb, int64_t kh, int64_t ksb, int64_t ksh, int64_t vsb, int64_t vsh, int64_t mb);

// logits [vocab] float32 of token at cache slot pos; its K and V are written there
void decode_step(const Model& m, int64_t token, int64_t pos, float* logits);

// logits [M, vocab] float32 of tokens [M] at cache slots base .. base + M - 1, RoPE positions pos [M], each
// attending to the slots its row of mask [M, base + M] (bytes) holds; each row as decode_step computes it alone.
// last: only the last row's logits, [1, vocab] (a piece of a prompt)
void forward_rows(const Model& m, const int64_t* tokens, const int64_t* pos, int64_t M, int64_t base,
                  const uint8_t* mask, float* logits, int64_t last);

// logits [R, vocab] float32 of the rows out [R] names, after B sequences' next tokens, tokens and pos [M] (sequence
// b's lens[b] rows after the previous sequences', positions consecutive), over a paged cache: layer i's K and V in
// k_pools[i] and v_pools[i] [n_blocks, Hkv, bs, D] bf16, sequence b's blocks in row b of table [B, W]; each row as
// decode_step computes it alone over a static cache of m.slots positions (bs: as attend_paged takes it)
void forward_paged(const Model& m, uint16_t* const* k_pools, uint16_t* const* v_pools, int64_t bs,
                   const int64_t* tokens, const int64_t* pos, const int64_t* lens, const int64_t* table, int64_t B,
                   int64_t W, const int64_t* out, int64_t R, float* logits);

// the greedy token of logits [V]: the first index of the largest, or -1 where one is not finite
int64_t greedy(const float* logits, int64_t V);

// greedy decoding from token at slot pos into out[0, n), until n tokens, one of eos[0, n_eos) or a -1; returns the
// tokens written
int64_t decode_greedy(const Model& m, int64_t token, int64_t pos, int64_t n, int64_t* out, const int64_t* eos,
                      int64_t n_eos, float* logits, int64_t vocab);

#pragma GCC visibility pop

// a kernel set's entry points, as ops.cpp calls them
struct KernelSet {
    decltype(&fast_decode::gemv_bf16) gemv_bf16;
    decltype(&fast_decode::gemv_int8) gemv_int8;
    decltype(&fast_decode::gemv_int4) gemv_int4;
    decltype(&fast_decode::dequantize_int4) dequantize_int4;
    decltype(&fast_decode::attend) attend;
    decltype(&fast_decode::attend_int8) attend_int8;
    decltype(&fast_decode::attend_paged) attend_paged;
    decltype(&fast_decode::decode_step) decode_step;
    decltype(&fast_decode::forward_rows) forward_rows;
    decltype(&fast_decode::forward_paged) forward_paged;
    decltype(&fast_decode::greedy) greedy;
    decltype(&fast_decode::decode_greedy) decode_greedy;
};

}  // namespace fast_decode

// the one symbol a kernel set's library exports (kernel_set.cpp)
extern "C" const fast_decode::KernelSet* fast_decode_kernels();
