"""Next-token sampling, vectorized over the batch (numpy).

Contract: `sample(logits, seqs) -> StepOutput`, where `logits` is float32 `[S, V]` for the
S `SeqStep`s that asked for a token, in order. Per row, in this order:

0. constrained rows (a `SeqStep.constraint`): the grammar's token mask, filled for all of
   them at once (kernels/grammar.py), sets every token it disallows to -inf, in place, so
   every rule below (and logprobs) sees only allowed tokens; other rows pay one attribute
   read;
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

Two implementations of the rules, giving the same token for the same logits, params and
seed — the same decisions as the reference's own float64 roundings, not just up to them:
- the reference (`sample_reference`: `sample_random`, `sample_filtered`, `invert_cdf`,
  `softmax`): whole-batch float64 [R, V] arrays, a stable argsort of every filtered row.
  Readable; the CUDA fake kernels call it; slow at real vocabularies (a 152k-token top_p
  row: ~18 ms).
- the fast path, `sample`: rows in chunks of at most CHUNK_ELEMENTS values (float64
  temporaries stay in cache; none is [R, V]), no argsort of the vocabulary. It computes the
  reference's exponentials bit for bit and skips only work that provably cannot change the
  token:
  * temperature only: the reference's token is the first index where its running sum of
    fl(e / sum(e)) passes u x the last one. Block sums locate that crossing; when it clears
    a bound on both sides' float rounding (`_crossing`) it is the reference's, else the row
    runs the reference's own inversion (the chance is about 1e-5 at a 152k vocabulary).
    The exponentials and block sums may come from `sample(..., exponentials=)` (the C
    kernels' vector exp, kernels/cpu `sampling_exponentials`: np.exp over a 152k row is
    ~1.1 ms of scalar libm calls on AVX2, ~5% of a Qwen2.5-0.5B decode step; the C pass
    ~0.25 ms) within EXP_ULPS ulp of np.exp's, which the crossing's bound allows for.
  * top_k / top_p / min_p: the reference normalizes by the sum of exp over the row in
    descending order, and that float sum depends on the order: so the row is sorted by
    value (np.sort of float32, no indices), giving the exponentials and the sum exactly, in
    the reference's order. The kept tokens are a prefix of that order: the reference's
    arithmetic is repeated exactly over the first n ranks (64, x 4 while undecided),
    vectorized over the chunk, and a row is done once one filter provably drops every later
    rank (`_prefix_ranks`). No id is sorted: the picked rank's value, and its rank among
    equal values (lower ids first), name the token. A row with NaN or +inf goes to the
    reference.
- logprobs: the reference's operations one row at a time. Penalties: only the ids that
  occur are touched (never a [V] array); see `penalize_row`.
The module is longer than most because the fast path and the reference it must equal live
side by side (tests/test_sampling_fast.py holds them to it).
"""

from typing import Callable, Optional, Sequence

import numpy as np

from ..core.executor import SeqStep, StepOutput, TopLogprobs
from .grammar import mask_logits

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


M64 = (1 << 64) - 1


def _mix64_int(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def request_uniforms(seeds: list, counters: list) -> list:
    """request_uniform's floats, bit for bit: Python ints for a few rows (the numpy form costs
    ~15 us however few), numpy for many."""
    if len(seeds) > 8:
        return request_uniform(np.array(seeds, dtype=np.uint64), np.array(counters, dtype=np.uint64)).tolist()
    return [(_mix64_int((_mix64_int(s) + (c + 1) * 0x9E3779B97F4A7C15) & M64) >> 11) * 2.0 ** -53
            for s, c in zip(seeds, counters)]


CHUNK_ELEMENTS = 1 << 17                # rows sampled together: chunk rows x V <= this (1 MiB of float64)
FIRST_CANDIDATES = 64                   # filtered rows are decided over this many leading ranks, x 4 per retry
WHOLE_ROW_MAX_VOCAB = 1024              # temperature-only rows up to this vocabulary: the reference's inversion
CDF_BLOCK = 512                         # temperature-only rows: the CDF crossing is found from sums of this many
TOP_P_MARGIN = 1e-12                    # relative: far above the 3 x 2**-53 a later token's mass can fall short
EXP_ULPS = 4                            # injected exponentials: at most this many ulp from np.exp's (C: 1 measured)


def sample(logits: np.ndarray, seqs: Sequence[SeqStep], argmax: Optional[np.ndarray] = None,
           exponentials: Optional[Callable] = None) -> StepOutput:
    """logits: float32 [S, V], one row per sampling SeqStep (hot path: once per step).
    argmax: np.argmax(logits, axis=1) when the forward already found it (the C lm_head does),
    used for greedy rows without penalties instead of another pass over [S, V]; it was taken
    before the grammar masks, so a masked row's argmax is taken again here.
    exponentials: `(block f32 [k, V], temperatures f64 [k], block_size) -> (e f64 [k, V], sums
    f64 [k, ceil(V / block_size)])` for temperature-only rows, e within EXP_ULPS ulp of the
    reference's exponentials (`_reference_exponentials`), or None for numpy's."""
    num_seqs = len(seqs)
    assert logits.ndim == 2 and logits.shape[0] == num_seqs, (logits.shape, num_seqs)
    masked = apply_constraints(logits, seqs)
    if argmax is not None and masked:
        argmax = argmax.copy()
        argmax[masked] = np.argmax(logits[masked], axis=1)
    params = [s.sampling for s in seqs]
    rows = _Rows(logits, seqs, {i for i, p in enumerate(params) if p.has_penalties})
    token_ids = np.empty(num_seqs, dtype=np.int64)                 # [S]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == num_seqs and not rows.penalized:
        token_ids[:] = np.argmax(logits, axis=1) if argmax is None else argmax
    else:
        for i in greedy:
            token_ids[i] = argmax[i] if argmax is not None and i not in rows.penalized else np.argmax(rows.gather([i]))
    random = [i for i, p in enumerate(params) if not p.greedy]
    if random:
        draws = dict(zip(random, request_uniforms([seqs[i].seed for i in random],
                                                  [len(seqs[i].output_token_ids) for i in random])))
        for chunk in _chunks([i for i in random if not is_filtered(params[i])], logits.shape[1]):
            token_ids[chunk] = _sample_plain(rows.gather(chunk), params, chunk, draws, exponentials)
        for chunk in _chunks([i for i in random if is_filtered(params[i])], logits.shape[1]):
            token_ids[chunk] = _sample_filtered_fast(rows.gather(chunk), params, chunk, draws)
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = compute_logprobs(logits, token_ids, params)
    return StepOutput(token_ids.tolist(), logprobs)


def apply_constraints(logits: np.ndarray, seqs: Sequence[SeqStep]) -> list:
    """Mask the rows whose request carries a grammar (float32 [S, V], in place) -> those rows.
    Hot path: an unconstrained step costs one attribute read per row and a count in C (batch
    64: ~7 µs on the shared 2-core machine, against a decode step of tens of ms)."""
    constraints = [s.constraint for s in seqs]
    if constraints.count(None) == len(constraints):
        return []
    rows = [i for i, c in enumerate(constraints) if c is not None]
    mask_logits(logits, rows, [constraints[i] for i in rows])
    return rows


def is_filtered(p) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _chunks(rows: list, vocab_size: int):
    step = max(1, CHUNK_ELEMENTS // vocab_size)
    for k in range(0, len(rows), step):
        yield rows[k:k + step]


class _Rows:
    """A step's logits by chunks of rows, penalized where a row has penalties. Penalized rows
    are copied into one scratch block per step: a fresh [V] copy per row cost more in page
    faults (~0.4 ms at V = 152k) than the penalties themselves."""

    def __init__(self, logits: np.ndarray, seqs: Sequence[SeqStep], penalized: set):
        self.logits, self.seqs, self.penalized = logits, seqs, penalized
        self.scratch = None                                        # float32 [chunk rows, V], made on first use

    def gather(self, chunk: list) -> np.ndarray:
        """-> float32 [k, V], read only (a one-row chunk without penalties is a view)."""
        if not self.penalized.intersection(chunk):
            return self.logits[chunk[0]:chunk[0] + 1] if len(chunk) == 1 else self.logits[chunk]
        if self.scratch is None:
            vocab_size = self.logits.shape[1]
            self.scratch = np.empty((max(1, CHUNK_ELEMENTS // vocab_size), vocab_size), dtype=np.float32)
        block = self.scratch[:len(chunk)]
        np.take(self.logits, chunk, axis=0, out=block)
        for j, i in enumerate(chunk):
            if i in self.penalized:
                penalize_row(block[j], self.seqs[i])
        return block


def _temperatures(params, chunk: list) -> np.ndarray:
    return np.array([params[i].temperature for i in chunk], dtype=np.float64)[:, None]      # [k, 1]


def _reference_exponentials(block: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """float32 [k, V], float64 [k] -> the reference's float64 exp(x / T - max), bit for bit."""
    x = block.astype(np.float64)                                                      # [k, V]
    x /= temperatures[:, None]
    x -= x.max(axis=1, keepdims=True)
    return np.exp(x, out=x)


def _numpy_exponentials(block: np.ndarray, temperatures: np.ndarray, block_size: int) -> tuple:
    """`sample`'s `exponentials` contract, exactly (np.exp): -> e [k, V], block sums [k, nb]."""
    x = _reference_exponentials(block, temperatures)
    return x, np.add.reduceat(x, np.arange(0, x.shape[1], block_size), axis=1)


def _sample_plain(block: np.ndarray, params, chunk: list, draws: dict, exponentials=None) -> np.ndarray:
    """Temperature-only rows, float32 [k, V]: the reference's exponentials (or within
    EXP_ULPS of them), then the CDF crossing found from block sums (see `_crossing`); the
    reference's own inversion for a row whose crossing is too close to call."""
    u = np.array([draws[i] for i in chunk])
    temperatures = _temperatures(params, chunk)[:, 0]                                 # [k]
    if block.shape[1] <= WHOLE_ROW_MAX_VOCAB:                       # small rows: the reference's inversion
        x = _reference_exponentials(block, temperatures)
        return invert_cdf(x / x.sum(axis=1, keepdims=True), u)
    x, block_sums = (exponentials or _numpy_exponentials)(block, temperatures, CDF_BLOCK)
    block_cdf = np.cumsum(block_sums, axis=1)                                         # [k, V / CDF_BLOCK]
    out = np.empty(len(chunk), dtype=np.int64)
    for r in range(len(chunk)):
        token = None
        if np.isfinite(block_cdf[r, -1]) and block_cdf[r, -1] > 0:
            token = _crossing(x[r], block_cdf[r], u[r])
        if token is None:
            e = _reference_exponentials(block[r:r + 1], temperatures[r:r + 1])[0]
            token = int(invert_cdf((e / e.sum())[None], u[r:r + 1])[0])
        out[r] = token
    return out


def _crossing(e: np.ndarray, block_cdf: np.ndarray, u: float) -> Optional[int]:
    """The first j with cdf[j] > u x cdf[-1], the reference's CDF being the running sum of
    fl(e / sum(e)) in index order — or None when the float roundings could decide it.

    The reference's cdf[j] is E_j / s x (1 + a_j) with E_j the exact sum of e[:j + 1] and
    |a_j| <= (j + 2) eps (eps = 2**-53; nonnegative terms); its target u x cdf[-1] has one
    more rounding. So its test cdf[j] <= target is the exact test E_j / E_V <= u except where
    the two are within (2V + 3) eps. Here E_j comes from block sums, a running sum over
    blocks and one over the block that crosses: within (3 CDF_BLOCK + 2 nblocks + 4) eps of
    exact. `e` itself may be within EXP_ULPS ulp of the reference's exponentials (each off by
    a factor 1 + d, |d| <= 2 EXP_ULPS eps), which moves E_j / E_V by at most 4 EXP_ULPS eps
    (arguments below -708 give 0 there: at most V x 1e-307 against E_V >= 1, the row's
    maximum being exp(0)). When both neighbours of the crossing clear the sum of the bounds
    (twice it, for second-order terms), the reference crosses at the same j: its CDF never
    decreases."""
    total = block_cdf[-1]
    target = u * total
    b = int(np.searchsorted(block_cdf, target, "right"))
    if b >= len(block_cdf):
        return None
    base = float(block_cdf[b - 1]) if b else 0.0
    cdf = base + np.cumsum(e[b * CDF_BLOCK:(b + 1) * CDF_BLOCK])
    j = int(np.searchsorted(cdf, target, "right"))
    if j >= len(cdf):
        return None
    before = float(cdf[j - 1]) if j else base
    tol = 2.0 * (2 * len(e) + 3 * CDF_BLOCK + 2 * len(block_cdf) + 16 + 4 * EXP_ULPS) * 2.0 ** -53
    if cdf[j] / total - u <= tol or u - before / total <= tol:
        return None
    return b * CDF_BLOCK + j


def _sample_filtered_fast(block: np.ndarray, params, chunk: list, draws: dict) -> np.ndarray:
    """top_k / top_p / min_p rows, float32 [k, V]: sorted values give the reference's
    exponentials and normalizer exactly; ranks are decided over the fewest leading columns
    that provably suffice; no id is sorted."""
    out = np.empty(len(chunk), dtype=np.int64)
    temps = _temperatures(params, chunk)
    u = np.array([draws[i] for i in chunk])
    keys = np.negative(block)
    keys.sort(axis=1)                                               # [k, V] float32: -logit ascending
    good = np.isfinite(keys[:, 0]) & ~np.isnan(keys[:, -1])
    for r in np.flatnonzero(~good).tolist():                        # NaN / +inf / all -inf: the reference
        out[r] = sample_filtered(block[r:r + 1].astype(np.float64) / temps[r:r + 1], u[r:r + 1],
                                 [params[chunk[r]]])[0]
    if not good.all():
        block, keys, temps, u, chunk = block[good], keys[good], temps[good], u[good], [
            i for i, g in zip(chunk, good) if g]
    if not chunk:
        return out
    e = keys.astype(np.float64)                                     # the reference's descending x[order]
    e /= -temps                                                     # is keys / -T (sign-symmetric division)
    e -= e[:, :1].copy()                                            # (a view of e itself: numpy's slow path)
    np.exp(e, out=e)                                                # [k, V] e, descending
    ranks = _filtered_ranks(e, [params[i] for i in chunk], u)
    out[good] = _ids_at_ranks(block, keys, ranks)
    return out


def _filtered_ranks(e: np.ndarray, params: list, u: np.ndarray) -> np.ndarray:
    """e float64 [k, V] descending -> the rank each row's reference picks. The leading n
    columns decide a row once some filter provably drops every later rank
    (`_prefix_ranks`); undecided rows retry with 4 x n columns."""
    k, vocab_size = e.shape
    totals = e.sum(axis=1)                                          # the reference's normalizer, same order
    top_k = np.array([p.top_k or vocab_size for p in params])       # [k]
    top_p = np.array([p.top_p for p in params])
    min_p = np.array([p.min_p for p in params])
    active = (int(top_k.min()), any(p.top_p < 1.0 for p in params), any(p.min_p > 0.0 for p in params))
    ranks = np.empty(k, dtype=np.int64)
    todo = np.arange(k)
    n = min(vocab_size, FIRST_CANDIDATES)
    while len(todo):
        rows = todo if len(todo) < k else slice(None)
        r_ranks, decided = _prefix_ranks(e[rows, :n], e[rows, n] if n < vocab_size else None, totals[todo],
                                         top_k[todo], top_p[todo], min_p[todo], u[todo], active)
        ranks[todo[decided]] = r_ranks[decided]
        todo = todo[~decided]
        n = min(vocab_size, 4 * n)
    return ranks


def _prefix_ranks(e: np.ndarray, e_next, totals, top_k, top_p, min_p, u, active: tuple) -> tuple:
    """The reference's `sample_filtered` arithmetic over the first n ranks (e float64 [m, n],
    descending; e_next [m] the (n+1)-th or None). -> (rank per row, whether the prefix
    decides the row). Its operations on these columns are the reference's on the same
    values, so a decided row's rank is the reference's:
    - top_k <= n: later ranks fail rank < top_k.
    - top_p: a later rank j's mass-before, fl(fl(cdf[j-1] + p_j) - p_j), is at least
      cdf[j-1] x (1 - 3 x 2**-53) (as p_j <= cdf[j-1]), and the running sum never falls: so
      cdf[n-1] >= top_p x (1 + TOP_P_MARGIN) drops every later rank.
    - min_p: probabilities never rise along the order, so once one (inside, or the next
      one) is below min_p x the top probability, every later one is.
    Then the inversion: the reference's weights after rank n are 0, so its CDF there stays
    at the prefix's total; it counts those ranks only when the count already reaches n, past
    `last`, which caps it. `active` = (smallest top_k, any top_p < 1, any min_p > 0) of the
    chunk: a test no row can fail is skipped (rank < top_k >= n; probs >= 0 x top)."""
    n = e.shape[1]
    min_top_k, any_top_p, any_min_p = active
    probs = e / totals[:, None]                                                       # [m, n]
    cdf = np.cumsum(probs, axis=1)
    keep = cdf - probs < top_p[:, None]                             # the reference applies it even at top_p 1
    if min_top_k < n:
        keep &= np.arange(n)[None, :] < top_k[:, None]
    decided = top_k <= n
    if any_top_p:
        decided |= (top_p < 1.0) & (cdf[:, -1] >= top_p * (1.0 + TOP_P_MARGIN))
    if any_min_p:
        floor = min_p * probs[:, 0]                                                   # [m]
        keep &= probs >= floor[:, None]
        decided |= (min_p > 0.0) & (probs[:, -1] < floor)
        if e_next is not None:
            decided |= (min_p > 0.0) & (e_next / totals < floor)
    if e_next is None:
        decided[:] = True
    keep[:, 0] = True
    weights = np.where(keep, probs, 0.0)
    wcdf = np.cumsum(weights, axis=1)
    total = wcdf[:, -1]
    target = u * total
    count = np.count_nonzero(wcdf <= target[:, None], axis=1)
    last = n - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    return np.minimum(count, last), decided


def _ids_at_ranks(block: np.ndarray, keys: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The id at each row's rank of the descending order, ties by lower id: the rank's value,
    and its place among equal values. block float32 [k, V], keys = sorted(-block)."""
    k = len(ranks)
    at = keys[np.arange(k), ranks]                                                    # [k] -value
    tie = ranks - np.count_nonzero(keys < at[:, None], axis=1)                        # equal values before it
    ids = np.argmax(block == -at[:, None], axis=1)
    for r in np.flatnonzero(tie).tolist():
        ids[r] = np.flatnonzero(block[r] == -at[r])[tie[r]]
    return ids


def apply_penalties(logits: np.ndarray, seqs: Sequence[SeqStep], rows: Sequence[int]) -> np.ndarray:
    """In place on float32 [S, V] for the given rows."""
    for i in rows:
        penalize_row(logits[i], seqs[i])
    return logits


def penalize_row(row: np.ndarray, s: SeqStep) -> np.ndarray:
    """In place on float32 [V]: work over the ids that occur (O(context), never O(V)).
    Frequency/presence change only ids with a count; the [V]-wide form this replaced also
    subtracted a zero from the others, which can only turn a -0.0 logit into +0.0."""
    vocab_size, p = len(row), s.sampling
    out = np.asarray(s.output_token_ids, dtype=np.int64)
    if p.repetition_penalty != 1.0:
        seen, _ = distinct_counts(np.concatenate((np.asarray(s.prompt_token_ids, dtype=np.int64), out)), vocab_size)
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(out):
        ids, counts = distinct_counts(out, vocab_size)
        row[ids] -= np.float32(p.frequency_penalty) * counts.astype(np.float32) + np.float32(p.presence_penalty)
    return row


def distinct_counts(ids: np.ndarray, vocab_size: Optional[int] = None) -> tuple:
    """int64 [n] -> (the distinct ids, in [0, V) when `vocab_size` is given, ascending; how often
    each occurs). A sort and a comparison: np.unique on integers costs ~10x that in numpy 2.4
    (~120 us for 1500 ids)."""
    if vocab_size is not None:
        ids = ids[(ids >= 0) & (ids < vocab_size)]
    ids = np.sort(ids)
    first = np.empty(len(ids), dtype=bool)
    first[:1] = True
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return ids[starts], np.diff(starts, append=len(ids))


# ------------------------------------------------------------------ the reference

def sample_reference(logits: np.ndarray, seqs: Sequence[SeqStep]) -> StepOutput:
    """The rules as whole-batch float64 arrays: what `sample` must equal, token for token."""
    num_seqs = len(seqs)
    apply_constraints(logits, seqs)
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


def sample_random(logits: np.ndarray, seqs: Sequence[SeqStep]) -> np.ndarray:
    """float32 [R, V] of rows with temperature > 0 -> int64 [R] sampled ids."""
    params = [s.sampling for s in seqs]
    temps = np.array([p.temperature for p in params], dtype=np.float64)[:, None]      # [R, 1]
    x = logits.astype(np.float64) / temps                                             # [R, V]
    u = request_uniform(np.array([s.seed for s in seqs], dtype=np.uint64),
                        np.array([len(s.output_token_ids) for s in seqs], dtype=np.uint64))  # [R]
    out = np.empty(len(seqs), dtype=np.int64)
    filtered = np.array([is_filtered(p) for p in params], dtype=bool)
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
    """Log-softmax of the raw logits for rows that asked, one row at a time (float64 [V], no
    [R, V] copy). -> [TopLogprobs | None] per row"""
    out = [None] * len(params)
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        x = logits[i].astype(np.float64)                                               # [V]
        xmax = x.max()
        lp = x - (np.log(np.exp(x - xmax).sum()) + xmax)                               # [V]
        n = min(p.logprobs, len(lp))
        top = np.argpartition(-lp, n - 1)[:n] if n else np.empty(0, dtype=np.int64)
        top = top[np.argsort(-lp[top], kind="stable")]
        out[i] = TopLogprobs(float(lp[token_ids[i]]), top.tolist(), lp[top].tolist())
    return out
