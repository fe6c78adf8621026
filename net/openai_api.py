"""Request bodies of the three generation routes, parsed (orjson) and validated into a
`GenerationRequest` with typed `core.sampling_params.SamplingParams`.

- `POST /v1/completions`       OpenAI completions
- `POST /v1/chat/completions`  OpenAI chat completions
- `POST /generate`             tokenwire's native stream (NDJSON or binary token ids)

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

from functools import lru_cache
from typing import NamedTuple

import orjson

from ..core.sampling_params import MAX_TOP_LOGPROBS, InvalidParameter, SamplingParams

from ..core.constraint import ConstraintSpec
from .errors import ApiError, bad_param, unsupported
from .structured import GUIDED_KEYS, REFUSED_GUIDED_KEYS, ToolPlan, constraint_spec, tool_plan

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16                        # n and best_of


class GenerationRequest(NamedTuple):
    """A validated generation request, before tokenization."""
    route: str                          # "completions" | "chat" | "generate"
    prompt: str | None                  # text prompt (completions, generate)
    prompt_token_ids: list | None       # pre-tokenized prompt (completions, generate)
    messages: list | None               # chat messages, for the chat template
    params: SamplingParams
    stream: bool
    include_usage: bool                 # stream_options.include_usage
    continuous_usage: bool              # stream_options.continuous_usage_stats: usage on every chunk
    model: str | None                   # as the client named it (checked against the served name)
    n: int = 1                          # choices returned
    best_of: int = 1                    # choices sampled (>= n; completions only, not streamed)
    constraint: ConstraintSpec | None = None    # the output must match it (response_format, guided_*, tools)
    constraint_param: str | None = None # the request field that asked for it: errors about it name this
    tools: ToolPlan | None = None       # chat with tools: how the output is read back
    template_tools: list | None = None  # the tools as the chat template receives them


def max_tokens_problem(max_tokens: int | None, num_prompt: int, max_model_len: int) -> str | None:
    """Why max_tokens cannot be served after a prompt of `num_prompt` tokens, naming both
    numbers (OpenAI and vLLM refuse it rather than finish early with "length"), or None. None
    also when the prompt alone fills the context: that is the engine's PromptTooLong (400
    context_length_exceeded) whatever max_tokens says, never a negative number of tokens left."""
    if max_tokens is None or num_prompt >= max_model_len or num_prompt + max_tokens <= max_model_len:
        return None
    num_left = max_model_len - num_prompt
    return (f"max_tokens is {max_tokens}, but the context leaves {num_left} tokens after the prompt "
            f"({max_model_len} tokens of context, {num_prompt} in the prompt); ask for at most {num_left}, "
            f"or leave max_tokens out to use the rest of the context")


def parse_json(body: bytes) -> dict:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "UTF-8" in str(exc) or "utf-8" in str(exc):
            raise ApiError(400, f"request body is not valid UTF-8: {exc}", code="invalid_encoding") from None
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


# ----------------------------------------------------------------- routes

_IGNORED = {"user", "nvext"}            # accepted and without effect
SPECULATIVE_KEYS = ("speculative", "num_speculative_tokens")   # tokenwire's own: core/speculative.py
_COMMON = _IGNORED | {"model", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "stream", "stream_options", "n", "logit_bias", *SPECULATIVE_KEYS,
           "response_format", "structured_outputs", *GUIDED_KEYS, *REFUSED_GUIDED_KEYS}
_COMPLETIONS_KEYS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                        "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"}
_GENERATE_KEYS = _IGNORED | {"prompt", "prompt_token_ids", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop",
                  "stop_token_ids", "ignore_eos", "skip_special_tokens", "model", *SPECULATIVE_KEYS,
                  "response_format", "structured_outputs", *GUIDED_KEYS, *REFUSED_GUIDED_KEYS}


def parse_completions(body: dict, on_unknown=None) -> GenerationRequest:
    _check_keys(body, _COMPLETIONS_KEYS, on_unknown)
    _check_common_unsupported(body)
    if _opt(body, "echo", bool, False):
        raise unsupported("echo", "echo=true is not supported")
    if _opt(body, "suffix", str, None):
        raise unsupported("suffix", "suffix (insertion) is not supported")
    prompt, prompt_ids = _prompt(body)
    logprobs = _opt(body, "logprobs", int, None)
    # max_tokens absent: the rest of the context (vLLM's choice; OpenAI's 16 would make a
    # client that leaves it out get a 400 for a number it never sent, near the context's end)
    params = _sampling(body, max_tokens=_opt(body, "max_tokens", int, None), logprobs=logprobs)
    stream, include_usage, continuous = _stream(body)
    n = _num_choices(body)
    best_of = _opt(body, "best_of", int, n)
    if not n <= best_of <= MAX_CHOICES:
        raise bad_param("best_of", f"best_of must be in [n, {MAX_CHOICES}] (n = {n}), got {best_of}")
    if best_of > n and stream:
        raise bad_param("best_of", "best_of > n cannot be streamed: the best choices are known only at the end")
    constraint, constraint_param = constraint_spec(body)
    _one_choice_if_read_back(n, best_of, constraint_param)
    return GenerationRequest("completions", prompt, prompt_ids, None, params, stream, include_usage, continuous,
                             _opt(body, "model", str, None), n, best_of, constraint=constraint,
                             constraint_param=constraint_param)


def parse_chat(body: dict, on_unknown=None) -> GenerationRequest:
    _check_keys(body, _CHAT_KEYS, on_unknown)
    _check_common_unsupported(body)
    plan, template_tools, tool_constraint = tool_plan(body, _opt(body, "parallel_tool_calls", bool, True))
    constraint, constraint_param = constraint_spec(body)
    if tool_constraint is not None:
        if constraint is not None:
            raise bad_param("tool_choice", "tool_choice required or a named function constrains the output "
                            f"already; drop {constraint_param}")
        constraint, constraint_param = tool_constraint, "tools"
    messages = _messages(body)
    max_tokens = _opt(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int, None)
    want_logprobs = _opt(body, "logprobs", bool, False)
    top = _opt(body, "top_logprobs", int, None)
    if top is not None and not want_logprobs:
        raise bad_param("top_logprobs", "top_logprobs requires logprobs=true")
    params = _sampling(body, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None)
    stream, include_usage, continuous = _stream(body)
    n = _num_choices(body)
    _one_choice_if_read_back(n, n, constraint_param or ("tools" if plan is not None else None))
    return GenerationRequest("chat", None, None, messages, params, stream, include_usage, continuous,
                             _opt(body, "model", str, None), n, n, constraint=constraint,
                             constraint_param=constraint_param, tools=plan, template_tools=template_tools)


def parse_generate(body: dict, on_unknown=None) -> GenerationRequest:
    _check_keys(body, _GENERATE_KEYS, on_unknown)
    has_text, has_ids = body.get("prompt") is not None, body.get("prompt_token_ids") is not None
    if has_text == has_ids:
        raise bad_param("prompt", "give exactly one of prompt (a string) and prompt_token_ids (a list of ints)")
    prompt = _opt(body, "prompt", str, None)
    prompt_ids = _token_ids(body["prompt_token_ids"], "prompt_token_ids") if has_ids else None
    params = _sampling(body, max_tokens=_opt(body, "max_tokens", int, None), logprobs=None)
    constraint, constraint_param = constraint_spec(body)
    return GenerationRequest("generate", prompt, prompt_ids, None, params, True, True, False,
                             _opt(body, "model", str, None), constraint=constraint, constraint_param=constraint_param)


# ---------------------------------------------------------------- helpers

def _check_keys(body: dict, known: set, on_unknown) -> None:
    if body.keys() <= known:
        return
    for key in body:
        if key not in known:
            if on_unknown is None:
                raise unsupported(key, f"unknown or unsupported parameter {key!r} (the server runs with "
                                       "--strict-params)")
            on_unknown(key)


def _one_choice_if_read_back(n: int, best_of: int, constrained_by: str | None) -> None:
    """n / best_of > 1 with an output constraint, or with tools read back as calls (tool_choice
    other than "none"), is a 400: choices carry no grammar and no tool read-back."""
    if best_of > 1 and constrained_by is not None:
        raise unsupported("n" if n > 1 else "best_of", f"n > 1 (or best_of > 1) with {constrained_by} is not "
                          "supported; send one request per choice")


def _num_choices(body: dict) -> int:
    n = _opt(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_param("n", f"n must be in [1, {MAX_CHOICES}], got {n}")
    return n


def _check_common_unsupported(body: dict) -> None:
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias is not supported")


def _opt(body: dict, name: str, kind: type, default):
    """body[name] when present and not null, checked to be of `kind` (bool is not an int here)."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float:
        ok = type(value) in (int, float)
    else:
        ok = type(value) is kind
    if not ok:
        raise bad_param(name, f"{name} must be {_KIND_NAMES[kind]}, got {_json_type(value)}")
    return float(value) if kind is float else value


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               list: "an array", dict: "an object"}


def _json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _sampling(body: dict, *, max_tokens, logprobs) -> SamplingParams:
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        stop = tuple(stop)
    else:
        raise bad_param("stop", "stop must be a string or an array of strings")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if "top_logprobs" in body else "logprobs"
        raise bad_param(name, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    kwargs = {"max_tokens": max_tokens, "stop": stop, "logprobs": logprobs}
    for name, kind in _SAMPLING_FIELDS.items():      # only what the body sets: defaults stay the dataclass's
        if name in body:
            value = _opt(body, name, kind, None)
            if value is not None:
                kwargs[name] = value
    stop_ids = body.get("stop_token_ids")
    if stop_ids:
        kwargs["stop_token_ids"] = tuple(_token_ids(stop_ids, "stop_token_ids", allow_empty=True))
    try:
        return _sampling_params(tuple(kwargs.items()))
    except InvalidParameter as exc:
        raise bad_param(exc.param, str(exc)) from None


@lru_cache(maxsize=256)
def _sampling_params(fields: tuple) -> SamplingParams:
    """SamplingParams are immutable, and most requests share theirs (defaults, or a client's
    fixed settings): one made per distinct set of fields, not per request (~3 µs each).
    `fields` are (name, value) pairs whose types `_sampling` has checked, so equal keys
    mean equal parameters."""
    return SamplingParams(**dict(fields))


# body key -> JSON type, for the SamplingParams fields taken from the body as they are
_SAMPLING_FIELDS = {"min_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                    "frequency_penalty": float, "presence_penalty": float, "seed": int, "ignore_eos": bool,
                    "skip_special_tokens": bool, "speculative": str, "num_speculative_tokens": int}


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """-> (stream, include_usage, continuous_usage_stats)"""
    stream = _opt(body, "stream", bool, False)
    options = _opt(body, "stream_options", dict, None)
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
        return None, _token_ids(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        inner = prompt[0]
        if isinstance(inner, str):
            return inner, None
        if isinstance(inner, list):
            return None, _token_ids(inner, "prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported("prompt", f"batched prompts are not supported ({len(prompt)} given); send one request each")
    raise bad_param("prompt", "prompt must be a string, an array of token ids, or an array holding one of those")


def _token_ids(value, name: str, allow_empty: bool = False) -> list:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise bad_param(name, f"{name} must be an array of non-negative integers")
    if not value and not allow_empty:
        raise bad_param(name, f"{name} must not be empty")
    return value


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _messages(body: dict) -> list:
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
