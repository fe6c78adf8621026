"""`tokenwire bench peers` from options to printed tables (see the package docstring)."""

import importlib.util
import argparse
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import orjson

from .. import fast_client
from ..load import make_target, run_event_loop
from ..pingpong import measure_floor
from ..plot import plot_levels, plot_path
from ..proc import num_cores, pin_to_core
from . import report
from .runner import HOST, free_port, measure_server, peer_specs


DEFAULT_SERVERS = "tokenwire,h2-minimal,hypercorn,uvicorn,tokenwire-grpc,grpc,ceiling"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", default=DEFAULT_SERVERS,
                        help=f"comma-separated servers to run, in order (default {DEFAULT_SERVERS}; also "
                             "tokenwire-ndjson, tokenwire-binary, tokenwire-h1, and the API families' streams: tokenwire-chat, "
                             "tokenwire-responses, tokenwire-messages)")
    parser.add_argument("--concurrency", default="1,8,64,256", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=None,
                        help="measured requests per level (default: max(400, 8 x concurrency))")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests per level (default: concurrency)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt length in words (default 16)")
    parser.add_argument("--step-us", type=float, default=0.0, help="mock engine step time in µs (default 0: zero-cost)")
    parser.add_argument("--server-core", type=int, default=None, help="core for the servers (default: the last one)")
    parser.add_argument("--client-core", type=int, default=None, help="core for the load generator (default: 0)")
    parser.add_argument("--floor-round-trips", type=int, default=2000, help="ping-pong round trips (default 2000)")
    parser.add_argument("--client", choices=fast_client.CLIENTS, default="python",
                        help="load client for the HTTP/2 SSE servers: python (default), c (hand-written HTTP/2 in C: "
                             "resolves sub-millisecond TTFT at concurrency 64), node; the others keep the Python one")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of the whole server list, alternating (tokenwire, peer, tokenwire, ...); the "
                             "report is on each figure's median, with a table of ranges and the lone stream's "
                             "paired ratios per round (default 1)")
    parser.add_argument("--trace", default=None, help="tokenwire's per-request stage timelines as Chrome trace JSON")
    parser.add_argument("--json", default=None, help="write one row per server and concurrency to this JSON file")
    parser.add_argument("--plot", default=None, type=plot_path,
                        help="write a plot of latency and throughput against concurrency (PNG, SVG, PDF: by suffix)")


def run(args) -> int:
    return run_peers(args)


def run_peers(args) -> int:
    try:
        servers, levels = _parse(args)
    except ValueError as exc:
        print(f"tokenwire bench peers: {exc}", file=sys.stderr)
        return 2
    client_core, server_core = _cores(args)
    header = _header(args, client_core, server_core)     # before pinning: it counts the machine's cores
    if client_core is not None:
        pin_to_core(client_core)
    print(header)
    floor = measure_floor(args.floor_round_trips, server_core=server_core)
    print(f"ping-pong floor (64 B round trip, two processes, loopback TCP): p50 {floor.p50_us:.0f} µs, "
          f"p99 {floor.p99_us:.0f} µs, min {floor.min_us:.0f} µs\n")
    rounds, failures = [], {}
    for n in range(args.repeat):
        if args.repeat > 1:
            print(f"-- round {n + 1} of {args.repeat}", flush=True)
        rows, failed = run_event_loop(_measure_all(args, servers, levels, server_core))
        rounds.append(rows)
        failures.update(failed)
    rows = rounds[0] if args.repeat == 1 else report.median_rows(rounds)
    _print_report(rows, servers, floor, failures)
    families = report.family_table(report.family_ratios(rounds))
    if families:
        print("\nAPI families' streams against /v1/chat/completions (issue 29)")
        print(families)
    if args.repeat > 1:
        ok = [s for s in servers if s not in failures]
        print(f"\nover {args.repeat} alternating rounds")
        print(report.rounds_table([report.summarize_servers(r, ok) for r in rounds]))
    _write(args, rows, servers, floor, failures, rounds)
    return 1 if failures or not rows else 0


def _parse(args):
    specs = peer_specs(0, args.step_us)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in specs]
    if unknown or not servers:
        raise ValueError(f"unknown server(s) {unknown or servers}; known: {', '.join(specs)}")
    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise ValueError("--concurrency takes comma-separated integers, e.g. 1,8,64,256") from None
    if not concurrency or min(concurrency) < 1:
        raise ValueError("--concurrency levels must be >= 1")
    for name in ("requests", "max_tokens", "prompt_len", "floor_round_trips", "repeat"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.step_us < 0:
        raise ValueError("--step-us must be >= 0")
    if args.client != "python":
        fast_client.check_available(args.client)
    levels = [(c, args.requests or max(400, 8 * c), c if args.warmup is None else args.warmup) for c in concurrency]
    return servers, levels


def _cores(args):
    """(client core, server core): two different cores when there are two, else unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("only one core is available: server and load generator share it (figures are pessimistic)")
        return None, None
    client = args.client_core if args.client_core is not None else cores[0]
    server = args.server_core if args.server_core is not None else cores[-1]
    if client == server:
        print(f"warning: server and load generator both pinned to core {client}")
    return client, server


async def _measure_all(args, servers, levels, server_core):
    rows, failures = [], {}
    for name in servers:
        port = free_port()
        spec = peer_specs(port, args.step_us, args.trace, args.max_tokens)[name]
        print(f"{name}: {spec.what} ...", flush=True)
        try:
            target = make_target(HOST, port, spec.path, spec.protocol, spec.framing, args.prompt_len,
                                 args.max_tokens)._replace(headers=spec.headers)
            rows += await measure_server(spec, target, levels, server_core, args.max_tokens, args.client)
        except (RuntimeError, OSError, TimeoutError) as exc:
            failures[name] = str(exc)
            print(f"{name} FAILED: {exc}", flush=True)
    return rows, failures


def _header(args, client_core, server_core) -> str:
    load1, load5, _ = os.getloadavg()
    return (f"tokenwire bench peers: {args.max_tokens} tokens per request, one message per token, mock step "
            f"{args.step_us:g} µs, prompt {args.prompt_len} words\n"
            f"machine: {num_cores()} cores available, {platform.processor() or platform.machine()}, "
            f"load average {load1:.2f} (1 min) {load5:.2f} (5 min) at start; server core {server_core}, "
            f"load generator core {client_core}\n"
            f"versions: {_versions()}")


def _versions() -> str:
    out = [f"python {platform.python_version()}"]
    for package in ("tokenwire", "h2", "fastapi", "hypercorn", "uvicorn", "uvloop", "grpcio"):
        try:
            out.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            out.append(f"{package} (not installed)")
    return ", ".join(out) + f"; uvicorn http: {http_implementation()}"


def _print_report(rows, servers, floor, failures) -> None:
    print()
    print(report.levels_table(rows))
    stages = report.server_stages_table(rows)
    if stages:
        print("\nserver-side stages (reported by the server in each stream's last chunk)")
        print(stages)
        print("\nTTFT as the server timed it and as the client saw it")
        print(report.ttft_table(rows))
    lone = report.lone_stream_table(rows)
    if lone:
        print(f"\na lone stream (concurrency {report.LONE_CONCURRENCY})")
        print(lone)
    summary = report.summarize_servers(rows, [s for s in servers if s not in failures])
    print("\nside by side (ping-pong floor p50 %.0f µs, p99 %.0f µs)" % (floor.p50_us, floor.p99_us))
    print(report.side_by_side(summary, floor.p50_us))
    ratios = report.ratios(summary)
    if ratios:
        print()
        print(ratios)
    checks = report.targets(summary, floor.p50_us)
    if checks:
        print("\ntargets (tokenwire)")
        print(report.targets_table(checks))
    for name, why in failures.items():
        print(f"\n{name} failed: {why}")
    load1, _, _ = os.getloadavg()
    print(f"\nload average at the end: {load1:.2f} (1 min)")


def _write(args, rows, servers, floor, failures, rounds) -> None:
    if args.json:
        summary = report.summarize_servers(rows, [s for s in servers if s not in failures])
        doc = {"command": "peers", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
               "floor": floor._asdict(), "rows": rows, "summary": summary, "failures": failures,
               "rounds": rounds if len(rounds) > 1 else None,
               "targets": [{"target": d, "measured": m, "met": ok}
                           for d, m, ok in report.targets(summary, floor.p50_us)]}
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")
    if args.plot and rows:
        plot_levels(rows, args.plot, f"tokenwire bench peers: zero-cost mock engine, {args.max_tokens} tokens/request"
                    if not args.step_us else f"tokenwire bench peers: mock step {args.step_us:g} µs")
        print(f"wrote {args.plot}")


def http_implementation() -> str:
    """What uvicorn's http="auto" picks: httptools when installed, else h11."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
