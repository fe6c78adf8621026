"""Run each server of `tokenwire bench peers` in turn, under the same load, and collect rows.

Every server is its own process, pinned to the server core from before its first
instruction (`preexec_fn`), so all its threads stay there; this process — the load
generator — is pinned to the other core. Each server is started, polled until one
request streams through, loaded at every concurrency level, and stopped with SIGTERM
(SIGKILL after a grace period). Server CPU is read from /proc around each measured window.
"""

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

from .. import fast_client
from ..loadgen import Target, closed_loop, open_pool, run_level

HOST = "127.0.0.1"
CEILING = "ceiling"         # not a peer: the canned server that bounds what the client can measure
H2_MINIMAL = "h2-minimal"   # the floor a lone stream is held to (h2_minimal.py)
READY_TIMEOUT_S = 120.0


class PeerSpec(NamedTuple):
    """How to start one server and how to talk to it."""
    name: str
    what: str               # one line for the report: framework, server, protocol
    argv: list              # the command, with the port and step time filled in
    protocol: str           # load generator protocol: "h2", "h1", "grpc"
    framing: str            # "sse", "ndjson", "binary", "grpc", "responses", "messages" (bench/wire.py)
    path: str
    headers: tuple = ()


def peer_specs(port: int, step_us: float, trace: Optional[str] = None, max_tokens: int = 32) -> dict:
    """Every server this benchmark knows, by name."""
    py = [sys.executable, "-m"]
    step = ["--step-us", f"{step_us:g}"]
    # --no-access-log: the peers run without access logs too (uvicorn access_log=False, hypercorn accesslog None)
    tokenwire = py + ["tokenwire", "serve", "--backend", "mock", "--mock-step-us", f"{step_us:g}", "--no-access-log",
                      "--host", HOST, "--port", str(port)] + (["--trace", trace] if trace else [])
    fastapi = py + ["tokenwire.bench.peers.fastapi_app", "--host", HOST, "--port", str(port)] + step
    grpc = py + ["tokenwire.bench.peers.grpc_peer", "--host", HOST, "--port", str(port)] + step
    h2_minimal = py + ["tokenwire.bench.peers.h2_minimal", "--host", HOST, "--port", str(port)] + step
    specs = [
        PeerSpec("tokenwire", "tokenwire, HTTP/2 h2c, OpenAI SSE /v1/completions", tokenwire, "h2", "sse",
                 "/v1/completions"),
        PeerSpec("tokenwire-ndjson", "tokenwire, HTTP/2 h2c, native NDJSON /generate", tokenwire, "h2", "ndjson",
                 "/generate"),
        PeerSpec("tokenwire-binary", "tokenwire, HTTP/2 h2c, native binary /generate", tokenwire, "h2", "binary",
                 "/generate", (("accept", "application/octet-stream"),)),
        PeerSpec("tokenwire-h1", "tokenwire, HTTP/1.1, OpenAI SSE /v1/completions", tokenwire, "h1", "sse",
                 "/v1/completions"),
        PeerSpec("tokenwire-chat", "tokenwire, HTTP/2 h2c, OpenAI SSE /v1/chat/completions", tokenwire, "h2", "sse",
                 "/v1/chat/completions"),
        PeerSpec("tokenwire-responses", "tokenwire, HTTP/2 h2c, OpenAI Responses events /v1/responses", tokenwire,
                 "h2", "responses", "/v1/responses"),
        PeerSpec("tokenwire-messages", "tokenwire, HTTP/2 h2c, Anthropic Messages events /v1/messages", tokenwire,
                 "h2", "messages", "/v1/messages"),
        PeerSpec("tokenwire-grpc", "tokenwire, gRPC tokenwire.v1.Generator/Generate on its HTTP/2 port", tokenwire,
                 "grpc", "grpc", "/tokenwire.v1.Generator/Generate"),
        PeerSpec("hypercorn", "FastAPI StreamingResponse on hypercorn, HTTP/2 h2c, uvloop",
                 fastapi + ["--server", "hypercorn"], "h2", "sse", "/v1/completions"),
        PeerSpec("uvicorn", "FastAPI StreamingResponse on uvicorn, HTTP/1.1, uvloop",
                 fastapi + ["--server", "uvicorn"], "h1", "sse", "/v1/completions"),
        PeerSpec(H2_MINIMAL, "150-line uvloop + h2 server: the floor for raw h2 in Python", h2_minimal, "h2", "sse",
                 "/v1/completions"),
        PeerSpec("grpc", "grpc.aio server-streaming RPC, HTTP/2", grpc, "grpc", "grpc", "/"),
        PeerSpec(CEILING, "canned HTTP/2 responses, no framework: what the load generator can measure at most",
                 py + ["tokenwire.bench.canned", "--host", HOST, "--port", str(port), "--tokens", str(max_tokens)],
                 "h2", "sse", "/v1/completions"),
    ]
    return {s.name: s for s in specs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server child process, pinned to a core, with its output in a temporary log."""

    def __init__(self, spec: PeerSpec, core: Optional[int]):
        self.spec = spec
        self.log = tempfile.NamedTemporaryFile(prefix=f"tokenwire-peer-{spec.name}-", suffix=".log", delete=False)
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(spec.argv, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=pin, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def failure(self) -> Optional[str]:
        """Why the process is gone, with its last output, or None while it runs."""
        if self.proc.poll() is None:
            return None
        return f"{self.spec.name} exited with status {self.proc.returncode}:\n{self.log_tail()}"

    def log_tail(self, num_lines: int = 15) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return b"\n".join(f.read().splitlines()[-num_lines:]).decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


async def wait_until_streaming(server: ServerProcess, target: Target, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll until one request streams through without error (the server may listen before it is ready)."""
    deadline = time.monotonic() + timeout_s
    last = "no connection yet"
    while time.monotonic() < deadline:
        why = server.failure()
        if why:
            raise RuntimeError(why)
        try:
            pool = await open_pool(target, 1, 1)
        except OSError as exc:
            last = str(exc)
            await asyncio.sleep(0.1)
            continue
        try:
            (rec,) = await asyncio.wait_for(closed_loop(pool, 1, 1), 30)
        finally:
            pool.close()
        if rec.error is None and rec.token_ns:
            return
        last = rec.error or "the stream carried no tokens"
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{server.spec.name} did not stream within {timeout_s:.0f} s: {last}\n{server.log_tail()}")


def level_runner(client: str, target: Target):
    """The client's run_level; the Python client for a server the other client cannot speak to."""
    try:
        fast_client.check(client, target)
    except ValueError:
        return run_level
    return run_level if client == "python" else functools.partial(fast_client.run_level, client=client)


async def measure_server(spec: PeerSpec, target: Target, levels: list, core: Optional[int],
                         max_tokens: int, client: str = "python", **level_options) -> list:
    """Start one server, run every level against it, stop it; one row per level. `level_options`:
    run_level's (mode, spread_s)."""
    server = ServerProcess(spec, core)
    rows = []
    run = level_runner(client, target)
    try:
        await wait_until_streaming(server, target)
        for concurrency, num_requests, num_warmup in levels:
            row = await run(target, concurrency, num_requests, num_warmup=num_warmup, server_pid=server.pid,
                            expected_tokens=max_tokens, **level_options)
            why = server.failure()
            if why:
                raise RuntimeError(why)
            row.update(server=spec.name)
            rows.append(row)
    finally:
        server.stop()
    return rows
