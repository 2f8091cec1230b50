"""checkpoint.py: the one reader and writer of native checkpoints. Every tensor it hands out is 64-byte aligned,
whoever wrote the file, and writing never loses a file that was there."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from checkpoint import huge_pages, into_huge_pages, load_model, read_checkpoint, save
from conftest import mapping_of

ROOT = Path(__file__).resolve().parent.parent


def shift_data(src: Path, dst: Path, by: int = 8) -> Path:
    """A copy of a safetensors file whose header has `by` more trailing spaces: every tensor moves `by` bytes,
    as in files other tools write, which align the data to 8 bytes at most."""
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    dst.write_bytes((n + by).to_bytes(8, "little") + raw[8 : 8 + n] + b" " * by + raw[8 + n :])
    return dst


def copy_shifted(ckpt: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in ckpt.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    shift_data(ckpt / "model.safetensors", dst / "model.safetensors")
    return dst


def misaligned(path: Path) -> list[str]:
    with safe_open(path, "pt") as f:
        return [k for k in f.keys() if f.get_tensor(k).data_ptr() % 16]


def test_written_checkpoints_put_every_weight_matrix_on_a_64_byte_boundary(checkpoint, tmp_path):
    args, _, state = read_checkpoint(checkpoint, "cpu", torch.float32)
    out = save(tmp_path / "c", args, state, checkpoint / "tokenizer.model")
    with safe_open(out / "model.safetensors", "pt") as f:
        matrices = [k for k in f.keys() if f.get_tensor(k).dim() == 2]
        assert matrices and all(f.get_tensor(k).data_ptr() % 64 == 0 for k in matrices)


@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_parameter_and_buffer_is_64_byte_aligned_after_load(checkpoint, tmp_path, shifted, dtype):
    path = copy_shifted(checkpoint, tmp_path / "s") if shifted else checkpoint
    if shifted:
        assert misaligned(path / "model.safetensors")  # the premise: the raw file is misaligned
    model = load_model(path, "cpu", dtype)
    model.setup_caches(1, 16)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    assert [n for n, t in tensors if t.data_ptr() % 64] == []




@pytest.mark.skipif(not huge_pages(), reason="this Linux gives no transparent huge pages")
def test_loaded_weights_live_in_memory_that_asks_for_huge_pages_not_in_the_file(checkpoint):
    model = load_model(checkpoint, "cpu", torch.bfloat16)
    places = {n: mapping_of(t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert places and {n: p for n, p in places.items() if p[0] != "" or "hg" not in p[1]} == {}


@pytest.mark.skipif(not huge_pages(), reason="this Linux gives no transparent huge pages")
def test_moving_weights_into_huge_pages_keeps_their_values_and_a_tied_head_one_tensor():
    model = nn.ModuleDict({"emb": nn.Embedding(300, 64), "norm": nn.LayerNorm(64), "head": nn.Linear(64, 300)})
    model.head.weight = model.emb.weight
    model.register_buffer("steps", torch.arange(5))
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    into_huge_pages(model)
    assert model.head.weight is model.emb.weight and isinstance(model.head.weight, nn.Parameter)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert all("hg" in mapping_of(t.data_ptr())[1] for t in model.state_dict().values())


@pytest.mark.skipif(not huge_pages(), reason="this Linux gives no transparent huge pages")
def test_weights_stay_where_they_are_when_no_memory_can_be_mapped(monkeypatch):
    import checkpoint

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(checkpoint.mmap, "mmap", no_memory)
    layer = nn.Linear(64, 64)
    where = layer.weight.data_ptr()
    into_huge_pages(layer)
    assert layer.weight.data_ptr() == where


def test_int8_prefill_of_64_tokens_runs_from_a_file_whose_weights_sit_8_bytes_off(checkpoint, tmp_path):
    from quantize_checkpoint import quantize_checkpoint
    q = copy_shifted(quantize_checkpoint(checkpoint, "int8", out_dir=tmp_path / "q"), tmp_path / "q8")
    assert any(k.endswith("wqkv.weight") for k in misaligned(q / "model.safetensors"))
    # in a child process: torch's int8 matmul segfaults on a misaligned weight on AVX-512, and must not take the
    # test run down with it
    code = (f"import torch, checkpoint; m = checkpoint.load_model({str(q)!r}, 'cpu', torch.bfloat16); "
            f"m.setup_caches(1, 64); torch.manual_seed(0); "
            f"print(m(torch.randint(0, 320, (1, 64)), torch.arange(64)).float().abs().sum().item())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert float(result.stdout.split()[-1]) > 0


def test_save_refuses_a_non_empty_directory_without_force(checkpoint, tmp_path):
    args, _, state = read_checkpoint(checkpoint, "cpu", torch.float32)
    out = tmp_path / "out"
    save(out, args, state, checkpoint / "tokenizer.model")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="not empty"):
        save(out, args, state, checkpoint / "tokenizer.model")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_save_with_force_replaces_an_earlier_checkpoint(checkpoint, tmp_path):
    args, _, state = read_checkpoint(checkpoint, "cpu", torch.float32)
    out = tmp_path / "out"
    save(out, args, state, checkpoint / "tokenizer.model")
    save(out, args, {k: v + 1 for k, v in state.items()}, checkpoint / "tokenizer.model", force=True)
    assert torch.equal(read_checkpoint(out, "cpu", torch.float32)[2]["norm.weight"], state["norm.weight"] + 1)


def test_force_never_replaces_a_directory_that_holds_other_files(checkpoint, tmp_path):
    args, _, state = read_checkpoint(checkpoint, "cpu", torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="also holds notes.txt"):
        save(out, args, state, checkpoint / "tokenizer.model", force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "config.json").read_text() == "{}"


@pytest.mark.parametrize("where", ["input", "inside", "around"])
def test_save_never_writes_into_around_or_inside_its_input(checkpoint, tmp_path, where):
    args, _, state = read_checkpoint(checkpoint, "cpu", torch.float32)
    source = tmp_path / "a" / "src"
    shutil.copytree(checkpoint, source)
    out = {"input": source, "inside": source / "sub", "around": tmp_path / "a"}[where]
    with pytest.raises(ValueError, match="the input"):
        save(out, args, state, source / "tokenizer.model", force=True, inputs=[source])
    assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in checkpoint.iterdir())


def test_a_config_with_the_old_name_of_block_size_still_loads(checkpoint, tmp_path):
    old = copy_shifted(checkpoint, tmp_path / "old")
    cfg = json.loads((old / "config.json").read_text())
    cfg["max_seq_len"] = cfg.pop("block_size")
    (old / "config.json").write_text(json.dumps(cfg))
    assert load_model(old, "cpu", torch.float32).args.block_size == cfg["max_seq_len"]



def test_an_interrupted_save_leaves_the_earlier_checkpoint_whole(checkpoint, tmp_path, monkeypatch):
    import checkpoint as ckpt
    args, _, state = read_checkpoint(checkpoint, "cpu", torch.float32)
    out = save(tmp_path / "out", args, state, checkpoint / "tokenizer.model")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(path, *a, **k):  # Ctrl-C halfway through writing the weights
        path.write_bytes(b"half")
        raise KeyboardInterrupt
    monkeypatch.setattr(ckpt, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(out, args, state, checkpoint / "tokenizer.model", force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it
