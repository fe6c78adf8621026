"""Sampling: each filter against its definition, the seeded RNG against the documented formula,
and a request's draw independent of what else is in the batch."""

import numpy as np
import pytest

from tokenwire.core.executor import SeqStep
from tokenwire.kernels.sampling import apply_penalties, request_uniform, sample
from tokenwire.core.sampling_params import SamplingParams

M64 = (1 << 64) - 1


def py_mix64(z):
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_uniform(seed, counter):
    """The formula in kernels/sampling.py's docstring, in plain Python integers."""
    x = (py_mix64(seed) + (counter + 1) * 0x9E3779B97F4A7C15) & M64
    return (py_mix64(x) >> 11) * 2.0 ** -53


def seq(params, seed=0, num_out=0, prompt=(1, 2), out=None):
    output = list(out) if out is not None else [7] * num_out
    return SeqStep(0, [1], 0, [0], True, params, seed, list(prompt), output)


def test_uniform_matches_the_documented_formula():
    seeds = [0, 1, 42, 2**63, M64, 0x0123456789ABCDEF]
    counters = [0, 1, 2, 1000, 2**32, 7]
    got = request_uniform(np.array(seeds, dtype=np.uint64), np.array(counters, dtype=np.uint64))
    assert got.tolist() == [py_uniform(s, c) for s, c in zip(seeds, counters)]
    u = request_uniform(np.full(20000, 5, dtype=np.uint64), np.arange(20000, dtype=np.uint64))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and len(set(u.tolist())) == 20000


def test_greedy_is_argmax_and_ignores_the_seed():
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    p = SamplingParams(temperature=0.0)
    out = sample(logits, [seq(p, seed=s) for s in (1, 2, 3)])
    assert out.token_ids == np.argmax(logits, axis=1).tolist() and out.logprobs is None


def empirical(logits_row, params, n=4000):
    logits = np.tile(np.asarray(logits_row, dtype=np.float32), (n, 1))
    ids = sample(logits, [seq(params, seed=s) for s in range(n)]).token_ids
    return np.bincount(ids, minlength=len(logits_row)) / n


def test_temperature_sampling_follows_the_softmax():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    freq = empirical(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.1], atol=0.03)
    sharp = empirical(logits, SamplingParams(temperature=0.25))       # p^4, renormalized
    want = np.array([0.5, 0.25, 0.15, 0.1]) ** 4
    np.testing.assert_allclose(sharp, want / want.sum(), atol=0.03)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    f = empirical(logits, SamplingParams(top_k=2))
    assert f[2] == f[3] == 0 and abs(f[0] - 0.5 / 0.8) < 0.03
    f = empirical(logits, SamplingParams(top_p=0.7))                   # 0.5 + 0.3 reaches 0.7
    assert f[2] == f[3] == 0 and abs(f[1] - 0.3 / 0.8) < 0.03
    f = empirical(logits, SamplingParams(top_p=0.85))
    assert f[3] == 0 and f[2] > 0
    f = empirical(logits, SamplingParams(min_p=0.35))                  # keeps p >= 0.175
    assert f[2] == f[3] == 0 and f[0] > 0 and f[1] > 0
    f = empirical(logits, SamplingParams(top_p=0.01))                  # the top token always stays
    assert f[0] == 1.0
    f = empirical(logits, SamplingParams(top_k=1, temperature=2.0))
    assert f[0] == 1.0


def test_same_seed_and_counter_same_token_whatever_the_batch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 300)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=0.0),
              SamplingParams(top_k=20, seed=12), SamplingParams(top_p=0.9, temperature=1.3),
              SamplingParams(min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3),
              SamplingParams(temperature=1.0, presence_penalty=1.0, logprobs=0)]
    seqs = [seq(p, seed=100 + i, num_out=i, out=[5, 5, i, 9][:i]) for i, p in enumerate(params)]
    alone = [sample(logits[i:i + 1], [seqs[i]]) for i in range(6)]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [4, 4, 2, 0]):
        batch = sample(logits[order], [seqs[i] for i in order])
        for j, i in enumerate(order):
            assert batch.token_ids[j] == alone[i].token_ids[0]
            if params[i].logprobs is not None:
                assert batch.logprobs[j] == alone[i].logprobs[0]
            else:
                assert batch.logprobs[j] is None


def test_the_draw_advances_with_the_output_length():
    logits = np.zeros((64, 1000), dtype=np.float32)                    # uniform over 1000 ids
    p = SamplingParams(temperature=1.0)
    ids = sample(logits, [seq(p, seed=3, num_out=n) for n in range(64)]).token_ids
    assert len(set(ids)) > 55                                          # a new number per position
    again = sample(logits, [seq(p, seed=3, num_out=n) for n in range(64)]).token_ids
    assert ids == again
    other = sample(logits, [seq(p, seed=4, num_out=n) for n in range(64)]).token_ids
    assert ids != other


def test_penalties_follow_their_definitions():
    logits = np.array([[2.0, -2.0, 1.0, 0.5, 3.0]], dtype=np.float32)
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=[0], out=[1])
    np.testing.assert_allclose(apply_penalties(logits.copy(), [s], [0])[0], [1.0, -4.0, 1.0, 0.5, 3.0])
    s = seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[4], out=[2, 2, 3])
    np.testing.assert_allclose(apply_penalties(logits.copy(), [s], [0])[0], [2.0, -2.0, -0.25, -0.25, 3.0])
    # the prompt counts for repetition only: token 4 keeps its logit under frequency/presence
    greedy = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert sample(logits, [seq(greedy, prompt=[4], out=[])]).token_ids == [0]
    assert sample(logits, [seq(SamplingParams(temperature=0.0), prompt=[4])]).token_ids == [4]


def test_logprobs_are_the_raw_log_softmax_and_sorted_top_n():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 40)).astype(np.float32)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.7, logprobs=0, seed=1)]
    out = sample(logits, [seq(params[0]), seq(params[1])])
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    lp0, lp1 = out.logprobs
    assert lp0.top_ids == np.argsort(-ref[0])[:5].tolist()
    np.testing.assert_allclose(lp0.top_logprobs, np.sort(ref[0])[::-1][:5], rtol=1e-6)
    assert lp0.token_logprob == pytest.approx(ref[0, out.token_ids[0]]) and lp0.top_ids[0] == out.token_ids[0]
    assert lp1.top_ids == [] and lp1.token_logprob == pytest.approx(ref[1, out.token_ids[1]])


def test_logprobs_top_n_larger_than_the_vocabulary():
    logits = np.array([[0.0, 1.0, 2.0]], dtype=np.float32)
    out = sample(logits, [seq(SamplingParams(temperature=0.0, logprobs=20))])
    assert out.logprobs[0].top_ids == [2, 1, 0]
