"""kernels/cuda/meta.py without a GPU: a decode bucket's sampler rows, kept across steps by
their keys, hold the bytes a full rewrite of every row would write, step after step, as rows
change hands, change parameters, take penalties, and fall to padding."""

import numpy as np
import pytest

from tokenwire.core.executor import DecodeStep
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.kernels.cuda.meta import decode_layout, fill_sampling

B, CAPACITY = 8, 256
TEMPERATURE = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64)
TOP_K = SamplingParams(temperature=1.0, top_k=5, logprobs=2, max_tokens=64)
PENALTIES = SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=64)


def decode(seq_id: int, params: SamplingParams, seed: int, num_out: int) -> DecodeStep:
    return DecodeStep(seq_id, (3,), 10 + num_out, [seq_id], True, params, seed, [4, 5, 6, seq_id],
                      [7 + (seq_id + i) % 5 for i in range(num_out)], num_pending=seq_id % 2)


def steps() -> list:
    """Each step's rows: the same requests going on, one replaced (another request, same params
    object), one changing its params, a penalty row, the batch shrinking and growing."""
    live = {r: (100 + r, TEMPERATURE if r % 2 else TOP_K, 1000 + r) for r in range(B)}
    out = []
    for k in range(12):
        if k == 3:
            live[2] = (200, live[2][1], 5)                  # another request in the row
        if k == 5:
            live[4] = (live[4][0], TEMPERATURE if live[4][1] is TOP_K else TOP_K, live[4][2])
        if k == 6:
            live[1] = (300, PENALTIES, 7)
        rows = B if k < 7 or k > 9 else 5                   # padding rows from step 7 to 9
        out.append([decode(sid, params, seed, num_out=k + sid % 3) for r, (sid, params, seed) in sorted(live.items())
                    if r < rows])
    return out


def test_kept_sampler_rows_hold_what_a_full_rewrite_writes():
    layout = decode_layout(B, 4, CAPACITY)
    # a slot's staging held another layout before: what neither writes (alignment gaps, the
    # unread fields of padding rows) stays as it was, in both
    kept, full = np.full(layout.nbytes, 0xA5, np.uint8), np.full(layout.nbytes, 0xA5, np.uint8)
    keys = [None] * B
    for k, seqs in enumerate(steps()):
        entries = fill_sampling(layout.views(kept), seqs, CAPACITY, keys)
        assert fill_sampling(layout.views(full), seqs, CAPACITY) == entries
        lo, hi = layout.forward_bytes, layout.used_bytes(True, entries)
        assert kept[lo:hi].tobytes() == full[lo:hi].tobytes(), f"step {k}"
        held = [key for key in keys[:len(seqs)] if key is not None]
        assert len(held) == sum(not s.sampling.has_penalties for s in seqs)     # penalty rows: whole each step
        assert all(key == "pad" for key in keys[len(seqs):])


def test_a_row_whose_write_raised_is_written_again():
    """A penalty context over the capacity raises after the row's parameters were written: the
    row's key no longer names its old request, so that request, back in the row, is written."""
    layout = decode_layout(B, 4, CAPACITY)
    kept, full = np.full(layout.nbytes, 0xA5, np.uint8), np.full(layout.nbytes, 0xA5, np.uint8)
    keys = [None] * B
    before = decode(1, TEMPERATURE, 11, 3)
    fill_sampling(layout.views(kept), [before], CAPACITY, keys)
    too_many = DecodeStep(2, (3,), 10, [2], True, PENALTIES, 22, list(range(CAPACITY + 1)), [], num_pending=0)
    with pytest.raises(ValueError, match="exceeds the CUDA executor's capacity"):
        fill_sampling(layout.views(kept), [too_many], CAPACITY, keys)
    fill_sampling(layout.views(kept), [before], CAPACITY, keys)
    fill_sampling(layout.views(full), [before], CAPACITY)
    lo, hi = layout.forward_bytes, layout.used_bytes(True, 0)
    assert kept[lo:hi].tobytes() == full[lo:hi].tobytes()
