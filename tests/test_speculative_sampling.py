"""Sampling with speculation keeps the model's distribution: 20,000 sampled continuations
with n-gram speculation against 20,000 without (other seeds), on a random model of a
16-token vocabulary, per setting (temperature; temperature + top_p; temperature + top_k); a
chi-square test of homogeneity on the joint of the 2nd and 3rd tokens (both verified
positions) must not tell them apart at p >= 0.01."""

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from engines import engine_core
from tokenwire.core.outputs import Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.core.speculative import FixedCosts
from tokenwire.kernels import cpu
from spec_engines import random_engine, tiny_config

NUM_DRAWS = 20_000
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]      # a suffix that occurred before: proposals from the first decode
SETTINGS = {"temperature": dict(temperature=1.0), "top_p": dict(temperature=0.8, top_p=0.9),
            "top_k": dict(temperature=1.2, top_k=5)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # small weights: a flat enough next-token distribution that every cell is drawn
    return random_engine(tiny_config(vocab_size=16), tmp_path_factory.mktemp("vocab16"), seed=3, scale=1.2)


def sample_pairs(engine, settings: dict, method: str, first_seed: int):
    """-> ((2nd, 3rd) token pairs of NUM_DRAWS seeded requests, the engine's stats)"""
    backend = "cpu" if cpu.AVAILABLE else "reference"
    core = engine_core(engine, backend, max_num_seqs=256, max_num_batched_tokens=4096, max_queued_requests=NUM_DRAWS,
                       enable_prefix_caching=False)
    core.speculator.costs = FixedCosts()        # decisions from acceptance alone, whatever the machine's load
    params = [SamplingParams(max_tokens=4, ignore_eos=True, seed=first_seed + i, speculative=method,
                             num_speculative_tokens=3, **settings) for i in range(NUM_DRAWS)]
    for i, p in enumerate(params):
        core.add_request(i, PROMPT, p, Timeline())
    tokens = {}
    while core.has_unfinished():
        for o in core.step().rows:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    pairs = np.array([(t[1], t[2]) for t in tokens.values()])
    return pairs, core.stats()


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_speculative_sampling_keeps_the_distribution(engine, setting):
    spec, stats = sample_pairs(engine, SETTINGS[setting], "ngram", 0)
    plain, _ = sample_pairs(engine, SETTINGS[setting], "off", NUM_DRAWS)
    assert len(spec) == len(plain) == NUM_DRAWS
    # the proposals were verified, some kept and some not
    num_rejected = stats.num_spec_proposed - stats.num_spec_accepted
    assert stats.num_spec_steps >= NUM_DRAWS and stats.num_spec_accepted > 1000 and num_rejected > 1000
    cells = 16 * spec[:, 0] + spec[:, 1], 16 * plain[:, 0] + plain[:, 1]
    table = np.array([np.bincount(c, minlength=256) for c in cells])          # [2, 256]
    table = table[:, table.sum(axis=0) > 0]
    rare = table.sum(axis=0) < 20                   # pool the cells too rare for the chi-square approximation
    table = np.column_stack([table[:, ~rare], table[:, rare].sum(axis=1)]) if rare.any() else table
    assert table.shape[1] >= 10                     # a distribution, not a near-certain continuation
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value >= 0.01, (setting, p_value, table)
