"""`tokenwire bench response-cache`: TTFT of an answer from the exact-match response cache
against the mock engine's, measured in the same run.

    tokenwire bench response-cache [--model PATH] [--backend cpu] [--requests 300] [--rounds 5]

Two servers run in this process on loopback: the model (--backend, default cpu on the
default model) with `--response-cache-size 64`, and `--backend mock` (zero-cost steps). One
greedy streamed completion (--max-tokens tokens, ignore_eos) is sent to the model once to
fill the cache; then, for --rounds rounds, each server gets --requests identical requests at
concurrency 1 over HTTP/2 (bench/loadgen.py, after a warm-up), the two alternating so they
share the machine's state. The model server answers every measured request from the cache
(the run checks its hit counter). Reported: the median over rounds of each server's TTFT
p50, and their ratio against the target (cached within 1.2x of the mock).
"""

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import orjson

from ..server import Server
from .args import positive_int
from .loadgen import Target, run_level

TARGET_RATIO = 1.2



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="engine or model (default: the embedded default model)")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "reference", "cuda"))
    parser.add_argument("--requests", type=positive_int, default=300, help="measured requests per round and server")
    parser.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def target(server: Server, model: str, max_tokens: int) -> Target:
    body = orjson.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "stream": True})
    return Target("127.0.0.1", server.port, "h2", "sse", "/v1/completions", body, "application/json")


async def measure(args, cached: Server, mock: Server) -> dict:
    targets = {"cached": target(cached, cached.app.model.name, args.max_tokens),
               "mock": target(mock, "mock", args.max_tokens)}
    await run_level(targets["cached"], 1, 1, num_warmup=0)          # the one live answer: fills the cache
    p50 = {name: [] for name in targets}
    for _ in range(args.rounds):
        for name, t in targets.items():
            row = await run_level(t, 1, args.requests, num_warmup=20, expected_tokens=args.max_tokens)
            if row["num_errors"] or row["num_count_mismatches"]:
                raise RuntimeError(f"{name}: {row['first_error'] or 'wrong token counts'}")
            p50[name].append(row["ttft_p50_us"])
    return {name: statistics.median(values) for name, values in p50.items()} | {"rounds": p50}


def run(args) -> int:
    try:
        cached = Server(args.model, backend=args.backend, port=0, response_cache_size=64).start()
    except (ValueError, OSError, ImportError) as exc:
        print(f"tokenwire bench response-cache: {exc}", file=sys.stderr)
        return 2
    mock = Server(backend="mock", port=0).start()
    try:
        result = asyncio.run(measure(args, cached, mock))
        hits = cached.engine.stats().num_response_cache_hits
    finally:
        cached.stop()
        mock.stop()
    expected_hits = args.rounds * (args.requests + 20)
    ratio = result["cached"] / result["mock"]
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"TTFT p50 at concurrency 1, HTTP/2, {args.max_tokens}-token greedy answers, median of {args.rounds} rounds "
          f"of {args.requests} requests:")
    print(f"  response cache ({args.backend}): {result['cached']:8.1f} us  ({hits} cache hits, {expected_hits} expected)")
    print(f"  mock engine:          {result['mock']:8.1f} us")
    print(f"  ratio {ratio:.2f}  (target <= {TARGET_RATIO}: {verdict})")
    if hits < expected_hits:
        print("  some measured requests were not cache hits: the comparison is void", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(dict(result, ratio=ratio, hits=hits), indent=2))
    return 0
