"""A stand-in for llama.cpp's llama-server that speaks the part of its HTTP API the benchmarks use: /health,
/completion answering n_predict tokens after DELAY_S, with timings of known prompt speed (bench_engine.py), and
/v1/completions streaming max_tokens one-token chunks of text as server-sent events, the first after DELAY_S and
the others TOKEN_S apart, the last with the usage, then [DONE] (bench_serve.py). It counts the requests in flight
and records each request and when it arrived. In a test's own process (FakeServer), or as a program (see
executable) that takes llama-server's command line, writes it and its process id to <program>.calls, and answers
--help with the flags it knows."""
import contextlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DELAY_S = 0.02
TOKEN_S = 0.002
PROMPT_MS_PER_TOKEN = 0.5  # 2000 prompt tokens/s in the timings
HELP = "-np, --parallel N\n-cb, --cont-batching\n--cache-ram N\n--no-ui, --no-webui\n"


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, short: bool = False, first_s: float = DELAY_S, token_s: float = TOKEN_S,
                 serial: bool = False, hold: int = 0):
        super().__init__(("127.0.0.1", port), Handler)
        self.lock, self.in_flight, self.most_in_flight = threading.Lock(), 0, 0
        self.received, self.arrived = [], []  # request bodies and their time.perf_counter(), in order of arrival
        self.short = short  # answer one token fewer than asked
        self.first_s, self.token_s = first_s, token_s  # /v1/completions: before the first token, between the others
        self.serial = threading.Lock() if serial else None  # /v1/completions: one answer at a time, the others wait
        self.hold, self.all_here = hold, threading.Event()  # /v1/completions: no answer before `hold` have arrived

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_):
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *_):  # quiet
        pass

    def answer(self, body: dict, status: int = 200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({"status": "ok"} if self.path == "/health" else {"error": "not found"}, 200 if
                    self.path == "/health" else 404)

    def do_POST(self):
        arrived = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:
            s.received.append(body)
            s.arrived.append(arrived)
            s.in_flight += 1
            s.most_in_flight = max(s.most_in_flight, s.in_flight)
            if len(s.arrived) >= s.hold:
                s.all_here.set()
        try:
            if self.path == "/v1/completions":
                s.all_here.wait(timeout=60)
                with s.serial or contextlib.nullcontext():
                    return self.stream(body)
            time.sleep(DELAY_S)
        finally:
            with s.lock:
                s.in_flight -= 1
        n, prompt = body["n_predict"] - s.short, len(body["prompt"])
        self.answer({"content": "", "tokens_predicted": n, "tokens_evaluated": prompt,
                     "timings": {"prompt_n": prompt, "prompt_ms": prompt * PROMPT_MS_PER_TOKEN, "predicted_n": n,
                                 "predicted_ms": n * 1.0}})

    def stream(self, body: dict):
        """As llama-server streams /v1/completions: a chunk per token, the usage in the last, no Content-Length
        (the answer ends when the connection closes)."""
        s, n = self.server, body["max_tokens"] - self.server.short
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        send = lambda chunk: (self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode()),  # noqa: E731
                              self.wfile.flush())
        time.sleep(s.first_s)
        for i in range(n):
            if i:
                time.sleep(s.token_s)
            send({"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}], "object": "text_completion"})
        prompt = len(body["prompt"])
        send({"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "object": "text_completion",
              "usage": {"completion_tokens": n, "prompt_tokens": prompt, "total_tokens": n + prompt}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def executable(folder: Path) -> Path:
    """A llama-server program in folder that runs this file with the Python that runs the tests."""
    folder.mkdir(exist_ok=True)
    program = folder / "llama-server"
    program.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$0\" \"$@\"\n")
    program.chmod(0o755)
    return program


if __name__ == "__main__":
    program, args = sys.argv[1], sys.argv[2:]
    if "--help" in args or "--version" in args:
        print(HELP if "--help" in args else "version: 0 (stand-in)")
        sys.exit(0)
    with open(program + ".calls", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": args}) + "\n")
    FakeServer(int(args[args.index("--port") + 1])).serve_forever()
