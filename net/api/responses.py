"""OpenAI's Responses API, `POST /v1/responses`: the family's request parsed into the
routes' `GenerationRequest`, a `response` object, and its stream of typed events.

Accepted: `input` (a string, or a list of items: messages with `input_text` / `output_text`
parts, `function_call` and `function_call_output` items of earlier turns), `instructions`
(a system message before them), `max_output_tokens`, `temperature`, `top_p` (and the
sampling extensions the other routes take: top_k, min_p, seed, stop, penalties), `stream`,
`text.format` (text, json_object, json_schema: the structured-output path of
net/api/structured.py), `tools` (function tools) with `tool_choice` and
`parallel_tool_calls`, `metadata` (echoed). No server-side storage: `store: true`,
`previous_response_id`, `conversation` and `background` are 400s naming the field.

Stream (SSE, `event:` + `data:` per event, each with its `sequence_number`):
response.created, response.in_progress, response.output_item.added (the message),
response.content_part.added, response.output_text.delta per token, then at the end
response.output_text.done, response.content_part.done, response.output_item.done and
response.completed, which carries the usage and tokenwire's stage `timings` (its status is
"incomplete", with incomplete_details, when max_output_tokens or a deadline ended it: always
response.completed, never response.incomplete, because the OpenAI SDK's
`stream.get_final_response()` accepts only that one; response.failed when the engine failed). A delta event is spliced per token from constant bytes around the text and
its sequence number (`ResponsesSse.splice`). Function calls are read back at the end
(net/api/structured.py) and sent as function_call items with their whole arguments.
"""

import orjson

from ...core.constraint import ConstraintSpec
from .errors import ApiError, bad_param, unsupported
from .fields import SPECULATIVE_KEYS, check_keys, opt, sampling
from .route import GenerationRequest, Route
from .structured import schema_spec, tool_plan

_KEYS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options",
         "text", "tools", "tool_choice", "parallel_tool_calls", "metadata", "store", "previous_response_id",
         "conversation", "background", "user", "truncation", "reasoning", "include", "top_logprobs",
         "service_tier", "safety_identifier", "prompt_cache_key", "max_tool_calls", "prompt",
         # the sampling extensions the other routes take (vLLM's Responses route takes them too)
         "top_k", "min_p", "seed", "stop", "repetition_penalty", "frequency_penalty", "presence_penalty",
         "ignore_eos", "min_tokens", *SPECULATIVE_KEYS}
_REFUSED = {"previous_response_id": "previous_response_id needs stored responses; this server keeps none: send the "
                                    "earlier turns' items in input",
            "conversation": "conversations need stored responses; this server keeps none: send the earlier turns' "
                            "items in input",
            "background": "background responses are not supported",
            "prompt": "stored prompt templates are not supported",
            "max_tool_calls": "max_tool_calls is not supported"}
_ROLES = {"user", "assistant", "system", "developer"}


def parse_responses(body: dict, on_unknown=None) -> GenerationRequest:
    check_keys(body, _KEYS, on_unknown)
    _refuse_storage(body)
    messages = _input_messages(body)
    tools_body = _chat_tools(body)
    plan, template_tools, constraint = tool_plan(tools_body, opt(body, "parallel_tool_calls", bool, True))
    constraint_param = "tools" if constraint is not None else None
    fmt_constraint = _text_format(body.get("text"))
    if fmt_constraint is not None:
        if constraint is not None:
            raise bad_param("text.format", "tool_choice required or a named function constrains the output already")
        constraint, constraint_param = fmt_constraint, "text.format"
    try:
        params = sampling(body, max_tokens=opt(body, "max_output_tokens", int, None), logprobs=None)
    except ApiError as exc:
        if exc.param == "max_tokens":
            exc.param, exc.message = "max_output_tokens", exc.message.replace("max_tokens", "max_output_tokens")
        raise
    stream = opt(body, "stream", bool, False)
    echo = {"instructions": opt(body, "instructions", str, None), "max_output_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": opt(body, "metadata", dict, {})}
    return GenerationRequest(RESPONSES, None, None, messages, params, stream, True, False, opt(body, "model", str, None),
                             constraint=constraint, constraint_param=constraint_param, tools=plan,
                             template_tools=template_tools, echo=echo)


def _refuse_storage(body: dict) -> None:
    if body.get("store") is True:
        raise unsupported("store", "store=true needs server-side storage; this server keeps no responses: send "
                          "store=false (or leave it out) and the earlier turns' items in input")
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False):
            raise unsupported(key, why)
    top = opt(body, "top_logprobs", int, 0)
    if top:
        raise unsupported("top_logprobs", "log-probabilities are not returned on /v1/responses; use "
                          "/v1/chat/completions with logprobs")
    include = opt(body, "include", list, [])
    if "message.output_text.logprobs" in include:
        raise unsupported("include", "message.output_text.logprobs is not supported")


# ------------------------------------------------------------------ input

def _input_messages(body: dict) -> list:
    """instructions and input -> chat messages for the model's template."""
    messages = []
    instructions = opt(body, "instructions", str, None)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise bad_param("input", "input must not be empty")
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_param("input", "input must be a string or a non-empty array of input items")
    for i, item in enumerate(items):
        _add_item(messages, i, item)
    return messages


def _add_item(messages: list, i: int, item) -> None:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad_param("input", f"{where} must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_param("input", f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}")
        messages.append({"role": role, "content": _content(where, item.get("content"))})
    elif kind == "function_call":
        call = _function_call(where, item)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad_param("input", f"{where}.call_id must be a string")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _content(where + ".output", item.get("output"))})
    elif kind == "reasoning":
        return                              # a reasoning model's summary of an earlier turn: not for this model
    else:
        raise unsupported("input", f"{where}.type {kind!r} is not supported; use message, function_call or "
                          "function_call_output items")


def _content(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param("input", f"{where} content must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise unsupported("input", f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_param("input", f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "".join(texts)


def _function_call(where: str, item: dict) -> dict:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise bad_param("input", f"{where} must have call_id, name and arguments (a JSON string)")
    try:
        arguments = orjson.loads(item["arguments"])
    except orjson.JSONDecodeError:
        raise bad_param("input", f"{where}.arguments is not valid JSON") from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


# ------------------------------------------------------------------ tools and text.format

def _chat_tools(body: dict) -> dict:
    """Responses' flat function tools and tool_choice -> chat's shapes, for structured.tool_plan."""
    tools = body.get("tools")
    out = {}
    if tools is not None and tools != []:
        if not isinstance(tools, list):
            raise bad_param("tools", "tools must be an array")
        out["tools"] = [_chat_tool(i, t) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                            '{"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and (out or choice not in ("none", "auto")):     # auto (the default) needs no tools
        out["tool_choice"] = choice
    return out


def _chat_tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise unsupported("tools", f"tools[{i}]: only function tools are supported, got {kind!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _text_format(text) -> ConstraintSpec | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_param("text", "text must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_param("text.format", 'text.format must be an object with a "type"')
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return ConstraintSpec("json_object", "")
    if fmt["type"] != "json_schema":
        raise bad_param("text.format", f"text.format.type must be text, json_object or json_schema, got {fmt['type']!r}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict) or not isinstance(fmt.get("name"), str):
        raise bad_param("text.format", "text.format json_schema needs a name and a schema object")
    return schema_spec(schema)


# ------------------------------------------------------------------ the response object

_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "deadline": "incomplete",
           "error": "failed"}
_INCOMPLETE = {"length": {"reason": "max_output_tokens"}, "deadline": {"reason": "deadline"}}


def usage(use: dict) -> dict:
    """OpenAI chat usage -> the Responses API's."""
    return {"input_tokens": use["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": use["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": use["total_tokens"]}


def response_object(g, served, response_id: str, created: int, status: str, output: list, use: dict | None,
                    incomplete=None, error=None) -> dict:
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": incomplete, "output": output, "usage": usage(use) if use is not None else None,
            **_echo(g, served)}


def _echo(g, served) -> dict:
    """The response object's fields that every event of one response repeats unchanged."""
    echo = g.echo
    return {"background": False, "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
            "model": served.model, "parallel_tool_calls": echo["parallel_tool_calls"], "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": echo["temperature"],
            "text": echo["text"], "tool_choice": echo["tool_choice"], "tools": echo["tools"], "top_p": echo["top_p"],
            "truncation": "disabled", "metadata": echo["metadata"]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_items(response_id: str, calls: list) -> list:
    base = response_id.replace("resp_", "fc_", 1)
    return [{"type": "function_call", "id": f"{base}_{k}", "call_id": c["id"], "name": c["function"]["name"],
             "arguments": c["function"]["arguments"], "status": "completed"} for k, c in enumerate(calls)]


def _message_id(response_id: str) -> str:
    return response_id.replace("resp_", "msg_", 1)


def _whole_body(g, served, response_id, created, text, finish_reason, use, ids, logprobs) -> bytes:
    output = [_message_item(_message_id(response_id), text)]
    return orjson.dumps(response_object(g, served, response_id, created, _STATUS.get(finish_reason, "completed"),
                                        output, use, _INCOMPLETE.get(finish_reason)))


def _tools_body(g, served, response_id, created, content, calls, finish_reason, use, timings) -> tuple:
    output = ([_message_item(_message_id(response_id), content)] if content else []) + _call_items(response_id, calls)
    status, incomplete = _STATUS.get(finish_reason, "completed"), _INCOMPLETE.get(finish_reason)
    if not g.stream:
        body = response_object(g, served, response_id, created, status, output, use, incomplete)
        return ((b"content-type", b"application/json"),), orjson.dumps(body)
    events = _Events()
    events.open(response_object(g, served, response_id, created, "in_progress", [], None))
    for index, item in enumerate(output):
        if item["type"] == "message":
            events.message(index, item["id"], content)
            continue
        events.add("response.output_item.added", output_index=index, item=dict(item, arguments="",
                                                                                 status="in_progress"))
        events.add("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                   delta=item["arguments"])
        events.add("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                   name=item["name"], arguments=item["arguments"])
        events.add("response.output_item.done", output_index=index, item=item)
    final = response_object(g, served, response_id, created, status, output, use, incomplete)
    events.add("response.completed", response=final, timings=timings)
    return ResponsesSse.response_headers, events.bytes()


class _Events:
    """Whole events, numbered (the slow path: the start and the end of a stream)."""
    __slots__ = ("parts", "seq")

    def __init__(self, seq: int = 0):
        self.parts = []
        self.seq = seq

    def add(self, kind: str, **fields) -> None:
        self.parts.append(b"event: " + kind.encode() + b"\ndata: "
                          + orjson.dumps({"type": kind, **fields, "sequence_number": self.seq}) + b"\n\n")
        self.seq += 1

    def open(self, response: dict) -> None:
        self.add("response.created", response=response)
        self.add("response.in_progress", response=response)

    def message(self, index: int, item_id: str, text: str) -> None:
        """A whole message item: added, its part, one delta, done."""
        self.start_message(index, item_id)
        self.add("response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text,
                 logprobs=[])
        self.end_message(index, item_id, text)

    def start_message(self, index: int, item_id: str) -> None:
        self.add("response.output_item.added", output_index=index, item=_message_item(item_id, "", "in_progress"))
        self.add("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                 part=_text_part(""))

    def end_message(self, index: int, item_id: str, text: str) -> None:
        self.add("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                 logprobs=[])
        self.add("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                 part=_text_part(text))
        self.add("response.output_item.done", output_index=index, item=_message_item(item_id, text))

    def bytes(self) -> bytes:
        return b"".join(self.parts)


_NUM_OPENING = 4                    # response.created, .in_progress, .output_item.added, .content_part.added
_SEQ_TAILS = [b',"sequence_number":%d}\n\n' % n for n in range(8192)]     # a delta event's end, by its number


def _delta_splicer(prefix: bytes, texts: list):
    """-> splice(text): a later token's delta event (hot path: once per token). The event's
    sequence number follows from the number of texts so far (each delta appends one), and its
    closing bytes come from a table: a closure over locals, no attribute or format per token."""
    append = texts.append

    def splice(text: str) -> bytes:
        append(text)
        try:
            tail = _SEQ_TAILS[len(texts) + _NUM_OPENING - 1]
        except IndexError:                  # past 8192 events
            tail = b',"sequence_number":%d}\n\n' % (len(texts) + _NUM_OPENING - 1)
        return prefix + orjson.dumps(text) + tail
    return splice


# A stream's opening and closing events as byte templates (%b: JSON the encoder makes, %d: a
# sequence number): the same bytes `_Events` writes, without a dict and a dumps per event.
_CREATED = (b'event: response.created\ndata: {"type":"response.created","response":%b,"sequence_number":0}\n\n'
            b'event: response.in_progress\ndata: {"type":"response.in_progress","response":%b,"sequence_number":1}\n\n'
            b'event: response.output_item.added\ndata: {"type":"response.output_item.added","output_index":0,'
            b'"item":{"type":"message","id":%b,"status":"in_progress","role":"assistant","content":[]},'
            b'"sequence_number":2}\n\n'
            b'event: response.content_part.added\ndata: {"type":"response.content_part.added","item_id":%b,'
            b'"output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[],'
            b'"logprobs":[]},"sequence_number":3}\n\n')
_CLOSING = (b'event: response.output_text.done\ndata: {"type":"response.output_text.done","item_id":%b,'
            b'"output_index":0,"content_index":0,"text":%b,"logprobs":[],"sequence_number":%d}\n\n'
            b'event: response.content_part.done\ndata: {"type":"response.content_part.done","item_id":%b,'
            b'"output_index":0,"content_index":0,"part":{"type":"output_text","text":%b,"annotations":[],'
            b'"logprobs":[]},"sequence_number":%d}\n\n'
            b'event: response.output_item.done\ndata: {"type":"response.output_item.done","output_index":0,'
            b'"item":%b,"sequence_number":%d}\n\n'
            b'event: response.completed\ndata: {"type":"response.completed","response":%b,"timings":%b,'
            b'"sequence_number":%d}\n\n')


# response_object's bytes, its fields in the same order: id, created_at, status, incomplete_details,
# output, usage, then the echoed fields (`_echo`, serialized once per request)
_OBJECT = (b'{"id":%b,"object":"response","created_at":%d,"status":%b,"error":null,"incomplete_details":%b,'
           b'"output":%b,"usage":%b,%b}')
_ITEM = (b'{"type":"message","id":%b,"status":"completed","role":"assistant","content":[{"type":"output_text",'
         b'"text":%b,"annotations":[],"logprobs":[]}]}')


class ResponsesSse:
    """The Responses event stream of one request (encoders._Stream's interface). Its opening
    and closing events are byte templates filled once per request; a token's delta event is
    spliced by `splice`."""
    content_type = b"text/event-stream"
    response_headers = ((b"content-type", content_type), (b"cache-control", b"no-cache"))
    in_band_errors = False
    __slots__ = ("_g", "_served", "_id", "_created", "_item", "_item_json", "_texts", "_started", "_echo_json",
                 "splice")

    def __init__(self, g, served, response_id: str, created: int):
        self._g, self._served, self._id, self._created = g, served, response_id, created
        self._item = _message_id(response_id)
        self._item_json = orjson.dumps(self._item)
        self._texts = []                    # the text so far: the closing events repeat it whole
        self._started = False
        self.splice = _delta_splicer(
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":'
            + self._item_json + b',"output_index":0,"content_index":0,"logprobs":[],"delta":', self._texts)

    def text_parts(self) -> tuple:
        return None, None                   # the sequence number changes: `splice` instead

    def token(self, out) -> bytes:
        return self.splice(out.text)

    def first_token(self, out) -> bytes:
        return self._open() + self.splice(out.text)

    def _open(self) -> bytes:
        """The four opening events (sequence numbers 0 to _NUM_OPENING - 1)."""
        self._started = True
        self._echo_json = orjson.dumps(_echo(self._g, self._served))[1:-1]
        response = _OBJECT % (orjson.dumps(self._id), self._created, b'"in_progress"', b"null", b"[]", b"null",
                              self._echo_json)
        item = self._item_json
        return _CREATED % (response, response, item, item)

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        head = b"" if self._started else self._open()
        text = "".join(self._texts)
        seq = _NUM_OPENING + len(self._texts)
        if error is not None:
            failed = response_object(self._g, self._served, self._id, self._created, "failed",
                                     [_message_item(self._item, text)], use,
                                     error={"code": "server_error", "message": f"the engine failed: {error}"})
            events = _Events(seq)
            events.add("response.failed", response=failed, timings=timings)
            return head + events.bytes()
        text_json, item_id = orjson.dumps(text), self._item_json
        item = _ITEM % (item_id, text_json)
        status = _STATUS.get(finish_reason, "completed")
        final = _OBJECT % (orjson.dumps(self._id), self._created, b'"%s"' % status.encode(),
                           orjson.dumps(_INCOMPLETE.get(finish_reason)), b"[" + item + b"]",
                           orjson.dumps(usage(use)), self._echo_json)
        return head + _CLOSING % (item_id, text_json, seq, item_id, text_json, seq + 1, item, seq + 2,
                                  final, orjson.dumps(timings), seq + 3)

    def trailers(self, base: list, finish_reason: str, error: str | None) -> list:
        return base


def _encoder(g, served, response_id, created, index, num_prompt, headers):
    return ResponsesSse(g, served, response_id, created)


RESPONSES = Route("responses", parse_responses, "resp_", "input", _encoder, _whole_body, _tools_body, chat=True,
                  max_tokens_param="max_output_tokens")
