"""Request fields every API family checks the same way: the JSON body, a field's JSON type,
the sampling fields, token ids, unknown keys, and max_tokens against the context.

A field of the wrong type is a 400 naming it (`bad_param`); `SamplingParams` range-checks
and names the parameter; a key the route does not know goes to `on_unknown(name)` (logged
once by the app), or is a 400 naming it with --strict-params (`on_unknown` None).
"""

from functools import lru_cache

import orjson

from ...core.sampling_params import MAX_TOP_LOGPROBS, InvalidParameter, SamplingParams
from .errors import ApiError, bad_param, unsupported

MAX_STOP_STRINGS = 16
SPECULATIVE_KEYS = ("speculative", "num_speculative_tokens")   # tokenwire's own: core/speculative.py


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


def check_keys(body: dict, known: set, on_unknown) -> None:
    if body.keys() <= known:
        return
    for key in body:
        if key not in known:
            if on_unknown is None:
                raise unsupported(key, f"unknown or unsupported parameter {key!r} (the server runs with "
                                       "--strict-params)")
            on_unknown(key)


def opt(body: dict, name: str, kind: type, default):
    """body[name] when present and not null, checked to be of `kind` (bool is not an int here)."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float:
        ok = type(value) in (int, float)
    else:
        ok = type(value) is kind
    if not ok:
        raise bad_param(name, f"{name} must be {KIND_NAMES[kind]}, got {json_type(value)}")
    return float(value) if kind is float else value


KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               list: "an array", dict: "an object"}


def json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def sampling(body: dict, *, max_tokens, logprobs) -> SamplingParams:
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
    for name, kind in SAMPLING_FIELDS.items():      # only what the body sets: defaults stay the dataclass's
        if name in body:
            value = opt(body, name, kind, None)
            if value is not None:
                kwargs[name] = value
    stop_ids = body.get("stop_token_ids")
    if stop_ids:
        kwargs["stop_token_ids"] = tuple(token_ids(stop_ids, "stop_token_ids", allow_empty=True))
    try:
        return sampling_params_of(tuple(kwargs.items()))
    except InvalidParameter as exc:
        raise bad_param(exc.param, str(exc)) from None


@lru_cache(maxsize=256)
def sampling_params_of(fields: tuple) -> SamplingParams:
    """SamplingParams are immutable, and most requests share theirs (defaults, or a client's
    fixed settings): one made per distinct set of fields, not per request (~3 µs each).
    `fields` are (name, value) pairs whose types `_sampling` has checked, so equal keys
    mean equal parameters."""
    return SamplingParams(**dict(fields))


# body key -> JSON type, for the SamplingParams fields taken from the body as they are
SAMPLING_FIELDS = {"min_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                    "frequency_penalty": float, "presence_penalty": float, "seed": int, "ignore_eos": bool,
                    "skip_special_tokens": bool, "speculative": str, "num_speculative_tokens": int}


def token_ids(value, name: str, allow_empty: bool = False) -> list:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise bad_param(name, f"{name} must be an array of non-negative integers")
    if not value and not allow_empty:
        raise bad_param(name, f"{name} must not be empty")
    return value
