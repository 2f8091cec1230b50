"""The OpenAI API's shapes: a request's body checked and turned into the engine's terms (sampling options, a
grammar, prompt tokens), and the reply built from the engine's requests, whole or as server-sent events. serve.py
serves them; errors are ApiError, which it answers as the API's error JSON."""
import asyncio
import json
import math
import time
import uuid

import cli
import tool_calls
from sampling import OptionError, Sampling, with_defaults

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
REFUSED = ("functions", "function_call", "suffix")  # would change the answer's kind


class ApiError(Exception):
    def __init__(self, status: int, message: str, param=None, kind: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


MAX_PROMPTS = 256  # the engine requests one HTTP request may make: its prompts times n
API_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # OpenAI's, where neither request nor model says


def need(ok: bool, message: str, param=None, status: int = 400):
    if not ok:
        raise ApiError(status, message, param)


def whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---- a request's body -> the engine's Request --------------------------------------------------------------------

def sampling(body: dict, model: dict, chat: bool) -> dict:
    """The OpenAI fields the engine honours, checked; fields that would change what kind of answer comes back, and
    that it cannot give, are refused; the others are ignored, as the OpenAI API ignores fields it does not know.
    temperature, top_p and top_k not sent are the model's defaults (model: its generation_config.json's), else
    the API's (API_DEFAULTS). Log-probabilities (chat: logprobs true and top_logprobs N; completions: logprobs N,
    with echo for the prompt's too) are the model's own, before temperature, penalties or truncation."""
    for name in REFUSED + (("echo",) if chat else ()):
        need(body.get(name) in (None, False, [], ""), f"'{name}' is not supported by this server", name)
    need(body.get("best_of") in (None, 1), "best_of must be 1 on this server", "best_of")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    given = with_defaults(body, model, API_DEFAULTS)
    temperature = given["temperature"]
    need(not number(temperature) or temperature <= 2, "temperature must be a number from 0 to 2", "temperature")
    seed, stop, echo = body.get("seed"), body.get("stop"), body.get("echo", False)
    stop = [stop] if isinstance(stop, str) else stop
    need(not isinstance(stop, list) or len(stop) <= 16, "stop must be a string or a list of at most 16", "stop")
    for name in ("stream", "ignore_eos", "echo") + (("logprobs",) if chat else ()):
        need(body.get(name) in (None, True, False), f"{name} must be true or false", name)
    need(limit != 0 or echo, "max_tokens 0 needs echo: it scores the prompt only", "max_tokens")
    if chat:
        top = body.get("top_logprobs")
        need(top is None or body.get("logprobs"), "top_logprobs needs logprobs true", "top_logprobs")
        logprobs = (top or 0) if body.get("logprobs") else None
    else:
        logprobs = body.get("logprobs")
    extra = {k: body[k] for k in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
             if body.get(k) is not None}
    try:  # the checks every entry point makes (sampling.py); the API's own bounds above
        o = Sampling(1 if limit is None or limit == 0 and whole(limit) else limit, temperature, given["top_k"],
                     given["top_p"], seed % 2**64 if whole(seed) else seed, stop,
                     logit_bias=body.get("logit_bias") or None, logprobs=logprobs,
                     prompt_logprobs=logprobs if echo else None, **extra)
    except OptionError as e:
        field = {"max_new_tokens": "max_tokens", "logprobs": "top_logprobs" if chat else "logprobs"}.get(e.param,
                                                                                                      e.param)
        raise ApiError(400, str(e).replace(e.param, field), field) from None
    n = 1 if body.get("n") is None else body["n"]
    need(whole(n) and 1 <= n <= 16, "n must be a whole number from 1 to 16", "n")
    options = body.get("stream_options")
    need(options is None or isinstance(options, dict) and options.get("include_usage") in (None, True, False),
         "stream_options must be an object whose include_usage is true or false", "stream_options")
    return dict(sampling=o, limit=limit, n=n, ignore_eos=bool(body.get("ignore_eos")), stream=bool(body.get(
        "stream")), usage=bool((options or {}).get("include_usage")), grammar=grammar(body.get("response_format")),
        echo=bool(echo))


def grammar(fmt):
    """response_format as llguidance's grammar text (guided.grammars), or None for plain text."""
    if fmt is None:
        return None
    need(isinstance(fmt, dict) and fmt.get("type") in RESPONSE_FORMATS,
         f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}", "response_format")
    import guided
    if fmt["type"] == "json_object":
        return guided.grammars(json=True)[0]
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        need(isinstance(spec, dict) and isinstance(spec.get("schema"), dict),
             "response_format json_schema needs json_schema.schema, an object", "response_format")
        try:
            return guided.grammars(json_schema=spec["schema"])[0]
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"response_format: the schema cannot be used: {str(e)[:300]}", "response_format")
    return None


def prompt_tokens(tokenizer, prompt, vocab: int) -> list[list[int]]:
    """/v1/completions' prompt: a string, token ids, or a list of either (many prompts, each its own choices)."""
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    for p in prompt if many else [prompt]:
        need(isinstance(p, str) and p or isinstance(p, list) and p and all(whole(t) and 0 <= t < vocab for t in p),
             f"prompt must be a non-empty string, a list of token ids in 0..{vocab - 1}, or a list of those", "prompt")
    return [tokenizer.encode(p, bos=True) if isinstance(p, str) else p for p in (prompt if many else [prompt])]


def chat_tokens(tokenizer, messages, tools=None) -> list[int]:
    """/v1/chat/completions' messages through the model's chat template (tools: the API's, which it renders)."""
    need(tokenizer.chat_template is not None, "this model has no chat template: use /v1/completions", "messages")
    need(isinstance(messages, list) and messages, "messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        need(isinstance(m, dict) and m.get("role") in ROLES, f"messages[{i}] must be an object whose role is "
             f"{', '.join(ROLES)}", "messages")
        content, calls = m.get("content"), m.get("tool_calls") if m["role"] == "assistant" else None
        if isinstance(content, list):  # parts: text only
            need(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                     for p in content), f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        need(isinstance(content, str) or content is None and calls, f"messages[{i}].content must be a string or a "
             f"list of text parts", "messages")
        turn = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
        if calls:
            need(isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict) and
                                                 isinstance(c["function"].get("name"), str) for c in calls),
                 f"messages[{i}].tool_calls must be a list of {{'id', 'type', 'function': {{'name', 'arguments'}}}}",
                 "messages")
            turn["tool_calls"] = calls
        if m["role"] == "tool":
            turn.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        turns.append(turn)
    try:
        turns = tool_calls.for_template(turns)
    except ValueError:
        raise ApiError(400, "a tool call's arguments must be JSON text", "messages") from None
    return tokenizer.encode(tokenizer.apply_chat_template(turns, tools=tools), bos=False, specials=True)


ROLES = ("system", "developer", "user", "assistant", "tool")


def tool_options(body: dict, tokenizer, chat: bool):
    """tools, tool_choice and parallel_tool_calls, checked: None without tools, else the tools as the template
    renders them, the grammar the answer follows (None for tool_choice "none") and whether it is read for calls."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        need(choice in (None, "none", "auto"), "tool_choice needs tools", "tool_choice")
        return None
    need(chat, "'tools' is not supported on /v1/completions: use /v1/chat/completions", "tools")
    need(tool_calls.supported(tokenizer.chat_template), "this model's chat template does not render tools with "
         f"the {tool_calls.OPEN} format this server reads: it cannot call tools", "tools")
    need(body.get("response_format") in (None, {"type": "text"}), "response_format and tools cannot be combined",
         "response_format")
    parallel = body.get("parallel_tool_calls", True)
    need(parallel in (True, False), "parallel_tool_calls must be true or false", "parallel_tool_calls")
    try:
        funcs = tool_calls.functions(tools)
        must = tool_calls.chosen(choice, [f["name"] for f in funcs])
    except OptionError as e:
        raise ApiError(400, str(e), e.param) from None
    import guided
    try:
        text = tool_calls.grammar(funcs, must, parallel) if must != [] else None
        return {"tools": tools, "grammar": text and guided.lark_text(text, "tools"), "read": must != []}
    except ValueError as e:
        raise ApiError(400, f"tools: a schema cannot be used: {str(e)[:300]}", "tools") from None


class Answer:
    """The reply to one HTTP request: its n engine requests' text as it grows, whole or as server-sent events, with
    their log-probabilities where asked. echo: each completion starts with its prompt (and the prompt's
    log-probabilities, where asked); scoring (max_tokens 0): the prompt alone, the token drawn after it not shown."""

    def __init__(self, tokenizer, requests: list, chat: bool, model: str, stop, n: int = 1, echo: bool = False,
                 scoring: bool = False, tools: bool = False):
        self.tokenizer, self.requests, self.chat, self.model, self.stop = tokenizer, requests, chat, model, stop
        self.echo, self.scoring, self.tools = echo, scoring, tools  # tools: the answers are read for tool calls
        self.prompts = requests[::n]  # one request of each prompt: the usage counts each prompt once
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created, self.sent = int(time.time()), [""] * len(requests)
        self.shown = [[max(len(r.prompt) - 6, 0), len(r.prompt), ""] for r in requests]  # see grown
        self.hold = max(map(len, stop or [""]), default=1) - 1  # a stop string's start may be in the latest text
        self.noted = [[0, 0] for _ in requests]  # streamed: tokens whose logprobs went, and their text's length

    def text(self, r, n: int) -> str:
        return cli.new_text(self.tokenizer, r.prompt, r.out[:n], self.stop)

    def grown(self, i: int, r, n: int) -> str:
        """Choice i's new text through its first n tokens, for streaming: each time only the tokens since the last
        whole piece are decoded, after a few before them for context (so spaces and merged bytes come out as in the
        whole text), and the text they add is appended. A step costs the same however long prompt and answer."""
        start, read, text = self.shown[i]
        tokens = r.prompt[start:] + r.out[max(start - len(r.prompt), 0) : n]  # [tokens since start]
        before, now = (self.tokenizer.decode(t, specials=False) for t in (tokens[: read - start], tokens))
        if len(now) > len(before) and not now.endswith("\ufffd"):  # (a character still cut: wait for its bytes)
            self.shown[i] = [read, start + len(tokens), text + now[len(before):]]
        return self.shown[i][2]

    def usage(self) -> dict:
        done = 0 if self.scoring else sum(len(r.out) for r in self.requests)
        prompt = sum(len(r.prompt) for r in self.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in self.prompts)}}

    def reason(self, r, calls: list = ()) -> str:
        if r.finish_reason == "error":
            raise ApiError(500, f"generation failed: {r.error}", kind="server_error")
        return "tool_calls" if calls else "stop" if r.finish_reason == "stop" and not self.scoring else "length"

    def items(self, tokens: list[int], lps: list, before) -> list[tuple]:
        """(text, log-probability, [(text, log-probability)] of the alternatives) for each token (lps[i]: its
        (log-probability, alternatives), or None for the prompt's first): a token's text as it reads after the one
        before it (before: the token ahead of tokens[0], or None), so that a word keeps its leading space."""
        out, decode = [], lambda ids: self.tokenizer.decode(ids, specials=False)  # noqa: E731
        for t, lp in zip(tokens, lps):
            head = [] if before is None else [before]
            skip = len(decode(head))
            text = lambda x: decode(head + [x])[skip:]  # noqa: E731
            out.append((text(t), None, None) if lp is None else
                       (text(t), max(lp[0], -9999.0), [(text(a), max(v, -9999.0)) for a, v in lp[1]]))
            before = t
        return out

    def logprobs(self, items: list[tuple], offset: int = 0):
        """items in the API's layout: chat's content list, or completions' tokens, token_logprobs, top_logprobs and
        text_offset (each token's place in the choice's text, from offset)."""
        if self.chat:
            entry = lambda text, v: {"token": text, "logprob": v, "bytes": list(text.encode())}  # noqa: E731
            return {"content": [{**entry(t, v), "top_logprobs": [entry(a, w) for a, w in top]} for t, v, top in items],
                    "refusal": None}
        offsets = [offset + sum(len(t) for t, *_ in items[:k]) for k in range(len(items))]
        return {"tokens": [t for t, *_ in items], "token_logprobs": [v for _, v, _ in items],
                "top_logprobs": [None if top is None else dict(top) for *_, top in items], "text_offset": offsets}

    def prompt_items(self, r) -> list[tuple]:  # the echoed prompt's items (log-probabilities where scored)
        return self.items(r.prompt, r.prompt_logprobs or [None] * len(r.prompt), None)

    async def whole(self, sink: asyncio.Queue, service, request) -> dict:
        """Wait for every choice to finish (cancelling them if the client goes away meanwhile)."""
        left, looked = set(self.requests), time.monotonic()
        try:
            while left:
                try:
                    r, _, finished = await asyncio.wait_for(sink.get(), timeout=0.5)
                    if finished:
                        left.discard(r)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() - looked >= 0.5:  # twice a second, however fast the tokens come
                    looked = time.monotonic()
                    if await request.is_disconnected():
                        service.cancel(list(left))
                        return {}
        finally:
            if left:
                service.cancel(list(left))
        choices = []
        for i, r in enumerate(self.requests):
            n = 0 if self.scoring else len(r.out)
            text, logprobs, head = self.text(r, n), None, ""
            if self.echo:
                head = self.tokenizer.decode(r.prompt, specials=False)
            if r.sampling.logprobs is not None:
                before = r.prompt[-1]
                logprobs = self.logprobs((self.prompt_items(r) if self.echo else []) +
                                         self.items(r.out[:n], r.logprobs[:n], before))
            content, calls = tool_calls.parse(text) if self.tools else (text, [])
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            content = {"message": message} if self.chat else {"text": head + text}
            choices.append({"index": i, **content, "finish_reason": self.reason(r, calls), "logprobs": logprobs})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def chunk(self, i: int, text, finish=None, logprobs=None) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text} if i >= 0 else {"role": "assistant", "content": ""}
            choice = {"index": max(i, 0), "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return self.event({"choices": [choice]})

    def event(self, payload: dict) -> str:
        payload = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, **payload}
        return f"data: {json.dumps(payload)}\n\n"

    def streamed_logprobs(self, i: int, r, n: int, finished: bool):
        """Choice i's logprobs not yet sent, of its first n tokens whose text is within what was sent (finished: all
        that stay), or None where not asked."""
        if r.sampling.logprobs is None:
            return None
        a, chars = self.noted[i]
        b = len(r.logprobs) if finished else min(n, len(r.logprobs))
        items = self.items(r.out[a:b], r.logprobs[a:b], r.out[a - 1] if a else r.prompt[-1])
        while not finished and items and chars + sum(len(t) for t, *_ in items) > len(self.sent[i]):
            items.pop()  # (its text is held back yet)
        self.noted[i] = [a + len(items), chars + sum(len(t) for t, *_ in items)]
        return self.logprobs(items, chars + (len(self.tokenizer.decode(r.prompt, specials=False)) if self.echo else 0))

    async def stream(self, sink: asyncio.Queue, service, usage: bool):
        """Server-sent events: each choice's new text as it comes, held back while it may be the start of a stop
        string or of a character not yet whole (echo: after its prompt); its finish; the usage if asked; [DONE].
        Cancelled if the client goes away (the response's task is cancelled: the finally clause runs)."""
        left, index, echoed = set(self.requests), {r: i for i, r in enumerate(self.requests)}, set()
        try:
            if self.chat:
                for i in range(len(self.requests)):
                    yield self.chunk(-1 - i, "")
            while left:
                r, n, finished = await sink.get()
                i, n = index[r], 0 if self.scoring else n
                if self.echo and r not in echoed:
                    echoed.add(r)
                    lp = None if r.sampling.logprobs is None else self.logprobs(self.prompt_items(r))
                    yield self.chunk(i, self.tokenizer.decode(r.prompt, specials=False), None, lp)
                text = self.text(r, n) if finished else cli.cut_text(self.grown(i, r, n), self.stop)
                ready = text if finished else text[: max(len(self.sent[i]), len(text) - self.hold)]
                if not finished and ready.endswith("\ufffd"):
                    ready = ready[:-1]
                calls = tool_calls.parse(text)[1] if finished and self.tools else []
                if calls:
                    yield self.event({"choices": [{"index": i, "delta": {"tool_calls": [
                        {"index": k, **c} for k, c in enumerate(calls)]}, "finish_reason": None, "logprobs": None}]})
                elif self.tools and not finished and maybe_call(ready):
                    pass  # (held: it may be a tool call, sent whole once done)
                elif len(ready) > len(self.sent[i]) and ready.startswith(self.sent[i]):
                    new, self.sent[i] = ready[len(self.sent[i]):], ready
                    yield self.chunk(i, new, None, self.streamed_logprobs(i, r, n, finished))
                if finished:
                    left.discard(r)
                    try:
                        lp = self.streamed_logprobs(i, r, n, True) if not self.scoring else None
                        yield self.chunk(i, None, self.reason(r, calls), lp if lp and (lp.get("content") or
                                                                                     lp.get("tokens")) else None)
                    except ApiError as e:
                        yield f"data: {json.dumps(e.body())}\n\n"
            if usage:
                yield self.event({"choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            if left:
                service.cancel(list(left))


def maybe_call(text: str) -> bool:  # the answer so far is, or may grow into, a tool call
    head = text.lstrip()
    return head.startswith(tool_calls.OPEN) or tool_calls.OPEN.startswith(head)
