"""How the engine benchmarks time a forward: one prefill step of B prompts, then decode steps.

Shared by `tokenwire bench engine` (bench/engine.py: random-weight engines of a shape) and
its `--vs llama.cpp` comparison (bench/vs_llama.py), which gives llama.cpp the same prompt
(`bench_prompt`) and the same steps.
"""

import time

import numpy as np

from ..core.executor import SeqStep
from ..core.options import DEFAULTS
from ..core.sampling_params import SamplingParams
from ..kernels.forward_batch import build_forward_batch

BLOCK_SIZE = DEFAULTS.block_size          # the served engine's KV block (core/options.py)


def bench_prompt(config, batch: int, prompt_len: int) -> list:
    """The prompt every sequence of a `batch`-sized run gets: random ids, fixed per batch size."""
    return [int(t) for t in np.random.default_rng(batch).integers(0, config.vocab_size, prompt_len)]


def steps_for(batch: int, prompt: list, start: int, tables: list):
    greedy = SamplingParams(temperature=0.0)
    return [SeqStep(i, prompt if start == 0 else [prompt[0]], start, tables[i], True, greedy, 0, [], [])
            for i in range(batch)]


def time_batch(model, config, batch: int, prompt_len: int, num_steps: int, profile: bool = False) -> dict:
    """Prefill B prompts in one step, then decode (step i feeds prompt[i % prompt_len]);
    -> prefill tokens/s, decode step times (s)."""
    total = prompt_len + num_steps + 1
    blocks_per_seq = -(-total // BLOCK_SIZE)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompt = bench_prompt(config, batch, prompt_len)
    batch_data = build_forward_batch(steps_for(batch, prompt, 0, tables), BLOCK_SIZE)
    t0 = time.perf_counter()
    model.forward(batch_data)
    prefill_s = time.perf_counter() - t0
    step_s = []
    if profile:
        model.profile(reset=True)
    for i in range(num_steps + 1):                          # the first decode step warms up
        data = build_forward_batch(steps_for(batch, prompt[i % prompt_len:], prompt_len + i, tables), BLOCK_SIZE)
        t0 = time.perf_counter()
        model.forward(data)
        if i:
            step_s.append(time.perf_counter() - t0)
    return {"prefill_tokens_per_s": batch * prompt_len / prefill_s, "step_s": step_s}
