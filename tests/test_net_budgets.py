"""Server-wide budgets (net/budgets.py) and memory given back (net/memory.py).

The rule that picks which connections to end, the defaults' formulas, and when memory is
given back, as units; then each budget over a real server (mock engine, both event loops)
with small budgets: a connection over the total unsent budget is ended while a smaller,
older one and a legitimate client are served; the largest body holder is ended at the total
body budget; past max_connections, new connections are refused in their protocol (HTTP/1.1
503, HTTP/2 SETTINGS + GOAWAY) and counted. Nothing here asserts a duration: every step
waits for what the server said.
"""

import asyncio
import json
import socket
import ssl
import struct
import time

import h2.connection
import h2.settings
import pytest
from h2.errors import ErrorCodes

import tokenwire
from tokenwire.bench.abuses import (
    DATA,
    GOAWAY,
    HEADERS,
    HELLO,
    PING,
    SETTINGS,
    frame,
    goaway_of,
    read_frames,
    request_block,
)
from tokenwire.net import budgets, memory
from tokenwire.net.app import App
from tokenwire.net.budgets import MIB, SET_UPS_PER_TICK, ServerLimits, pick_victims
from tokenwire.net.protocol.events import Limits
from tokenwire.net.protocol.shell import ServerProtocol

from clients.rawh2 import RawH2
from clients.tls import self_signed_cert
from test_net_protocol_limits import MemoryTransport

HOST = "127.0.0.1"


# ------------------------------------------------------------------ units

def test_the_largest_holders_go_first_and_the_oldest_among_equals():
    holders = [(100, 1.0, "small-old"), (5000, 9.0, "big-new"), (6000, 3.0, "big-old"), (9000, 8.0, "bigger")]
    # 9000 is alone in its power of two; 5000 and 6000 share theirs, and the older goes first
    assert pick_victims(holders, 1) == ["bigger"]
    assert pick_victims(holders, 9001) == ["bigger", "big-old"]
    assert pick_victims(holders, 15001) == ["bigger", "big-old", "big-new"]
    assert pick_victims(holders, 10**9) == ["bigger", "big-old", "big-new", "small-old"]
    assert pick_victims(holders, 0) == [] and pick_victims([], 10) == []


class Endable:
    def __init__(self):
        self.ended = []

    def end(self, cause: str, why: str) -> None:
        self.ended.append(cause)


def test_budget_cuts_log_one_line_per_interval_counting_every_connection_ended(monkeypatch, caplog):
    """An attack trips a budget several times a second: the first cut is logged at once, the
    rest of the interval's cuts in one line at its end, each connection still ended at once."""
    monkeypatch.setattr(budgets, "LOG_INTERVAL_S", 0.2)

    async def cuts():
        budget = budgets.ServerBudget(ServerLimits(10, 1000, 1000), set())
        conns = [Endable() for _ in range(6)]
        budget.unsent.bytes = 1500
        for conn in conns:
            budget._cut([conn], budget.unsent)
        await asyncio.sleep(0.4)
        return conns

    with caplog.at_level("WARNING", logger="tokenwire.net"):
        conns = asyncio.run(cuts())
    assert all(conn.ended == ["total_unsent_bytes"] for conn in conns)
    lines = [r.getMessage() for r in caplog.records if "over the server's limit" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].endswith("ended 1 connection(s) holding the most")
    assert lines[1].endswith("ended 5 connection(s) holding the most")


def test_the_defaults_follow_the_machine(monkeypatch):
    monkeypatch.setattr(budgets, "memory_bytes", lambda: 1 << 30)
    monkeypatch.setattr(budgets, "fd_limit", lambda: 1024)
    limits = ServerLimits()
    assert limits.max_connections == min(1024 - 256, (1 << 30) // 32 // (32 * 1024)) == 768
    assert limits.max_total_unsent_bytes == limits.max_total_body_bytes == 16 * MIB       # 1/64 is below the floor
    monkeypatch.setattr(budgets, "memory_bytes", lambda: 24 << 30)
    monkeypatch.setattr(budgets, "fd_limit", lambda: 300)
    limits = ServerLimits()
    assert limits.max_connections == 150 and limits.max_total_unsent_bytes == 384 * MIB
    monkeypatch.setattr(budgets, "memory_bytes", lambda: 1 << 40)
    assert ServerLimits().max_total_body_bytes == 1024 * MIB
    with pytest.raises(ValueError, match="max_connections"):
        ServerLimits(max_connections=0)


class Freed:
    """What memory.GiveBack reads of a ServerBudget."""

    def __init__(self, num_freed_bytes=0, num_closed=0, num_unsent_bytes=0):
        self.num_freed_bytes, self.num_closed = num_freed_bytes, num_closed
        self.num_unsent_bytes, self.num_body_bytes = num_unsent_bytes, 0

    def take_freed(self):
        out = self.num_freed_bytes, self.num_closed
        self.num_freed_bytes = self.num_closed = 0
        return out


def test_memory_is_given_back_after_large_frees_many_closes_or_a_burst_at_most_once_per_interval():
    give_back = memory.GiveBack()
    trims = []
    give_back.trim = trims.append
    give_back.maybe(Freed(memory.GIVE_BACK_BYTES - 1, memory.GIVE_BACK_CONNECTIONS - 1), 100.0)
    assert trims == []
    give_back.maybe(Freed(memory.GIVE_BACK_BYTES), 100.0)
    assert trims == [0]
    give_back.maybe(Freed(0, memory.GIVE_BACK_CONNECTIONS), 100.0 + memory.GIVE_BACK_INTERVAL_S / 2)
    assert trims == [0]
    give_back.maybe(Freed(0, memory.GIVE_BACK_CONNECTIONS), 100.0 + memory.GIVE_BACK_INTERVAL_S)
    assert trims == [0, 0] and give_back.num_times == 2
    # a little let go of is enough once a burst (given back while much was held) is over
    later = 100.0 + 2 * memory.GIVE_BACK_INTERVAL_S
    give_back.maybe(Freed(memory.QUIET_FREED_BYTES), later)
    assert trims == [0, 0]                  # no burst before
    give_back.maybe(Freed(memory.GIVE_BACK_BYTES, num_unsent_bytes=memory.QUIET_BYTES), later)
    assert trims == [0, 0, 0]               # large frees while much is held: a burst
    later += memory.GIVE_BACK_INTERVAL_S
    give_back.maybe(Freed(memory.QUIET_FREED_BYTES, num_unsent_bytes=memory.QUIET_BYTES), later)
    assert trims == [0, 0, 0]               # not over yet
    give_back.maybe(Freed(memory.QUIET_FREED_BYTES), later)
    assert trims == [0, 0, 0, 0]            # over: given back once more
    give_back.maybe(Freed(memory.QUIET_FREED_BYTES), later + memory.GIVE_BACK_INTERVAL_S)
    assert trims == [0, 0, 0, 0]            # and no more


class ReadingTransport(MemoryTransport):
    reading = True

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True


def test_a_burst_of_new_connections_is_set_up_a_share_per_iteration_of_the_loop():
    """2,000 connections at once held the loop 100+ ms setting up their sessions: past
    SET_UPS_PER_TICK in one iteration, a connection's first bytes wait (reading paused) for
    the next, in arrival order."""
    async def burst():
        app = App()
        conns = [ServerProtocol(app, Limits()) for _ in range(SET_UPS_PER_TICK + 8)]
        for proto in conns:
            proto.connection_made(ReadingTransport())
            proto.data_received(HELLO)
        set_up = [proto.session is not None for proto in conns]
        paused = [not proto.transport.reading for proto in conns]
        await asyncio.sleep(0)                  # the next iteration
        return set_up, paused, [proto.session is not None and proto.transport.reading for proto in conns]
    set_up, paused, later = asyncio.run(burst())
    assert set_up == [True] * SET_UPS_PER_TICK + [False] * 8
    assert paused == [False] * SET_UPS_PER_TICK + [True] * 8
    assert all(later)


# ------------------------------------------------------------ real servers

@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def loop_kind(request):
    return request.param


def serve(loop_kind, http2_only=False, tls=None, **server_limits):
    limits = Limits(write_timeout_s=600, idle_timeout_s=600, handshake_timeout_s=600,   # no deadline fires here
                    http2_only=http2_only)
    full = dict(max_connections=64, max_total_unsent_bytes=64 * MIB, max_total_body_bytes=64 * MIB) | server_limits
    cert, key = tls or (None, None)
    return tokenwire.Server(backend="mock", port=0, loop=loop_kind, limits=limits, tls_cert=cert, tls_key=key,
                            server_limits=ServerLimits(**full)).start()


def completion(max_tokens: int) -> dict:
    return {"prompt": "hi", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


def get(sock: socket.socket, path: str) -> bytes:
    """One HTTP/1.1 keep-alive GET on `sock`; -> the response (head and content-length body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
        chunk = sock.recv(65536)
        assert chunk, raw
        raw += chunk
    return raw


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def closed_count(sock: socket.socket, reason: str) -> float:
    text = get(sock, "/metrics").split(b"\r\n\r\n", 1)[1].decode()
    return float(text.split(f'tokenwire_connections_closed_total{{reason="{reason}"}} ', 1)[1].split()[0])


def gauge(sock: socket.socket, name: str) -> float:
    text = get(sock, "/metrics").split(b"\r\n\r\n", 1)[1].decode()
    return float(text.split(f"\n{name} ", 1)[1].split()[0])


def counted(port: int, reason: str, expected: int, sock: socket.socket | None = None) -> float:
    """closed_total{reason} once it reaches `expected` (a close is counted when the server
    sees the connection lost, after our side closed too), or what it is after 30 s; asked
    on `sock`, else on a new connection."""
    deadline = time.monotonic() + 30
    with sock or socket.create_connection((HOST, port)) as s:
        while (n := closed_count(s, reason)) < expected and time.monotonic() < deadline:
            time.sleep(0.01)
    return n


def read_to_eof(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except ConnectionResetError:
        pass
    return raw


def test_over_the_total_unsent_budget_the_largest_holder_is_ended(loop_kind):
    """Two clients whose stream windows stay shut (responses queue in the server): an older
    one holding a little, a newer one holding more and more. Past 256 KiB in all, the newer
    is ended (GOAWAY ENHANCE_YOUR_CALM); the older gets its whole answer once it opens its
    window, and a legitimate client is served."""
    server = serve(loop_kind, max_total_unsent_bytes=256 * 1024)
    try:
        small = RawH2(HOST, server.port, window=0)
        sid = small.post("/v1/completions", completion(20))
        small.read_until(lambda: sid in small.status)           # its tokens queue behind a shut window
        big = RawH2(HOST, server.port, window=0)
        for _ in range(4):
            big.post("/v1/completions", completion(3000))        # ~1.2 MB of SSE, far over 256 KiB
        big.read_until(lambda: big.goaway is not None)
        assert big.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
        big.close()
        small.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        small.flush()
        small.read_until(lambda: sid in small.ended)
        assert small.data[sid].endswith(b"data: [DONE]\n\n") and small.goaway is None
        legit = RawH2(HOST, server.port)
        sid = legit.post("/v1/completions", completion(8))
        legit.read_until(lambda: sid in legit.ended)
        assert legit.status[sid] == b"200"
        assert counted(server.port, "total_unsent_bytes", 1) == 1
        with socket.create_connection((HOST, server.port)) as s:
            assert gauge(s, "tokenwire_unsent_bytes") == 0
    finally:
        server.stop()


def test_over_the_total_body_budget_the_largest_holder_is_ended(loop_kind):
    """An HTTP/2 body of 300 KB held (older), then an HTTP/1.1 body passing 750 KB: past
    1 MiB in all, the HTTP/1.1 connection (holding the most) is closed; the HTTP/2 request
    completes and is answered."""
    server = serve(loop_kind, max_total_body_bytes=1 * MIB)
    try:
        body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode() + b" " * 300_000
        held = socket.create_connection((HOST, server.port))
        held.sendall(HELLO + frame(HEADERS, 4, 1, request_block("/v1/completions"))
                     + b"".join(frame(DATA, 0, 1, body[i:i + 16384]) for i in range(0, len(body) - 1, 16384))
                     + frame(PING, 0, 0, b"counted!"))
        frames, _ = read_frames(held, 30, until=lambda fs: any(f.type == PING and f.flags & 1 for f in fs))
        assert any(f.type == PING for f in frames)             # every byte before the PING was read
        big = socket.create_connection((HOST, server.port))
        big.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: 3000000\r\n\r\n")
        try:
            big.sendall(b" " * 800_000)
        except OSError:
            pass                                                # ended while we were still sending
        assert b"HTTP/1.1" not in read_to_eof(big)             # closed, no response
        big.close()
        held.sendall(frame(DATA, 1, 1, body[-1:]))
        frames, _ = read_frames(held, 30, until=lambda fs: any(f.type in (DATA, HEADERS) and f.flags & 1
                                                               for f in fs))
        assert any(f.type == HEADERS for f in frames) and goaway_of(frames) is None
        assert b'"finish_reason"' in b"".join(f.payload for f in frames if f.type == DATA)
        assert counted(server.port, "total_body_bytes", 1) == 1
        with socket.create_connection((HOST, server.port)) as s:
            assert gauge(s, "tokenwire_body_bytes") == 0
        held.close()
    finally:
        server.stop()


def test_past_max_connections_new_ones_are_refused_in_their_protocol_and_counted(loop_kind):
    server = serve(loop_kind, max_connections=3)
    try:
        open_ = [socket.create_connection((HOST, server.port)) for _ in range(3)]
        for s in open_:
            assert get(s, "/health").startswith(b"HTTP/1.1 200 ")     # accepted and served
        with socket.create_connection((HOST, server.port)) as s:        # HTTP/1.1: 503
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = read_to_eof(s).split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        with socket.create_connection((HOST, server.port)) as s:        # HTTP/2: SETTINGS, GOAWAY(0, NO_ERROR)
            s.sendall(HELLO)
            frames, closed = read_frames(s, 30)
        assert closed and [f.type for f in frames] == [SETTINGS, GOAWAY]
        assert struct.unpack(">II", frames[1].payload[:8]) == (0, ErrorCodes.NO_ERROR)
        with socket.create_connection((HOST, server.port)) as s:        # says nothing: closed, no answer
            assert read_to_eof(s) == b""
        open_.pop().close()
        num_refused = 3
        for _ in range(1000):                       # once the server has seen the close, one more fits
            with socket.create_connection((HOST, server.port)) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = read_to_eof(s)
            if not answer.startswith(b"HTTP/1.1 503 "):
                break
            num_refused += 1
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert counted(server.port, "max_connections", num_refused, open_[0]) == num_refused
        for s in open_[1:]:
            s.close()
    finally:
        server.stop()


def test_where_tls_alpn_or_http2_only_names_the_protocol_the_refusal_comes_at_once(loop_kind, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server = serve(loop_kind, tls=(cert, key), max_connections=1)
    try:
        ctx = ssl.create_default_context(cafile=cert)
        with socket.create_connection((HOST, server.port)) as held:
            with ctx.wrap_socket(held, server_hostname="localhost") as held_tls:
                assert get(held_tls, "/health").startswith(b"HTTP/1.1 200 ")       # the one connection
                for alpn, expected in (["h2"], b"\x00\x00\x00\x04"), (["http/1.1"], b"HTTP/1.1 503 "):
                    ctx.set_alpn_protocols(alpn)
                    with ctx.wrap_socket(socket.create_connection((HOST, server.port)),
                                         server_hostname="localhost") as s:
                        assert read_to_eof(s).startswith(expected), alpn         # nothing sent first
    finally:
        server.stop()
    server = serve(loop_kind, http2_only=True, max_connections=1)
    try:
        with socket.create_connection((HOST, server.port)) as held:
            held.sendall(HELLO)
            read_frames(held, 30, until=lambda fs: any(f.type == SETTINGS for f in fs))
            with socket.create_connection((HOST, server.port)) as s:
                frames, closed = read_frames(s, 30)
            assert closed and [f.type for f in frames] == [SETTINGS, GOAWAY]
    finally:
        server.stop()


def test_a_closed_connection_leaves_no_cycles_for_the_collector(loop_kind):
    """A lost connection undoes its reference cycles (protocol.py `_break_cycles`), so reference
    counting frees it as it closes: after 2,000 connections closed, the full collection that
    found them held the loop 130-325 ms. Idle HTTP/2, HTTP/2 with a stream in flight, HTTP/1.1."""
    import gc

    from tokenwire.net.protocol.http2 import H2Session
    server = serve(loop_kind)
    try:
        gc.collect()
        socks = []
        for i in range(12):
            sock = socket.create_connection((HOST, server.port))
            if i % 3 == 0:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            elif i % 3 == 1:
                sock.sendall(HELLO + frame(HEADERS, 5, 1, request_block("/health", "GET")))
            else:
                body = json.dumps(completion(100000)).encode()
                sock.sendall(HELLO + frame(HEADERS, 4, 1, request_block("/v1/completions", "POST"))
                             + frame(DATA, 1, 1, body))
            socks.append(sock)
        for sock in socks:              # every connection answered: its session exists
            assert sock.recv(1)
        metrics = socket.create_connection((HOST, server.port))
        assert gauge(metrics, "tokenwire_connections_open") == 13
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 30
        while gauge(metrics, "tokenwire_connections_open") > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gauge(metrics, "tokenwire_connections_open") == 1
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            kinds = {type(o).__name__ for o in gc.garbage
                     if isinstance(o, (ServerProtocol, H2Session, h2.connection.H2Connection))}
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert not kinds, f"left for the collector: {kinds}"
        metrics.close()
    finally:
        server.stop()


@pytest.mark.parametrize("send_buffer", [64 * 1024, 0])
def test_each_connection_gets_the_socket_send_buffer(send_buffer):
    """--socket-send-buffer: SO_SNDBUF on every accepted TCP socket (Linux reports double what
    was set), so a client that stops reading pauses our writes early and holds little kernel
    memory; 0 leaves the OS's autotuning."""
    limits = Limits(socket_send_buffer=send_buffer)
    server = tokenwire.Server(backend="mock", port=0, limits=limits).start()
    try:
        with socket.create_connection((HOST, server.port)) as sock:
            assert b"200" in get(sock, "/health").split(b"\r\n", 1)[0]
            (proto,) = [p for p in list(server.app.connections) if p.transport is not None]
            got = proto.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            with socket.socket() as fresh:
                default = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if send_buffer:
            assert got in (send_buffer, 2 * send_buffer)
        else:
            assert got >= default and got not in (64 * 1024, 128 * 1024 * 2)
    finally:
        server.stop()


def test_the_socket_send_buffer_flag():
    from tokenwire.cli import build_parser

    def parse(*argv):
        return build_parser(["serve", *argv]).parse_args(["serve", *argv])
    assert parse("--socket-send-buffer", "0").socket_send_buffer == 0
    assert parse("--socket-send-buffer", "256KiB").socket_send_buffer == 256 * 1024
    assert parse().socket_send_buffer == Limits().socket_send_buffer == 128 * 1024
    with pytest.raises(ValueError):
        Limits(socket_send_buffer=-1)
