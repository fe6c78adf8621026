"""A step's metadata: host arrays in pinned staging, copied to the device in one piece.

Contract:
- `MetaLayout` places named typed arrays at fixed offsets of one byte buffer; the same
  offsets hold on the device, so one `cuMemcpyHtoDAsync` of the used prefix moves a step.
  Forward fields come first, then sampler parameters, then the penalty entries (variable
  length, last), so a greedy step copies only the forward part.
- `decode_layout(B, max_blocks, pen_capacity)`: a graph bucket of B one-token sequences
  (fixed, so the captured graph's pointers stay valid). `eager_layout(...)`: any step.
- `fill_forward_*` and `fill_sampling` write a step's SeqSteps into the views (hot path: once
  per step; numpy where it pays, plain loops over sequences otherwise).
"""

from typing import NamedTuple, Optional, Sequence

import numpy as np

from ...core.executor import SeqStep
from ..sampling import distinct_counts

META_ALIGN = 16


class MetaLayout(NamedTuple):
    fields: dict                # name -> (offset, dtype, count)
    forward_bytes: int          # end of the forward fields
    sampler_bytes: int          # end of the fixed sampler fields (penalty entries follow)
    nbytes: int                 # everything, penalty capacity included

    def views(self, buf: np.ndarray) -> dict:
        return {name: buf[off:off + np.dtype(dt).itemsize * n].view(dt) for name, (off, dt, n) in self.fields.items()}

    def ptrs(self, base: int) -> dict:
        return {name: base + off for name, (off, _, _) in self.fields.items()}

    def used_bytes(self, sampling: bool, num_entries: int) -> int:
        if not sampling:
            return self.forward_bytes
        return self.sampler_bytes + 8 * num_entries


def _layout(forward: list, sampler: list, pen_capacity: int) -> MetaLayout:
    fields, offset = {}, 0

    def place(group):
        nonlocal offset
        for name, dtype, count in group:
            offset = -(-offset // META_ALIGN) * META_ALIGN
            fields[name] = (offset, dtype, count)
            offset += np.dtype(dtype).itemsize * count
        return offset
    forward_bytes = place(forward)
    sampler_bytes = place(sampler)
    place([("pen_entries", np.int32, 2 * pen_capacity)])
    sampler_bytes = fields["pen_entries"][0]
    return MetaLayout(fields, forward_bytes, sampler_bytes, offset)


def _sampler_fields(R: int) -> list:
    return [("dparams", np.float64, 4 * R), ("rng", np.uint64, 2 * R), ("fparams", np.float32, 4 * R),
            ("iparams", np.int32, 4 * R), ("pen_row_ptr", np.int32, R + 1)]


def decode_layout(B: int, max_blocks: int, pen_capacity: int) -> MetaLayout:
    forward = [("token_ids", np.int32, B), ("positions", np.int32, B), ("slot_mapping", np.int32, B),
               ("block_tables", np.int32, B * max_blocks)]
    return _layout(forward, _sampler_fields(B), pen_capacity)


def eager_layout(T: int, S: int, R: int, ld_bt: int, num_items: int, pen_capacity: int) -> MetaLayout:
    forward = [("token_ids", np.int32, T), ("positions", np.int32, T), ("slot_mapping", np.int32, T),
               ("block_tables", np.int32, S * ld_bt), ("items", np.int32, 3 * num_items),
               ("logits_rows", np.int32, R)]
    return _layout(forward, _sampler_fields(R), pen_capacity)


# ------------------------------------------------------------------ filling (hot path)

def fill_decode(v: dict, seqs: Sequence[SeqStep], B: int, max_blocks: int, block_size: int, scratch_block: int,
                row_keys: list, limits: tuple) -> bool:
    """B-row bucket from len(seqs) <= B decode SeqSteps; padding rows write the scratch block.

    row_keys[r] remembers which (sequence, number of blocks, last block) row r of these views
    holds, so an unchanged block table is not written again (the caller resets the keys when
    the bytes are used for anything else, or when a sequence is prefilled: recompute after
    preemption gives new blocks). `limits` = (vocab_size, max_positions, num_blocks): bad
    values raise here, by name. -> whether any row needs more than argmax."""
    vocab_size, max_positions, num_blocks = limits
    tables = v["block_tables"].reshape(B, max_blocks)
    toks, poss, slots = [], [], []
    full = False
    for r, s in enumerate(seqs):
        p, bt, tok = s.start_pos, s.block_table, s.token_ids[0]
        nb, bi = len(bt), s.start_pos // block_size
        if not 0 <= tok < vocab_size:
            raise ValueError(f"sequence {s.seq_id}: token id {tok} out of range [0, {vocab_size})")
        if p >= max_positions or bi >= nb or nb > max_blocks:
            raise ValueError(f"sequence {s.seq_id}: {nb} KV blocks for position {p} (at most {max_blocks} "
                             f"blocks of {block_size}, the CUDA executor's max_model_len {max_positions})")
        key = (s.seq_id, nb, bt[-1])
        if row_keys[r] != key:
            if min(bt) < 0 or max(bt) >= num_blocks:
                raise ValueError(f"sequence {s.seq_id}: block id out of range [0, {num_blocks})")
            tables[r, :nb] = bt
            row_keys[r] = key
        toks.append(tok)
        poss.append(p)
        slots.append(bt[bi] * block_size + p % block_size)
        sp = s.sampling
        full = full or sp.temperature != 0.0 or sp.logprobs is not None or sp.has_penalties
    n = len(seqs)
    v["token_ids"][:n] = toks
    v["positions"][:n] = poss
    v["slot_mapping"][:n] = slots
    if n < B:
        v["token_ids"][n:] = 0
        v["positions"][n:] = 0
        v["slot_mapping"][n:] = scratch_block * block_size
        for r in range(n, B):
            if row_keys[r] != "pad":
                tables[r, 0] = scratch_block
                row_keys[r] = "pad"
    return full


def fill_eager(v: dict, seqs: Sequence[SeqStep], ld_bt: int, block_size: int, queries_per_item: int) -> None:
    """Any mix of prefill chunks and decode tokens (mirrors kernels/forward_batch.py)."""
    tables = v["block_tables"].reshape(len(seqs), ld_bt)
    t = 0
    items, rows = [], []
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        v["token_ids"][t:t + n] = s.token_ids
        p = np.arange(s.start_pos, s.start_pos + n, dtype=np.int32)
        v["positions"][t:t + n] = p
        bt = np.asarray(s.block_table, dtype=np.int32)
        tables[i, :len(bt)] = bt
        tables[i, len(bt):] = 0
        v["slot_mapping"][t:t + n] = bt[p // block_size] * block_size + p % block_size
        for q0 in range(0, n, queries_per_item):
            items.append((i, t + q0, min(queries_per_item, n - q0)))
        if s.sample:                        # a speculating sequence: its last 1 + num_spec rows
            rows.extend(range(t + n - 1 - s.num_spec, t + n))
        t += n
    v["items"][:] = np.asarray(items, dtype=np.int32).reshape(-1)
    v["logits_rows"][:] = rows


def count_items(seqs: Sequence[SeqStep], queries_per_item: int) -> int:
    return sum(-(-len(s.token_ids) // queries_per_item) for s in seqs)


def fill_sampling(v: dict, seqs: Sequence[SeqStep], capacity: int, row_keys: Optional[list] = None) -> int:
    """Sampler parameters of the rows that sample, in order. -> number of penalty entries.

    `row_keys` (a decode bucket's, kept across steps as fill_decode's are, reset with them):
    row_keys[r] = (sequence, its SamplingParams, seed) whose parameters row r holds ("pad": a
    padding row's; None: unknown); such a row gets only its RNG counter, one assignment for all
    rows. Four row assignments for every row cost ~2 us a row, most of a batch-64 step's host
    time. A row with penalties is written whole every step (its entries move)."""
    R = len(seqs)
    d, f, ip, rng = (v["dparams"].reshape(-1, 4), v["fparams"].reshape(-1, 4),
                     v["iparams"].reshape(-1, 4), v["rng"].reshape(-1, 2))
    row_ptr, entries = v["pen_row_ptr"], v["pen_entries"]
    keys = row_keys if row_keys is not None else [None] * len(d)     # an eager step's: kept nowhere
    counters, ptrs = [], []
    e = 0
    for r, s in enumerate(seqs):
        p = s.sampling
        counters.append(len(s.output_token_ids) + s.num_pending)    # a pending token counts (executor.py)
        ptrs.append(e)
        key = keys[r]
        if key is not None and key[0] == s.seq_id and key[1] is p and key[2] == s.seed:
            continue
        keys[r] = None                      # until the row is whole again (a penalty overflow raises)
        penalties = p.has_penalties
        d[r] = (p.temperature, p.top_p, p.min_p, 0.0)
        f[r] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, 0.0)
        ip[r] = (p.top_k, -1 if p.logprobs is None else p.logprobs, int(penalties), 0)
        rng[r, 0] = s.seed
        if penalties:
            e = _penalty_entries(entries, e, s, capacity)
        keys[r] = None if penalties else (s.seq_id, p, s.seed)
    rng[:R, 1] = counters
    row_ptr[:R] = ptrs
    if any(k != "pad" for k in keys[R:]):
        d[R:] = 0.0                               # padding rows of a bucket: greedy, no extras
        ip[R:] = (0, -1, 0, 0)
        keys[R:] = ["pad"] * (len(keys) - R)
    row_ptr[R:] = e
    return e


def _penalty_entries(entries: np.ndarray, e: int, s: SeqStep, capacity: int) -> int:
    out = np.asarray(s.output_token_ids, dtype=np.int64)
    seen, _ = distinct_counts(np.concatenate([np.asarray(s.prompt_token_ids, dtype=np.int64), out]))
    if e + len(seen) > capacity:
        raise ValueError(f"penalty context of {e + len(seen)} distinct tokens in one step exceeds the CUDA "
                         f"executor's capacity of {capacity} (raise max_penalty_tokens)")
    counts = np.zeros(len(seen), dtype=np.int32)
    if len(out):
        idx, c = distinct_counts(out)
        counts[np.searchsorted(seen, idx)] = c
    pairs = entries[2 * e:2 * (e + len(seen))].reshape(-1, 2)
    pairs[:, 0] = np.clip(seen, -1, np.iinfo(np.int32).max)
    pairs[:, 1] = counts
    return e + len(seen)


def needs_full_sampler(seqs: Sequence[SeqStep]) -> bool:
    """Any row with temperature, penalties or logprobs (else argmax alone does)."""
    return any(not s.sampling.greedy or s.sampling.logprobs is not None or s.sampling.has_penalties for s in seqs)


def check_eager(seqs, T: int, max_tokens: int, max_num_seqs: int, max_model_len: int, max_blocks: int,
                block_size: int, num_blocks: int, vocab_size: int) -> None:
    """An eager step's limits, each failure named (cheap next to the step itself)."""
    if T > max_tokens:
        raise ValueError(f"a step of {T} tokens exceeds the CUDA executor's max_num_batched_tokens {max_tokens}")
    if len(seqs) > max_num_seqs:
        raise ValueError(f"a step of {len(seqs)} sequences exceeds the CUDA executor's max_num_seqs {max_num_seqs}")
    for s in seqs:
        end = s.start_pos + len(s.token_ids)
        if end > max_model_len:
            raise ValueError(f"sequence {s.seq_id} reaches position {end}, past max_model_len {max_model_len}")
        if len(s.block_table) * block_size < end or len(s.block_table) > max_blocks:
            raise ValueError(f"sequence {s.seq_id}: {len(s.block_table)} KV blocks for {end} tokens")
        if s.block_table and (max(s.block_table) >= num_blocks or min(s.block_table) < 0):
            raise ValueError(f"sequence {s.seq_id}: block id out of range [0, {num_blocks})")
        if s.token_ids and (min(s.token_ids) < 0 or max(s.token_ids) >= vocab_size):
            raise ValueError(f"sequence {s.seq_id}: token id out of range [0, {vocab_size})")
