"""Tests for scripts/convert_hf_checkpoint.py on tiny random HF Llama checkpoints."""
import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers  # noqa: E402 - the reference implementation, a test dependency

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "convert_hf_checkpoint.py"
sys.path.insert(0, str(REPO / "scripts"))
from convert_hf_checkpoint import args_from_hf_config, convert_hf_checkpoint  # noqa: E402

from conftest import errors_of

N_HEAD, N_KV_HEAD, HEAD_DIM, DIM, N_LAYER = 4, 2, 8, 32, 2
TOKENIZER_BYTES = b"\x00not a real tokenizer\xff\n"  # copied verbatim, never parsed


def tiny_llama(tie=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=DIM, intermediate_size=48, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=N_KV_HEAD, head_dim=HEAD_DIM,
        max_position_embeddings=128, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


def save_hf_dir(path, model, **save_kwargs):
    model.save_pretrained(path, **save_kwargs)
    (path / "tokenizer.model").write_bytes(TOKENIZER_BYTES)
    return path


def state_dict_copy(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def save_bin_dir(path, model, sharded):
    """A transformers-4-style .bin checkpoint (transformers 5 only writes safetensors)."""
    path.mkdir()
    (path / "config.json").write_text(model.config.to_json_string())
    (path / "tokenizer.model").write_bytes(TOKENIZER_BYTES)
    state = state_dict_copy(model)
    if not sharded:
        torch.save(state, path / "pytorch_model.bin")
        return path
    keys = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    for name, shard_keys in shards.items():
        torch.save({k: state[k] for k in shard_keys}, path / name)
    weight_map = {k: name for name, shard_keys in shards.items() for k in shard_keys}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def rewrite_weights(hf_dir, edit):
    """Replace hf_dir's single model.safetensors with edit(state_dict)."""
    path = hf_dir / "model.safetensors"
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def dir_hashes(path):
    return {p.relative_to(path): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def run_cli(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def hf_dir(tmp_path, model):
    return save_hf_dir(tmp_path / "hf", model)


@pytest.fixture
def native(hf_dir, tmp_path):
    return load_file(convert_hf_checkpoint(hf_dir, tmp_path / "native") / "model.safetensors")


def test_native_keys_and_shapes_follow_the_format(native):
    q_rows, kv_rows = N_HEAD * HEAD_DIM, N_KV_HEAD * HEAD_DIM
    assert native["tok_embeddings.weight"].shape == (64, DIM)
    assert native["layers.1.attention.wqkv.weight"].shape == (q_rows + 2 * kv_rows, DIM)
    assert native["layers.1.attention.wo.weight"].shape == (DIM, q_rows)
    assert native["layers.1.feed_forward.w2.weight"].shape == (DIM, 48)
    assert native["output.weight"].shape == (64, DIM)
    assert len(native) == 2 + N_LAYER * 7 + 1


def test_wqkv_reapplying_hf_permutation_recovers_q_k_v(native, model):
    def meta_to_hf(w, n_heads):  # the permutation HF's conversion script applied to Meta's weights
        return w.view(n_heads, HEAD_DIM // 2, 2, DIM).transpose(1, 2).reshape(n_heads * HEAD_DIM, DIM)

    attn = model.model.layers[1].self_attn
    kv_rows = N_KV_HEAD * HEAD_DIM
    q, k, v = native["layers.1.attention.wqkv.weight"].split([N_HEAD * HEAD_DIM, kv_rows, kv_rows])
    assert not torch.equal(q, attn.q_proj.weight)  # the layouts really differ, so the check below means something
    assert torch.equal(meta_to_hf(q, N_HEAD), attn.q_proj.weight)
    assert torch.equal(meta_to_hf(k, N_KV_HEAD), attn.k_proj.weight)
    assert torch.equal(v, attn.v_proj.weight)


def test_other_weights_are_copied_unchanged(native, model):
    layer = model.model.layers[0]
    assert torch.equal(native["tok_embeddings.weight"], model.model.embed_tokens.weight)
    assert torch.equal(native["layers.0.attention_norm.weight"], layer.input_layernorm.weight)
    assert torch.equal(native["layers.0.ffn_norm.weight"], layer.post_attention_layernorm.weight)
    assert torch.equal(native["layers.0.attention.wo.weight"], layer.self_attn.o_proj.weight)
    assert torch.equal(native["layers.0.feed_forward.w1.weight"], layer.mlp.gate_proj.weight)
    assert torch.equal(native["layers.0.feed_forward.w3.weight"], layer.mlp.up_proj.weight)
    assert torch.equal(native["layers.0.feed_forward.w2.weight"], layer.mlp.down_proj.weight)
    assert torch.equal(native["norm.weight"], model.model.norm.weight)
    assert torch.equal(native["output.weight"], model.lm_head.weight)


def test_config_json_holds_model_args_and_tokenizer_is_copied(hf_dir, tmp_path):
    out = convert_hf_checkpoint(hf_dir, tmp_path / "native")
    expected = args_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    assert json.loads((out / "config.json").read_text()) == dataclasses.asdict(expected)
    assert (out / "tokenizer.model").read_bytes() == TOKENIZER_BYTES


def test_sharded_safetensors_matches_single_file(native, model, tmp_path):
    sharded = save_hf_dir(tmp_path / "sharded", model, max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    out = convert_hf_checkpoint(sharded, tmp_path / "native_sharded")
    assert_same_tensors(load_file(out / "model.safetensors"), native)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_bin_checkpoint_matches_safetensors(native, model, tmp_path, sharded):
    bin_dir = save_bin_dir(tmp_path / "bin", model, sharded)
    out = convert_hf_checkpoint(bin_dir, tmp_path / "native_bin")
    assert_same_tensors(load_file(out / "model.safetensors"), native)


def test_safetensors_preferred_over_bin(hf_dir, tmp_path):
    torch.save({"model.embed_tokens.weight": torch.zeros(3)}, hf_dir / "pytorch_model.bin")  # would fail if read
    out = convert_hf_checkpoint(hf_dir, tmp_path / "native")
    assert (out / "model.safetensors").is_file()


def test_source_files_are_byte_identical_after_conversion(model, tmp_path):
    src = save_hf_dir(tmp_path / "hf", model, max_shard_size="20KB")
    before = dir_hashes(src)
    convert_hf_checkpoint(src, tmp_path / "native", dtype="bfloat16")
    assert dir_hashes(src) == before


def test_dtype_flag_casts_every_tensor(hf_dir, tmp_path):
    out = convert_hf_checkpoint(hf_dir, tmp_path / "native", dtype="bfloat16")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


def test_tied_embeddings_omit_output_weight(tmp_path):
    src = save_hf_dir(tmp_path / "hf", tiny_llama(tie=True))
    tensors = load_file(convert_hf_checkpoint(src, tmp_path / "native") / "model.safetensors")
    assert "output.weight" not in tensors and "tok_embeddings.weight" in tensors


def test_untied_checkpoint_without_lm_head_is_rejected(hf_dir, tmp_path):
    rewrite_weights(hf_dir, lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        convert_hf_checkpoint(hf_dir, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_unexpected_tensor_is_rejected_but_rotary_inv_freq_is_ignored(hf_dir, tmp_path):
    rewrite_weights(hf_dir, lambda sd: {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    convert_hf_checkpoint(hf_dir, tmp_path / "ok")
    rewrite_weights(hf_dir, lambda sd: {**sd, "model.layers.2.mlp.up_proj.weight": torch.ones(4)})
    with pytest.raises(ValueError, match="model.layers.2.mlp.up_proj.weight"):
        convert_hf_checkpoint(hf_dir, tmp_path / "bad")


def test_shape_that_disagrees_with_config_is_rejected(hf_dir, tmp_path):
    rewrite_weights(hf_dir, lambda sd: {**sd, "model.layers.1.mlp.down_proj.weight": torch.ones(DIM, 40)})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        convert_hf_checkpoint(hf_dir, tmp_path / "native")


def test_tokenizer_found_in_original_subfolder(hf_dir, tmp_path):
    (hf_dir / "original").mkdir()
    (hf_dir / "tokenizer.model").rename(hf_dir / "original" / "tokenizer.model")
    out = convert_hf_checkpoint(hf_dir, tmp_path / "native")
    assert (out / "tokenizer.model").read_bytes() == TOKENIZER_BYTES


@pytest.mark.parametrize("out", [".", "native", ".."])
def test_out_dir_that_is_inside_or_around_the_source_is_refused(hf_dir, out):
    before = dir_hashes(hf_dir)
    with pytest.raises(ValueError, match="the input"):
        convert_hf_checkpoint(hf_dir, hf_dir / out, force=True)
    assert dir_hashes(hf_dir) == before


def test_existing_output_without_force_fails_and_is_left_intact(hf_dir, tmp_path):
    out = convert_hf_checkpoint(hf_dir, tmp_path / "native")
    (out / "model.safetensors").write_bytes(b"previous conversion")
    before = dir_hashes(out)
    with pytest.raises(ValueError, match="--force"):
        convert_hf_checkpoint(hf_dir, out)
    assert dir_hashes(out) == before


def test_force_replaces_an_earlier_conversion(hf_dir, tmp_path, native):
    out = convert_hf_checkpoint(hf_dir, tmp_path / "native2", dtype="bfloat16")
    convert_hf_checkpoint(hf_dir, out, force=True)
    assert_same_tensors(load_file(out / "model.safetensors"), native)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.model"]


def test_force_refuses_a_directory_that_holds_no_earlier_checkpoint(hf_dir, tmp_path):
    out = tmp_path / "native2"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's file")
    before = dir_hashes(out)
    with pytest.raises(ValueError, match="only an earlier checkpoint"):
        convert_hf_checkpoint(hf_dir, out, force=True)
    assert dir_hashes(out) == before


@pytest.mark.parametrize("remove", ["config.json", "model.safetensors", "tokenizer.model"])
def test_cli_reports_missing_input_in_one_error_line(hf_dir, tmp_path, remove):
    (hf_dir / remove).unlink()
    result = run_cli("--checkpoint_dir", hf_dir, "--out_dir", tmp_path / "native")
    assert result.returncode != 0
    assert result.stderr.startswith("error:") and len(errors_of(result.stderr)) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "native").exists()


@pytest.mark.parametrize("model_type", ["gemma", "gpt2"])
def test_a_config_naming_another_architecture_is_refused_though_its_tensors_are_llamas(hf_dir, tmp_path, model_type):
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported"):
        convert_hf_checkpoint(hf_dir, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def test_a_config_nested_too_deeply_is_refused_not_a_recursion_error(hf_dir, tmp_path):
    (hf_dir / "config.json").write_text("[" * 100000)
    with pytest.raises(ValueError, match="config.json is not valid JSON: it is nested too deeply"):
        convert_hf_checkpoint(hf_dir, tmp_path / "native")
