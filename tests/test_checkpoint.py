"""checkpoint.py: the one reader and writer of native checkpoints. Every tensor it hands out is 64-byte aligned,
whoever wrote the file, and writing never loses a file that was there."""
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from checkpoint import (cache_zeros, checkpoint_files, huge_pages, into_huge_pages, join_gate_up, load_model,
                        read_checkpoint, save)
from convert_hf_checkpoint import args_from_hf_config
from model import ModelArgs
from quantize import dequantize_int4, pack_nibbles, quantize_int4
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
def test_a_cpu_cache_tensor_of_2_mb_or_more_gets_2_mb_pages():
    t = cache_zeros((1, 4, 4097, 64), torch.bfloat16, "cpu")  # 2.0 MB and a tail
    assert t.is_contiguous() and not t.any()
    t.fill_(1)  # the first writes fault the pages in
    start = t.data_ptr()
    for mapping in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in mapping.split()[0].split("-"))
        if lo <= start < hi:
            huge_kb = int(re.search(r"AnonHugePages:\s+(\d+) kB", mapping).group(1))
            assert huge_kb == 2048  # the whole 2 MB page; the tail stays in 4 KB pages
            return
    raise AssertionError("no mapping holds the cache")


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
            f"print(m(torch.randint(0, 320, (1, 64)), m.context(torch.arange(64))).float().abs().sum().item())")
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


# ---- the feed-forward's gate and up layers: apart in the file, joined in the model -------------------------------

@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
def test_the_gate_and_up_layers_of_a_file_load_as_one_w13_gate_rows_first(checkpoint, tmp_path, mode):
    from quantize_checkpoint import quantize_checkpoint
    path = checkpoint if mode == "float" else quantize_checkpoint(checkpoint, mode, 32, out_dir=tmp_path / mode)
    stored = read_checkpoint(path, "cpu", torch.float32)[2]
    ff = load_model(path, "cpu", torch.float32).layers[1].feed_forward
    assert not hasattr(ff, "w1") and not hasattr(ff, "w3")
    tensors = ff.w13.state_dict()
    assert tensors.keys() == {"float": {"weight"}, "int8": {"weight", "scales"},
                              "int4": {"weight", "scales", "zeros"}}[mode]
    for name, t in tensors.items():
        assert torch.equal(t, torch.cat([stored[f"layers.1.feed_forward.{w}.{name}"] for w in ("w1", "w3")]))


def test_a_gate_and_an_up_stored_in_two_kinds_join_dequantized():
    torch.manual_seed(0)
    gate, up = torch.randn(8, 64), torch.randn(8, 64)
    q, scales, zeros = quantize_int4(gate, 32)
    p = "layers.0.feed_forward."
    state = {p + "w1.weight": pack_nibbles(q), p + "w1.scales": scales, p + "w1.zeros": zeros, p + "w3.weight": up}
    assert join_gate_up(state, 64, torch.float32).keys() == {p + "w13.weight"}
    assert torch.equal(state[p + "w13.weight"], torch.cat([dequantize_int4(q, scales, zeros), up]))


def test_saving_a_loaded_model_writes_the_w1_and_w3_it_was_read_from(checkpoint, tmp_path):
    model = load_model(checkpoint, "cpu", torch.float32)
    out = save(tmp_path / "out", model.args, model.state_dict(), checkpoint / "tokenizer.model")
    before, after = (read_checkpoint(p, "cpu", torch.float32)[2] for p in (checkpoint, out))
    assert "layers.0.feed_forward.w1.weight" in after and "layers.0.feed_forward.w13.weight" not in after
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_the_cpu_cache_of_a_loaded_model_comes_from_the_huge_page_allocator(checkpoint):
    assert load_model(checkpoint, "cpu", torch.float32).cache_zeros is cache_zeros


# ---- what a new user hits ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["file", "folder"])
def test_a_gguf_file_as_the_checkpoint_points_to_the_gguf_converter(tmp_path, given):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"GGUF file.*scripts/convert_gguf.py --gguf \S*m.gguf --out_dir"):
        checkpoint_files(tmp_path / "m.gguf" if given == "file" else tmp_path)


@pytest.mark.parametrize("text", ["[" * 100000, '{"a": ' * 100000])
def test_a_config_nested_too_deeply_is_refused_in_one_line_not_a_recursion_error(checkpoint, tmp_path, text):
    shutil.copytree(checkpoint, tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json is not a model config: it is nested too deeply"):
        load_model(tmp_path / "c", "cpu", torch.float32)


# ---- Hugging Face configs ----------------------------------------------------------------------------------------

def test_hf_config_reads_transformers4_and_5_layouts_alike():
    v4 = dict(model_type="llama", vocab_size=128256, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=8, hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072,
              rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0,
              low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(v4["rope_scaling"], rope_theta=500000.0)
    assert args_from_hf_config(v4) == args_from_hf_config(v5) == ModelArgs.from_name("Llama-3.1-8B")


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (dict(attention_bias=True), "o_proj"),
    (dict(embedding_multiplier=12.0), "embedding_multiplier"),  # Granite: Llama's tensors, other arithmetic
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "yarn"),
])
def test_hf_config_rejects_other_architectures(change, message):
    cfg = dict(model_type="llama", vocab_size=100, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
               intermediate_size=64)
    with pytest.raises(ValueError, match=message):
        args_from_hf_config({**cfg, **change})


def test_mistral_sliding_window_is_kept_and_does_not_cap_the_sequence_length():
    cfg = dict(model_type="mistral", vocab_size=32000, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
               rms_norm_eps=1e-5, sliding_window=4096)
    expected = dataclasses.replace(ModelArgs.from_name("Mistral-7B"), block_size=32768, sliding_window=4096)
    assert args_from_hf_config(cfg) == expected


@pytest.mark.parametrize("model_type", ["gpt2", "gemma", "phi3", "mixtral"])
def test_a_hf_config_of_another_architecture_is_refused_by_its_model_type(model_type):
    cfg = dict(model_type=model_type, vocab_size=100, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
               intermediate_size=64)
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported"):
        args_from_hf_config(cfg)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_a_hf_config_of_the_llama_layout_is_read_whatever_its_model_type(model_type):
    cfg = dict(model_type=model_type, vocab_size=100, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
               intermediate_size=64)
    assert args_from_hf_config(cfg).n_layer == 2


def test_a_gguf_file_given_as_a_checkpoint_names_the_conversion_into_this_projects_checkpoints(tmp_path):
    import checkpoint
    gguf = tmp_path / "site-packages" / "model.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError) as e:
        checkpoint.checkpoint_files(gguf)
    out = str(e.value).rsplit("--out_dir ", 1)[1]
    assert "convert it first" in str(e.value) and Path(out).resolve() == ROOT / "checkpoints" / "model.Q4_1"
