"""`tokenwire bench stages`, the grammar rows: what constrained decoding costs.

- grammar compile: a JSON schema never seen before -> a matcher with its first mask ready
  (kernels/grammar.GrammarCompiler.compile; a distinct `$comment` per call defeats the cache);
- grammar mask (batch B): kernels/grammar.mask_logits over B constrained rows (the fill of
  every row's bitmask, in parallel above one row, and the -inf writes), plus each row's
  matcher taking a token, as the engine thread does; per token = per row;
- engine decode step + sampling at batch `GRAMMAR_STEP_BATCH` on each backend that masks,
  unconstrained and constrained, as two rows of the table, and (`step_overhead`) as
  alternating pairs in one loop, whose median ratio is the price of structured output on
  that backend with the machine's noise shared by both sides (target: at most +10% on the
  CPU backend).
"""

import itertools
import statistics
import time

import numpy as np

from ..core.sampling_params import SamplingParams
from ..kernels.grammar import GrammarCompiler, mask_logits
from ..net.api.structured import schema_spec
from .stage_fns import Setup, Stage, _decode_batch

GRAMMAR_STEP_BATCH = 16
# the JSON schema every grammar row times: nested object, pattern, enum, bounded integer and array
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "user", "tags", "score"],
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "role"],
                 "properties": {"name": {"type": "string", "maxLength": 12},
                                "role": {"enum": ["admin", "editor", "viewer"]}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "score": {"type": "integer", "minimum": -50, "maximum": 500},
    },
}
OVERHEAD_PAIRS = 30


class ConstraintWalk:
    """Constraints for `num` rows that take one token per call and start over when complete."""

    def __init__(self, compiled, num: int):
        self.compiled = compiled
        self.constraints = [compiled.constraint() for _ in range(num)]

    def take(self, token_ids) -> None:
        for k, token in enumerate(token_ids):
            c = self.constraints[k]
            if not c.accept(int(token)) or c.is_finished():
                self.constraints[k] = self.compiled.constraint()


def grammar_stages(s: Setup) -> list:
    config = s.engine.config
    compiler = GrammarCompiler(s.engine.tokenizer, config.vocab_size, s.engine.eos_token_ids)
    compiled = compiler.compile(schema_spec(SCHEMA))
    counter = itertools.count()
    out = [Stage("grammar compile (JSON schema, uncached)", "engine",
                 lambda: compiler.compile(schema_spec(dict(SCHEMA, **{"$comment": str(next(counter))}))),
                 note="llguidance; to the first mask")]
    rng = np.random.default_rng(0)
    for batch in s.batch_sizes:
        logits = rng.standard_normal((batch, config.vocab_size), dtype=np.float32)
        out.append(Stage(f"grammar mask + advance (batch {batch})", "engine", _masker(logits, ConstraintWalk(compiled, batch)),
                         num_tokens=batch, note=f"vocab {config.vocab_size}; includes a [B, V] logits copy"))
    params = SamplingParams(temperature=1.0)
    for backend, executor in s.executors.items():
        prompt = s.prompt_ids[: min(len(s.prompt_ids), config.max_position_embeddings - 2)]
        seqs = _decode_batch(executor, prompt, GRAMMAR_STEP_BATCH, params)
        label = f"engine decode step [{backend}] (batch {GRAMMAR_STEP_BATCH}, T=1)"
        if seqs is None:
            out.append(Stage(label, "engine", None, note="skipped: the contexts do not fit the KV cache"))
            continue
        walk = ConstraintWalk(compiled, GRAMMAR_STEP_BATCH)
        out.append(Stage(label + " unconstrained", "engine", lambda e=executor, q=seqs: e.step(q),
                         num_tokens=GRAMMAR_STEP_BATCH))
        out.append(Stage(label + " JSON-schema constrained", "engine", _constrained_step(executor, seqs, walk),
                         num_tokens=GRAMMAR_STEP_BATCH, note="mask in sampling + matcher advance"))
    return out


def _masker(logits: np.ndarray, walk: ConstraintWalk):
    work = np.empty_like(logits)                                    # [B, V]
    rows = list(range(len(logits)))

    def fn():
        np.copyto(work, logits)
        mask_logits(work, rows, walk.constraints)
        walk.take(work.argmax(axis=1))
    return fn


def _constrained_step(executor, seqs: list, walk: ConstraintWalk):
    def fn():
        step = executor.step([s._replace(constraint=c) for s, c in zip(seqs, walk.constraints)])
        walk.take(step.token_ids)
    return fn


def step_overhead(s: Setup, num_pairs: int = OVERHEAD_PAIRS) -> list:
    """Per backend: unconstrained and constrained decode steps at GRAMMAR_STEP_BATCH,
    alternating (one of each per pair). -> [{backend, unconstrained_ms, constrained_ms, ratio}]"""
    config = s.engine.config
    compiled = GrammarCompiler(s.engine.tokenizer, config.vocab_size, s.engine.eos_token_ids).compile(
        schema_spec(SCHEMA))
    params = SamplingParams(temperature=1.0)
    out = []
    for backend, executor in s.executors.items():
        prompt = s.prompt_ids[: min(len(s.prompt_ids), config.max_position_embeddings - 2)]
        seqs = _decode_batch(executor, prompt, GRAMMAR_STEP_BATCH, params)
        if seqs is None:
            continue
        constrained = _constrained_step(executor, seqs, ConstraintWalk(compiled, GRAMMAR_STEP_BATCH))
        plain, masked, ratios = [], [], []
        for _ in range(num_pairs):
            t0 = time.perf_counter_ns()
            executor.step(seqs)
            t1 = time.perf_counter_ns()
            constrained()
            t2 = time.perf_counter_ns()
            plain.append(t1 - t0)
            masked.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
        out.append({"backend": backend, "batch": GRAMMAR_STEP_BATCH, "pairs": num_pairs,
                    "unconstrained_ms": statistics.median(plain) / 1e6,
                    "constrained_ms": statistics.median(masked) / 1e6, "ratio": statistics.median(ratios)})
    return out
