"""model.py against the reference implementation, Hugging Face transformers' LlamaForCausalLM."""
import dataclasses
import mmap
import re
from pathlib import Path

import pytest
import torch

from conftest import convert, save_hf_llama
from checkpoint import load_model
from generate import generate
from model import ModelArgs, Transformer, cache_zeros, kv_bucket, transformer_configs

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
    steps = [ours(tokens[:, :half], torch.arange(half))]
    steps += [ours(tokens[:, i : i + 1], torch.tensor([i])) for i in range(half, SEQ)]
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
    assert rel_err(ours(x, torch.arange(40)), ours(x)) < 1e-5


@torch.no_grad()
def test_decoding_through_a_cache_of_2_mb_or_more_matches_the_full_forward(pair, tokens):
    # from 2 MB a CPU cache tensor is an anonymous mapping asked for 2 MB pages (cache_zeros), not torch's memory
    _, ours = pair
    B = -(-(2 << 20) // (ours.args.n_kv_head * (SEQ + 1) * ours.args.head_dim * 4))  # float32 rows that make 2 MB
    ours.setup_caches(B, SEQ)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: the mapping, aligned to 2 MB (elsewhere torch.zeros)
        assert ours.layers[0].attention.kv_cache.v_cache.data_ptr() % (2 << 20) == 0
    x, half = tokens.repeat(B, 1)[:B], SEQ // 2
    steps = [ours(x[:, :half], torch.arange(half))]
    steps += [ours(x[:, i : i + 1], torch.tensor([i])) for i in range(half, SEQ)]
    assert rel_err(torch.cat(steps, dim=1), ours(x)) < 1e-5


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
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


@torch.no_grad()
def test_reading_only_a_bucket_of_a_long_cache_gives_the_whole_cache_logits(pair, tokens):
    _, ours = pair
    ours.setup_caches(2, SEQ)
    T, n = SEQ - 10, SEQ - 10 + 3  # a kv_len well short of the cache, and just enough for these positions
    whole = [ours(tokens[:, :T], torch.arange(T))] + [ours(tokens[:, i : i + 1], torch.tensor([i])) for i in range(T, n)]
    part = [ours(tokens[:, :T], torch.arange(T), None, n)]
    part += [ours(tokens[:, i : i + 1], torch.tensor([i]), None, n) for i in range(T, n)]
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


def test_from_hf_config_reads_transformers4_and_5_layouts_alike():
    v4 = dict(model_type="llama", vocab_size=128256, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=8, hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072,
              rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA31_SCALING, factor=8.0,
                                                                        original_max_position_embeddings=8192))
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(v4["rope_scaling"], rope_theta=500000.0)
    assert ModelArgs.from_hf_config(v4) == ModelArgs.from_hf_config(v5) == ModelArgs.from_name("Llama-3.1-8B")


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (dict(attention_bias=True), "o_proj"),
    (dict(embedding_multiplier=12.0), "embedding_multiplier"),  # Granite: Llama's tensors, other arithmetic
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "yarn"),
])
def test_from_hf_config_rejects_other_architectures(change, message):
    cfg = dict(model_type="llama", vocab_size=100, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
               intermediate_size=64)
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config({**cfg, **change})


def test_mistral_sliding_window_is_kept_and_does_not_cap_the_sequence_length():
    cfg = dict(model_type="mistral", vocab_size=32000, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
               rms_norm_eps=1e-5, sliding_window=4096)
    expected = dataclasses.replace(ModelArgs.from_name("Mistral-7B"), block_size=32768, sliding_window=4096)
    assert ModelArgs.from_hf_config(cfg) == expected


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
