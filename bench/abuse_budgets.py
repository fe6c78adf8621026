"""The server-wide rows of `tokenwire bench abuse`: what many connections do together.

Rows: N connections that never read ("non-reading", N = 20 and 100, wide-open windows, new
streams opened as the server's running count drops, so 100 are in flight in all and the
legitimate client is always admitted at once), and 2,000 idle HTTP/2 connections. Each row runs three rounds
against one fresh `tokenwire serve --backend mock`, with --max-total-unsent-bytes 64 MiB
(below what the attacks can hold, so that budget binds; the machine's default, 1/64 of
memory, may not) and its other budgets at their defaults (net/budgets.py), the legitimate
client of bench/abuse_harness.py beside it. Printed per row, beside its target:

    RSS growth      the worst round's peak less the RSS before it, against the budget that
                    bounds it (non-reading: --max-total-unsent-bytes, plus SLACK_PER_CONN_KIB a
                    connection; idle: N x budgets.CONNECTION_BYTES) plus SLACK_MIB
    worst TTFT      the legitimate client's worst time to first token during each round's
                    attack, the median of the three rounds: < 100 ms
    RSS after       once the attack ended, RSS sampled every 0.25 s for 30 s: the first
                    sample within 20% of the RSS before that attack (memory given back,
                    net/memory.py), else the sample at 30 s; the worst round is shown. The
                    next round starts once the server has given memory back
                    (tokenwire_memory_given_back_total), so that collection counts in the
                    last column, the client's worst TTFT while RSS came back, not in the
                    next attack
    row's drift     the RSS before the first round -> after the last, with no target: what
                    the rounds leave behind together. CPython's small-object allocator frees a
                    1 MiB arena only when every object in it is gone, and the few long-lived
                    objects the server makes during an attack (the legitimate client's
                    requests, closed-stream ids) pin the arenas the attack's connections used:
                    after 2,000 idle connections, 22 more arenas held 43 KB more live data.
                    Measured in-process: +6-8 MiB over 3 rounds without the legitimate client,
                    +16-21 MiB with it, no higher after 5-7 rounds (a plateau, not a leak)
"""

import os
import threading
import time
from typing import Callable, NamedTuple

from ..net.budgets import CONNECTION_BYTES
from . import abuses
from .abuse_harness import MIB, Legit, Served, ttft_between
from .abuses import Answer

ROUNDS = 3
RECOVERY_S = 30.0           # how long after an attack RSS may take to come back
RECOVERY_RATIO = 1.2        # ... to within 20% of what it was before the row
TTFT_TARGET_MS = 100.0
SLACK_MIB = 32              # over a budget: the allocator's slack, the requests in flight, the legit client
SLACK_PER_CONN_KIB = 128    # and per connection: its transport's buffer (the 64 KiB high-water mark, plus
                            # the write that crossed it) and its last held chunk's spare room
NUM_TOKENS = 1500           # per non-reading stream; new ones keep coming (100 x 1500 tokens: a fraction of
                            # the mock's 16384 KV blocks of 16, so the legitimate client is never queued)
UNSENT_BUDGET = "64MiB"     # --max-total-unsent-bytes for these rows: below what the attacks can hold, so it binds
SERVER_ARGS = ("--max-total-unsent-bytes", UNSENT_BUDGET)


class BudgetScale(NamedTuple):
    never_reading: tuple        # connection counts, one row each
    num_streams: int            # non-reading streams in flight in all (under --max-num-seqs 256)
    num_idle: int
    hold_s: float               # a never-reading round ends once all were ended, or after this
    idle_hold_s: float


FULL = BudgetScale((20, 100), 100, 2000, 60.0, 5.0)
CI = BudgetScale((4, 10), 20, 200, 10.0, 1.0)


class Round(NamedTuple):
    answer: Answer
    rss_before: int
    rss_peak: int
    rss_after: int              # the first sample within RECOVERY_RATIO of rss_before, else the last
    recovered_s: float | None   # when that was, after the attack ended (None: not within RECOVERY_S)
    t0: float                   # the attack, monotonic s
    t1: float
    t2: float                   # the end of the wait after it (memory given back, or RECOVERY_S)


class BudgetRow(NamedTuple):
    abuse: str
    bound_mib: float            # RSS growth allowed
    bound_text: str
    rounds: list


def run_budget_rows(scale: BudgetScale, server_args=(), mock_step_us: float = 1000.0,
                    only: set | None = None) -> tuple:
    """The rows whose name holds a word of `only` (all: None); -> (rows, the legitimate
    client's TTFT samples, the server's /metrics at the end)."""
    names = [(f"{n} non-reading conns, {scale.num_streams} streams in flight", n)
             for n in scale.never_reading] + [(f"{scale.num_idle} idle HTTP/2 conns", None)]
    names = [(name, n) for name, n in names if only is None or any(word in name for word in only)]
    if not names:
        return [], [], {}
    served = Served((*SERVER_ARGS, *server_args), mock_step_us=mock_step_us)
    try:
        legit = Legit(served.port)
        time.sleep(0.5)
        rows = [_row(served, scale, name, n) for name, n in names]
        samples = legit.stop()
        return rows, samples, served.metrics()
    finally:
        served.stop()


def _row(served: Served, scale: BudgetScale, name: str, num_conns: int | None) -> BudgetRow:
    """Never reading (`num_conns`), or idle (None): three rounds, and the bound on RSS growth."""
    port = served.port
    if num_conns is None:
        bound = scale.num_idle * CONNECTION_BYTES / MIB
        text = f"{scale.num_idle} x {CONNECTION_BYTES // 1024} KiB + {SLACK_MIB}"
        return BudgetRow(name, bound + SLACK_MIB, text, _rounds(
            served, lambda: abuses.idle_connections(port, scale.num_idle, scale.idle_hold_s)))
    bound = served.metrics()["tokenwire_unsent_bytes_limit"] / MIB
    slack = SLACK_MIB + num_conns * SLACK_PER_CONN_KIB / 1024
    text = f"{bound:.0f} + {SLACK_MIB} + {num_conns} x {SLACK_PER_CONN_KIB} KiB"
    return BudgetRow(name, bound + slack, text, _rounds(served, lambda: abuses.never_reading_connections(
        port, num_conns, scale.num_streams, NUM_TOKENS, lambda: served.metrics()["tokenwire_requests_running"],
        scale.hold_s)))


def _rounds(served: Served, attack: Callable[[], Answer]) -> list:
    return [_round(served, attack) for _ in range(ROUNDS)]


def _round(served: Served, attack: Callable[[], Answer]) -> Round:
    before = served.rss_bytes()
    peak, done = [before], threading.Event()
    sampler = threading.Thread(target=_sample_peak, args=(served, peak, done), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    answer = attack()
    t1 = time.monotonic()
    done.set()
    sampler.join()
    return _recover(served, Round(answer, before, peak[0], 0, None, t0, t1, t1))


def _recover(served: Served, rnd: Round) -> Round:
    """RSS every 0.25 s after the attack: the first sample within RECOVERY_RATIO of the RSS
    before it.
    Sampling goes on until the server has given memory back since the attack (/metrics), so
    the next round starts after that collection, or until RECOVERY_S."""
    given = served.metrics()["tokenwire_memory_given_back_total"]
    after, recovered_s, gave_back, checked_s = served.rss_bytes(), None, False, 0.0
    while (elapsed := time.monotonic() - rnd.t1) < RECOVERY_S and (recovered_s is None or not gave_back):
        if recovered_s is None and after <= rnd.rss_before * RECOVERY_RATIO:
            recovered_s = elapsed
        if elapsed - checked_s >= 1.0:
            gave_back, checked_s = served.metrics()["tokenwire_memory_given_back_total"] > given, elapsed
        time.sleep(0.25)
        after = after if recovered_s is not None else served.rss_bytes()
    return rnd._replace(rss_peak=max(rnd.rss_peak, after), rss_after=after, recovered_s=recovered_s,
                        t2=time.monotonic())


def _sample_peak(served: Served, peak: list, done: threading.Event) -> None:
    while not done.wait(0.01):
        peak[0] = max(peak[0], served.rss_bytes())


def summarize(row: BudgetRow, samples: list) -> dict:
    """A row's figures against its targets."""
    growth = max(r.rss_peak - r.rss_before for r in row.rounds) / MIB
    worsts = [w if w is not None else float("inf") for w in (ttft_between(samples, r.t0, r.t1)[1] for r in row.rounds)]
    ttft = sorted(worsts)[len(worsts) // 2]
    first = row.rounds[0].rss_before / MIB
    worst = max(row.rounds, key=lambda r: r.rss_after / r.rss_before)
    recovered = all(r.recovered_s is not None for r in row.rounds)
    failed = sum(ttft_between(samples, r.t0, r.t1)[3] for r in row.rounds)
    after = [ttft_between(samples, r.t1, r.t2)[1] for r in row.rounds]
    return {"growth_mib": growth, "growth_ok": growth <= row.bound_mib, "ttft_ms": ttft, "ttft_rounds_ms": worsts,
            "ttft_after_ms": max((w for w in after if w is not None), default=None),
            "ttft_ok": ttft < TTFT_TARGET_MS, "before_mib": worst.rss_before / MIB, "after_mib": worst.rss_after / MIB,
            "first_mib": first, "last_mib": row.rounds[-1].rss_after / MIB,
            "recovered_s": max((r.recovered_s for r in row.rounds if r.recovered_s is not None), default=None),
            "recovered_ok": recovered, "num_legit_failed": failed}


def format_budget_table(rows: list, samples: list, metrics: dict, load_before: tuple) -> str:
    load_after = os.getloadavg()
    limits = (f"--max-total-unsent-bytes {metrics['tokenwire_unsent_bytes_limit'] / MIB:.0f} MiB, "
              f"--max-connections {metrics['tokenwire_connections_limit']:.0f}")
    lines = [f"server-wide budgets: a fresh server with its defaults ({limits}), {ROUNDS} rounds a row; "
             f"{os.cpu_count()} CPUs, load average {_load(load_before)} before, {_load(load_after)} after", "",
             "| abuse | server answer (each round) | RSS growth, worst round (MiB) | bound (MiB) "
             "| legit worst TTFT, median of 3 (rounds) (ms) | target | RSS before -> after (MiB), worst round | target "
             "| legit worst TTFT while RSS came back (ms) | row's drift (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s = summarize(row, samples)
        answers = "; ".join(r.answer.text for r in row.rounds)
        back = (f"{s['before_mib']:.0f} -> {s['after_mib']:.0f} ({s['after_mib'] / s['before_mib'] - 1:+.0%}, "
                + (f"by {s['recovered_s']:.1f} s)" if s["recovered_ok"] else f"not within {RECOVERY_S:g} s)"))
        lines.append(f"| {row.abuse} | {answers} | {s['growth_mib']:.0f} {_ok(s['growth_ok'])} | {row.bound_text} "
                     f"| {s['ttft_ms']:.1f} ({' / '.join(f'{w:.0f}' for w in s['ttft_rounds_ms'])}) "
                     f"{_ok(s['ttft_ok'])} | < {TTFT_TARGET_MS:g} "
                     f"| {back} {_ok(s['recovered_ok'])} | within {RECOVERY_RATIO - 1:.0%} in {RECOVERY_S:g} s "
                     f"| {_ms(s['ttft_after_ms'])} | {s['first_mib']:.0f} -> {s['last_mib']:.0f} |")
    closed = {k[k.index('"') + 1:-2]: v for k, v in metrics.items()
              if k.startswith("tokenwire_connections_closed_total") and v}
    lines.append("\ntokenwire_connections_closed_total: " + ", ".join(f"{k}={v:g}" for k, v in sorted(closed.items())))
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ok(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _load(load: tuple) -> str:
    return " ".join(f"{x:.2f}" for x in load)
