"""The machine's floor: a 64-byte round trip between two processes over loopback TCP.

No server can answer a request faster than one such round trip, so the TTFT figures are
printed next to it. The echo side is a child process (`python -m tokenwire.bench.pingpong
--echo`) pinned to the server core; the caller's process, pinned to the load core, sends
and times each round trip with blocking sockets and TCP_NODELAY, the cheapest Python can do.
"""

import argparse
import socket
import subprocess
import sys
import time
from typing import NamedTuple, Optional

from .proc import pin_to_core
from .stats import percentile


class PingPong(NamedTuple):
    num_round_trips: int
    size: int            # bytes each way
    p50_us: float
    p99_us: float
    min_us: float


def measure_floor(num_round_trips: int = 2000, size: int = 64, server_core: Optional[int] = None,
                  num_warmup: int = 200) -> PingPong:
    """Round-trip times against an echo child process; the caller stays where it is pinned."""
    cmd = [sys.executable, "-m", "tokenwire.bench.pingpong", "--echo", "--size", str(size)]
    if server_core is not None:
        cmd += ["--core", str(server_core)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtt_ns = _round_trips(sock, num_warmup + num_round_trips, size)[num_warmup:]
    finally:
        child.wait(timeout=10)
    rtt_us = sorted(ns / 1000 for ns in rtt_ns)
    return PingPong(num_round_trips, size, percentile(rtt_us, 50), percentile(rtt_us, 99), rtt_us[0])


def _round_trips(sock: socket.socket, n: int, size: int) -> list:
    message = b"x" * size
    buf = bytearray(size)
    view = memoryview(buf)
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        sock.sendall(message)
        got = 0
        while got < size:
            got += sock.recv_into(view[got:], size - got)
        out.append(clock() - t0)
    return out


def _echo(size: int, core: Optional[int]) -> None:
    if core is not None:
        pin_to_core(core)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        print(listener.getsockname()[1], flush=True)
        sock, _ = listener.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(size)
        view = memoryview(buf)
        while True:
            got = 0
            while got < size:
                n = sock.recv_into(view[got:], size - got)
                if n == 0:
                    return
                got += n
            sock.sendall(buf)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="loopback ping-pong (echo side)")
    parser.add_argument("--echo", action="store_true", required=True)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--core", type=int, default=None)
    args = parser.parse_args(argv)
    _echo(args.size, args.core)
    return 0


if __name__ == "__main__":
    sys.exit(main())
