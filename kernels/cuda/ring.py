"""The pinned host ring: where each step's sampled ids (and logprobs) land, one slot per step.

A slot owns pinned staging for the step's metadata (host -> device), pinned bytes for its
outputs (device -> host, same offsets as on the device from `acts.tokens`), and two events:
`done` (the step's kernels finished, compute stream) and `ready` (its ids are in `out`, copy
stream). Slots are used in order; one is free again once its step has been waited.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...core.executor import StepOutput, TopLogprobs
from .kernels import MAX_TOP_LOGPROBS


@dataclass
class RingSlot:
    staging: np.ndarray         # pinned uint8: the step's metadata
    out: np.ndarray             # pinned uint8: ids, then logprobs (same offsets as on the device)
    done: object                # event: the step's kernels finished
    ready: object               # event: its ids are in `out`
    in_flight: bool = False
    views: dict = field(default_factory=dict)   # graph bucket -> metadata views into `staging`
    layout: object = None       # what `staging` last held: a graph bucket, or "eager"
    row_keys: list = field(default_factory=list)   # per row of that bucket: whose block table it holds
    sampler_keys: list = field(default_factory=list)   # per row of that bucket: whose sampler parameters
    start: object = None        # timing event before the step's kernels (CudaOptions.step_timing), or None



def read_step(slot: RingSlot, num_rows: int, logprobs: Optional[tuple], offsets: tuple) -> StepOutput:
    """The step's output from the slot's pinned bytes (after its `ready` event)."""
    R = num_rows
    ids = slot.out[:4 * R].view(np.int32).tolist()
    if logprobs is None:
        return StepOutput(ids)
    lp_off, ids_off, top_off = offsets
    tl = slot.out[lp_off:lp_off + 8 * R].view(np.float64)
    top_ids = slot.out[ids_off:ids_off + 4 * R * MAX_TOP_LOGPROBS].view(np.int32).reshape(R, -1)
    top_lp = slot.out[top_off:top_off + 8 * R * MAX_TOP_LOGPROBS].view(np.float64).reshape(R, -1)
    rows = [None if n is None else TopLogprobs(float(tl[r]), top_ids[r, :n].tolist(), top_lp[r, :n].tolist())
            for r, n in enumerate(logprobs)]
    return StepOutput(ids, rows)
