"""scripts/llama_cpp.py and bench.py --peer: a checkpoint written as GGUF is the same model when read back, and the
peer benchmark alternates its two sides and reports medians and ratios. llama.cpp itself takes ten minutes to
build, so here a stand-in llama-bench reports fixed speeds (the real comparison is README.md's table)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from checkpoint import read_checkpoint
from conftest import errors_of

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_peer import kept, memory_changed, round_plan  # noqa: E402
from convert_gguf import convert_gguf  # noqa: E402
from fake_llama_server import PROMPT_MS_PER_TOKEN, FakeServer, executable  # noqa: E402
from llama_cpp import llama_bench, write_gguf  # noqa: E402
from llama_server import free_port, llama_server, serve_workload, server_command  # noqa: E402


def test_a_checkpoint_written_as_gguf_reads_back_as_the_same_weights(checkpoint, tmp_path):
    write_gguf(checkpoint, tmp_path / "model.gguf")
    back = convert_gguf(tmp_path / "model.gguf", tmp_path / "back", tokenizer=checkpoint / "tokenizer.model")
    args, _, state = read_checkpoint(checkpoint)
    args_back, _, state_back = read_checkpoint(back)
    assert replace(args_back, norm_eps=args.norm_eps) == args and abs(args_back.norm_eps / args.norm_eps - 1) < 1e-6
    assert state.keys() == state_back.keys() and all(torch.equal(state[k], state_back[k]) for k in state)


FAKE_BENCH = """#!/usr/bin/env python3
import json, sys
a = sys.argv
n = lambda flag: int(a[a.index(flag) + 1])
open(sys.argv[0] + ".calls", "a").write(" ".join(a[1:]) + "\\n")
tests = []
if n("-p"):
    tests.append({"n_prompt": n("-p"), "n_gen": 0, "avg_ts": 100.0})
if n("-n"):
    tests.append({"n_prompt": 0, "n_gen": n("-n"), "avg_ts": 40.0 if n("-d") else 50.0})
print(json.dumps(tests))
"""


def fake_llama_cpp(folder: Path) -> Path:
    folder.mkdir()
    (folder / "llama-bench").write_text(FAKE_BENCH)
    (folder / "llama-quantize").write_text("#!/bin/sh\ncp \"$3\" \"$4\"\n")  # --allow-requantize --pure IN OUT TYPE
    for tool in ("llama-bench", "llama-quantize"):
        os.chmod(folder / tool, 0o755)
    return folder


def test_llama_bench_speeds_are_read_from_its_json(tmp_path):
    tools = fake_llama_cpp(tmp_path / "bin")
    assert llama_bench(tools, tmp_path / "m.gguf", 2, 512, 64) == {"prefill": 100.0, "decode": 50.0}
    assert llama_bench(tools, tmp_path / "m.gguf", 2, 0, 64, 4096, warmup=False) == {"decode": 40.0}
    assert "-d 4096 --no-warmup" in (tools / "llama-bench.calls").read_text()


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """bench.py --peer on the built-in shape in int8 with an int8 KV cache, two rounds, against the stand-in
    llama-bench"""
    tmp = tmp_path_factory.mktemp("peer")
    tools, out = fake_llama_cpp(tmp / "bin"), tmp / "peer.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "--peer", "llama.cpp", "--llama_cpp",
                             str(tools), "--shapes", "built-in", "--weights", "int8", "--rounds", "2", "--prefill",
                             "32", "--depth", "300", "--new_tokens", "8", "--threads", "1", "--kv_cache_dtype",
                             "int8", "--work_dir", str(tmp / "work"), "--json", str(out)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    calls = [c.split() for c in (tools / "llama-bench.calls").read_text().splitlines() if c.startswith("-m")]
    return result.stdout, json.loads(out.read_text())["peer_rows"][0], calls, tmp / "work"


def test_bench_peer_alternates_rounds_and_reports_each_ratio(peer_run):
    stdout, row, _, work = peer_run
    assert row["weights"] == "int8, KV int8" and row["theirs"] == "Q8_0, KV Q8_0" and len(row["rounds"]) == 2
    assert (work / "built-in-1024-Q8_0.gguf").exists()
    assert row["llama_decode"] == 50.0 and row["llama_prefill"] == 100.0 and row["llama_depth_decode"] == 40.0
    ours = sorted(a["decode"] for a, _ in row["rounds"])
    assert row["decode_ratio"] == pytest.approx(sum(ours) / 2 / 50.0) and row["decode_ratio"] > 0
    # the memory measured in each round, before and after our decode
    assert row["depth_decode"] > 0 and [len(probes) for probes in row["read_rounds_gb_s"]] == [2, 2]
    kept = sorted(a["kept"] for a, _ in row["rounds"])
    assert row["depth_kept"] == pytest.approx(sum(kept) / 2) and kept[0] > 0  # the median of the rounds' own
    pct = [100 * row["weight_bytes"] * a["decode"] / (sum(probes) / 2 * 1e9)
           for (a, _), probes in zip(row["rounds"], row["read_rounds_gb_s"])]
    assert row["pct_read"] == pytest.approx(sum(pct) / 2) and row["pct_read"] > 0
    assert row["memory_changed_rounds"] == [i for i, p in enumerate(row["read_rounds_gb_s"]) if memory_changed(p)]
    assert "| int8, KV int8 | Q8_0, KV Q8_0 | idle |" in stdout


def test_our_short_decode_runs_between_two_read_probes_in_either_order():
    for mirrored in (False, True):
        plan = round_plan(True, mirrored)
        i = plan.index(("ours", "decode"))
        assert {plan[i - 1], plan[i + 1]} == {("read", "0"), ("read", "1")}
        assert [step for step in plan if step[0] == "read"] == [("read", k) for k in ("10" if mirrored else "01")]


def test_kept_runs_right_beside_our_decode_at_depth_in_either_order():
    for mirrored in (False, True):
        plan = round_plan(True, mirrored)
        i = plan.index(("ours", "depth_decode"))
        assert plan[i + (-1 if mirrored else 1)] == ("ours", "kept") and ("theirs", "kept") not in plan


def test_kept_compares_the_decode_at_depth_with_one_after_100_tokens_of_context():
    calls = []

    def rate(ids, n, cached):  # 10 tok/s at depth, 20 after a short context
        calls.append((len(ids), n, cached))
        return 10.0 if cached == 4096 else 20.0
    assert kept(rate, list(range(5000)), 16, 4096) == 50.0
    assert calls == [(4097, 16, 4096), (101, 16, 100)] * 5  # each pair at depth first, then right beside it
    calls.clear()
    kept(rate, list(range(5000)), 8, 150)  # a depth under 200: half of it
    assert calls[:2] == [(151, 8, 150), (76, 8, 75)]


def test_a_round_whose_probes_differ_by_over_a_quarter_is_marked_as_the_memory_changing():
    assert memory_changed([33e9, 60e9]) and memory_changed([60e9, 47e9])
    assert not memory_changed([60e9, 49e9]) and not memory_changed([35e9, 35e9])


def test_bench_peer_runs_each_measurement_beside_the_other_sides_and_mirrors_every_other_round(peer_run):
    _, _, calls, _ = peer_run
    tests = [(c[c.index("-p") + 1], c[c.index("-n") + 1], c[c.index("-d") + 1]) for c in calls]
    one_round = [("0", "8", "0"), ("0", "8", "300"), ("32", "0", "0")]  # decode, decode at depth, prefill
    assert tests == one_round + one_round[::-1] and all(c[c.index("-t") + 1] == "1" for c in calls)


def test_bench_peer_runs_a_gguf_file_in_llama_cpp_and_its_import_in_ours(tmp_path):
    import gguf
    from conftest import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=gguf.GGMLQuantizationType.Q4_1)
    tools, out = fake_llama_cpp(tmp_path / "bin"), tmp_path / "peer.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "--peer", "llama.cpp", "--llama_cpp",
                             str(tools), "--gguf", str(model), "--rounds", "1", "--prefill", "16", "--depth", "32",
                             "--new_tokens", "8", "--work_dir", str(tmp_path / "work"), "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    row = json.loads(out.read_text())["peer_rows"][0]
    assert row["weights"] == "imported" and row["decode"] > 0 and row["depth_decode"] > 0
    _, quantization, _ = read_checkpoint(tmp_path / "work" / "tiny-imported")
    assert quantization == ("int4", 32)  # Q4_1's blocks of 32, as imported
    calls = [c for c in (tools / "llama-bench.calls").read_text().splitlines() if c.startswith("-m")]
    assert calls and all(c.split()[1] == str(model) for c in calls)  # llama.cpp reads the file itself
    assert not any("-ctk" in c for c in calls)  # the default cache on both sides


def test_bench_peer_with_an_int8_cache_gives_llama_cpp_a_q8_0_cache(peer_run):
    _, row, calls, _ = peer_run
    assert row["depth_decode"] > 0 and len(calls) == 6
    assert all(" ".join(c).endswith("-ctk q8_0 -ctv q8_0 -fa on") for c in calls)


def test_bench_gguf_without_peer_is_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "--gguf", str(tmp_path / "m.gguf"),
                             "--json", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and len(errors_of(result.stderr)) == 1 and "--peer" in result.stderr


def test_bench_kv_cache_dtype_without_peer_is_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "--kv_cache_dtype", "int8", "--json",
                             str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and len(errors_of(result.stderr)) == 1 and "--peer" in result.stderr
    assert not (tmp_path / "b.json").exists()


def test_bench_gguf_that_is_missing_is_one_line_error_before_any_build(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "--peer", "llama.cpp", "--gguf",
                             str(tmp_path / "m.gguf"), "--json", str(tmp_path / "b.json")], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    lines = errors_of(result.stderr)  # less the warning a busy machine adds
    assert result.returncode != 0 and len(lines) == 1 and "m.gguf not found" in lines[0]


# ---- llama-server, for bench_engine.py --peer ----------------------------------------------------------------------

def test_the_server_client_sends_every_request_first_come_first_served_with_at_most_n_in_flight():
    reqs = [([i] * (i + 1), 4 + i) for i in range(10)]
    with FakeServer() as server:
        r = serve_workload(server.url, reqs, 3)
    got = [(b["prompt"], b["n_predict"]) for b in server.received]
    assert sorted(got) == sorted(reqs) and server.most_in_flight == 3
    assert all(b["ignore_eos"] and not b["cache_prompt"] and b["temperature"] == 0 for b in server.received)
    order = [b["prompt"][0] for b in server.received]  # each thread takes the next request when its last is answered
    assert sorted(order[:3]) == [0, 1, 2] and all(abs(i - at) < 3 for at, i in enumerate(order))
    assert r["new_tokens"] == sum(n for _, n in reqs) and r["tokens_per_s"] == pytest.approx(r["new_tokens"] /
                                                                                            r["seconds"])
    assert r["prompt_tokens"] == sum(len(p) for p, _ in reqs)
    assert r["prompt_tokens_per_s"] == pytest.approx(1e3 / PROMPT_MS_PER_TOKEN)


def test_the_server_client_refuses_an_answer_short_of_the_tokens_asked():
    with FakeServer(short=True) as server, pytest.raises(ValueError, match="answered 4 new tokens where 5"):
        serve_workload(server.url, [([1, 2], 5)] * 4, 2)


def test_llama_server_starts_with_a_slot_per_request_waits_until_ready_and_is_stopped_after(tmp_path):
    program = executable(tmp_path / "bin")
    cmd = server_command(program.parent, tmp_path / "m.gguf", 2, 3, 300, free_port())
    flags = " ".join(cmd)
    assert "--threads 2 --threads-batch 2 -np 3 -c 1536 -cb --cache-ram 0 --no-webui" in flags  # 3 slots of 512
    with llama_server(cmd) as url:
        assert serve_workload(url, [([1, 2, 3], 4)], 1)["new_tokens"] == 4
    call = json.loads((tmp_path / "bin" / "llama-server.calls").read_text())
    assert call["argv"] == cmd[1:]
    with pytest.raises(ProcessLookupError):  # stopped, and reaped
        os.kill(call["pid"], 0)


def test_llama_server_that_exits_while_starting_is_one_line_error(tmp_path):
    program = tmp_path / "llama-server"
    program.write_text("#!/bin/sh\necho 'loading the model'\necho 'error: failed to load model' >&2\nexit 1\n")
    program.chmod(0o755)
    with pytest.raises(ValueError, match="exited with status 1: error: failed to load model"):
        with llama_server([str(program), "--port", str(free_port())]):
            pass


def test_the_real_llama_server_answers_each_request_in_full(real_llama_server):
    reqs = [([5 + i] * (8 + i), 6 + i) for i in range(4)]
    r = serve_workload(real_llama_server, reqs, 2)
    assert r["new_tokens"] == sum(n for _, n in reqs) and r["tokens_per_s"] > 0
    assert r["prompt_tokens"] == sum(len(p) for p, _ in reqs)  # the ids as sent: no token added in front
