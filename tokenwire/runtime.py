"""The one place that assembles an engine: `EngineOptions` -> an `EngineCore` (not yet
started) and the `ModelCard` the front end serves it under.

    engine, card = build_engine(EngineOptions(model="out/stories260K", backend="cpu"))

Steps, each owned by one part: the model spec becomes an engine directory (engine_build:
an engine as is, a checkpoint built into the cache, the embedded default built on first
use), kernels/engine_format.py loads it (or the backend brings its own model, like the
mock), the backend's row in kernels.BACKENDS makes the executor, and the EngineCore is
built around it here with the scheduling options. `tokenwire serve`, `tokenwire.Server`,
the benchmarks and the tests all come through `build_engine`.
"""

import json
import logging
from pathlib import Path
from typing import NamedTuple, Optional

from .core.engine_core import EngineCore
from .core.model_card import ModelCard
from .core.options import DEFAULTS, EngineOptions
from .engine_build.resolve import resolve_model
from .kernels import backend
from .kernels.engine_format import load_engine
from .kernels.grammar import GrammarCompiler

log = logging.getLogger("tokenwire")


class BuiltEngine(NamedTuple):
    core: EngineCore                # not started: the caller starts it (or drives step() itself)
    card: ModelCard


def build_engine(options: EngineOptions = DEFAULTS, *, model=None) -> BuiltEngine:
    """Build the engine `options` describe. `model`: an already loaded engine directory
    (kernels/engine_format.Engine) to use instead of resolving `options.model`."""
    row = backend(options.backend)
    template = read_chat_template(options.chat_template) if options.chat_template else None
    if model is None:
        model = row.builtin_model(options) if row.builtin_model is not None else load_model(options.model)
    max_model_len = context_length(options.max_model_len, model.config.max_position_embeddings)
    executor = row.create_executor(model, options, max_model_len)
    core = EngineCore(executor, model.tokenizer, eos_token_ids=model.eos_token_ids, max_model_len=max_model_len,
                      max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
                      max_queued_requests=options.max_queued_requests,
                      enable_prefix_caching=options.enable_prefix_caching, response_cache_size=options.response_cache_size,
                      inline_step_ns=int(options.inline_step_us * 1000),
                      model_identity=f"{options.backend}:{model.name}:{getattr(model, 'path', '')}")
    card = ModelCard(name=options.served_model_name or model.name, description=model.description,
                     backend=options.backend, tokenizer=model.tokenizer, encode_prompt=model.encode_prompt,
                     bos_token_id=model.bos_token_id, add_bos=model.add_bos,
                     chat_template=template or model.chat_template, special_tokens=model.special_tokens,
                     max_model_len=max_model_len, supports_logprobs=row.samples_logprobs,
                     grammars=GrammarCompiler(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
                     if row.samples_constrained else None)
    return BuiltEngine(core, card)


def load_model(spec: Optional[str]):
    """A model spec (engine dir, checkpoint, hub name; None: the embedded default) -> loaded Engine."""
    return load_engine(resolve_model(spec, log=lambda line: log.info("%s", line)))


def context_length(requested: Optional[int], limit: int) -> int:
    if requested is not None and requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's {limit} positions")
    return requested or limit


def read_chat_template(path: str) -> str:
    """A Jinja template file, or a tokenizer_config.json's "chat_template" string."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {path!r}: {exc.strerror}") from None
    if path.endswith(".json"):
        try:
            return json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path!r} has no \"chat_template\" string") from None
    return text
