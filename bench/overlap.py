"""`tokenwire bench overlap`: overlapped engine steps against synchronous ones, on the mock's step time.

The mock executor's step waits without the GIL, as a wait for a GPU does, so it shows how
much of the host's per-step work (schedule, batch, detokenize, stops, hand-off, frames) the
step driver hides behind the step (core/step_driver.py rule 3). For each step time S, a
`tokenwire serve --backend mock --mock-step-us S` runs with overlap and with `--no-overlap`,
in alternating order over `--rounds`, and every concurrency level is loaded in a closed loop
(the C client by default). By default the loop is staggered: the streams start one response's
time (max tokens x S) apart in all, so requests end and arrive a few per step, as users' do.
With `--engine-process` a third server runs in each round, overlapped with its engine in a
process of its own (tokenwire/engine_process.py): its CPU per token counts both processes.
`--mode closed` starts them at once: with equal response lengths they stay in step, every
request of the level ends in one step and the next wave is taken in while every slot idles
(that measures the server's intake of a burst, not overlap). Printed per S, concurrency and
mode, medians over the rounds:
achieved tokens/s against the ideal concurrency / S (every step carries every stream), the
inter-token p50 against S, the server's CPU per streamed token, the host ceiling, and the
most host CPU time stolen by the hypervisor in any of the rounds (bench/proc.py); the load
average beside. The host ceiling is the most tokens/s the server's measured CPU per token
allows on the cores its interpreters can use (`GIL_CORES`: one for a server whose loop and
engine share a GIL, two for an engine process, at most the machine's), against the ideal: a
cell whose ceiling is under its target is bound by the host's work per token, and no
schedule reaches the target there until that work shrinks (the load client's own CPU, and
the CPU per token rising with contention, put the real bound lower still).
"""

import argparse
import asyncio
import os
import statistics
import sys

from . import fast_client
from .load import make_target
from .peers.runner import HOST, PeerSpec, free_port, measure_server
from .stats import fmt_steal, table

DEFAULT_STEPS_US = "1000,300"
DEFAULT_CONCURRENCY = "1,64,256"
# (S µs, concurrency) -> (least tokens/s ÷ ideal, most inter-token p50 ÷ S) that issue 27 asks of overlap
# mode -> the server's flags: overlap on, off, and on with the engine in a process of its own
MODES = {"on": [], "off": ["--no-overlap"], "process": ["--engine-process"]}
# mode -> the cores its host work can use at once: one GIL, or the loop's and the engine process's
GIL_CORES = {"on": 1, "off": 1, "process": 2}
TARGETS = {(1000, 64): (0.98, None), (1000, 256): (0.95, None), (300, 64): (0.95, None),
           (1000, 1): (None, 1.03), (300, 1): (None, 1.03)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step-us", default=DEFAULT_STEPS_US,
                        help=f"comma-separated mock step times, µs (default {DEFAULT_STEPS_US})")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                        help=f"comma-separated closed-loop levels (default {DEFAULT_CONCURRENCY})")
    parser.add_argument("--rounds", type=int, default=3, help="alternating on/off rounds (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per response (default 64)")
    parser.add_argument("--requests", type=int, default=None,
                        help="measured requests per level (default: max(64, 4 x concurrency))")
    parser.add_argument("--client", choices=fast_client.CLIENTS, default="c",
                        help="load client (default c: the C HTTP/2 client; python, node)")
    parser.add_argument("--mode", choices=("staggered", "closed"), default="staggered",
                        help="staggered (default): the streams start max tokens x S apart in all and stay out "
                             "of step; closed: all at once, every level a train of waves")
    parser.add_argument("--server-core", type=int, default=None, help="pin the servers to this core (default: none)")
    parser.add_argument("--engine-process", action="store_true",
                        help="also run each round's server with --engine-process (overlap on), as a third mode")


def run(args) -> int:
    try:
        steps_us = [float(s) for s in args.step_us.split(",")]
        levels = [int(c) for c in args.concurrency.split(",")]
        if args.client != "python":
            fast_client.check_available(args.client)
    except ValueError as exc:
        print(f"tokenwire bench overlap: {exc}", file=sys.stderr)
        return 2
    loop = "staggered closed loop (max tokens x S apart)" if args.mode == "staggered" else "closed loop"
    print(f"tokenwire bench overlap: mock steps of {args.step_us} µs, {loop} at {args.concurrency}, "
          f"{args.max_tokens} tokens per response, {args.rounds} alternating rounds, client {args.client}")
    rows = asyncio.run(measure(args, steps_us, levels))
    print(format_rows(rows, args.rounds))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


async def measure(args, steps_us: list, levels: list) -> list:
    """-> one row per (S, mode, round, concurrency): the load generator's row, tagged
    (`overlap`: the mode, a key of MODES)."""
    rows = []
    modes = list(MODES) if args.engine_process else list(MODES)[:2]
    for step_us in steps_us:
        for round_index in range(args.rounds):
            for mode in (modes if round_index % 2 == 0 else modes[::-1]):
                for row in await measure_one(args, step_us, mode, levels):
                    row.update(step_us=step_us, overlap=mode, round=round_index)
                    rows.append(row)
    return rows


async def measure_one(args, step_us: float, mode: str, levels: list) -> list:
    """Start one server, load it at every level, stop it."""
    port = free_port()
    flags = MODES[mode]
    argv = [sys.executable, "-m", "tokenwire", "serve", "--backend", "mock", "--mock-step-us", f"{step_us:g}",
            "--no-access-log", "--host", HOST, "--port", str(port)] + flags
    name = " ".join(["tokenwire"] + flags)
    spec = PeerSpec(name, f"mock {step_us:g} µs", argv, "h2", "sse", "/v1/completions")
    target = make_target(HOST, port, spec.path, "h2", "sse", 16, args.max_tokens)
    plan = [(c, args.requests or max(64, 4 * c), c) for c in levels]
    options = {"mode": args.mode}
    if args.mode == "staggered":
        options["spread_s"] = args.max_tokens * step_us / 1e6
    return await measure_server(spec, target, plan, args.server_core, args.max_tokens, args.client, **options)


def format_rows(rows: list, num_rounds: int) -> str:
    """Medians over the rounds per (S, concurrency, mode), against the ideal and the targets
    (which the overlapped modes are held to)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["step_us"], r["concurrency"], r["overlap"]), []).append(r)
    lines = []
    order = list(MODES)
    for (step_us, concurrency, mode), rs in sorted(groups.items(),
                                                   key=lambda kv: (-kv[0][0], kv[0][1], order.index(kv[0][2]))):
        ideal = concurrency * 1e6 / step_us
        ratios = [r["tokens_per_s"] / ideal for r in rs]
        itl = [r["itl_us_p50"] / step_us for r in rs if r.get("itl_us_p50") is not None]
        cpu = [r["cpu_us_per_token"] for r in rs if r.get("cpu_us_per_token") is not None]
        cpu_us = statistics.median(cpu) if cpu else None
        steal = [r["host_steal"] for r in rs if r.get("host_steal") is not None]
        cores = min(GIL_CORES[mode], os.cpu_count() or 1)
        want_ratio, want_itl = TARGETS.get((int(step_us), concurrency), (None, None)) if mode != "off" else (None, None)
        lines.append([f"{step_us:g}", str(concurrency), mode,
                      f"{statistics.median(r['tokens_per_s'] for r in rs):,.0f}", f"{ideal:,.0f}",
                      _range(ratios) + (f" (≥ {want_ratio})" if want_ratio else ""),
                      (_range(itl) if itl else "-") + (f" (≤ {want_itl})" if want_itl else ""),
                      f"{cpu_us:.1f}" if cpu else "-", f"{cores * 1e6 / cpu_us / ideal:.2f}" if cpu else "-",
                      fmt_steal(max(steal) if steal else None),
                      str(sum(r["num_errors"] for r in rs))])
    headers = ["S µs", "conc", "overlap", "tok/s", "ideal", "÷ ideal: median [range]", "ITL p50 ÷ S",
               "server CPU µs/tok", "host ceiling ÷ ideal", "steal (most)", "errors"]
    return table(headers, lines)


def _range(values: list) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"
