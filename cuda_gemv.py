"""Matrix-vector products for decoding on NVIDIA GPUs: y = x @ w.T for x [M, K] of a few rows, with w in bf16 or
int8 (a scale per row, the layout quantize.py stores), as Triton kernels.

Batch-1 decode is one pass over every weight, so a product is as fast as it reads its bytes: these kernels read
them nearer the copy bandwidth than cuBLAS (bf16) and inductor's reduction (int8) do (figures in HOW_IT_WORKS.md,
"GPU decode kernels").

The int8 kernel converts no weight: each byte b goes, with b ^ 0x80, under the exponent bits of 2^23 (0x4B000000),
which makes the float 2^23 + b + 128, and one subtraction leaves b exactly: two integer operations, where the
conversion instructions would not keep up with the memory. The weights are loaded as 32-bit words, four bytes taken
apart with shifts and masks.

A program computes BLOCK_N outputs of one row of x; the rows of x vary fastest over the grid, so the programs that
share a weight tile run together and all but the first find it in L2 (speculative verification, small batches).
Block sizes are tuned once per shape by triton.autotune, on the first call (outside any CUDA graph capture: the
compiled step runs once eagerly before it is recorded). More than MAX_ROWS rows (prefill) go to cuBLAS.

int4 layers stay on torch's kernel (`_weight_int4pack_mm`): a kernel of this design for the stored int4 layout read
it more slowly.

attend_paged is the engine's attention on a GPU: each query row over its own blocks of the paged KV cache where
they lie (the softmax kept running block by block, one program per query position and KV head), so a decode step
has fixed shapes whatever the rows' contexts and cuda_step.py records it as a CUDA graph."""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch comes without Triton: nothing here is used then
    triton = None

MAX_ROWS = 8  # a verify pass of a few drafted tokens, or a small batch; more rows read the weight from cuBLAS

if triton is not None:
    def configs(blocks_k):
        return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n in (2, 4, 8, 16) for k in blocks_k
                for w in (2, 4)]

    def bench(fn, quantiles):  # triton's default times each config for 125 ms; a few ms tell them apart
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    @triton.jit
    def gemv_bf16_kernel(x_ptr, w_ptr, y_ptr, M, N, K,  # x [M, K], w [N, K], y [M, N], all bf16
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        m, n0 = tl.program_id(0) % M, tl.program_id(0) // M * BLOCK_N
        rows = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                        other=0.0)
            x = tl.load(x_ptr + m * K + cols, mask=cols < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + m * N + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def gemv_int8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,  # x [M, K] bf16, w [N, K/4] int32, s [N], y [M, N]
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        m, n0 = tl.program_id(0) % M, tl.program_id(0) // M * BLOCK_N
        rows = n0 + tl.arange(0, BLOCK_N)
        words = tl.arange(0, BLOCK_K // 4)
        acc = tl.zeros([BLOCK_N, BLOCK_K // 4], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 // 4 + words
            w = tl.load(w_ptr + rows[:, None] * (K // 4) + cols[None, :],
                        mask=(rows[:, None] < N) & (cols[None, :] < K // 4), other=0)
            for i in tl.static_range(4):  # byte i of each word is column 4 * word + i
                x = tl.load(x_ptr + m * K + 4 * cols + i, mask=cols < K // 4, other=0.0).to(tl.float32)
                # the byte b (signed) as 2^23 + b + 128: b ^ 0x80 under 2^23's exponent bits, then less the offset
                q = (((w >> (8 * i)) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
                acc += q * x[None, :]
        scale = tl.load(s_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * N + rows, (tl.sum(acc, 1) * scale).to(y_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def attend_paged_triton(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, o_ptr, S, W, scale, H: tl.constexpr,
                            HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GP: tl.constexpr):
        # one program: query position s of row b, for the H / HKV query heads that share KV head h (GP: that many,
        # to a power of two), over the row's blocks up to its position: the softmax kept running, block by block
        b, s, h = tl.program_id(0) // S, tl.program_id(0) % S, tl.program_id(1)
        g, d, j = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, BS)
        live = g < H // HKV
        at = ((b * H + h * (H // HKV) + g) * S + s) * D  # q and out [B, H, S, D]
        q = tl.load(q_ptr + at[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32) * scale
        last = tl.load(pos_ptr + b * S + s)  # the last position it sees
        m = tl.full([GP], float("-inf"), dtype=tl.float32)
        total = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        for i in range(0, last // BS + 1):
            kv = ((tl.load(table_ptr + b * W + i) * HKV + h) * BS + j) * D  # pools [n_blocks, HKV, BS, D]
            k = tl.load(k_ptr + kv[:, None] + d[None, :]).to(tl.float32)
            v = tl.load(v_ptr + kv[:, None] + d[None, :]).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, BS]
            scores = tl.where((i * BS + j <= last)[None, :], scores, float("-inf"))
            top = tl.maximum(m, tl.max(scores, 1))
            e, shrink = tl.exp(scores - top[:, None]), tl.exp(m - top)
            total = total * shrink + tl.sum(e, 1)
            acc = acc * shrink[:, None] + tl.sum(e[:, :, None] * v[None, :, :], axis=1)
            m = top
        tl.store(o_ptr + at[:, None] + d[None, :], (acc / total[:, None]).to(o_ptr.dtype.element_ty),
                 mask=live[:, None])

    gemv_bf16_tuned = triton.autotune(configs((256, 512, 1024)), key=["M", "N", "K"], do_bench=bench)(
        gemv_bf16_kernel)
    gemv_int8_tuned = triton.autotune(configs((256, 512, 1024)), key=["M", "N", "K"], do_bench=bench)(
        gemv_int8_kernel)


def grid(M: int, N: int):
    return lambda meta: (M * triton.cdiv(N, meta["BLOCK_N"]),)


@torch.library.custom_op("fast_decode_cuda::gemv_bf16", mutates_args=())
def gemv_bf16(x: Tensor, w: Tensor) -> Tensor:  # x [M, K], w [N, K], bf16 -> [M, N]
    y = x.new_empty(x.size(0), w.size(0))
    gemv_bf16_tuned[grid(*y.shape)](x.contiguous(), w, y, x.size(0), *w.shape)
    return y


@torch.library.custom_op("fast_decode_cuda::gemv_int8", mutates_args=())
def gemv_int8(x: Tensor, w: Tensor, scales: Tensor) -> Tensor:  # x [M, K] bf16, w int8 [N, K], scales [N] -> [M, N]
    y = x.new_empty(x.size(0), w.size(0))
    gemv_int8_tuned[grid(*y.shape)](x.contiguous(), w.view(torch.int32), scales, y, x.size(0), *w.shape)
    return y


def attend_paged(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, pos: Tensor, slots: int = 0) -> Tensor:
    """Attention for a few query rows straight over a paged cache (cpu_gemv.attend_paged's arguments): q [B, H, S,
    D], k_pool and v_pool [n_blocks, Hkv, block_size, D], table [B, W] each row's blocks in order, pos [B, S] each
    query's position (it sees its row's positions up to it) -> [B, H, S, D]. No copy of the rows' K and V, and
    fixed shapes whatever the context: a step on it can be recorded as a CUDA graph once per batch size."""
    (B, H, S, D), (_, Hkv, size, _) = q.shape, k_pool.shape
    q = q.contiguous()  # model.py's q is a transposed view; the kernel and its output are [B, H, S, D] in order
    out = torch.empty_like(q)
    attend_paged_triton[(B * S, Hkv)](q, k_pool, v_pool, table, pos, out, S, table.size(1), D**-0.5,
                                      H=H, HKV=Hkv, D=D, BS=size, GP=triton.next_power_of_2(H // Hkv))
    return out


def pages_ok(head_dim: int, block_size: int) -> bool:  # what attend_paged takes: powers of two
    return triton is not None and all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))


@gemv_bf16.register_fake
def _(x, w):
    return x.new_empty(x.size(0), w.size(0))


@gemv_int8.register_fake
def _(x, w, scales):
    return x.new_empty(x.size(0), w.size(0))


def few_rows(x: Tensor) -> bool:  # decode, verification, small batches; inference only: the ops have no backward
    return x.numel() <= MAX_ROWS * x.size(-1) and not (torch.is_grad_enabled() and x.requires_grad)


class GemvBf16(nn.Module):
    """nn.Linear without a bias, bf16: few rows on the kernel above, more on cuBLAS."""
    def __init__(self, weight: Tensor):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if not few_rows(x):
            return F.linear(x, self.weight)
        return gemv_bf16(x.reshape(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class GemvInt8(nn.Module):
    """quantize.py's int8 layer (weight int8 [N, K], scales bf16 [N]): few rows on the kernel above; more
    dequantized for cuBLAS."""
    def __init__(self, weight: Tensor, scales: Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if not few_rows(x):
            return F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return gemv_int8(x.reshape(-1, x.size(-1)), self.weight, self.scales).view(*x.shape[:-1], -1)


def replacement(m: nn.Module) -> Optional[nn.Module]:
    """The layer that takes m's place (nn.Linear in bf16, or quantize.py's int8 layer, told apart by its tensors),
    or None. quantize.py's int4 layers stay on torch's kernel: a Triton kernel of the same design as these read
    int4 weights more slowly than it."""
    w, scales = getattr(m, "weight", None), getattr(m, "scales", None)
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_cuda or not w.is_contiguous() or w.size(1) % 4:
        return None
    if isinstance(m, nn.Linear) and m.bias is None and w.dtype == torch.bfloat16:
        return GemvBf16(w)
    if w.dtype == torch.int8 and isinstance(scales, Tensor) and getattr(m, "zeros", None) is None:
        return GemvInt8(w, scales.to(torch.bfloat16))
    return None


def install(model: nn.Module) -> int:
    """Replace the model's CUDA bf16 and int8 linear layers, in place, by ones on these kernels. Returns how many
    layers were replaced; 0 without Triton."""
    if triton is None:
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


def describe(model: nn.Module) -> str:
    """Which kernels the model's GPU products run on, in words."""
    kinds = [k for k, c in (("bf16", GemvBf16), ("int8", GemvInt8)) if any(isinstance(m, c) for m in model.modules())]
    return f"CUDA kernels: Triton for {' and '.join(kinds)}" if kinds else "CUDA kernels: torch's"
