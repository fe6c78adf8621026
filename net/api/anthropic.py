"""Anthropic's Messages API, `POST /v1/messages` and `POST /v1/messages/count_tokens`: the
family's request parsed into the routes' `GenerationRequest`, a `message` object, its
event stream, and Anthropic's error shape.

Accepted: `model`, `max_tokens` (required, as Anthropic requires it), `system` (a string or
text blocks), `messages` (user / assistant turns whose content is a string or blocks:
text, tool_use, tool_result), `stop_sequences`, `temperature`, `top_p`, `top_k`,
`stream`, `tools` ({name, description, input_schema}) with `tool_choice` (auto, any, tool,
none; `disable_parallel_tool_use`), `metadata` (ignored), and the sampling extensions the
other routes take (seed, ignore_eos, min_p, repetition_penalty, speculative,
num_speculative_tokens). Images, documents and
extended thinking are 400s naming the field.

Stream (SSE, `event:` + `data:`): message_start, content_block_start (text), ping, one
content_block_delta (text_delta) per token — constant bytes around the text, spliced by
the dispatcher like chat's —, content_block_stop, message_delta (stop_reason,
stop_sequence, usage, and tokenwire's stage `timings`), message_stop; an engine failure
mid-stream is an `error` event. Tool calls are read back at the end (net/api/structured.py)
and sent as tool_use blocks, their input as one input_json_delta.

stop_reason: end_turn (EOS), stop_sequence (a stop sequence; `stop_sequence` names it when
the request gave one, else null: the engine does not report which one of several
matched), max_tokens, tool_use, and "deadline" when x-request-timeout-ms passed.

Errors: `{"type": "error", "error": {"type": ..., "message": ...}}`, the message starting
with the field it is about (`messages: messages.0.content ...`), as Anthropic writes them.
"""

import orjson

from .errors import ApiError, bad_param, unsupported
from .fields import SPECULATIVE_KEYS, check_keys, opt, sampling
from .route import GenerationRequest, Route
from .structured import tool_plan

_EXTENSIONS = ("seed", "ignore_eos", "min_p", "repetition_penalty", *SPECULATIVE_KEYS)  # the other routes' fields
_KEYS = {"model", "max_tokens", "system", "messages", "stop_sequences", "temperature", "top_p", "top_k", "stream",
         "tools", "tool_choice", "metadata", "thinking", "service_tier", "container", "mcp_servers", *_EXTENSIONS}
_COUNT_KEYS = {"model", "system", "messages", "tools", "tool_choice", "thinking"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_body(exc: ApiError) -> bytes:
    """Anthropic's error shape; the field, when there is one, leads the message."""
    message = exc.message if exc.param is None or exc.message.startswith(exc.param + ":") else \
        f"{exc.param}: {exc.message}"
    return orjson.dumps({"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"),
                                                    "message": message}})


def parse_messages(body: dict, on_unknown=None) -> GenerationRequest:
    check_keys(body, _KEYS, on_unknown)
    _refuse(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_param("max_tokens", "max_tokens: Field required")
    messages, plan, template_tools, constraint = _prompt(body)
    stop = opt(body, "stop_sequences", list, [])
    fields = {k: body[k] for k in ("temperature", "top_p", "top_k", *_EXTENSIONS) if k in body}
    fields["stop"] = stop
    try:
        params = sampling(fields, max_tokens=opt(body, "max_tokens", int, None), logprobs=None)
    except ApiError as exc:
        if exc.param == "stop":
            exc.param = "stop_sequences"
        raise
    return GenerationRequest(MESSAGES, None, None, messages, params, opt(body, "stream", bool, False), True, False,
                             opt(body, "model", str, None), constraint=constraint,
                             constraint_param="tools" if constraint is not None else None, tools=plan,
                             template_tools=template_tools)


def parse_count_tokens(body: dict, on_unknown=None) -> tuple:
    """count_tokens' body -> (messages, the tools for the chat template)."""
    check_keys(body, _COUNT_KEYS, on_unknown)
    _refuse(body)
    messages, _, template_tools, _ = _prompt(body)
    return messages, template_tools


def _refuse(body: dict) -> None:
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise unsupported("thinking", "extended thinking is not supported by this server")
    for key in ("container", "mcp_servers"):
        if body.get(key):
            raise unsupported(key, f"{key} is not supported by this server")


def _prompt(body: dict) -> tuple:
    """-> (chat messages, ToolPlan | None, tools for the template, ConstraintSpec | None)"""
    messages = _system(body.get("system"))
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_param("messages", "messages must be a non-empty array of {role, content} objects")
    for i, turn in enumerate(turns):
        messages += _turn(i, turn)
    plan, template_tools, constraint = tool_plan(_chat_tools(body), _parallel(body.get("tool_choice")))
    return messages, plan, template_tools, constraint


def _system(system) -> list:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": "".join(_text("system", j, b) for j, b in enumerate(system))}]
    raise bad_param("system", "system must be a string or an array of text blocks")


def _text(where: str, j: int, block) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise unsupported(where.split(".")[0], f"{where}.{j}: only text blocks are supported here, got {kind!r}")
    return block["text"]


def _turn(i: int, turn) -> list:
    """One Anthropic message -> chat messages (tool_result blocks become tool messages)."""
    where = f"messages.{i}"
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise bad_param("messages", f"{where}.role must be 'user' or 'assistant'")
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_param("messages", f"{where}.content must be a string or an array of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(f"{where}.content.{j}", block))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(f"{where}.content.{j}", block))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise unsupported("messages", f"{where}.content.{j}: a {kind!r} block is not supported in a {role} "
                              "message (text, tool_use in assistant turns, tool_result in user turns)")
    if role == "assistant":
        message = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool_use(where: str, block: dict) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
            not isinstance(block.get("input"), dict):
        raise bad_param("messages", f"{where}: a tool_use block needs id, name and input (an object)")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def _tool_result(where: str, block: dict) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_param("messages", f"{where}.tool_use_id: Field required")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text(f"{where}.content", k, b) for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise bad_param("messages", f"{where}.content must be a string or an array of text blocks")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _chat_tools(body: dict) -> dict:
    """Anthropic's tools and tool_choice -> chat's shapes, for structured.tool_plan."""
    tools = body.get("tools")
    out = {}
    if tools:
        if not isinstance(tools, list):
            raise bad_param("tools", "tools must be an array")
        out["tools"] = [_chat_tool(i, t) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad_param("tool_choice", 'tool_choice must be {"type": "auto" | "any" | "none"} or '
                        '{"type": "tool", "name": ...}')
    return out


def _chat_tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
        raise unsupported("tools", f"tools.{i}: only client tools {{name, description, input_schema}} are supported")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_param("tools", f"tools.{i}.input_schema: Field required (a JSON schema object)")
    fn = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _parallel(choice) -> bool:
    return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)


# ------------------------------------------------------------------ the message object

def usage(use: dict) -> dict:
    return {"input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
            "cache_read_input_tokens": use["prompt_tokens_details"]["cached_tokens"],
            "cache_creation_input_tokens": 0}


def stop_reason(g, served, finish_reason: str, last_ids) -> tuple:
    """-> (stop_reason, stop_sequence)"""
    if finish_reason == "stop":
        stops = g.params.stop
        if stops and not (last_ids and last_ids[-1] in served.eos_token_ids):
            return "stop_sequence", stops[0] if len(stops) == 1 else None
        return "end_turn", None
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish_reason, finish_reason), None


def _message(response_id: str, served, content: list, reason, sequence, use: dict) -> dict:
    return {"id": response_id, "type": "message", "role": "assistant", "model": served.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(use)}


def _whole_body(g, served, response_id, created, text, finish_reason, use, ids, logprobs) -> bytes:
    reason, sequence = stop_reason(g, served, finish_reason, ids)
    return orjson.dumps(_message(response_id, served, [{"type": "text", "text": text}], reason, sequence, use))


def _tool_blocks(content, calls: list) -> list:
    blocks = [{"type": "text", "text": content}] if content else []
    for call in calls:
        try:
            arguments = orjson.loads(call["function"]["arguments"])
        except orjson.JSONDecodeError:      # cut by max_tokens
            arguments = {}
        blocks.append({"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1),
                       "name": call["function"]["name"], "input": arguments})
    return blocks


def _tools_body(g, served, response_id, created, content, calls, finish_reason, use, timings) -> tuple:
    blocks = _tool_blocks(content, calls)
    reason, sequence = stop_reason(g, served, finish_reason, None)
    if not g.stream:
        return ((b"content-type", b"application/json"),), orjson.dumps(
            _message(response_id, served, blocks, reason, sequence, use))
    start = _message(response_id, served, [], None, None, use)
    start["usage"]["output_tokens"] = 0
    events = [_event("message_start", message=start)]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            events += [_event("content_block_start", index=index, content_block={"type": "text", "text": ""}),
                       _event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})]
        else:
            events += [_event("content_block_start", index=index, content_block=dict(block, input={})),
                       _event("content_block_delta", index=index, delta={
                           "type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()})]
        events.append(_event("content_block_stop", index=index))
    events += [_event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                      usage={"output_tokens": use["completion_tokens"]}, timings=timings),
               _event("message_stop")]
    return MessagesSse.response_headers, b"".join(events)


def _event(kind: str, **fields) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


_DELTA_PREFIX = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
_DELTA_SUFFIX = b"}}\n\n"
_PING = _event("ping")
_BLOCK_START = _event("content_block_start", index=0, content_block={"type": "text", "text": ""}) + _PING
_BLOCK_STOP = _event("content_block_stop", index=0)
_MESSAGE_STOP = _event("message_stop")


class MessagesSse:
    """The Messages event stream of one request (encoders._Stream's interface). A later
    token's event is constant bytes around its text (`text_parts`): the dispatcher splices it."""
    content_type = b"text/event-stream"
    response_headers = ((b"content-type", content_type), (b"cache-control", b"no-cache"))
    in_band_errors = False
    __slots__ = ("_g", "_served", "_id", "_num_prompt", "_started")

    def __init__(self, g, served, response_id: str, num_prompt: int):
        self._g, self._served, self._id, self._num_prompt = g, served, response_id, num_prompt
        self._started = False

    def text_parts(self) -> tuple:
        return _DELTA_PREFIX, _DELTA_SUFFIX

    def token(self, out) -> bytes:
        """Hot path: once per token."""
        return _DELTA_PREFIX + orjson.dumps(out.text) + _DELTA_SUFFIX

    def first_token(self, out) -> bytes:
        return self._open() + self.token(out)

    def _open(self) -> bytes:
        self._started = True
        start = _message(self._id, self._served, [], None, None,
                         {"prompt_tokens": self._num_prompt, "completion_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 0}})
        return _event("message_start", message=start) + _BLOCK_START

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        head = b"" if self._started else self._open()
        if error is not None:
            return head + _event("error", error={"type": "api_error", "message": f"the engine failed: {error}"})
        reason, sequence = stop_reason(self._g, self._served, finish_reason, out.token_ids)
        return head + _BLOCK_STOP + _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                           usage={"output_tokens": use["completion_tokens"],
                                                  "cache_read_input_tokens":
                                                      use["prompt_tokens_details"]["cached_tokens"]},
                                           timings=timings) + _MESSAGE_STOP

    def trailers(self, base: list, finish_reason: str, error: str | None) -> list:
        return base


def _encoder(g, served, response_id, created, index, num_prompt, headers):
    return MessagesSse(g, served, response_id, num_prompt)


MESSAGES = Route("messages", parse_messages, "msg_", "messages", _encoder, _whole_body, _tools_body, error_body,
                 chat=True)
