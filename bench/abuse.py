"""`tokenwire bench abuse`: every abuse of issue 12 against a real server, a legitimate client beside it.

    tokenwire bench abuse                  # full scale: 1M-frame floods, 100k rapid resets, 500 slowloris
    tokenwire bench abuse --scale ci       # the sizes tests/test_abuse.py runs

A server (`tokenwire serve --backend mock`) runs in its own process on 127.0.0.1; the
legitimate client runs in another (so its timings share no GIL with the attackers) and sends
one small streaming request every 100 ms on its own HTTP/2 connection, recording its time to
first token. Each abuse (bench/abuses.py) runs in turn from this process while the server's
RSS is sampled every 10 ms. The table: the abuse, the server's answer, RSS before / peak /
after (MiB), and the legitimate client's TTFT p50 and worst before (a quiet baseline) and
during the abuse.
"""

import multiprocessing
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, NamedTuple

import h2.config
import h2.connection
import h2.events

from . import abuses
from .abuses import Answer, Scale

MIB = 1 << 20
# server flags for the CI scale: deadlines short enough to watch them fire
CI_SERVER_ARGS = ("--handshake-timeout", "2", "--write-timeout", "2", "--idle-timeout", "30")


class Row(NamedTuple):
    abuse: str
    answer: Answer
    rss_mib: tuple          # before, peak, after
    ttft_ms: tuple          # p50, worst during the abuse (None when the client got no answer)
    num_legit: int          # legitimate requests answered during it
    num_legit_failed: int


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


# ------------------------------------------------------------------ the runs

def abuse_table(served: Served, scale: Scale, limit: int) -> list[tuple[str, Callable[[], Answer]]]:
    port = served.port
    return [
        ("HTTP/2 body over the limit, no content-length", lambda: abuses.body_over_limit(port, limit, False)),
        ("HTTP/2 content-length over the limit", lambda: abuses.body_over_limit(port, limit, True)),
        (f"rapid reset: {scale.num_rapid_resets} streams", lambda: abuses.rapid_reset(port, scale)),
        (f"{scale.num_flood_frames} SETTINGS, never reading", lambda: abuses.settings_flood(port, scale)),
        (f"{scale.num_flood_frames} PINGs, never reading", lambda: abuses.ping_flood(port, scale)),
        (f"{scale.num_flood_frames} WINDOW_UPDATEs", lambda: abuses.window_update_flood(port, scale)),
        (f"{scale.num_flood_frames} empty DATA frames", lambda: abuses.empty_frame_flood(port, scale)),
        (f"slowloris: {scale.num_slowloris} conns, preface 1 byte/s", lambda: abuses.slowloris(port, scale)),
        (f"zero window: {scale.zero_window_streams} streams x {scale.zero_window_tokens} tokens",
         lambda: abuses.zero_window(port, scale)),
        (f"never reads: {scale.zero_window_streams} streams x {scale.zero_window_tokens * 10} tokens",
         lambda: abuses.never_reads(port, scale)),
        (f"{scale.prompt_bytes / 1e6:.1f} MB prompt", lambda: abuses.big_prompt(port, scale)),
        ("HEAD /metrics, HTTP/1.1", lambda: abuses.head_request(port, False)),
        ("HEAD /metrics, HTTP/2", lambda: abuses.head_request(port, True)),
        ("invalid preface 'PRI * HTTP/2.0...XX'", lambda: abuses.invalid_preface(port)),
    ]


def run_abuses(served: Served, scale: Scale, limit: int, only: set | None = None,
               baseline_s: float = 2.0) -> tuple[tuple, list[Row]]:
    """Baseline, then each abuse with the RSS sampled; -> (baseline (p50, worst, n, failed), rows)."""
    legit = Legit(served.port)
    time.sleep(0.5)             # its connection is up
    t_base = time.monotonic()
    time.sleep(baseline_s)
    spans = []
    for name, run in abuse_table(served, scale, limit):
        if only and not any(word in name for word in only):
            continue
        before = served.rss_bytes()
        peak = [before]
        done = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(served, peak, done), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        answer = run()
        t1 = time.monotonic()
        time.sleep(0.3)         # the server lets go of what the abuse left
        done.set()
        sampler.join()
        after = served.rss_bytes()
        spans.append((name, answer, (before, max(peak[0], after), after), t0, max(t1, t0 + 0.25)))
    samples = legit.stop()
    baseline = ttft_between(samples, t_base, t_base + baseline_s)
    rows = []
    for name, answer, rss, t0, t1 in spans:
        p50, worst, n, failed = ttft_between(samples, t0, t1)
        rows.append(Row(name, answer, tuple(x / MIB for x in rss), (p50, worst), n, failed))
    return baseline, rows


def _sample_rss(served: Served, peak: list, done: threading.Event) -> None:
    """Every 10 ms until `done`: the largest RSS seen goes to peak[0]."""
    while not done.wait(0.01):
        peak[0] = max(peak[0], served.rss_bytes())


def format_table(baseline: tuple, rows: list[Row]) -> str:
    ms = lambda x: "-" if x is None else f"{x:.1f}"     # noqa: E731
    lines = [f"legitimate client, quiet baseline: TTFT p50 {ms(baseline[0])} ms, worst {ms(baseline[1])} ms "
             f"({baseline[2]} requests, {baseline[3]} failed)", "",
             "| abuse | server answer | RSS before / peak / after (MiB) | legit TTFT p50 / worst during (ms) "
             "| legit served / failed |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.abuse} | {r.answer.text} | {r.rss_mib[0]:.0f} / {r.rss_mib[1]:.0f} / {r.rss_mib[2]:.0f} "
                     f"| {ms(r.ttft_ms[0])} / {ms(r.ttft_ms[1])} | {r.num_legit} / {r.num_legit_failed} |")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--scale", choices=("ci", "full"), default="full",
                        help="full: 1M-frame floods, 100k rapid resets, 500 slowloris connections (default); "
                             "ci: the test suite's sizes")
    parser.add_argument("--only", default=None, help="comma-separated words: run the abuses whose name holds one")
    parser.add_argument("--mock-step-us", type=float, default=1000.0,
                        help="the mock engine's step time (default: %(default)s)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more `tokenwire serve` argument (repeatable), e.g. --server-arg=--write-timeout=5")


def run(args) -> int:
    scale = abuses.CI if args.scale == "ci" else abuses.FULL
    server_args = list(CI_SERVER_ARGS if args.scale == "ci" else ()) + args.server_arg
    limit = 4 * MIB
    served = Served(server_args, mock_step_us=args.mock_step_us)
    try:
        only = set(args.only.split(",")) if args.only else None
        baseline, rows = run_abuses(served, scale, limit, only)
        print(format_table(baseline, rows))
        closed = {k: v for k, v in served.metrics().items() if k.startswith("tokenwire_connections_closed_total") and v}
        print("\ntokenwire_connections_closed_total:", ", ".join(f"{k[k.index('=') + 2:-2]}={v:g}"
                                                               for k, v in sorted(closed.items())))
        errors = [line for line in served.log if "Traceback" in line or "ERROR" in line or "Fatal" in line]
        print(f"server log: {len(served.log)} lines, {len(errors)} errors" + "".join("\n  " + e for e in errors[:10]))
    finally:
        served.stop()
    return 0
