"""`tokenwire bench cold-start`: the first request after `/health` turns 200 against the
fifth, over fresh server processes.

    tokenwire bench cold-start [--model SPEC|default ...] [--starts 5] [--requests 5] [--compare-no-warm-up]

For each model (`--model`, repeatable; `default` or none: the embedded default model) the model is
built once into a private cache (untimed), then `--starts` fresh `python -m tokenwire serve`
processes are started one after another. Each is polled until `/health` answers 200 (its
launch-to-200 time is recorded), then sent `--requests` sequential streamed completions of
the same short prompt, each on a new HTTP/1.1 connection, as a user's first curl would be.
A request's TTFT is the server's own (`timings.ttft_us` of its final chunk: arrival to the
first token on the wire), with the client's (request sent to first `data:` line) beside it.
The warm-up time is read from the server's log line ("warm-up: ...").

Reported per model: medians over the starts of the first and the last request's TTFT and
of the per-start ratio first / last (the target: at most TARGET_RATIO), the start time
and the warm-up time. `--compare-no-warm-up` alternates starts with `--no-warm-up`, so the
table shows both sides measured in the same run.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .args import positive_int
from .cluster import start_tokenwire
from .stats import table

TARGET_RATIO = 2.0
PROMPT = "Once upon a time there was a"
WARM_UP_LINE = re.compile(r"warm-up: .* in ([0-9.]+) ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=None,
                        help="model spec to serve, repeatable; 'default': the embedded default model "
                             "(also what no --model means)")
    parser.add_argument("--starts", type=positive_int, default=5, help="fresh servers per side (default: %(default)s)")
    parser.add_argument("--requests", type=positive_int, default=5,
                        help="sequential requests per server; the last is the reference (default: %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=8, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--compare-no-warm-up", action="store_true",
                        help="alternate each start with one under --no-warm-up")
    parser.add_argument("--json", metavar="FILE", help="also write every measured figure as JSON")


def run(args) -> int:
    sides = {"warm-up": []} | ({"no warm-up": ["--no-warm-up"]} if args.compare_no_warm_up else {})
    results = {}
    with tempfile.TemporaryDirectory(prefix="tokenwire-bench-cold-") as tmp:
        env = {**os.environ, "TOKENWIRE_CACHE_DIR": str(Path(tmp) / "cache")}
        for spec in args.model or ["default"]:
            results[spec] = measure_model(None if spec == "default" else spec, sides, args, Path(tmp), env)
    print(report(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def measure_model(spec, sides: dict, args, tmp: Path, env: dict) -> dict:
    command = [sys.executable, "-m", "tokenwire"]
    model_args = ["--model", spec] if spec else []
    start_tokenwire(command, model_args, tmp / "build.log", env=env).stop()      # builds the engine once, untimed
    runs = {side: [] for side in sides}
    for i in range(args.starts):
        for side, flags in sides.items():
            served = start_tokenwire(command, model_args + flags, tmp / f"{side}-{i}.log", env=env)
            try:
                ttfts = [one_request(served.port, args.max_tokens) for _ in range(args.requests)]
            finally:
                served.stop()
            runs[side].append({"start_s": served.started_s, "warm_up_ms": warm_up_ms(served.log_tail(100_000)),
                               "server_ttft_us": [t[0] for t in ttfts], "client_ttft_us": [t[1] for t in ttfts]})
    return runs


def one_request(port: int, max_tokens: int) -> tuple:
    """One streamed completion on a new connection -> (server TTFT µs, client TTFT µs)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}: {response.read()[:300]!r}")
        client_us, final = None, None
        for line in response:
            if line.startswith(b"data: {"):
                client_us = client_us or (time.perf_counter() - sent) * 1e6
                chunk = json.loads(line[6:])
                final = chunk.get("timings") or final
        if final is None:
            raise RuntimeError("the stream ended without its timings")
        return final["ttft_us"], client_us
    finally:
        conn.close()


def warm_up_ms(log: str):
    match = WARM_UP_LINE.search(log)
    return float(match.group(1)) if match else None


def summary(runs: list) -> dict:
    ratios = [r["server_ttft_us"][0] / r["server_ttft_us"][-1] for r in runs]
    warm = [r["warm_up_ms"] for r in runs if r["warm_up_ms"] is not None]
    return {"first_us": statistics.median(r["server_ttft_us"][0] for r in runs),
            "last_us": statistics.median(r["server_ttft_us"][-1] for r in runs),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "client_first_us": statistics.median(r["client_ttft_us"][0] for r in runs),
            "client_last_us": statistics.median(r["client_ttft_us"][-1] for r in runs),
            "start_s": statistics.median(r["start_s"] for r in runs),
            "warm_up_ms": statistics.median(warm) if warm else None}


def report(results: dict, args) -> str:
    rows = []
    for model, sides in results.items():
        for side, runs in sides.items():
            s = summary(runs)
            rows.append([model, side, f"{s['first_us'] / 1000:.2f}", f"{s['last_us'] / 1000:.2f}",
                         f"{s['ratio']:.2f}", "yes" if s["ratio"] <= TARGET_RATIO else "no",
                         " ".join(f"{r:.2f}" for r in s["ratios"]),
                         f"{s['client_first_us'] / 1000:.2f} / {s['client_last_us'] / 1000:.2f}",
                         f"{s['start_s'] * 1000:.0f}", "-" if s["warm_up_ms"] is None else f"{s['warm_up_ms']:.0f}"])
    head = (f"medians of {args.starts} fresh starts per side; {args.requests} sequential streamed requests of "
            f"{args.max_tokens} tokens each (prompt {PROMPT!r}, greedy), a new HTTP/1.1 connection each; TTFT: "
            f"the server's (arrival to first token on the wire); ratio: request 1 / request {args.requests} "
            f"per start (target <= {TARGET_RATIO:g})\n")
    return head + table(["model", "side", "TTFT #1 ms", f"TTFT #{args.requests} ms", "ratio",
                         f"<= {TARGET_RATIO:g}", "ratio per start", "client #1 / last ms", "start ms", "warm-up ms"],
                        rows, left=(0, 1))
