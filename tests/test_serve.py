"""serve.py, the OpenAI-compatible server, through real clients: the official `openai` package for what it sends,
and plain HTTP (http.client) for what it never would. Each server here runs as its own process on a free local
port, as a user starts it."""
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import needs_smollm2

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = ROOT / "checkpoints" / "stdlib-target"
openai = pytest.importorskip("openai", reason="needs: pip install openai (the tests' client)")


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}/v1"

    def client(self, key: str = "none"):
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def http(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
        """status and JSON body of one plain request; body: bytes as they are, or an object as JSON."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        c.request(method, path, data, headers or {"Content-Type": "application/json"})
        r = c.getresponse()
        text = r.read()
        c.close()
        return r.status, json.loads(text) if text and r.getheader("Content-Type", "").startswith("application/json") \
            else text.decode()

    def events(self, path: str, body: dict, stop_after: int = None) -> tuple[int, list]:
        """A streamed request's status and server-sent events' data (the JSON decoded, "[DONE]" as it is);
        stop_after: disconnect after that many."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r, out = c.getresponse(), []
        if r.status != 200:
            return r.status, [json.loads(r.read())]
        for line in r:
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                out.append(data if data == "[DONE]" else json.loads(data))
                if stop_after is not None and len(out) >= stop_after:
                    break
        c.close()
        return 200, out

    def metric(self, name: str) -> float:
        _, text = self.http("GET", "/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"fast_decode_{name} "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(checkpoint: Path, tmp_path: Path, *args, env=None):
    port, log = free_port(), tmp_path / f"serve-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--checkpoint_path", str(checkpoint),
                                 "--port", str(port), "--threads", "1", *map(str, args)], stdout=out, stderr=out,
                                env={**os.environ, **(env or {})})
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError, http.client.HTTPException):
                if server.http("GET", "/health")[0] == 200:
                    break
            assert time.monotonic() < deadline, "serve.py did not answer /health: " + log.read_text()
            time.sleep(0.3)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    with serving(BUILTIN, tmp_path_factory.mktemp("serve"), "--max_rows", 8, "--max_waiting", 16) as s:
        yield s


def lone_greedy(prompt: str, n: int) -> str:
    """The built-in model's greedy text as generate.py --compile makes it alone."""
    from fast_decode import LLM
    return LLM(BUILTIN, compile=True, threads=1).generate(prompt, max_new_tokens=n, temperature=0,
                                                            speculate=None).text


def test_openai_completion_is_the_greedy_text_generate_py_makes_alone(builtin):
    r = builtin.client().completions.create(model="stdlib-target", prompt="def add(a, b):", max_tokens=16,
                                           temperature=0)
    assert r.choices[0].text == lone_greedy("def add(a, b):", 16)
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (16, r.usage.prompt_tokens + 16)


def test_a_streamed_completion_sends_the_same_text_then_usage_then_done(builtin):
    body = {"model": "stdlib-target", "prompt": "import os\n", "max_tokens": 12, "temperature": 0}
    whole = builtin.http("POST", "/v1/completions", body)[1]["choices"][0]["text"]
    status, events = builtin.events("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12 and events[-2]["choices"] == []
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == whole
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_streams_text_pieces_that_join_to_the_answer(builtin):
    c = builtin.client()
    args = dict(model="stdlib-target", prompt="class Stack:", max_tokens=10, temperature=0)
    pieces = [ch.choices[0].text for ch in c.completions.create(**args, stream=True) if ch.choices]
    assert len(pieces) > 1 and "".join(pieces) == c.completions.create(**args).choices[0].text


def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(builtin):
    c = builtin.client()
    full = c.completions.create(model="stdlib-target", prompt="def add(a, b):", max_tokens=30,
                                temperature=0).choices[0].text
    stop = full.strip().split()[1]  # a word from the middle of the answer
    r = c.completions.create(model="stdlib-target", prompt="def add(a, b):", max_tokens=30, temperature=0,
                             stop=[stop, "@@never@@"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 30


def test_n_choices_with_a_seed_are_reproducible_and_differ_from_each_other(builtin):
    c = builtin.client()
    ask = lambda: [x.text for x in c.completions.create(  # noqa: E731
        model="stdlib-target", prompt="def f(x):", max_tokens=12, temperature=1.0, n=3, seed=7).choices]
    first = ask()
    assert ask() == first and len(set(first)) == 3


def test_top_k_zero_means_no_limit_as_llama_server_and_vllm_read_it(builtin):
    body = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 1.0, "seed": 3}
    got, unlimited = builtin.http("POST", "/v1/completions", body)
    assert got == 200
    got, zero = builtin.http("POST", "/v1/completions", {**body, "top_k": 0})
    assert got == 200 and zero["choices"][0]["text"] == unlimited["choices"][0]["text"]


def test_models_and_health_answer(builtin):
    assert [m.id for m in builtin.client().models.list().data] == ["stdlib-target"]
    assert builtin.http("GET", "/health") == (200, {"status": "ok"})


BAD = [  # (what, body as JSON text or an object, status)
    ("invalid JSON", b"{bad", 400),
    ("a JSON array", [1, 2], 400),
    ("deeply nested JSON", b"[" * 100000 + b"]" * 100000, 400),
    ("no prompt", {"max_tokens": 3}, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("prompt of the wrong type", {"prompt": 12}, 400),
    ("a token id past the vocabulary", {"prompt": [1, 10**9]}, 400),
    ("max_tokens a string", {"prompt": "x", "max_tokens": "5"}, 400),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}, 400),
    ("max_tokens past the context", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("NaN temperature", b'{"prompt": "x", "temperature": NaN}', 400),
    ("negative temperature", {"prompt": "x", "temperature": -1}, 400),
    ("top_p zero", {"prompt": "x", "top_p": 0}, 400),
    ("negative top_k", {"prompt": "x", "top_k": -1}, 400),
    ("stop a number", {"prompt": "x", "stop": 3}, 400),
    ("n too many", {"prompt": "x", "n": 1000}, 400),
    ("logprobs past 20", {"prompt": "x", "logprobs": 21}, 400),
    ("tools", {"prompt": "x", "tools": [{"type": "function"}]}, 400),
    ("an unknown response_format", {"prompt": "x", "response_format": {"type": "xml"}}, 400),
    ("a schema that is no schema", {"prompt": "x", "response_format": {"type": "json_schema",
                                                                       "json_schema": {"schema": {"type": 5}}}}, 400),
    ("an unknown model", {"prompt": "x", "model": "gpt-9"}, 404),
    ("a prompt past the context", {"prompt": [5] * 5000}, 400),
]


@pytest.mark.parametrize("what,body,status", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_gets_the_openai_error_json_with_its_status(builtin, what, body, status):
    got, answer = builtin.http("POST", "/v1/completions", body)
    assert got == status and isinstance(answer["error"]["message"], str) and answer["error"]["type"], answer


def test_a_prompt_past_the_context_is_the_context_length_error_clients_recognise(builtin):
    context = builtin.client().models.list().data[0].max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        builtin.client().completions.create(model="stdlib-target", prompt=[5] * 5000, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert e.value.body["message"] == (f"This model's maximum context length is {context} tokens. However, you "
                                       f"requested 5004 tokens (5000 in the messages, 4 in the completion). Please "
                                       f"reduce the length of the messages or completion.")


def test_a_completion_without_max_tokens_writes_16_tokens(builtin):
    r = builtin.client().completions.create(model="stdlib-target", prompt="def f(x):", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_tokenize_gives_the_ids_a_prompt_runs_as_and_detokenize_the_text_back(builtin):
    from checkpoint import load_tokenizer, read_config
    ids = load_tokenizer(BUILTIN, read_config(BUILTIN)).encode("def f(x):", bos=True)
    status, got = builtin.http("POST", "/tokenize", {"prompt": "def f(x):"})
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] > len(ids)
    used = builtin.client().completions.create(model="stdlib-target", prompt="def f(x):", max_tokens=1).usage
    assert used.prompt_tokens == len(ids)
    assert builtin.http("POST", "/tokenize", {"prompt": "def f(x):", "add_special_tokens": False})[1]["tokens"] == ids[1:]
    assert builtin.http("POST", "/detokenize", {"tokens": ids[1:]})[1] == {"prompt": "def f(x):"}
    assert builtin.http("POST", "/detokenize", {"tokens": [-1]})[0] == 400
    assert builtin.http("POST", "/tokenize", {"prompt": 5})[0] == 400


def test_a_list_of_prompts_gets_n_choices_each_indexed_prompt_by_prompt(builtin):
    from checkpoint import load_tokenizer, read_config
    prompts = ["def add(a, b):", "class Stack:", load_tokenizer(BUILTIN, read_config(BUILTIN)).encode("import os")]
    ask = lambda p, n=1: builtin.client().completions.create(model="stdlib-target", prompt=p, max_tokens=8, n=n,
                                                             temperature=0)  # noqa: E731
    alone = [ask(p) for p in prompts]
    many = ask(prompts, n=2)
    assert [c.index for c in many.choices] == list(range(6))
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert many.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_a_body_over_the_limit_gets_413(builtin):
    got, answer = builtin.http("POST", "/v1/completions", {"prompt": "x" * (2 << 20)})
    assert got == 413 and "body" in answer["error"]["message"]


def test_unknown_paths_and_methods_get_404_and_405(builtin):
    assert builtin.http("GET", "/v2/nothing")[0] == 404
    got, answer = builtin.http("GET", "/v1/completions")
    assert got == 405 and answer["error"]["message"]


def test_chat_on_a_model_without_a_template_is_a_400(builtin):
    got, answer = builtin.http("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert got == 400 and "chat template" in answer["error"]["message"]


def test_an_api_key_guards_every_path_but_health(tmp_path):
    with serving(BUILTIN, tmp_path, env={"FAST_DECODE_API_KEY": "sesame"}) as s:
        assert s.http("GET", "/health")[0] == 200
        assert s.http("GET", "/v1/models")[0] == 401 and s.http("GET", "/metrics")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.client("sesame").completions.create(model="stdlib-target", prompt="x", max_tokens=2).choices


def test_a_request_without_sampling_fields_samples_as_the_models_generation_config_says(tmp_path):
    from test_fast_decode import greedy_by_default
    with serving(greedy_by_default(tmp_path / "ckpt"), tmp_path) as s:
        model = s.client().models.list().data[0]
        assert model.sampling_defaults == {"temperature": 0, "top_k": 0, "top_p": 1.0}  # the model's, else the API's
        ask = lambda **o: s.client().completions.create(model=model.id, prompt="def f(x):", max_tokens=16, seed=3,
                                                        **o).choices[0].text  # noqa: E731
        assert ask() == ask(temperature=0) != ask(temperature=1)


def test_sigterm_lets_a_running_request_finish_and_exits_0(tmp_path):
    with serving(BUILTIN, tmp_path, "--grace", 30) as s:
        c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "def f(x):", "max_tokens": 200, "stream": True,
                                                         "temperature": 0, "ignore_eos": True}))
        r = c.getresponse()
        r.readline()  # the first event: it runs
        s.proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
        assert s.proc.wait(timeout=60) == 0


def test_each_request_is_logged_in_a_line_and_stopping_says_so(tmp_path):
    with serving(BUILTIN, tmp_path) as s:
        s.client().completions.create(model="stdlib-target", prompt="x", max_tokens=2)
        assert s.http("POST", "/v1/completions", {"prompt": "x", "temperature": -1})[0] == 400
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        lines = s.log.read_text().splitlines()
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines)
    assert any('"POST /v1/completions HTTP/1.1" 400' in line for line in lines)
    assert lines[-1] == "stopped serving stdlib-target"


# ---- a real chat model ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_imports, tmp_path_factory):
    with serving(smollm2_imports["int8"], tmp_path_factory.mktemp("serve"), "--max_rows", 4,
                 "--model_name", "smollm2") as s:
        yield s


QUESTION = "Name the capital of France."


@needs_smollm2
def test_chat_greedy_answer_is_generate_py_chats(smollm2, smollm2_imports):
    from launcher import command
    r = smollm2.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=24, temperature=0)
    alone = command("generate.py", "--checkpoint_path", smollm2_imports["int8"], "--chat", "--prompt", QUESTION,
                    "--temperature", 0, "--max_new_tokens", 24, "--compile", "--device", "cpu", "--threads", 1,
                    timeout=600, text=True)
    assert alone.returncode == 0, alone.stderr
    answer = r.choices[0].message.content
    assert "Paris" in answer and answer in alone.stdout and r.choices[0].message.role == "assistant"


@needs_smollm2
def test_a_chat_past_the_context_is_the_context_length_error(smollm2):
    with pytest.raises(openai.BadRequestError) as e:
        smollm2.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x " * 5000}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


@needs_smollm2
def test_a_client_that_hangs_up_on_a_whole_answer_cancels_it_while_its_tokens_keep_coming(smollm2):
    before = smollm2.metric('requests_finished_total{reason="cancelled"}')
    c = http.client.HTTPConnection("127.0.0.1", smollm2.port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"prompt": QUESTION, "max_tokens": 1500, "ignore_eos": True}))
    time.sleep(1)  # it decodes
    c.close()  # never read: the answer would take 1,500 tokens
    for _ in range(1200):
        if not smollm2.metric("requests_running"):
            break
        time.sleep(0.1)
    assert smollm2.metric('requests_finished_total{reason="cancelled"}') == before + 1  # cancelled, not run out


@needs_smollm2
def test_chat_with_a_json_schema_answers_json_that_validates(smollm2):
    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    r = smollm2.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)  # e.g. {"city": "Paris", ...}
    assert r.choices[0].finish_reason == "stop"


@needs_smollm2
def test_a_streamed_chat_starts_with_the_role_and_ends_with_the_finish(smollm2):
    chunks = list(smollm2.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@needs_smollm2
@pytest.mark.parametrize("stream", [False, True])
def test_text_past_the_end_of_turn_carries_no_special_token(smollm2, stream):
    r = smollm2.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=48, temperature=0,
        extra_body={"ignore_eos": True}, **(dict(stream=True, stream_options={"include_usage": True}) if stream else {}))
    chunks = list(r) if stream else [r]
    text = "".join((c.choices[0].delta.content if stream else c.choices[0].message.content) or ""
                   for c in chunks if c.choices)
    assert "Paris" in text and "<|im_" not in text and chunks[-1].usage.completion_tokens == 48


@pytest.mark.parametrize("fixture", ["checkpoint", "chat_checkpoint"])  # SentencePiece with bytes; byte-level BPE
def test_streamed_text_grown_a_token_at_a_time_is_the_whole_texts(fixture, request):
    import random

    import openai_api
    from checkpoint import load_tokenizer, read_config
    from engine import Request
    path = request.getfixturevalue(fixture)
    tok, rng = load_tokenizer(path, read_config(path)), random.Random(0)
    for text in ("Grüße, 世界! naïve café -> ok", None, None):  # then any ids: cut characters, spaces, specials
        ids = tok.encode(text, bos=False) if text else [rng.randrange(tok.vocab_size) for _ in range(150)]
        r = Request(ids[:10], out=ids[10:])
        answer = openai_api.Answer(tok, [r], chat=False, model="m", stop=None)
        for n in range(1, len(r.out) + 1):
            whole = answer.text(r, n)
            grown = answer.grown(0, r, n)
            assert whole.startswith(grown) and (grown == whole or whole.endswith("\ufffd"))
