"""The scheduler's side of prefix caching: which of a request's blocks are known, and when
its own become known. The block manager keeps the blocks and the hash index
(core/block_manager.py); this keeps the requests' hash chains and the cache-aware order.

Rules:
1. A request's full blocks are named by `chain_hashes` over its tokens (prompt, then output),
   computed once each, as they are needed (`Request.block_hashes`).
2. At admission a request takes the blocks of its longest cached prefix, never its last
   token (it is fed, to be sampled), and starts with them computed (`take`).
3. A block is registered once every token in it is computed (`cache_computed`): the
   scheduler calls it after a prefill chunk and when a request releases its blocks other than
   by failing (a decode's blocks then, in one chain: core/scheduler.py says why).
4. Admission order (`pick`, over the waiting queue sorted once per step by the scheduler):
   among the first ADMIT_WINDOW waiting requests of the head's priority, the one with the longest cached prefix goes first (ties: the oldest).
   Each time the oldest is passed over it counts; after MAX_PASSED_OVER it goes first
   whatever the cache holds, so no request waits more than MAX_PASSED_OVER admissions
   longer than first come first served would make it.
"""

from .block_manager import BlockManager, chain_hashes
from .request import Request

ADMIT_WINDOW = 8                    # waiting requests compared by cached prefix at each admission
MAX_PASSED_OVER = 4                 # admissions the oldest waiting request may cede to better-cached ones


class PrefixCache:
    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.num_queries = 0                # tokens of admitted requests looked up (at each admission)
        self.num_hits = 0                   # of which found cached

    def cached_prefix(self, req: Request) -> list:
        """Cached blocks of `req`'s longest cached prefix, short of its last token. -> list[int]
        Memoized on the request until the cache's content changes: a waiting request is looked
        up at every admission while it is in the window (up to ADMIT_WINDOW per admission)."""
        bm = self.block_manager
        num_blocks = (req.num_tokens - 1) // bm.block_size
        key = (bm.cache_version, num_blocks)
        memo = req.prefix_match
        if memo is not None and memo[0] == key:
            return memo[1]
        blocks = bm.match_prefix(self.block_hashes(req, num_blocks)[:num_blocks])
        req.prefix_match = (key, blocks)
        return blocks

    def block_hashes(self, req: Request, num_blocks: int) -> list:
        """`req.block_hashes`, extended to at least `num_blocks` full blocks."""
        hashes, bs = req.block_hashes, self.block_manager.block_size
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self.block_manager.root_hash
            hashes += chain_hashes(parent, req.tokens(len(hashes) * bs, num_blocks * bs), bs)
        return hashes

    def take(self, req: Request, cached: list) -> int:
        """Give an admitted request (empty table) its cached blocks. -> tokens they cover"""
        start = len(cached) * self.block_manager.block_size
        self.block_manager.take_cached(cached, req.block_table)
        req.num_computed_tokens = start
        req.num_hashed_blocks = len(cached)
        self.num_queries += req.num_tokens
        self.num_hits += start
        return start

    def cache_computed(self, req: Request, num_computed: int) -> None:
        """Register `req`'s full blocks among its first `num_computed` (computed) tokens."""
        num_full = num_computed // self.block_manager.block_size
        if num_full > req.num_hashed_blocks:
            hashes, table = self.block_hashes(req, num_full), req.block_table
            for i in range(req.num_hashed_blocks, num_full):
                self.block_manager.cache_block(table[i], hashes[i])
            req.num_hashed_blocks = num_full

    def pick(self, order: list) -> tuple:
        """Which of the waiting entries, sorted in admission order, to admit next (rule 4), and
        its cached blocks. -> (index in `order`, list[int])"""
        head = order[0]
        head_cached = self.cached_prefix(head[2])
        if len(order) == 1 or head[2].num_passed_over >= MAX_PASSED_OVER:
            return 0, head_cached
        best, best_cached = 0, head_cached
        block_size = self.block_manager.block_size
        for i in range(1, min(ADMIT_WINDOW, len(order))):
            entry = order[i]
            if entry[0] != head[0]:
                break
            req = entry[2]
            if (req.num_tokens - 1) // block_size <= len(best_cached):
                continue                    # it has no more full blocks than the best has cached: no lookup
            cached = self.cached_prefix(req)
            if len(cached) > len(best_cached):
                best, best_cached = i, cached
        for i in range(best):
            order[i][2].num_passed_over += 1
        return best, best_cached
