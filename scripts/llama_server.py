"""llama.cpp's llama-server as a peer for scripts/bench_engine.py: started on a free local port with one slot per
request decoding at once and continuous batching, fed a workload's requests as token ids by as many client threads
(each sends the next request as soon as its last one is answered: first come, first served), and stopped after.
Only the standard library speaks to it: /health until it says ok, then /completion. scripts/bench_serve.py starts
and stops it, and our serve.py, the same way (running)."""
import contextlib
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

STARTUP_S, STOP_S = 300.0, 10.0  # loading the weights takes seconds; a slow disk or a busy machine more
CONTEXT_STEP = 256  # each slot's context, rounded up to this
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to 127.0.0.1, whatever http_proxy says


def server_flags(tools: Path) -> str:
    """What this build's llama-server --help says: its flags differ between versions."""
    done = subprocess.run([str(tools / "llama-server"), "--help"], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def server_command(tools: Path, model: Path, threads: int, slots: int, longest: int, port: int) -> list[str]:
    """llama-server with `slots` slots of continuous batching, each with room for the longest request (its -c is
    split among the slots), on `threads` threads for decoding and prompts alike. Its prompt cache in RAM is off:
    every prompt here is new, and saving idle slots to it is work our engine does not do."""
    flags = server_flags(tools)
    per_slot = -(-(longest + 1) // CONTEXT_STEP) * CONTEXT_STEP
    cmd = [str(tools / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--threads-batch", str(threads), "-np", str(slots), "-c", str(slots * per_slot)]
    cmd += ["-cb"] if "--cont-batching" in flags else []
    cmd += ["--cache-ram", "0"] if "--cache-ram" in flags else []
    cmd += ["--no-webui"] if "--no-webui" in flags else []
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_line(log) -> str:
    log.seek(0)
    lines = log.read().strip().splitlines()
    return lines[-1] if lines else "no output"


def wait_healthy(p: subprocess.Popen, url: str, log, timeout: float = STARTUP_S, name: str = "llama-server"):
    """Poll /health until it answers ok (503 while the model loads); fail if the server exits or takes too long."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            raise ValueError(f"{name} exited with status {p.returncode}: {last_line(log)}")
        try:
            with LOCAL.open(url + "/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except (OSError, ValueError):  # not listening yet, or still loading
            pass
        time.sleep(0.1)
    raise ValueError(f"{name} did not report ready within {timeout:.0f} s: {last_line(log)}")


def stop(p: subprocess.Popen):
    """Ask it to stop (SIGTERM: it finishes cleanly), and kill it if it has not within STOP_S."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(STOP_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def running(cmd: list[str], name: str = "llama-server"):
    """The HTTP server of `cmd` (which names its --port on 127.0.0.1), running and ready: its URL and process. Stopped
    on leaving, error or not; `name` is what errors call it."""
    port = cmd[cmd.index("--port") + 1]
    with tempfile.TemporaryFile(mode="w+") as log:  # a file, not a pipe: its log cannot fill one and stall it
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(p, url, log, name=name)
            yield url, p
        finally:
            stop(p)


@contextlib.contextmanager
def llama_server(cmd: list[str]):
    """The server of `cmd` (see server_command), running and ready: its URL. Stopped on leaving, error or not."""
    with running(cmd) as (url, _):
        yield url


def complete(url: str, prompt: list[int], n: int, sampling: Optional[dict] = None) -> dict:
    """One request: the prompt's token ids, exactly n new tokens (no end-of-sequence stop), greedy or as sampling
    says (temperature, top_k, top_p; its other samplers off), nothing reused from an earlier prompt. Its answer, once
    checked to hold n tokens."""
    s = sampling or {}
    body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True, "cache_prompt": False,
                       "temperature": s.get("temperature", 0.0), "top_k": s.get("top_k") or 0,
                       "top_p": s.get("top_p", 1.0), "min_p": 0.0, "stream": False}).encode()
    request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    try:
        with LOCAL.open(request, timeout=3600) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"llama-server refused a request of {len(prompt)} + {n} tokens: "
                         f"{e.read().decode(errors='replace')[:300]}") from None
    got = answer.get("tokens_predicted", answer.get("timings", {}).get("predicted_n"))
    if got != n:
        raise ValueError(f"llama-server answered {got} new tokens where {n} were asked")
    return answer


def serve_workload(url: str, requests: list[tuple[list[int], int]], concurrency: int,
                   sampling: Optional[dict] = None) -> dict:
    """The requests through the server from `concurrency` client threads, in order: at most that many in flight,
    each thread taking the next request when its last one is answered. New tokens per second over the whole run (from
    the first send to the last answer), and prompt tokens per second as its timings give them (each request's prompt
    tokens over its own prompt time; slots that share a batch each count its time)."""
    ends = [0.0] * len(requests)

    def one(i: int) -> dict:
        answer = complete(url, *requests[i], sampling)
        ends[i] = time.perf_counter()
        return answer

    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="client")
    t0 = time.perf_counter()
    try:
        futures = [pool.submit(one, i) for i in range(len(requests))]  # a FIFO queue that the threads take from
        answers = [f.result() for f in futures]
    except BaseException:  # the requests not yet sent are dropped; those in flight end when the server stops
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    seconds = max(ends) - t0
    new = sum(a["tokens_predicted"] for a in answers)
    timings = [a.get("timings", {}) for a in answers]
    prompt_n, prompt_ms = sum(t.get("prompt_n", 0) for t in timings), sum(t.get("prompt_ms", 0.0) for t in timings)
    return {"seconds": seconds, "new_tokens": new, "prompt_tokens": prompt_n, "tokens_per_s": new / seconds,
            "prompt_tokens_per_s": 1e3 * prompt_n / prompt_ms if prompt_ms else None}

