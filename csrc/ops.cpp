// The torch ops fast_decode::* and the batch-1 step as the torch class fast_decode.Step, over the kernel set loaded
// last (use_kernels). Built against this torch's headers; torch.compile keeps the ops in its graphs and calls them
// with no Python in between. See HOW_IT_WORKS.md, "The C++ sources and their build".
#include <dlfcn.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kernels.h"

using at::Tensor;
using fast_decode::KernelSet;

static const KernelSet* K = nullptr;  // the set the ops run on

// the kernel set built at path (a shared library exporting fast_decode_kernels) becomes the ops' set; the library
// stays loaded, so that a Step made on an earlier set keeps running on it
static void use_kernels(std::string path) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib, "use_kernels: ", dlerror());
    auto set = (decltype(&fast_decode_kernels))dlsym(lib, "fast_decode_kernels");
    TORCH_CHECK(set, "use_kernels: ", path, " is no kernel set");
    K = set();
}

static const KernelSet& kernels() {
    TORCH_CHECK(K, "fast_decode: no kernel set loaded (cpu_gemv.load)");
    return *K;
}

static Tensor out(const Tensor& x, int64_t n, bool f32) {  // [..., n], bf16 or float32
    auto shape = x.sizes().vec();
    shape.back() = n;
    return at::empty(shape, x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
}

template <typename T> static T* ptr(const Tensor& t) { return (T*)t.data_ptr(); }

// x [..., K] bf16, w [N, K] bf16 -> [..., N]
static Tensor gemv_bf16(const Tensor& x_, const Tensor& w, bool f32) {
    Tensor x = x_.contiguous(), y = out(x, w.size(0), f32);
    kernels().gemv_bf16(ptr<uint16_t>(x), ptr<uint16_t>(w), y.data_ptr(), x.numel() / w.size(1), w.size(0), w.size(1),
                        f32);
    return y;
}

// x [..., K] bf16, w [N, K] int8, scales [N] bf16 -> [..., N]
static Tensor gemv_int8(const Tensor& x_, const Tensor& w, const Tensor& scales, bool f32) {
    Tensor x = x_.contiguous(), y = out(x, w.size(0), f32);
    kernels().gemv_int8(ptr<uint16_t>(x), ptr<int8_t>(w), ptr<uint16_t>(scales), y.data_ptr(), x.numel() / w.size(1),
                        w.size(0), w.size(1), f32);
    return y;
}

// x [..., K'] bf16, w [N, K'/2] uint8 (two q per byte), scales and zeros [N, K'/G] bf16 -> [..., N]
static Tensor gemv_int4(const Tensor& x_, const Tensor& w, const Tensor& scales, const Tensor& zeros, bool f32) {
    Tensor x = x_.contiguous(), y = out(x, w.size(0), f32);
    int64_t k = 2 * w.size(1);
    int64_t g = k / scales.size(1);
    TORCH_CHECK(k % 64 == 0 && g * scales.size(1) == k && (g == 32 || g == 64 || g == 128 || g == 256),
                "gemv_int4: K ", k, " in groups of ", g, "; K must be a multiple of 64 and a group 32 to 256 long");
    kernels().gemv_int4(ptr<uint16_t>(x), ptr<uint8_t>(w), ptr<uint16_t>(scales), ptr<uint16_t>(zeros), y.data_ptr(),
                        x.numel() / k, w.size(0), k, g, f32);
    return y;
}

// w [N, K'/2] uint8, scales and zeros [N, K'/G] bf16 -> [N, K'] float32 (or bf16)
static Tensor dequantize_int4(const Tensor& w, const Tensor& scales, const Tensor& zeros, bool f32) {
    Tensor y = at::empty({w.size(0), 2 * w.size(1)}, w.options().dtype(f32 ? at::kFloat : at::kBFloat16));
    kernels().dequantize_int4(ptr<uint8_t>(w), ptr<uint16_t>(scales), ptr<uint16_t>(zeros), y.data_ptr(), y.size(0),
                              y.size(1), y.size(1) / scales.size(1), f32);
    return y;
}

// x [..., K] bf16, w [N, K] int8, scales [N] bf16 -> [..., N] in dtype: many rows through torch's GEMM, the weight
// converted exactly to dtype and the scale applied after the product. An op of its own so that a compiled prefill
// runs these same ATen ops: inductor would put its int8 weight-only matmul in their place, another kernel.
static Tensor gemm_int8(const Tensor& x, const Tensor& w, const Tensor& scales, at::ScalarType dtype) {
    return at::linear(x.to(dtype), w.to(dtype)).mul(scales.to(dtype));
}

// q [B, H, S, D] bf16, k and v [B, Hkv, L, D] bf16 (slices of the cache: rows of D contiguous), mask [B|1, 1, S, L]
// bool -> [B, H, S, D]
static Tensor attend(const Tensor& q_, const Tensor& k, const Tensor& v, const Tensor& mask) {
    Tensor q = q_.contiguous();
    int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), L = k.size(2);
    Tensor m = mask.expand({B, 1, S, L}), y = at::empty(q.sizes(), q.options());
    kernels().attend(ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), ptr<uint8_t>(m), ptr<uint16_t>(y), B, H,
                     k.size(1), S, L, D, k.stride(0), k.stride(1), m.stride(0));
    return y;
}

// attend() over an int8 cache: k and v [B, Hkv, L, D] int8, k_scale [B, Hkv, L, 1] and v_scale [B, Hkv, L, D / 32]
// float32 (slices of the cache)
static Tensor attend_int8(const Tensor& q_, const Tensor& k, const Tensor& ks, const Tensor& v, const Tensor& vs,
                          const Tensor& mask) {
    Tensor q = q_.contiguous();
    int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), L = k.size(2);
    Tensor m = mask.expand({B, 1, S, L}), y = at::empty(q.sizes(), q.options());
    kernels().attend_int8(ptr<uint16_t>(q), ptr<int8_t>(k), ptr<float>(ks), ptr<int8_t>(v), ptr<float>(vs),
                          ptr<uint8_t>(m), ptr<uint16_t>(y), B, H, k.size(1), S, L, D, k.stride(0), k.stride(1),
                          ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), m.stride(0));
    return y;
}

// q [B, H, S, D] bf16 over a paged cache: k_pool and v_pool [n_blocks, Hkv, block_size, D] bf16 (contiguous), table
// [B, W] int64 each row's block ids in position order, pos [B, S] int64 each query's position (it sees positions
// 0 .. pos of its row) -> [B, H, S, D], each row bit for bit as attend() computes it alone over a contiguous cache of
// `slots` positions. The kernel reads what pos and table point at: both are checked here first.
static Tensor attend_paged(const Tensor& q_, const Tensor& kp, const Tensor& vp, const Tensor& table_,
                           const Tensor& pos_, int64_t slots) {
    TORCH_CHECK(q_.dim() == 4 && kp.dim() == 4 && vp.sizes() == kp.sizes(), "attend_paged: q must be [B, H, S, D] ",
                "and k_pool, v_pool [n_blocks, Hkv, block_size, D], got ", q_.sizes(), ", ", kp.sizes(), " and ",
                vp.sizes());
    TORCH_CHECK(q_.scalar_type() == at::kBFloat16 && kp.scalar_type() == at::kBFloat16 &&
                vp.scalar_type() == at::kBFloat16, "attend_paged: q, k_pool and v_pool must be bfloat16, got ",
                q_.scalar_type(), ", ", kp.scalar_type(), " and ", vp.scalar_type());
    TORCH_CHECK(q_.device().is_cpu() && kp.device().is_cpu() && vp.device().is_cpu() && table_.device().is_cpu() &&
                pos_.device().is_cpu(), "attend_paged: every tensor must be on the CPU");
    const int64_t B = q_.size(0), H = q_.size(1), S = q_.size(2), D = q_.size(3);
    const int64_t n_blocks = kp.size(0), Hkv = kp.size(1), bs = kp.size(2);
    TORCH_CHECK(kp.size(3) == D && (D == 16 || D == 32 || D == 64 || D == 128 || D == 256),
                "attend_paged: head dim 16, 32, 64, 128 or 256 in q and the pools, got ", D, " and ", kp.size(3));
    TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "attend_paged: ", H, " query heads do not share ", Hkv, " KV heads evenly");
    TORCH_CHECK(S >= 1 && S <= 32, "attend_paged: 1 to 32 query positions a row (q's S), got ", S);
    TORCH_CHECK(bs >= 16 && bs % 16 == 0, "attend_paged: block_size must be a multiple of 16, got ", bs);
    TORCH_CHECK(kp.is_contiguous() && vp.is_contiguous(), "attend_paged: k_pool and v_pool must be contiguous");
    TORCH_CHECK(table_.scalar_type() == at::kLong && table_.dim() == 2 && table_.size(0) == B,
                "attend_paged: table must be int64 [B, W] with B = ", B, ", got ", table_.scalar_type(), " ",
                table_.sizes());
    TORCH_CHECK(pos_.scalar_type() == at::kLong && pos_.dim() == 2 && pos_.size(0) == B && pos_.size(1) == S,
                "attend_paged: pos must be int64 [B, S] = [", B, ", ", S, "], got ", pos_.scalar_type(), " ",
                pos_.sizes());
    Tensor q = q_.contiguous(), table = table_.contiguous(), pos = pos_.contiguous();
    const int64_t W = table.size(1), *t = ptr<int64_t>(table), *p = ptr<int64_t>(pos);
    const int64_t room = slots < W * bs ? slots : W * bs;  // the positions the cache and the table both hold
    for (int64_t b = 0; b < B; b++) {
        int64_t last = 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t x = p[b * S + s];
            TORCH_CHECK(x >= 0 && x < room, "attend_paged: row ", b, " has position ", x, ", outside 0 .. ",
                        room - 1, " (", slots, " slots, ", W, " blocks of ", bs, " in its table)");
            last = x > last ? x : last;
        }
        for (int64_t i = 0; i <= last / bs; i++)  // the blocks the row reads; the table's rest is never read
            TORCH_CHECK(t[b * W + i] >= 0 && t[b * W + i] < n_blocks, "attend_paged: row ", b, "'s block ", i, " is ",
                        t[b * W + i], ", outside the pool's ", n_blocks, " blocks");
    }
    Tensor y = at::empty(q.sizes(), q.options());
    const int64_t chunk = kernels().attend_paged(ptr<uint16_t>(q), ptr<uint16_t>(kp), ptr<uint16_t>(vp), t, p,
                                                 ptr<uint16_t>(y), B, H, Hkv, S, D, W, bs, slots);
    TORCH_CHECK(chunk == 0, "attend_paged: block_size ", bs, " does not divide the kernel's chunk of ", chunk,
                " positions (", slots, " slots, ", Hkv, " KV heads of ", D, "); 16, 32, 64, 128 and 256 always do");
    return y;
}

// ---- the batch-1 step: kernels.h's Model, filled from model.py's tensors -------------------------------------------

// a product's tensors: [w] bf16, [w, scales] int8, or [w, scales, zeros] int4 (w packed two to a byte)
static fast_decode::Linear linear(const std::vector<Tensor>& t) {
    static const at::ScalarType kinds[] = {at::kBFloat16, at::kChar, at::kByte};
    TORCH_CHECK(t.size() >= 1 && t.size() <= 3 && t[0].dim() == 2 && t[0].scalar_type() == kinds[t.size() - 1],
                "Step: a product is [bf16 w], [int8 w, scales] or [uint8 w, scales, zeros]");
    const int64_t kind = t.size() - 1, k = t[0].size(1) * (kind == 2 ? 2 : 1);
    return {kind, t[0].size(0), k, kind == 2 ? k / t[1].size(1) : 0, t[0].data_ptr(),
            kind ? t[1].data_ptr() : nullptr, kind == 2 ? t[2].data_ptr() : nullptr};
}

template <typename T> static T* ptr(const std::optional<Tensor>& t) { return t ? (T*)t->data_ptr() : nullptr; }

// Pointers into the model's tensors as they are when it is made, and no references to them: the model's cache may
// be freed and set up anew (cpu_step.step makes a Step per decode loop). Runs on the set loaded when it was made.
struct Step : torch::CustomClassHolder {
    fast_decode::Model m{};
    std::vector<fast_decode::Layer> layers;
    const KernelSet& k = kernels();

    // embed [vocab, dim], norm [dim] bf16; freqs [positions, head_dim / 2, 2] float32; output: a product's tensors
    Step(const Tensor& embed, const Tensor& norm, const Tensor& freqs, const std::vector<Tensor>& output,
         int64_t n_head, int64_t n_kv_head, int64_t window, double eps) {
        m.dim = embed.size(1), m.n_head = n_head, m.n_kv_head = n_kv_head, m.head_dim = 2 * freqs.size(1);
        m.window = window, m.eps = (float)eps;
        m.embed = ptr<uint16_t>(embed), m.norm = ptr<uint16_t>(norm), m.freqs = ptr<float>(freqs);
        m.out = linear(output);
    }

    // the next layer: its norms' weights, q, k and v's bias, its products, and its cache [1, Hkv, slots, D] (bf16,
    // or int8 with k_scale [1, Hkv, slots, 1] and v_scale [1, Hkv, slots, D / 32])
    void add_layer(const Tensor& attn_norm, const Tensor& ffn_norm, const std::optional<Tensor>& bqkv,
                   const std::vector<Tensor>& qkv, const std::vector<Tensor>& o, const std::vector<Tensor>& w13,
                   const std::vector<Tensor>& w2, const Tensor& k_cache, const Tensor& v_cache,
                   const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
        layers.push_back({ptr<uint16_t>(attn_norm), ptr<uint16_t>(ffn_norm), ptr<uint16_t>(bqkv), linear(qkv),
                          linear(o), linear(w13), linear(w2), k_cache.data_ptr(), v_cache.data_ptr(),
                          ptr<float>(k_scale), ptr<float>(v_scale)});
        m.layers = layers.data(), m.n_layer = layers.size();
        m.hidden = layers.back().w13.n / 2, m.slots = k_cache.size(2), m.vb = v_scale ? v_scale->size(-1) : 0;
    }

    // logits [1, vocab] float32 of token at cache slot pos
    void step(int64_t token, int64_t pos, const Tensor& logits) { k.decode_step(m, token, pos, ptr<float>(logits)); }

    // logits [M, vocab] float32 of tokens [M] int64 at slots base .. base + M - 1, RoPE positions pos [M] int64,
    // row i attending to the slots mask [M, base + M] bool holds: a verify pass, each row as step computes it; logits
    // [1, vocab]: the last row's alone (a piece of a prompt)
    void rows(const Tensor& tokens, const Tensor& pos, int64_t base, const Tensor& mask, const Tensor& logits) {
        const int64_t M = tokens.numel();
        TORCH_CHECK(pos.numel() == M && mask.dim() == 2 && mask.size(0) == M && mask.size(1) == base + M &&
                    mask.is_contiguous() && (logits.size(0) >= M || logits.size(0) == 1) && base + M <= m.slots,
                    "Step.rows: shapes");
        TORCH_CHECK(m.layers[0].w13.k == m.layers[0].qkv.k, "Step.rows: w13 and qkv take inputs of one length");
        k.forward_rows(m, ptr<int64_t>(tokens), ptr<int64_t>(pos), M, base, ptr<uint8_t>(mask), ptr<float>(logits),
                       logits.size(0) < M);
    }

    // the engine's paged cache: layer i's pools k[i] and v[i] [n_blocks, Hkv, block_size, D] bf16, for paged()
    std::vector<uint16_t*> kp, vp;
    int64_t n_blocks = 0, bs = 0;
    void set_pools(const std::vector<Tensor>& k, const std::vector<Tensor>& v) {
        TORCH_CHECK((int64_t)k.size() == m.n_layer && v.size() == k.size(), "Step.set_pools: a pool a layer");
        kp.clear(), vp.clear();
        for (size_t i = 0; i < k.size(); i++) {
            TORCH_CHECK(k[i].dim() == 4 && k[i].sizes() == k[0].sizes() && v[i].sizes() == k[0].sizes() &&
                        k[i].size(1) == m.n_kv_head && k[i].size(3) == m.head_dim && k[i].is_contiguous() &&
                        v[i].is_contiguous() && k[i].scalar_type() == at::kBFloat16 &&
                        v[i].scalar_type() == at::kBFloat16, "Step.set_pools: pools must be contiguous bf16 ",
                        "[n_blocks, ", m.n_kv_head, ", block_size, ", m.head_dim, "], got ", k[i].sizes());
            kp.push_back(ptr<uint16_t>(k[i])), vp.push_back(ptr<uint16_t>(v[i]));
        }
        n_blocks = k[0].size(0), bs = k[0].size(2);
        TORCH_CHECK(bs >= 16 && bs % 16 == 0, "Step.set_pools: block_size must be a multiple of 16, got ", bs);
    }

    // logits [R, vocab] float32 of the rows out [R] int64 names, after B sequences' next tokens: tokens and pos [M]
    // int64, sequence b's lens[b] of them after the previous ones' at consecutive positions, its blocks in its row of
    // table [B, W] int64, over the pools (set_pools): the engine's step in one pass, each row as step computes it
    // alone. int4's products are batch-invariant for up to 32 rows off AMX, the others' at any count: the caller
    // knows which it runs, and passes that many.
    void paged(const Tensor& tokens, const Tensor& pos, const Tensor& lens, const Tensor& table, const Tensor& out,
               const Tensor& logits) {
        TORCH_CHECK(!kp.empty() && m.window == 0, "Step.paged: no pools set, or a sliding window");
        const int64_t M = tokens.numel(), B = lens.numel(), R = out.numel();
        for (const Tensor* t : {&tokens, &pos, &lens, &table, &out})
            TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "Step.paged: int64 contiguous tensors");
        TORCH_CHECK(pos.numel() == M && table.dim() == 2 && table.size(0) == B && logits.is_contiguous() &&
                    logits.dim() == 2 && logits.size(0) >= R && logits.size(1) == m.out.n &&
                    logits.scalar_type() == at::kFloat, "Step.paged: shapes");
        TORCH_CHECK(m.layers[0].w13.k == m.layers[0].qkv.k, "Step.paged: w13 and qkv take inputs of one length");
        const int64_t W = table.size(1), *t = ptr<int64_t>(table), *p = ptr<int64_t>(pos), *tok = ptr<int64_t>(tokens);
        const int64_t *n = ptr<int64_t>(lens), *o = ptr<int64_t>(out);
        int64_t rows = 0;
        for (int64_t b = 0; b < B; rows += n[b], b++) {  // what the step reads and writes through: checked first
            TORCH_CHECK(n[b] >= 1 && rows + n[b] <= M, "Step.paged: sequence ", b, " has ", n[b], " of ", M, " rows");
            for (int64_t s = 0; s < n[b]; s++) {
                const int64_t i = rows + s, x = p[i], token = tok[i];
                TORCH_CHECK(token >= 0 && token < m.out.n && x >= 0 && x < m.slots - 1 && x < W * bs &&
                            (s == 0 || x == p[i - 1] + 1), "Step.paged: row ", i, " has token ", token,
                            " at position ", x);
            }
            for (int64_t i = 0; i <= p[rows + n[b] - 1] / bs; i++)
                TORCH_CHECK(t[b * W + i] >= 0 && t[b * W + i] < n_blocks, "Step.paged: sequence ", b, "'s block ", i,
                            " is ", t[b * W + i], ", outside the pool");
        }
        TORCH_CHECK(rows == M, "Step.paged: the lens sum to ", rows, ", not the ", M, " tokens");
        for (int64_t r = 0; r < R; r++) TORCH_CHECK(o[r] >= 0 && o[r] < M, "Step.paged: out row ", o[r]);
        k.forward_paged(m, kp.data(), vp.data(), bs, tok, p, n, t, B, W, o, R, ptr<float>(logits));
    }

    // the greedy token of logits [1, vocab]: the first largest, or -1 where one is not finite
    int64_t greedy(const Tensor& logits) { return k.greedy(ptr<float>(logits), logits.numel()); }

    // step, then greedy: one call from Python a token
    int64_t step_greedy(int64_t token, int64_t pos, const Tensor& logits) {
        step(token, pos, logits);
        return greedy(logits);
    }

    // greedy decoding from token at slot pos into out [n] int64, until an id of eos [E] int64; the tokens written
    int64_t greedy_loop(int64_t token, int64_t pos, const Tensor& out, const Tensor& eos, const Tensor& logits) {
        return k.decode_greedy(m, token, pos, out.numel(), ptr<int64_t>(out), ptr<int64_t>(eos), eos.numel(),
                               ptr<float>(logits), logits.numel());
    }
};

// New behaviour takes a new op, never new arguments on an old one: a graph inductor compiled and cached before calls
// the op with the arguments it had then. f32: the products in float32 instead of bf16 (the output head)
TORCH_LIBRARY(fast_decode, m) {
    m.def("gemv_bf16(Tensor x, Tensor w, bool f32=False) -> Tensor");
    m.def("gemv_int8(Tensor x, Tensor w, Tensor scales, bool f32=False) -> Tensor");
    m.def("gemv_int4(Tensor x, Tensor w, Tensor scales, Tensor zeros, bool f32=False) -> Tensor");
    m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor");
    m.def("attend_int8(Tensor q, Tensor k, Tensor k_scale, Tensor v, Tensor v_scale, Tensor mask) -> Tensor");
    m.def("attend_paged(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor pos, int slots) -> Tensor");
    m.def("dequantize_int4(Tensor w, Tensor scales, Tensor zeros, bool f32) -> Tensor");
    m.def("gemm_int8(Tensor x, Tensor w, Tensor scales, ScalarType dtype) -> Tensor");
    m.def("use_kernels(str path) -> ()", use_kernels);
    m.class_<Step>("Step")
        .def(torch::init<const Tensor&, const Tensor&, const Tensor&, const std::vector<Tensor>&, int64_t, int64_t,
                         int64_t, double>())
        .def("add_layer", &Step::add_layer)
        .def("step", &Step::step)
        .def("rows", &Step::rows)
        .def("set_pools", &Step::set_pools)
        .def("paged", &Step::paged)
        .def("greedy", &Step::greedy)
        .def("step_greedy", &Step::step_greedy)
        .def("greedy_loop", &Step::greedy_loop);
}

TORCH_LIBRARY_IMPL(fast_decode, CPU, m) {
    m.impl("gemv_bf16", gemv_bf16);
    m.impl("gemv_int8", gemv_int8);
    m.impl("gemv_int4", gemv_int4);
    m.impl("dequantize_int4", dequantize_int4);
    m.impl("gemm_int8", gemm_int8);
    m.impl("attend", attend);
    m.impl("attend_int8", attend_int8);
    m.impl("attend_paged", attend_paged);
}
