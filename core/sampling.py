"""Next-token sampling, vectorized over the batch (numpy).

Contract: `sample(logits, seqs) -> StepOutput`, where `logits` is float32 `[S, V]` for the
S `SeqStep`s that asked for a token, in order. Per row, in this order:

1. penalties (only rows that set one): repetition over prompt + output (HF / CTRL rule:
   positive logits divided, negative multiplied), then OpenAI frequency and presence over
   the output;
2. greedy rows (temperature 0): argmax;
3. other rows: divide by temperature, softmax, drop tokens outside top_k, outside the top_p
   nucleus (the most likely token is always kept), or below min_p x the top probability,
   then invert the CDF at one uniform number `u`;
4. logprobs (rows that asked): log-softmax of the model's raw logits — the chosen token's
   logprob and the top N.

Determinism: `u = request_uniform(seed, counter)` with `counter = len(output_token_ids)`,
a pure function (two splitmix64 rounds) that a GPU sampler can compute the same way:

    x = mix64(seed) + (counter + 1) * 0x9E3779B97F4A7C15   (mod 2**64)
    u = (mix64(x) >> 11) * 2**-53                           (53 random bits in [0, 1))
    mix64(z): z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31

Every step works row by row (reductions along the vocabulary axis only), so a row's result
depends on its own logits, params, seed and counter, never on which other rows share the batch.
"""

from typing import Sequence

import numpy as np

from .executor import SeqStep, StepOutput, TopLogprobs

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_2 = np.uint64(0x94D049BB133111EB)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 [S] (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * MIX_1
    z = z ^ (z >> np.uint64(27))
    z = z * MIX_2
    return z ^ (z >> np.uint64(31))


def request_uniform(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """uint64 [S], uint64 [S] -> float64 [S] in [0, 1): the draw for each request's next token."""
    x = mix64(seeds.astype(np.uint64)) + (counters.astype(np.uint64) + np.uint64(1)) * GOLDEN
    return (mix64(x) >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)


def sample(logits: np.ndarray, seqs: Sequence[SeqStep]) -> StepOutput:
    """logits: float32 [S, V], one row per sampling SeqStep (hot path: once per step)."""
    num_seqs = len(seqs)
    assert logits.ndim == 2 and logits.shape[0] == num_seqs, (logits.shape, num_seqs)
    params = [s.sampling for s in seqs]
    raw = logits
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if penalized:
        logits = apply_penalties(logits.copy(), seqs, penalized)
    token_ids = np.empty(num_seqs, dtype=np.int64)                 # [S]
    greedy = np.array([p.greedy for p in params], dtype=bool)      # [S]
    if greedy.any():
        token_ids[greedy] = np.argmax(logits[greedy], axis=1)
    if not greedy.all():
        rows = np.flatnonzero(~greedy)
        token_ids[rows] = sample_random(logits[rows], [seqs[i] for i in rows])
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = compute_logprobs(raw, token_ids, params)
    return StepOutput(token_ids.tolist(), logprobs)


def apply_penalties(logits: np.ndarray, seqs: Sequence[SeqStep], rows: Sequence[int]) -> np.ndarray:
    """In place on float32 [S, V] for the given rows; one row at a time (penalties are rare)."""
    vocab_size = logits.shape[1]
    for i in rows:
        s, row = seqs[i], logits[i]
        p = s.sampling
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.fromiter((*s.prompt_token_ids, *s.output_token_ids), dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < vocab_size)]
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(s.output_token_ids):
            out = np.asarray(s.output_token_ids, dtype=np.int64)
            counts = np.bincount(out[out < vocab_size], minlength=vocab_size).astype(np.float32)  # [V]
            row -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
    return logits


def sample_random(logits: np.ndarray, seqs: Sequence[SeqStep]) -> np.ndarray:
    """float32 [R, V] of rows with temperature > 0 -> int64 [R] sampled ids."""
    params = [s.sampling for s in seqs]
    temps = np.array([p.temperature for p in params], dtype=np.float64)[:, None]      # [R, 1]
    x = logits.astype(np.float64) / temps                                             # [R, V]
    u = request_uniform(np.array([s.seed for s in seqs], dtype=np.uint64),
                        np.array([len(s.output_token_ids) for s in seqs], dtype=np.uint64))  # [R]
    out = np.empty(len(seqs), dtype=np.int64)
    filtered = np.array([p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params], dtype=bool)
    if (~filtered).any():
        rows = np.flatnonzero(~filtered)
        out[rows] = invert_cdf(softmax(x[rows]), u[rows])
    if filtered.any():
        rows = np.flatnonzero(filtered)
        out[rows] = sample_filtered(x[rows], u[rows], [params[i] for i in rows])
    return out


def sample_filtered(x: np.ndarray, u: np.ndarray, params) -> np.ndarray:
    """Rows with top_k / top_p / min_p: work in descending-probability order. x: float64 [R, V]"""
    num_rows, vocab_size = x.shape
    order = np.argsort(-x, axis=1, kind="stable")                                     # [R, V]
    probs = softmax(np.take_along_axis(x, order, axis=1))                             # [R, V] descending
    top_k = np.array([p.top_k or vocab_size for p in params])[:, None]                # [R, 1]
    top_p = np.array([p.top_p for p in params])[:, None]
    min_p = np.array([p.min_p for p in params])[:, None]
    rank = np.arange(vocab_size)[None, :]                                             # [1, V]
    mass_before = np.cumsum(probs, axis=1) - probs                                    # [R, V]
    keep = (rank < top_k) & (mass_before < top_p) & (probs >= min_p * probs[:, :1])
    keep[:, 0] = True
    picked = invert_cdf(np.where(keep, probs, 0.0), u)                                # rank per row
    return order[np.arange(num_rows), picked]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def invert_cdf(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """First column whose cumulative weight exceeds u x total, per row. [R, V], [R] -> int64 [R]"""
    cdf = np.cumsum(weights, axis=1)                                                  # [R, V]
    target = u * cdf[:, -1]
    idx = (cdf <= target[:, None]).sum(axis=1)
    # guard the float edge u*total == total: never step past the last token with weight
    last = weights.shape[1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    return np.minimum(idx, last)


def compute_logprobs(logits: np.ndarray, token_ids: np.ndarray, params) -> list:
    """Log-softmax of the raw logits for rows that asked. -> [TopLogprobs | None] per row"""
    out = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    x = logits[rows].astype(np.float64)
    lse = np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) + x.max(axis=1, keepdims=True)
    lp = x - lse                                                                       # [R, V]
    for r, i in enumerate(rows):
        n = min(params[i].logprobs, lp.shape[1])
        top = np.argpartition(-lp[r], n - 1)[:n] if n else np.empty(0, dtype=np.int64)
        top = top[np.argsort(-lp[r, top], kind="stable")]
        out[i] = TopLogprobs(float(lp[r, token_ids[i]]), top.tolist(), lp[r, top].tolist())
    return out
