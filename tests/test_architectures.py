"""Qwen2, Mistral (sliding window) and Llama-3.2 checkpoints: converted from tiny random transformers models, they
must give transformers' logits, over a whole sequence and token by token through the KV cache."""
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import checkpoint
import tp
from conftest import convert
from convert_hf_checkpoint import args_from_hf_config

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
SEQ = 24
LLAMA3_SCALING = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=16)  # short, so the scaling changes the frequencies used here


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def save_hf(path, model, sp_model_path):
    model.save_pretrained(path)
    shutil.copy(sp_model_path, path / "tokenizer.model")  # the converter copies a tokenizer along
    return path


def build(tmp_path, sp_model_path, config, model_class):
    """(HF model, our model converted from its save_pretrained folder), both float32."""
    torch.manual_seed(0)
    hf = model_class(config).eval()
    native = convert(save_hf(tmp_path / "hf", hf, sp_model_path), tmp_path / "native")
    return hf, checkpoint.load_model(native, "cpu", torch.float32)


def qwen2_config(**changes):
    return transformers.Qwen2Config(**{**SHAPE, "tie_word_embeddings": True, **changes})


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, sp_model_path):
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(qwen2_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):  # transformers starts biases at zero, which would hide a wrong row order
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("qwen2")
    native = convert(save_hf(path / "hf", hf, sp_model_path), path / "native")
    return hf, native


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, sp_model_path):
    return build(tmp_path_factory.mktemp("mistral"), sp_model_path,
                 transformers.MistralConfig(**SHAPE, sliding_window=8), transformers.MistralForCausalLM)


def tokens(n=SEQ, seed=1):
    return torch.randint(3, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def step_by_step(model, ids, prefill=1):  # ids [1, S] -> [1, S, V]: a prefill, then one token at a time
    model.setup_caches(1, ids.size(1) + 8)
    out = [model(ids[:, :prefill], model.context(torch.arange(prefill)))]
    out += [model(ids[:, t : t + 1], model.context(torch.tensor([t]))) for t in range(prefill, ids.size(1))]
    return torch.cat(out, 1)


def assert_matches(ours, hf):
    torch.testing.assert_close(ours, hf, rtol=1e-5, atol=1e-5)


# ---- Qwen2: q/k/v biases, tied embeddings -----------------------------------------------------------------------

def test_qwen2_converts_to_qkv_bias_and_tied_embeddings(qwen2):
    _, native = qwen2
    args = checkpoint.read_config(native)
    assert args.qkv_bias and args.tie_embeddings and args.sliding_window == 0
    tensors = load_file(native / "model.safetensors")
    assert tensors["layers.0.attention.bqkv"].shape == ((4 + 2 * 2) * 16,) and "output.weight" not in tensors


def test_qwen2_full_sequence_logits_match_transformers(qwen2):
    hf, native = qwen2
    ids = tokens()
    assert_matches(checkpoint.load_model(native, "cpu", torch.float32)(ids), hf(ids).logits)


def test_qwen2_decoding_through_the_kv_cache_matches_transformers(qwen2):
    hf, native = qwen2
    ids = tokens()
    assert_matches(step_by_step(checkpoint.load_model(native, "cpu", torch.float32), ids, prefill=5), hf(ids).logits)


def test_qwen2_int8_checkpoint_keeps_the_bias_in_float_and_stays_close(qwen2, tmp_path):
    from quantize_checkpoint import quantize_checkpoint
    hf, native = qwen2
    out = quantize_checkpoint(native, "int8", out_dir=tmp_path / "int8")
    assert load_file(out / "model.safetensors")["layers.1.attention.bqkv"].is_floating_point()
    ids = tokens()
    ours = checkpoint.load_model(out, "cpu", torch.float32)(ids)
    assert (ours - hf(ids).logits).abs().max() < 0.1 * hf(ids).logits.abs().max()


def test_qwen2_shards_of_both_ranks_reassemble_bqkv_in_q_k_v_order(qwen2):
    _, native = qwen2
    state, args = checkpoint.read_weights(native / "model.safetensors", "cpu", torch.float32), checkpoint.read_config(native)
    shards = [tp.shard_state(state, args, r, 2, "cpu") for r in range(2)]
    sizes = [args.n_head * args.head_dim, args.n_kv_head * args.head_dim, args.n_kv_head * args.head_dim]
    parts = [s["layers.0.attention.bqkv"].split([n // 2 for n in sizes]) for s in shards]
    assert torch.equal(torch.cat([torch.cat([parts[0][i], parts[1][i]]) for i in range(3)]),
                       state["layers.0.attention.bqkv"])


def test_qwen2_two_ranks_give_the_single_process_logits(qwen2, tmp_path):
    from test_tp import PROMPT, ROOT, torchrun
    _, native = qwen2
    result = torchrun(2, ROOT / "tests" / "tp_worker.py", native, tmp_path)
    assert result.returncode == 0, result.stderr[:3000]
    single = checkpoint.load_model(native, "cpu", torch.float32)
    single.setup_caches(1, 64)
    expected = single(torch.tensor([PROMPT]), single.context(torch.arange(len(PROMPT))))[0]
    assert_matches(load_file(tmp_path / "logits.safetensors")["logits"], expected)


def test_qwen2_unused_sliding_window_is_no_window():
    cfg = {**qwen2_config().to_dict(), "use_sliding_window": False, "sliding_window": 4096}
    del cfg["layer_types"]  # as transformers 4 saved it
    assert args_from_hf_config(cfg).sliding_window == 0


# ---- Mistral: sliding-window attention ---------------------------------------------------------------------------

def test_mistral_keeps_its_window_and_its_full_context():
    args = args_from_hf_config(transformers.MistralConfig(**SHAPE, sliding_window=8).to_dict())
    assert (args.sliding_window, args.block_size) == (8, 256)


def test_mistral_full_sequence_longer_than_the_window_matches_transformers(mistral):
    hf, ours = mistral
    ids = tokens()
    expected = hf(ids).logits
    assert_matches(ours(ids), expected)
    ours.args.sliding_window = 0  # the window really cuts: without it the logits differ
    try:
        assert not torch.allclose(ours(ids), expected, atol=1e-3)
    finally:
        ours.args.sliding_window = 8


def test_mistral_decoding_past_the_window_through_the_static_cache_matches_transformers(mistral):
    hf, ours = mistral
    ids = tokens()
    assert_matches(step_by_step(ours, ids, prefill=12), hf(ids).logits)  # a prefill past the window, then steps


def test_mistral_left_padded_batch_gives_each_row_what_it_gets_alone(mistral):
    _, ours = mistral
    prompts = [tokens(10, seed=2)[0], tokens(SEQ, seed=3)[0]]
    follow = tokens(2 * 12, seed=4).view(2, 12)  # fed after each prompt, one token per step
    pad = SEQ - len(prompts[0])
    left_pad = torch.tensor([pad, 0])
    ours.setup_caches(2, SEQ + 16)
    idx = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), prompts[0]]), prompts[1]])
    batched = [ours(idx, ours.context(torch.arange(SEQ), left_pad))[:, -1]]
    batched += [ours(follow[:, t : t + 1], ours.context(torch.tensor([SEQ + t]), left_pad))[:, -1] for t in range(12)]
    for row, prompt in enumerate(prompts):
        ours.setup_caches(1, SEQ + 16)
        alone = [ours(prompt[None], ours.context(torch.arange(len(prompt))))[0, -1]]
        alone += [ours(follow[row : row + 1, t : t + 1], ours.context(torch.tensor([len(prompt) + t])))[0, -1] for t in range(12)]
        assert_matches(torch.stack([b[row] for b in batched]), torch.stack(alone))


# ---- Llama-3.2: tied embeddings, llama3 RoPE scaling -------------------------------------------------------------

@pytest.fixture(scope="module")
def llama32(tmp_path_factory, sp_model_path):
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_theta=500000.0,
                                      rope_scaling=LLAMA3_SCALING)
    return build(tmp_path_factory.mktemp("llama32"), sp_model_path, config, transformers.LlamaForCausalLM)


def test_llama32_tied_and_rope_scaled_matches_transformers(llama32):
    hf, ours = llama32
    assert ours.args.tie_embeddings and ours.args.rope_scaling["factor"] == 32.0
    ids = tokens(40)
    expected = hf(ids).logits
    assert_matches(ours(ids), expected)
    assert_matches(step_by_step(ours, ids, prefill=5), expected)


# ---- refusals ------------------------------------------------------------------------------------------------------

def refusal(tmp_path, sp_model_path, model, edit_config=None, edit_weights=None):
    """The converter's error for model's save_pretrained folder, after the edits."""
    hf_dir = save_hf(tmp_path / "hf", model, sp_model_path)
    if edit_config:
        cfg = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps(edit_config(cfg)))
    if edit_weights:
        path = hf_dir / "model.safetensors"
        save_file(edit_weights(load_file(path)), path, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        convert(hf_dir, tmp_path / "native")
    assert not (tmp_path / "native").exists()
    return str(e.value)


def test_llama_config_with_attention_bias_is_refused_for_its_o_proj_bias(tmp_path, sp_model_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, attention_bias=True))
    assert "o_proj" in refusal(tmp_path, sp_model_path, model)


def test_o_proj_bias_tensor_is_refused_by_name(tmp_path, sp_model_path):
    model = transformers.Qwen2ForCausalLM(qwen2_config())
    bias = "model.layers.1.self_attn.o_proj.bias"
    message = refusal(tmp_path, sp_model_path, model, edit_weights=lambda sd: {**sd, bias: torch.zeros(64)})
    assert bias in message and "only q_proj, k_proj and v_proj" in message


def test_mlp_bias_is_refused(tmp_path, sp_model_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, mlp_bias=True))
    assert "mlp_bias" in refusal(tmp_path, sp_model_path, model)


def test_layer_types_mixing_sliding_and_full_attention_is_refused(tmp_path, sp_model_path):
    model = transformers.Qwen2ForCausalLM(qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert "mix full_attention and sliding_attention" in refusal(tmp_path, sp_model_path, model)


def test_qwen2_sliding_window_on_only_some_layers_is_refused_without_layer_types(tmp_path, sp_model_path):
    model = transformers.Qwen2ForCausalLM(qwen2_config())
    edit = lambda cfg: {**{k: v for k, v in cfg.items() if k != "layer_types"}, "use_sliding_window": True,  # noqa: E731
                        "sliding_window": 8, "max_window_layers": 1}
    assert "mix full_attention and sliding_attention" in refusal(tmp_path, sp_model_path, model, edit_config=edit)


@pytest.mark.parametrize("value", [-1, 2.5, True, "8"])
def test_native_config_sliding_window_must_be_a_whole_number_at_least_0(value):
    with pytest.raises(ValueError, match="sliding_window"):
        checkpoint.check_config({"sliding_window": value}, "config.json")
    assert checkpoint.check_config({"sliding_window": 0}, "config.json").sliding_window == 0
