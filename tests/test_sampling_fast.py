"""The fast sampling path (`sample`) against the reference (`sample_reference`): the same token,
bit for bit, on every kind of row — ties, near-flat and heavy-tailed rows, masked (-inf)
tokens, NaN / +inf rows, penalties, logprobs — and through each of its shortcuts: candidate
growth, ties at the candidate boundary, the min_p bound just past the candidates, and a
temperature row whose CDF crossing is too close to call from block sums."""

import numpy as np
import pytest

from tokenwire.kernels import cpu, sampling
from tokenwire.core.executor import SeqStep
from tokenwire.kernels.sampling import penalize_row, request_uniform, request_uniforms, sample, sample_reference
from tokenwire.core.sampling_params import SamplingParams


PATHS = ["whole rows", "large rows"] + (["large rows, C exponentials"] if cpu.AVAILABLE else [])


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Small vocabularies are decided whole; force the large-row shortcuts on them too, with
    numpy's exponentials and with the C kernels' (within EXP_ULPS of numpy's)."""
    if request.param.startswith("large rows"):
        monkeypatch.setattr(sampling, "WHOLE_ROW_MAX_VOCAB", 0)
    return request.param


def exponentials(path):
    return cpu.sampling_exponentials if path == "large rows, C exponentials" else None


def seq(params, seed, prompt=(1, 2), out=()):
    return SeqStep(0, [1], 0, [0], True, params, seed, list(prompt), list(out))


def assert_same(logits, seqs, path=None):
    fast, ref = sample(logits, seqs, exponentials=exponentials(path)), sample_reference(logits, seqs)
    assert fast.token_ids == ref.token_ids
    assert fast.logprobs == ref.logprobs
    # the forward's fused argmax (the C lm_head's) stands in for greedy rows without penalties
    fused = sample(logits, seqs, np.argmax(logits, axis=1).astype(np.int32), exponentials(path))
    assert fused.token_ids == ref.token_ids and fused.logprobs == ref.logprobs


def random_params(rng):
    kw = {"temperature": float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7, 5.0]))}
    if rng.random() < 0.5:
        kw["top_k"] = int(rng.choice([1, 2, 5, 63, 64, 65, 500, 100000]))
    if rng.random() < 0.5:
        kw["top_p"] = float(rng.choice([0.01, 0.5, 0.9, 0.999, rng.uniform(0.05, 1.0)]))
    if rng.random() < 0.4:
        kw["min_p"] = float(rng.choice([1e-6, 0.01, 0.05, 0.3, 1.0, rng.random()]))
    if rng.random() < 0.15:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.15:
        kw["frequency_penalty"], kw["presence_penalty"] = float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
    if rng.random() < 0.1:
        kw["logprobs"] = int(rng.integers(0, 21))
    return SamplingParams(**kw)


def random_logits(rng, kind, rows, vocab_size):
    shape = (rows, vocab_size)
    if kind == "normal":
        x = rng.standard_normal(shape) * rng.uniform(0.01, 10)
    elif kind == "ties":
        x = np.round(rng.standard_normal(shape) * 2) / 2
    elif kind == "few peaks":
        x = np.zeros(shape)
        x[:, rng.integers(0, vocab_size, 5)] = 3
    elif kind == "near flat":
        x = rng.standard_normal(shape) * 0.001
    elif kind == "heavy tail":
        x = -np.abs(rng.standard_cauchy(shape))
    else:                                                   # masked: a third of the ids at -inf
        x = rng.standard_normal(shape) * 3
        x[:, rng.integers(0, vocab_size, vocab_size // 3)] = -np.inf
    return x.astype(np.float32)


KINDS = ["normal", "ties", "few peaks", "near flat", "heavy tail", "masked"]


@pytest.mark.parametrize("vocab_size", [2, 37, 781, 5000, 40000])
def test_fast_path_picks_the_reference_token(vocab_size, path):
    rng = np.random.default_rng(vocab_size)
    for trial in range(24 if vocab_size < 40000 else 8):
        rows = int(rng.integers(1, 9))
        logits = random_logits(rng, KINDS[trial % len(KINDS)], rows, vocab_size)
        seqs = [seq(random_params(rng), int(rng.integers(0, 2**63)), rng.integers(0, vocab_size, 5),
                    rng.integers(0, vocab_size, int(rng.integers(0, 6)))) for _ in range(rows)]
        assert_same(logits, seqs, path)


def test_chunking_never_changes_a_rows_token(monkeypatch, path):
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((9, 3000)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0.9), SamplingParams(top_p=0.8), SamplingParams(top_k=40, min_p=0.02)]
    seqs = [seq(params[i % 3], 77 + i) for i in range(9)]
    alone = [sample(logits[i:i + 1], [seqs[i]], exponentials=exponentials(path)).token_ids[0] for i in range(9)]
    for chunk_elements in (1, 6000, 1 << 20):           # one row, two rows, all rows per chunk
        monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", chunk_elements)
        assert sample(logits, seqs, exponentials=exponentials(path)).token_ids == alone


def test_ties_across_the_candidate_boundary(path):
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((1, 2000)) - 5).astype(np.float32)
    logits[0, rng.choice(2000, 300, replace=False)] = 2.0   # 300 ties where the first 64 candidates end
    for seed in range(40):
        for p in (SamplingParams(top_k=70), SamplingParams(top_k=64, top_p=0.5), SamplingParams(min_p=0.5)):
            assert_same(logits, [seq(p, seed)], path)


def test_a_wide_nucleus_grows_the_candidates(path):
    logits = (np.random.default_rng(7).standard_normal((4, 20000)) * 0.01).astype(np.float32)
    seqs = [seq(SamplingParams(top_p=q), 10 + i) for i, q in enumerate((0.5, 0.9, 0.999, 0.99999))]
    assert_same(logits, seqs, path)


def test_min_p_bound_just_past_the_candidates(path):
    # 64 tokens at or above min_p x the top, the 65th just below: the first candidate set decides
    e = np.concatenate([np.linspace(1.0, 0.1, 64), [0.1 * (1 - 1e-6)], np.full(500, 1e-3)])
    logits = np.log(e).astype(np.float32)[None]
    for seed in range(30):
        assert_same(logits, [seq(SamplingParams(min_p=0.1), seed)], path)
        assert_same(logits, [seq(SamplingParams(min_p=float(e[64])), seed)], path)


def draw(seed):
    return float(request_uniform(np.array([seed], dtype=np.uint64), np.array([0], dtype=np.uint64))[0])


def test_a_temperature_row_too_close_to_call_takes_the_reference_inversion(path):
    seed = next(s for s in range(100) if abs(draw(s) - 0.5) > 0.05)
    u = draw(seed)
    # two tokens, the temperature tuned so that p(token 0) = u: the CDF crosses the draw
    # within float rounding, which block sums cannot settle
    d = np.log(1 / u - 1)
    logits = np.array([[0.0, 1.0]] if d > 0 else [[1.0, 0.0]], dtype=np.float32)
    params = SamplingParams(temperature=abs(1 / d))
    x = logits[0].astype(np.float64) / params.temperature
    e = np.exp(x - x.max())
    assert sampling._crossing(e, np.cumsum(np.add.reduceat(e, [0])), u) is None
    assert_same(logits, [seq(params, seed)], path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_rows_with_nan_or_infinite_logits_match_the_reference(bad, path):
    logits = np.random.default_rng(8).standard_normal((3, 50)).astype(np.float32)
    logits[0, 7] = bad
    logits[1, :] = bad if bad == -np.inf else logits[1, :]
    for p in (SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=3), SamplingParams(min_p=0.1),
              SamplingParams(temperature=0.0)):
        with np.errstate(all="ignore"):
            assert_same(logits, [seq(p, 5 + i) for i in range(3)], path)


def dense_penalties(row, s):
    """The [V]-wide definition the sparse `penalize_row` replaces."""
    p, vocab_size = s.sampling, len(row)
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.fromiter((*s.prompt_token_ids, *s.output_token_ids), dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < vocab_size)]
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(s.output_token_ids):
        out = np.asarray(s.output_token_ids, dtype=np.int64)
        counts = np.bincount(out[out < vocab_size], minlength=vocab_size).astype(np.float32)
        row -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
    return row


def test_sparse_penalties_equal_the_dense_definition():
    rng = np.random.default_rng(9)
    for _ in range(50):
        row = (rng.standard_normal(300) * 4).astype(np.float32)
        params = SamplingParams(repetition_penalty=float(rng.uniform(0.5, 3)), frequency_penalty=float(rng.uniform(-2, 2)),
                                presence_penalty=float(rng.uniform(-2, 2)))
        s = seq(params, 0, rng.integers(0, 320, 20), rng.integers(0, 300, int(rng.integers(0, 40))))
        np.testing.assert_array_equal(penalize_row(row.copy(), s), dense_penalties(row.copy(), s))


@pytest.mark.parametrize("num_rows", [1, 8, 9, 40])
def test_python_and_numpy_draws_are_the_same_floats(num_rows):
    rng = np.random.default_rng(num_rows)
    seeds = [0, (1 << 64) - 1, 1 << 63, *rng.integers(0, 2**63, num_rows, dtype=np.uint64).tolist()][:num_rows]
    counters = rng.integers(0, 1 << 40, num_rows).tolist()
    want = request_uniform(np.array(seeds, dtype=np.uint64), np.array(counters, dtype=np.uint64)).tolist()
    assert request_uniforms(seeds, counters) == want
