"""The load generator's engine: connection pools, closed- and open-loop drivers, one level's figures.

A level is one concurrency (closed loop: that many requests always in flight, each stream
started again from the completion callback of the last one) or one arrival rate (open
loop: Poisson arrivals, at most `concurrency` in flight, the rest wait in a backlog). A
warm-up runs first at the same concurrency; the measured window then brackets the
requests with CPU readings of this process and, when known, of the server process.

Everything here runs on one asyncio loop; per-token work lives in the clients
(h2client.py, h1client.py), per-request work in the completion callbacks below.
"""

import asyncio
import bisect
import collections
import math
import random
import time
from typing import Callable, NamedTuple, Optional
from urllib.parse import urlsplit

from . import h1client, h2client
from .proc import cpu_delta_ns, read_cpu, read_host_ticks, steal_fraction
from .stats import percentile, summarize
from .wire import now_ns

PROTOCOLS = ("h2", "h1", "grpc")
STALL_TIMEOUT_S = 60.0      # a level fails when no stream completes for this long


class Target(NamedTuple):
    """Where and what to send: one request shape, reused by every stream of a level."""
    host: str
    port: int
    protocol: str           # "h2" (prior knowledge), "h1" (HTTP/1.1 keep-alive), "grpc" (gRPC over h2)
    framing: str            # how a response body splits into messages: "sse", "ndjson", "grpc"
    path: str
    body: bytes
    content_type: str
    headers: tuple = ()     # extra request headers, (name, value) pairs


def parse_url(url: str) -> tuple:
    """(host, port, path) of an http:// URL; other schemes get a clear error."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"--url must be an http:// URL (h2c prior knowledge or HTTP/1.1), got {url!r}")
    if not parts.hostname:
        raise ValueError(f"--url has no host: {url!r}")
    return parts.hostname, parts.port or 80, parts.path or "/"


# -- connection pools: start(done) opens one stream on some connection ----------------------
class H2Pool:
    def __init__(self, conns, template):
        self._conns = conns
        self._template = template
        self._next = 0

    def start(self, done):
        conn = self._conns[self._next]
        self._next = (self._next + 1) % len(self._conns)
        return conn.start(self._template, done)

    @property
    def num_queued(self) -> int:
        return sum(c.num_queued for c in self._conns)

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    def close(self):
        for conn in self._conns:
            conn.close()


class H1Pool:
    """Idle keep-alive connections; a request finding none waits for the next to free up."""

    def __init__(self, conns, request: bytes):
        self._idle = list(conns)
        self._all = list(conns)
        self._request = request
        self._pending = collections.deque()
        self.num_queued = 0

    def start(self, done):
        if not self._idle:
            self.num_queued += 1
            self._pending.append(done)
            return None
        conn = self._idle.pop()
        return conn.start(self._request, lambda rec: self._release(conn, rec, done))

    @property
    def num_connections(self) -> int:
        return len(self._all)

    def _release(self, conn, rec, done):
        if conn.reusable:
            self._idle.append(conn)
        done(rec)
        if self._pending and self._idle:
            self.start(self._pending.popleft())

    def close(self):
        for conn in self._all:
            conn.close()


async def open_pool(target: Target, concurrency: int, num_connections: int):
    """Connections enough for `concurrency` streams: HTTP/1.1 one each; HTTP/2 as the server allows."""
    if target.protocol == "h1":
        request = h1client.build_request(f"{target.host}:{target.port}", target.path, target.body,
                                         target.content_type, target.headers)
        conns = await asyncio.gather(*(h1client.open_connection(target.host, target.port, target.framing)
                                       for _ in range(concurrency)))
        return H1Pool(conns, request)
    grpc = target.protocol == "grpc"
    headers = [("content-type", target.content_type), *target.headers] + ([("te", "trailers")] if grpc else [])
    template = h2client.RequestTemplate(f"{target.host}:{target.port}", target.path, target.body,
                                        headers, content_length=not grpc)
    first = await h2client.open_connection(target.host, target.port, target.framing, grpc)
    needed = max(num_connections, math.ceil(concurrency / first.max_streams) if first.max_streams else 1)
    rest = await asyncio.gather(*(h2client.open_connection(target.host, target.port, target.framing, grpc)
                                  for _ in range(needed - 1)))
    return H2Pool([first, *rest], template)


# -- drivers ---------------------------------------------------------------------------------
async def closed_loop(pool, concurrency: int, num_requests: int) -> list:
    """Keep `concurrency` streams in flight until `num_requests` have completed."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    records = []
    issued = 0

    def issue():
        nonlocal issued
        issued += 1
        pool.start(on_done)

    def on_done(rec):  # per request
        rec.end_ns = now_ns()
        records.append(rec)
        if issued < num_requests:
            if rec.error is None:
                issue()
            else:
                loop.call_soon(issue)  # a failure may complete inside start(): no recursion
        elif len(records) == num_requests and not finished.done():
            finished.set_result(None)

    if num_requests == 0:
        return records
    for _ in range(min(concurrency, num_requests)):
        issue()
    await wait_with_progress(finished, records, num_requests)
    return records


async def staggered_loop(pool, concurrency: int, num_requests: int, num_warmup: int, spread_s: float,
                         mark: Callable[[], object], stall_s: float = STALL_TIMEOUT_S,
                         every: Optional[list] = None) -> tuple:
    """A closed loop whose streams are out of step, as users' requests are: the first
    `concurrency` streams start `spread_s / concurrency` apart, and the loop runs from warm-up
    into the measured window without a break, so the offsets persist (`closed_loop` starts its
    streams at once, and with equal response lengths they then stay in step: every prefill
    lands in one step). Measured: the `num_requests` requests issued after the first
    `num_warmup`; `mark()` is called as the first of them is issued and as the last completes.
    Streams are issued until then (the load stays at `concurrency`), and the rest drain
    unmeasured; `every` gets every request's record, warm-up and drain included.
    -> (measured records, (the two values mark() returned))"""
    loop = asyncio.get_running_loop()
    finished, drained = loop.create_future(), loop.create_future()
    records, marks = [], []
    completed = every if every is not None else []  # every request, warm-up and drain included
    issued = in_flight = 0

    def issue():
        nonlocal issued, in_flight
        if finished.done():             # a completion's reissue queued beside the last measured one's
            return
        if issued == num_warmup:
            marks.append(mark())
        index, issued, in_flight = issued, issued + 1, in_flight + 1
        pool.start(lambda rec: on_done(rec, index))

    def on_done(rec, index):
        nonlocal in_flight
        rec.end_ns = now_ns()
        in_flight -= 1
        completed.append(rec)
        if num_warmup <= index < num_warmup + num_requests:
            records.append(rec)
            if len(records) == num_requests:
                marks.append(mark())
                finished.set_result(None)
        if not finished.done():
            loop.call_soon(issue)       # a failure may complete inside start(): no recursion
        elif not in_flight and not drained.done():
            drained.set_result(None)

    for i in range(concurrency):
        loop.call_later(spread_s * i / concurrency, issue)
    # progress is any completion: the first measured one ends a warm-up and a request's life in
    await wait_with_progress(finished, completed, num_warmup + num_requests, stall_s)
    if in_flight:
        await asyncio.wait_for(drained, STALL_TIMEOUT_S)
    return records, marks


async def wait_with_progress(finished, records: list, num_requests: int, stall_s: float = STALL_TIMEOUT_S):
    """Wait for `finished`; TimeoutError once no stream has completed for `stall_s` seconds."""
    count, changed = len(records), time.monotonic()
    while not finished.done():
        await asyncio.wait([finished], timeout=min(1.0, stall_s / 2))
        if len(records) != count:
            count, changed = len(records), time.monotonic()
        elif time.monotonic() - changed > stall_s:
            raise TimeoutError(f"no stream finished for {stall_s:.0f} s ({count} of {num_requests} done): "
                               "the server stalled, or flow control never reopened")


async def open_loop(pool, rate: float, num_requests: int, concurrency: int, seed: int = 0) -> tuple:
    """Poisson arrivals at `rate`/s, at most `concurrency` in flight; returns (records, lag_us).

    Latencies are measured from the moment a stream is sent; the lag of each send behind
    its scheduled arrival (timer granularity, backlog) is reported separately.
    """
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    rng = random.Random(seed)
    records, lag_ns, backlog = [], [], collections.deque()
    in_flight = 0

    def send(arrival_ns):
        nonlocal in_flight
        in_flight += 1
        lag_ns.append(now_ns() - arrival_ns)
        pool.start(on_done)

    def on_done(rec):
        nonlocal in_flight
        rec.end_ns = now_ns()
        records.append(rec)
        in_flight -= 1
        if backlog:
            loop.call_soon(send, backlog.popleft())
        if len(records) == num_requests and not finished.done():
            finished.set_result(None)

    arrival = now_ns()
    for _ in range(num_requests):
        arrival += int(rng.expovariate(rate) * 1e9)
        delay_s = (arrival - now_ns()) / 1e9
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if in_flight < concurrency:
            send(arrival)
        else:
            backlog.append(arrival)
    if num_requests:
        await wait_with_progress(finished, records, num_requests)
    return records, [ns / 1000 for ns in lag_ns]


# -- one level -------------------------------------------------------------------------------
# a server is read once it has gone idle: a thread that runs without being descheduled (a loop
# busy-polling, or stepping the engine itself) has its CPU time brought up to date only at the
# next scheduler tick (bench/proc.py), so a reading taken while it runs lags by up to a tick
SETTLE_S = 0.003                    # longer than tokenwire's busy polling after the last request


async def read_cpu_idle(pid: int):
    """The server's CPU time (bench/proc.read_cpu), read after it had SETTLE_S to go idle."""
    await asyncio.sleep(SETTLE_S)
    return read_cpu(pid)


async def run_level(target: Target, concurrency: int, num_requests: int, *, num_warmup: int,
                    num_connections: int = 1, mode: str = "closed", rate: Optional[float] = None,
                    server_pid: Optional[int] = None, expected_tokens: Optional[int] = None,
                    spread_s: float = 0.0) -> dict:
    """Warm up, measure one level, and return its row of figures. `mode`: "closed", "open"
    (Poisson arrivals at `rate`), or "staggered" (closed, streams `spread_s / concurrency` apart)."""
    pool = await open_pool(target, concurrency, num_connections)
    if mode == "staggered":
        try:
            return await run_staggered(pool, target, concurrency, num_requests, num_warmup, spread_s, server_pid,
                                       expected_tokens)
        finally:
            pool.close()
    try:
        await closed_loop(pool, concurrency, num_warmup)
        queued_before = pool.num_queued
        server_before = await read_cpu_idle(server_pid) if server_pid else None
        host_before, client_before, start = read_host_ticks(), time.process_time_ns(), now_ns()
        lag_us = []
        if mode == "closed":
            records = await closed_loop(pool, concurrency, num_requests)
        else:
            records, lag_us = await open_loop(pool, rate, num_requests, concurrency)
        wall_ns, client_ns = now_ns() - start, time.process_time_ns() - client_before
        host_after = read_host_ticks()
        server_after = await read_cpu_idle(server_pid) if server_pid else None
        num_queued = pool.num_queued - queued_before
    finally:
        pool.close()
    server_ns = cpu_delta_ns(server_before, server_after) if server_before and server_after else None
    row = summarize_level(records, wall_ns, client_ns, server_ns, expected_tokens)
    row.update(concurrency=concurrency, mode=mode, rate=rate, protocol=target.protocol,
               num_connections=pool.num_connections, num_queued=num_queued, client="python",
               host_steal=steal_fraction(host_before, host_after))
    if lag_us:
        row.update(summarize(lag_us, "send_lag_us"))
    return row


async def run_staggered(pool, target: Target, concurrency: int, num_requests: int, num_warmup: int,
                        spread_s: float, server_pid: Optional[int], expected_tokens: Optional[int]) -> dict:
    """run_level's staggered mode. The server is read while it runs (the window is seconds, a
    reading lags by at most a scheduler tick); throughput and its CPU per token count every
    stream's tokens inside the window (summarize_level)."""
    def readings():
        return now_ns(), time.process_time_ns(), read_cpu(server_pid) if server_pid else None, read_host_ticks()

    every = []
    records, ((start, client_before, server_before, host_before), (end, client_after, server_after, host_after)) = \
        await staggered_loop(pool, concurrency, num_requests, num_warmup, spread_s, readings, every=every)
    server_ns = cpu_delta_ns(server_before, server_after) if server_before and server_after else None
    row = summarize_level(records, end - start, client_after - client_before, server_ns, expected_tokens,
                          ((start, end), every))
    row.update(concurrency=concurrency, mode="staggered", rate=None, spread_s=spread_s, protocol=target.protocol,
               num_connections=pool.num_connections, num_queued=0, client="python",
               host_steal=steal_fraction(host_before, host_after))
    return row


def summarize_level(records: list, wall_ns: int, client_ns: int, server_ns: Optional[int],
                    expected_tokens: Optional[int], window: Optional[tuple] = None) -> dict:
    """Latency percentiles (µs), throughput, and CPU per streamed token of one measured window.
    `window`: ((open ns, close ns), every record of the run) when streams other than the measured
    ones ran in it (staggered): throughput and CPU per token count every token stamped inside
    it, not the measured requests' (which undercount a window of N requests at concurrency c
    by about N / (N + c), their own ramp in and out)."""
    ok = [r for r in records if r.error is None and r.token_ns]
    errors = [r.error or "stream ended with no tokens" for r in records if r.error is not None or not r.token_ns]
    ttft = [(r.token_ns[0] - r.start_ns) / 1000 for r in ok]
    itl = [(b - a) / 1000 for r in ok for a, b in zip(r.token_ns, r.token_ns[1:])]
    e2e = [(r.end_ns - r.start_ns) / 1000 for r in ok]
    num_tokens = sum(len(r.token_ns) for r in records)
    window_tokens = num_tokens if window is None else tokens_within(*window)
    wall_s = wall_ns / 1e9
    row = {"num_requests": len(records), "num_errors": len(errors), "first_error": errors[0] if errors else None,
           "num_tokens": num_tokens, "wall_s": wall_s,
           "tokens_per_request": num_tokens / len(records) if records else 0.0,
           "num_count_mismatches": sum(1 for r in ok if expected_tokens and len(r.token_ns) != expected_tokens),
           "tokens_per_s": window_tokens / wall_s if wall_s else math.nan,
           "requests_per_s": len(records) / wall_s if wall_s else math.nan,
           "client_cpu_us_per_token": client_ns / 1000 / window_tokens if window_tokens else math.nan,
           "client_cpu_util": client_ns / wall_ns if wall_ns else math.nan,
           "cpu_us_per_token": server_ns / 1000 / window_tokens if server_ns is not None and window_tokens else None,
           "server_cpu_util": server_ns / wall_ns if server_ns is not None and wall_ns else None}
    row.update(summarize(ttft, "ttft_us"))
    row.update(summarize(itl, "itl_us"))
    row["itl_us_hist"] = log_histogram(itl)
    row.update(summarize(e2e, "e2e_us"))
    row["ttft_p50_us"], row["ttft_p99_us"] = row["ttft_us_p50"], row["ttft_us_p99"]
    row["server_timings_us_p50"] = server_timings_p50(ok)
    row.update(summarize(server_ttft_us(ok), "server_ttft_us"))
    return row


def tokens_within(bounds: tuple, records: list) -> int:
    """Tokens of `records` stamped inside bounds = (open, close), on the records' clock."""
    start, end = bounds
    return sum(bisect.bisect_right(r.token_ns, end) - bisect.bisect_left(r.token_ns, start) for r in records)


HIST_BINS_PER_DECADE = 10          # inter-token histogram: log-spaced bins, 1 µs to 100 s


def log_histogram(values_us: list) -> list:
    """[(bin's lower edge µs, count)] over log-spaced bins (HIST_BINS_PER_DECADE a decade from
    1 µs), the non-empty ones; values under 1 µs (tokens that came in one read) count in the first."""
    counts = {}
    for v in values_us:
        k = max(0, int(math.floor(math.log10(v) * HIST_BINS_PER_DECADE))) if v >= 1 else 0
        counts[k] = counts.get(k, 0) + 1
    return [(10 ** (k / HIST_BINS_PER_DECADE), counts[k]) for k in sorted(counts)]


def server_ttft_us(records: list) -> list:
    """Each stream's TTFT as its server timed it, where the server reported one (tokenwire does):
    the `ttft_us` of the timings in its last chunk, which is Timeline.arrived_ns (the read that
    completed the request's headers) to first_token_emitted_ns (the first token's bytes handed
    to the transport), so it holds neither the network nor the client."""
    return [r.timings["ttft_us"] for r in records
            if r.timings and isinstance(r.timings.get("ttft_us"), (int, float)) and r.timings["ttft_us"] > 0]


def server_timings_p50(records: list) -> Optional[dict]:
    """Median of each stage timing the server reported in its streams (tokenwire does), or None."""
    reported = [r.timings for r in records if r.timings]
    if not reported:
        return None
    keys = [k for k, v in reported[0].items() if isinstance(v, (int, float))]
    return {k: percentile(sorted(t[k] for t in reported if isinstance(t.get(k), (int, float))), 50) for k in keys}
