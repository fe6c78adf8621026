"""Grammars as token masks, on llguidance: compile a `ConstraintSpec`, make each request's
`TokenConstraint`, fill a step's bitmask for every constrained row at once, apply it.

Why llguidance (bench/grammar_engines.py, figures in docs/ARCHITECTURE.md): it installs
with no dependency (xgrammar needs torch and triton), compiles a JSON schema lazily in
milliseconds (outlines-core builds the whole token-level automaton first: ~0.15 s at a
781-token vocabulary, far more at 150k), and fills a mask in tens of microseconds.

Contract:
- `GrammarCompiler(tokenizer, vocab_size, eos_token_ids)` for one model;
  `compile(spec) -> CompiledGrammar` (thread-safe, cached by spec; raises
  `core.constraint.InvalidConstraint` naming the problem). net/ calls it off the event
  loop, before the request is queued. `CompiledGrammar.constraint()` makes one request's
  `GrammarConstraint` (core/constraint.py's `TokenConstraint`). `forget(spec)` drops one
  from the cache (compile / forget).
- `mask_logits(logits, rows, constraints)`: kernels/sampling.py's one call per step with
  constrained rows: fills int32 `[k, ceil(V / 32)]` (bit j of word w allows token 32 w + j;
  llguidance's thread pool from PARALLEL_FILL_MIN_ROWS rows on) and sets every disallowed
  logit of those rows to -inf, in place (`apply_bitmask`).
- llguidance says nothing on stderr (its matchers are made with log_level 0: it used to print
  "Warning: ..." lines outside the log's format): a grammar's warnings at compile time and
  the reason a matcher refuses a token are WARNINGs on logger `tokenwire.kernels.grammar`.
"""

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import NamedTuple, Sequence

try:
    import llguidance
    import llguidance.numpy as llg_np
except ImportError as exc:              # optional where it is missing (the GPU image has none): the
    llguidance = llg_np = None          # server then has no constrained decoding, and says why at start
    MISSING = f"structured output needs llguidance (pip install llguidance): {exc}"
else:
    MISSING = None
import numpy as np

from ..core.constraint import ConstraintSpec, InvalidConstraint

log = logging.getLogger(__name__)
SILENT = 0                              # llguidance's log_level: it prints nothing itself (the log says it)
CACHE_SIZE = 256                        # compiled grammars kept per model
SPARSE_WORDS_DIVISOR = 64              # a row is masked the sparse way while at most 1 word in 64 has a set bit
PARALLEL_FILL_MIN_ROWS = 16             # fewer rows: one by one (llguidance's pool costs more than it saves;
                                        # 64 rows at 150k on the shared 2-core machine: pool 7 ms, serial 0.7 ms)
NEG_INF = np.float32(-np.inf)
_EXECUTOR = llguidance.LLExecutor() if llguidance is not None else None     # llguidance's own thread pool for batch mask fills
JSON_OPTIONS = {"whitespace_flexible": False}   # compact JSON: a model cannot pad it with endless spaces


class CompiledGrammar(NamedTuple):
    grammar: str                        # llguidance's grammar text, validated
    initial: object                     # llguidance.LLMatcher in its start state, never advanced
    compile_ns: int                     # what compiling it cost (0 when it came from the cache)
    spec: ConstraintSpec                # what it was compiled from

    def constraint(self) -> "GrammarConstraint":
        """A fresh matcher for one request: a copy of the start state (~5 µs; building a
        matcher from the grammar text again costs ~2 ms)."""
        return GrammarConstraint(self.initial.deep_copy(), self.spec)


class GrammarConstraint:
    """One request's matcher (a `TokenConstraint`); advanced on the engine thread."""
    __slots__ = ("matcher", "mask_ns", "spec")

    def __init__(self, matcher, spec: ConstraintSpec):
        self.matcher = matcher
        self.mask_ns = 0                # mask filling charged to this request
        self.spec = spec                # its grammar's spec: an engine in another process compiles it again

    def accept(self, token_id: int) -> bool:
        """Hot path: once per generated token of a constrained request."""
        if self.matcher.consume_token(token_id):
            return True
        log.warning("the grammar refuses token %d: %s", token_id, self.matcher.get_error().split("\n", 1)[0])
        return False

    def is_finished(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Specs -> compiled grammars for one model's tokenizer (cached by spec, thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._source = (tokenizer, vocab_size, list(eos_token_ids))
        self._tokenizer = None          # llguidance.LLTokenizer, made by the first compile (off the loop:
        self._cache = OrderedDict()     # ~20 ms at 781 tokens, ~4 s at 150k)   ConstraintSpec -> CompiledGrammar
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            tokenizer, vocab_size, eos = self._source
            try:
                self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
            except (ValueError, RuntimeError) as exc:
                raise InvalidConstraint(f"the grammar engine cannot read this model's tokenizer: {exc}") from None
        return self._tokenizer

    def cached(self, spec: ConstraintSpec):
        """The compiled grammar if `spec` was compiled before (cheap: the event loop asks), else None."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is None:
                return None
            self._cache.move_to_end(spec)
            return hit._replace(compile_ns=0)

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        hit = self.cached(spec)
        if hit is not None:
            return hit
        t0 = time.perf_counter_ns()
        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidConstraint(f"invalid {spec.kind.replace('_', ' ')}: {error.strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=SILENT)
        if matcher.is_error():
            raise InvalidConstraint(f"invalid {spec.kind.replace('_', ' ')}: {matcher.get_error()}")
        for warning in matcher.get_grammar_warnings():
            log.warning("the %s grammar compiles with a warning: %s", spec.kind.replace("_", " "), warning)
        matcher.compute_bitmask()                                   # the first mask's lazy parts, built once here
        compiled = CompiledGrammar(grammar, matcher, time.perf_counter_ns() - t0, spec)
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def forget(self, spec: ConstraintSpec) -> None:
        """Drop `spec`'s compiled grammar from the cache (the model's tokenizer stays built):
        the server's warm-up compiles one and leaves the cache as it found it."""
        with self._lock:
            self._cache.pop(spec, None)


def grammar_text(spec: ConstraintSpec) -> str:
    """A spec -> llguidance's grammar text (its own compile errors become InvalidConstraint)."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.source)
    except ValueError as exc:
        raise InvalidConstraint(f"invalid {spec.kind.replace('_', ' ')}: {exc}") from None
    raise InvalidConstraint(f"unknown constraint kind {spec.kind!r}")


class MaskBuffer:
    """The step's bitmask, int32 [rows, ceil(V / 32)], grown on demand and reused."""

    def __init__(self):
        self.bitmask = np.empty((0, 0), dtype=np.int32)

    def rows(self, num_rows: int, vocab_size: int) -> np.ndarray:
        words = (vocab_size + 31) // 32
        if self.bitmask.shape[0] < num_rows or self.bitmask.shape[1] != words:
            self.bitmask = np.empty((max(num_rows, 2 * self.bitmask.shape[0]), words), dtype=np.int32)
        return self.bitmask[:num_rows]


_MASKS = threading.local()              # one buffer per sampling thread (the engine thread)


def mask_logits(logits: np.ndarray, rows: Sequence[int], constraints: Sequence[GrammarConstraint]) -> None:
    """float32 [S, V], in place: rows[k]'s disallowed tokens -> -inf (hot path: once per step
    with constrained rows). Each constraint is charged an equal share of the step's mask time."""
    t0 = time.perf_counter_ns()
    buffer = getattr(_MASKS, "buffer", None) or _new_buffer()
    vocab_size = logits.shape[1]
    bitmask = buffer.rows(len(rows), vocab_size)                                       # [k, W]
    if len(rows) < PARALLEL_FILL_MIN_ROWS:
        for k, c in enumerate(constraints):
            llg_np.fill_next_token_bitmask(c.matcher, bitmask, k)
    else:
        llg_np.fill_next_token_bitmask_par(_EXECUTOR, [(c.matcher, k) for k, c in enumerate(constraints)], bitmask)
    apply_bitmask(logits, rows, bitmask)
    share = (time.perf_counter_ns() - t0) // len(rows)
    for c in constraints:
        c.mask_ns += share


def apply_bitmask(logits: np.ndarray, rows: Sequence[int], bitmask: np.ndarray) -> None:
    """logits float32 [S, V], bitmask int32 [k, W] for `rows`: every token whose bit is clear
    -> -inf, in place, each row the cheaper of two ways. A grammar allows few tokens at most
    steps: then only the set bits are expanded, the allowed logits kept aside, the row filled
    with -inf and the kept put back (0.01% allowed at V = 150k: ~30x cheaper than the dense
    way). A row with many words set (inside a free string) goes the dense way: every bit
    unpacked, a masked copy (10% allowed: ~4x cheaper than the sparse way)."""
    dense = np.count_nonzero(bitmask, axis=1) * SPARSE_WORDS_DIVISOR > bitmask.shape[1]   # [k]
    dense_ks = np.flatnonzero(dense).tolist()
    if dense_ks:
        allowed = np.unpackbits(bitmask[dense_ks].view(np.uint8), axis=1, count=logits.shape[1],
                                bitorder="little")                                    # [d, V] uint8
        for j, k in enumerate(dense_ks):
            np.copyto(logits[rows[k]], NEG_INF, where=allowed[j] == 0)
    if len(dense_ks) == len(rows):
        return
    sparse = np.flatnonzero(~dense)
    _apply_sparse(logits, np.asarray(rows, dtype=np.intp)[sparse], bitmask[sparse])


def _apply_sparse(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """apply_bitmask's sparse way for int32 [k, W] masks of `rows` (intp [k])."""
    hit_rows, hit_words = np.nonzero(bitmask)                                          # [n] words with a set bit
    bits = np.unpackbits(bitmask[hit_rows, hit_words].view(np.uint8).reshape(-1, 4), axis=1,
                         bitorder="little")                                           # [n, 32]
    word_k, bit = np.nonzero(bits)
    token = hit_words[word_k] * 32 + bit                                               # allowed ids
    row = rows[hit_rows[word_k]]
    inside = token < logits.shape[1]
    row, token = row[inside], token[inside]
    kept = logits[row, token]
    logits[rows] = NEG_INF
    logits[row, token] = kept


def _new_buffer() -> MaskBuffer:
    _MASKS.buffer = MaskBuffer()
    return _MASKS.buffer
