"""The one place that assembles an engine: `EngineOptions` -> an `EngineCore` (not yet
started) and the `ModelCard` the front end serves it under.

    engine, card = build_engine(EngineOptions(model="out/stories260K", backend="cpu"))

Steps, each owned by one part: the model spec becomes an engine directory (engine_build:
an engine as is, a checkpoint built into the cache, the embedded default built on first
use), kernels/engine_format.py loads it (or the backend brings its own model, like the
mock), the backend's row in kernels.BACKENDS makes the executor, and the EngineCore is
built around it here with the scheduling options. `tokenwire serve`, `tokenwire.Server`,
the benchmarks and the tests all come through `build_engine`.

A server loads `build_warm_engine(options)`: `build_engine`, then, unless
`options.warm_up` is off, `warm_up`: the paths a first request takes (a prefill, a decode
step, greedy and sampled rows with and without a grammar, the grammar engine's tokenizer,
the prompt encoder) run through the engine's own EngineCore and executor before /health
turns 200, and leave no trace (EngineCore.warm_up; the grammar cache is left as it was).
What it saves is measured by `tokenwire bench cold-start` (bench/cold_start.py).
"""

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Optional

from .core.constraint import ConstraintSpec
from .core.draft import DraftProposer
from .core.engine_core import EngineCore
from .core.model_card import ModelCard
from .core.options import DEFAULTS, EngineOptions
from .core.outputs import FINISH_ERROR
from .core.sampling_params import SamplingParams
from .core.speculative import Speculator
from .engine_build.resolve import resolve_model
from .kernels import backend
from .kernels.engine_format import load_engine
from .kernels.grammar import MISSING as GRAMMARS_MISSING
from .kernels.grammar import GrammarCompiler

log = logging.getLogger("tokenwire")


class BuiltEngine(NamedTuple):
    core: EngineCore                # not started: the caller starts it (or drives step() itself)
    card: ModelCard


def build_engine(options: EngineOptions = DEFAULTS, *, model=None) -> BuiltEngine:
    """Build the engine `options` describe. `model`: an already loaded engine directory
    (kernels/engine_format.Engine) to use instead of resolving `options.model`."""
    row = backend(options.backend)
    if model is None:
        model = load_backend_model(options, row)
    if row.samples_constrained and GRAMMARS_MISSING:
        log.warning("no constrained decoding on this server (a constrained request is a 400): %s", GRAMMARS_MISSING)
    max_model_len = context_length(options.max_model_len, model.config.max_position_embeddings)
    executor = row.create_executor(model, options, max_model_len)
    speculator = build_speculator(options, row, model, max_model_len, getattr(executor, "max_sample_rows", None))
    core = EngineCore(executor, model.tokenizer, eos_token_ids=model.eos_token_ids, max_model_len=max_model_len,
                      max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
                      prefill_cap=options.prefill_cap, max_queued_requests=options.max_queued_requests,
                      enable_prefix_caching=options.enable_prefix_caching, response_cache_size=options.response_cache_size,
                      inline_step_ns=int(options.inline_step_us * 1000), overlap=options.overlap, speculator=speculator,
                      model_identity=f"{options.backend}:{model.name}:{getattr(model, 'path', '')}")
    methods = tuple(speculator.proposers) if speculator is not None else ()
    return BuiltEngine(core, build_card(options, row, model, max_model_len, methods))


def load_backend_model(options: EngineOptions, row):
    """The model `options` name, as backend `row` serves it: its own (the mock's) or an engine directory."""
    return row.builtin_model(options) if row.builtin_model is not None else load_model(options.model)


def build_card(options: EngineOptions, row, model, max_model_len: int, speculative_methods: tuple) -> ModelCard:
    """What the front end serves `model` under (`build_engine`; an engine process's front end,
    tokenwire/engine_process.py, builds it beside the process's engine)."""
    template = read_chat_template(options.chat_template) if options.chat_template else None
    return ModelCard(name=options.served_model_name or model.name, description=model.description,
                     backend=options.backend, tokenizer=model.tokenizer, encode_prompt=model.encode_prompt,
                     bos_token_id=model.bos_token_id, add_bos=model.add_bos,
                     chat_template=template or model.chat_template, special_tokens=model.special_tokens,
                     max_model_len=max_model_len, supports_logprobs=row.samples_logprobs,
                     grammars=GrammarCompiler(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
                     if row.samples_constrained and not GRAMMARS_MISSING else None,
                     speculative_methods=speculative_methods)


def build_speculator(options: EngineOptions, row, model, max_model_len: int,
                     max_rows: Optional[int] = None) -> Optional[Speculator]:
    """Speculative decoding for backends that verify proposed rows (core/speculative.py): always
    there on them (a request may ask for it while the server's default is off), with the draft
    model when one is named. None on the others, which refuse --speculative."""
    if not row.speculates:
        if options.speculative != "off" or options.speculative_model:
            raise ValueError(f"--speculative {options.speculative}: the {options.backend} backend does not verify "
                             f"speculated tokens (the cpu, reference and cuda backends do)")
        return None
    draft = None
    if options.speculative_model:
        draft_model = load_model(options.speculative_model)
        check_same_tokenizer(model, draft_model)
        draft_len = min(max_model_len, draft_model.config.max_position_embeddings)
        draft_options = replace(options, num_kv_blocks=None)
        draft = DraftProposer(row.create_executor(draft_model, draft_options, draft_len), draft_len)
        log.info("speculative decoding: draft model %s", draft_model.name)
    return Speculator(options.speculative, options.num_speculative_tokens, draft, max_rows)


def check_same_tokenizer(model, draft_model) -> None:
    """A draft proposes token ids: they must mean what they mean to the target."""
    if (model.config.vocab_size != draft_model.config.vocab_size
            or model.tokenizer.get_vocab() != draft_model.tokenizer.get_vocab()):
        raise ValueError(f"the draft model {draft_model.name!r} does not share the tokenizer of {model.name!r} "
                         f"(vocabularies of {draft_model.config.vocab_size} and {model.config.vocab_size} ids)")


WARM_UP_PROMPT = "Once upon a time"                # any short text: every tokenizer encodes it
WARM_UP_SPEC = ConstraintSpec("json_object", "")    # compiles in milliseconds at any vocabulary size
# each request: a prefill and one decode step; greedy rows take the fused-argmax path, sampled
# ones the penalties / top-k / top-p path (and logprobs, where the backend computes them)
WARM_UP_GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
WARM_UP_SAMPLED = SamplingParams(max_tokens=2, temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1,
                                 seed=0, ignore_eos=True)


class WarmUp(NamedTuple):
    """What `warm_up` ran."""
    seconds: float                      # the whole warm-up, grammar compile included
    num_requests: int                   # requests run through the engine
    errors: list                        # list[str]: why warm-up requests failed (none, normally)


def build_warm_engine(options: EngineOptions = DEFAULTS) -> BuiltEngine:
    """What a server loads: `build_engine(options)`, warmed up unless `options.warm_up` is False."""
    engine = build_engine(options)
    if options.warm_up:
        warm_up(engine)
    return engine


def warm_up(engine: BuiltEngine) -> WarmUp:
    """Run every path a first request takes through `engine` (not started yet), so that the
    first request served is as fast as the fifth: the KV cache's and the scratch buffers'
    first-touch page faults, the executor's thread pool, sampling with and without a grammar,
    the grammar engine's tokenizer (built by the first compile), the tokenizer's first call.
    EngineCore.warm_up forgets the requests; the compiled grammar is dropped from the cache.
    A failed warm-up request is a WARNING naming the reason (the server still starts). Logs
    one line with the time it took."""
    start = time.perf_counter()
    core, card = engine
    prompt = card.encode_prompt(WARM_UP_PROMPT)[:max(1, card.max_model_len - 3)]
    sampled = replace(WARM_UP_SAMPLED, logprobs=1) if card.supports_logprobs else WARM_UP_SAMPLED
    params, constraints = [WARM_UP_GREEDY, sampled], [None, None]
    if card.grammars is not None:           # one batch: the constrained rows beside the plain ones
        compiled = warm_up_grammars(card.grammars)
        params, constraints = params * 2, constraints + [compiled.constraint(), compiled.constraint()]
    finals = core.warm_up(prompt, params, constraints)
    errors = [out.error for out in finals if out.finish_reason == FINISH_ERROR]
    result = WarmUp(time.perf_counter() - start, len(finals), errors)
    for error in errors:
        log.warning("warm-up: a request failed in the engine: %s", error)
    log.info("warm-up: %d requests (prefill, decode; greedy and sampled%s) in %.0f ms", result.num_requests,
             ", with and without a grammar" if card.grammars is not None else "", result.seconds * 1000)
    return result


def warm_up_grammars(grammars: GrammarCompiler):
    """Compile the warm-up's grammar (the grammar engine's tokenizer is built by the first
    compile) and leave the cache as it was. -> the compiled grammar"""
    compiled = grammars.compile(WARM_UP_SPEC)
    grammars.forget(WARM_UP_SPEC)
    return compiled


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
