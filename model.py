"""A Llama-architecture decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU, and a
static KV cache that is updated in place so torch.compile and CUDA graphs can replay every decode step.
cpu_step.py repeats this forward for one token in C++ (batch-1 decoding on a CPU): a change to the arithmetic here
needs the same change there, which tests/test_cpu_step.py checks by comparing the two."""
import math
import mmap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = -1  # -1: one KV head per query head (MHA); 1 is MQA, in between is GQA
    dim: int = 4096
    head_dim: int = -1  # -1: dim // n_head
    intermediate_size: int = -1  # -1: Llama's rule, 2/3 of 4*dim rounded up to a multiple of 256
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3.1 style: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    norm_eps: float = 1e-5
    block_size: int = 2048  # the longest context the model takes: the RoPE table and any cache stop here
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q, k and v projections add a bias (o_proj does not)
    sliding_window: int = 0  # 0: none; else token i attends to positions i - sliding_window < j <= i (Mistral)

    def __post_init__(self):
        if self.n_kv_head == -1:
            self.n_kv_head = self.n_head
        if self.head_dim == -1:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size == -1:
            self.intermediate_size = find_multiple(int(2 * 4 * self.dim / 3), 256)
        sizes = (self.vocab_size, self.n_layer, self.n_head, self.n_kv_head, self.dim, self.head_dim,
                 self.intermediate_size, self.block_size)
        if min(sizes) < 1:
            raise ValueError(f"model sizes must be positive: {self}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window {self.sliding_window} must be 0 (none) or positive")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """A named config, or the longest one whose name a checkpoint name contains ("meta-llama/Llama-2-7b-chat-hf")."""
        hits = [k for k in transformer_configs if k.lower() in name.lower()]
        if not hits:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(transformer_configs)}")
        return cls(**transformer_configs[max(hits, key=len)])

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        """Any Hugging Face config.json (transformers 4 or 5 layout) of the Llama layout, whatever its model_type:
        SiLU, RMSNorm, RoPE, and at most one sliding window shared by every layer (Mistral). qkv_bias (Qwen2) is not
        a config field there: the converter reads it from the weights."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only SiLU, as in Llama)")
        if cfg.get("attention_bias"):  # every transformers model with this flag puts a bias on o_proj too
            raise ValueError("attention_bias: o_proj biases are not supported (q/k/v biases, as in Qwen2, are)")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        # fields that rescale what the same tensors compute (Granite's multipliers, Gemma-2's soft caps, SmolLM3's
        # layers without RoPE): the weights would load and the model would silently compute something else
        odd = [k for k, v in cfg.items() if v is not None and (k.startswith("no_rope") or k.endswith(
               ("_multiplier", "_softcapping", "logits_scaling")))]
        if odd:
            raise ValueError(f"config field {odd[0]} changes what the weights compute; not part of the Llama layout")
        missing = [k for k in ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size")
                   if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        rope = cfg.get("rope_parameters") or {}  # transformers 5 nests rope_theta and the scaling here
        scaling = cfg.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported (only Llama-3.1 'llama3')")
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        n_head, n_layer = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None and cfg.get("use_sliding_window") and "max_window_layers" in cfg:  # Qwen2's older layout
            types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention" for i in range(n_layer)]
        kinds = set(types or ())
        if len(kinds) > 1:
            raise ValueError(f"layers mix {' and '.join(sorted(kinds))}; only one attention kind for every layer "
                             f"is supported")
        if kinds - {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types {kinds.pop()!r} is not supported (full_attention or sliding_attention)")
        # Qwen2 sets sliding_window but slides only with use_sliding_window; layer_types, where given, decides
        slides = cfg.get("use_sliding_window") is not False and kinds != {"full_attention"}
        window = cfg.get("sliding_window") if slides else 0
        return cls(
            vocab_size=cfg["vocab_size"], n_layer=n_layer, n_head=n_head,
            n_kv_head=cfg.get("num_key_value_heads") or n_head, dim=cfg["hidden_size"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head, intermediate_size=cfg["intermediate_size"],
            rope_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling={k: scaling[k] for k in keys} if rope_type == "llama3" else None,
            norm_eps=cfg.get("rms_norm_eps", 1e-6), block_size=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_window=window or 0)  # null: none


_llama31_scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_llama32_scaling = dict(_llama31_scaling, factor=32.0)
transformer_configs = {
    "Llama-2-7b": dict(n_layer=32, n_head=32, dim=4096, block_size=4096),
    "Llama-2-13b": dict(n_layer=40, n_head=40, dim=5120, block_size=4096),
    "Llama-2-70b": dict(n_layer=80, n_head=64, n_kv_head=8, dim=8192, intermediate_size=28672, block_size=4096),
    "CodeLlama-7b": dict(n_layer=32, n_head=32, dim=4096, vocab_size=32016, rope_base=1e6, block_size=16384),
    "CodeLlama-34b": dict(n_layer=48, n_head=64, n_kv_head=8, dim=8192, intermediate_size=22016, rope_base=1e6,
                          block_size=16384),
    "Mistral-7B": dict(n_layer=32, n_head=32, n_kv_head=8, dim=4096, intermediate_size=14336, block_size=4096),
    "Llama-3-8B": dict(n_layer=32, n_head=32, n_kv_head=8, dim=4096, intermediate_size=14336, vocab_size=128256,
                       rope_base=500000.0, block_size=8192),
    "Llama-3-70B": dict(n_layer=80, n_head=64, n_kv_head=8, dim=8192, intermediate_size=28672, vocab_size=128256,
                        rope_base=500000.0, block_size=8192),
    "Llama-3.1-8B": dict(n_layer=32, n_head=32, n_kv_head=8, dim=4096, intermediate_size=14336, vocab_size=128256,
                         rope_base=500000.0, block_size=131072, rope_scaling=_llama31_scaling),
    "Llama-3.1-70B": dict(n_layer=80, n_head=64, n_kv_head=8, dim=8192, intermediate_size=28672, vocab_size=128256,
                          rope_base=500000.0, block_size=131072, rope_scaling=_llama31_scaling),
    "Llama-3.1-405B": dict(n_layer=126, n_head=128, n_kv_head=8, dim=16384, intermediate_size=53248, vocab_size=128256,
                           rope_base=500000.0, block_size=131072, rope_scaling=_llama31_scaling),
    "Llama-3.2-1B": dict(n_layer=16, n_head=32, n_kv_head=8, dim=2048, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, rope_base=500000.0, block_size=131072, rope_scaling=_llama32_scaling,
                         tie_embeddings=True),
    "Llama-3.2-3B": dict(n_layer=28, n_head=24, n_kv_head=8, dim=3072, head_dim=128, intermediate_size=8192,
                         vocab_size=128256, rope_base=500000.0, block_size=131072, rope_scaling=_llama32_scaling,
                         tie_embeddings=True),
    "TinyLlama-1.1B": dict(n_layer=22, n_head=32, n_kv_head=4, dim=2048, intermediate_size=5632),
}


def precompute_freqs_cis(seq_len: int, head_dim: int, base: float, scaling: Optional[dict] = None,
                         device=None) -> Tensor:  # -> [seq_len, head_dim // 2, 2] (cos, sin), float32
    freqs = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling:  # Llama-3.1: slow the low frequencies down by `factor`, keep the high ones, blend in between
        old_len, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / freqs
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        freqs = (1 - smooth) * freqs / factor + smooth * freqs
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:  # x [B, S, H, D], freqs_cis [B|1, S, D/2, 2]
    # rotate in float32: cos/sin at large positions need more precision than bf16 has
    xs = x.float().unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2]: interleaved pairs, Meta's layout
    cos, sin = freqs_cis[:, :, None, :, 0], freqs_cis[:, :, None, :, 1]
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], dim=-1)
    return out.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # the mean of squares overflows or loses precision in 16-bit
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def quantize_rows(x: Tensor, block: int) -> tuple[Tensor, Tensor]:  # x [..., D] -> int8 [..., D], scales [..., D/block]
    xb = x.float().unflatten(-1, (-1, block))
    scale = xb.abs().amax(-1) / 127
    return (xb / scale.clamp(min=1e-30)[..., None]).round().to(torch.int8).flatten(-2), scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype) -> Tensor:  # int8 [..., D], float32 [..., n] -> [..., D]
    return (q.float().unflatten(-1, (scale.size(-1), -1)) * scale[..., None]).flatten(-2).to(dtype)


def cache_zeros(shape: tuple, dtype: torch.dtype, device) -> Tensor:
    """Zeros for the KV cache. On CPU, a cache tensor of 2 MB or more lies in 2 MB pages where Linux grants them
    (transparent huge pages, asked for with madvise): a decode step reads the whole cache, and in 4 KB pages every
    4 KB of it misses the TLB and stops the prefetchers (attention over 4096 positions x 22 layers from memory on a
    Zen 4: 0.88-0.96x the time). Only whole 2 MB pages are asked for, so the tail takes no more memory than it holds."""
    n = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or n < 2 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # private anonymous memory reads as zeros (a shared mapping would be shmem, which THP leaves alone); the tensor
    # keeps the mapping alive
    buf = mmap.mmap(-1, n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    start = -t.data_ptr() % (2 << 20)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, n // (2 << 20) * (2 << 20))
    except OSError:  # a kernel without transparent huge pages: 4 KB pages, as torch.zeros would give
        pass
    return t[start:start + n].view(dtype).view(shape)


class KVCache(nn.Module):
    def __init__(self, max_batch_size: int, n_kv_head: int, max_seq_length: int, head_dim: int, dtype, device):
        """dtype torch.int8: each position's key per head rounded to int8 with one float32 scale, its value with
        one per 32 dimensions (values have a few large dimensions), about half the bytes of bf16 to store and read."""
        super().__init__()
        # one spare slot, never read: attention reads a slice of the cache, and were a slice ever the whole buffer
        # it would be contiguous where the others are not, and torch.compile would compile that case again
        shape = (max_batch_size, n_kv_head, max_seq_length + 1, head_dim)
        self.register_buffer("k_cache", cache_zeros(shape, dtype, device), persistent=False)
        self.register_buffer("v_cache", cache_zeros(shape, dtype, device), persistent=False)
        int8 = dtype == torch.int8
        self.register_buffer("k_scale", torch.zeros(*shape[:-1], 1, device=device) if int8 else None, persistent=False)
        blocks = head_dim // 32 if head_dim % 32 == 0 else 1
        self.register_buffer("v_scale", torch.zeros(*shape[:-1], blocks, device=device) if int8 else None,
                             persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:  # input_pos [S], k/v [B, H_kv, S, D]
        """-> k, v [B, H_kv, max_seq_length + 1, D]; int8: k, k_scale [..., 1], v, v_scale [..., D / 32 (or 1)]"""
        # written in place at fixed addresses: the step's shapes never change, so a CUDA graph can replay it
        if self.k_scale is None:
            out, new = (self.k_cache, self.v_cache), (k, v)
        else:
            (k, ks), (v, vs) = quantize_rows(k, k.size(-1)), quantize_rows(v, v.size(-1) // self.v_scale.size(-1))
            out, new = (self.k_cache, self.k_scale, self.v_cache, self.v_scale), (k, ks, v, vs)
        out = [t[: k.size(0)] for t in out]
        for t, x in zip(out, new):
            t[:, :, input_pos] = x
        return tuple(out)


def sdpa_int8(q: Tensor, k: Tensor, k_scale: Tensor, v: Tensor, v_scale: Tensor, attn_mask: Tensor,
              enable_gqa: bool) -> Tensor:  # q [B, H, S, D]; k, v [B, H_kv, L, D] int8, scales [B, H_kv, L, n]
    """Attention over an int8 cache: dequantized to q's dtype, then SDPA (a kernel may take its place, see
    cpu_gemv.py)."""
    k, v = dequantize_rows(k, k_scale, q.dtype), dequantize_rows(v, v_scale, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        # one fused matmul for q, k and v: a single pass over the input instead of three
        qkv_rows = (args.n_head + 2 * args.n_kv_head) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_rows, bias=False)
        # the bias (Qwen2) is a parameter of its own, rows in wqkv's order, not the Linear's: the quantized and
        # kernel layers that replace nn.Linear then need no bias support, and it stays float
        self.register_parameter("bqkv", nn.Parameter(torch.zeros(qkv_rows)) if args.qkv_bias else None)
        self.wo = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None
        self.sdpa = F.scaled_dot_product_attention  # a kernel for decoding may take its place (see cpu_gemv.py)
        self.sdpa_int8 = sdpa_int8

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Optional[Tensor], input_pos: Optional[Tensor]) -> Tensor:
        B, S, _ = x.shape  # x [B, S, dim]; mask [B|1, 1, S, L <= max_seq_length] or None for plain causal
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        qkv = self.wqkv(x) if self.bqkv is None else self.wqkv(x) + self.bqkv  # [B, S, q_size + 2 * kv_size]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb(q.view(B, S, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(B, S, self.n_kv_head, self.head_dim), freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        gqa = self.n_head != self.n_kv_head  # several query heads share a KV head, without copying the cache
        if input_pos is None:
            y = self.sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        else:
            # read only the first L slots, those the mask covers: a short context in a long cache costs what it
            # would in a short cache, instead of streaming every allocated slot each step
            cache = [t[:, :, : mask.size(-1)] for t in self.kv_cache.update(input_pos, k, v)]
            y = self.sdpa(q, *cache, attn_mask=mask, enable_gqa=gqa) if len(cache) == 2 else \
                self.sdpa_int8(q, *cache, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, S, q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GateUp(nn.Module):
    """FeedForward with the gate and up layers joined into one, w13 (the gate's outputs, then the up's): one product
    and one pass over both weights where there were two. The kernel files (cpu_gemv.py, cuda_gemv.py) put it in."""
    def __init__(self, w13: nn.Module, w2: nn.Module):
        super().__init__()
        self.w13, self.w2 = w13, w2

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Optional[Tensor], input_pos: Optional[Tensor]) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", None, persistent=False)
        self.max_batch_size = self.max_seq_length = 0
        self.kv_dtype: Optional[torch.dtype] = None  # the cache's dtype; None: the model's

    def setup_caches(self, max_batch_size: int, max_seq_length: int, kv_dtype: Optional[torch.dtype] = None):
        """Preallocate the KV cache and the RoPE table once; calling again with new sizes replaces both.
        kv_dtype: torch.int8 for an int8 cache (see KVCache); None keeps the last call's choice."""
        if not 0 < max_seq_length <= self.args.block_size:
            raise ValueError(f"max_seq_length {max_seq_length} is outside the model's 1..{self.args.block_size}")
        self.kv_dtype = kv_dtype or self.kv_dtype
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        for layer in self.layers:
            layer.attention.kv_cache = None  # free the old cache before allocating the new one
        # plain tensors even when called under inference_mode (as generate() does): the cache outlives the call,
        # and an inference tensor could not be written outside one
        with torch.inference_mode(False):
            for layer in self.layers:
                layer.attention.kv_cache = KVCache(max_batch_size, self.args.n_kv_head, max_seq_length,
                                                   self.args.head_dim, self.kv_dtype or dtype, device)
            self.freqs_cis = precompute_freqs_cis(max_seq_length, self.args.head_dim, self.args.rope_base,
                                                  self.args.rope_scaling, device)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length

    def forward(self, idx: Tensor, input_pos: Optional[Tensor] = None, left_pad: Optional[Tensor] = None,
                kv_len: Optional[int] = None, last: bool = False, tree_mask: Optional[Tensor] = None,
                tree_pos: Optional[Tensor] = None) -> Tensor:
        """idx [B, S] token ids -> logits [B, S, vocab].

        With input_pos [S] (cache slots), attend through the KV cache; left_pad [B] counts each row's leading pad
        tokens, which are masked out and shift that row's RoPE positions so it sees exactly what it would alone.
        kv_len, if given, must exceed every position in input_pos: attention then reads only the first kv_len
        cache slots (see kv_bucket). The default is the whole cache.
        Without input_pos, run causal (and sliding-window) attention over idx and touch no cache (training,
        perplexity). last: the logits of the last position only, [B, 1, vocab] (prefill needs no others).
        tree_mask [S, kv_len] bool and tree_pos [S] (a token tree, batch 1; see trees.py): the cache slots each token
        sees and its RoPE position, in place of the causal mask and input_pos; the tokens are still written at
        input_pos."""
        if input_pos is None:
            S = idx.size(1)
            freqs_cis = precompute_freqs_cis(S, self.args.head_dim, self.args.rope_base, self.args.rope_scaling,
                                             idx.device)[None]
            # is_causal (mask None) lets SDPA pick its fused kernels; a mask only where the window cuts something
            cut = 0 < self.args.sliding_window < S
            mask = self.cache_mask(torch.arange(S, device=idx.device), None, S) if cut else None  # [1, 1, S, S]
        else:
            if self.freqs_cis is None:
                raise RuntimeError("decoding with input_pos needs the KV cache: call model.setup_caches first")
            pos = input_pos if tree_pos is None else tree_pos
            pos = pos[None] if left_pad is None else (pos[None] - left_pad[:, None]).clamp(min=0)
            freqs_cis = self.freqs_cis[pos]  # [B|1, S, D/2, 2]
            mask = self.cache_mask(input_pos, left_pad, kv_len or self.max_seq_length) if tree_mask is None \
                else tree_mask[None, None]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, freqs_cis, mask, input_pos)
        return self.output(self.norm(x[:, -1:] if last else x))

    def cache_mask(self, input_pos: Tensor, left_pad: Optional[Tensor], kv_len: int) -> Tensor:  # -> [B|1, 1, S, kv_len]
        # built from input_pos each call rather than sliced from an [L, L] table: that table is 17 GB at L = 128k
        slots = torch.arange(kv_len, device=input_pos.device)
        mask = slots <= input_pos[:, None]  # [S, L] causal over cache slots
        if self.args.sliding_window:  # every slot stays cached; the window only hides the old ones, so it is exact
            mask = mask & (slots > input_pos[:, None] - self.args.sliding_window)
        if left_pad is not None:
            # hide each row's pad slots; a pad query still sees itself, so no softmax row is empty (that gives NaN)
            mask = mask & ((slots >= left_pad[:, None, None]) | (slots == input_pos[:, None]))  # [B, S, L]
        return mask[:, None] if mask.dim() == 3 else mask[None, None]


def kv_bucket(n: int, max_seq_length: int) -> int:
    """The kv_len for a step whose positions are all below n: the next power of two (at least 256), capped at the
    cache. A 100-token context in a 32k cache then reads 256 slots per step, and a compiled step sees only
    log2(max_seq_length / 256) lengths, so CUDA graphs are recorded a few times, not once per token."""
    return min(max_seq_length, max(256, 1 << (n - 1).bit_length()))
