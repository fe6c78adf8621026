"""Server-wide budgets: what all connections together may hold, beside each one's `Limits`.

`ServerLimits` (each a `tokenwire serve` flag; the defaults are read from the machine the
server starts on, formulas below):
    max_connections          open connections; one more is refused at accept (protocol.py
                             answers in the protocol its first bytes name, then closes)
    max_total_unsent_bytes   response bytes waiting for peers that do not read them (held while
                             a socket is full + queued behind HTTP/2 windows), all connections
    max_total_body_bytes     request-body bytes buffered for requests not yet complete

Accounting is on the event loop only, without a lock or a walk over connections: each
connection reports its two counts to `ServerBudget` as they change (unsent bytes once per
flush, i.e. once per step it is written; body bytes once per read), as deltas to the
totals. Going over a byte budget schedules one enforcement pass (`loop.call_soon`: nothing
is ended in the middle of a step's write). It ends connections, GOAWAY ENHANCE_YOUR_CALM
and their requests cancelled, the largest holders first, the oldest first among holdings
within a factor of two (`pick_victims`), until the total fits again; each is counted in
`tokenwire_connections_closed_total` under the budget's reason.

A burst of new connections is taken a share per iteration of the loop (`may_set_up`):
setting one up (its session, the preface, a first request) costs ~0.4 ms, and 2,000 opened
at once held the loop 100+ ms in a single iteration, a legitimate client's request waiting
behind them. Past SET_UPS_PER_TICK in one iteration, a connection's first bytes wait, its
reading paused, for a later one, in arrival order.
"""

import asyncio
import logging
import os
import resource
import time
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("tokenwire.net")

MIB = 1 << 20
CONNECTION_BYTES = 32 * 1024    # an idle HTTP/2 connection's memory, rounded up (~21 KiB measured)
FD_RESERVE = 256                # descriptors kept for the model's files, eventfds, the listening
                                # sockets and refused connections waiting for their answer
MAX_WAITING_REFUSALS = 64       # refused connections waiting for their first bytes; more are closed at once
LOG_INTERVAL_S = 10.0           # at most one "refused connections" line, and one "ended connections" line per
                                # budget, this often (an attack trips a budget several times a second)
SET_UPS_PER_TICK = 32           # new connections whose first bytes are taken per iteration of the loop (~0.4 ms
                                # each: a session, the preface, a request); 2,000 at once held it 100+ ms


def memory_bytes() -> int:
    """Physical memory, or the cgroup v2 limit where it is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text != "max":
            total = min(total, int(text))
    except (OSError, ValueError):
        pass
    return total


def fd_limit() -> int:
    """The process's open-file limit (soft RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_fd_limit() -> tuple:
    """Soft RLIMIT_NOFILE up to the hard limit (`tokenwire serve` owns its process; the soft
    limit is often 1024); -> (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections() -> int:
    """The fd limit less FD_RESERVE (or half of it, whichever is smaller), and no more idle
    connections than fit in 1/32 of memory at CONNECTION_BYTES each."""
    fds = fd_limit()
    return max(1, min(fds - min(FD_RESERVE, fds // 2), memory_bytes() // 32 // CONNECTION_BYTES))


def default_max_total_bytes() -> int:
    """1/64 of memory, within [16 MiB, 1 GiB]: the default of both byte budgets."""
    return min(max(memory_bytes() // 64, 16 * MIB), 1024 * MIB)


@dataclass(frozen=True)
class ServerLimits:
    """Server-wide budgets; every one is a `tokenwire serve` flag (README: "Limits")."""
    max_connections: int = field(default_factory=default_max_connections)
    max_total_unsent_bytes: int = field(default_factory=default_max_total_bytes)
    max_total_body_bytes: int = field(default_factory=default_max_total_bytes)

    def __post_init__(self):
        for name in ("max_connections", "max_total_unsent_bytes", "max_total_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Held:
    """What one connection holds of one byte budget, as that budget last counted it."""
    __slots__ = ("conn", "bytes", "since")

    def __init__(self, conn):
        self.conn = conn                # the ServerProtocol: `end(cause, message)` cuts it
        self.bytes = 0
        self.since = 0.0                # monotonic s when it began to hold them


class Holding:
    """What one connection holds, as the budgets counted it (owned by its ServerProtocol)."""
    __slots__ = ("unsent", "body")

    def __init__(self, conn):
        self.unsent = Held(conn)        # unsent response bytes
        self.body = Held(conn)          # body bytes of incomplete requests

    def forget_conn(self) -> None:
        """The connection is gone: no back-reference to it stays (it is freed as it closes)."""
        self.unsent.conn = self.body.conn = None


class Total:
    """One server-wide byte budget: the bytes all connections hold of it, its limit, and who
    holds any; going over it schedules the budget's enforcement pass."""

    def __init__(self, cause: str, what: str, limit: int, schedule):
        self.cause = cause              # tokenwire_connections_closed_total's reason for its cuts
        self.what = what                # the log's and the GOAWAY's words for its bytes
        self.limit = limit
        self.bytes = 0
        self.num_freed = 0              # bytes connections stopped holding, since memory was given back
        self.holders: set = set()       # Helds with bytes > 0
        self._schedule = schedule

    def hold(self, held: Held, num_bytes: int) -> None:
        """A connection's count changed (once per flush or read at most)."""
        old = held.bytes
        if not old:
            held.since = time.monotonic()
            self.holders.add(held)
        elif num_bytes < old:
            self.num_freed += old - num_bytes
            if not num_bytes:
                self.holders.discard(held)
        held.bytes = num_bytes
        self.bytes += num_bytes - old
        if self.bytes > self.limit:
            self._schedule()

    def victims(self) -> list:
        """The connections to end so that it fits again (`pick_victims`)."""
        excess = self.bytes - self.limit
        if excess <= 0:
            return []
        return pick_victims([(h.bytes, h.since, h.conn) for h in self.holders], excess)


def pick_victims(holders: list, excess: int) -> list:
    """holders: [(num_bytes, since, conn)] -> the conns to end so that at least `excess`
    bytes go: the largest holdings first (to within a factor of two: by bit length), and
    among those the one holding since longest first."""
    ranked = sorted(holders, key=lambda h: (-h[0].bit_length(), h[1]))
    victims, num_freed = [], 0
    for num_bytes, _, conn in ranked:
        if num_freed >= excess:
            break
        victims.append(conn)
        num_freed += num_bytes
    return victims


class ServerBudget:
    """The server-wide totals, one per App; only the event loop's thread touches it."""

    def __init__(self, limits: ServerLimits, connections: set):
        self.limits = limits
        self.connections = connections      # the app's open connections
        self.unsent = Total("total_unsent_bytes", "unsent response bytes", limits.max_total_unsent_bytes,
                            self._schedule)
        self.body = Total("total_body_bytes", "buffered request-body bytes", limits.max_total_body_bytes,
                          self._schedule)
        self.num_closed = 0                 # connections closed since memory was given back
        self.num_waiting_refusals = 0       # refused connections waiting for the bytes that name their protocol
        self._enforcing = False
        self._num_set_ups = 0               # sessions set up in this iteration of the loop
        self._waiting_set_up = deque()      # connections whose first bytes wait for a later iteration
        self._turn = None                   # the connection whose turn it is
        self._num_refused = 0               # refusals since the last log line
        self._refusal_logged_at = -LOG_INTERVAL_S
        self._cuts: dict = {}               # budget -> [connections ended since its last line, when that was, peak total]

    # ----------------------------------------------------------- accounting

    @property
    def num_unsent_bytes(self) -> int:
        return self.unsent.bytes

    @property
    def num_body_bytes(self) -> int:
        return self.body.bytes

    @property
    def num_freed_bytes(self) -> int:
        """Bytes connections stopped holding since memory was given back (memory.py's trigger)."""
        return self.unsent.num_freed + self.body.num_freed

    def release(self, holding: Holding) -> None:
        """The connection is ending: nothing it holds will be sent or completed."""
        for total, held in ((self.unsent, holding.unsent), (self.body, holding.body)):
            if held.bytes:
                total.hold(held, 0)

    def closed(self, holding: Holding) -> None:
        """The connection is gone (memory.py gives memory back after many)."""
        self.release(holding)
        self.num_closed += 1

    def take_freed(self) -> tuple:
        """-> (bytes let go of, connections closed) since the last call (memory.py's trigger)."""
        freed, closed = self.num_freed_bytes, self.num_closed
        self.unsent.num_freed = self.body.num_freed = self.num_closed = 0
        return freed, closed

    # ------------------------------------------------------------ admission

    def admits(self) -> bool:
        """A new connection fits under max_connections; else it is counted as refused."""
        if len(self.connections) < self.limits.max_connections:
            return True
        self._num_refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= LOG_INTERVAL_S:
            log.warning("at the connection limit (--max-connections %d): refused %d new connections",
                        self.limits.max_connections, self._num_refused)
            self._refusal_logged_at, self._num_refused = now, 0
        return False

    def may_set_up(self, conn) -> bool:
        """A new connection's first bytes may set up its session in this iteration of the loop
        (-> True), else it waits (-> False) and `conn.set_up_now()` is called when its turn comes,
        SET_UPS_PER_TICK per iteration, in arrival order."""
        if conn is self._turn:
            return True
        if not self._num_set_ups and not self._waiting_set_up:
            asyncio.get_running_loop().call_soon(self._next_tick)
        if self._num_set_ups < SET_UPS_PER_TICK and not self._waiting_set_up:
            self._num_set_ups += 1
            return True
        self._waiting_set_up.append(conn)
        return False

    def _next_tick(self) -> None:
        """A new iteration of the loop: the next connections waiting get their turn."""
        self._num_set_ups = 0
        waiting = self._waiting_set_up
        try:
            while waiting and self._num_set_ups < SET_UPS_PER_TICK:
                self._num_set_ups += 1
                self._turn = waiting.popleft()
                self._turn.set_up_now()
        finally:                # (one that raises is the loop's to log; the others still get their turn)
            self._turn = None
            if self._num_set_ups or waiting:
                asyncio.get_running_loop().call_soon(self._next_tick)

    def begin_refusal(self) -> bool:
        """A refused connection may wait for its first bytes (-> True) unless too many do."""
        if self.num_waiting_refusals >= MAX_WAITING_REFUSALS:
            return False
        self.num_waiting_refusals += 1
        return True

    def end_refusal(self) -> None:
        self.num_waiting_refusals -= 1

    # ---------------------------------------------------------- enforcement

    def _schedule(self) -> None:
        if not self._enforcing:
            self._enforcing = True
            asyncio.get_running_loop().call_soon(self.enforce)

    def enforce(self) -> None:
        """End the connections that hold the most until both byte totals fit their budgets."""
        self._enforcing = False
        for total in (self.unsent, self.body):
            victims = total.victims()
            if victims:
                self._cut(victims, total)

    def _cut(self, victims: list, total: Total) -> None:
        for conn in victims:
            conn.end(total.cause, f"the server holds {total.bytes} {total.what}, over its limit of {total.limit}")
        cuts = self._cuts.setdefault(total.cause, [0, -LOG_INTERVAL_S, 0])
        cuts[0] += len(victims)
        cuts[2] = max(cuts[2], total.bytes)
        wait = cuts[1] + LOG_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self._log_cuts(total)
        elif cuts[0] == len(victims):       # the first cut since the last line: its line comes at the interval's end
            asyncio.get_running_loop().call_later(wait, self._log_cuts, total)

    def _log_cuts(self, total: Total) -> None:
        """One line for the connections a budget ended since its last line (at most one per LOG_INTERVAL_S)."""
        cuts = self._cuts[total.cause]
        if cuts[0]:
            log.warning("up to %d %s held, over the server's limit of %d: ended %d connection(s) holding the most",
                        cuts[2], total.what, total.limit, cuts[0])
        cuts[:] = [0, time.monotonic(), 0]
