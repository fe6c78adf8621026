"""Errors core/ raises across its boundary; net/ maps each to an HTTP status.

- `QueueFull`: too many requests waiting for the engine (server -> 429).
- `PromptTooLong`: the prompt leaves no room to generate within `max_model_len` (-> 400, with the numbers).
- `InvalidRequest`: anything else wrong with a submitted request (empty prompt, token id
  outside the vocabulary, duplicate id) (-> 400).
- `IllegalTransition`: a request lifecycle transition that is not in the table
  (core/request.py). Always a bug in core, never the client's fault.
- `BlockAccountingError`: a KV block freed twice or unknown (core/block_manager.py). Also a bug.
- `BuildError`: a checkpoint, tokenizer or engine directory that cannot be used (engine_build/
  and the engine reader in kernels/). Every message names the file (or hub name) and the
  problem, so the CLI prints one line and exits 2 instead of a traceback from deep inside
  numpy or json.
"""

from pathlib import Path
from typing import Union


class QueueFull(RuntimeError):
    def __init__(self, num_queued: int, max_queued: int):
        super().__init__(f"the engine queue is full: {num_queued} requests waiting, the limit is {max_queued}")
        self.num_queued = num_queued
        self.max_queued = max_queued


class PromptTooLong(ValueError):
    def __init__(self, num_prompt_tokens: int, max_model_len: int):
        super().__init__(f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} "
                         f"tokens, so a prompt may have at most {max_model_len - 1}")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class InvalidRequest(ValueError):
    pass


class IllegalTransition(RuntimeError):
    pass


class BlockAccountingError(RuntimeError):
    pass


class BuildError(Exception):
    """A checkpoint, tokenizer or engine directory that cannot be used, and why."""

    def __init__(self, source: Union[str, Path, None], problem: str):
        self.source = None if source is None else str(source)
        self.problem = problem
        super().__init__(problem if source is None else f"{source}: {problem}")
