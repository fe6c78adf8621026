"""`tokenwire bench peers`: tokenwire against the servers users would otherwise run, on one mock engine.

Servers (each its own process, pinned to one core; the load generator on another):
  tokenwire   `tokenwire serve --backend mock`, HTTP/2 h2c, OpenAI SSE (also: -ndjson, -binary, -h1)
  hypercorn   FastAPI + hypercorn, HTTP/2 h2c, SSE           (fastapi_app.py)
  uvicorn     FastAPI + uvicorn, HTTP/1.1 chunked, SSE        (fastapi_app.py)
  grpc        grpc.aio server-streaming RPC                   (grpc_peer.py, mock.proto)
  ceiling     not a peer: canned HTTP/2 responses (bench/canned.py), the most the client can measure
All stream one message per token of the same mock sequence (mock_source.py) at the same
step time. They run one after another under the same closed-loop load from the lean
clients; the 64-byte ping-pong floor is measured first, in the same run.
"""

import argparse

DEFAULT_SERVERS = "tokenwire,hypercorn,uvicorn,grpc,ceiling"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", default=DEFAULT_SERVERS,
                        help=f"comma-separated servers to run, in order (default {DEFAULT_SERVERS}; also "
                             "tokenwire-ndjson, tokenwire-binary, tokenwire-h1)")
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
    parser.add_argument("--trace", default=None, help="tokenwire's per-request stage timelines as Chrome trace JSON")
    parser.add_argument("--json", default=None, help="write one row per server and concurrency to this JSON file")
    parser.add_argument("--plot", default=None, help="write a PNG of latency and throughput against concurrency")


def run(args) -> int:
    from .cli import run_peers
    return run_peers(args)
