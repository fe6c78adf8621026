"""What the routes know about the served model: `ModelInfo`, made once from the engine's
`ModelCard` (core/model_card.py) when the model is loaded.

The card is plain data; here it becomes what the routes call per request: the prompt
encoder (net/api/prompt_encoder.py's piece cache when the tokenizer allows, checked against the
card's own `encode_prompt`) and the compiled chat template.
"""

import logging
import time
from typing import Callable, NamedTuple

from ...core.model_card import ModelCard
from .chat_template import ChatTemplate
from .prompt_encoder import piece_encoder
from .structured import tool_family

log = logging.getLogger("tokenwire.net")


class ModelInfo(NamedTuple):
    """What the routes need to know about the served model."""
    name: str                               # the id in /v1/models and in every response
    tokenizer: object                       # tokenizers.Tokenizer
    encode: Callable[[str], list]           # completion prompt -> ids, with the model's BOS rule
    chat_template: ChatTemplate | None
    max_model_len: int
    created: int                            # unix seconds, for /v1/models
    description: str                        # shown in /v1/models ("owned_by" stays "tokenwire")
    supports_logprobs: bool = True          # False for the mock engine, which samples nothing
    grammars: object = None                 # the card's grammar compiler; None: no constrained decoding
    backend: str = ""
    tool_family: str = "hermes"             # the tool-call markup `tool_choice=auto` parses (structured.py)
    speculative_methods: tuple = ()         # a request's `speculative` may name these, or "off"


def model_info(card: ModelCard) -> ModelInfo:
    template = ChatTemplate(card.chat_template, card.special_tokens) if card.chat_template else None
    return ModelInfo(name=card.name, tokenizer=card.tokenizer, encode=prompt_encoder(card), chat_template=template,
                     max_model_len=card.max_model_len, created=int(time.time()), description=card.description,
                     supports_logprobs=card.supports_logprobs, grammars=card.grammars, backend=card.backend,
                     tool_family=tool_family(card.chat_template), speculative_methods=card.speculative_methods)


def prompt_encoder(card: ModelCard) -> Callable[[str], list]:
    """card.encode_prompt, through prompt_encoder.PieceEncoder when the tokenizer allows:
    the model's BOS rule in front of the fast ids, checked against encode_prompt once here."""
    fast = piece_encoder(card.tokenizer)
    if fast is None:
        return card.encode_prompt
    bos = [card.bos_token_id] if card.add_bos and card.bos_token_id is not None else []

    def encode(text: str) -> list:
        return bos + fast.encode(text)
    probe = "Hello, world: 12 tokens' worth of text\n"
    if encode(probe) != card.encode_prompt(probe):
        log.warning("fast prompt encoding disagrees with the model's encode_prompt; not used")
        return card.encode_prompt
    return encode
