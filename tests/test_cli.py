"""`python generate.py` end to end, as a user would run it (forked by tests/launcher.py; reading stdin and Ctrl-C in
a process of their own)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import errors_of
from launcher import command

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=300):
    return command("generate.py", *args, timeout=timeout, text=True)


# one schema for plain and speculative decoding; speculation's figures are null without it
METRICS = {"ttft_ms", "decode_tokens_per_sec", "tokens_per_sec", "prefill_tokens_per_sec", "bandwidth_gb_s",
           "peak_memory_gb", "compile_s", "total_s", "samples", "target_forwards", "mean_accepted", "mean_drafted",
           "acceptance_rate", "accept_histogram", "forced_tokens", "tree_sizes", "methods",
           "incomplete"}


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
    lines = errors_of(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


@pytest.mark.parametrize("args, message", [
    (("--checkpoint_path", "/nonexistent/ckpt"), "checkpoint not found"),
    (("--checkpoint_path", ROOT / "model.py"), "not a checkpoint"),
    (("--max_new_tokens", 1000), "exceeds the maximum"),
    (("--max_new_tokens", 10, "--max_seq_length", 8), "exceeds the maximum"),
    (("--max_new_tokens", 0), "--max_new_tokens"),
    (("--temperature", -0.5), "--temperature"),
    (("--top_k", -1), "--top_k"),
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


# ---- prompts, labels and interruption -----------------------------------------------------------------------------

def test_cli_reads_the_prompt_from_stdin_and_from_a_file(checkpoint, tmp_path):
    args = ("--checkpoint_path", checkpoint, "--max_new_tokens", 4, "--ignore_eos", "--temperature", 0)
    stdin = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--prompt", "-", *map(str, args)],
                           input="the quick brown", capture_output=True, text=True, timeout=300, cwd=ROOT)
    (tmp_path / "p.txt").write_text("the quick brown")
    from_file = run_cli("--prompt_file", tmp_path / "p.txt", *args)
    inline = run_cli("--prompt", "the quick brown", *args)
    assert stdin.returncode == from_file.returncode == inline.returncode == 0, stdin.stderr + from_file.stderr
    text = lambda r: r.stdout.splitlines()[1]  # noqa: E731  (the line after "Loaded ...")
    assert text(stdin) == text(from_file) == text(inline) and text(inline).startswith("the quick brown")


def test_cli_labels_each_output_of_a_batch(checkpoint):
    result = run_cli("--checkpoint_path", checkpoint, "--prompt", "def f(x):", "--prompt", "the lazy dog",
                     "--max_new_tokens", 4, "--ignore_eos")
    assert result.returncode == 0, result.stderr
    assert "--- prompt 1 of 2 ---\ndef f(x):" in result.stdout
    assert "--- prompt 2 of 2 ---\nthe lazy dog" in result.stdout


def test_cli_metrics_json_replaces_its_own_earlier_file(checkpoint, tmp_path):
    first = metrics_of(checkpoint, tmp_path, "--max_new_tokens", 3, "--ignore_eos")[1]
    second = metrics_of(checkpoint, tmp_path, "--max_new_tokens", 5, "--ignore_eos")[1]
    assert len(first["samples"][0]["tokens"]) == 3 and len(second["samples"][0]["tokens"]) == 5


def test_cli_runs_a_model_whose_vocabulary_is_padded_past_the_tokenizer(checkpoint, tmp_path):
    padded = tmp_path / "padded"
    shutil.copytree(checkpoint, padded)
    from safetensors.torch import load_file, save_file
    import torch
    state = load_file(padded / "model.safetensors")
    for k in ("tok_embeddings.weight", "output.weight"):  # 64 more rows, as models padded to a multiple of 64 have
        state[k] = torch.cat([state[k], torch.zeros(64, state[k].size(1))])
    torch.manual_seed(0)  # real ids score 0 and some padding id scores above it: padding wins every greedy step
    state["output.weight"] = torch.cat([state["output.weight"][:-64] * 0, torch.randn(64, state[k].size(1)) * 10])
    save_file(state, padded / "model.safetensors")
    cfg = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    _, metrics = metrics_of(padded, tmp_path, "--prompt", "the", "--max_new_tokens", 4, "--ignore_eos",
                                "--temperature", 0)
    assert metrics["samples"][0]["text"] == "" and min(metrics["samples"][0]["tokens"]) >= cfg["vocab_size"]


def default_sigint():
    """A shell without job control starts background jobs with SIGINT ignored, and a child inherits that (as nohup
    intends), so the suite run that way would send a Ctrl-C the process never sees. A terminal's process has it."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_with_one_line_and_status_130_keeping_what_was_printed(tmp_path):
    import os
    import signal
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--max_new_tokens", "1000",
                             "--ignore_eos", "--num_samples", "1000", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=default_sigint)
    first = proc.stdout.readline()  # "Loaded ...": generation starts right after it
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert first.startswith("Loaded") and "Traceback" not in err
    assert errors_of(err) == ["interrupted"]


def test_a_busy_cpu_is_reported_with_the_fix(capfd, monkeypatch):
    import os
    import time
    import cli
    monkeypatch.setattr(cli, "warned", False)
    cores = len(os.sched_getaffinity(0))
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        cli.set_threads(cores)
    finally:
        for p in spin:
            p.kill()
    err = capfd.readouterr().err
    assert err.startswith("warning:") and "--threads 1" in err and len(err.splitlines()) == 1


def test_physical_cores_counts_at_least_one_and_at_most_the_cpus():
    import os
    import cli
    assert 1 <= cli.physical_cores() <= len(os.sched_getaffinity(0))


def test_a_torch_older_than_the_oldest_tested_gets_one_line_and_status_2():
    code = ("import runpy, sys, torch; from torch.torch_version import TorchVersion; "
            "torch.__version__ = TorchVersion('2.5.1'); sys.argv = ['generate.py']; "
            "runpy.run_path('generate.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["error: torch 2.11 or newer is needed; this is torch 2.5.1"]


def test_torchs_guess_of_a_cuda_home_prints_nothing_in_a_command_and_importing_the_kernels_changes_no_logger(tmp_path):
    """A CUDA build of torch on a machine without a GPU warns when its C++-extension module guesses a CUDA home (the
    kernels' build and inductor's do). Called directly, the guess warns on any build; inside a command, not; and
    importing cpu_gemv leaves torch's loggers as they were."""
    import os

    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA runtime, so torch has nothing to warn about")
    guess = "from torch.utils.cpp_extension import _find_cuda_home; _find_cuda_home()"
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", first], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
            for first in (guess, f"import cli; cli.run_main(lambda: exec({guess!r}))",
                          "import logging, cpu_gemv; assert logging.getLogger('torch.utils.cpp_extension').level == 0")]
    assert "No CUDA runtime is found" in runs[0].stderr  # what the warning looks like, where nothing stops it
    assert runs[1].returncode == 0 and runs[1].stderr == ""
    assert runs[2].returncode == 0 and runs[2].stderr == ""


def test_ctrl_c_while_torch_is_still_importing_is_one_line_and_status_130():
    import signal
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=default_sigint)
    time.sleep(0.5)  # Python is up; importing torch takes seconds
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and errors_of(err) == ["interrupted"]


def test_an_unknown_flag_gets_the_closest_known_one(capsys):
    import cli
    import generate
    with pytest.raises(SystemExit) as e:
        cli.run_main(generate.main, ["--max_tokens", "5"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["error: unrecognized arguments: --max_tokens 5; did you mean "
                                                    "--max_new_tokens?"]


def busy(n):
    """n processes spinning on the CPU, for the length of the with block."""
    import contextlib
    import time

    @contextlib.contextmanager
    def spinning():
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        try:
            time.sleep(0.5)
            yield
        finally:
            for p in spin:
                p.kill()
    return spinning()


def test_the_default_thread_count_leaves_the_busy_cores_and_says_so(capfd, monkeypatch):
    import os
    import cli
    monkeypatch.setattr(cli, "warned", False)
    cores = len(os.sched_getaffinity(0))
    with busy(cores):
        chosen = cli.set_threads(None)
    err = capfd.readouterr().err
    assert chosen < cli.physical_cores() or cli.physical_cores() == 1
    assert f"decoding uses {chosen} thread(s)" in err and len(err.splitlines()) == 1


def test_a_busy_cpu_is_reported_once_a_process_however_many_models_load(capfd, monkeypatch):
    import os
    import cli
    monkeypatch.setattr(cli, "warned", False)
    with busy(len(os.sched_getaffinity(0))):
        first = cli.set_threads(None)
        cli.set_threads(None)
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and f"decoding uses {first} thread(s)" in err


def test_threads_asked_for_get_no_advice_to_use_the_same_number(capfd, monkeypatch):
    import os
    import cli
    monkeypatch.setattr(cli, "warned", False)
    with busy(len(os.sched_getaffinity(0))):
        cli.set_threads(1)
    err = capfd.readouterr().err
    assert "--threads 1" not in err and len(err.splitlines()) <= 1


def test_guided_output_cut_by_max_new_tokens_says_incomplete_in_the_output_and_the_metrics(checkpoint, tmp_path):
    result, metrics = metrics_of(checkpoint, tmp_path, "--regex", "[a-z]{40}", "--max_new_tokens", 4,
                                 "--temperature", 0)
    assert "is incomplete" in result.stderr and "(incomplete)" in result.stdout
    assert metrics["incomplete"] is True and metrics["samples"][0]["finish_reason"] == "incomplete"


def test_a_finished_row_repeating_eos_streams_no_end_of_turn_token(chat_checkpoint, capsys):
    from checkpoint import load_tokenizer, read_config
    import cli
    tok = load_tokenizer(chat_checkpoint, read_config(chat_checkpoint))
    end = tok.token_id("<|im_end|>")
    assert end in tok.eos_ids
    prompt, reply = tok.encode("hi", bos=False), tok.encode(" there", bos=False)
    stream = cli.make_streamer(tok, prompt, tok.eos_ids)
    for n in range(1, len(reply) + 9):  # the reply, then EOS 8 times, as a batch's finished row repeats it
        stream((reply + [end] * 8)[:n])
    assert capsys.readouterr().out == tok.decode(prompt + reply)[len(tok.decode(prompt)):]


def test_help_gives_each_options_default_and_none_where_there_is_none():
    import cli
    import generate
    text = " ".join(cli.generate_parser(generate.__doc__).format_help().split())
    assert "at most (default: 200)" in text and "(default: the checkpoint's generation_config.json, else 0.8)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_sampling_flags_not_given_are_the_checkpoints_defaults_and_given_ones_win(tmp_path):
    import json

    import cli
    import generate
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.9}))
    p = cli.generate_parser(generate.__doc__)
    args = p.parse_args(["--checkpoint_path", str(tmp_path)])
    cli.sampling_options(p, args)
    assert (args.temperature, args.top_k, args.top_p) == (0.2, 200, 0.9)  # top_k: the command's own default
    args = p.parse_args(["--checkpoint_path", str(tmp_path), "--temperature", "0.7", "--top_k", "0"])
    cli.sampling_options(p, args)
    assert (args.temperature, args.top_k, args.top_p) == (0.7, 0, 0.9)  # (0: no limit)
