"""Weight-only quantization: int8 per output channel, int4 per group (round-to-nearest or GPTQ).

Decoding one token reads every weight once, so at batch 1 its speed is the weight bytes divided by the memory
bandwidth: 8-bit weights halve the bytes, 4-bit ones quarter them. Activations stay bf16.

The checkpoint file is the same on every device (safetensors; mode and group size in its metadata):
  int8: NAME.weight int8 [N, K], NAME.scales bf16 [N];              w = weight * scales
  int4: NAME.weight uint8 [N, K'/2], NAME.scales, NAME.zeros bf16 [N, K'/G];  w = (q - 8) * scale + zero
        where q in 0..15 is two to a byte, column 2j in the low nibble and 2j+1 in the high one, and K' is K
        rounded up to a multiple of G with zero columns. Packing into a kernel's layout happens at load time.
Scales and zeros may also be float32 (a GGUF import keeps Q4_0/Q4_1's exactly that way); loading casts them to
the runtime dtype. A file may mix kinds per layer (see install): the metadata names the most common mode.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Context, Transformer, precompute_freqs_cis

MODES = ("int8", "int4", "int4-gptq")
GROUPSIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


# ---- quantize and dequantize one weight --------------------------------------------------------------------------

def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:  # w [N, K] -> q int8 [N, K], scales bf16 [N]
    scales = (w.float().abs().amax(1) / 127).clamp(min=1e-8).to(torch.bfloat16)  # rounded first: q uses what is stored
    q = (w.float() / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:  # -> [N, K] float32
    return q.float() * scales.float()[:, None]


def int4_grid(w: Tensor) -> tuple[Tensor, Tensor]:  # w [..., G] groups -> scales, zeros bf16 [...]
    lo, hi = w.float().amin(-1), w.float().amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16)  # rounded first: q is computed from what is stored
    return scales, (lo + 8 * scales.float()).to(torch.bfloat16)  # the kernels' convention: w = (q - 8) * s + zero


def round_int4(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:  # w, scales, zeros broadcastable -> q 0..15
    return ((w.float() - zeros.float()) / scales.float() + 8).round().clamp(0, 15).to(torch.uint8)


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    """Round to nearest. w [N, K] -> q uint8 [N, K'] (0..15), scales and zeros bf16 [N, K'/G]."""
    groups = pad_columns(w.float(), groupsize).unflatten(1, (-1, groupsize))  # [N, K'/G, G]
    scales, zeros = int4_grid(groups)
    return round_int4(groups, scales[..., None], zeros[..., None]).flatten(1), scales, zeros


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:  # q [N, K'] -> [N, K'] float32
    groups = q.float().unflatten(1, (scales.size(1), -1))  # [N, K'/G, G]
    return ((groups - 8) * scales.float()[..., None] + zeros.float()[..., None]).flatten(1)


def pad_columns(w: Tensor, groupsize: int) -> Tensor:  # [N, K] -> [N, K'], K' a multiple of groupsize
    return F.pad(w, (0, find_multiple(w.size(1), groupsize) - w.size(1)))


def pack_nibbles(q: Tensor) -> Tensor:  # [N, K'] 0..15 -> [N, K'/2] uint8
    return (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)


def unpack_nibbles(p: Tensor) -> Tensor:  # [N, K'/2] uint8 -> [N, K'] uint8
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(1)


# ---- quantized layers ----------------------------------------------------------------------------------------------

class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            # torch's CPU kernel reads the int8 weight directly; dequantizing first would write a bf16 copy per call.
            # On AVX-512 it crashes unless the weight is 16-byte aligned: checkpoint.py aligns every tensor
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            return y.view(*x.shape[:-1], self.out_features)
        # the scale is per output channel, so it can wait until after the matmul; on CUDA, inductor fuses the
        # int8 -> bf16 conversion into the matmul's weight load, so the weight is read from memory as int8
        return F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)


class Int4Linear(nn.Module):
    """Holds the checkpoint's plain layout until pack() rewrites it for the device's bf16 int4 kernel; unpacked, it
    dequantizes per call (float32 or float16 activations, where the kernels do not apply)."""

    def __init__(self, in_features: int, out_features: int, groupsize: int):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.k_padded = k = find_multiple(in_features, groupsize)
        self.register_buffer("weight", torch.empty(out_features, k // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, k // groupsize, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.empty(out_features, k // groupsize, dtype=torch.bfloat16))
        self.register_buffer("scales_and_zeros", None)  # [K'/G, N', 2], set by pack()

    @torch.no_grad()
    def pack(self):
        """Rewrite the weights in the layout of torch's int4 kernel for this device (CUDA or CPU)."""
        n = find_multiple(self.out_features, 16)  # the CPU kernel's rows come in 16s, the CUDA one's in 8s
        pad_rows = lambda t: F.pad(t, (0, 0, 0, n - t.size(0)))  # zero scale and zero: padded rows give 0
        q = pad_rows(unpack_nibbles(self.weight)).int()  # [n, K']
        if self.weight.is_cuda:
            k = q.size(1)
            inner_k_tiles = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2  # K' is a multiple of 32
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                inner_k_tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        scales_and_zeros = torch.stack([pad_rows(self.scales), pad_rows(self.zeros)], -1)  # [n, K'/G, 2]
        self.scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous()
        self.weight = packed
        del self.scales, self.zeros  # the plain copies are no longer needed

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        if self.k_padded != self.in_features:
            x2 = F.pad(x2, (0, self.k_padded - self.in_features))  # the weight's zero columns meet zero inputs
        if self.scales_and_zeros is None:
            w = dequantize_int4(unpack_nibbles(self.weight), self.scales, self.zeros)
            y = F.linear(x2, w.to(x.dtype))
        else:
            mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
            y = mm(x2, self.weight, self.groupsize, self.scales_and_zeros)[:, : self.out_features]
        return y.view(*x.shape[:-1], self.out_features)


def install(model: nn.Module, mode: str, groupsize: int, names=None, prefix: str = "") -> nn.Module:
    """Swap every nn.Linear (the output head too) for its quantized twin, in place; run on the meta device.
    names, the tensor names in a checkpoint file, make the kind per layer, for files that mix them (a GGUF import:
    int4 layers and an int8 head): a Linear whose NAME.zeros is there becomes Int4Linear, NAME.scales alone
    Int8Linear, neither stays nn.Linear. Without names every Linear becomes `mode`'s."""
    for name, child in model.named_children():
        full = prefix + name
        if not isinstance(child, nn.Linear):
            install(child, mode, groupsize, names, full + ".")
            continue
        kind = mode if names is None else "int4" if f"{full}.zeros" in names else \
            "int8" if f"{full}.scales" in names else None
        k, n = child.in_features, child.out_features
        if kind:
            setattr(model, name, Int8Linear(k, n) if kind == "int8" else Int4Linear(k, n, groupsize))
    return model


def pack(model: nn.Module):
    """After loading with bf16 activations (the int4 kernels take no other): every Int4Linear into its kernel's
    layout. Layers that another kernel took over (cpu_gemv.py, which reads the stored layout) are no longer here."""
    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.pack()


# ---- GPTQ ----------------------------------------------------------------------------------------------------------

@torch.no_grad()
def gptq_int4(w: Tensor, hessian: Tensor, groupsize: int, damp: float = 0.01) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ (Frantar et al., 2022): quantize one column at a time and spread its rounding error over the columns not
    yet quantized, weighted by the inverse Hessian of the layer's reconstruction loss ||XW^T - XQ^T||^2.
    w [N, K], hessian [K, K] = X^T X over the calibration inputs -> as quantize_int4."""
    w = pad_columns(w.float(), groupsize)
    n, k = w.shape
    h = F.pad(hessian.float(), (0, k - hessian.size(0), 0, k - hessian.size(0)))
    dead = h.diagonal() == 0  # an input that is always zero: its weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * h.diagonal().mean() * torch.eye(k, device=w.device)  # dampening keeps the Cholesky stable
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.zeros(n, k // groupsize, dtype=torch.bfloat16, device=w.device)
    zeros = torch.zeros_like(scales)
    block = max(128, groupsize)  # whole groups per block, so a group's grid sees all earlier updates
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, hb, err = w[:, b0:b1].clone(), hinv[b0:b1, b0:b1], torch.zeros(n, b1 - b0, device=w.device)
        for j in range(b1 - b0):
            g = (b0 + j) // groupsize
            if (b0 + j) % groupsize == 0:
                scales[:, g], zeros[:, g] = int4_grid(wb[:, j : j + groupsize])
            q[:, b0 + j] = round_int4(wb[:, j], scales[:, g], zeros[:, g])
            deq = (q[:, b0 + j].float() - 8) * scales[:, g].float() + zeros[:, g].float()
            err[:, j] = (wb[:, j] - deq) / hb[j, j]
            wb[:, j:] -= err[:, j : j + 1] * hb[j : j + 1, j:]  # the columns after j absorb its error
        w[:, b1:] -= err @ hinv[b0:b1, b1:]  # lazy update of the later blocks, one matmul per block
    return q, scales, zeros


def linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def collect_hessians(module: nn.Module, run, chunks) -> dict[str, Tensor]:
    """X^T X of every Linear's input in module, over all chunks; run(chunk) runs the forward."""
    hessians = {}

    def hook(name):
        def accumulate(mod, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].size(-1)).float()
            hessians[name] = hessians.get(name, 0) + x.T @ x
        return accumulate
    handles = [m.register_forward_hook(hook(name)) for name, m in linears(module).items()]
    try:
        for c in chunks:
            run(c)
    finally:
        for h in handles:
            h.remove()
    return hessians


@torch.no_grad()
def gptq_model(model: Transformer, tokens: Tensor, groupsize: int, chunk: int = 8, progress=None) -> dict:
    """Quantize every Linear of a float32 model with GPTQ, one block at a time: each block is calibrated on the
    outputs of the blocks before it as already quantized, so it learns to correct their error too.
    tokens [n, S] -> {linear name: (q, scales, zeros)}; the model's weights are replaced by their dequantized values."""
    freqs_cis = precompute_freqs_cis(tokens.size(1), model.args.head_dim, model.args.rope_base,
                                     model.args.rope_scaling, tokens.device)[None]
    xs = [model.tok_embeddings(t) for t in tokens.split(chunk)]  # [chunk, S, dim] each: bounded memory
    blocks = [(f"layers.{i}.", layer, lambda x, layer=layer: layer(x, freqs_cis, Context(None)))  # causal, no cache
              for i, layer in enumerate(model.layers)]
    head = nn.ModuleDict(dict(norm=model.norm, output=model.output))
    blocks.append(("", head, lambda x: model.output(model.norm(x))))
    out = {}
    for i, (prefix, block, run) in enumerate(blocks):
        hessians = collect_hessians(block, run, xs)
        for name, lin in linears(block).items():
            q, scales, zeros = gptq_int4(lin.weight, hessians[name], groupsize)
            lin.weight.copy_(dequantize_int4(q, scales, zeros)[:, : lin.in_features])
            out[prefix + name] = (q, scales, zeros)
        xs = [run(x) for x in xs] if i < len(blocks) - 1 else xs
        if progress:
            progress(i + 1, len(blocks))
    return out


# ---- whole models ---------------------------------------------------------------------------------------------------

def calibration_tokens(tokenizer, texts: list[str], samples: int, seq_len: int) -> Tensor:  # -> [n, S]
    """Up to `samples` windows of seq_len tokens, spread evenly over the concatenated texts."""
    ids = [i for t in texts for i in tokenizer.encode(t, bos=True)]
    if len(ids) < seq_len:
        raise ValueError(f"the calibration text is {len(ids)} tokens; it needs at least --calibration_seq_len "
                         f"{seq_len}")
    starts = torch.linspace(0, len(ids) - seq_len, min(samples, len(ids) // seq_len)).long().tolist()
    return torch.tensor([ids[s : s + seq_len] for s in starts])


def quantized_state(model: Transformer, mode: str, groupsize: int, gptq: Optional[dict] = None,
                    progress=None) -> dict:
    """The checkpoint's tensors: every Linear quantized (from gptq where given), everything else bf16."""
    state, quantized = {}, linears(model)
    for name, t in model.state_dict().items():
        layer = name.removesuffix(".weight")
        if layer not in quantized:
            state[name] = t.to(torch.bfloat16)
            continue
        if progress:
            progress(list(quantized).index(layer) + 1, len(quantized))
        if mode == "int8":
            state[name], state[layer + ".scales"] = quantize_int8(t)
        else:
            q, state[layer + ".scales"], state[layer + ".zeros"] = gptq[layer] if gptq else quantize_int4(t, groupsize)
            state[name] = pack_nibbles(q)
    return {k: v.contiguous().cpu() for k, v in state.items()}
