"""Native checkpoints, read and written here and nowhere else. A checkpoint is a directory:
  model.safetensors  the weights under model.py's names; a quantized one says its mode in the metadata
  config.json        the fields of model.ModelArgs
  tokenizer.model    SentencePiece or tiktoken (tokenizer.py tells which from the content)

load_model builds the model on the meta device (no memory, no init), memory-maps the weights and assigns them.
Every tensor it hands out starts on a 64-byte boundary: some CPU kernels (torch's int8 matmul on AVX-512) crash
on less. save pads the safetensors header so that the data starts on one, and puts the tensors whose sizes are
multiples of 64 bytes first; any tensor still misaligned, here or in a file another tool wrote, is copied."""
import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

import cpu_gemv
import quantize
from model import ModelArgs, Transformer

ALIGN = 64
TOKENIZER = "tokenizer.model"
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
    weights = path if path.is_file() else next((ckpt_dir / n for n in ("model.safetensors", "model.pth")
                                                if (ckpt_dir / n).is_file()), None)
    if weights is None or weights.suffix not in (".safetensors", ".pth"):
        raise ValueError(f"not a checkpoint: {path} has no model.safetensors (see scripts/convert_hf_checkpoint.py)")
    if not (ckpt_dir / "config.json").is_file():
        raise ValueError(f"not a checkpoint: {ckpt_dir} has no config.json")
    return ckpt_dir, weights


def read_config(ckpt_dir: Path) -> ModelArgs:
    try:
        cfg = json.loads((ckpt_dir / "config.json").read_text())
        if isinstance(cfg, dict) and "max_seq_len" in cfg:  # the name of block_size in older checkpoints
            cfg["block_size"] = cfg.pop("max_seq_len")
        return ModelArgs(**cfg)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{ckpt_dir / 'config.json'} is not a model config: {str(e).splitlines()[0]}") from None


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


def meta_model(args: ModelArgs, quantization: Optional[tuple[str, int]]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
        if quantization:  # int8/int4 layers in place of nn.Linear; the file's metadata says which
            quantize.install(model, *quantization)
    return model


def check_state(state: dict, args: ModelArgs, quantization, what: str):
    """Raise if the tensors are not exactly those the config (and quantization) describe."""
    expected = meta_model(args, quantization).state_dict()
    if args.tie_embeddings and not quantization:  # a quantized head is stored apart from the embedding
        expected.pop("output.weight")
    for k in sorted(expected.keys() | state.keys()):
        if k not in state or k not in expected:
            problem = "lacks" if k not in state else "has an unexpected"
            raise ValueError(f"{what} disagree: the weights {problem} tensor {k}")
        want, got = expected[k], state[k]
        if got.shape != want.shape or (got.is_floating_point() != want.is_floating_point()) or \
                (not want.is_floating_point() and got.dtype != want.dtype):
            raise ValueError(f"{what} disagree: {k} is {str(got.dtype)[6:]} {tuple(got.shape)}, "
                             f"they need {str(want.dtype)[6:]} {tuple(want.shape)}")


def read_checkpoint(checkpoint_path, device="cpu", dtype=torch.bfloat16) -> tuple[ModelArgs, Optional[tuple], dict]:
    """(config, quantization, tensors), checked against each other."""
    ckpt_dir, weights = checkpoint_files(checkpoint_path)
    args, quantization = read_config(ckpt_dir), read_quantization(weights)
    state = read_weights(weights, device, dtype)
    what = f"config.json{' and the ' + quantization[0] + ' metadata' if quantization else ''} and {weights.name}"
    check_state(state, args, quantization, what)
    return args, quantization, state


def build(args: ModelArgs, quantization, state: dict, device, dtype, cpu_kernels: str = "auto") -> Transformer:
    """The model holding `state`, with the device's fastest kernels installed."""
    model = meta_model(args, quantization)
    model.load_state_dict(state, assign=True, strict=False)
    if args.tie_embeddings and not quantization:  # assign replaced the shared Parameter, so tie it again
        model.output.weight = model.tok_embeddings.weight
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and cpu_kernels != "off":
        cpu_gemv.install(model)  # first: it takes the int4 layers it reads in their stored layout
    if quantization and dtype == torch.bfloat16:
        quantize.pack(model)  # the rest go to torch's int4 kernels, in their layout
    return model.eval()


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


def write_atomically(path: Path, write):
    """Write beside `path`, then rename: a crash leaves the old file or none, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_writable(out_dir: Path, force: bool, *extra: str):
    """Raise unless save() may write its files into out_dir: call it before long work, so that it fails fast."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory")
    present = [f for f in ("config.json", TOKENIZER, *extra, "model.safetensors") if (out_dir / f).exists()]
    if present and not force:
        raise ValueError(f"{out_dir / present[0]} already exists; pass --force to replace it")


def save(out_dir, args: ModelArgs, state: dict, tokenizer: Path, metadata: Optional[dict] = None,
         extra: Optional[dict] = None, force: bool = False) -> Path:
    """Write a checkpoint: state's tensors, args, a copy of the tokenizer file and `extra` {name: text}.
    Only the files it writes are replaced, and only with force; anything else in out_dir stays."""
    out_dir = Path(out_dir)
    check_writable(out_dir, force, *(extra or {}))
    tokenizer_bytes = Path(tokenizer).read_bytes()  # before anything is written: the source may be in out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {"config.json": json.dumps(dataclasses.asdict(args), indent=2) + "\n", **(extra or {})}
    for name, text in texts.items():
        write_atomically(out_dir / name, lambda tmp: tmp.write_text(text))
    write_atomically(out_dir / TOKENIZER, lambda tmp: tmp.write_bytes(tokenizer_bytes))
    write_atomically(out_dir / "model.safetensors", lambda tmp: write_safetensors(tmp, state, metadata))
    return out_dir
