"""The CPU executor: SeqSteps -> ForwardBatch -> forward -> sampling.

Contract:
- `ModelRunner(model, block_size, num_blocks)` implements `Executor` (core/executor.py) for
  any forward object with `.config` and `forward(ForwardBatch) -> float32 [S_sample, V]`
  that owns a paged KV cache of `num_blocks` x `block_size` (the numpy `ReferenceModel`
  today; the C-kernel model plugs in the same way). Sampling is kernels/sampling.py, with
  the backend's `exponentials` for temperature rows when it has them (kernels/cpu's C ones).
- `kv_cache_num_blocks(...)` sizes the cache from a memory budget; `create_runner(...)` makes
  the runner for a loaded engine directory over any forward factory, and `create_executor`
  is the "reference" row of kernels.BACKENDS (kernels/cpu's row uses the C forward).
"""

import logging
from typing import Callable, Optional, Sequence

from ..core.config import ModelConfig
from ..core.executor import SeqStep, StepOutput, SyncExecutor
from ..core.options import EngineOptions
from ..core.speculative import sampling_rows
from .forward_batch import BlockTables, build_forward_batch
from .model import ReferenceModel
from .sampling import sample

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30        # 1 GiB unless told otherwise
KV_BYTES_PER_VALUE = 4                  # the numpy reference keeps K and V in float32


class ModelRunner(SyncExecutor):
    """Executor over a forward object (hot path: `step`, once per engine step). Its step runs
    on the calling thread (`launch` computes it): it never overlaps."""

    def __init__(self, model, block_size: int, num_blocks: int, exponentials: Optional[Callable] = None):
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if getattr(model, name, value) != value:
                raise ValueError(f"the model's KV cache has {name}={getattr(model, name)}, the runner was given {value}")
        self.model = model
        self.config: ModelConfig = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_tables = BlockTables()                       # the batch's block-table array, kept across steps
        # a forward that also returns each row's argmax (kernels/cpu's CpuModel), or None
        self._forward_argmax = getattr(model, "forward_argmax", None)
        self._exponentials = exponentials                       # sample()'s, for temperature rows; None: numpy's

    def step(self, seqs: Sequence[SeqStep]) -> StepOutput:
        batch = build_forward_batch(seqs, self.block_size, self.block_tables)
        sampling_seqs = sampling_rows(seqs)                     # one per sampled row, speculated ones included
        if self._forward_argmax is not None and any(s.sampling.greedy for s in sampling_seqs):
            logits, argmax = self._forward_argmax(batch)        # greedy rows: argmax fused into lm_head
            return sample(logits, sampling_seqs, argmax, self._exponentials)
        logits = self.model.forward(batch)                      # [S_sample, V]
        if not sampling_seqs:
            return StepOutput([])
        return sample(logits, sampling_seqs, exponentials=self._exponentials)

    def close(self) -> None:
        self.model = self._forward_argmax = None                # drop weights and cache


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = KV_BYTES_PER_VALUE) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_value


def kv_cache_num_blocks(config: ModelConfig, block_size: int, max_model_len: int, max_num_seqs: int,
                        kv_cache_bytes: Optional[int] = None) -> int:
    """Blocks for `max_num_seqs` full contexts, capped by the byte budget (default 1 GiB), and
    never fewer than one full context (a request must always fit alone)."""
    per_block = kv_bytes_per_token(config) * block_size
    blocks_per_seq = -(-max_model_len // block_size)
    budget_blocks = (DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes) // per_block
    if kv_cache_bytes is not None and budget_blocks < blocks_per_seq:
        raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds {budget_blocks * block_size} tokens, "
                         f"fewer than one context of {max_model_len}; raise the budget or lower max_model_len "
                         f"({per_block} bytes per block of {block_size} tokens)")
    return max(blocks_per_seq, min(budget_blocks, blocks_per_seq * max_num_seqs))


def create_runner(engine, options: EngineOptions, max_model_len: int, model_factory: Callable,
                  exponentials: Optional[Callable] = None) -> ModelRunner:
    """A loaded engine directory -> ModelRunner over `model_factory(config, tensors,
    block_size, num_blocks)`, its KV cache sized by `kv_cache_num_blocks` unless the options
    fix the number of blocks; `exponentials` goes to `sample` (kernels/sampling.py)."""
    config = engine.config
    num_blocks = options.num_kv_blocks or kv_cache_num_blocks(config, options.block_size, max_model_len,
                                                              options.max_num_seqs, options.kv_cache_bytes)
    model = model_factory(config, engine.tensors, options.block_size, num_blocks)
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, options.block_size,
             num_blocks * options.block_size * kv_bytes_per_token(config) / 2**20)
    return ModelRunner(model, options.block_size, num_blocks, exponentials)


def create_executor(engine, options: EngineOptions, max_model_len: int) -> ModelRunner:
    """kernels.BACKENDS["reference"]: the numpy reference forward (kernels/model.py)."""
    return create_runner(engine, options, max_model_len, ReferenceModel)
