"""The benchmarks' quick modes run end to end and write their JSON (their figures are checked by reading them, not
here: a timed test is not a benchmark)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import huge_pages
from conftest import errors_of, mapping_of
from fake_llama_server import executable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench import probe_ones  # noqa: E402


def test_bench_guided_pairs_each_run_with_a_guided_one(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "--guided", "--shapes", "built-in",
                             "--weights", "bf16", "--modes", "eager", "--batches", "1", "--prompts", "16",
                             "--new_tokens", "16", "--repeats", "1", "--no-transformers", "--no-long_cache",
                             "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["guided_tok_s"] > 0 and row["guided_mask_steps_s"] > 0 and 0 < row["guided_forced"] < 1
    assert "guided steps/s, no fast-forward" in result.stdout


@pytest.mark.skipif(not huge_pages(), reason="this Linux gives no transparent huge pages")
def test_the_memory_probe_reads_memory_that_asks_for_huge_pages_as_the_weights_do():
    ones = probe_ones(1 / 256, torch.device("cpu"))  # 4 MiB
    assert ones.dtype == torch.float32 and ones.numel() == 2**20 and bool((ones == 1).all())
    place, flags = mapping_of(ones.data_ptr())
    assert place == "" and "hg" in flags  # anonymous memory, madvised for 2 MB pages


@pytest.mark.skipif(not huge_pages(), reason="this Linux gives no transparent huge pages")
def test_the_memory_probe_is_plain_memory_when_no_block_can_be_mapped(monkeypatch):
    import checkpoint

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(checkpoint.mmap, "mmap", no_memory)
    ones = probe_ones(1 / 256, torch.device("cpu"))
    assert ones.numel() == 2**20 and bool((ones == 1).all())


def test_the_memory_probes_are_made_once_and_kept_so_no_free_lands_on_a_measurement(monkeypatch):
    import bench
    made = []
    monkeypatch.setattr(bench, "PROBES", {})
    monkeypatch.setattr(bench, "probe_ones", lambda gib, device: made.append(gib) or torch.ones(int(gib * 2**28)))
    cpu = torch.device("cpu")
    for _ in range(3):
        assert bench.read_bandwidth(cpu, 1 / 256) > 0 and bench.copy_bandwidth(cpu, 1 / 256) > 0
    assert made == [1 / 256, 1 / 256]  # the copy's source (also the sum's) and its destination, once each


def test_bench_cpu_step_times_both_steps_alternating_and_writes_json(tmp_path):
    import cpu_gemv
    if cpu_gemv.load() is None:
        pytest.skip("no kernels for this CPU or no g++: there is no C++ step to time")
    out = tmp_path / "cpu_step.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench_cpu_step.py"), "--rounds", "3", "--steps", "2",
                             "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(out.read_text())
    assert len(row["compiled_ms"]) == len(row["cpp_ms"]) == len(row["ratios"]) == 3
    assert row["ratios"] == pytest.approx([a / b for a, b in zip(row["compiled_ms"], row["cpp_ms"])])
    assert "| stdlib-target |" in result.stdout


FORCED = ["draft", "tree", "staged", "lookup", "suffix", "lookahead"]


def test_bench_speculative_times_each_method_against_plain_decoding_and_writes_json(tmp_path):
    import speculative
    methods = (["auto"] if "auto" in speculative.SPECULATE else []) + FORCED
    out = tmp_path / "spec.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench_speculative.py"), "--models", "builtin",
                             "--workloads", "repetitive", "--methods", *methods, "--prompts", "1", "--rounds", "1",
                             "--new_tokens", "8", "--json", str(out)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    r = json.loads(out.read_text())
    assert {"platform", "cpu", "cpu_kernels", "threads"} <= set(r["machine"]) and r["date"]
    workload = r["models"]["builtin"]["workloads"]["repetitive"]
    runs = workload["methods"]
    assert set(runs) == {"plain", *methods} and workload["best_forced"] in FORCED
    assert ("auto_over_best" in workload) == ("auto" in methods)
    assert runs["plain"]["same"] is True and runs["plain"]["speedups"] == [1.0]
    for m in runs.values():  # one round of one prompt: one timed run, its tokens and figures
        [[run]] = m["runs"]
        assert m["speedup"] > 0 and run["decode_s"] > 0 and len(run["tokens"]) == 8
    assert "| repetitive text |" in result.stdout


def test_bench_speculative_compares_the_default_with_the_best_method_on_the_same_prompts():
    from bench_speculative import summary
    run = lambda s: {"decode_s": s, "decode_tokens": 1, "seconds": s, "tokens": [1]}  # noqa: E731 (s per token)
    # round 0, prompts 0 and 1: lookup twice as fast as auto on one prompt, half as fast on the other
    runs = {"plain": [[run(4.0), run(4.0)]], "lookup": [[run(1.0), run(2.0)]], "auto": [[run(2.0), run(1.0)]],
            "suffix": [[run(3.0), run(3.0)]]}
    out = summary(runs)
    assert out["best_forced"] == "lookup" and out["auto_over_best"] == pytest.approx(1.0)


def test_bench_engine_runs_a_workload_through_the_engine_and_beside_it_llama_server_and_writes_json(tmp_path):
    """with a stand-in llama-server (tests/fake_llama_server.py) in two rounds"""
    program, out = executable(tmp_path / "bin"), tmp_path / "engine.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench_engine.py"), "--models", "builtin",
                             "--requests", "6", "--concurrency", "3", "--lengths", "8", "24", "--peer", "llama.cpp",
                             "--llama_cpp", str(program.parent), "--rounds", "2", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    r = json.loads(out.read_text())["models"]["builtin"]
    assert r["new_tokens"] >= 6 * 8 and r["tokens_per_s"] > 0 and r["batch1_tokens_per_s"] > 0
    assert 0 < r["peak_kv_bytes"] <= r["static_kv_bytes"] and "| builtin |" in result.stdout
    theirs = r["llama_cpp"]
    assert theirs["type"] == "BF16" and theirs["gguf"].endswith("stdlib-target-BF16.gguf") and len(r["rounds"]) == 2
    assert theirs["new_tokens"] == r["new_tokens"] and theirs["tokens_per_s"] > 0 and theirs["prompt_tokens_per_s"]
    ratios = sorted(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(r["rounds"], theirs["rounds"]))
    assert r["over_llama_cpp"] == pytest.approx(sum(ratios) / 2)
    calls = [json.loads(line) for line in (tmp_path / "bin" / "llama-server.calls").read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["argv"] == theirs["command"][1:] and "-np 3" in " ".join(theirs["command"])
    assert "| builtin | BF16 |" in result.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/bench_engine.py"), "--llama_cpp", str(tmp_path),
                          "--json", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and len(errors_of(bad.stderr)) == 1 and "--peer" in bad.stderr


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="the C++ kernels are x86's")
def test_roofline_sets_the_engines_steps_against_ceilings_measured_here_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/roofline.py"), "--rows", "4", "--context", "8",
                             "--rounds", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    (model,) = figures["models"]
    assert min(model["read_bytes_per_s"]) > 0 and min(figures["macs_per_s"].values()) > 0
    assert model["rows"] == 4 and model["one_row_tokens_per_s"] > 0 and model["rows_tokens_per_s"] > 0
    assert 0 < model["rows_compute_share"] < 1  # no step outruns the multiply-add units
    assert "| stdlib-target |" in result.stdout
