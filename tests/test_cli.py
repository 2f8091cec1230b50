"""`python generate.py` end to end, through a subprocess as a user would run it."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# one schema for plain and speculative decoding; speculation's figures are null without it
METRICS = {"ttft_ms", "decode_tokens_per_sec", "tokens_per_sec", "prefill_tokens_per_sec", "bandwidth_gb_s",
           "peak_memory_gb", "compile_s", "total_s", "samples", "target_forwards", "mean_accepted", "mean_drafted",
           "acceptance_rate", "accept_histogram"}


def metrics_of(checkpoint, tmp_path, *args):
    out = tmp_path / "metrics.json"
    result = run_cli("--checkpoint_path", checkpoint, "--metrics_json", out, *args)
    assert result.returncode == 0, result.stderr
    return result, json.loads(out.read_text())


def test_cli_generates_and_reports_speed_and_metrics_json(checkpoint, tmp_path):
    result, metrics = metrics_of(checkpoint, tmp_path, "--prompt", "the quick", "--max_new_tokens", 8,
                                 "--num_samples", 2, "--ignore_eos", "--temperature", 0)
    for label in ("Time to first token", "tokens/sec", "Bandwidth achieved", "peak memory"):
        assert label in result.stdout
    assert set(metrics) == METRICS
    assert metrics["target_forwards"] == 8 and metrics["accept_histogram"] is None  # prefill and 7 steps
    assert all(metrics[k] > 0 for k in ("ttft_ms", "decode_tokens_per_sec", "tokens_per_sec", "bandwidth_gb_s"))
    assert len(metrics["samples"]) == 2 and all(len(s["tokens"]) == 8 for s in metrics["samples"])
    assert metrics["samples"][0] == metrics["samples"][1]  # greedy
    assert "the quick" + metrics["samples"][0]["text"] in result.stdout


def test_cli_repeated_prompt_flag_makes_a_batch(checkpoint, tmp_path):
    _, metrics = metrics_of(checkpoint, tmp_path, "--prompt", "def f(x):", "--prompt", "the lazy dog jumps over",
                            "--max_new_tokens", 6, "--ignore_eos")
    assert len(metrics["samples"]) == 2


def test_cli_batch_size_repeats_a_single_prompt(checkpoint, tmp_path):
    _, metrics = metrics_of(checkpoint, tmp_path, "--batch_size", 3, "--max_new_tokens", 6, "--ignore_eos")
    assert len(metrics["samples"]) == 3


def test_cli_seed_makes_sampling_reproducible(checkpoint, tmp_path):
    args = ("--max_new_tokens", 12, "--ignore_eos", "--temperature", 1.0, "--top_p", 0.9)
    first = metrics_of(checkpoint, tmp_path, "--seed", 7, *args)[1]["samples"]
    assert metrics_of(checkpoint, tmp_path, "--seed", 7, *args)[1]["samples"] == first
    assert metrics_of(checkpoint, tmp_path, "--seed", 8, *args)[1]["samples"] != first


def test_cli_profile_writes_a_chrome_trace(checkpoint, tmp_path):
    trace = tmp_path / "trace.json"
    metrics_of(checkpoint, tmp_path, "--max_new_tokens", 4, "--profile", trace)
    assert "traceEvents" in json.loads(trace.read_text())


def test_cli_compiled_decode_and_prefill_give_the_eager_tokens(checkpoint, tmp_path):
    args = ("--max_new_tokens", 10, "--ignore_eos", "--temperature", 0, "--dtype", "float32")
    eager = metrics_of(checkpoint, tmp_path, *args)[1]
    compiled = metrics_of(checkpoint, tmp_path, "--compile", "--compile_prefill", *args)[1]
    assert compiled["samples"] == eager["samples"]
    assert compiled["compile_s"] > 0


@pytest.fixture
def broken(checkpoint, tmp_path):
    """Copies of the checkpoint, damaged in one way each."""
    def make(kind):
        d = tmp_path / kind
        shutil.copytree(checkpoint, d)
        weights, config = d / "model.safetensors", d / "config.json"
        if kind == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif kind == "not_weights":
            weights.write_text("hello")
        elif kind == "config_disagrees":
            config.write_text(json.dumps({**json.loads(config.read_text()), "n_layer": 3}))
        elif kind == "bad_config":
            config.write_text("{not json")
        elif kind == "empty":
            shutil.rmtree(d)
            d.mkdir()
        elif kind == "no_tokenizer":
            (d / "tokenizer.model").unlink()
        return d
    return make


@pytest.mark.parametrize("kind, message", [
    ("truncated", "truncated"), ("not_weights", "truncated or not a weights file"),
    ("config_disagrees", "disagree"), ("bad_config", "not a model config"), ("empty", "is empty"),
    ("no_tokenizer", "tokenizer"),
])
def test_cli_damaged_checkpoint_gets_a_one_line_error(broken, kind, message):
    result = run_cli("--checkpoint_path", broken(kind), "--max_new_tokens", 4)
    assert_one_line_error(result, message)


def assert_one_line_error(result, message):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


@pytest.mark.parametrize("args, message", [
    (("--checkpoint_path", "/nonexistent/ckpt"), "checkpoint not found"),
    (("--checkpoint_path", ROOT / "model.py"), "not a checkpoint"),
    (("--max_new_tokens", 1000), "exceeds the maximum"),
    (("--max_new_tokens", 10, "--max_seq_length", 8), "exceeds the maximum"),
    (("--max_new_tokens", 0), "--max_new_tokens"),
    (("--temperature", -0.5), "--temperature"),
    (("--top_k", 0), "--top_k"),
    (("--top_p", 0), "--top_p"),
    (("--top_p", 1.5), "--top_p"),
    (("--device", "tpu"), "device"),
    (("--device", "cuda:0"), "not available"),
    (("--dtype", "int3"), "--dtype"),
    (("--prompt", ""), "prompt is empty"),
    (("--prompt", "a", "--prompt", "b", "--batch_size", 3), "--batch_size"),
    (("--max_new_tokens", "many"), "--max_new_tokens"),
])
def test_cli_bad_argument_gets_a_one_line_error(checkpoint, args, message):
    if args[:2] == ("--device", "cuda:0"):
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA, so cuda:0 is a valid device here")
    if "--checkpoint_path" not in args:
        args = ("--checkpoint_path", checkpoint) + args
    assert_one_line_error(run_cli(*args), message)


def test_cli_runs_a_llama3_style_checkpoint_with_a_tiktoken_tokenizer(tmp_path, tiktoken_model_path):
    from conftest import convert, save_hf_llama
    save_hf_llama(tmp_path / "hf", tiktoken_model_path, vocab_size=600,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64))
    checkpoint = convert(tmp_path / "hf", tmp_path / "native")
    _, metrics = metrics_of(checkpoint, tmp_path, "--prompt", "héllo → 世界", "--max_new_tokens", 8, "--ignore_eos")
    assert len(metrics["samples"][0]["tokens"]) == 8
    assert "<|begin_of_text|>" not in metrics["samples"][0]["text"]
