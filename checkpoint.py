"""Native checkpoints, read and written here and nowhere else. A checkpoint is a directory:
  model.safetensors  the weights under model.py's names, except that each feed-forward's gate and up layers are
                     kept apart as w1 and w3 (the model joins them as w13 on load); a quantized file says its mode
                     in the metadata
  config.json        the fields of model.ModelArgs
  tokenizer.model    SentencePiece or tiktoken, or tokenizer.json (tokenizer.py tells which from the content),
                     with tokenizer_config.json, generation_config.json and chat_template.jinja where the model has them

load_model builds the model on the meta device (no memory, no init), memory-maps the weights and assigns them.
Every tensor it hands out starts on a 64-byte boundary: some CPU kernels (torch's int8 matmul on AVX-512) crash
on less. save pads the safetensors header so that the data starts on one, and puts the tensors whose sizes are
multiples of 64 bytes first; any tensor still misaligned, here or in a file another tool wrote, is copied."""
import dataclasses
import json
import math
import mmap
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

import cpu_gemv
import cuda_gemv
import quantize
from cli import available_memory
from model import ModelArgs, Transformer
from tokenizer import Tokenizer

ALIGN = 64
TOKENIZER = "tokenizer.model"
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER, "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL"}


# ---- reading -----------------------------------------------------------------------------------------------------

def checkpoint_files(checkpoint_path) -> tuple[Path, Path]:
    """The checkpoint's directory and weights file; a ValueError naming what is wrong if it is not one."""
    path = Path(checkpoint_path)
    if not path.exists():
        raise ValueError(f"checkpoint not found: {path}")
    ckpt_dir = path if path.is_dir() else path.parent
    if path.is_dir() and not any(path.iterdir()):
        raise ValueError(f"checkpoint directory is empty: {path}")
    if is_hf_checkpoint(ckpt_dir):
        raise ValueError(f"{ckpt_dir} is a Hugging Face checkpoint; convert it first: python "
                         f"{script('convert_hf_checkpoint.py')} --checkpoint_dir {ckpt_dir} "
                         f"--out_dir {ckpt_dir}-native")
    weights = path if path.is_file() else next((ckpt_dir / n for n in ("model.safetensors", "model.pth")
                                                if (ckpt_dir / n).is_file()), None)
    ggufs = [path] if path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    if ggufs and (weights is None or weights == ggufs[0]):
        gguf = ggufs[0]
        out = project_path("checkpoints", gguf.stem)  # in this project's checkpoints/, not beside a wheel's file
        raise ValueError(f"{gguf} is a GGUF file (llama.cpp's format); convert it first: python "
                         f"{script('convert_gguf.py')} --gguf {gguf} --out_dir {out}")
    if weights is None or weights.suffix not in (".safetensors", ".pth"):
        raise ValueError(f"not a checkpoint: {path} has no model.safetensors (see scripts/convert_hf_checkpoint.py)")
    if not (ckpt_dir / "config.json").is_file():
        raise ValueError(f"not a checkpoint: {ckpt_dir} has no config.json")
    return ckpt_dir, weights


def script(name: str) -> str:
    return project_path("scripts", name)


def project_path(*parts: str) -> str:
    """How to name a path of this project on a command line: relative to the working directory when below it."""
    path = Path(__file__).resolve().parent.joinpath(*parts)
    return str(path) if os.path.relpath(path).startswith("..") else os.path.relpath(path)


def read_json(path: Path, what: str = "valid JSON"):
    """The value in a JSON file, or a ValueError naming the file. Python's parser recurses once per nesting level,
    so a file of a hundred thousand '[' would otherwise end in a RecursionError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not {what}: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ValueError(f"{path} is not {what}: it is nested too deeply") from None


def is_hf_checkpoint(ckpt_dir: Path) -> bool:
    """A Hugging Face model folder: its config.json names the architecture (ours holds ModelArgs' fields only)."""
    try:
        cfg = read_json(ckpt_dir / "config.json")
        return isinstance(cfg, dict) and ("model_type" in cfg or "architectures" in cfg)
    except (OSError, ValueError):
        return False


def check_config(cfg, where: str) -> ModelArgs:
    """ModelArgs from a config dict, every field checked for type and range first: a string where a number
    belongs, or a zero, would otherwise fail deep in the model or, worse, run and produce garbage."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} does not hold a JSON object of model fields")
    if "max_seq_len" in cfg:  # the name of block_size in older checkpoints
        cfg = {**cfg, "block_size": cfg["max_seq_len"]}
        del cfg["max_seq_len"]
    fields = {f.name: f.type for f in dataclasses.fields(ModelArgs)}
    for key, value in cfg.items():
        kind = fields.get(key)
        problem = None
        if kind is None:
            problem = f"is not a model field (known: {', '.join(fields)})"
        elif kind is int and type(value) is not int:
            problem = f"must be a whole number, got {value!r}"
        elif kind is float and (type(value) not in (int, float) or not math.isfinite(value)):
            problem = f"must be a finite number, got {value!r}"
        elif kind is bool and type(value) is not bool:
            problem = f"must be true or false, got {value!r}"
        elif key == "rope_scaling" and value is not None and not (isinstance(value, dict) and all(
                type(value.get(k)) in (int, float) and math.isfinite(value[k]) and value[k] > 0 for k in
                ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))):
            problem = ("must be null or an object of positive numbers factor, low_freq_factor, high_freq_factor "
                       "and original_max_position_embeddings")
        elif key == "rope_base" and value <= 0 or key == "norm_eps" and not 0 < value < 1:
            problem = f"is out of range: {value!r}"
        elif key == "sliding_window" and value < 0:
            problem = f"must be 0 (no window) or a positive whole number, got {value}"
        elif kind is int and value < 1 and key not in ("n_kv_head", "head_dim", "intermediate_size", "sliding_window"):
            problem = f"must be at least 1, got {value}"
        if problem:
            raise ValueError(f"{where}: {key} {problem}; fix that field")
    try:
        return ModelArgs(**cfg)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def read_config(ckpt_dir: Path) -> ModelArgs:
    path = ckpt_dir / "config.json"
    return check_config(read_json(path, "a model config"), str(path))


def read_quantization(weights: Path) -> Optional[tuple[str, int]]:
    """(mode, groupsize) from a quantized checkpoint's safetensors metadata (see quantize.py); None if float."""
    if weights.suffix != ".safetensors":
        return None
    try:
        with safe_open(weights, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        raise ValueError(f"cannot read {weights} (truncated or not a weights file): {str(e).splitlines()[0]}") from None
    mode, groupsize = meta.get("quantization"), meta.get("groupsize", "0")
    if mode is None:
        return None
    if mode not in ("int8", "int4") or mode == "int4" and groupsize not in map(str, quantize.GROUPSIZES):
        raise ValueError(f"{weights} has unknown quantization metadata: quantization={mode!r}, groupsize={groupsize!r}")
    return mode, int(groupsize)


def aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % ALIGN == 0 else t.clone()  # torch's allocators align to 64 bytes or more


def read_weights(weights: Path, device, dtype) -> dict:
    """Tensors straight from the mmap'd file to the device, one at a time: no second full copy in RAM."""
    cast = lambda t: aligned(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype))
    try:
        if weights.suffix == ".pth":  # never unpickle arbitrary objects
            return {k: cast(t) for k, t in torch.load(weights, mmap=True, weights_only=True).items()}
        with safe_open(weights, framework="pt", device="cpu") as f:
            return {k: cast(f.get_tensor(k)) for k in f.keys()}
    except Exception as e:  # safetensors and torch.load raise many types for truncated or foreign files
        raise ValueError(f"cannot read {weights} (truncated or not a weights file): {str(e).splitlines()[0]}") from None


def meta_model(args: ModelArgs, quantization: Optional[tuple[str, int]], names=None) -> Transformer:
    """names: the file's tensor names, which say each layer's kind where a file mixes them (quantize.install)."""
    with torch.device("meta"):
        model = Transformer(args)
        if quantization:  # int8/int4 layers in place of nn.Linear; the file's metadata says which
            quantize.install(model, *quantization, names)
    return model


def stored_gate_up(args: ModelArgs, quantization, names) -> nn.Module:
    """Every layer's gate (w1) and up (w3) layers as a file stores them, on the meta device, under the file's names
    (the model holds them joined: see join_gate_up)."""
    linear = lambda: nn.Linear(args.dim, args.intermediate_size, bias=False)  # noqa: E731
    with torch.device("meta"):
        layers = nn.ModuleList(nn.ModuleDict({"feed_forward": nn.ModuleDict({"w1": linear(), "w3": linear()})})
                               for _ in range(args.n_layer))
        module = nn.ModuleDict({"layers": layers})
        return quantize.install(module, *quantization, names) if quantization else module


def dequantized(parts: dict, in_features: int, dtype) -> torch.Tensor:  # a layer's stored tensors -> [N, K] float
    if "zeros" in parts:
        w = quantize.dequantize_int4(quantize.unpack_nibbles(parts["weight"]), parts["scales"], parts["zeros"])
        return w[:, :in_features].to(dtype)
    if "scales" in parts:
        return quantize.dequantize_int8(parts["weight"], parts["scales"]).to(dtype)
    return parts["weight"].to(dtype)


def join_gate_up(state: dict, in_features: int, dtype) -> dict:
    """Each layer's gate (w1) and up (w3) tensors joined, in place, into the model's w13: the gate's rows, then the
    up's. Float, int8 and int4 layouts all keep output rows on dim 0 (see quantize.py), so they join as stored; a
    gate and an up of two kinds (a GGUF import may mix them) are both dequantized to `dtype` first."""
    for key in [k for k in state if k.endswith(".feed_forward.w1.weight")]:
        prefix = key.removesuffix("w1.weight")
        gate, up = ({k.rsplit(".", 1)[1]: state.pop(k) for k in list(state) if k.startswith(f"{prefix}{w}.")}
                    for w in ("w1", "w3"))
        if gate.keys() != up.keys():
            gate, up = ({"weight": dequantized(p, in_features, dtype)} for p in (gate, up))
        state.update({f"{prefix}w13.{name}": torch.cat([gate[name], up[name]]) for name in gate})
    return state


def split_gate_up(state: dict) -> dict:
    """A model's tensors as a file keeps them: each w13 split back into the w1 and w3 it was joined from."""
    out = {}
    for k, t in state.items():
        if ".feed_forward.w13." in k:
            out[k.replace(".w13.", ".w1.")], out[k.replace(".w13.", ".w3.")] = t.chunk(2)
        else:
            out[k] = t
    return out


def float_head(model: Transformer) -> bool:
    return type(model.output) is torch.nn.Linear


def check_state(state: dict, args: ModelArgs, quantization, what: str):
    """Raise if the tensors, as a file stores them, are not exactly those the config (and quantization) describe."""
    model, gate_up = meta_model(args, quantization, state.keys()), stored_gate_up(args, quantization, state.keys())
    kinds = {type(m) for m in (*model.modules(), *gate_up.modules())}
    if quantization and {"int8": quantize.Int8Linear, "int4": quantize.Int4Linear}[quantization[0]] not in kinds:
        raise ValueError(f"{what} disagree: no layer holds {quantization[0]} tensors")
    expected = {k: t for k, t in model.state_dict().items() if ".feed_forward.w13." not in k} | gate_up.state_dict()
    if args.tie_embeddings and float_head(model):  # a quantized head is stored apart from the embedding
        expected.pop("output.weight")
    for k in sorted(expected.keys() | state.keys()):
        if k not in state or k not in expected:
            problem = "lack" if k not in state else "have an unexpected"
            raise ValueError(f"{what} disagree: the weights {problem} tensor {k}")
        want, got = expected[k], state[k]
        if got.shape != want.shape or (got.is_floating_point() != want.is_floating_point()) or \
                (not want.is_floating_point() and got.dtype != want.dtype):
            raise ValueError(f"{what} disagree: {k} is {str(got.dtype)[6:]} {tuple(got.shape)}, "
                             f"they need {str(want.dtype)[6:]} {tuple(want.shape)}")


def tensor_sizes(weights: Path) -> dict[str, tuple[bool, int, int]]:
    """name -> (floating point, elements, bytes per element), from the file's header alone: nothing is read."""
    try:
        if weights.suffix == ".pth":
            state = torch.load(weights, mmap=True, weights_only=True)
            return {k: (t.is_floating_point(), t.numel(), t.element_size()) for k, t in state.items()}
        dtypes = {v: k for k, v in ST_DTYPES.items()}
        with safe_open(weights, framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            return {k: (dtypes[s.get_dtype()].is_floating_point, math.prod(s.get_shape()),
                        dtypes[s.get_dtype()].itemsize) for k, s in slices.items()}
    except Exception as e:  # safetensors and torch.load raise many types for truncated or foreign files
        raise ValueError(f"cannot read {weights} (truncated or not a weights file): {str(e).splitlines()[0]}") from None


def check_layers(args: ModelArgs, names, weights: Path):
    """Before the model is built: a config that claims a million layers would build them until memory ran out."""
    layers = {n.split(".")[1] for n in names if n.startswith("layers.")}
    if len(layers) != args.n_layer:
        raise ValueError(f"{weights.parent / 'config.json'} says n_layer {args.n_layer} but {weights.name} holds "
                         f"{len(layers)} layers; fix n_layer")


def memory_needed(args: ModelArgs, sizes: dict, dtype, batch: int = 0, seq_len: int = 0, prompt_len: int = 0,
                  share: int = 1, kv_int8: bool = False) -> dict:
    """Bytes, roughly: the weights in `dtype` (quantized ones as stored), the KV cache for batch x seq_len (in
    `dtype`, or int8 with float32 scales: see model.KVCache), and prefill's largest activations (the logits of
    every prompt position, the MLP's hidden states, the attention scores), each divided over `share` ranks."""
    elt = torch.finfo(dtype).bits // 8
    weights = sum(n * (elt if floating else size) for floating, n, size in sizes.values())
    blocks = args.head_dim // 32 if args.head_dim % 32 == 0 else 1  # V's scales per position (K has one)
    per_head = args.head_dim + 2 + 2 * blocks if kv_int8 else args.head_dim * elt  # the mean of K's and V's
    kv = 2 * args.n_layer * batch * args.n_kv_head * seq_len * per_head
    # the MLP holds 4 x intermediate_size a token at once: w13's gate and up, silu(gate), and their product
    acts = batch * prompt_len * ((args.vocab_size + 4 * args.dim + 4 * args.intermediate_size) * elt
                                 + args.n_head * seq_len * 4)
    return {"weights": weights // share, "KV cache": kv // share, "activations": acts // share}


def check_memory(needed: dict, device, fix: str):
    total, available = sum(needed.values()), available_memory(torch.device(device))
    if total > available:
        parts = " + ".join(f"{k} {v / 1e9:.2f}" for k, v in needed.items() if v)
        raise ValueError(f"this needs about {total / 1e9:.1f} GB ({parts} GB) but {torch.device(device)} has "
                         f"{available / 1e9:.1f} GB available; {fix}")


def plan(checkpoint_path, device="cpu", dtype=torch.bfloat16, batch: int = 0, seq_len: int = 0,
         prompt_len: int = 0, share: int = 1, kv_int8: bool = False) -> ModelArgs:
    """Every check that reads no weights: the files, the config, the layer count, and the memory the weights and
    a cache for batch x seq_len need against what `device` has. Call it before allocating anything."""
    ckpt_dir, weights = checkpoint_files(checkpoint_path)
    args = read_config(ckpt_dir)
    sizes = tensor_sizes(weights)
    check_layers(args, sizes, weights)
    fix = "lower --batch_size or --max_seq_length" if batch else "use a quantized checkpoint or a larger machine"
    check_memory(memory_needed(args, sizes, dtype, batch, seq_len, prompt_len, share, kv_int8), device, fix)
    return args


def check_finite(state: dict, weights: Path):
    """One NaN in any weight turns every later logit into NaN: refuse the file instead of printing garbage."""
    for k, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{weights}: tensor {k} holds NaN or infinite values; the file is damaged "
                             f"(convert or download it again)")


def read_checkpoint(checkpoint_path, device="cpu", dtype=torch.bfloat16) -> tuple[ModelArgs, Optional[tuple], dict]:
    """(config, quantization, tensors), checked against each other before and after reading."""
    plan(checkpoint_path, device, dtype)
    ckpt_dir, weights = checkpoint_files(checkpoint_path)
    args, quantization = read_config(ckpt_dir), read_quantization(weights)
    state = read_weights(weights, device, dtype)
    what = f"config.json{' and the ' + quantization[0] + ' metadata' if quantization else ''} and {weights.name}"
    check_state(state, args, quantization, what)
    check_finite(state, weights)
    return args, quantization, state


def tokenizer_files(folder: Path) -> dict[str, Path]:
    """The tokenizer and its companions present in a checkpoint (or Hugging Face) folder, by name."""
    return {n: Path(folder) / n for n in TOKENIZER_FILES if (Path(folder) / n).is_file()}


def tokenizer_path(folder: Path) -> Path:
    """tokenizer.json where there is one (it carries the added and special tokens), else tokenizer.model."""
    files = tokenizer_files(folder)
    return files.get("tokenizer.json", files.get(TOKENIZER, Path(folder) / TOKENIZER))


def load_tokenizer(checkpoint_path, args: ModelArgs) -> Tokenizer:
    """The checkpoint's tokenizer, refused if it names tokens the model has no row for."""
    path = tokenizer_path(checkpoint_files(checkpoint_path)[0])
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(f"{path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{args.vocab_size}: that tokenizer belongs to another model")
    return tokenizer


def build(args: ModelArgs, quantization, state: dict, device, dtype, cpu_kernels: str = "auto") -> Transformer:
    """The model holding `state` (as a file stores it), with the device's fastest kernels installed. `state` is
    emptied: its tensors belong to the model now (on the CPU, copied into huge pages and each original freed as it
    goes)."""
    state = join_gate_up(state, args.dim, dtype)
    model = meta_model(args, quantization, state.keys())
    model.load_state_dict(state, assign=True, strict=False)
    state.clear()
    if args.tie_embeddings and float_head(model):  # assign replaced the shared Parameter, so tie it again
        model.output.weight = model.tok_embeddings.weight
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and cpu_kernels != "off":
        cpu_gemv.install(model)  # first: it takes the int4 layers it reads in their stored layout
    if torch.device(device).type == "cuda" and dtype == torch.bfloat16:
        cuda_gemv.install(model)  # on a GPU the bf16 and int8 layers; int4 ones stay for quantize.pack
    if quantization and dtype == torch.bfloat16:
        quantize.pack(model)  # the rest go to torch's int4 kernels, in their layout
    if torch.device(device).type == "cpu":
        into_huge_pages(model)
        model.cache_zeros = cache_zeros
    return model.eval()


def huge_pages() -> bool:
    """Whether Linux gives 2 MB pages (transparent huge pages) to memory that asks for them."""
    try:
        return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in \
            Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def huge_page_block(nbytes: int, tail: bool = True) -> Optional[torch.Tensor]:  # -> [nbytes] uint8, zeros
    """nbytes of anonymous memory that asks for 2 MB pages, starting on a 2 MB boundary; the tensor keeps the
    mapping alive (views of it too). tail=False leaves the part past the last whole 2 MB page in 4 KB pages, so it
    takes no more memory than it holds. None where Linux gives no huge pages or the mapping does not fit."""
    if not huge_pages():
        return None
    try:
        # private anonymous memory reads as zeros (a shared mapping would be shmem, which THP leaves alone)
        block = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory = torch.frombuffer(block, dtype=torch.uint8)
        start = -memory.data_ptr() % (2 << 20)
        length = nbytes if tail else nbytes // (2 << 20) * (2 << 20)
        if length:
            block.madvise(mmap.MADV_HUGEPAGE, start, length)
    except OSError:  # a memory limit
        return None
    return memory[start:start + nbytes]


def cache_zeros(shape: tuple, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """The KV cache's allocator on the CPU (model.cache_zeros): a tensor of 2 MB or more lies in 2 MB pages where
    Linux grants them. A decode step reads the whole cache, and in 4 KB pages it would miss the TLB every 4 KB
    and stop the prefetchers (HOW_IT_WORKS.md, "A static KV cache")."""
    n = math.prod(shape) * dtype.itemsize
    block = huge_page_block(n, tail=False) if torch.device(device).type == "cpu" and n >= 2 << 20 else None
    return torch.zeros(shape, dtype=dtype, device=device) if block is None else block.view(dtype).view(shape)


def into_huge_pages(model: nn.Module):
    """Every CPU weight moved into one anonymous block that asks for 2 MB pages. Decoding reads all the weights
    every step; in the memory-mapped file they sit in 4 KB pages of the page cache, a TLB miss every 4 KB
    (HOW_IT_WORKS.md, "Loading"). Each original is dropped once copied, so memory holds one copy (a file's pages
    stay only as cache)."""
    slots = [(m, kind, name) for m in model.modules() for kind in ("_parameters", "_buffers")
             for name, t in getattr(m, kind).items()
             if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.nbytes]
    sizes = {id(t): -(-t.nbytes // ALIGN) * ALIGN for m, kind, name in slots for t in [getattr(m, kind)[name]]}
    memory = huge_page_block(sum(sizes.values())) if slots else None
    if memory is None:  # no huge pages, or no room for a second mapping: the weights stay in the file's pages
        return
    offset, moved = 0, {}
    for m, kind, name in slots:
        t = getattr(m, kind)[name]
        if id(t) not in moved:  # a tied head shares the embedding's tensor: one copy for both
            new = memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            moved[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
            offset += sizes[id(t)]
        getattr(m, kind)[name] = moved[id(t)]


def load_model(checkpoint_path, device="cpu", dtype=torch.bfloat16, cpu_kernels: str = "auto") -> Transformer:
    """The checkpoint's model on `device`, weights in `dtype` (quantized weights keep theirs). cpu_kernels="off"
    keeps torch's own CPU kernels instead of cpu_gemv.py's."""
    return build(*read_checkpoint(checkpoint_path, device, dtype), device, dtype, cpu_kernels)


# ---- writing -----------------------------------------------------------------------------------------------------

def write_safetensors(path: Path, state: dict, metadata: Optional[dict] = None):
    """The safetensors format, laid out so that every tensor whose size is a multiple of 64 bytes (every weight
    matrix of a real model) starts on a 64-byte boundary once the file is memory-mapped."""
    tensors = [(k, t.detach().contiguous().cpu()) for k, t in state.items()]
    tensors.sort(key=lambda kt: (kt[1].nbytes % ALIGN != 0, kt[0]))  # aligned sizes first keep each other aligned
    header, offset = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}, 0
    for k, t in tensors:
        header[k] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # trailing spaces are allowed: the data starts on a boundary
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _, t in tensors:
            f.write(t.reshape(-1).view(torch.uint8).numpy().data if t.nbytes else b"")


def is_native_checkpoint(path: Path) -> bool:
    """A directory this project wrote: a config of ModelArgs' fields and weights under model.py's names."""
    try:
        read_config(path)
        with safe_open(path / "model.safetensors", framework="pt") as f:
            return "tok_embeddings.weight" in f.keys()
    except Exception:  # anything unreadable is not ours
        return False


def check_writable(out_dir: Path, force: bool, inputs=(), extra=()):
    """Raise unless save() may write into out_dir: a new or empty directory, or with force one that holds an
    earlier checkpoint and nothing else; never an input, nor a directory inside or around one. Call it before
    long work, so that it fails fast."""
    out = Path(out_dir).resolve()
    for source in map(lambda p: Path(p).resolve(), inputs):
        if out == source or out in source.parents or source in out.parents:
            where = "is" if out == source else "contains" if out in source.parents else "is inside"
            raise ValueError(f"--out_dir {out_dir} {where} the input {source}; choose a directory apart from it")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out_dir {out_dir} exists and is not a directory")
    parent = next(p for p in out.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK) or out.is_dir() and not os.access(out, os.W_OK):
        raise ValueError(f"--out_dir {out_dir} is not writable")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not force:
        raise ValueError(f"--out_dir {out_dir} is not empty; choose a new directory, or pass --force to replace "
                         f"an earlier checkpoint there")
    ours = {"config.json", *TOKENIZER_FILES, "model.safetensors", *extra}
    foreign = [n for n in present if n not in ours]
    if foreign or present and not is_native_checkpoint(out):
        held = f"also holds {foreign[0]}" if foreign else "does not hold one"
        raise ValueError(f"--force replaces only an earlier checkpoint, and {out_dir} {held}; "
                         f"choose another directory")


def save(out_dir, args: ModelArgs, state: dict, tokenizer, metadata: Optional[dict] = None,
         extra: Optional[dict] = None, force: bool = False, inputs=()) -> Path:
    """Write a checkpoint: state's tensors (a model's w13 as w1 and w3), args, the tokenizer and `extra`
    {name: text}. tokenizer is a file (copied as tokenizer.model, or under its name if it is one of
    TOKENIZER_FILES) or {name: Path or text}.
    check_writable decides whether out_dir may be written. The files go to a sibling directory that is then
    renamed into place, so an interrupted save leaves the earlier checkpoint or none, never a mix of the two."""
    out_dir = Path(out_dir)
    check_writable(out_dir, force, inputs, extra or {})
    full = out_dir.resolve()  # "." has no name to put beside it
    tmp, old = (full.with_name(f".{full.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    try:
        tmp.mkdir(parents=True)
        if not isinstance(tokenizer, dict):
            tokenizer = {Path(tokenizer).name if Path(tokenizer).name in TOKENIZER_FILES else TOKENIZER: tokenizer}
        texts = {"config.json": json.dumps(dataclasses.asdict(args), indent=2) + "\n", **tokenizer, **(extra or {})}
        for name, text in texts.items():
            if isinstance(text, str):
                (tmp / name).write_text(text, encoding="utf-8")
            else:
                shutil.copyfile(text, tmp / name)
        write_safetensors(tmp / "model.safetensors", split_gate_up(state), metadata)
        if full.is_dir() and any(full.iterdir()):  # an earlier checkpoint (check_writable said so)
            os.replace(full, old)
        os.replace(tmp, full)  # onto a missing or empty directory: one rename
    finally:
        if old.exists() and not full.exists():  # the last rename failed: put the earlier checkpoint back
            os.replace(old, full)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
