"""Paged KV cache accounting: which physical blocks are free, and how many holders each has.

Contract:
- The cache is `num_blocks` blocks of `block_size` token slots; the executor owns the
  memory, this class owns only the bookkeeping (ints and lists, no tensor library).
- A sequence's block table is a plain `list[int]` that it owns; `append_slot` grows it in
  place so it covers a number of tokens, `free` releases every block in it.
- Every block has a reference count. `allocate` hands out blocks with count 1; `share`
  adds a holder (a later prefix cache or a fork can point two tables at one block); `free`
  drops one holder per block and returns the block to the free list at zero. Freeing a
  block that has no holder raises `BlockAccountingError`: a double free is a bug, not a no-op.
- `num_free_blocks` / `num_used_blocks` are exact at every moment (metrics read them).

Pairs: can_allocate / allocate, can_append_slot / append_slot (append_block: its one-block
form), share / free.
"""

from collections import Counter
from typing import Iterable

from .errors import BlockAccountingError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV cache needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks                      # holders per block
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ...

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list, num_tokens: int) -> int:
        """Blocks `block_table` lacks to cover `num_tokens` tokens (0 when it already does)."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, num_blocks: int) -> list:
        """Take `num_blocks` free blocks, each with one holder. -> list[int]"""
        if num_blocks > len(self.free_block_ids):
            raise BlockAccountingError(f"asked for {num_blocks} KV blocks, {len(self.free_block_ids)} are free")
        if num_blocks <= 0:
            return []
        block_ids = self.free_block_ids[-num_blocks:]
        del self.free_block_ids[-num_blocks:]
        ref_counts = self.ref_counts
        for b in block_ids:
            ref_counts[b] = 1
        return block_ids

    def can_append_slot(self, block_table: list, num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= len(self.free_block_ids)

    def append_slot(self, block_table: list, num_tokens: int) -> None:
        """Grow `block_table` in place until it covers `num_tokens` tokens (hot path: per decode
        step it is one comparison, and one block every `block_size` tokens)."""
        needed = -(-num_tokens // self.block_size) - len(block_table)
        if needed > 0:
            block_table.extend(self.allocate(needed))

    def append_block(self, block_table: list) -> None:
        """Grow `block_table` by one free block (hot path: a decode stepping into a new block;
        append_slot's general path cost ~0.5 us a request, all of a lockstep batch at once)."""
        if not self.free_block_ids:
            raise BlockAccountingError("asked for 1 KV block, 0 are free")
        block_id = self.free_block_ids.pop()
        self.ref_counts[block_id] = 1
        block_table.append(block_id)

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one holder to blocks that already have one."""
        ref_counts = self.ref_counts
        for b in block_ids:
            if not 0 <= b < self.num_blocks or ref_counts[b] == 0:
                raise BlockAccountingError(f"cannot share KV block {b}: it is not allocated")
        for b in block_ids:
            ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block with no holder left is free again.
        Checks everything before changing anything, so a bad call leaves the counts intact."""
        ref_counts = self.ref_counts
        block_ids = list(block_ids)
        drops = Counter(block_ids)
        for b, n in drops.items():
            if not 0 <= b < self.num_blocks or ref_counts[b] < n:
                raise BlockAccountingError(f"KV block {b} freed {n} time(s) but has "
                                           f"{ref_counts[b] if 0 <= b < self.num_blocks else 0} holder(s) "
                                           f"(double free?)")
        for b in block_ids:
            ref_counts[b] -= 1
            if ref_counts[b] == 0:
                self.free_block_ids.append(b)
