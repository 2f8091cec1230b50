#!/usr/bin/env python3
"""Convert a GGUF file (llama.cpp's format) of a Llama or Qwen2 model into a native checkpoint: the config and the
tokenizer from its metadata, the weights kept quantized wherever this project has the same format.

    python scripts/convert_gguf.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out_dir checkpoints/smollm2-q4

Q4_0 and Q4_1 become int4 layers with groups of 32, losslessly: the same 4-bit values, and each block's scale and
offset kept float32. Q8_0 becomes int8 with one scale per output channel, requantized from its values (its scales
are per block of 32, which int8 has no room for). F32, F16 and BF16 become --dtype, and so does every other type
(the k-quants, Q5_0, the IQ types...), dequantized, which one line reports. --dequantize makes every weight float.
The embedding is always float; the output head of a quantized file that ties it to the embedding is stored apart,
quantized (int8 from a Q8_0 embedding, else in the mode of the other layers).

The tokenizer: a byte-level BPE (tokenizer.ggml.model "gpt2") is rebuilt as a tokenizer.json that splits text as
llama.cpp does for its tokenizer.ggml.pre; a SentencePiece one ("llama") cannot be rebuilt faithfully from the
metadata, so it needs --tokenizer, the model's own tokenizer.model or tokenizer.json.
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import cli  # noqa: E402
from convert_hf_checkpoint import DTYPES, unpermute_rope  # noqa: E402
from model import ModelArgs, precompute_freqs_cis  # noqa: E402
from quantize import pack_nibbles, quantize_int4  # noqa: E402
from tokenizer import LLAMA3_PATTERN, Tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
# architecture -> whether llama.cpp rotates it NEOX-style, in rotate-half pairs: then q and k are in Hugging Face's
# row order and must be permuted into this model's interleaved pairs. For Llama, llama.cpp's converter has already
# permuted them into exactly those.
ARCHS = {"llama": False, "qwen2": True}
INT4_TYPES = (Q.Q4_0, Q.Q4_1)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
NOT_WEIGHTS = (Q.I8, Q.I16, Q.I32, Q.I64, Q.F64)

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3")  # llama.cpp adds BOS and looks whole words up before merging
# tokenizer.ggml.pre -> the regexes that split text before BPE, applied in turn, as llama.cpp's llama-vocab.cpp
# does. "default" is taken as GPT-2's, the split byte-level vocabularies were trained with.
PRE_SPLITS = {
    "gpt-2": [GPT2_SPLIT], "gpt2": [GPT2_SPLIT], "default": [GPT2_SPLIT],
    "smollm": [r"\p{N}", GPT2_SPLIT], "starcoder": [r"\p{N}", GPT2_SPLIT],  # every digit alone, then GPT-2's
    "qwen2": [QWEN2_SPLIT], "deepseek-r1-qwen": [QWEN2_SPLIT],
    **{name: [LLAMA3_PATTERN] for name in LLAMA3_PRES},
}
REQUIRED = object()


# ---- metadata ----------------------------------------------------------------------------------------------------

def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ValueError(f"--gguf {path} {'is not a file' if path.exists() else 'not found'}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes GGUF)")
    print(f"reading {path} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)  # a vocabulary takes seconds to parse
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises many types on a truncated or damaged file
        raise ValueError(f"cannot read {path} (truncated or damaged GGUF): {cli.first_line(e)}") from None


def field(reader: gguf.GGUFReader, key: str, kind: type, default=REQUIRED):
    """A metadata value, checked to be of `kind` (and positive, for numbers); `default` where it is missing."""
    f = reader.fields.get(key)
    if f is None:
        if default is REQUIRED:
            raise ValueError(f"the GGUF metadata lacks {key}")
        return default
    value = f.contents()
    if kind is float and type(value) is int:
        value = float(value)
    ok = type(value) is kind and (kind not in (int, float) or 0 < value < float("inf"))
    if not ok:
        need = {int: "a positive whole number", float: "a positive number", str: "a string", bool: "true or false",
                list: "a list"}[kind]
        raise ValueError(f"the GGUF metadata's {key} must be {need}, got {str(value)[:60]}")
    return value


def token_id(reader, name: str, vocab_size: int):
    """tokenizer.ggml.{name}_token_id, or None; 0 is an id, so field() does not read these."""
    f = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
    if f is None:
        return None
    i = f.contents()
    if type(i) is not int or not 0 <= i < vocab_size:
        raise ValueError(f"the GGUF metadata's tokenizer.ggml.{name}_token_id is {i!r}, not a token id below "
                         f"{vocab_size}")
    return i


def shape(t) -> tuple:  # GGUF lists a tensor's dimensions innermost first: [K, N] for our [N, K]
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def read_args(reader, tensors: dict, path: Path) -> tuple[str, ModelArgs]:
    """The architecture and ModelArgs from the metadata and the tensors present."""
    arch = field(reader, "general.architecture", str)
    if arch not in ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; this converter reads {', '.join(ARCHS)}")
    key = lambda name, kind=int, default=REQUIRED: field(reader, f"{arch}.{name}", kind, default)  # noqa: E731
    dim, n_head = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", int, dim // n_head)
    if key("attention.value_length", int, head_dim) != head_dim:
        raise ValueError(f"{path}: value heads of another size than key heads are not supported")
    if key("rope.dimension_count", int, head_dim) != head_dim:
        raise ValueError(f"{path}: RoPE over part of each head ({key('rope.dimension_count')} of {head_dim} "
                         f"dimensions) is not supported")
    scaling = key("rope.scaling.type", str, "none")
    if scaling != "none":
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (only Llama-3.1's, from rope_freqs)")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} lacks the tensor token_embd.weight")
    base, vocab = key("rope.freq_base", float, 10000.0), shape(tensors["token_embd.weight"])[0]
    if key("vocab_size", int, vocab) != vocab:
        raise ValueError(f"{path}: {arch}.vocab_size says {key('vocab_size')} but token_embd.weight has {vocab} rows")
    cfg = dict(vocab_size=vocab, n_layer=key("block_count"), n_head=n_head,
               n_kv_head=key("attention.head_count_kv", int, n_head), dim=dim, head_dim=head_dim,
               intermediate_size=key("feed_forward_length"), rope_base=base,
               rope_scaling=rope_scaling(tensors.get("rope_freqs.weight"), head_dim, base, path),
               norm_eps=key("attention.layer_norm_rms_epsilon", float), block_size=key("context_length"),
               tie_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors)
    return arch, checkpoint.check_config(cfg, f"{path} (as converted)")


def rope_scaling(t, head_dim: int, base: float, path: Path):
    """Llama-3.1's scaling, which llama.cpp stores as one factor per frequency (rope_freqs) instead of its
    parameters: the parameters of Llama 3.1 and 3.2, checked to give the same frequencies."""
    if t is None:
        return None
    factors = read_float(t)  # [head_dim / 2]
    if factors.shape != (head_dim // 2,) or not bool(torch.isfinite(factors).all()) or factors.min() <= 0:
        raise ValueError(f"{path}: rope_freqs.weight is not {head_dim // 2} positive factors")
    if bool((factors == 1).all()):
        return None
    scaling = dict(factor=float(factors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    angle = lambda s: torch.atan2(*precompute_freqs_cis(2, head_dim, base, s)[1].unbind(-1)[::-1])  # noqa: E731
    if not torch.allclose(angle(None) / angle(scaling), factors, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight is not Llama-3.1's RoPE scaling; not supported")
    return scaling


def check_tensors(tensors: dict, args: ModelArgs, path: Path):
    """Exactly the tensors of the model the metadata describes, each of the shape it implies."""
    dim, q, kv, inter = args.dim, args.n_head * args.head_dim, args.n_kv_head * args.head_dim, args.intermediate_size
    want = {"token_embd.weight": (args.vocab_size, dim), "output_norm.weight": (dim,)}
    if not args.tie_embeddings:
        want["output.weight"] = (args.vocab_size, dim)
    if "rope_freqs.weight" in tensors:
        want["rope_freqs.weight"] = (args.head_dim // 2,)
    for n in range(args.n_layer):
        b = f"blk.{n}."
        want.update({b + "attn_norm.weight": (dim,), b + "attn_q.weight": (q, dim), b + "attn_k.weight": (kv, dim),
                     b + "attn_v.weight": (kv, dim), b + "attn_output.weight": (dim, q), b + "ffn_norm.weight": (dim,),
                     b + "ffn_gate.weight": (inter, dim), b + "ffn_up.weight": (inter, dim),
                     b + "ffn_down.weight": (dim, inter)})
        if args.qkv_bias:
            want.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
    extra = [k for k in tensors if k not in want]
    if extra:
        raise ValueError(f"{path}: unexpected tensor {extra[0]} ({len(extra)} unexpected in all; the metadata "
                         f"describes a {args.n_layer}-layer model without it)")
    for name, size in want.items():
        if name not in tensors:
            raise ValueError(f"{path} lacks the tensor {name}")
        t = tensors[name]
        if shape(t) != size:
            raise ValueError(f"{path}: tensor {name} has shape {list(shape(t))}, the metadata implies {list(size)}")
        if t.tensor_type in NOT_WEIGHTS:
            raise ValueError(f"{path}: tensor {name} is {t.tensor_type.name}; a float or quantized weight belongs "
                             f"there")


# ---- the tokenizer -----------------------------------------------------------------------------------------------

def tokenizer_files(reader, path: Path, vocab_size: int, tokenizer=None, sampling: Optional[dict] = None) -> dict:
    """{file name: text or Path}: tokenizer.json (or --tokenizer's file), tokenizer_config.json and
    generation_config.json (its end ids and sampling defaults), from the metadata."""
    tokens = field(reader, "tokenizer.ggml.tokens", list, [])
    kind = field(reader, "tokenizer.ggml.model", str, None)
    if tokenizer is not None:
        size = Tokenizer(tokenizer).vocab_size  # checks the file
        if size > vocab_size:
            raise ValueError(f"--tokenizer {tokenizer} has {size} tokens but the model has {vocab_size}")
        with open(tokenizer, "rb") as f:  # told from the content, as tokenizer.py does
            json_file = f.read(1 << 10).lstrip()[:1] == b"{"
        files = {"tokenizer.json" if json_file else checkpoint.TOKENIZER: Path(tokenizer)}
    elif kind == "gpt2":
        files = {"tokenizer.json": byte_level_bpe(reader, tokens, path)}
    elif kind == "llama":
        raise ValueError(f"{path} holds a SentencePiece tokenizer, which cannot be rebuilt faithfully from GGUF "
                         f"metadata; pass --tokenizer PATH, the model's tokenizer.model or tokenizer.json")
    else:
        what = f"tokenizer.ggml.model {kind!r} is not supported" if kind else "has no tokenizer"
        raise ValueError(f"{path} {what}; pass --tokenizer PATH, the model's tokenizer.model or tokenizer.json")
    if len(tokens) > vocab_size:
        raise ValueError(f"{path} lists {len(tokens)} tokens but the embedding has {vocab_size} rows")
    ids = {k: token_id(reader, k, vocab_size) for k in ("bos", "eos", "eot", "eom", "padding", "unknown")}
    name = lambda i: tokens[i] if i is not None and i < len(tokens) else None  # noqa: E731
    config = {"bos_token": name(ids["bos"]), "eos_token": name(ids["eos"]), "pad_token": name(ids["padding"]),
              "unk_token": name(ids["unknown"]), "tokenizer_class": "PreTrainedTokenizerFast"}
    template = field(reader, "tokenizer.chat_template", str, None)
    if template is not None:
        config["chat_template"] = template
    ends = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    generation = {"bos_token_id": ids["bos"], "eos_token_id": ends if len(ends) > 1 else ends[0] if ends else None}
    for key, name in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p")):  # the model's sampling
        if f"general.sampling.{key}" in reader.fields:  # defaults, as llama.cpp's converter stores them
            generation[name] = reader.fields[f"general.sampling.{key}"].contents()
    generation.update(sampling or {})
    return {**files, "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}


def byte_level_bpe(reader, tokens: list, path: Path) -> str:
    """A tokenizer.json for a byte-level BPE vocabulary: its tokens and merges, the pre-tokenizer llama.cpp uses
    for tokenizer.ggml.pre, control tokens as special tokens, user-defined ones as added tokens, and BOS (or EOS)
    added to each text where the metadata says so."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    pre = field(reader, "tokenizer.ggml.pre", str, "default")
    if pre not in PRE_SPLITS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_SPLITS)}); "
                         f"pass --tokenizer PATH, the model's tokenizer.json")
    merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges", list)]
    if not tokens or any(len(m) != 2 for m in merges):
        raise ValueError(f"{path}: the tokenizer's tokens or merges are malformed")
    types = field(reader, "tokenizer.ggml.token_type", list, [gguf.TokenType.NORMAL] * len(tokens))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:
        tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in LLAMA3_PRES))
    except Exception as e:  # a merge of tokens not in the vocabulary
        raise ValueError(f"{path}: the tokenizer's merges do not fit its tokens ({cli.first_line(e)[:100]})") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in PRE_SPLITS[pre]]
                                                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == gguf.TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == gguf.TokenType.USER_DEFINED])
    ends = []
    for key, default in (("bos", pre in LLAMA3_PRES), ("eos", False)):
        i = token_id(reader, key, len(tokens))
        if field(reader, f"tokenizer.ggml.add_{key}_token", bool, default) and i is not None:
            ends.append((key, tokens[i], i))
    if ends:
        around = lambda seq, n: [f"{t}:{n}" for k, t, _ in ends if k == "bos"] + [f"{seq}:{n}"] + \
            [f"{t}:{n}" for k, t, _ in ends if k == "eos"]  # noqa: E731
        tok.post_processor = processors.TemplateProcessing(single=around("$A", 0), pair=around("$A", 0) + around(
            "$B", 1), special_tokens=[(t, i) for _, t, i in ends])
    return tok.to_str()


# ---- the weights -------------------------------------------------------------------------------------------------

def read_float(t) -> torch.Tensor:  # -> float32 [N, K] or [N]
    try:
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)).view(shape(t))
    except NotImplementedError:
        raise ValueError(f"tensor {t.name} is {t.tensor_type.name}, a type the gguf package cannot dequantize") \
            from None


def int4_parts(t) -> dict:
    """Q4_0 or Q4_1 as this project's int4 with groups of 32, the same numbers.
    -> weight uint8 [N, K/2], scales and zeros float32 [N, K/32]"""
    n, k = shape(t)
    blocks = torch.from_numpy(np.array(t.data)).view(n, k // 32, -1)  # [N, K/32, 18 or 20 bytes]
    f16 = lambda b: b.contiguous().view(torch.float16)[..., 0].float()  # noqa: E731  two bytes -> [N, K/32]
    d, q1 = f16(blocks[..., 0:2]), t.tensor_type == Q.Q4_1
    qs = blocks[..., 4 if q1 else 2:]  # [N, K/32, 16]: byte j holds element j (low nibble) and j + 16 (high)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).flatten(1)  # [N, K] 0..15 in column order
    m = f16(blocks[..., 2:4]) if q1 else -8 * d
    # GGUF computes w = q * d + m (Q4_0: m = -8d), ours w = (q - 8) * scale + zero: scale = d, zero = m + 8d
    return {"weight": pack_nibbles(q), "scales": d, "zeros": m + 8 * d}


def int8_parts(w: torch.Tensor) -> tuple[dict, float]:
    """Per output channel, symmetric; scales float32. w [N, K] -> ({weight int8 [N, K], scales [N]}, the largest
    error relative to the largest weight)"""
    scales = (w.abs().amax(1) / 127).clamp(min=1e-30)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    err = float((q.float() * scales[:, None] - w).abs().max() / w.abs().max().clamp(min=1e-30))
    return {"weight": q, "scales": scales}, err


def layer_kind(types, dequantize: bool) -> str:
    """What one Linear becomes, given the GGUF types of the tensors fused into it."""
    if dequantize:
        return "float"
    if all(t in INT4_TYPES for t in types):
        return "int4"
    return "int8" if all(t == Q.Q8_0 for t in types) else "float"


def rope_rows(parts: dict, n_heads: int, head_dim: int) -> dict:
    """q or k rows from rotate-half order into interleaved pairs. Rows are output channels, which a quantized
    tensor keeps whole, so its weight, scales and zeros are permuted alike."""
    order = unpermute_rope(torch.arange(n_heads * head_dim)[:, None], n_heads, head_dim)[:, 0]
    return {k: v[order] for k, v in parts.items()}


def convert_tensors(tensors: dict, args: ModelArgs, neox: bool, dtype, dequantize: bool, path: Path):
    """Native name -> tensor, and what was done: (state, layer kinds Counter, dequantized types Counter, largest
    Q8_0 -> int8 error)."""
    state, kinds, dequantized, q8_error = {}, Counter(), Counter(), 0.0

    def read(name: str, kind: str) -> dict:  # one GGUF tensor as `kind`'s tensors, checked finite
        nonlocal q8_error
        t = tensors[name]
        if kind == "int4":
            parts = int4_parts(t)
        else:
            w = read_float(t)
            if kind == "int8":
                parts, err = int8_parts(w)
                q8_error = max(q8_error, err)
            else:
                parts = {"weight": w.to(dtype)}
                if t.tensor_type not in FLOAT_TYPES and not dequantize and name != "token_embd.weight":
                    dequantized[t.tensor_type.name] += 1
        if not all(bool(torch.isfinite(p).all()) for p in parts.values() if p.is_floating_point()):
            raise ValueError(f"{path}: tensor {name} holds NaN or infinite values (in {str(dtype)[6:]}); the file is "
                             f"damaged")
        return parts

    def linear(native: str, names: list, heads=()):  # fused in row order; heads: q/k head counts to permute
        kind = layer_kind([tensors[n].tensor_type for n in names], dequantize)
        parts = [read(n, kind) for n in names]
        for i, h in enumerate(heads if neox else ()):
            parts[i] = rope_rows(parts[i], h, args.head_dim)
        for key in parts[0]:
            state[f"{native}.{key}"] = torch.cat([p[key] for p in parts])
        kinds[kind] += 1

    def vector(name: str, heads=None):  # a norm or a bias, always float
        w = read(name, "float")["weight"]
        return rope_rows({"w": w[:, None]}, heads, args.head_dim)["w"][:, 0] if neox and heads else w

    state["tok_embeddings.weight"] = read("token_embd.weight", "float")["weight"]
    for n in tqdm(range(args.n_layer), desc="converting layers", disable=None):
        b, native = f"blk.{n}.", f"layers.{n}."
        state[native + "attention_norm.weight"] = vector(b + "attn_norm.weight")
        linear(native + "attention.wqkv", [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
               (args.n_head, args.n_kv_head))
        if args.qkv_bias:
            state[native + "attention.bqkv"] = torch.cat([vector(b + "attn_q.bias", args.n_head),
                                                          vector(b + "attn_k.bias", args.n_kv_head),
                                                          vector(b + "attn_v.bias")])
        linear(native + "attention.wo", [b + "attn_output.weight"])
        state[native + "ffn_norm.weight"] = vector(b + "ffn_norm.weight")
        linear(native + "feed_forward.w1", [b + "ffn_gate.weight"])
        linear(native + "feed_forward.w3", [b + "ffn_up.weight"])
        linear(native + "feed_forward.w2", [b + "ffn_down.weight"])
    state["norm.weight"] = vector("output_norm.weight")
    if not args.tie_embeddings:
        linear("output", ["output.weight"])
    elif not dequantize and (kinds["int4"] or kinds["int8"] or tensors["token_embd.weight"].tensor_type == Q.Q8_0):
        # a quantized file's tied head is stored apart from the float embedding, quantized
        embd = tensors["token_embd.weight"]
        head = "int8" if embd.tensor_type == Q.Q8_0 or kinds["int8"] > kinds["int4"] else "int4"
        if head == "int4" and embd.tensor_type not in INT4_TYPES:
            q, scales, zeros = quantize_int4(read_float(embd), 32)
            state.update({"output.weight": pack_nibbles(q), "output.scales": scales, "output.zeros": zeros})
        else:
            state.update({f"output.{k}": v for k, v in read("token_embd.weight", head).items()})
        kinds[head] += 1
    return state, kinds, dequantized, q8_error


# ---- the command -------------------------------------------------------------------------------------------------

def convert_gguf(gguf_path, out_dir, dtype="bfloat16", dequantize: bool = False, tokenizer=None,
                 force: bool = False, sampling: Optional[dict] = None) -> Path:
    """Convert the GGUF file into a native checkpoint in out_dir. sampling: the model's sampling defaults
    ({"temperature": 0.2, ...}) for its generation_config.json, over any the metadata has. Raises ValueError with a
    one-line message on bad input, before anything is written. Returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    reader = open_gguf(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    arch, args = read_args(reader, tensors, gguf_path)
    check_tensors(tensors, args, gguf_path)
    files = tokenizer_files(reader, gguf_path, args.vocab_size, tokenizer, sampling)
    inputs = [gguf_path] + ([Path(tokenizer)] if tokenizer else [])
    checkpoint.check_writable(out_dir, force, inputs)

    state, kinds, dequantized, q8_error = convert_tensors(tensors, args, ARCHS[arch], DTYPES[dtype], dequantize,
                                                          gguf_path)
    modes = {k: kinds[k] for k in ("int4", "int8") if kinds[k]}
    metadata = {"format": "pt", "method": "gguf", "source": str(gguf_path)}
    quantization = None
    if modes:
        quantization = (max(modes, key=modes.get), 32 if "int4" in modes else 0)
        metadata.update(quantization=quantization[0], **({"groupsize": "32"} if "int4" in modes else {}))
    checkpoint.check_state(state, args, quantization, f"{gguf_path} as converted and its config")  # loadable
    checkpoint.save(out_dir, args, state, files, metadata, force=force, inputs=inputs)

    if dequantized:
        print(f"dequantized to {dtype} (this project has no lossless form for them): "
              + ", ".join(f"{n} ({c} tensors)" for n, c in dequantized.most_common()))
    if q8_error:
        print(f"Q8_0 -> int8 with one scale per output channel: largest error {q8_error:.2%} of the largest weight")
    params = sum(t.numel() * (2 if k.endswith(".weight") and t.dtype == torch.uint8 else 1)
                 for k, t in state.items() if not k.endswith((".scales", ".zeros")))
    tied = state["tok_embeddings.weight"].numel() if args.tie_embeddings and "output.weight" in state else 0
    apart = f"; {params - tied:,} in the model, its output head being the embedding, stored apart quantized" \
        if tied else ""
    print(f"converted {params:,} params ({kinds['int4']} int4, {kinds['int8']} int8, {kinds['float']} float layers"
          f"{apart}) to {out_dir / 'model.safetensors'}")
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--gguf", type=Path, required=True, help="the .gguf file (read only)")
    p.add_argument("--out_dir", type=Path, required=True, help="a new or empty directory to write the checkpoint into")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="the float weights' dtype (default "
                   "bfloat16); int4 and int8 scales are stored float32")
    p.add_argument("--dequantize", action="store_true", help="make every weight float (--dtype), none int4 or int8")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.model or tokenizer.json to use instead of the "
                   "metadata's (needed where the GGUF holds a SentencePiece tokenizer)")
    p.add_argument("--force", action="store_true", help="replace an earlier checkpoint in --out_dir (refused if "
                   "the directory holds anything else)")
    p.add_argument("--temperature", type=cli.finite_float, help="the model's default temperature, written to "
                   "its generation_config.json over the metadata's (SmolLM2-135M-Instruct's: 0.2)")
    p.add_argument("--top_p", type=cli.finite_float, help="the model's default top_p, likewise (SmolLM2's: 0.9)")
    p.add_argument("--top_k", type=cli.whole_or_zero, help="the model's default top_k, likewise (0: no limit)")
    args = cli.one_line_errors(p).parse_args(argv)
    from sampling import OptionError, Sampling
    sampling = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None}
    try:
        Sampling(**sampling)  # the checks every entry point makes
    except OptionError as e:
        p.error(f"--{e}")
    convert_gguf(args.gguf, args.out_dir, args.dtype, args.dequantize, args.tokenizer, args.force, sampling)


if __name__ == "__main__":
    cli.run_main(main)
