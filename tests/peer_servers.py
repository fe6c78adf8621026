"""Peer servers of `tokenwire bench peers` (bench/peers/) for tests: each in its own process."""

import asyncio

from tokenwire.bench.load import make_target
from tokenwire.bench.peers.runner import HOST, ServerProcess, free_port, peer_specs, wait_until_streaming


def start_peer(name: str, max_tokens: int) -> tuple:
    """Start the peer `name` on a free port and return once one request streams through it.
    -> (port, ServerProcess); the caller stops it."""
    port = free_port()
    spec = peer_specs(port, 0.0)[name]
    server = ServerProcess(spec, None)
    target = make_target(HOST, port, spec.path, spec.protocol, spec.framing, 3, max_tokens)
    try:
        asyncio.run(wait_until_streaming(server, target, timeout_s=60))
    except BaseException:
        server.stop()
        raise
    return port, server
