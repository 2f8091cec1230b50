"""Tool calls through serve.py, with the clients agents use (the openai SDK, LangChain, litellm): a tiny random chat
model whose template renders tools and teaches the <tool_call> format, so every call it makes is the guided
output's work: with tool_choice "required" or a named function, arguments that validate, always."""
import json
import shutil
from typing import Literal

import jsonschema
import pytest

from test_serve import BUILTIN, openai, serving

TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools> <tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(chat_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "toolmodel"
    shutil.copytree(chat_checkpoint, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tools_server(tool_model, tmp_path_factory):
    with serving(tool_model, tmp_path_factory.mktemp("serve")) as s:
        yield s


def ask(server, **args):
    return server.client().chat.completions.create(model="toolmodel", messages=ASK, max_tokens=120, **args)


def valid(call) -> bool:  # an SDK tool call: a known function, arguments that match its schema
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_gives_calls_whose_arguments_validate(tools_server, seed):
    r = ask(tools_server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    choice = choice0 = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice0.message.tool_calls
    assert all(valid(c) for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_a_named_function_is_the_only_one_called_and_parallel_false_gives_one_call(tools_server):
    for seed in range(3):
        r = ask(tools_server, tools=TOOLS, temperature=1.0, seed=seed, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time" and valid(calls[0])


def test_auto_answers_in_text_or_in_calls_never_in_a_broken_call(tools_server):
    for seed in range(4):
        m = ask(tools_server, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed).choices[0].message
        assert all(valid(c) for c in m.tool_calls) if m.tool_calls else "<tool_call>" not in m.content


def test_streamed_tool_calls_assemble_to_the_whole_reply(tools_server):
    args = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=5)
    whole = ask(tools_server, **args).choices[0]
    calls, finish = {}, None
    for chunk in ask(tools_server, stream=True, **args):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_conversation_with_a_call_and_its_result_is_accepted(tools_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 2}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    r = tools_server.client().chat.completions.create(model="toolmodel", messages=messages, tools=TOOLS,
                                                      tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    status, _ = tools_server.http("POST", "/v1/chat/completions", {"messages": ASK, "tool_choice": "none",
                                                                   "max_tokens": 2})
    assert status == 200  # tool_choice none without tools, as clients send it


@pytest.mark.parametrize("body,field", [
    ({"tools": [{"type": "function"}]}, "tools"), ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format")])
def test_bad_tool_fields_are_a_400_naming_the_field(tools_server, body, field):
    status, answer = tools_server.http("POST", "/v1/chat/completions", {"messages": ASK, **body})
    assert status == 400 and answer["error"]["param"] == field, answer


def test_a_model_whose_template_has_no_tool_calling_refuses_tools_naming_it(chat_checkpoint, tmp_path):
    with serving(chat_checkpoint, tmp_path) as s:
        status, answer = s.http("POST", "/v1/chat/completions", {"messages": ASK, "tools": TOOLS})
    assert status == 400 and answer["error"]["param"] == "tools" and "template" in answer["error"]["message"]


def test_langchain_bind_tools_round_trip_with_a_tool_result(tools_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Rome"], days: Literal[1, 2, 3]) -> str:
        """The forecast for a city."""
        return f"Sunny in {city} for {days} days"

    chat = langchain_openai.ChatOpenAI(model="toolmodel", base_url=tools_server.url, api_key="none", temperature=0,
                                       max_tokens=120)
    asked = [HumanMessage("What is the weather in Paris?")]
    reply = chat.bind_tools([get_weather], tool_choice="required").invoke(asked)
    assert reply.tool_calls, reply
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}
    streamed = None
    for chunk in chat.bind_tools([get_weather], tool_choice="required").stream(asked):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = chat.bind_tools([get_weather]).bind(max_tokens=16).invoke(asked + [reply, result])
    assert isinstance(final.content, str) and (final.content or final.tool_calls)


def test_litellm_gets_tool_calls_and_recognises_a_context_overflow(tools_server, tmp_path):
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/toolmodel", api_base=tools_server.url, api_key="none", messages=ASK,
                           tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and all(json.loads(c.function.arguments) for c in calls)
    chunks = list(litellm.completion(model="openai/toolmodel", api_base=tools_server.url, api_key="none",
                                     messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                                     temperature=0, stream=True))
    streamed = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    with serving(BUILTIN, tmp_path) as s, pytest.raises(litellm.ContextWindowExceededError):
        litellm.text_completion(model="openai/stdlib-target", api_base=s.url, api_key="none", prompt="x " * 5000,
                                max_tokens=4)


def test_the_sdk_raises_a_bad_request_naming_tools_on_completions(tools_server):
    with pytest.raises(openai.BadRequestError) as e:
        tools_server.client().completions.create(model="toolmodel", prompt="x", extra_body={"tools": TOOLS})
    assert e.value.param == "tools"


def test_llm_chat_with_tools_returns_the_calls_it_was_held_to(tool_model):
    from fast_decode import LLM
    llm = LLM(tool_model, dtype="float32")
    done = llm.chat(ASK, tools=TOOLS, tool_choice="required", max_new_tokens=120, temperature=1.0, seed=3)
    assert done.finish_reason == "tool_calls" and done.tool_calls
    for c in done.tool_calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    plain = llm.chat(ASK, tools=TOOLS, tool_choice="none", max_new_tokens=4, temperature=0)
    assert plain.tool_calls is None and plain.finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="tool_choice"):
        llm.chat(ASK, tools=TOOLS, tool_choice="sometimes")
