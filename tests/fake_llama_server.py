"""A stand-in for llama.cpp's llama-server that speaks the part of its HTTP API bench_engine.py uses: /health, and
/completion answering n_predict tokens after DELAY_S, with timings of known prompt speed. It counts the requests in
flight and records each request. In a test's own process (FakeServer), or as a program (see executable) that takes
llama-server's command line, writes it and its process id to <program>.calls, and answers --help with the flags
it knows."""
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DELAY_S = 0.02
PROMPT_MS_PER_TOKEN = 0.5  # 2000 prompt tokens/s in the timings
HELP = "-np, --parallel N\n-cb, --cont-batching\n--cache-ram N\n--no-ui, --no-webui\n"


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, short: bool = False):
        super().__init__(("127.0.0.1", port), Handler)
        self.lock, self.in_flight, self.most_in_flight = threading.Lock(), 0, 0
        self.received = []  # request bodies, in the order they arrived
        self.short = short  # answer one token fewer than asked

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
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:
            s.received.append(body)
            s.in_flight += 1
            s.most_in_flight = max(s.most_in_flight, s.in_flight)
        time.sleep(DELAY_S)
        with s.lock:
            s.in_flight -= 1
        n, prompt = body["n_predict"] - s.short, len(body["prompt"])
        self.answer({"content": "", "tokens_predicted": n, "tokens_evaluated": prompt,
                     "timings": {"prompt_n": prompt, "prompt_ms": prompt * PROMPT_MS_PER_TOKEN, "predicted_n": n,
                                 "predicted_ms": n * 1.0}})


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
