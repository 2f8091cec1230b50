"""Tool calling in the format of Qwen2.5, Qwen3, SmolLM3 and the Hermes models: the chat template renders the tools
(as transformers' apply_chat_template(tools=...) does), the model answers with blocks of

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and guided generation (guided.py, llguidance) holds the answer to that format and to each function's JSON schema:
free text or calls for tool_choice "auto", calls only for "required" or a named function. The answer's text then
becomes the OpenAI API's tool_calls."""
import json
import re
import uuid
from typing import Optional

from guided import JSON_OPTIONS  # (compact JSON, as guided output writes it)
from sampling import check  # (an OptionError naming the field)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def functions(tools) -> list[dict]:
    """The API's tools ([{"type": "function", "function": {"name", "description", "parameters"}}]), checked, as
    the functions they declare (each with its parameters' schema, an object's by default)."""
    check(isinstance(tools, list) and tools, "tools", "tools must be a non-empty list")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        check(isinstance(f, dict) and isinstance(f.get("name"), str) and NAME.fullmatch(f["name"]), "tools",
              f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, its name "
              f"1 to 64 letters, digits, _ or -")
        params = f.get("parameters", {"type": "object"})
        check(isinstance(params, dict), "tools", f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": f["name"], "description": f.get("description"), "parameters": params})
    check(len({f["name"] for f in out}) == len(out), "tools", "two tools have one name")
    return out


def chosen(choice, names: list[str]) -> Optional[list[str]]:
    """tool_choice as the functions the answer must call (None: it may answer in text instead, "auto"; []: it
    calls none, "none")."""
    if choice in (None, "auto"):
        return None
    if choice == "none":
        return []
    if choice == "required":
        return names
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    check(isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str), "tool_choice",
          "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    check(name in names, "tool_choice", f"tool_choice names '{name}', which is not among the tools")
    return [name]


def supported(template: Optional[str]) -> bool:  # the template renders tools and teaches this format
    return template is not None and "tools" in template and OPEN in template


def grammar(funcs: list[dict], must: Optional[list[str]], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for the answer: one call, or calls one per line when parallel, each
    naming one of the functions (must's, or any when must is None) with arguments that match its schema; with must
    None, free text that does not start a call is the other choice."""
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
               for f in funcs if must is None or f["name"] in must]
    body = {"anyOf": schemas, "x-guidance": JSON_OPTIONS} if len(schemas) > 1 else {**schemas[0],
                                                                                     "x-guidance": JSON_OPTIONS}
    rules = [f'call: "{OPEN}\\n" %json {json.dumps(body)} "\\n{CLOSE}"',
             "calls: call (\"\\n\" call)*" if parallel else "calls: call"]
    if must is None:
        return "\n".join(["start: calls | TEXT", f"TEXT: /(?s:.*)/ & ~/[ \\t\\n]*{OPEN}(?s:.*)/", *rules])
    return "\n".join(["start: calls", *rules])


def parse(text: str) -> tuple[Optional[str], list[dict]]:
    """The answer's text as (content, tool_calls in the API's shape): its calls where it is made of them (text
    before the first allowed), else the text itself and no calls."""
    if OPEN not in text:
        return text, []
    head, calls = text[: text.index(OPEN)], []
    for block in re.findall(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), text, re.S):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return (head.strip() or None) if calls else text, calls


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant turn's tool call arguments as objects (the API sends
    them as JSON text), its missing content empty."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""} if m.get("content") is None else m
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c["function"])
                if isinstance(f.get("arguments"), str):
                    f["arguments"] = json.loads(f["arguments"])
                calls.append({**c, "function": f})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
