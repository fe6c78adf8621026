"""vLLM's token routes, `POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

/tokenize takes `prompt` (with the model's BOS rule when `add_special_tokens`, default
true, as a completion prompt is tokenized) or `messages` (through the chat template, with
`add_generation_prompt` default true; `add_special_tokens` default false, since the
template writes its own), `tools` for the template, `return_token_strs`; it answers
`{"count", "max_model_len", "tokens", "token_strs"}`. /detokenize takes `tokens` and
answers `{"prompt"}`, special tokens included. Errors in OpenAI's shape.
"""

from typing import NamedTuple

import orjson

from .errors import bad_param
from .fields import check_keys, opt, token_ids
from .openai import chat_messages

_TOKENIZE_KEYS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                  "tools", "continue_final_message", "chat_template_kwargs"}
_DETOKENIZE_KEYS = {"model", "tokens"}


class TokenizeRequest(NamedTuple):
    model: str | None
    prompt: str | None                  # a completion prompt, or
    messages: list | None               # chat messages for the template
    tools: list | None                  # the template's tools
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize(body: dict, on_unknown=None) -> TokenizeRequest:
    check_keys(body, _TOKENIZE_KEYS, on_unknown)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise bad_param("prompt", "give exactly one of prompt (a string) and messages (chat messages)")
    chat = body.get("messages") is not None
    messages = chat_messages(body) if chat else None
    tools = opt(body, "tools", list, None)
    if opt(body, "continue_final_message", bool, False):
        raise bad_param("continue_final_message", "continue_final_message is not supported")
    return TokenizeRequest(opt(body, "model", str, None), None if chat else opt(body, "prompt", str, ""), messages,
                           tools, opt(body, "add_special_tokens", bool, not chat),
                           opt(body, "add_generation_prompt", bool, True), opt(body, "return_token_strs", bool, False))


def parse_detokenize(body: dict, on_unknown, vocab_size: int) -> tuple:
    """-> (model or None, token ids), every id checked against the vocabulary."""
    check_keys(body, _DETOKENIZE_KEYS, on_unknown)
    if body.get("tokens") is None:
        raise bad_param("tokens", "tokens is required (an array of token ids)")
    ids = token_ids(body["tokens"], "tokens", allow_empty=True)
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise bad_param("tokens", f"token id {bad[0]} is outside the vocabulary ({vocab_size} tokens)")
    return opt(body, "model", str, None), ids


def tokenize_body(ids: list, max_model_len: int, tokenizer, return_token_strs: bool) -> bytes:
    strs = [tokenizer.id_to_token(t) for t in ids] if return_token_strs else None
    return orjson.dumps({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs})


def detokenize_body(tokenizer, ids: list) -> bytes:
    return orjson.dumps({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})
