"""`tokenwire bench deploy`: the deploy artifacts measured side by side in one run.

- `--binary PATH`: the single-file binary's size; its cold start (launch to `/health` 200,
  model cache warm, so the figure is process start-up plus model load) and its TTFT
  (p50/p99 over sequential streams, the lean HTTP/2 client of `bench load`) against the
  Python install (`python -m tokenwire serve`), in alternating rounds on the same model.
- `--haproxy CONFIG`: two mock replicas behind HAProxy on CONFIG (deploy/haproxy.cfg):
  h2load requests/s and errors, and TTFT p50/p99 with the lean client, through HAProxy
  against straight to one replica, alternating.

Every figure is the median over `--rounds`; the table prints both sides and their ratio.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .cluster import start_haproxy, start_tokenwire
from .h2load import h2load_command, parse_output
from .load import make_target, run_event_loop
from .loadgen import run_level
from .stats import table

MOCK_ARGS = ["--backend", "mock", "--mock-step-us", "1000"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--binary", default=None, help="the single-file binary (scripts/build_binary.sh)")
    parser.add_argument("--python", default=None,
                        help="the Python whose tokenwire install is the reference (default: this one)")
    parser.add_argument("--model", default=None, help="model for the binary comparison (default: the default model)")
    parser.add_argument("--haproxy", default=None, metavar="CONFIG", help="HAProxy config (deploy/haproxy.cfg)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (default 3)")
    parser.add_argument("--requests", type=int, default=40, help="streams per TTFT measurement (default 40)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per stream (default 16)")
    parser.add_argument("--h2load-requests", type=int, default=4000, help="h2load requests per run (default 4000)")
    parser.add_argument("--concurrency", type=int, default=64, help="h2load streams in flight (default 64)")


def run(args) -> int:
    if not args.binary and not args.haproxy:
        print("tokenwire bench deploy: give --binary PATH, --haproxy CONFIG, or both", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tokenwire-bench-deploy-") as tmp:
        if args.binary:
            print(compare_binary(args, Path(tmp)))
        if args.haproxy:
            print(compare_haproxy(args, Path(tmp)))
    return 0


def python_command(args) -> list:
    if args.python:
        return [args.python, "-m", "tokenwire"]
    if getattr(sys, "frozen", False):
        return ["python3", "-m", "tokenwire"]
    return [sys.executable, "-m", "tokenwire"]


def ttft(port: int, args, concurrency: int = 1, num_requests: int = 0) -> dict:
    """The lean client's row for one level against 127.0.0.1:port (ttft_us_p50, ttft_us_p99, ...)."""
    target = make_target("127.0.0.1", port, "/v1/completions", "h2", "sse", 16, args.max_tokens)
    return run_event_loop(run_level(target, concurrency, num_requests or args.requests, num_warmup=concurrency,
                                    expected_tokens=args.max_tokens))


def compare_binary(args, tmp: Path) -> str:
    binary = Path(args.binary).resolve()
    sides = {"binary": [str(binary)], "python": python_command(args)}
    serve_args = ["--model", args.model] if args.model else []
    env = {**os.environ, "TOKENWIRE_CACHE_DIR": str(tmp / "cache")}
    start_tokenwire(sides["python"], serve_args, tmp / "warm.log", env=env).stop()   # builds the model once
    figures = {side: {"start_s": [], "ttft_p50": [], "ttft_p99": [], "errors": 0} for side in sides}
    for round_index in range(args.rounds):
        for side, command in sides.items():
            served = start_tokenwire(command, serve_args, tmp / f"{side}-{round_index}.log", name=side, env=env)
            try:
                row = ttft(served.port, args)
                served.signal()
                served.wait()
            finally:
                served.stop()
            f = figures[side]
            f["start_s"].append(served.started_s)
            f["ttft_p50"].append(row["ttft_us_p50"])
            f["ttft_p99"].append(row["ttft_us_p99"])
            f["errors"] += row["num_errors"]
    med = {side: {k: statistics.median(v) for k, v in f.items() if k != "errors"} for side, f in figures.items()}
    rows = [[what, f"{med['binary'][key] * scale:.{digits}f}", f"{med['python'][key] * scale:.{digits}f}",
             f"{med['binary'][key] / med['python'][key]:.2f}"]
            for what, key, scale, digits in (("cold start to /health 200, ms", "start_s", 1000, 0),
                                              ("TTFT p50, µs", "ttft_p50", 1, 0), ("TTFT p99, µs", "ttft_p99", 1, 0))]
    return (f"binary {binary}: {binary.stat().st_size / 2**20:.1f} MiB ({binary.stat().st_size} bytes)\n"
            f"medians of {args.rounds} alternating rounds, {args.requests} sequential streams of "
            f"{args.max_tokens} tokens each per TTFT figure, model: {args.model or 'the default model'}; "
            f"errors: binary {figures['binary']['errors']}, python {figures['python']['errors']}\n"
            + table(["", "binary", "python -m tokenwire", "ratio"], rows))


def compare_haproxy(args, tmp: Path) -> str:
    command = python_command(args)
    replicas = [start_tokenwire(command, MOCK_ARGS, tmp / f"replica{i}.log", name=f"replica{i}") for i in (1, 2)]
    lb = None
    try:
        lb, _ = start_haproxy(Path(args.haproxy), [r.port for r in replicas], tmp / "haproxy.log")
        body = tmp / "body.json"
        body.write_bytes(b'{"prompt": "Once upon a time", "max_tokens": %d, "stream": true}' % args.max_tokens)
        targets = {"haproxy -> 2 replicas": lb.port, "one replica directly": replicas[0].port}
        figures = {name: {"rps": [], "ttft_p50": [], "ttft_p99": [], "errors": 0} for name in targets}
        for _ in range(args.rounds):
            for name, port in targets.items():
                result = h2load(port, body, args)
                row = ttft(port, args, concurrency=8, num_requests=max(args.requests, 200))
                f = figures[name]
                f["rps"].append(result.requests_per_s)
                f["ttft_p50"].append(row["ttft_us_p50"])
                f["ttft_p99"].append(row["ttft_us_p99"])
                f["errors"] += result.num_requests - result.num_succeeded + row["num_errors"]
    finally:
        for process in [lb, *replicas]:
            if process is not None:
                process.stop()
    rows = [[name, f"{statistics.median(f['rps']):.0f}", str(f["errors"]), f"{statistics.median(f['ttft_p50']):.0f}",
             f"{statistics.median(f['ttft_p99']):.0f}"] for name, f in figures.items()]
    return (f"mock replicas ({' '.join(MOCK_ARGS)}), {args.max_tokens} tokens a stream; h2load "
            f"{args.h2load_requests} requests, {args.concurrency} streams over 4 connections; TTFT: lean "
            f"client, 8 streams in flight; medians of {args.rounds} alternating rounds\n"
            + table(["path", "h2load req/s", "errors", "TTFT p50 µs", "TTFT p99 µs"], rows))


def h2load(port: int, body: Path, args):
    cmd = h2load_command(f"http://127.0.0.1:{port}/v1/completions", str(body), (("content-type", "application/json"),),
                         args.h2load_requests, args.concurrency, num_connections=4)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return parse_output(out.stdout + out.stderr)
