"""An OpenAI-compatible HTTP server on the engine (engine.py): /v1/chat/completions and /v1/completions, streamed
or not, for any client of the OpenAI API (its `openai` package, curl, an agent or an evaluation harness).

    python serve.py --checkpoint_path checkpoints/stdlib-target --port 8000

The engine runs in a thread of its own, stepping while it has work; HTTP handlers only check a request, queue it
and read its tokens as the engine makes them. A client that disconnects cancels its request (its KV blocks go back
at once); past --max_waiting queued requests, new ones get 429. Errors are the OpenAI API's error JSON: 400 for a
bad body (code context_length_exceeded for a prompt past the context), 401 without the API key, 404 for an unknown
model or path, 413 for a body too long or a prompt the KV pool cannot hold, 429 when full. SIGTERM or Ctrl-C: no
new requests, the running ones get --grace seconds to finish, then exit 0."""
import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import cli
from openai_api import (API_DEFAULTS, MAX_PROMPTS, Answer, ApiError, chat_tokens, need, prompt_tokens, sampling,
                        tool_options, whole)
from sampling import with_defaults

KEY_ENV = "FAST_DECODE_API_KEY"
START = time.time()

# ---- the engine in its thread ------------------------------------------------------------------------------------

class Service:
    """The engine and the thread that steps it. Handlers submit requests with an asyncio queue each; after every
    step the thread posts (request, tokens so far, finish reason) to the queues of the requests that moved."""

    def __init__(self, llm, engine, max_waiting: int, metrics):
        self.llm, self.engine, self.max_waiting, self.metrics = llm, engine, max_waiting, metrics
        self.inbox, self.wake, self.checking = queue.SimpleQueue(), threading.Event(), threading.Lock()
        self.sinks, self.queued, self.last = {}, 0, {}  # request -> (loop, queue); submitted, not yet in the engine
        self.stopping = False
        import torch
        self.threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.thread.start()

    def check(self, r):
        with self.checking:  # grammars compile here, in a handler's worker thread, not in the engine's
            self.engine.check(r)

    def submit(self, requests: list, loop, sink: asyncio.Queue):
        if self.stopping:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        if len(self.engine.waiting) + self.queued + len(requests) > self.max_waiting:
            raise ApiError(429, "too many requests are waiting: retry later", kind="rate_limit_error")
        self.queued += len(requests)
        for r in requests:
            self.inbox.put(("add", r, (loop, sink)))
        self.wake.set()

    def cancel(self, requests: list):
        for r in requests:
            self.inbox.put(("cancel", r, None))
        self.wake.set()

    def run(self):
        import torch
        torch.set_num_threads(self.threads)  # this thread's own setting: the kernels' parallel regions read it
        while not (self.stopping and not self.engine.has_work()):
            if not self.engine.has_work():
                self.wake.wait(0.5)
            self.wake.clear()
            self.take_inbox()
            try:
                for r in self.engine.step() if self.engine.has_work() else ():
                    self.post(r)
            except Exception as e:  # a bug of ours: every request in flight fails, saying so, and the server goes on
                for r in list(self.engine.running) + list(self.engine.waiting):
                    if r in self.engine.waiting:
                        self.engine.waiting.remove(r)
                    self.engine.finish(r, "error", f"the engine failed: {type(e).__name__}: {e}")
                    self.post(r)

    def take_inbox(self):
        while True:
            try:
                what, r, sink = self.inbox.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                self.queued -= 1
                self.sinks[r] = sink
                if r.finished:  # cancelled before it got here
                    self.post(r)
                    continue
                self.engine.add(r)  # (checked by the handler)
            elif not r.finished:
                self.engine.cancel(r)
                if r in self.sinks:
                    self.post(r)

    def post(self, r):
        now = time.perf_counter()
        if r.out and r not in self.last:
            self.metrics.ttft.observe(now - r.times.get("arrived", now))
        elif r in self.last and len(r.out) > self.last[r][0]:
            self.metrics.itl.observe((now - self.last[r][1]) / (len(r.out) - self.last[r][0]))
        self.last[r] = (len(r.out), now)
        loop, sink = self.sinks[r]
        if r.finished:
            del self.sinks[r], self.last[r]
            self.metrics.finished.labels(r.finish_reason).inc()
        loop.call_soon_threadsafe(sink.put_nowait, (r, len(r.out), r.finish_reason))

    def stop(self):
        """No more requests; cancel those still running and let the thread end."""
        self.stopping = True
        self.cancel(list(self.sinks) + list(self.engine.waiting) + list(self.engine.running))
        self.thread.join(timeout=10)


class Metrics:
    """The Prometheus figures: the engine's counts read when scraped, the latencies observed as tokens come."""

    def __init__(self, engine, prefix: str = "fast_decode"):
        import prometheus_client as prom
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        self.prom, self.registry = prom, prom.CollectorRegistry()
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = prom.Histogram(f"{prefix}_time_to_first_token_seconds", "Time from arrival to the first token",
                                   buckets=buckets, registry=self.registry)
        self.itl = prom.Histogram(f"{prefix}_inter_token_latency_seconds", "Time between a request's tokens",
                                  buckets=(0.005,) + buckets[:-3], registry=self.registry)
        self.finished = prom.Counter(f"{prefix}_requests_finished", "Requests finished, by finish reason",
                                     ["reason"], registry=self.registry)

        class EngineCounts:
            def collect(self):
                s, pool = engine.stats, engine.pool
                yield GaugeMetricFamily(f"{prefix}_requests_running", "Requests in the running batch",
                                        value=len(engine.running))
                yield GaugeMetricFamily(f"{prefix}_requests_waiting", "Requests waiting to start",
                                        value=len(engine.waiting))
                yield GaugeMetricFamily(f"{prefix}_kv_blocks_in_use", "KV cache blocks held by requests",
                                        value=pool.in_use())
                yield GaugeMetricFamily(f"{prefix}_kv_blocks", "KV cache blocks in the pool", value=pool.n_blocks)
                for name, key, what in (("generation_tokens", "generated", "Tokens generated"),
                                        ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted"),
                                        ("prompt_tokens_cached", "cached_tokens", "Prompt tokens from the cache"),
                                        ("preemptions", "preempted", "Requests preempted and recomputed")):
                    yield CounterMetricFamily(f"{prefix}_{name}", what, value=s[key])
        self.registry.register(EngineCounts())

    def text(self) -> bytes:
        return self.prom.generate_latest(self.registry)


# ---- HTTP --------------------------------------------------------------------------------------------------------

def build_app(llm, engine, *, name: str, api_key=None, max_waiting: int = 64, max_body: int = 1 << 20):
    """The Starlette app serving llm's model through engine as `name`."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    metrics = Metrics(engine)
    service = Service(llm, engine, max_waiting, metrics)
    tokenizer, context, vocab = llm.tokenizer, engine.context, llm.model.args.vocab_size

    async def body_of(request) -> dict:
        size = request.headers.get("content-length")
        need(size is None or size.isdigit() and int(size) <= max_body, f"the body is over {max_body} bytes",
             status=413)
        data = b""
        async for part in request.stream():
            data += part
            need(len(data) <= max_body, f"the body is over {max_body} bytes", status=413)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            raise ApiError(400, "the body is not valid JSON")
        need(isinstance(body, dict), "the body must be a JSON object")
        model = body.get("model")
        need(model is None or isinstance(model, str), "model must be a string", "model")
        need(model in (None, name), f"the model '{model}' does not exist: this server has '{name}'", "model", 404)
        return body

    async def requests_for(tokens: list[int], o: dict, field: str) -> list:
        """The engine's requests for one prompt: its n choices. Without max_tokens a completion writes 16 tokens, as
        OpenAI's and vLLM's do, and a chat reply up to the end of the context."""
        from engine import Request
        room, s = context - len(tokens), o["sampling"]
        limit = o["limit"] if o["limit"] is not None else 16 if field == "prompt" else max(room, 1)
        if limit > room:  # in the words and code that clients (the openai SDK, litellm, LangChain) recognise
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{len(tokens) + limit} tokens ({len(tokens)} in the messages, {limit} in the completion). "
                           f"Please reduce the length of the messages or completion.", field,
                           code="context_length_exceeded")
        eos = () if o["ignore_eos"] else tuple(tokenizer.eos_ids)
        seeds = [None if s.seed is None else (s.seed + i) % 2**64 for i in range(o["n"])]  # choice i: seed + i
        rs = [Request(tokens, replace(s, max_new_tokens=max(limit, 1), seed=seed), eos, o["grammar"])
              for seed in seeds]  # (max_tokens 0, scoring the prompt: its one token is not shown)
        try:
            for r in rs:
                await run_in_threadpool(service.check, r)
        except ValueError as e:
            raise ApiError(413 if "pool" in str(e) else 400, str(e), "logit_bias" if "logit_bias" in str(e) else None)
        return rs

    async def complete(request, chat: bool):
        body = await body_of(request)
        o = sampling(body, tokenizer.sampling_defaults, chat)
        tools = tool_options(body, tokenizer, chat)
        if tools and tools["grammar"]:
            o["grammar"] = tools["grammar"]
        if chat:
            prompts = [chat_tokens(tokenizer, body.get("messages"), tools and tools["tools"])]
        else:
            need("prompt" in body, "prompt is required", "prompt")
            prompts = prompt_tokens(tokenizer, body["prompt"], vocab)
        need(len(prompts) * o["n"] <= MAX_PROMPTS, f"prompts x n is at most {MAX_PROMPTS} a request", "n")
        rs = [r for tokens in prompts for r in await requests_for(tokens, o, "messages" if chat else "prompt")]
        loop, sink = asyncio.get_running_loop(), asyncio.Queue()
        service.submit(rs, loop, sink)
        answer = Answer(tokenizer, rs, chat, name, o["sampling"].stop, o["n"], o["echo"], o["limit"] == 0,
                        bool(tools and tools["read"]))
        if o["stream"]:
            return StreamingResponse(answer.stream(sink, service, o["usage"]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await answer.whole(sink, service, request))

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def completions(request):
        return await complete(request, chat=False)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": int(START),
                                                         "owned_by": "fast-decode", "max_model_len": context,
                                                         "sampling_defaults": with_defaults(
                                                             {}, tokenizer.sampling_defaults, API_DEFAULTS)}]})

    async def tokenize(request):  # vLLM's shapes: the ids the server would run, a prompt's or chat messages'
        body = await body_of(request)
        if "messages" in body:
            tokens = chat_tokens(tokenizer, body["messages"])
        else:
            need(isinstance(body.get("prompt"), str) and body["prompt"], "prompt must be a non-empty string", "prompt")
            need(body.get("add_special_tokens", True) in (True, False), "add_special_tokens must be true or false",
                 "add_special_tokens")
            tokens = tokenizer.encode(body["prompt"], bos=body.get("add_special_tokens", True))
        return JSONResponse({"count": len(tokens), "max_model_len": context, "tokens": tokens})

    async def tokenizer_info(request):  # vLLM's: what a client needs to tokenize as the server does
        return JSONResponse({"model_max_length": context, "vocab_size": vocab,
                             "chat_template": tokenizer.chat_template, **{k: tokenizer.special_tokens.get(k) for k in (
                                 "bos_token", "eos_token", "pad_token", "unk_token")}})

    async def detokenize(request):
        tokens = (await body_of(request)).get("tokens")
        need(isinstance(tokens, list) and all(whole(t) and 0 <= t < vocab for t in tokens),
             f"tokens must be a list of token ids in 0..{vocab - 1}", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def prometheus(request):
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    async def http_error(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                     kind=kind).body(), status_code=e.status_code)

    async def crash(request, e: Exception):  # a bug of ours, said as the API says it, never a traceback
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body(),
                            status_code=500)

    class KeyCheck:
        """Every path but /health needs 'Authorization: Bearer <key>' when the server has a key."""
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and api_key and scope["path"] != "/health":
                given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    e = ApiError(401, "a valid API key is needed: 'Authorization: Bearer <key>'",
                                 kind="authentication_error", code="invalid_api_key")
                    return await JSONResponse(e.body(), status_code=401)(scope, receive, send)
            return await self.app(scope, receive, send)

    from starlette.middleware import Middleware

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(service.stop)
    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"]), Route("/tokenize", tokenize, methods=["POST"]),
              Route("/detokenize", detokenize, methods=["POST"]),
              Route("/tokenizer_info", tokenizer_info, methods=["GET"])]
    app = Starlette(routes=routes, middleware=[Middleware(KeyCheck)], lifespan=lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: crash})
    app.state.service = service
    return app


def check_address(host: str, port: int):
    """ValueError unless this process could listen on host:port now."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(info[0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(info[4])
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=cli.summary(__doc__))
    p.add_argument("--checkpoint_path", type=Path, default=cli.DEFAULT_CHECKPOINT, help="the model's folder")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    p.add_argument("--port", type=cli.positive_int, default=8000, help="the port to listen on")
    p.add_argument("--api_key", help=f"require 'Authorization: Bearer KEY' (default: ${KEY_ENV} if set)")
    p.add_argument("--model_name", help="the model's id in the API (default: the checkpoint folder's name)")
    p.add_argument("--max_rows", type=cli.positive_int, default=16, help="requests decoding at once")
    p.add_argument("--max_waiting", type=cli.positive_int, default=64, help="requests queued beyond those; more get "
                   "429")
    p.add_argument("--kv_blocks", type=cli.positive_int, help="KV cache blocks of 16 tokens (default: room for "
                   "--max_rows requests of 40%% of the context each)")
    p.add_argument("--max_seq_length", type=cli.positive_int, help="the context: prompt + answer, at most")
    p.add_argument("--grace", type=float, default=10.0, help="seconds running requests get to finish on shutdown")
    cli.add_device_options(p)
    args = cli.one_line_errors(p).parse_args(argv)
    if not (math.isfinite(args.grace) and args.grace >= 0):
        raise ValueError(f"--grace must be a number of seconds >= 0, got {args.grace}")
    if args.port > 65535:
        raise ValueError(f"--port must be at most 65535, got {args.port}")
    key = args.api_key or os.environ.get(KEY_ENV) or None
    check_address(args.host, args.port)  # before the model loads, which takes a while
    import uvicorn
    from engine import Engine
    from fast_decode import LLM
    llm = LLM(args.checkpoint_path, device=args.device, dtype=args.dtype, max_seq_length=args.max_seq_length,
              threads=args.threads, cpu_kernels=args.cpu_kernels)
    engine = Engine(llm.model, llm.tokenizer, blocks=args.kv_blocks, max_rows=args.max_rows)
    name = args.model_name or Path(os.path.abspath(args.checkpoint_path)).name  # a link keeps its own name
    app = build_app(llm, engine, name=name, api_key=key, max_waiting=args.max_waiting)
    if key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without an API key: anyone who reaches it can use it (give "
              f"--api_key or set {KEY_ENV})", file=sys.stderr)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (context {engine.context} tokens, "
          f"{engine.pool.n_blocks} KV blocks, {args.max_rows} requests at once)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.grace))
    logging.getLogger("uvicorn.access").setLevel(logging.INFO)  # a line a request; uvicorn's own news: warnings only
    # a signal is how this server is meant to stop: a graceful shutdown and status 0, where uvicorn would end by
    # raising the signal again (a second one still stops it at once)
    server.capture_signals = contextlib.nullcontext
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: server.handle_exit(number, frame))
    server.run()
    print(f"stopped serving {name}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    cli.run_main(main)
