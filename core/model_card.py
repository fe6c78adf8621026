"""What the front end needs to know about the model an engine serves.

tokenwire/runtime.py fills one `ModelCard` when it builds an engine (from the engine
directory, or from a backend that brings its own model, like the mock); net/ turns it into
its routes' `ModelInfo` (the fast prompt encoder, the compiled chat template). Plain data:
no tensor library, no file access.
"""

from typing import Callable, NamedTuple, Optional


class ModelCard(NamedTuple):
    name: str                               # the id in /v1/models and every response
    description: str                        # one line for /v1/models
    backend: str                            # the kernels.BACKENDS row that runs it
    tokenizer: object                       # tokenizers.Tokenizer
    encode_prompt: Callable[[str], list]    # completion prompt -> ids, with the model's BOS rule
    bos_token_id: Optional[int]
    add_bos: bool                           # encode_prompt puts bos_token_id in front
    chat_template: Optional[str]            # Jinja source (the model's or the override); None: no chat route
    special_tokens: dict                    # bos_token, eos_token, ... as the chat template sees them
    max_model_len: int
    supports_logprobs: bool = True          # False for the mock engine, which samples nothing
    grammars: object = None                 # kernels/grammar.GrammarCompiler (compile / cached a ConstraintSpec);
                                            # None: the backend does no constrained decoding
    speculative_methods: tuple = ()         # what a request's `speculative` may name ("off" always)
