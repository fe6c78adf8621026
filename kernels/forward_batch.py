"""The flat arrays one forward pass consumes, built from a step's `SeqStep`s.

Every backend's forward takes the same `ForwardBatch`: the step's new tokens concatenated
over sequences (prefill chunks and decode tokens mixed), where each one's K/V goes in the
paged cache, and which positions need logits. Building it is the one place where the
scheduler's lists become arrays.

`build_forward_batch` is the fast builder (a one-pass path for small pure-decode steps,
whole-array arithmetic otherwise); an executor passes its `BlockTables`, which keeps the
block-table array from step to step and rewrites only the rows whose table changed, so a
steady decode step converts no block id. `build_forward_batch_reference` is the readable
definition, sequence by sequence.
"""

from itertools import chain
from typing import NamedTuple, Optional, Sequence

import numpy as np

from ..core.executor import SeqStep


SMALL_DECODE = 128              # pure-decode steps up to this many sequences take the one-pass path (measured cross-over)
SMALL_VERIFY = 32               # other steps up to this many tokens too (a lone request verifying proposals:
                                # ~8 us against ~35 for the whole-array path)


class ForwardBatch(NamedTuple):
    token_ids: np.ndarray       # int32 [T]     new tokens of all sequences, concatenated
    positions: np.ndarray       # int32 [T]     position of each new token in its sequence
    seq_starts: np.ndarray      # int32 [S + 1] sequence s owns token_ids[seq_starts[s]:seq_starts[s + 1]]
    context_lens: np.ndarray    # int32 [S]     tokens in the cache once this step is written
    block_tables: np.ndarray    # int32 [S, max_blocks] physical KV block ids; unused tail is 0
    slot_mapping: np.ndarray    # int32 [T]     cache slot (block * block_size + offset) of each new token
    logits_indices: np.ndarray  # int32 [S_sample] rows of T whose logits are wanted, in SeqStep order
                                #   (1 + num_spec rows for a sequence verifying proposals)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def build_forward_batch(seqs: Sequence[SeqStep], block_size: int, tables: Optional["BlockTables"] = None
                        ) -> ForwardBatch:
    """Flatten a step's sequences (hot path: once per step). A pure-decode step of up to
    SMALL_DECODE sequences is one Python pass; otherwise Python touches each sequence a few
    times and no token one by one (ids go through a C iterator into numpy) and the rest is
    whole-array arithmetic. With `tables` (an executor's BlockTables) the block-table array
    is that cache's, valid until its next update; without, every array is fresh."""
    num_seqs = len(seqs)
    num_new = [len(s.token_ids) for s in seqs]                                  # [S]
    num_tokens = sum(num_new)
    block_tables = tables.update(seqs) if tables is not None else fresh_block_tables(seqs)
    if num_tokens == num_seqs <= SMALL_DECODE:
        return _small_decode(seqs, block_size, block_tables)
    if num_tokens <= SMALL_VERIFY:
        return _small_batch(seqs, block_size, block_tables)
    start_pos = np.array([s.start_pos for s in seqs], dtype=np.int32)          # [S]
    token_ids = np.fromiter(chain.from_iterable([s.token_ids for s in seqs]), dtype=np.int32, count=num_tokens)
    if num_tokens == num_seqs:                                                  # pure decode: one token each
        positions = start_pos
        seq_starts = np.arange(num_seqs + 1, dtype=np.int32)
        owner = seq_starts[:-1]
    else:
        seq_starts = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=seq_starts[1:])
        owner = np.repeat(np.arange(num_seqs, dtype=np.int32), num_new)        # [T] sequence of each token
        positions = np.arange(num_tokens, dtype=np.int32) - seq_starts[owner] + start_pos[owner]
    context_lens = start_pos + np.asarray(num_new, dtype=np.int32)
    slot_mapping = block_tables[owner, positions // block_size] * block_size + positions % block_size
    samples = np.fromiter([s.sample for s in seqs], dtype=bool, count=num_seqs)
    logits_indices = seq_starts[1:][samples] - 1
    if any([s.num_spec for s in seqs]):
        logits_indices = _speculative_rows(seqs, seq_starts)
    return ForwardBatch(token_ids, positions, seq_starts, context_lens, block_tables, slot_mapping, logits_indices)


def _speculative_rows(seqs: Sequence[SeqStep], seq_starts: np.ndarray) -> np.ndarray:
    """logits_indices when some sequences verify proposals: the last 1 + num_spec rows of each
    (core/speculative.py), the last row of other sampling ones; ascending. -> int32 [S_sample]"""
    counts = np.fromiter([(1 + s.num_spec) if s.sample else 0 for s in seqs], dtype=np.int32, count=len(seqs))
    ends = seq_starts[1:]                                                       # [S]
    firsts = np.repeat(ends - counts, counts)                                   # [R] each row's sequence's first row
    offsets = np.arange(len(firsts), dtype=np.int32) - np.repeat(np.cumsum(counts) - counts, counts)
    return (firsts + offsets).astype(np.int32)


def _small_decode(seqs: Sequence[SeqStep], block_size: int, block_tables: np.ndarray) -> ForwardBatch:
    """One-token sequences: one Python pass and one conversion beat a dozen numpy calls on
    small arrays (batch 1: ~6 us against ~12; batch 64: 27 against 32; even at ~200)."""
    rows = ([], [], [])                                     # token ids, positions, cache slots
    ids, positions, slots = rows
    for s in seqs:
        p = s.start_pos
        ids.append(s.token_ids[0])
        positions.append(p)
        slots.append(s.block_table[p // block_size] * block_size + p % block_size)
    arrays = np.array(rows, dtype=np.int32)                 # [3, S]
    seq_starts = np.arange(len(seqs) + 1, dtype=np.int32)
    if all([s.sample for s in seqs]):
        logits_indices = seq_starts[:-1]
    else:
        logits_indices = np.array([i for i, s in enumerate(seqs) if s.sample], dtype=np.int32)
    return ForwardBatch(arrays[0], arrays[1], seq_starts, arrays[1] + 1, block_tables, arrays[2], logits_indices)


def _small_batch(seqs: Sequence[SeqStep], block_size: int, block_tables: np.ndarray) -> ForwardBatch:
    """A few tokens in all (decodes verifying proposals, a short chunk): one Python pass over
    the tokens, one conversion."""
    rows = ([], [], [])                                     # token ids, positions, cache slots
    ids, positions, slots = rows
    seq_starts, context_lens, logits_indices = [0], [], []
    for s in seqs:
        table, p = s.block_table, s.start_pos
        ids += s.token_ids
        for pos in range(p, p + len(s.token_ids)):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        end = len(ids)
        seq_starts.append(end)
        context_lens.append(p + len(s.token_ids))
        if s.sample:
            logits_indices += range(end - 1 - s.num_spec, end)
    arrays = np.array(rows, dtype=np.int32)                 # [3, T]
    return ForwardBatch(arrays[0], arrays[1], np.array(seq_starts, dtype=np.int32),
                        np.array(context_lens, dtype=np.int32), block_tables, arrays[2],
                        np.array(logits_indices, dtype=np.int32))


def fresh_block_tables(seqs: Sequence[SeqStep]) -> np.ndarray:
    """int32 [S, max(1, longest table)], each row a sequence's table then zeros. Converting
    Python ints costs ~16 ns each: at batch 64 with 40 blocks each, ~40 us (see BlockTables)."""
    num_blocks = [len(s.block_table) for s in seqs]
    max_blocks = max(num_blocks, default=0)
    flat = np.fromiter(chain.from_iterable([s.block_table for s in seqs]), dtype=np.int32, count=sum(num_blocks))
    if max_blocks and min(num_blocks) == max_blocks:
        return flat.reshape(len(seqs), max_blocks)
    tables = np.zeros((len(seqs), max(max_blocks, 1)), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < np.asarray(num_blocks)[:, None]] = flat
    return tables


class BlockTables:
    """The block-table array kept from step to step by one executor: row r is rewritten only
    when the r-th sequence's table differs from the one the row holds. The test is a list
    comparison at C speed (the held copy shares the int objects, so equal entries compare by
    identity): ~0.2 us a row against ~16 ns a block to convert. A table appends a block every
    block_size tokens, so most steps rewrite nothing. Tables that are not lists are
    rewritten every step."""

    def __init__(self):
        self.array = np.zeros((0, 1), dtype=np.int32)     # int32 [rows, width]: rows beyond a table are 0
        self.held = []                                    # list[list[int] | None]: what each row holds

    def update(self, seqs: Sequence[SeqStep]) -> np.ndarray:
        """-> int32 [S, max(1, longest table)] view, valid until the next update (hot path)."""
        width = max(1, max([len(s.block_table) for s in seqs], default=0))
        if len(seqs) > self.array.shape[0] or width > self.array.shape[1]:
            self._grow(len(seqs), width)
        array, held = self.array, self.held
        for r, s in enumerate(seqs):
            table = s.block_table
            if type(table) is not list or table != held[r]:
                n = len(table)
                array[r, :n] = table
                array[r, n:] = 0
                held[r] = list(table) if type(table) is list else None
        return array[:len(seqs), :width]

    def _grow(self, num_rows: int, width: int) -> None:
        rows, cols = self.array.shape
        array = np.zeros((max(num_rows, 2 * rows), max(width, 2 * cols)), dtype=np.int32)
        array[:rows, :cols] = self.array
        self.array = array
        self.held += [None] * (array.shape[0] - rows)


def build_forward_batch_reference(seqs: Sequence[SeqStep], block_size: int) -> ForwardBatch:
    """The same arrays, sequence by sequence: the readable definition the fast builder is
    tested and benchmarked against."""
    token_ids, positions, slots, seq_starts, logits_indices = [], [], [], [0], []
    max_blocks = max([len(s.block_table) for s in seqs] + [1])
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        block_tables[i, :len(s.block_table)] = s.block_table
        for offset, token_id in enumerate(s.token_ids):
            pos = s.start_pos + offset
            token_ids.append(token_id)
            positions.append(pos)
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        seq_starts.append(len(token_ids))
        if s.sample:
            logits_indices += range(len(token_ids) - 1 - s.num_spec, len(token_ids))
    context_lens = [s.start_pos + len(s.token_ids) for s in seqs]
    return ForwardBatch(*(np.array(a, dtype=np.int32) for a in (token_ids, positions, seq_starts, context_lens)),
                        block_tables, np.array(slots, dtype=np.int32), np.array(logits_indices, dtype=np.int32))
