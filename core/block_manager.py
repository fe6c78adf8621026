"""Paged KV cache accounting: which physical blocks are free, how many holders each has, and
which full blocks hold known content (the prefix cache).

Contract:
- The cache is `num_blocks` blocks of `block_size` token slots; the executor owns the
  memory, this class owns only the bookkeeping (ints, bytes, lists and dicts; no tensor library).
- A sequence's block table is a plain `list[int]` that it owns; `append_slot` grows it in
  place so it covers a number of tokens, `free` releases every block in it.
- Every block has a reference count. `allocate` hands out blocks with count 1; `share`
  adds a holder (a fork or a cache hit points two tables at one block); `free` drops one
  holder per block. Freeing a block that has no holder raises `BlockAccountingError`: a
  double free is a bug, not a no-op.
- Prefix cache (on when a `prefix_cache_identity` is given): a full block whose K/V are computed can be
  registered under its content hash (`cache_block`): the hash chains over the block's token
  ids and its predecessor's hash (`chain_hashes`), from a root that names the model, so one
  hash names one whole prefix. A block with no holder left is then *evictable*, not free:
  its content stays reachable through `cached` and `take_cached` gives it a holder again.
  Every block with no holder is in exactly one of two places:
    `free_block_ids`   plain free blocks (a stack),
    `evictable`        cached blocks, least recently released first (an insertion-ordered dict).
  Allocation takes a plain free block first and evicts the least recently released cached
  block only when none is left, so a cached prefix survives until its memory is needed.
  A block with holders is never evicted. `free` releases a table's blocks last block first,
  so a prefix's tail is evicted before its head (a head evicted first would strand the tail).
- `num_free_blocks` (plain + evictable) / `num_used_blocks` are exact at every moment.

Pairs: can_allocate / allocate, can_append_slot / append_slot (append_block: its one-block
form), share / free, cache_block / (eviction), match_prefix / take_cached.
"""

import hashlib
import struct
from collections import Counter
from typing import Iterable, Optional

from .errors import BlockAccountingError


def root_hash(model_identity: str) -> bytes:
    """The chain's start: every cached block of one model descends from it, so two models (or
    one model at two precisions) never share a block."""
    return hashlib.blake2b(model_identity.encode(), digest_size=16).digest()


def chain_hashes(parent: bytes, token_ids, block_size: int) -> list:
    """Hashes of the full blocks of `token_ids` (a multiple of `block_size` ids), the first one
    chained to `parent`. blake2b, not Python's hash(): an int tuple's hash is predictable, and
    a client who could make a collision would read another's K/V. ~1 us a block."""
    hashes = []
    # one conversion, native int32s as array("i") lays them out; a block is a slice of it.
    # struct, not array: array's constructor parses each int through PyArg_Parse (~4 us for
    # 96 ids against ~1 us), and every request hashes its blocks twice (prefill, release)
    data = struct.pack("=%di" % len(token_ids), *token_ids)
    step = block_size * 4
    for i in range(0, len(token_ids) // block_size * step, step):
        parent = hashlib.blake2b(parent + data[i:i + step], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache_identity: Optional[str] = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV cache needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # the prefix cache is on when the model is named: its blocks' hash chains start from it
        self.enable_prefix_caching = prefix_cache_identity is not None
        self.root_hash = root_hash(prefix_cache_identity) if self.enable_prefix_caching else b""
        self.ref_counts = [0] * num_blocks                      # holders per block
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ...
        self.block_hashes: list = [None] * num_blocks           # list[bytes | None]: a cached block's content hash
        self.cached = {}                                        # content hash -> block id
        self.evictable = {}                                     # block id -> None, least recently released first
        self.num_evictions = 0
        self.cache_version = 0                                  # bumped whenever `cached` changes (lookups memoize on it)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids) - len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content the cache can hand out again (held or evictable)."""
        return len(self.cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list, num_tokens: int) -> int:
        """Blocks `block_table` lacks to cover `num_tokens` tokens (0 when it already does)."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids) + len(self.evictable)

    def allocate(self, num_blocks: int) -> list:
        """Take `num_blocks` free blocks, each with one holder; evicts cached ones only when the
        plain free list runs out. -> list[int]"""
        if num_blocks > len(self.free_block_ids) + len(self.evictable):
            raise BlockAccountingError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} are free")
        if num_blocks <= 0:
            return []
        num_plain = min(num_blocks, len(self.free_block_ids))
        block_ids = self.free_block_ids[len(self.free_block_ids) - num_plain:]
        del self.free_block_ids[len(self.free_block_ids) - num_plain:]
        for _ in range(num_blocks - num_plain):
            block_ids.append(self._evict_one())
        ref_counts = self.ref_counts
        for b in block_ids:
            ref_counts[b] = 1
        return block_ids

    def _evict_one(self) -> int:
        """The least recently released cached block, its content forgotten. -> its id"""
        block_id = next(iter(self.evictable))
        del self.evictable[block_id]
        del self.cached[self.block_hashes[block_id]]
        self.block_hashes[block_id] = None
        self.num_evictions += 1
        self.cache_version += 1
        return block_id

    def can_append_slot(self, block_table: list, num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= self.num_free_blocks

    def append_slot(self, block_table: list, num_tokens: int) -> None:
        """Grow `block_table` in place until it covers `num_tokens` tokens (hot path: per decode
        step it is one comparison, and one block every `block_size` tokens)."""
        needed = -(-num_tokens // self.block_size) - len(block_table)
        if needed > 0:
            block_table.extend(self.allocate(needed))

    def append_block(self, block_table: list) -> None:
        """Grow `block_table` by one free block (hot path: a decode stepping into a new block;
        append_slot's general path cost ~0.5 us a request, all of a lockstep batch at once)."""
        if self.free_block_ids:
            block_id = self.free_block_ids.pop()
        elif self.evictable:
            block_id = self._evict_one()
        else:
            raise BlockAccountingError("asked for 1 KV block, 0 are free")
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
        """Drop one holder from each block, last block first; a block with no holder left is
        free again, or evictable when it is cached. Checks everything before changing
        anything, so a bad call leaves the counts intact."""
        ref_counts = self.ref_counts
        block_ids = list(block_ids)
        # a table's blocks are distinct: one drop each (a Counter per request cost ~2 us)
        drops = dict.fromkeys(block_ids, 1) if len(set(block_ids)) == len(block_ids) else Counter(block_ids)
        for b, n in drops.items():
            if not 0 <= b < self.num_blocks or ref_counts[b] < n:
                raise BlockAccountingError(f"KV block {b} freed {n} time(s) but has "
                                           f"{ref_counts[b] if 0 <= b < self.num_blocks else 0} holder(s) "
                                           f"(double free?)")
        block_hashes = self.block_hashes
        for b in reversed(block_ids):
            ref_counts[b] -= 1
            if ref_counts[b] == 0:
                if block_hashes[b] is None:
                    self.free_block_ids.append(b)
                else:
                    self.evictable[b] = None

    # ------------------------------------------------------------------ prefix cache

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a held, full, computed block under its content hash. A block already cached
        keeps its hash; when another block holds the same content (two requests computed one
        prefix at once), the first stays the cached one and this block stays plain."""
        if self.ref_counts[block_id] == 0:
            raise BlockAccountingError(f"cannot cache KV block {block_id}: it has no holder")
        if self.block_hashes[block_id] is None and block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
            self.cache_version += 1

    def match_prefix(self, hashes: list) -> list:
        """The cached blocks of the longest prefix of `hashes` (a request's chained block
        hashes). Changes nothing. -> list[int]"""
        cached, block_ids = self.cached, []
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            block_ids.append(b)
        return block_ids

    def num_evictable_in(self, block_ids: list) -> int:
        """How many of these cached blocks have no holder: taking them uses up free blocks."""
        evictable = self.evictable
        return sum(1 for b in block_ids if b in evictable)

    def take_cached(self, block_ids: list, block_table: list) -> None:
        """Append cached blocks (from `match_prefix`) to an empty-tailed `block_table`, one
        holder each; an evictable one stops being evictable."""
        ref_counts, evictable, block_hashes = self.ref_counts, self.evictable, self.block_hashes
        for b in block_ids:
            if block_hashes[b] is None:
                raise BlockAccountingError(f"KV block {b} is not cached")
        for b in block_ids:
            if ref_counts[b] == 0:
                del evictable[b]
            ref_counts[b] += 1
        block_table.extend(block_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached content (evictable blocks become plain free ones), e.g. after a
        failed step whose device state is not trusted."""
        for b in self.evictable:
            self.free_block_ids.append(b)
        self.evictable.clear()
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self.cache_version += 1
