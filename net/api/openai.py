"""The OpenAI family's classic routes: request bodies parsed (orjson) and validated into a
`GenerationRequest` with typed `core.sampling_params.SamplingParams`, and their rows
(`COMPLETIONS`, `CHAT`: SSE encoders from net/writer/encoders.py, whole bodies, tool calls read back).

- `POST /v1/completions`       OpenAI completions
- `POST /v1/chat/completions`  OpenAI chat completions

Every parameter is type-checked here and range-checked by `SamplingParams`; a parameter
this server knows but does not implement (echo, logit_bias, ...) is a 400
naming it. A key the route does not know at all (clients written for vLLM send their own)
goes to the caller's `on_unknown(name)` (the app logs each name once and goes on), or is a
400 naming it when there is no `on_unknown` (`--strict-params`). Accepted no-ops: `user`
(an end-user id for abuse tracking) and vendor extension objects such as NVIDIA's `nvext`.

`n` (both OpenAI routes, 1..MAX_CHOICES) asks for n choices; `best_of` (completions, n..
MAX_CHOICES, not streamed) samples best_of and returns the n with the highest mean token
log-probability. Choice i of a seeded request samples with seed (seed + i) mod 2**64
(core/sampling_params.choice_params), so it equals a single request with that seed.
"""

import orjson

from ..writer import encoders
from .errors import bad_param, unsupported
from .fields import SPECULATIVE_KEYS, check_keys, opt, sampling, token_ids
from .route import GenerationRequest, Route
from .structured import (
    GUIDED_KEYS,
    REFUSED_GUIDED_KEYS,
    constraint_spec,
    new_call_id,
    tool_plan,
    tool_response_chunks,
)

MAX_CHOICES = 16                        # n and best_of


# ----------------------------------------------------------------- routes

_IGNORED = {"user", "nvext"}            # accepted and without effect
_COMMON = _IGNORED | {"model", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "stream", "stream_options", "n", "logit_bias", *SPECULATIVE_KEYS,
           "response_format", "structured_outputs", *GUIDED_KEYS, *REFUSED_GUIDED_KEYS}
_COMPLETIONS_KEYS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                        "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"}

def parse_completions(body: dict, on_unknown=None) -> GenerationRequest:
    check_keys(body, _COMPLETIONS_KEYS, on_unknown)
    _check_common_unsupported(body)
    if opt(body, "echo", bool, False):
        raise unsupported("echo", "echo=true is not supported")
    if opt(body, "suffix", str, None):
        raise unsupported("suffix", "suffix (insertion) is not supported")
    prompt, prompt_ids = _prompt(body)
    logprobs = opt(body, "logprobs", int, None)
    # max_tokens absent: the rest of the context (vLLM's choice; OpenAI's 16 would make a
    # client that leaves it out get a 400 for a number it never sent, near the context's end)
    params = sampling(body, max_tokens=opt(body, "max_tokens", int, None), logprobs=logprobs)
    stream, include_usage, continuous = _stream(body)
    n = _num_choices(body)
    best_of = opt(body, "best_of", int, n)
    if not n <= best_of <= MAX_CHOICES:
        raise bad_param("best_of", f"best_of must be in [n, {MAX_CHOICES}] (n = {n}), got {best_of}")
    if best_of > n and stream:
        raise bad_param("best_of", "best_of > n cannot be streamed: the best choices are known only at the end")
    constraint, constraint_param = constraint_spec(body)
    _one_choice_if_read_back(n, best_of, constraint_param)
    return GenerationRequest(COMPLETIONS, prompt, prompt_ids, None, params, stream, include_usage, continuous,
                             opt(body, "model", str, None), n, best_of, constraint=constraint,
                             constraint_param=constraint_param)


def parse_chat(body: dict, on_unknown=None) -> GenerationRequest:
    check_keys(body, _CHAT_KEYS, on_unknown)
    _check_common_unsupported(body)
    plan, template_tools, tool_constraint = tool_plan(body, opt(body, "parallel_tool_calls", bool, True))
    constraint, constraint_param = constraint_spec(body)
    if tool_constraint is not None:
        if constraint is not None:
            raise bad_param("tool_choice", "tool_choice required or a named function constrains the output "
                            f"already; drop {constraint_param}")
        constraint, constraint_param = tool_constraint, "tools"
    messages = chat_messages(body)
    max_tokens = opt(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = opt(body, "max_tokens", int, None)
    want_logprobs = opt(body, "logprobs", bool, False)
    top = opt(body, "top_logprobs", int, None)
    if top is not None and not want_logprobs:
        raise bad_param("top_logprobs", "top_logprobs requires logprobs=true")
    params = sampling(body, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None)
    stream, include_usage, continuous = _stream(body)
    n = _num_choices(body)
    _one_choice_if_read_back(n, n, constraint_param or ("tools" if plan is not None else None))
    return GenerationRequest(CHAT, None, None, messages, params, stream, include_usage, continuous,
                             opt(body, "model", str, None), n, n, constraint=constraint,
                             constraint_param=constraint_param, tools=plan, template_tools=template_tools)


# ---------------------------------------------------------------- helpers

def _one_choice_if_read_back(n: int, best_of: int, constrained_by: str | None) -> None:
    """n / best_of > 1 with an output constraint, or with tools read back as calls (tool_choice
    other than "none"), is a 400: choices carry no grammar and no tool read-back."""
    if best_of > 1 and constrained_by is not None:
        raise unsupported("n" if n > 1 else "best_of", f"n > 1 (or best_of > 1) with {constrained_by} is not "
                          "supported; send one request per choice")


def _num_choices(body: dict) -> int:
    n = opt(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_param("n", f"n must be in [1, {MAX_CHOICES}], got {n}")
    return n


def _check_common_unsupported(body: dict) -> None:
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias is not supported")


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """-> (stream, include_usage, continuous_usage_stats)"""
    stream = opt(body, "stream", bool, False)
    options = opt(body, "stream_options", dict, None)
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_param("stream_options", "stream_options is only allowed with stream=true")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise unsupported("stream_options", f"unknown stream_options key {key!r}")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key, False)
        if type(value) is not bool:
            raise bad_param("stream_options", f"stream_options.{key} must be a boolean")
        flags.append(value)
    return stream, flags[0], flags[1]


def _prompt(body: dict) -> tuple[str | None, list | None]:
    """OpenAI allows a string, a token list, or a batch of either; batches of more than one are refused."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_param("prompt", "prompt is required")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return None, token_ids(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        inner = prompt[0]
        if isinstance(inner, str):
            return inner, None
        if isinstance(inner, list):
            return None, token_ids(inner, "prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported("prompt", f"batched prompts are not supported ({len(prompt)} given); send one request each")
    raise bad_param("prompt", "prompt must be a string, an array of token ids, or an array holding one of those")


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def chat_messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "messages must be a non-empty array of {role, content} objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_param("messages", f"{where} must be an object")
    role = m.get("role")
    if role not in _ROLES:
        raise bad_param("messages", f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(where, j, p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise bad_param("messages", f"{where}.content must be a string or an array of text parts")
    out = {"role": role, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if m.get("tool_calls"):
        if role != "assistant" or not isinstance(m["tool_calls"], list):
            raise bad_param("messages", f"{where}.tool_calls must be an array on an assistant message")
        out["tool_calls"] = [_tool_call(where, j, c) for j, c in enumerate(m["tool_calls"])]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_param("messages", f"{where}.tool_call_id is required on a tool message")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _tool_call(where: str, j: int, call) -> dict:
    """An earlier turn's call, as transformers' templates read it: arguments as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise bad_param("messages", f"{where}.tool_calls[{j}] must be {{id, type: function, "
                        "function: {name, arguments (a JSON string)}}")
    try:
        arguments = orjson.loads(fn["arguments"])
    except orjson.JSONDecodeError:
        raise bad_param("messages", f"{where}.tool_calls[{j}].function.arguments is not valid JSON") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _text_part(where: str, j: int, part) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise unsupported("messages", f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
    return part["text"]


# ------------------------------------------------------------------ rows

def _completions_encoder(g, served, response_id, created, index, num_prompt, headers):
    return encoders.CompletionSse(response_id, created, served.model, g.include_usage, served.token_text, index,
                                  num_prompt if g.continuous_usage else None)


def _chat_encoder(g, served, response_id, created, index, num_prompt, headers):
    if g.tools is not None:         # a named function: its arguments, token by token
        return encoders.ChatToolArgumentsSse(response_id, created, served.model, g.include_usage, served.token_text,
                                             new_call_id(), g.tools.names[0])
    return encoders.ChatSse(response_id, created, served.model, g.include_usage, served.token_text, index,
                            num_prompt if g.continuous_usage else None)


def _completions_body(g, served, response_id, created, text, finish_reason, use, ids, logprobs) -> bytes:
    lps = encoders.completion_logprobs(ids, logprobs, served.token_text) if logprobs is not None else None
    return encoders.completion_body(response_id, created, served.model, text, finish_reason, use, lps)


def _chat_body(g, served, response_id, created, text, finish_reason, use, ids, logprobs) -> bytes:
    lps = encoders.chat_logprobs(ids, logprobs, served.token_text) if logprobs is not None else None
    return encoders.chat_body(response_id, created, served.model, text, finish_reason, use, lps)


def _chat_tools_body(g, served, response_id, created, content, calls, finish_reason, use, timings) -> tuple:
    """A chat completion with tools read back as OpenAI tool calls: a whole body, or one SSE
    body when the client asked for a stream."""
    if g.stream:
        fields = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": served.model}
        body = tool_response_chunks(fields, content, calls, finish_reason, use if g.include_usage else None, timings)
        return encoders.ChatSse.response_headers, body
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    body = orjson.dumps({"id": response_id, "object": "chat.completion", "created": created, "model": served.model,
                         "usage": use, "choices": [{"index": 0, "message": message, "logprobs": None,
                                                    "finish_reason": finish_reason}]})
    return ((b"content-type", b"application/json"),), body


COMPLETIONS = Route("completions", parse_completions, "cmpl-", "prompt", _completions_encoder, _completions_body,
                    allows_token_ids=True)
CHAT = Route("chat", parse_chat, "chatcmpl-", "messages", _chat_encoder, _chat_body, _chat_tools_body, chat=True,
             streams_named_tool=True)
