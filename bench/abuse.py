"""`tokenwire bench abuse`: every abuse of issues 12 and 30 against a real server, a legitimate client beside it.

    tokenwire bench abuse                  # full scale: 1M-frame floods, 100k rapid resets, 500 slowloris,
                                           # 20 and 100 never-reading connections, 2,000 idle ones
    tokenwire bench abuse --scale ci       # the sizes tests/test_abuse.py runs

A server (`tokenwire serve --backend mock`) runs in its own process on 127.0.0.1; the
legitimate client runs in another (so its timings share no GIL with the attackers) and sends
one small streaming request every 100 ms on its own HTTP/2 connection, recording its time to
first token. Each abuse (bench/abuses.py) runs in turn from this process while the server's
RSS is sampled every 10 ms. The table: the abuse, the server's answer, RSS before / peak /
after (MiB), and the legitimate client's TTFT p50 and worst before (a quiet baseline) and
during the abuse. Then the server-wide rows (bench/abuse_budgets.py: many connections
together, three rounds each against a fresh server, RSS against the budgets and RSS given
back after) in a second table. The bench raises its own open-file limit to the hard limit
(2,000 connections); `tokenwire serve` raises its own.
"""

import os
import threading
import time
from typing import Callable, NamedTuple

from ..net.budgets import raise_fd_limit
from . import abuse_budgets, abuses
from .abuse_harness import MIB, Legit, Served, ttft_between
from .abuses import Answer, Scale

# server flags for the CI scale: deadlines short enough to watch them fire
CI_SERVER_ARGS = ("--handshake-timeout", "2", "--write-timeout", "2", "--idle-timeout", "30")


class Row(NamedTuple):
    abuse: str
    answer: Answer
    rss_mib: tuple          # before, peak, after
    ttft_ms: tuple          # p50, worst during the abuse (None when the client got no answer)
    num_legit: int          # legitimate requests answered during it
    num_legit_failed: int


# ------------------------------------------------------------------ the runs

def abuse_table(served: Served | None, scale: Scale, limit: int) -> list[tuple[str, Callable[[], Answer]]]:
    port = served.port if served is not None else 0
    return [
        ("HTTP/2 body over the limit, no content-length", lambda: abuses.body_over_limit(port, limit, False)),
        ("HTTP/2 content-length over the limit", lambda: abuses.body_over_limit(port, limit, True)),
        (f"rapid reset: {scale.num_rapid_resets} streams", lambda: abuses.rapid_reset(port, scale)),
        (f"{scale.num_flood_frames} SETTINGS, never reading", lambda: abuses.settings_flood(port, scale)),
        (f"{scale.num_flood_frames} PINGs, never reading", lambda: abuses.ping_flood(port, scale)),
        (f"{scale.num_flood_frames} WINDOW_UPDATEs", lambda: abuses.window_update_flood(port, scale)),
        (f"{scale.num_flood_frames} empty DATA frames", lambda: abuses.empty_frame_flood(port, scale)),
        (f"slowloris: {scale.num_slowloris} conns, preface 1 byte/s", lambda: abuses.slowloris(port, scale)),
        (f"zero window: {scale.zero_window_streams} streams x {scale.zero_window_tokens} tokens",
         lambda: abuses.zero_window(port, scale)),
        (f"never reads: {scale.zero_window_streams} streams x {scale.zero_window_tokens * 10} tokens",
         lambda: abuses.never_reads(port, scale)),
        (f"{scale.prompt_bytes / 1e6:.1f} MB prompt", lambda: abuses.big_prompt(port, scale)),
        ("HEAD /metrics, HTTP/1.1", lambda: abuses.head_request(port, False)),
        ("HEAD /metrics, HTTP/2", lambda: abuses.head_request(port, True)),
        ("invalid preface 'PRI * HTTP/2.0...XX'", lambda: abuses.invalid_preface(port)),
    ]


def run_abuses(served: Served, scale: Scale, limit: int, only: set | None = None,
               baseline_s: float = 2.0) -> tuple[tuple, list[Row]]:
    """Baseline, then each abuse with the RSS sampled; -> (baseline (p50, worst, n, failed), rows)."""
    legit = Legit(served.port)
    time.sleep(0.5)             # its connection is up
    t_base = time.monotonic()
    time.sleep(baseline_s)
    spans = []
    for name, run in abuse_table(served, scale, limit):
        if only and not any(word in name for word in only):
            continue
        before = served.rss_bytes()
        peak = [before]
        done = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(served, peak, done), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        answer = run()
        t1 = time.monotonic()
        time.sleep(0.3)         # the server lets go of what the abuse left
        done.set()
        sampler.join()
        after = served.rss_bytes()
        spans.append((name, answer, (before, max(peak[0], after), after), t0, max(t1, t0 + 0.25)))
    samples = legit.stop()
    baseline = ttft_between(samples, t_base, t_base + baseline_s)
    rows = []
    for name, answer, rss, t0, t1 in spans:
        p50, worst, n, failed = ttft_between(samples, t0, t1)
        rows.append(Row(name, answer, tuple(x / MIB for x in rss), (p50, worst), n, failed))
    return baseline, rows


def _sample_rss(served: Served, peak: list, done: threading.Event) -> None:
    """Every 10 ms until `done`: the largest RSS seen goes to peak[0]."""
    while not done.wait(0.01):
        peak[0] = max(peak[0], served.rss_bytes())


def format_table(baseline: tuple, rows: list[Row]) -> str:
    ms = lambda x: "-" if x is None else f"{x:.1f}"     # noqa: E731
    lines = [f"legitimate client, quiet baseline: TTFT p50 {ms(baseline[0])} ms, worst {ms(baseline[1])} ms "
             f"({baseline[2]} requests, {baseline[3]} failed)", "",
             "| abuse | server answer | RSS before / peak / after (MiB) | legit TTFT p50 / worst during (ms) "
             "| legit served / failed |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.abuse} | {r.answer.text} | {r.rss_mib[0]:.0f} / {r.rss_mib[1]:.0f} / {r.rss_mib[2]:.0f} "
                     f"| {ms(r.ttft_ms[0])} / {ms(r.ttft_ms[1])} | {r.num_legit} / {r.num_legit_failed} |")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--scale", choices=("ci", "full"), default="full",
                        help="full: 1M-frame floods, 100k rapid resets, 500 slowloris connections (default); "
                             "ci: the test suite's sizes")
    parser.add_argument("--only", default=None, help="comma-separated words: run the abuses whose name holds one")
    parser.add_argument("--mock-step-us", type=float, default=1000.0,
                        help="the mock engine's step time (default: %(default)s)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more `tokenwire serve` argument (repeatable), e.g. --server-arg=--write-timeout=5")


def run(args) -> int:
    raise_fd_limit()
    scale = abuses.CI if args.scale == "ci" else abuses.FULL
    server_args = list(CI_SERVER_ARGS if args.scale == "ci" else ()) + args.server_arg
    only = set(args.only.split(",")) if args.only else None
    load_before = os.getloadavg()
    if only is None or any(any(word in name for word in only) for name, _ in abuse_table(None, scale, 0)):
        _run_per_connection(scale, server_args, args.mock_step_us, only)
    budget_scale = abuse_budgets.CI if args.scale == "ci" else abuse_budgets.FULL
    rows, samples, metrics = abuse_budgets.run_budget_rows(budget_scale, args.server_arg, args.mock_step_us,
                                                           only)
    if rows:
        print("\n" + abuse_budgets.format_budget_table(rows, samples, metrics, load_before))
    return 0


def _run_per_connection(scale: Scale, server_args: list, mock_step_us: float, only: set | None) -> None:
    limit = 4 * MIB
    served = Served(server_args, mock_step_us=mock_step_us)
    try:
        baseline, rows = run_abuses(served, scale, limit, only)
        print(format_table(baseline, rows))
        closed = {k: v for k, v in served.metrics().items() if k.startswith("tokenwire_connections_closed_total") and v}
        print("\ntokenwire_connections_closed_total:", ", ".join(f"{k[k.index('=') + 2:-2]}={v:g}"
                                                               for k, v in sorted(closed.items())))
        errors = [line for line in served.log if "Traceback" in line or "ERROR" in line or "Fatal" in line]
        print(f"server log: {len(served.log)} lines, {len(errors)} errors" + "".join("\n  " + e for e in errors[:10]))
    finally:
        served.stop()
