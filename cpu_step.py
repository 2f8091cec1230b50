"""A batch-1 decode step on a CPU as one C++ call: model.py's forward for one token, on cpu_gemv.py's kernels.

The compiled step (torch.compile's C++ wrapper) runs the same kernels, but pays a fixed cost every step that a CPU
cannot hide: dynamo's guard check, gathering the graph's inputs, and at each join between products an inductor
kernel and a boxed op call. Here the step is a loop over the layers in C++ (csrc/step.cpp): RMSNorm, RoPE, the
cache write and the SiLU on one thread, the products and the attention on the kernels' threads, scratch kept
between steps, and no Python, allocation or dispatch between them. HOW_IT_WORKS.md, "Batch-1 decoding on a CPU is
one C++ call", has what it saves; scripts/bench_cpu_step.py times the two alternating.

It runs what it can run exactly as model.py does (the same bf16 roundings, the same cache), and says None to the
rest, which then runs model.py's forward (backend.py chooses): batches, left padding, float32 models, torch's
kernels, tensor parallelism (its all-reduces are modules this step does not know). Being a second implementation of that
forward, it checks itself against it when first made for a model (agrees)."""
import sys
from typing import Optional

import torch
from torch import Tensor

import cpu_gemv
from model import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock


def linear(m, n: int, k: int) -> Optional[list[Tensor]]:
    """m (a layer of cpu_gemv's taking a k-long input to n outputs) as the step's product: its tensors, or None."""
    w = getattr(m, "weight", None)
    if type(m) is cpu_gemv.GemvBf16 and m.gemv and w.shape == (n, k):
        return [w]
    if type(m) is cpu_gemv.GemvInt8 and w.shape == (n, k):
        return [w, m.scales]
    if type(m) is cpu_gemv.GemvInt4 and m.in_features == k and w.size(0) == n:
        return [w, m.scales, m.zeros]
    return None


def bf16(t: Optional[Tensor], *shape) -> bool:
    return t is not None and t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape == shape


class Step:
    """model's batch-1 decode step, bound to its weights and cache: step(cur, input_pos) -> logits [1, V]."""
    def __init__(self, model: Transformer, cpp):
        # cpp (csrc/ops.cpp's Step) holds pointers into the model's tensors as they were (see step) and no references,
        # so that setup_caches can free an old cache before it allocates the new one
        self.model, self.cpp = model, cpp
        self.logits, self.many = torch.empty(1, model.args.vocab_size), torch.empty(0, model.args.vocab_size)
        # positions of a prompt a pass: the bf16 and int8 products compute each row as alone for any number of rows,
        # the int4 one off AMX's tiles for up to 32 (more go to a GEMM's tiles)
        int4 = [m for m in model.modules() if type(m) is cpu_gemv.GemvInt4]
        self.piece = 512 if all(map(cpu_gemv.int4_rows_alone, int4)) else 32

    def check(self, token: int, pos: int, n: int = 1):
        if not (0 <= token < self.logits.size(1) and 0 <= pos and pos + n <= self.model.max_seq_length):
            raise ValueError(f"token {token} at positions {pos}..{pos + n - 1}: outside the model's "
                             f"{self.logits.size(1)} tokens or its cache's {self.model.max_seq_length} positions")

    def __call__(self, cur: Tensor, input_pos: Tensor) -> Tensor:  # cur [1, 1], input_pos [1]
        """The logits [1, V] float32, in the step's own buffer, which the next call rewrites (no allocation a step:
        HOW_IT_WORKS.md, "Batch-1 decoding on a CPU is one C++ call")."""
        token, pos = int(cur), int(input_pos)
        self.check(token, pos)
        self.cpp.step(token, pos, self.logits)
        return self.logits

    def greedy(self, cur: Tensor, input_pos: Tensor) -> int:
        """The step's greedy token, as generate.sample picks it at temperature 0 (-1: a logit is not finite); its
        logits are in the step's buffer, as after a call."""
        token, pos = int(cur), int(input_pos)
        self.check(token, pos)
        return self.cpp.step_greedy(token, pos, self.logits)

    def rows(self, tokens: Tensor, pos: Tensor, base: int, mask: Tensor, last: bool = False) -> Tensor:
        """A verify pass: the logits [M, V] float32 of tokens [M] at slots base .. base + M - 1, at RoPE positions pos
        [M], row i attending to the slots mask[i] holds ([M, base + M]); each row as the step computes it alone (the
        kernels are batch-invariant), in a buffer the next call rewrites. last: the last row's alone, [1, V]."""
        M = tokens.numel()
        self.check(int(tokens.min()), base, M)
        self.check(int(tokens.max()), base, M)
        if self.many.size(0) < M:
            self.many = torch.empty(M, self.logits.size(1))
        out = self.logits if last and M > 1 else self.many
        self.cpp.rows(tokens.contiguous(), pos.contiguous(), base, mask.contiguous(), out)
        return out if last and M > 1 else self.many[:M]

    def greedy_loop(self, token: int, pos: int, out: Tensor, eos: Optional[Tensor]) -> int:
        """Greedy decoding from token at slot pos into out [n] int64, a step a token, each fed the last pick: until
        out is full, an id of eos [E] or -1 (a logit not finite; see greedy). Returns the tokens written."""
        assert out.dtype == torch.int64 and out.dim() == 1 and out.is_contiguous()
        self.check(token, pos, out.numel())
        eos = torch.empty(0, dtype=torch.int64) if eos is None else eos.to(torch.int64).contiguous()
        return self.cpp.greedy_loop(token, pos, out, eos, self.logits)


def step_for(model: Transformer, verify: bool = True) -> Optional[Step]:
    """The C++ step for model as it is now, or None where it cannot run it exactly. verify: check it against
    model.py's forward first (agrees); the caller that keeps it checks once a model."""
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
        if type(b) is not TransformerBlock or type(att) is not Attention or type(ff) is not FeedForward or \
                type(att.kv_cache) is not cpu_gemv.KernelCache or \
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
        layers.append((b.attention_norm.weight, b.ffn_norm.weight, att.bqkv, *products, cache.k_cache,
                       cache.v_cache, cache.k_scale, cache.v_scale))
    out = linear(model.output, a.vocab_size, a.dim)
    if out is None or not model.output.f32 or not bf16(model.norm.weight, a.dim) or type(model.norm) is not RMSNorm \
            or model.norm.eps != a.norm_eps:
        return None
    freqs = model.freqs_cis
    if freqs.dtype != torch.float32 or not freqs.is_contiguous() or freqs.shape[1:] != (D // 2, 2):
        return None
    if verify and not agrees(model, cpp_step(model, layers[:1], out)):
        return None
    return Step(model, cpp_step(model, layers, out))


def cpp_step(model: Transformer, layers: list, out: list[Tensor]):
    """csrc/ops.cpp's Step over the given layers' tensors (step_for's), with model's embedding, norm and head."""
    a = model.args
    cpp = torch.classes.fast_decode.Step(model.tok_embeddings.weight, model.norm.weight, model.freqs_cis, out,
                                         a.n_head, a.n_kv_head, a.sliding_window or 0, a.norm_eps)
    for layer in layers:
        cpp.add_layer(*layer)
    return cpp


TOLERANCE = 0.1  # of what the layer changes in the logits: bf16 roundings in another order stay well below it


@torch.no_grad()
def agrees(model: Transformer, cpp, token: int = 1) -> bool:
    """Whether the C++ step (cpp, over the first layer only) gives the logits model.py's forward gives over that
    layer, for one token at one position: the step is a second implementation of that forward, and one edited
    without the other must not decode. The difference is measured against what the layer changes (the logits with
    no layer at all), over one layer only, so that rounding differences neither grow with depth nor hide in a small
    layer's output. The cache slot both write is restored; on a mismatch one line on stderr says so."""
    pos = min(4, model.max_seq_length - 1)  # a few slots before it: the attention's scale and softmax count
    c = model.layers[0].attention.kv_cache
    cache = [t for t in (c.k_cache, c.v_cache, c.k_scale, c.v_scale) if t is not None]
    saved = [t[:, :, pos].clone() for t in cache]
    got = torch.empty(1, model.args.vocab_size)
    input_pos = torch.tensor([pos])
    try:
        cpp.step(token, pos, got)
        # model.py's forward over the first layer, its steps called one by one (the model itself is left whole)
        x = model.tok_embeddings(torch.tensor([[token]]))
        ctx = model.context(input_pos, kv_len=pos + 1)
        h = model.layers[0](x, model.freqs_cis[ctx.pos], ctx, c)
        want = model.output(model.norm(h))[:, -1].float()  # [1, V]
        base = model.output(model.norm(x))[:, -1].float()  # [1, V]: embedding, norm and head alone
    finally:
        for t, s in zip(cache, saved):
            t[:, :, pos] = s
    finite = want.isfinite()
    if torch.equal(finite, got.isfinite()):  # a damaged model: the step's NaNs where the forward has them
        if not finite.any():
            return True
        d, effect = ((got - want)[finite].norm().item(), (want - base)[finite].norm().item())
        if d <= TOLERANCE * effect or d <= 1e-3 * want[finite].norm().item():
            return True
        why = f"logits {d / max(effect, 1e-30):.0%} of the layer's own change apart"
    else:
        why = "logits not finite where the other's are"
    print(f"cpu_step: the C++ step does not match model.py's forward ({why}; was model.py changed?): it runs "
          f"model.py's forward instead", file=sys.stderr)
    return False
