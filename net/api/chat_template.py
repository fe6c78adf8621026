"""Chat templates from tokenizer_config.json, rendered with jinja2 the way transformers does.

transformers' conventions, kept so a model's template renders here exactly as it does there:
a sandboxed environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, `raise_exception(msg)` and `strftime_now(fmt)` as globals, a `tojson` filter
that keeps non-ASCII text (`ensure_ascii=False`), and the variables `messages`,
`add_generation_prompt`, `tools` (the request's, as OpenAI sends them: {"type": "function",
"function": {...}}, which is what transformers' apply_chat_template(tools=...) passes),
`bos_token`, `eos_token` (plus the other special tokens the config names). The rendered text already holds the template's special tokens, so it is
tokenized without adding any more (transformers does the same).
"""

import datetime
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

from .errors import ApiError


class TemplateRaised(Exception):
    """`raise_exception(...)` inside a template: the messages break the template's rules."""


def _raise_exception(message):
    raise TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _token_text(token) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict | None = None):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc} (line {exc.lineno})") from None
        self.source = source
        self.special_tokens = {name: _token_text(tok) or "" for name, tok in (special_tokens or {}).items()}
        self.special_tokens.setdefault("bos_token", "")
        self.special_tokens.setdefault("eos_token", "")

    def render(self, messages: list, add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The prompt text for `messages`; a template's own refusal becomes a 400."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, documents=None, **self.special_tokens)
        except TemplateRaised as exc:
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}",
                           param="messages", code="invalid_messages") from None
        except jinja2.TemplateError as exc:
            raise ApiError(400, f"the model's chat template failed on these messages: {exc}",
                           param="messages", code="invalid_messages") from None
