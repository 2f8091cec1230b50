"""A Llama-architecture decoder in one file that needs only torch: RMSNorm, RoPE, grouped-query attention, SwiGLU,
and a static KV cache updated in place so that torch.compile and CUDA graphs can replay every decode step."""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = -1  # -1: one KV head per query head (MHA); 1 is MQA, in between is GQA
    dim: int = 4096
    head_dim: int = -1  # -1: dim // n_head
    intermediate_size: int = -1  # -1: Llama's rule
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3.1: factor, low_/high_freq_factor, original_max_position_embeddings
    norm_eps: float = 1e-5
    block_size: int = 2048  # the longest context the model takes: the RoPE table and any cache stop here
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q, k and v projections add a bias (o_proj does not)
    sliding_window: int = 0  # 0: none; else token i attends to positions i - sliding_window < j <= i (Mistral)

    def __post_init__(self):
        self.n_kv_head = self.n_head if self.n_kv_head == -1 else self.n_kv_head
        self.head_dim = self.dim // self.n_head if self.head_dim == -1 else self.head_dim
        if self.intermediate_size == -1:  # Llama's rule: 2/3 of 4 * dim, rounded up to a multiple of 256
            self.intermediate_size = 256 * math.ceil(8 * self.dim // 3 / 256)
        sizes = (self.vocab_size, self.n_layer, self.n_head, self.n_kv_head, self.dim, self.head_dim,
                 self.intermediate_size, self.block_size)
        if min(sizes) < 1 or self.sliding_window < 0:
            raise ValueError(f"model sizes must be positive, and sliding_window 0 (none) or positive: {self}")
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


_llama3 = dict(n_kv_head=8, vocab_size=128256, rope_base=500000.0, block_size=8192)
_llama31 = dict(_llama3, block_size=131072, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                               original_max_position_embeddings=8192))
_llama32 = dict(_llama31, rope_scaling=dict(_llama31["rope_scaling"], factor=32.0), intermediate_size=8192,
                tie_embeddings=True)
transformer_configs = {
    "Llama-2-7b": dict(n_layer=32, n_head=32, dim=4096, block_size=4096),
    "Llama-2-13b": dict(n_layer=40, n_head=40, dim=5120, block_size=4096),
    "Llama-2-70b": dict(n_layer=80, n_head=64, n_kv_head=8, dim=8192, intermediate_size=28672, block_size=4096),
    "CodeLlama-7b": dict(n_layer=32, n_head=32, dim=4096, vocab_size=32016, rope_base=1e6, block_size=16384),
    "CodeLlama-34b": dict(n_layer=48, n_head=64, n_kv_head=8, dim=8192, intermediate_size=22016, rope_base=1e6,
                          block_size=16384),
    "Mistral-7B": dict(n_layer=32, n_head=32, n_kv_head=8, dim=4096, intermediate_size=14336, block_size=4096),
    "Llama-3-8B": dict(_llama3, n_layer=32, n_head=32, dim=4096, intermediate_size=14336),
    "Llama-3-70B": dict(_llama3, n_layer=80, n_head=64, dim=8192, intermediate_size=28672),
    "Llama-3.1-8B": dict(_llama31, n_layer=32, n_head=32, dim=4096, intermediate_size=14336),
    "Llama-3.1-70B": dict(_llama31, n_layer=80, n_head=64, dim=8192, intermediate_size=28672),
    "Llama-3.1-405B": dict(_llama31, n_layer=126, n_head=128, dim=16384, intermediate_size=53248),
    "Llama-3.2-1B": dict(_llama32, n_layer=16, n_head=32, dim=2048, head_dim=64),
    "Llama-3.2-3B": dict(_llama32, n_layer=28, n_head=24, dim=3072, head_dim=128),
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


@dataclass
class Context:
    """One pass through a cache: RoPE positions pos [B|1, S]; slots for the new K and V ([S], or [B, S] in a pool);
    mask [B|1, 1, S, L], the slots each token sees; a pool's layer views and block table [B, W]; last logits only."""
    pos: Tensor
    slots: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    caches: Optional[list] = None
    table: Optional[Tensor] = None
    last: bool = False


class KVCache(nn.Module):
    """K and V [max_batch_size, n_kv_head, max_seq_length + 1, head_dim], written in place at fixed addresses (a CUDA
    graph replays a step). int8: a key per head, a value per 32 dimensions, rounded with a float32 scale, half of
    bf16's bytes. zeros(shape, dtype=, device=) allocates; sdpa, sdpa_int8 attend (a kernel subclass has its own)."""
    sdpa = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, max_batch_size: int, n_kv_head: int, max_seq_length: int, head_dim: int, dtype, device,
                 zeros=torch.zeros):
        super().__init__()
        # one spare slot, never read: attention reads a slice of the cache, and were a slice ever the whole buffer
        # it would be contiguous where the others are not, and torch.compile would compile that case again
        shape = (max_batch_size, n_kv_head, max_seq_length + 1, head_dim)
        self.register_buffer("k_cache", zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", zeros(shape, dtype=dtype, device=device), persistent=False)
        scales = lambda n: torch.zeros(*shape[:-1], n, device=device) if dtype == torch.int8 else None  # noqa: E731
        self.register_buffer("k_scale", scales(1), persistent=False)
        self.register_buffer("v_scale", scales(head_dim // 32 if head_dim % 32 == 0 else 1), persistent=False)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> Tensor:  # q [B, H, S, D], k/v [B, H_kv, S, D]
        """Write the new K and V at ctx.slots; attention over the first L slots as ctx.mask says -> [B, H, S, D]"""
        B, L, gqa = k.size(0), ctx.mask.size(-1), q.size(1) != k.size(1)
        held, new, sdpa = (self.k_cache, self.v_cache), (k, v), self.sdpa
        if self.k_scale is not None:
            held, sdpa = (self.k_cache, self.k_scale, self.v_cache, self.v_scale), self.sdpa_int8
            new = (*quantize_rows(k, k.size(-1)), *quantize_rows(v, v.size(-1) // self.v_scale.size(-1)))
        for t, x in zip(held, new):
            t[:B, :, ctx.slots] = x
        return sdpa(q, *(t[:B, :, :L] for t in held), attn_mask=ctx.mask, enable_gqa=gqa)

    @staticmethod
    def sdpa_int8(q: Tensor, k: Tensor, k_scale: Tensor, v: Tensor, v_scale: Tensor, attn_mask: Tensor,
                  enable_gqa: bool) -> Tensor:  # q [B, H, S, D]; k, v [B, H_kv, L, D] int8, scales [B, H_kv, L, n]
        """Attention over an int8 cache: dequantized to q's dtype, then SDPA."""
        k, v = dequantize_rows(k, k_scale, q.dtype), dequantize_rows(v, v_scale, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        # one fused matmul for q, k and v: a single pass over the input instead of three
        qkv_rows = (args.n_head + 2 * args.n_kv_head) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_rows, bias=False)
        # Qwen2's bias, in wqkv's row order, apart from the Linear: layers replacing it need no bias; it stays float
        self.register_parameter("bqkv", nn.Parameter(torch.zeros(qkv_rows)) if args.qkv_bias else None)
        self.wo = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, freqs_cis: Tensor, ctx: Context, cache=None) -> Tensor:
        B, S, _ = x.shape  # x [B, S, dim]; cache: a KVCache or a paged pool's view, None for no cache
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        qkv = self.wqkv(x) if self.bqkv is None else self.wqkv(x) + self.bqkv  # [B, S, q_size + 2 * kv_size]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb(q.view(B, S, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(B, S, self.n_kv_head, self.head_dim), freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        if cache is not None:
            y = cache.attend(q, k, v, ctx)
        else:  # several query heads share a KV head, without copying it; is_causal lets SDPA pick its fused kernels
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, is_causal=ctx.mask is None,
                                               enable_gqa=self.n_head != self.n_kv_head)
        return self.wo(y.transpose(1, 2).reshape(B, S, q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # the gate's rows, then the up projection's, in one matmul as in wqkv (files keep w1 and w3; loading joins)
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

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

    def forward(self, x: Tensor, freqs_cis: Tensor, ctx: Context, cache=None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, ctx, cache)
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
        self.cache_zeros = torch.zeros  # the KV cache's allocator; a loader may give one of its own
        self.cache_type = KVCache  # and its attention: a kernel module gives a subclass (cpu_gemv.KernelCache)

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
            a = self.args
            for layer in self.layers:
                layer.attention.kv_cache = self.cache_type(max_batch_size, a.n_kv_head, max_seq_length, a.head_dim,
                                                           self.kv_dtype or dtype, device, self.cache_zeros)
            self.freqs_cis = precompute_freqs_cis(max_seq_length, a.head_dim, a.rope_base, a.rope_scaling, device)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length

    def forward(self, idx: Tensor, ctx: Optional[Context] = None) -> Tensor:
        """idx [B, S] token ids -> logits [B, S|1, vocab]. With ctx, through a cache: the model's own, or ctx.caches.
        Without, causal (and sliding-window) attention over idx alone, no cache touched (training, perplexity)."""
        if ctx is None:  # is_causal (mask None) lets SDPA pick its fused kernels: a mask only where a window cuts
            S, a = idx.size(1), self.args
            ctx = Context(None, mask=self.cache_mask(torch.arange(S, device=idx.device), None, S)
                          if 0 < a.sliding_window < S else None)
            freqs_cis = precompute_freqs_cis(S, a.head_dim, a.rope_base, a.rope_scaling, idx.device)[None]
            caches = [None] * len(self.layers)
        elif self.freqs_cis is None:
            raise RuntimeError("decoding through a cache needs the RoPE table: call model.setup_caches first")
        else:
            freqs_cis, caches = self.freqs_cis[ctx.pos], ctx.caches or [b.attention.kv_cache for b in self.layers]
        x = self.tok_embeddings(idx)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, freqs_cis, ctx, cache)
        return self.output(self.norm(x[:, -1:] if ctx.last else x))

    def context(self, input_pos: Tensor, left_pad: Optional[Tensor] = None, kv_len: Optional[int] = None,
                mask: Optional[Tensor] = None, pos: Optional[Tensor] = None, last: bool = False) -> Context:
        """The pass for tokens at slots input_pos [S] of the model's cache. left_pad [B]: each row's leading pads,
        masked and shifting its RoPE positions (it sees what it would alone). kv_len > every slot: read only that
        many (kv_bucket). A tree: mask [B|1, S, kv_len] bool, the slots each node sees, and pos [B|1, S]."""
        rope = torch.atleast_2d(input_pos if pos is None else pos)  # [B|1, S]
        rope = rope if left_pad is None else (rope - left_pad[:, None]).clamp(min=0)
        mask = self.cache_mask(input_pos, left_pad, kv_len or self.max_seq_length) if mask is None \
            else mask.view(-1, 1, *mask.shape[-2:])  # [B|1, 1, S, kv_len]
        return Context(rope, input_pos, mask, last=last)

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
    """The kv_len for a step whose positions are all below n: the next power of two (at least 256), capped: a short
    context reads few slots, and a compiled step sees log2(max_seq_length / 256) lengths (CUDA graphs a few times)."""
    return min(max_seq_length, max(256, 1 << (n - 1).bit_length()))
