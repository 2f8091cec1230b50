"""Every bad input ends in one line on stderr and exit status 2, before any long work, and no input file changes.
One row per kind of bad input: the row builds the input in a temporary folder, runs the command as a user would
(forked by tests/launcher.py from a process that has imported torch: seconds of start-up less a row), and the test
checks the status, the one line (it must name the problem), the absence of a traceback, and the hash of every file
the command could have touched."""
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import errors_of, save_hf_llama, write_tiny_gguf
from launcher import command

HUGE = 20 * 2**30  # sparse files this large take no disk space


def fingerprint(folder: Path) -> dict:
    """Every file under folder: its hash, or for a huge sparse file its size and modification time."""
    def one(f):
        if f.stat().st_size > 1 << 26:
            return f.stat().st_size, f.stat().st_mtime_ns
        return hashlib.sha256(f.read_bytes()).hexdigest()
    return {str(f): one(f) for f in sorted(folder.rglob("*")) if f.is_file()}


def copy(ckpt, tmp, name="ckpt", **config):
    """A copy of the checkpoint with config.json's fields changed."""
    d = tmp / name
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    return d


def poisoned(ckpt, tmp, value):
    """A copy with one weight set to value (NaN or an infinity)."""
    d = copy(ckpt, tmp)
    state = load_file(d / "model.safetensors")
    state["layers.1.feed_forward.w2.weight"][3, 5] = value
    save_file(state, d / "model.safetensors")
    return d


def overflowing(ckpt, tmp):
    """A copy whose weights are all finite but whose activations overflow: the logits come out NaN."""
    d = copy(ckpt, tmp)
    state = load_file(d / "model.safetensors")
    state["norm.weight"].fill_(3e38)  # the final norm times 3e38, summed over 64 inputs, overflows
    save_file(state, d / "model.safetensors")
    return d


def sparse(path, size=HUGE):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def hf(tmp, sp, **config):
    """A Hugging Face checkpoint folder, with config.json's fields changed."""
    d = tmp / "hf"
    save_hf_llama(d, sp)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    return d


def hf_with_int8_weight(tmp, sp):
    d = hf(tmp, sp)
    state = load_file(d / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d


def tiktoken_duplicate_ranks(tmp):
    d = tmp / "tok"
    d.mkdir()
    (d / "tokenizer.model").write_text("YQ== 0\nYg== 1\nYw== 1\n")
    return d / "tokenizer.model"


def with_tokenizer(ckpt, tmp, tokenizer):
    d = copy(ckpt, tmp)
    os.replace(tokenizer, d / "tokenizer.model")  # a move: copying a sparse file would write all 20 GB
    return d


def truncated_gguf(tmp):
    path = write_tiny_gguf(tmp / "m.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def lark_file(tmp, text):
    (tmp / "g.lark").write_text(text)
    return tmp / "g.lark"


def text_file(tmp, name, text):
    (tmp / name).write_text(text)
    return tmp / name


def user_folder(tmp, *names):
    d = tmp / "mine"
    for n in names:
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        (d / n).write_text(f"the user's {n}")
    return d


GEN, QUANT, CONVERT, EVAL, SPEC = ("generate.py", "scripts/quantize_checkpoint.py",
                                   "scripts/convert_hf_checkpoint.py", "eval.py", "speculative.py")
GGUF = "scripts/convert_gguf.py"
TRAIN, BENCH, BENCH_Q, BENCH_S = ("scripts/train_tiny.py", "scripts/bench.py", "scripts/bench_quantize.py",
                                  "scripts/bench_speculative.py")
BENCH_C = "scripts/bench_cpu_step.py"
BATCH, BENCH_E, BENCH_SERVE = "batch.py", "scripts/bench_engine.py", "scripts/bench_serve.py"
ROOFLINE = "scripts/roofline.py"
SERVE = "serve.py"
N = ("--max_new_tokens", 4)

# id: (script, lambda tmp, ckpt, sp -> args, a word the one line must contain)
ROWS = {
    # sizes: refused up front, saying how much is needed and how much there is
    "config_with_a_million_layers": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, n_layer=10**6), *N],
                                     "holds 2 layers"),
    "batch_size_ten_million": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--batch_size", 10**7, *N],
                               "GB available"),
    "max_seq_length_past_the_model": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--max_seq_length", 10**9, *N],
                                      "block_size"),
    "kv_cache_larger_than_memory": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, block_size=10**9),
                                                          "--max_seq_length", 10**9, *N], "KV cache"),
    "tokenizer_of_20_GB": (GEN, lambda t, c, s: ["--checkpoint_path", with_tokenizer(c, t, sparse(t / "big")), *N],
                           "too large"),
    "prompt_file_of_20_GB": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--prompt_file", sparse(t / "p.txt"), *N],
                             "GB is available"),
    "eval_text_of_20_GB": (EVAL, lambda t, c, s: ["--checkpoint_path", c, "--text", sparse(t / "t.txt")], "GB"),
    # bad files
    "float_vocab_size": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, vocab_size=320.5), *N], "vocab_size"),
    "string_rope_base": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, rope_base="1e4"), *N], "rope_base"),
    "string_norm_eps": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, norm_eps="1e-5"), *N], "norm_eps"),
    "string_rope_scaling": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, rope_scaling="yes"), *N],
                            "rope_scaling"),
    "rope_base_zero": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, rope_base=0), *N], "rope_base"),
    "rope_base_negative": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, rope_base=-1.0), *N], "rope_base"),
    "tie_embeddings_as_a_string": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, tie_embeddings="false"), *N],
                                   "tie_embeddings"),
    "unknown_config_field": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, n_layers=2), *N], "n_layers"),
    "block_size_zero": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, block_size=0), *N], "block_size"),
    "tokenizer_larger_than_the_model": (GEN, lambda t, c, s: ["--checkpoint_path", copy(c, t, vocab_size=300), *N],
                                        "vocab_size"),
    "tiktoken_duplicate_ranks": (GEN, lambda t, c, s: ["--checkpoint_path",
                                                       with_tokenizer(c, t, tiktoken_duplicate_ranks(t)), *N], "rank"),
    "nan_weight": (GEN, lambda t, c, s: ["--checkpoint_path", poisoned(c, t, math.nan), *N], "NaN"),
    "inf_weight": (GEN, lambda t, c, s: ["--checkpoint_path", poisoned(c, t, math.inf), *N], "infinite"),
    "logits_overflow_during_generation": (GEN, lambda t, c, s: ["--checkpoint_path", overflowing(c, t), "--dtype",
                                                                "float32", *N], "NaN or infinite by new token 4"),
    "hf_folder_given_to_generate": (GEN, lambda t, c, s: ["--checkpoint_path", hf(t, s), *N],
                                    "convert_hf_checkpoint.py --checkpoint_dir"),
    # bad options
    "temperature_inf": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--temperature", "inf", *N], "--temperature"),
    "temperature_nan": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--temperature", "nan", *N], "--temperature"),
    "threads_zero": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--threads", 0, *N], "--threads"),
    "seed_beyond_64_bits": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--seed", 2**70, *N], "--seed"),
    "threads_beyond_any_machine": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--threads", 2**40, *N], "--threads"),
    "unknown_flag": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--max_tokens", 4], "--max_new_tokens"),
    "lone_surrogate_prompt": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--prompt", b"caf\xe9", *N], "UTF-8"),
    "empty_prompt_on_stdin": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--prompt", "-", *N], "empty"),
    "missing_prompt_file": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--prompt_file", t / "none.txt", *N],
                            "not found"),
    "binary_prompt_file": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--prompt_file",
                                                 c / "model.safetensors", *N], "text"),
    "profile_into_a_missing_folder": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--profile", t / "no" / "t.json",
                                                            *N], "does not exist"),
    "profile_onto_a_folder": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--profile", t, *N], "directory"),
    "metrics_json_onto_a_users_file": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--metrics_json",
                                                             user_folder(t, "thesis.txt") / "thesis.txt", *N],
                                       "not an earlier output"),
    "speculate_k_zero": (SPEC, lambda t, c, s: ["--checkpoint_path", c, "--prompt_lookup", 2, "--speculate_k", 0, *N],
                         "--speculate_k"),
    # quantization
    "groupsize_zero": (QUANT, lambda t, c, s: ["--checkpoint_path", c, "--mode", "int4", "--groupsize", 0,
                                               "--out_dir", t / "q"], "--groupsize"),
    "gptq_on_nan_weights": (QUANT, lambda t, c, s: ["--checkpoint_path", poisoned(c, t, math.nan), "--mode",
                                                    "int4-gptq", "--out_dir", t / "q"], "NaN"),
    "quantize_nan_weights": (QUANT, lambda t, c, s: ["--checkpoint_path", poisoned(c, t, math.nan), "--mode", "int8",
                                                     "--out_dir", t / "q"], "NaN"),
    "gptq_binary_calibration_file": (QUANT, lambda t, c, s: ["--checkpoint_path", c, "--mode", "int4-gptq",
                                                             "--calibration_file", c / "model.safetensors",
                                                             "--out_dir", t / "q"], "text"),
    "quantize_force_onto_the_inputs_parent": (QUANT, lambda t, c, s: ["--checkpoint_path", copy(c, t), "--mode",
                                                                      "int8", "--out_dir", t, "--force"],
                                              "contains the input"),
    "quantize_force_onto_a_users_folder": (QUANT, lambda t, c, s: ["--checkpoint_path", c, "--mode", "int8",
                                                                   "--out_dir", user_folder(t, "thesis.pdf",
                                                                                            "config.json"),
                                                                   "--force"], "also holds"),
    # conversion
    "hf_heads_zero": (CONVERT, lambda t, c, s: ["--checkpoint_dir", hf(t, s, num_attention_heads=0),
                                                "--out_dir", t / "out"], "num_attention_heads"),
    "hf_float_vocab_size": (CONVERT, lambda t, c, s: ["--checkpoint_dir", hf(t, s, vocab_size=320.0),
                                                      "--out_dir", t / "out"], "vocab_size"),
    "hf_nan_rope_theta": (CONVERT, lambda t, c, s: ["--checkpoint_dir", hf(t, s, rope_theta=math.nan, rope_parameters=None),
                                                    "--out_dir", t / "out"], "rope_theta"),
    "hf_tie_word_embeddings_as_a_string": (CONVERT, lambda t, c, s: ["--checkpoint_dir",
                                                                     hf(t, s, tie_word_embeddings="false"),
                                                                     "--out_dir", t / "out"], "tie_word_embeddings"),
    "hf_int8_tensor_for_a_float_weight": (CONVERT, lambda t, c, s: ["--checkpoint_dir", hf_with_int8_weight(t, s),
                                                                    "--out_dir", t / "out"], "float weight"),
    "convert_into_the_hf_download": (CONVERT, lambda t, c, s: ["--checkpoint_dir", hf(t, s), "--out_dir", t / "hf"],
                                     "is the input"),
    "convert_into_a_users_folder": (CONVERT, lambda t, c, s: ["--checkpoint_dir", hf(t, s),
                                                              "--out_dir", user_folder(t, "notes.md")], "not empty"),
    # GGUF import
    "gguf_not_a_gguf_file": (GGUF, lambda t, c, s: ["--gguf", c / "model.safetensors", "--out_dir", t / "o"],
                             "not a GGUF file"),
    "gguf_missing_file": (GGUF, lambda t, c, s: ["--gguf", t / "none.gguf", "--out_dir", t / "o"], "not found"),
    "gguf_truncated": (GGUF, lambda t, c, s: ["--gguf", truncated_gguf(t), "--out_dir", t / "o"], "truncated"),
    "gguf_unsupported_architecture": (GGUF, lambda t, c, s: ["--gguf", write_tiny_gguf(t / "m.gguf", arch="falcon"),
                                                             "--out_dir", t / "o"], "architecture 'falcon'"),
    "gguf_sentencepiece_without_tokenizer": (GGUF, lambda t, c, s: ["--gguf", write_tiny_gguf(t / "m.gguf",
                                                                                              tokenizer="llama"),
                                                                    "--out_dir", t / "o"], "--tokenizer PATH"),
    "gguf_unknown_pre_tokenizer": (GGUF, lambda t, c, s: ["--gguf", write_tiny_gguf(t / "m.gguf", pre="viking"),
                                                          "--out_dir", t / "o"], "tokenizer.ggml.pre 'viking'"),
    "gguf_into_its_own_folder": (GGUF, lambda t, c, s: ["--gguf", write_tiny_gguf(t / "m.gguf"), "--out_dir", t,
                                                        "--force"], "contains the input"),
    # evaluation
    "eval_nan_checkpoint": (EVAL, lambda t, c, s: ["--checkpoint_path", poisoned(c, t, math.nan), "--max_files", 1],
                            "NaN"),
    "eval_random_bytes": (EVAL, lambda t, c, s: ["--checkpoint_path", c, "--text",
                                                 (t / "r.bin").write_bytes(bytes(range(256)) * 64) and t / "r.bin"],
                          "UTF-8"),
    "eval_missing_text": (EVAL, lambda t, c, s: ["--checkpoint_path", c, "--text", t / "none.txt"], "not found"),
    # training
    "train_absurd_seq_len": (TRAIN, lambda t, c, s: ["--smoke", "--out_dir", t / "o", "--seq_len", 10**9], "--seq_len"),
    "train_batch_larger_than_memory": (TRAIN, lambda t, c, s: ["--out_dir", t / "o", "--batch_size", 10**6], "GB"),
    "train_out_dir_is_a_file": (TRAIN, lambda t, c, s: ["--smoke", "--out_dir", user_folder(t, "f") / "f"],
                                "not a directory"),
    "train_vocab_size_zero": (TRAIN, lambda t, c, s: ["--smoke", "--out_dir", t / "o", "--vocab_size", 0],
                              "--vocab_size"),
    "train_steps_zero": (TRAIN, lambda t, c, s: ["--smoke", "--out_dir", t / "o", "--steps", 0], "--steps"),
    "train_force_onto_a_users_folder": (TRAIN, lambda t, c, s: ["--smoke", "--force", "--out_dir",
                                                                user_folder(t, "stdlib-target/notes.md")],
                                        "also holds notes.md"),
    # guided generation
    "json_schema_not_json": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--json_schema", "{'type': 1}", *N],
                             "not valid JSON"),
    "json_schema_unknown_type": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--json_schema",
                                                       '{"type": "objekt"}', *N], "objekt"),
    "json_schema_missing_file": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--json_schema", t / "s.json", *N],
                                 "neither a JSON schema file"),
    "regex_unclosed_class": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--regex", "[a-z", *N], "invalid regex"),
    "lark_unknown_rule": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--grammar", lark_file(t, "start: expr"),
                                                *N], 'unknown name: "expr"'),
    "lark_missing_file": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--grammar", t / "g.lark", *N],
                          "cannot read the grammar file"),
    "two_schemas_for_three_prompts": (GEN, lambda t, c, s: ["--checkpoint_path", c, "--prompt", "a", "--prompt", "b",
                                                            "--prompt", "c", "--json", "--regex", "a+", *N],
                                      "one per prompt"),
    "chat_two_grammars": ("chat.py", lambda t, c, s: ["--checkpoint_path", c, "--json", "--regex", "a+"],
                          "every reply matches it"),
    # benchmarks
    "bench_unknown_device": (BENCH, lambda t, c, s: ["--device", "tpu"], "tpu"),
    "bench_repeats_zero": (BENCH, lambda t, c, s: ["--repeats", 0], "--repeats"),
    "bench_batch_zero": (BENCH, lambda t, c, s: ["--batches", 1, 0], "--batches"),
    "bench_json_onto_a_users_file": (BENCH, lambda t, c, s: ["--json", user_folder(t, "r.json") / "r.json"],
                                     "not an earlier output"),
    "bench_quantize_unknown_device": (BENCH_Q, lambda t, c, s: ["--device", "tpu"], "tpu"),
    "bench_quantize_repeats_zero": (BENCH_Q, lambda t, c, s: ["--repeats", 0], "--repeats"),
    "bench_speculative_rounds_zero": (BENCH_S, lambda t, c, s: ["--rounds", 0], "--rounds"),
    "bench_speculative_unknown_device": (BENCH_S, lambda t, c, s: ["--device", "tpu"], "tpu"),
    "bench_speculative_plot_onto_a_users_file": (BENCH_S, lambda t, c, s: ["--json",
                                                                           user_folder(t, "r.png") / "r.json"],
                                                 "not an earlier output"),
    "bench_cpu_step_no_checkpoint": (BENCH_C, lambda t, c, s: ["--checkpoint_path", t / "none"], "no checkpoint"),
    "bench_cpu_step_rounds_zero": (BENCH_C, lambda t, c, s: ["--rounds", 0], "--rounds"),
    "bench_cpu_step_json_onto_a_users_file": (BENCH_C, lambda t, c, s: ["--json", user_folder(t, "r.json") / "r.json"],
                                              "not an earlier output"),
    "batch_no_prompts_file": (BATCH, lambda t, c, s: ["--checkpoint_path", c, "--prompts_file", t / "none"],
                              "not found"),
    "batch_prompts_file_of_blank_lines": (BATCH, lambda t, c, s: ["--checkpoint_path", c, "--prompts_file",
                                                                  text_file(t, "p.txt", "\n  \n")], "no prompt"),
    "batch_prompts_file_bad_json_line": (BATCH, lambda t, c, s: [
        "--checkpoint_path", c, "--prompts_file", text_file(t, "p.jsonl", '{"prompt": "a"}\n{"prompt": \n')],
        "line 2"),
    "batch_prompts_file_line_without_prompt": (BATCH, lambda t, c, s: [
        "--checkpoint_path", c, "--prompts_file", text_file(t, "p.jsonl", '{"prompt": "a"}\n{"text": "b"}\n')],
        "line 2"),
    "batch_output_onto_a_users_file": (BATCH, lambda t, c, s: [
        "--checkpoint_path", c, "--prompts_file", text_file(t, "p.txt", "hi\n"), "--output",
        user_folder(t, "a.jsonl") / "a.jsonl"], "exists"),
    "batch_concurrency_zero": (BATCH, lambda t, c, s: ["--checkpoint_path", c, "--prompts_file",
                                                       text_file(t, "p.txt", "hi\n"), "--concurrency", 0],
                               "--concurrency"),
    "bench_engine_lengths_reversed": (BENCH_E, lambda t, c, s: ["--lengths", 10, 5], "--lengths"),
    "bench_engine_peer_on_a_gpu": (BENCH_E, lambda t, c, s: ["--device", "cuda", "--peer", "llama.cpp"], "--device"),
    "bench_engine_top_p_zero": (BENCH_E, lambda t, c, s: ["--temperature", 1, "--top_p", 0], "top_p"),
    "bench_engine_json_onto_a_users_file": (BENCH_E, lambda t, c, s: ["--json", user_folder(t, "r.json") / "r.json"],
                                            "not an earlier output"),
    "serve_missing_checkpoint": (SERVE, lambda t, c, s: ["--checkpoint_path", t / "nope"], "not found"),
    "serve_port_past_65535": (SERVE, lambda t, c, s: ["--checkpoint_path", c, "--port", 70000], "--port"),
    "serve_negative_grace": (SERVE, lambda t, c, s: ["--checkpoint_path", c, "--grace", -1], "--grace"),
    "serve_address_not_here": (SERVE, lambda t, c, s: ["--checkpoint_path", c, "--host", "10.255.255.1"],
                               "cannot listen"),
    "bench_serve_rate_zero": (BENCH_SERVE, lambda t, c, s: ["--rates", 1, 0], "--rates"),
    "bench_serve_lengths_reversed": (BENCH_SERVE, lambda t, c, s: ["--lengths", 10, 5], "--lengths"),
    "bench_serve_temperature_past_2": (BENCH_SERVE, lambda t, c, s: ["--temperature", 3], "--temperature"),
    "bench_serve_url_with_models": (BENCH_SERVE, lambda t, c, s: ["--url", "http://127.0.0.1:9", "--models",
                                                                  "builtin"], "--models"),
    "bench_serve_url_nothing_answers": (BENCH_SERVE, lambda t, c, s: ["--url", "http://127.0.0.1:9", "--json",
                                                                      t / "r.json"], "nothing answers"),
    "bench_serve_json_onto_a_users_file": (BENCH_SERVE, lambda t, c, s: [
        "--url", "http://127.0.0.1:9", "--json", user_folder(t, "r.json") / "r.json"], "not an earlier output"),
    "roofline_rows_past_the_decode_kernels": (ROOFLINE, lambda t, c, s: ["--checkpoint_path", c, "--rows", 33],
                                              "--rows"),
    "roofline_missing_checkpoint": (ROOFLINE, lambda t, c, s: ["--checkpoint_path", t / "nope"], "no checkpoint"),
}


@pytest.mark.parametrize("row", ROWS)
def test_bad_input_gets_one_line_status_2_and_changes_no_file(row, checkpoint, sp_model_path, tmp_path):
    script, make, word = ROWS[row]
    args = make(tmp_path, checkpoint, sp_model_path)
    before = fingerprint(tmp_path), fingerprint(checkpoint)
    result = command(script, *args, stdin=b"  \n" if "-" in args else None)
    stderr = result.stderr.decode(errors="replace")
    lines = errors_of(stderr)
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and word in lines[0], stderr
    assert (fingerprint(tmp_path), fingerprint(checkpoint)) == before


@pytest.mark.parametrize("ending", ["raise SystemExit(2)", "raise ValueError('no')", "sys.exit('bye')", "pass"])
def test_the_launcher_ends_a_command_as_python_does(ending, tmp_path):
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text(f"import sys\nprint(sys.argv[1:], sys.stdin.read())\n{ending}\n")
    args = ("--prompt", b"caf\xe9")
    ours = command(script, *args, stdin=b"in")
    python = subprocess.run([sys.executable, script, *args], input=b"in", capture_output=True, timeout=60)
    assert (ours.returncode, ours.stdout) == (python.returncode, python.stdout)
    assert ours.stderr.splitlines()[-1:] == python.stderr.splitlines()[-1:]  # the exception, or the message
    assert (b"Traceback" in ours.stderr) == (b"Traceback" in python.stderr)
