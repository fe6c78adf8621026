"""The flat arrays one forward pass consumes, built from a step's `SeqStep`s.

Every backend's forward takes the same `ForwardBatch`: the step's new tokens concatenated
over sequences (prefill chunks and decode tokens mixed), where each one's K/V goes in the
paged cache, and which positions need logits. Building it is the one place where the
scheduler's lists become arrays.
"""

from typing import NamedTuple, Sequence

import numpy as np

from .executor import SeqStep


class ForwardBatch(NamedTuple):
    token_ids: np.ndarray       # int32 [T]     new tokens of all sequences, concatenated
    positions: np.ndarray       # int32 [T]     position of each new token in its sequence
    seq_starts: np.ndarray      # int32 [S + 1] sequence s owns token_ids[seq_starts[s]:seq_starts[s + 1]]
    context_lens: np.ndarray    # int32 [S]     tokens in the cache once this step is written
    block_tables: np.ndarray    # int32 [S, max_blocks] physical KV block ids; unused tail is 0
    slot_mapping: np.ndarray    # int32 [T]     cache slot (block * block_size + offset) of each new token
    logits_indices: np.ndarray  # int32 [S_sample] rows of T whose logits are wanted, in SeqStep order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def build_forward_batch(seqs: Sequence[SeqStep], block_size: int) -> ForwardBatch:
    """Flatten a step's sequences (hot path: once per step)."""
    num_tokens = [len(s.token_ids) for s in seqs]
    seq_starts = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=seq_starts[1:])
    token_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int32, count=int(seq_starts[-1]))
    start_pos = np.array([s.start_pos for s in seqs], dtype=np.int32)
    context_lens = start_pos + np.asarray(num_tokens, dtype=np.int32)
    # positions: start_pos of the owning sequence plus the offset inside its chunk
    owner = np.repeat(np.arange(len(seqs), dtype=np.int32), num_tokens)
    positions = (np.arange(len(token_ids), dtype=np.int32) - seq_starts[owner] + start_pos[owner]).astype(np.int32)
    max_blocks = max((len(s.block_table) for s in seqs), default=0)
    block_tables = np.zeros((len(seqs), max(max_blocks, 1)), dtype=np.int32)
    for i, s in enumerate(seqs):
        block_tables[i, :len(s.block_table)] = s.block_table
    slot_mapping = (block_tables[owner, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    logits_indices = np.array([seq_starts[i + 1] - 1 for i, s in enumerate(seqs) if s.sample], dtype=np.int32)
    return ForwardBatch(token_ids, positions, seq_starts, context_lens, block_tables, slot_mapping, logits_indices)
