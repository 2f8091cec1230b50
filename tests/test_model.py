"""model.py against the reference implementation, Hugging Face transformers' LlamaForCausalLM."""
import dataclasses
import mmap

import pytest
import torch

from conftest import convert, save_hf_llama
from checkpoint import load_model
from generate import generate
from model import ModelArgs, Transformer, kv_bucket, transformer_configs

LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=32)
CONFIGS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa_tied_embeddings": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "llama31_rope_scaling": dict(num_key_value_heads=2, rope_scaling=LLAMA31_SCALING),
}
SEQ = 100  # longer than original_max_position_embeddings (32), so the Llama-3.1 scaling changes the logits


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, sp_model_path):
    """(transformers model, our model converted from its save_pretrained output), both float32."""
    hf_dir = tmp_path_factory.mktemp(request.param)
    hf = save_hf_llama(hf_dir / "hf", sp_model_path, **CONFIGS[request.param])
    ours = load_model(convert(hf_dir / "hf", hf_dir / "native"), "cpu", torch.float32)
    return hf, ours


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 320, (2, SEQ), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_logits_match_transformers(pair, tokens):
    hf, ours = pair
    assert rel_err(ours(tokens), hf(tokens).logits) < 1e-4


@torch.no_grad()
def test_cached_decoding_one_token_at_a_time_matches_full_forward(pair, tokens):
    _, ours = pair
    ours.setup_caches(2, SEQ)
    half = SEQ // 2
    steps = [ours(tokens[:, :half], ours.context(torch.arange(half)))]
    steps += [ours(tokens[:, i : i + 1], ours.context(torch.tensor([i]))) for i in range(half, SEQ)]
    assert rel_err(torch.cat(steps, dim=1), ours(tokens)) < 1e-5


@torch.no_grad()
def test_greedy_continuation_is_identical_to_transformers(pair, tokens):
    hf, ours = pair
    prompt = tokens[:1, :20]
    hf.generation_config.eos_token_id = None  # compare full-length continuations
    expected = hf.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0, 20:].tolist()
    rows = generate(ours, prompt.tolist(), 40, temperature=0.0).rows
    assert rows[0] == expected


@torch.no_grad()
def test_rope_scaling_changes_the_logits_at_this_length(tmp_path, sp_model_path, tokens):
    # guards the scaling test above: without the scaling our logits must be clearly off
    hf = save_hf_llama(tmp_path / "hf", sp_model_path, rope_scaling=LLAMA31_SCALING)
    ours = load_model(convert(tmp_path / "hf", tmp_path / "native"), "cpu", torch.float32)
    unscaled = Transformer(dataclasses.replace(ours.args, rope_scaling=None))
    unscaled.load_state_dict(ours.state_dict())
    assert rel_err(unscaled(tokens), hf(tokens).logits) > 1e-3


@torch.no_grad()
def test_setup_caches_again_with_new_sizes_reallocates(pair, tokens):
    _, ours = pair
    ours.setup_caches(1, 16)
    ours.setup_caches(3, 64)
    cache = ours.layers[0].attention.kv_cache
    assert cache.k_cache.shape == (3, ours.args.n_kv_head, 64 + 1, ours.args.head_dim)  # + the spare slot
    assert ours.freqs_cis.shape[0] == 64
    x = tokens[:, :40].repeat(2, 1)[:3]
    assert rel_err(ours(x, ours.context(torch.arange(40))), ours(x)) < 1e-5


@torch.no_grad()
def test_decoding_through_a_cache_of_2_mb_or_more_matches_the_full_forward(pair, tokens):
    # from 2 MB a CPU cache tensor is an anonymous mapping asked for 2 MB pages (checkpoint.cache_zeros)
    _, ours = pair
    B = -(-(2 << 20) // (ours.args.n_kv_head * (SEQ + 1) * ours.args.head_dim * 4))  # float32 rows that make 2 MB
    ours.setup_caches(B, SEQ)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: the mapping, aligned to 2 MB (elsewhere torch.zeros)
        assert ours.layers[0].attention.kv_cache.v_cache.data_ptr() % (2 << 20) == 0
    x, half = tokens.repeat(B, 1)[:B], SEQ // 2
    steps = [ours(x[:, :half], ours.context(torch.arange(half)))]
    steps += [ours(x[:, i : i + 1], ours.context(torch.tensor([i]))) for i in range(half, SEQ)]
    assert rel_err(torch.cat(steps, dim=1), ours(x)) < 1e-5


@torch.no_grad()
def test_reading_only_a_bucket_of_a_long_cache_gives_the_whole_cache_logits(pair, tokens):
    _, ours = pair
    ours.setup_caches(2, SEQ)
    T, n = SEQ - 10, SEQ - 10 + 3  # a kv_len well short of the cache, and just enough for these positions
    whole = [ours(tokens[:, :T], ours.context(torch.arange(T)))] + [ours(tokens[:, i : i + 1], ours.context(torch.tensor([i]))) for i in range(T, n)]
    part = [ours(tokens[:, :T], ours.context(torch.arange(T), None, n))]
    part += [ours(tokens[:, i : i + 1], ours.context(torch.tensor([i]), None, n)) for i in range(T, n)]
    assert rel_err(torch.cat(part, 1), torch.cat(whole, 1)) < 1e-6


def test_kv_bucket_covers_every_position_with_few_lengths_and_stays_within_the_cache():
    for cache in (100, 2048, 32768):
        lengths = {kv_bucket(n, cache) for n in range(1, cache + 1)}
        assert all(n <= kv_bucket(n, cache) <= cache for n in range(1, cache + 1))
        assert len(lengths) <= max(1, (cache // 256).bit_length() + 1)
    assert kv_bucket(100, 32768) == kv_bucket(100, 2048) == 256  # a short context reads as little from either


def test_setup_caches_beyond_the_model_maximum_is_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="max_seq_length"):
        ours.setup_caches(1, ours.args.block_size + 1)


# Published parameter counts (billions) of the checkpoints the named configs describe.
PUBLISHED_PARAMS = {"Llama-2-7b": 6.738, "Llama-2-13b": 13.016, "Llama-2-70b": 68.977, "CodeLlama-7b": 6.738,
                    "CodeLlama-34b": 33.744, "Mistral-7B": 7.242, "Llama-3-8B": 8.030, "Llama-3-70B": 70.554,
                    "Llama-3.1-8B": 8.030, "Llama-3.1-70B": 70.554, "Llama-3.1-405B": 405.853,
                    "Llama-3.2-1B": 1.236, "Llama-3.2-3B": 3.213, "TinyLlama-1.1B": 1.100}


@pytest.mark.parametrize("name", list(transformer_configs))
def test_named_config_has_the_published_parameter_count(name):
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_name(name))
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(PUBLISHED_PARAMS[name], rel=2e-3)


@pytest.mark.parametrize("checkpoint_name, config", [
    ("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7b"), ("codellama/CodeLlama-7b-Python-hf", "CodeLlama-7b"),
    ("meta-llama/Llama-3.1-70B-Instruct", "Llama-3.1-70B"), ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "TinyLlama-1.1B"),
])
def test_from_name_picks_the_longest_matching_config(checkpoint_name, config):
    assert ModelArgs.from_name(checkpoint_name) == ModelArgs(**transformer_configs[config])
