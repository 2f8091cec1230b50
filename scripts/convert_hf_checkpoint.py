#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint of the Llama layout (model_type llama, mistral or qwen2) into this repo's native
checkpoint directory. The details (heads, window, biases) are read from config.json's fields and the tensors present.

The native directory holds:
  model.safetensors  native tensor names; q/k/v fused into one wqkv with RoPE pairs interleaved
  config.json        the flat fields of model.ModelArgs
  tokenizer.json or tokenizer.model (from original/ where Llama-3 keeps it), tokenizer_config.json,
  generation_config.json, chat_template.jinja: copied byte-for-byte where present

Accepted weights: model.safetensors, sharded safetensors (+ index), pytorch_model.bin or
sharded pytorch_model-*.bin (+ index). Safetensors win when both are present. .bin files are
loaded with weights_only=True, so no pickled code is ever run. The source is only read.

Example:
  python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-hf/hf \\
      --out_dir checkpoints/meta-llama/Llama-2-7b-hf/native --dtype bfloat16
"""
import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

# Let `python scripts/convert_hf_checkpoint.py` find model.py from any working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import cli  # noqa: E402
from model import ModelArgs  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_CANDIDATES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")
WEIGHT_LAYOUTS = (  # (single file, index of shards), in order of preference
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)
IGNORED_SUFFIX = "rotary_emb.inv_freq"  # a buffer some old exports saved; our model recomputes it


LLAMA_LAYOUT = ("llama", "mistral", "qwen2")  # the model_types whose tensors and arithmetic are model.py's


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs from a Hugging Face config.json (transformers 4 or 5 layout) of the Llama layout: SiLU, RMSNorm,
    RoPE, and at most one sliding window shared by every layer (Mistral). qkv_bias (Qwen2) is not a config field
    there: the converter reads it from the weights."""
    if cfg.get("model_type", "llama") not in LLAMA_LAYOUT:  # other architectures may share Llama's tensor names
        raise ValueError(f"model_type {cfg['model_type']!r} is not supported: only the Llama layout "
                         f"({', '.join(LLAMA_LAYOUT)}) converts")
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
    return ModelArgs(
        vocab_size=cfg["vocab_size"], n_layer=n_layer, n_head=n_head,
        n_kv_head=cfg.get("num_key_value_heads") or n_head, dim=cfg["hidden_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head, intermediate_size=cfg["intermediate_size"],
        rope_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_scaling={k: scaling[k] for k in keys} if rope_type == "llama3" else None,
        norm_eps=cfg.get("rms_norm_eps", 1e-6), block_size=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_window=window or 0)  # null: none
HF_FIELDS = {  # the config fields read, and what each must be
    int: ("vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
          "intermediate_size", "max_position_embeddings", "sliding_window"),
    float: ("rope_theta", "rms_norm_eps"),
    bool: ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
    list: ("layer_types",),
}
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")  # Qwen2's, the only ones


def read_model_args(checkpoint_dir, names=()):
    """ModelArgs from config.json, and from the tensor names: q/k/v biases are in no config field (Qwen2)."""
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"config.json not found in {checkpoint_dir}")
    config = checkpoint.read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    check_hf_fields({**config, **(config.get("rope_parameters") or {})}, path)
    try:
        args = args_from_hf_config(config)
    except (KeyError, TypeError, AttributeError) as e:  # a field missing or of the wrong type
        raise ValueError(f"{path}: missing or malformed field {e}") from None
    other_bias = next((k for k in names if k.endswith(".bias") and not k.endswith(QKV_BIASES)), None)
    if other_bias:  # refused before any layer is converted: o_proj and MLP biases are not in the model
        raise ValueError(f"tensor {other_bias!r} is a bias this model lacks; only q_proj, k_proj and v_proj may "
                         f"have one (as in Qwen2)")
    args.qkv_bias = any(k.endswith(QKV_BIASES) for k in names)
    return checkpoint.check_config(dataclasses.asdict(args), f"{path} (as converted)")


def check_hf_fields(config: dict, path):
    """Types and ranges first: a 0 head count divides by zero, and a string "false" would read as true."""
    for kind, keys in HF_FIELDS.items():
        for key in keys:
            value = config.get(key)
            if value is None:
                continue
            ok = type(value) is kind or kind is float and type(value) is int
            ok = ok and (kind in (bool, list) or math.isfinite(value) and value > 0)
            if not ok:
                need = {int: "a positive whole number", float: "a positive finite number", bool: "true or false",
                        list: "a list"}
                raise ValueError(f"{path}: {key} must be {need[kind]}, got {value!r}; fix that field")


def find_tokenizer(checkpoint_dir) -> dict:
    """The tokenizer files to copy, by name: tokenizer.json (it carries the added and special tokens) or else
    tokenizer.model, and the companions that give the chat template and the end-of-sequence ids."""
    files = checkpoint.tokenizer_files(checkpoint_dir)
    if "tokenizer.json" in files:
        files.pop(checkpoint.TOKENIZER, None)
    elif checkpoint.TOKENIZER not in files and (checkpoint_dir / "original" / checkpoint.TOKENIZER).is_file():
        files[checkpoint.TOKENIZER] = checkpoint_dir / "original" / checkpoint.TOKENIZER  # where Llama-3 keeps it
    if not {"tokenizer.json", checkpoint.TOKENIZER} & files.keys():
        raise ValueError(f"no tokenizer found in {checkpoint_dir}: looked for "
                         f"{' and '.join(TOKENIZER_CANDIDATES)}")
    return files


def open_weights(checkpoint_dir):
    """HF tensor name -> a function that reads it. Files are mmap'd, and each tensor is read only when
    it is converted, so memory holds the output plus one tensor, never a second copy of the source."""
    for single, index in WEIGHT_LAYOUTS:
        if (checkpoint_dir / index).is_file():
            weight_map = checkpoint.read_json(checkpoint_dir / index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{checkpoint_dir / index} has no weight_map")
            files = sorted(set(weight_map.values()))
        elif (checkpoint_dir / single).is_file():
            files = [single]
        else:
            continue
        readers = {}
        for name in files:
            readers.update(open_weight_file(checkpoint_dir / name))
        return readers
    raise ValueError(f"no weights found in {checkpoint_dir}: looked for "
                     + ", ".join(name for layout in WEIGHT_LAYOUTS for name in layout))


def open_weight_file(path):
    try:
        if path.suffix == ".safetensors":
            f = safe_open(path, framework="pt", device="cpu")
            return {k: (lambda k=k: f.get_tensor(k)) for k in f.keys()}
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # never runs pickled code
        return {k: (lambda t=t: t) for k, t in state.items()}
    except Exception as e:  # corrupt, truncated or unsafe file: report it, don't trace back
        raise ValueError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def unpermute_rope(w, n_heads, head_dim):
    """Undo HF's rotate-half row permutation: RoPE pairs go back to rows (2i, 2i+1) of each head."""
    in_dim = w.shape[-1]
    return w.reshape(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(n_heads * head_dim, in_dim)


def convert_weights(weights, args, dtype):
    """Native name -> tensor: renamed, q/k/v fused, each a fresh contiguous copy (safe to save)."""
    def read(key, *shape):
        if key not in weights:
            raise ValueError(f"tensor {key!r} missing from checkpoint")
        tensor = weights.pop(key)()
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {key!r} has shape {list(tensor.shape)}, config.json implies {list(shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"tensor {key!r} is {str(tensor.dtype)[6:]}; a float weight belongs there (this "
                             f"converter reads unquantized checkpoints)")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"tensor {key!r} holds NaN or infinite values; the source checkpoint is damaged")
        return tensor.to(dtype=dtype or tensor.dtype, memory_format=torch.contiguous_format, copy=True)

    dim, inter, vocab = args.dim, args.intermediate_size, args.vocab_size
    q_rows, kv_rows = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    out = {"tok_embeddings.weight": read("model.embed_tokens.weight", vocab, dim)}
    for n in tqdm(range(args.n_layer), desc="converting layers", disable=None):
        hf, native = f"model.layers.{n}.", f"layers.{n}."
        q = unpermute_rope(read(hf + "self_attn.q_proj.weight", q_rows, dim), args.n_head, args.head_dim)
        k = unpermute_rope(read(hf + "self_attn.k_proj.weight", kv_rows, dim), args.n_kv_head, args.head_dim)
        v = read(hf + "self_attn.v_proj.weight", kv_rows, dim)  # v is not rotated: HF's row order is ours
        if args.qkv_bias:  # a bias is one more input column: its q and k rows are permuted as the weights' are
            bq = unpermute_rope(read(hf + "self_attn.q_proj.bias", q_rows)[:, None], args.n_head, args.head_dim)
            bk = unpermute_rope(read(hf + "self_attn.k_proj.bias", kv_rows)[:, None], args.n_kv_head, args.head_dim)
            bv = read(hf + "self_attn.v_proj.bias", kv_rows)
            out[native + "attention.bqkv"] = torch.cat([bq[:, 0], bk[:, 0], bv])  # wqkv's row order: q, k, v
        out[native + "attention_norm.weight"] = read(hf + "input_layernorm.weight", dim)
        out[native + "attention.wqkv.weight"] = torch.cat([q, k, v], dim=0)
        out[native + "attention.wo.weight"] = read(hf + "self_attn.o_proj.weight", dim, q_rows)
        out[native + "ffn_norm.weight"] = read(hf + "post_attention_layernorm.weight", dim)
        out[native + "feed_forward.w1.weight"] = read(hf + "mlp.gate_proj.weight", inter, dim)
        out[native + "feed_forward.w3.weight"] = read(hf + "mlp.up_proj.weight", inter, dim)
        out[native + "feed_forward.w2.weight"] = read(hf + "mlp.down_proj.weight", dim, inter)
    out["norm.weight"] = read("model.norm.weight", dim)
    if not args.tie_embeddings:
        out["output.weight"] = read("lm_head.weight", vocab, dim)
    # HF ties the head to the embedding on load and ignores a saved copy; old exports saved rotary buffers
    extra = [k for k in weights if not k.endswith(IGNORED_SUFFIX) and not (args.tie_embeddings and k == "lm_head.weight")]
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]!r} in checkpoint ({len(extra)} unexpected in all; "
                         f"config.json describes a {args.n_layer}-layer Llama)")
    return out


def convert_hf_checkpoint(checkpoint_dir, out_dir, dtype=None, force=False):
    """Convert the HF Llama checkpoint in `checkpoint_dir` into a native directory `out_dir`.

    dtype: None keeps each tensor's source dtype; else "bfloat16"/"float16"/"float32" or a
    torch.dtype. Raises ValueError (or OSError) with a one-line message on bad input.
    Returns out_dir as a Path.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if not checkpoint_dir.is_dir():
        raise ValueError(f"checkpoint directory {checkpoint_dir} does not exist")

    # Validate everything before creating or touching anything in out_dir.
    weights = open_weights(checkpoint_dir)  # only the names are read here; each tensor when it is converted
    args = read_model_args(checkpoint_dir, weights)
    tokenizer = find_tokenizer(checkpoint_dir)
    inputs = (checkpoint_dir, *tokenizer.values())
    checkpoint.check_writable(out_dir, force, inputs)
    tensors = convert_weights(weights, args, dtype)
    checkpoint.save(out_dir, args, tensors, tokenizer, {"format": "pt"}, force=force, inputs=inputs)

    n_params = sum(t.numel() for t in tensors.values())
    dtypes = "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}))
    print(f"converted {n_params:,} params ({dtypes}) to {out_dir / 'model.safetensors'}")
    return out_dir


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Convert a Hugging Face Llama checkpoint to the native format.")
    parser.add_argument("--checkpoint_dir", type=Path, required=True,
                        help="HF model directory with config.json, weights and tokenizer.json or tokenizer.model "
                        "(read only)")
    parser.add_argument("--out_dir", type=Path, required=True,
                        help="directory to write model.safetensors, config.json and the tokenizer files into")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="cast all weights to this dtype (default: keep the source dtype)")
    parser.add_argument("--force", action="store_true", help="replace an earlier converted checkpoint in "
                        "--out_dir (refused if the directory holds anything else)")
    return cli.one_line_errors(parser).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    convert_hf_checkpoint(args.checkpoint_dir, args.out_dir, dtype=args.dtype, force=args.force)


if __name__ == "__main__":
    cli.run_main(main)
