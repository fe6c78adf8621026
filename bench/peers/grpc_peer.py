"""Peer (d): a grpc.aio server-streaming service yielding one GenerateReply per token.

Written the way gRPC's asyncio documentation shows it: a servicer class generated from
mock.proto, an `async def` streaming method that yields messages, `grpc.aio.server()`
with an insecure port. grpc.aio runs on the standard asyncio loop (it does not support
uvloop).

Run: python -m tokenwire.bench.peers.grpc_peer --port P [--step-us N]
"""

import argparse
import asyncio
import sys

import grpc

from .grpc_proto import load
from .mock_source import MockTokens

mock_pb2, mock_pb2_grpc = load()


class MockGenerator(mock_pb2_grpc.MockGeneratorServicer):
    def __init__(self, step_us: float):
        self.source = MockTokens(step_us)

    async def Generate(self, request, context):
        async for token in self.source.stream(request.max_tokens):
            yield mock_pb2.GenerateReply(index=token.index, token_id=token.token_id, text=token.text,
                                         finish_reason=token.finish_reason or "")


async def serve(host: str, port: int, step_us: float) -> None:
    server = grpc.aio.server()
    mock_pb2_grpc.add_MockGeneratorServicer_to_server(MockGenerator(step_us), server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"grpc peer: could not bind {host}:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-us", type=float, default=0.0, help="mock engine step time (0: zero-cost)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.step_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
