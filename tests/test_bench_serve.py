"""scripts/bench_serve.py: its open-loop load and figures against a stand-in OpenAI streaming server in this process
(tests/fake_llama_server.py), the command starting and stopping a stand-in llama-server (also on Ctrl-C), and, where
this checkout has serve.py, a short run against ours on the built-in model. Timings are checked with room for a busy
machine: what matters is which side of a wide line a figure falls."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import errors_of
from fake_llama_server import FakeServer, executable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_serve import arrivals, held, main, run_load, stream_completion, summarize  # noqa: E402
from llama_server import free_port  # noqa: E402


def test_arrivals_are_a_poisson_process_whose_pattern_one_seed_keeps_at_every_rate():
    slow, fast = arrivals(4000, 4.0, seed=0), arrivals(4000, 8.0, seed=0)
    gaps = [b - a for a, b in zip(slow, slow[1:])]
    assert slow[0] == 0.0 and min(gaps) > 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.03)  # exponential: P(gap > mean)=1/e
    assert fast == pytest.approx([t / 2 for t in slow]) and arrivals(4000, 4.0, seed=1) != slow


def test_each_request_goes_out_at_its_time_while_the_server_answers_none_of_the_earlier_ones():
    """open loop: a server that answers nothing until all six have come, then one at a time, gets all six, none
    before its time (a client that waited for answers would never send the second)"""
    offsets = [0.0, 0.02, 0.04, 0.06, 0.08, 0.1]
    with FakeServer(first_s=0.05, token_s=0.0, serial=True, hold=6) as server:
        t0, records = run_load(server.url, "m", [([1, 2, 3], 2)] * 6, offsets)
    assert server.most_in_flight == 6 and all(r["error"] is None for r in records)
    for offset, arrived, r in zip(offsets, sorted(server.arrived), records):
        assert r["due"] == t0 + offset and r["sent"] >= r["due"] and arrived >= t0 + offset
    assert max(r["end"] for r in records) - t0 >= offsets[-1] + 6 * 0.05  # answered one by one, after the last came


def test_ttft_itl_and_tokens_come_from_the_stream():
    with FakeServer(first_s=0.1, token_s=0.03) as server:
        t0, records = run_load(server.url, "m", [([5] * 4, 5), ([6] * 3, 3)], [0.0, 0.0])
    out = summarize(t0, records, rate=2.0)
    assert out["completed"] == 2 and out["errors"] == 0 and out["output_tokens"] == 8 and out["prompt_tokens"] == 7
    assert 100 <= out["ttft_p50_ms"] <= out["ttft_p99_ms"] <= 1e3 * out["seconds"]  # no bound a busy machine breaks
    assert 30 <= out["itl_p50_ms"] <= 1e3 * out["seconds"] and out["tokens_per_chunk"] == 1
    assert out["output_tokens_per_s"] == pytest.approx(8 / out["seconds"]) and out["seconds"] >= 0.1 + 4 * 0.03
    first = out["per_request"][0]
    assert (first["tokens"], first["asked"], first["chunks"], first["usage_prompt_tokens"]) == (5, 5, 5, 4)
    body = server.received[0]
    assert body["prompt"] in ([5] * 4, [6] * 3) and body["stream"] and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"


def record(sent, chunks, end, tokens, error=None):
    return {"prompt": 10, "asked": tokens, "due": sent, "sent": sent, "chunks": chunks, "end": end, "tokens": tokens,
            "prompt_tokens": 10, "error": error}


def test_the_figures_of_a_run():
    """by hand: two answered requests, one failed"""
    records = [record(0.0, [0.5, 0.6, 0.8], 0.8, 3), record(1.0, [1.2, 1.3], 1.35, 2),
               record(1.5, [], 2.0, None, "HTTP 500: boom")]
    out = summarize(0.0, records, rate=1.5)
    assert (out["requests"], out["completed"], out["errors"], out["error_messages"]) == (3, 2, 1, {"HTTP 500: boom": 1})
    assert out["seconds"] == 2.0 and out["output_tokens_per_s"] == 2.5 and out["request_rate"] == 1.0
    assert out["ttft_p50_ms"] == pytest.approx(350) and out["ttft_p99_ms"] == pytest.approx(497)  # 200 and 500
    assert out["itl_p50_ms"] == pytest.approx(100) and out["itl_p99_ms"] == pytest.approx(198)  # 100, 200, 100
    assert out["tpot_p50_ms"] == pytest.approx(150) and out["latency_p50_ms"] == pytest.approx(575)  # 150 each


def test_the_rate_a_server_held_is_the_highest_within_the_ttft_objective_and_without_errors():
    run = lambda side, rate, p99, tok, errors=0: {"model": "m", "server": side, "rate": rate,  # noqa: E731
                                                  "ttft_p99_ms": p99, "output_tokens_per_s": tok, "errors": errors}
    runs = [run("ours", 1, 300, 100), run("ours", 2, 1900, 190), run("ours", 3, 2100, 240),
            run("llama.cpp", 1, 900, 98), run("llama.cpp", 2, 400, 150, errors=1), run("llama.cpp", 3, None, 0)]
    best = held(runs, 2.0)
    assert best[("m", "ours")]["rate"] == 2 and best[("m", "llama.cpp")]["rate"] == 1
    assert held(runs, 0.2) == {}


def test_a_server_answering_fewer_tokens_than_asked_or_none_is_an_error():
    with FakeServer(short=True) as server:
        t0, records = run_load(server.url, "m", [([1, 2], 3), ([3], 4)], [0.0, 0.0])
    out = summarize(t0, records, rate=1.0)
    assert out["errors"] == 2 and out["completed"] == 0 and out["output_tokens"] == 0 and out["ttft_p50_ms"] is None
    assert set(out["error_messages"]) == {f"answered {n - 1} tokens where {n} were asked" for n in (3, 4)}
    refused = stream_completion(f"http://127.0.0.1:{free_port()}", "m", [1], 2)  # nothing listens there
    assert "refused" in refused["error"] and refused["end"] >= refused["sent"]


def test_url_mode_prints_a_row_per_rate_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "serve.json"
    with FakeServer(first_s=0.01, token_s=0.001) as server:
        with pytest.raises(ValueError, match="--vocab"):  # the stand-in has no /v1/models
            main(["--url", server.url, "--json", str(out)])
        main(["--url", server.url + "/v1", "--vocab", "100", "--rates", "20", "40", "--requests", "4", "--lengths",
              "2", "4", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["rate"] for r in result["runs"]] == [20, 40] and result["url"] == server.url + "/v1"
    for r in result["runs"]:
        assert r["completed"] == 4 and r["errors"] == 0 and len(r["per_request"]) == 4
        assert {"output_tokens_per_s", "request_rate", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "errors", "seconds", "max_send_lag_ms"} <= set(r)
        assert f"| default | {server.url}/v1 | {r['rate']:g} |" in printed
    prompts = [b["prompt"] for b in server.received]
    assert len(prompts) == 8 and all(max(p) < 100 for p in prompts)
    # the same lengths at each rate, but ids no server has seen: its prefix cache cannot answer them
    assert sorted(map(len, prompts[:4])) == sorted(map(len, prompts[4:])) and len(set(map(tuple, prompts))) == 8


def started(calls: Path, timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if calls.is_file() and calls.read_text().strip():
            return json.loads(calls.read_text().splitlines()[0])
        time.sleep(0.1)
    raise AssertionError("the stand-in llama-server was never started")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_command_starts_llama_server_drives_it_and_stops_it(tmp_path):
    program, out = executable(tmp_path / "bin"), tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_serve.py"), "--servers", "llama.cpp",
                           "--llama_cpp", str(program.parent), "--models", "builtin", "--rates", "50", "--requests",
                           "4", "--lengths", "4", "8", "--slots", "2", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert (run["model"], run["server"], run["completed"], run["errors"]) == ("builtin", "llama.cpp", 4, 0)
    command = result["servers"]["builtin"]["llama.cpp"]
    call = started(program.parent / "llama-server.calls")
    assert call["argv"] == command[1:] and "-np 2" in " ".join(command) and "--threads 1" in " ".join(command)
    assert gone(call["pid"]) and "| builtin | llama.cpp | 50 |" in done.stdout


def test_ctrl_c_stops_the_server_it_started(tmp_path):
    program = executable(tmp_path / "bin")
    p = subprocess.Popen([sys.executable, str(ROOT / "scripts/bench_serve.py"), "--servers", "llama.cpp",
                          "--llama_cpp", str(program.parent), "--models", "builtin", "--rates", "0.1", "--requests",
                          "50", "--lengths", "4", "8", "--threads", "1", "--json", str(tmp_path / "serve.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        call = started(program.parent / "llama-server.calls")
        time.sleep(1.0)  # into the warm-up or the run
        p.send_signal(signal.SIGINT)
        _, stderr = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and errors_of(stderr)[-1] == "interrupted", stderr
    assert gone(call["pid"]) and not (tmp_path / "serve.json").exists()


def test_the_real_llama_server_streams_token_id_prompts_in_full_with_the_usage(real_llama_server):
    reqs = [([5 + i] * (8 + i), 6 + i) for i in range(4)]
    t0, records = run_load(real_llama_server, "tiny", reqs, [0.0, 0.01, 0.02, 0.03])
    out = summarize(t0, records, rate=100.0)
    assert out["errors"] == 0, out["error_messages"]
    assert out["output_tokens"] == sum(n for _, n in reqs) and out["ttft_p50_ms"] > 0 and out["itl_p50_ms"] > 0
    assert [r["usage_prompt_tokens"] for r in out["per_request"]] == [len(p) for p, _ in reqs]  # the ids as sent


@pytest.mark.skipif(not (ROOT / "serve.py").is_file(), reason="serve.py, our server, is not in this checkout yet")
def test_our_server_on_the_built_in_model(tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench_serve.py"), "--servers", "ours", "--models",
                           "builtin", "--rates", "20", "--requests", "4", "--lengths", "4", "8", "--slots", "2",
                           "--threads", "1", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["server"] == "ours" and run["completed"] == 4 and run["errors"] == 0, run["error_messages"]
