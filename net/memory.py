"""Giving freed memory back to the OS, after a burst.

What connections held is freed, but not returned: glibc's malloc keeps freed chunks in its
arenas (it trims only the top of the heap, past M_TRIM_THRESHOLD, and freed output buffers
sit everywhere in it). A connection's own objects were cyclic garbage (h2's H2Connection
refers to itself through bound methods), freed only by a full collection; protocol.py now
breaks those cycles when a connection is lost, and the collection here finds what is left.
20 connections that never read took RSS from 82 to 141 MiB, and it stayed at 135 MiB after
they closed; 2,000 idle connections left 41 MiB behind.

`GiveBack.maybe(budget, now)` runs from the server's periodic sweep. When connections let go
of at least GIVE_BACK_BYTES of output or bodies, or GIVE_BACK_CONNECTIONS connections closed,
since the last time (or, once they hold almost nothing after a give-back while they held
much, QUIET_FREED_BYTES / QUIET_CONNECTIONS: the end of a burst), and at most once per
GIVE_BACK_INTERVAL_S, it runs a full collection (the connections' cycles) and then
`malloc_trim(0)`, which returns the free pages inside every arena (madvise), not only the
heap's top. Measured on the mock server: back to
86 MiB from 135 MiB (gc 5 ms + trim 8 ms), and after 2,000 idle connections to 94 MiB
from 123 MiB (gc 130 ms while the connections' cycles were left for it, ~1 us per object;
freed as each connection closes now).
Tried and not kept: M_ARENA_MAX=2 (the same RSS after a trim) and a fixed
M_MMAP_THRESHOLD of 256 KiB (the peak rose by 19 MiB).
"""

import ctypes
import ctypes.util
import gc
import logging
import os
import time

log = logging.getLogger("tokenwire.net")

GIVE_BACK_BYTES = 16 << 20          # output / body bytes let go of since the last time
GIVE_BACK_CONNECTIONS = 256         # connections closed since the last time
QUIET_BYTES = 1 << 20               # the burst is over: the connections hold less than this in all; then
QUIET_FREED_BYTES = 1 << 20         # ... this much let go of
QUIET_CONNECTIONS = 16              # ... or this many closed suffice (what the last give-back, during the
                                    # burst, could not return yet)
GIVE_BACK_INTERVAL_S = 10.0         # at most this often (a full collection costs ~1 us per tracked object)


def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except OSError:
        return 0


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class GiveBack:
    """When to give memory back, and doing it (on the event loop: the sweep calls `maybe`)."""

    def __init__(self):
        self.trim = _malloc_trim()
        self.last_s = -GIVE_BACK_INTERVAL_S      # monotonic s of the last time
        self.num_times = 0
        self.in_burst = False                   # the last time was for a large free, while connections held much

    def due(self, budget, now: float) -> bool:
        """`budget`: the app's budgets.ServerBudget (what was let go of since the last time)."""
        if now - self.last_s < GIVE_BACK_INTERVAL_S:
            return False
        freed, closed = budget.num_freed_bytes, budget.num_closed
        if freed >= GIVE_BACK_BYTES or closed >= GIVE_BACK_CONNECTIONS:
            return True
        quiet = budget.num_unsent_bytes + budget.num_body_bytes < QUIET_BYTES
        return self.in_burst and quiet and (freed >= QUIET_FREED_BYTES or closed >= QUIET_CONNECTIONS)

    def maybe(self, budget, now: float) -> bool:
        """-> whether memory was given back now."""
        if not self.due(budget, now):
            return False
        self.give_back(budget, now)
        return True

    def give_back(self, budget, now: float) -> None:
        self.in_burst = budget.num_unsent_bytes + budget.num_body_bytes >= QUIET_BYTES
        freed, closed = budget.take_freed()
        self.last_s = now
        self.num_times += 1
        rss = rss_bytes()
        t0 = time.perf_counter()
        gc.collect()
        t1 = time.perf_counter()
        if self.trim is not None:
            self.trim(0)
        log.debug("memory given back after %d connections closed and %d bytes let go of: RSS %.0f -> %.0f MiB "
                  "(gc %.1f ms, malloc_trim %.1f ms)", closed, freed, rss / 2**20, rss_bytes() / 2**20,
                  (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
