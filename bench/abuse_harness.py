"""The server under test and the legitimate client beside it, for `tokenwire bench abuse`
(bench/abuse.py, bench/abuse_budgets.py) and tests/test_abuse.py.

`Served` runs `tokenwire serve --backend mock` in a child process on a free port and reads
its RSS and /metrics; `Legit` runs the legitimate client in another process (so its timings
share no GIL with the attackers): one small streaming request every 100 ms on its own
HTTP/2 connection, recording its time to first token.
"""

import multiprocessing
import socket
import subprocess
import sys
import threading
import time

import h2.config
import h2.connection
import h2.events

from . import abuses

MIB = 1 << 20


class Served:
    """`tokenwire serve` in a child process on a free port."""

    def __init__(self, args=(), mock_step_us: float = 1000.0):
        self.port = free_port()
        cmd = [sys.executable, "-m", "tokenwire", "serve", "--backend", "mock", "--port", str(self.port),
               "--mock-step-us", str(mock_step_us), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + 120
        while not _health_ok(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))
            time.sleep(0.05)

    def _read_log(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def metrics(self) -> dict:
        text = _http_get(self.port, "/metrics").decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((abuses.HOST, 0))
        return s.getsockname()[1]


def _http_get(port: int, path: str) -> bytes:
    with socket.create_connection((abuses.HOST, port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    return raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""


def _health_ok(port: int) -> bool:
    try:
        return _http_get(port, "/health") == b'{"status":"ok"}'
    except OSError:
        return False


# ------------------------------------------------------------ the legitimate client

def legit_client(port: int, stop, results) -> None:
    """Child process: one streaming request every 100 ms on one HTTP/2 connection; puts
    [(sent monotonic s, ttft s or None)] on `results` when `stop` is set."""
    samples = []
    conn = sock = None
    while not stop.is_set():
        tick = time.monotonic() + 0.1
        try:
            if sock is None:
                sock, conn = _legit_connect(port)
            samples.append(_legit_request(sock, conn))
        except (OSError, RuntimeError):
            samples.append((time.monotonic(), None))
            if sock is not None:
                sock.close()
            sock = conn = None
        time.sleep(max(0.0, tick - time.monotonic()))
    results.put(samples)


def _legit_connect(port: int):
    sock = socket.create_connection((abuses.HOST, port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def _legit_request(sock, conn) -> tuple:
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                            (":authority", abuses.HOST), ("content-type", "application/json")])
    conn.send_data(sid, b'{"prompt": "hello", "max_tokens": 4, "stream": true}', end_stream=True)
    t0 = time.monotonic()
    sock.sendall(conn.data_to_send())
    ttft = None
    while True:
        data = sock.recv(65536)
        if not data:
            raise RuntimeError("closed")
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                ttft = ttft or time.monotonic() - t0
                conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
                return t0, ttft
            elif isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                raise RuntimeError("reset")
        out = conn.data_to_send()
        if out:
            sock.sendall(out)


class Legit:
    """The legitimate client's process."""

    def __init__(self, port: int):
        ctx = multiprocessing.get_context("spawn")
        self.stop_event, self.results = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=legit_client, args=(port, self.stop_event, self.results), daemon=True)
        self.proc.start()

    def stop(self) -> list:
        self.stop_event.set()
        samples = self.results.get(timeout=60)
        self.proc.join(10)
        return samples


def ttft_between(samples: list, t0: float, t1: float) -> tuple:
    """(p50 ms, worst ms, answered, failed) of the requests sent in [t0, t1]."""
    got = [s for s in samples if t0 <= s[0] <= t1]
    ok = sorted(t for _, t in got if t is not None)
    if not ok:
        return None, None, 0, len(got)
    return ok[len(ok) // 2] * 1e3, ok[-1] * 1e3, len(ok), len(got) - len(ok)
