"""Structured output and tool calling on the API side: request keys -> a `ConstraintSpec`
(core/constraint.py) and a `ToolPlan`; a finished tool-calling completion -> OpenAI
`tool_calls`.

Accepted (each validated here; compiling the grammar is kernels/grammar.py's, off the loop):
- `response_format`: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}};
- vLLM's `guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice`
  (strings), `guided_grammar` (Lark or GBNF), and the newer `structured_outputs` object
  with the same four as `json`, `regex`, `choice`, `grammar`. At most one of them per request.
  Refused with a 400 naming them: `guided_decoding_backend`, `guided_whitespace_pattern`,
  `structured_outputs.structural_tag` / `json_object` / `whitespace_pattern`.
- `tools` ({"type": "function", "function": {name, description, parameters}}) with
  `tool_choice` "none" | "auto" | "required" | {"type": "function", "function": {"name"}}:
  required and named constrain the output to the tools' argument schemas; auto parses the
  model's own markup (`tool_family`). `parallel_tool_calls: false` means at most one call
  (required: the grammar ends after it; auto: the first is kept). A completion cut short by
  max_tokens still reads back as tool calls, the last one's arguments as far as they got
  (OpenAI's behaviour), never as the raw markup.
"""

import json
import re
import secrets
from typing import NamedTuple

import orjson

from ...core.constraint import ConstraintSpec
from .errors import bad_param, unsupported

GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
REFUSED_GUIDED_KEYS = ("guided_decoding_backend", "guided_whitespace_pattern")
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar"}


class ToolPlan(NamedTuple):
    """How a chat request with tools is generated and read back."""
    mode: str                           # "auto" | "required" | "named"
    names: tuple                        # the functions offered (named: the one chosen)
    family: str                         # "hermes" | "llama3": the markup `auto` parses
    parallel: bool = True               # parallel_tool_calls: False reads back (and allows) one call at most


def constraint_spec(body: dict) -> tuple:
    """The one output constraint the body asks for -> (ConstraintSpec, the key that asked for
    it, which an error about it names), or (None, None)."""
    for key in REFUSED_GUIDED_KEYS:
        if body.get(key) is not None:
            raise unsupported(key, f"{key} is not supported (the grammar engine is llguidance)")
    found = [(key, body[key]) for key in GUIDED_KEYS if body.get(key) is not None]
    found += _structured_outputs(body.get("structured_outputs"))
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    if len(found) > 1:
        raise bad_param(found[1][0], f"give one output constraint, got {', '.join(k for k, _ in found)}")
    if not found:
        return None, None
    key, value = found[0]
    if key == "response_format":
        return value, key
    guided_key = _STRUCTURED_OUTPUTS.get(key.removeprefix("structured_outputs."), key)
    return guided_constraint(guided_key, value, name=key), key


def _structured_outputs(value) -> list:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_param("structured_outputs", "structured_outputs must be an object")
    out = []
    for key, item in value.items():
        if key not in _STRUCTURED_OUTPUTS:
            raise unsupported("structured_outputs", f"structured_outputs.{key} is not supported; "
                              f"use one of {', '.join(_STRUCTURED_OUTPUTS)}")
        if item is not None:
            out.append((f"structured_outputs.{key}", item))
    return out


def _response_format(fmt) -> ConstraintSpec | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_param("response_format", 'response_format must be an object with a "type"')
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", "")
    if kind != "json_schema":
        raise bad_param("response_format", f"response_format.type must be text, json_object or json_schema, "
                        f"got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_param("response_format", "response_format.json_schema must be an object with a \"name\"")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_param("response_format", "response_format.json_schema.schema must be an object")
    return schema_spec(schema)


def schema_spec(schema: dict) -> ConstraintSpec:
    """The schema's text with its keys in the order given: the grammar writes an object's
    properties in the schema's order (a "reasoning, answer" schema thinks before it answers,
    as OpenAI and vLLM keep it), so two schemas that differ only in key order are two grammars."""
    return ConstraintSpec("json_schema", orjson.dumps(schema).decode())


def guided_constraint(key: str, value, name: str | None = None) -> ConstraintSpec:
    """A guided_* key's value (GUIDED_KEYS) -> its ConstraintSpec, or a 400 naming `name`
    (default: the key; the gRPC route names its own fields)."""
    name = name or key
    if key == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_param(name, f"{name} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise bad_param(name, f"{name} must be a JSON schema object")
        return schema_spec(value)
    if key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_param(name, f"{name} must be a non-empty array of non-empty strings")
        return ConstraintSpec("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise bad_param(name, f"{name} must be a non-empty string")
    return ConstraintSpec("regex" if key == "guided_regex" else "grammar", value)


# ------------------------------------------------------------------ tools

def tool_family(chat_template_source: str | None) -> str:
    """The markup a model's chat template teaches it for tool calls."""
    if chat_template_source and ("<|python_tag|>" in chat_template_source or "ipython" in chat_template_source):
        return "llama3"
    return "hermes"


def tool_plan(body: dict, parallel: bool = True) -> tuple:
    """-> (ToolPlan | None, the tools for the chat template | None, ConstraintSpec | None).
    The plan's family is "hermes" until the route knows the model (`tool_family`);
    `parallel`: the request's parallel_tool_calls."""
    tools = body.get("tools")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise unsupported("functions", "the deprecated functions / function_call are not supported; use tools")
    if tools is None:
        if body.get("tool_choice") not in (None, "none"):
            raise bad_param("tool_choice", "tool_choice needs tools")
        return None, None, None
    if not isinstance(tools, list) or not tools:
        raise bad_param("tools", "tools must be a non-empty array")
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = tuple(f["name"] for f in functions)
    choice = body.get("tool_choice", "auto")
    family = "hermes"
    if choice == "none":
        return None, tools, None
    if choice == "auto":
        return ToolPlan("auto", names, family, parallel), tools, None
    if choice == "required":
        return ToolPlan("required", names, family, parallel), tools, schema_spec(_calls_schema(functions, parallel))
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_param("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        fn = functions[names.index(name)]
        return ToolPlan("named", (name,), family), tools, schema_spec(fn.get("parameters") or {"type": "object"})
    raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                    '{"type": "function", "function": {"name": ...}}')


def _function(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_param("tools", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fn["name"]):
        raise bad_param("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_param("tools", f"tools[{i}].function.parameters must be a JSON schema object")
    return fn


def _calls_schema(functions: list, parallel: bool = True) -> dict:
    """tool_choice=required: a JSON array of one or more {"name", "arguments"} calls (exactly
    one when not `parallel`), name first: the grammar keeps the schema's property order."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_calls(plan: ToolPlan, text: str, cut: bool = False) -> tuple:
    """A finished completion -> (content or None, [OpenAI tool call, ...]); no calls found in
    `auto` mode: (text, []). `cut`: max_tokens ended it, so the last call may be unfinished:
    it is returned with its arguments as far as they got (a call cut inside its name is
    dropped), and its markup never becomes content."""
    if plan.mode == "named":
        return None, [_call(plan.names[0], text)]
    if plan.mode == "required":
        return None, [_call(name, args) for name, args in parse_required(text)]
    calls = parse_hermes(text, cut) if plan.family == "hermes" else parse_llama3(text, cut)
    calls = [c for c in calls if c[0] in plan.names][:None if plan.parallel else 1]
    opened = _opens_call(text, plan.family)
    if not calls and not (cut and opened):
        return text, []
    content = text[:opened].strip() if opened is not None else text
    return content or None, [_call(name, args) for name, args in calls]


def parse_required(text: str) -> list:
    """tool_choice=required's output, the compact JSON array its grammar writes
    (`[{"name":...,"arguments":{...}},...]`) -> [(name, arguments text)]; an array cut short
    gives its complete calls and the cut one (`_cut_call`)."""
    decoder, out, pos = json.JSONDecoder(), [], 1
    while pos < len(text):
        try:
            call, pos = decoder.raw_decode(text, pos)
        except ValueError:
            out += _cut_call(text[pos:])
            break
        out.append((call["name"], orjson.dumps(call["arguments"]).decode()))
        if not text.startswith(",", pos):
            break
        pos += 1
    return out


_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*(.*))?', re.S)


def _cut_call(text: str) -> list:
    """The start of a call object that max_tokens cut -> [(name, the arguments' text so far)],
    or [] when the name itself is not complete."""
    m = _CUT_CALL.match(text.strip())
    return [(m.group(1), (m.group(2) or "").rstrip())] if m else []


def _opens_call(text: str, family: str):
    """Where the model's tool-call markup starts in `text`, or None."""
    if family == "hermes":
        at = text.find("<tool_call>")
        return None if at < 0 else at
    body = text.lstrip()
    return len(text) - len(body) if body.startswith(("{", "<|python_tag|>")) else None


_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_hermes(text: str, cut: bool = False) -> list:
    """Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated
    (`cut`: then maybe one whose `</tool_call>` never came)."""
    out, end = [], 0
    for m in _HERMES.finditer(text):
        call = _json_object(m.group(1))
        if call is not None and isinstance(call.get("name"), str):
            out.append((call["name"], orjson.dumps(call.get("arguments", {})).decode()))
        end = m.end()
    rest = text.find("<tool_call>", end)
    if cut and rest >= 0:
        out += _cut_call(text[rest + len("<tool_call>"):])
    return out


def parse_llama3(text: str, cut: bool = False) -> list:
    """Llama 3.1: the whole reply is `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), several separated by ';' (`cut`: the last one may be unfinished)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    out = []
    parts = body.split(";")
    for k, part in enumerate(parts):
        call = _json_object(part.strip())
        if call is None and cut and k == len(parts) - 1:
            return out + _cut_call(part)
        if call is None or not isinstance(call.get("name"), str):
            return []
        out.append((call["name"], orjson.dumps(call.get("parameters", call.get("arguments", {}))).decode()))
    return out


def _json_object(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_response_chunks(fields: dict, content, calls: list, finish_reason: str, use: dict | None,
                         timings: dict) -> bytes:
    """A tool-calling stream, sent whole once the completion is done: the role, the content if
    any, one `tool_calls` delta per call (name and the arguments in full), the finish chunk."""
    def chunk(delta, finish=None):
        return dict(fields, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
    parts = [chunk({"role": "assistant", "content": content if content else None} if not calls
                   else {"role": "assistant", "content": content})]
    for k, call in enumerate(calls):
        parts.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": call["function"]}]}))
    last = chunk({}, finish_reason)
    last["timings"] = timings
    parts.append(last)
    if use is not None:
        parts.append(dict(fields, choices=[], usage=use))
    return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in parts) + b"data: [DONE]\n\n"
