"""A batch-1 decode step on a CPU as one C++ call: model.py's forward for one token, on cpu_gemv.py's kernels.

The compiled step (torch.compile's C++ wrapper) runs the same kernels, but pays a fixed cost every step that a CPU
cannot hide: dynamo's guard check (about 0.5 ms, its ~2000 Python objects evicted by the step's weight stream),
gathering the graph's ~360 inputs, and at each of the ~90 joins between products an inductor kernel and a boxed
op call. On TinyLlama's shape that was 2.3-2.6 ms of a 12.3-13.2 ms int4 step (Zen 4), the products alone reading
at 84-94% of the memory's speed. Here the step is a loop over the layers in C++: RMSNorm, RoPE, the cache write
and the SiLU on one thread (a few thousand values each), the products and the attention on the kernels' threads,
scratch kept between steps, and no Python, allocation or dispatch between them. scripts/bench_cpu_step.py times
the two alternating: on TinyLlama's shape (Zen 4) the compiled int4 step took 1.07-1.15x this one's time, int8
1.04-1.09x, bf16 0.98-1.07x; on SmolLM2-135M (30 thin layers) 1.41x.

It runs what it can run exactly as model.py does (the same bf16 roundings, the same cache), and says None to the
rest, which then takes the compiled step: batches, left padding, token trees, float32 models, torch's kernels,
tensor parallelism (its all-reduces are modules this step does not know)."""
import ctypes
from ctypes import POINTER, c_float, c_int64, c_void_p
from typing import Optional

import torch
from torch import Tensor

import cpu_gemv
from model import Attention, GateUp, RMSNorm, Transformer, TransformerBlock

STEP = r"""
// (bf16_bits, to_bf16x8, widen8 and hsum8: cpu_gemv.PRELUDE's)
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

// one layer's product: kind 0 bf16 w [n, k], 1 int8 w [n, k] and scales [n], 2 int4 w [n, k / 2] and scales and
// zeros [n, k / group]; k is the stored length (int4 pads the input to it with zeros)
struct Linear { int64_t kind, n, k, group; const void *w, *scales, *zeros; };
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
    const Layer* layers;
    void* kernels[5];  // gemv_bf16, gemv_int8, gemv_int4, attend, attend_int8 of the loaded kernel set
};

typedef void (*Bf16)(const uint16_t*, const void*, void*, int64_t, int64_t, int64_t, int64_t);
typedef void (*Int8)(const uint16_t*, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t);
typedef void (*Int4)(const uint16_t*, const void*, const void*, const void*, void*, int64_t, int64_t, int64_t,
                     int64_t, int64_t);
typedef void (*Attend)(const void*, const void*, const void*, const void*, void*, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef void (*AttendInt8)(const void*, const void*, const void*, const void*, const void*, const void*, void*,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t);

static void product(void* const* kernels, const Linear& l, const uint16_t* x, void* y, int64_t f32 = 0) {
    if (l.kind == 0) ((Bf16)kernels[0])(x, l.w, y, 1, l.n, l.k, f32);
    else if (l.kind == 1) ((Int8)kernels[1])(x, l.w, l.scales, y, 1, l.n, l.k, f32);
    else ((Int4)kernels[2])(x, l.w, l.scales, l.zeros, y, 1, l.n, l.k, l.group, f32);
}

// logits [vocab] float32 of token at cache slot pos; its K and V are written there, and it attends to the slots
// up to pos (the last `window` of them where the model slides): only those are read, with no mask, where the
// compiled step reads a power-of-two bucket of slots and masks the rest (at 100 positions, 256 a layer)
extern "C" void decode_step(const Model* model, int64_t token, int64_t pos, float* logits) {
    const Model& m = *model;
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
        product(m.kernels, l.qkv, xn.data(), qkv.data());
        if (l.bqkv) add(qkv.data(), l.bqkv, qn + 2 * kvn);
        uint16_t *q = qkv.data(), *k = q + qn, *v = k + kvn;
        rope(q, cs, H, D);
        rope(k, cs, Hkv, D);
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = h * m.slots + pos;
            if (!l.ks) {
                memcpy((uint16_t*)l.k + at * D, k + h * D, 2 * D);
                memcpy((uint16_t*)l.v + at * D, v + h * D, 2 * D);
            } else {
                quantize_row(k + h * D, (int8_t*)l.k + at * D, l.ks + at, D, D);
                quantize_row(v + h * D, (int8_t*)l.v + at * D, l.vs + at * m.vb, D, D / m.vb);
            }
        }
        if (!l.ks)
            ((Attend)m.kernels[3])(q, (uint16_t*)l.k + start * D, (uint16_t*)l.v + start * D, mask.data(), att.data(),
                                   1, H, Hkv, 1, L, D, Hkv * m.slots * D, m.slots * D, 0);
        else
            ((AttendInt8)m.kernels[4])(q, (int8_t*)l.k + start * D, l.ks + start, (int8_t*)l.v + start * D,
                                       l.vs + start * m.vb, mask.data(), att.data(), 1, H, Hkv, 1, L, D,
                                       Hkv * m.slots * D, m.slots * D, Hkv * m.slots, m.slots, Hkv * m.slots * m.vb,
                                       m.slots * m.vb, 0);
        product(m.kernels, l.o, att.data(), y.data());
        add(x.data(), y.data(), m.dim);
        rmsnorm(x.data(), l.ffn_norm, xn.data(), m.dim, m.eps);
        product(m.kernels, l.w13, xn.data(), gu.data());
        for (int64_t j = 0; j < m.hidden; j += 8) {  // silu(gate) * up in fp32, rounded once, as inductor fuses it
            const __m256 g = widen8(&gu[j]), u = widen8(&gu[m.hidden + j]);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            store8(&act[j], _mm256_mul_ps(s, u));
        }
        product(m.kernels, l.w2, act.data(), y.data());
        add(x.data(), y.data(), m.dim);
    }
    rmsnorm(x.data(), m.norm, xn.data(), m.dim, m.eps);
    product(m.kernels, m.out, xn.data(), logits, 1);
}

// the greedy token of logits [V]: the first index of the largest (torch.argmax's), or -1 where one is not finite
// (generate.sample's NOT_FINITE). torch's argmax, isfinite and where on the logits took ~0.2 ms a step on a 2-core
// Zen 4, this ~0.025 ms, nearly all of it reading the half of the logits the other core wrote.
extern "C" int64_t greedy(const float* logits, int64_t V) {
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
// the ~10 torch ops generate's loop runs a token cost ~0.35 ms there (their code and data evicted by the weights).
extern "C" int64_t decode_greedy(const Model* model, int64_t token, int64_t pos, int64_t n, int64_t* out,
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
"""


class Linear(ctypes.Structure):
    _fields_ = [("kind", c_int64), ("n", c_int64), ("k", c_int64), ("group", c_int64), ("w", c_void_p),
                ("scales", c_void_p), ("zeros", c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", c_void_p), ("ffn_norm", c_void_p), ("bqkv", c_void_p), ("qkv", Linear),
                ("o", Linear), ("w13", Linear), ("w2", Linear), ("k", c_void_p), ("v", c_void_p),
                ("ks", c_void_p), ("vs", c_void_p)]


class Model(ctypes.Structure):
    _fields_ = [(name, c_int64) for name in ("n_layer", "dim", "n_head", "n_kv_head", "head_dim", "hidden", "slots",
                                             "window", "vb")] + \
               [("eps", c_float), ("embed", c_void_p), ("norm", c_void_p), ("freqs", c_void_p), ("out", Linear),
                ("layers", POINTER(Layer)), ("kernels", c_void_p * 5)]


_lib: Optional[ctypes.CDLL] = None


def build() -> ctypes.CDLL:
    """The step's shared library (AVX2 and FMA, which every kernel set has), from the kernels' cache when built."""
    global _lib
    if _lib is None:
        flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
        _lib = ctypes.CDLL(str(cpu_gemv.compile_once(cpu_gemv.PRELUDE + STEP, flags)))
        _lib.decode_step.argtypes = [POINTER(Model), c_int64, c_int64, c_void_p]
        _lib.greedy.argtypes, _lib.greedy.restype = [c_void_p, c_int64], c_int64
        _lib.decode_greedy.argtypes = [POINTER(Model), c_int64, c_int64, c_int64, c_void_p, c_void_p, c_int64,
                                       c_void_p, c_int64]
        _lib.decode_greedy.restype = c_int64
    return _lib


def linear(m, n: int, k: int) -> Optional[Linear]:
    """m (a layer of cpu_gemv's taking a k-long input to n outputs) as the step's Linear, or None."""
    w = getattr(m, "weight", None)
    if type(m) is cpu_gemv.GemvBf16 and m.gemv and w.shape == (n, k):
        return Linear(0, n, k, 0, w.data_ptr(), None, None)
    if type(m) is cpu_gemv.GemvInt8 and w.shape == (n, k):
        return Linear(1, n, k, 0, w.data_ptr(), m.scales.data_ptr(), None)
    if type(m) is cpu_gemv.GemvInt4 and m.in_features == k and w.size(0) == n:
        kp = 2 * w.size(1)
        return Linear(2, n, kp, kp // m.scales.size(1), w.data_ptr(), m.scales.data_ptr(), m.zeros.data_ptr())
    return None


def bf16(t: Optional[Tensor], *shape) -> bool:
    return t is not None and t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape == shape


class Step:
    """model's batch-1 decode step, bound to its weights and cache: step(cur, input_pos) -> logits [1, V]."""
    def __init__(self, model: Transformer, model_struct: Model, layers):
        # the pointers in model_struct are the model's tensors as they were (see step): no reference is kept to
        # them, so that setup_caches can free an old cache before it allocates the new one
        self.model, self.struct, self.layers = model, model_struct, layers
        self.logits = torch.empty(1, model.args.vocab_size)
        self.lib = build()

    def check(self, token: int, pos: int, n: int = 1):
        if not (0 <= token < self.logits.size(1) and 0 <= pos and pos + n <= self.model.max_seq_length):
            raise ValueError(f"token {token} at positions {pos}..{pos + n - 1}: outside the model's "
                             f"{self.logits.size(1)} tokens or its cache's {self.model.max_seq_length} positions")

    def __call__(self, cur: Tensor, input_pos: Tensor) -> Tensor:  # cur [1, 1], input_pos [1]
        """The logits [1, V] float32, in the step's own buffer, which the next call rewrites (no allocation a step:
        a new 128 KB tensor cost ~0.07 ms of page faults every step on a 2-core Zen 4 VM)."""
        token, pos = int(cur), int(input_pos)
        self.check(token, pos)
        self.lib.decode_step(ctypes.byref(self.struct), token, pos, self.logits.data_ptr())
        return self.logits

    def greedy(self, cur: Tensor, input_pos: Tensor) -> int:
        """The step's greedy token, as generate.sample picks it at temperature 0 (-1: a logit is not finite)."""
        self(cur, input_pos)
        return self.lib.greedy(self.logits.data_ptr(), self.logits.size(1))

    def greedy_loop(self, token: int, pos: int, out: Tensor, eos: Optional[Tensor]) -> int:
        """Greedy decoding from token at slot pos into out [n] int64, a step a token, each fed the last pick: until
        out is full, an id of eos [E] or -1 (a logit not finite; see greedy). Returns the tokens written."""
        assert out.dtype == torch.int64 and out.dim() == 1 and out.is_contiguous()
        self.check(token, pos, out.numel())
        eos = torch.empty(0, dtype=torch.int64) if eos is None else eos.to(torch.int64).contiguous()
        return self.lib.decode_greedy(ctypes.byref(self.struct), token, pos, out.numel(), out.data_ptr(),
                                      eos.data_ptr(), eos.numel(), self.logits.data_ptr(), self.logits.size(1))


def step_for(model: Transformer) -> Optional[Step]:
    """The C++ step for model as it is now, or None where it cannot run it exactly."""
    a = model.args
    D, kvn, qn = a.head_dim, a.n_kv_head * a.head_dim, a.n_head * a.head_dim
    if cpu_gemv._lib is None or type(model) is not Transformer or model.freqs_cis is None:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return None
    if a.dim % 16 or a.intermediate_size % 16 or qn % 16 or not bf16(model.tok_embeddings.weight, a.vocab_size, a.dim):
        return None
    layers = []
    for b in model.layers:
        att, ff = b.attention, b.feed_forward
        norms = (b.attention_norm, b.ffn_norm)
        if type(b) is not TransformerBlock or type(att) is not Attention or type(ff) is not GateUp or \
                att.sdpa is not cpu_gemv.sdpa or \
                any(type(n) is not RMSNorm or n.eps != a.norm_eps or not bf16(n.weight, a.dim) for n in norms):
            return None
        cache = att.kv_cache
        int8 = cache.k_scale is not None
        # the kernels' head sizes (see cpu_gemv.sdpa and sdpa_int8); the int8 cache's V scales per 32 values
        if D not in ((64, 128, 256) if int8 else (16, 32, 64, 128, 256)) or \
                (int8 and cache.v_scale.size(-1) != D // 32) or not cache.k_cache.is_contiguous():
            return None
        if not int8 and cache.k_cache.dtype != torch.bfloat16:
            return None
        if att.bqkv is not None and not bf16(att.bqkv, qn + 2 * kvn):
            return None
        products = [linear(att.wqkv, qn + 2 * kvn, a.dim), linear(att.wo, a.dim, qn),
                    linear(ff.w13, 2 * a.intermediate_size, a.dim), linear(ff.w2, a.dim, a.intermediate_size)]
        if None in products:
            return None
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        layers.append(Layer(b.attention_norm.weight.data_ptr(), b.ffn_norm.weight.data_ptr(), ptr(att.bqkv),
                            *products, cache.k_cache.data_ptr(), cache.v_cache.data_ptr(), ptr(cache.k_scale),
                            ptr(cache.v_scale)))
    out = linear(model.output, a.vocab_size, a.dim)
    if out is None or not model.output.f32 or not bf16(model.norm.weight, a.dim) or type(model.norm) is not RMSNorm \
            or model.norm.eps != a.norm_eps:
        return None
    freqs = model.freqs_cis
    if freqs.dtype != torch.float32 or not freqs.is_contiguous() or freqs.shape[1:] != (D // 2, 2):
        return None
    array = (Layer * len(layers))(*layers)
    slots = model.layers[0].attention.kv_cache.k_cache.size(2)
    vb = D // 32 if model.layers[0].attention.kv_cache.k_scale is not None else 0
    kernels = [ctypes.cast(getattr(cpu_gemv._lib, n), c_void_p)
               for n in ("gemv_bf16", "gemv_int8", "gemv_int4", "attend", "attend_int8")]
    struct = Model(a.n_layer, a.dim, a.n_head, a.n_kv_head, D, a.intermediate_size, slots, a.sliding_window, vb,
                   a.norm_eps, model.tok_embeddings.weight.data_ptr(), model.norm.weight.data_ptr(),
                   freqs.data_ptr(), out, array, (c_void_p * 5)(*kernels))
    return Step(model, struct, array)


def step(model: Transformer, loop: Tensor) -> Optional[Step]:
    """step_for(model), built once per decode loop (loop: the input_pos tensor each loop of generate makes anew, and
    steps in place): the model may change between loops (a new cache from setup_caches, other layers or weights),
    not within one. Building it walks the model's layers, about a millisecond."""
    cached = model.__dict__.get("_cpu_step")
    if cached is None or cached[0] is not loop:  # the loop's tensor is held here: no new one can take its id
        cached = (loop, step_for(model))
        model.__dict__["_cpu_step"] = cached
    return cached[1]
