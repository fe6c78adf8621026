"""build_forward_batch against its sequence-by-sequence reference: every array, every dtype,
on mixed steps, small and large pure-decode steps, and through a BlockTables cache kept across
steps while tables grow, rows shift and a preempted sequence comes back on other blocks."""

import numpy as np
import pytest

from tokenwire.core.executor import DecodeStep, SeqStep
from tokenwire.kernels.forward_batch import (SMALL_DECODE, BlockTables, build_forward_batch,
                                          build_forward_batch_reference)
from tokenwire.core.sampling_params import SamplingParams

P = SamplingParams()
BS = 4


def assert_same(got, want):
    for name in want._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == np.int32 and a.shape == b.shape and np.array_equal(a, b), name


def random_step(rng, num_seqs, decode_only=False, speculative=False):
    seqs, next_block = [], 0
    for i in range(num_seqs):
        start = int(rng.integers(0, 60))
        n = 1 if decode_only or rng.random() < 0.5 else int(rng.integers(1, 20))
        num_blocks = -(-(start + n) // BS) + int(rng.integers(0, 3))         # some tables longer than needed
        table = [int(b) for b in rng.permutation(np.arange(next_block, next_block + num_blocks))]
        next_block += num_blocks
        ids = rng.integers(0, 1000, n).tolist()
        if n == 1 and rng.random() < 0.5:
            seqs.append(DecodeStep(i, tuple(ids), start, table, bool(rng.random() < 0.9), P, 0, [1], []))
        elif speculative and rng.random() < 0.6:    # a decode verifying n - 1 proposals: its last n rows
            seqs.append(SeqStep(i, ids, start, table, True, P, 0, [1], [], None, n - 1))
        else:
            seqs.append(SeqStep(i, ids, start, table, bool(rng.random() < 0.7), P, 0, [1], []))
    return seqs


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("num_seqs", [0, 1, 3, SMALL_DECODE, SMALL_DECODE + 1, 40])
def test_fast_builder_equals_the_reference(num_seqs, decode_only):
    rng = np.random.default_rng(num_seqs * 2 + decode_only)
    for _ in range(20):
        seqs = random_step(rng, num_seqs, decode_only)
        want = build_forward_batch_reference(seqs, BS)
        assert_same(build_forward_batch(seqs, BS), want)
        assert_same(build_forward_batch(seqs, BS, BlockTables()), want)


@pytest.mark.parametrize("num_seqs", [1, 2, 5, 40])
def test_speculative_rows_equal_the_reference(num_seqs):
    rng = np.random.default_rng(100 + num_seqs)
    for _ in range(30):
        seqs = random_step(rng, num_seqs, speculative=True)
        want = build_forward_batch_reference(seqs, BS)
        assert len(want.logits_indices) == sum((1 + s.num_spec) * s.sample for s in seqs)
        assert_same(build_forward_batch(seqs, BS), want)
        assert_same(build_forward_batch(seqs, BS, BlockTables()), want)


def test_block_tables_cache_follows_growth_shifts_and_preemption():
    rng = np.random.default_rng(3)
    cache = BlockTables()
    free = list(range(10000))
    tables = {i: [free.pop() for _ in range(int(rng.integers(1, 6)))] for i in range(12)}
    for step in range(300):
        live = sorted(tables)
        if rng.random() < 0.1 and len(live) > 2:                  # a request finishes: later rows shift
            free += tables.pop(live[int(rng.integers(0, len(live)))])
        if rng.random() < 0.1:                                    # preemption: same list, refilled in place with
            victim = tables[live[-1]] if live[-1] in tables else tables[live[0]]     # the same length, new blocks
            n, last = len(victim), victim[-1]
            free += victim
            victim.clear()
            victim += [free.pop(0) for _ in range(n - 1)] + [last]
        if rng.random() < 0.1:
            tables[max(tables) + 1] = [free.pop() for _ in range(int(rng.integers(1, 4)))]
        for t in tables.values():                                 # decodes cross block boundaries
            if rng.random() < 0.25:
                t.append(free.pop())
        seqs = [DecodeStep(i, (7,), len(t) * BS - 1, t, True, P, 0, [1], []) for i, t in sorted(tables.items())]
        if step % 7 == 0:
            seqs.append(SeqStep(999, [1, 2, 3], 0, (5000, 5001), True, P, 0, [], []))   # a tuple table: no caching
        assert_same(build_forward_batch(seqs, BS, cache), build_forward_batch_reference(seqs, BS))
