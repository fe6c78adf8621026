"""The abuses of issue 12, each a blocking function over raw sockets against a server on a port.

Every abuse returns an `Answer`: what the server did, in words for the table (`text`) and
as a short code a test asserts (`code`: "goaway:ENHANCE_YOUR_CALM", "413+rst:NO_ERROR",
"rst:CANCEL", "closed", "400", ...). Frames are built by hand (bench/h2client.frame and
never-indexed HPACK blocks) and read back with `read_frames`, so an abuse costs the
client little and never depends on the server being polite. `Scale` sets how hard each one
pushes: CI runs them small, `tokenwire bench abuse` large.
"""

import select
import selectors
import socket
import struct
import time
from typing import Callable, NamedTuple

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
from h2.errors import ErrorCodes

from .h2client import PREFACE, _stateless_block, frame

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
HELLO = PREFACE + frame(SETTINGS, 0, 0)
HOST = "127.0.0.1"


class Scale(NamedTuple):
    """How hard each abuse pushes."""
    num_flood_frames: int           # SETTINGS / PING / WINDOW_UPDATE / empty frames sent without reading
    num_rapid_resets: int           # HEADERS + DATA + RST_STREAM streams on one connection
    num_slowloris: int              # connections trickling the preface
    slowloris_s: float              # how long they trickle at most
    zero_window_streams: int        # streams x tokens whose window never opens
    zero_window_tokens: int
    prompt_bytes: int               # the oversized prompt
    wait_s: float                   # how long to wait for an answer that is a deadline


CI = Scale(20_000, 5_000, 50, 6.0, 20, 400, 3_500_000, 6.0)
FULL = Scale(1_000_000, 100_000, 500, 30.0, 100, 2000, 3_500_000, 40.0)


class Answer(NamedTuple):
    text: str       # for the table
    code: str       # for tests


class Frame(NamedTuple):
    type: int
    flags: int
    stream_id: int
    payload: bytes


def connect(port: int, hello: bytes = HELLO, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if hello:
        sock.sendall(hello)
    return sock


def read_frames(sock: socket.socket, timeout_s: float, until=None) -> tuple[list, bool]:
    """Frames until EOF, `until(frames)` or `timeout_s`; -> (frames, closed by the peer)."""
    buf, out, deadline = b"", [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = sock.recv(1 << 20)
        except socket.timeout:
            break
        except OSError:
            return out, True
        if not chunk:
            return out, True
        buf += chunk
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            n = int.from_bytes(buf[:3], "big")
            out.append(Frame(buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + n]))
            buf = buf[9 + n:]
        if until is not None and until(out):
            break
    return out, False


def goaway_of(frames: list) -> str | None:
    for f in frames:
        if f.type == GOAWAY:
            return ErrorCodes(struct.unpack(">I", f.payload[4:8])[0]).name
    return None


def goaway_last_stream(frames: list) -> int | None:
    for f in frames:
        if f.type == GOAWAY:
            return struct.unpack(">I", f.payload[:4])[0] & 0x7FFFFFFF
    return None


def send_flood(sock: socket.socket, one: bytes, n: int, batch: int = 1000) -> int:
    """Send `one` n times without reading; -> how many went out before the server hung up."""
    sent = 0
    try:
        while sent < n:
            k = min(batch, n - sent)
            sock.sendall(one * k)
            sent += k
    except OSError:
        pass
    return sent


def request_block(path: str, method: str = "POST", extra=()) -> bytes:
    return _stateless_block([(":method", method), (":scheme", "http"), (":authority", f"{HOST}"),
                             (":path", path), ("content-type", "application/json"), *extra])


def completion(sid: int, max_tokens: int, prompt: str = "hi") -> bytes:
    body = b'{"prompt": "%s", "max_tokens": %d, "stream": true, "ignore_eos": true}' % (prompt.encode(), max_tokens)
    return frame(HEADERS, 4, sid, request_block("/v1/completions")) + frame(DATA, 1, sid, body)


def wordy_chat(sid: int, max_tokens: int) -> bytes:
    """A streamed chat request whose every token carries usage too: ~330 bytes of SSE a token
    (a completion's: ~180)."""
    body = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %d, "stream": true, '
            b'"ignore_eos": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}}'
            % max_tokens)
    return frame(HEADERS, 4, sid, request_block("/v1/chat/completions")) + frame(DATA, 1, sid, body)


# ------------------------------------------------------------------ floods

def flood(port: int, one: bytes, n: int, setup: bytes = b"") -> Answer:
    sock = connect(port, HELLO + setup)
    t0 = time.monotonic()
    sent = send_flood(sock, one, n)
    frames, closed = read_frames(sock, 5.0, until=goaway_of)
    sock.close()
    code = goaway_of(frames)
    took_ms = (time.monotonic() - t0) * 1e3
    if code is None:
        return Answer(f"no GOAWAY after {sent} frames ({'closed' if closed else 'open'})", "none")
    return Answer(f"GOAWAY {code} after {sent} sent, {took_ms:.0f} ms", f"goaway:{code}")


def settings_flood(port: int, scale: Scale) -> Answer:
    return flood(port, frame(SETTINGS, 0, 0), scale.num_flood_frames)


def ping_flood(port: int, scale: Scale) -> Answer:
    return flood(port, frame(PING, 0, 0, bytes(8)), scale.num_flood_frames)


def window_update_flood(port: int, scale: Scale) -> Answer:
    return flood(port, frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)), scale.num_flood_frames)


def empty_frame_flood(port: int, scale: Scale) -> Answer:
    """Empty DATA frames without END_STREAM on an open request (CVE-2019-9518)."""
    return flood(port, frame(DATA, 0, 1, b""), scale.num_flood_frames,
                 setup=frame(HEADERS, 4, 1, request_block("/v1/completions")))


def rapid_reset(port: int, scale: Scale) -> Answer:
    """HEADERS + DATA + RST_STREAM per stream, as fast as the socket takes them (CVE-2023-44487)."""
    sock = connect(port)
    t0 = time.monotonic()
    sent, sid, batch = 0, 1, []
    try:
        while sent < scale.num_rapid_resets:
            batch.append(completion(sid, 64) + frame(RST_STREAM, 0, sid, struct.pack(">I", ErrorCodes.CANCEL)))
            sid += 2
            sent += 1
            if len(batch) == 200:
                sock.sendall(b"".join(batch))
                batch.clear()
        sock.sendall(b"".join(batch))
    except OSError:
        pass
    frames, _ = read_frames(sock, 5.0, until=goaway_of)
    sock.close()
    code = goaway_of(frames)
    rate = sent / max(time.monotonic() - t0, 1e-9)
    if code is None:
        return Answer(f"{sent} streams reset at {rate:.0f}/s, no GOAWAY", "none")
    last = goaway_last_stream(frames)
    return Answer(f"GOAWAY {code} at stream {(last + 1) // 2} of {sent} written", f"goaway:{code}")


# ------------------------------------------------------------------ bodies

def body_over_limit(port: int, limit: int, declared: bool) -> Answer:
    """An HTTP/2 body past the limit, with or without content-length, sent with exact flow control."""
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    extra = [("content-length", str(limit + 1))] if declared else []
    conn.send_headers(1, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                          (":authority", HOST), ("content-type", "application/json"), *extra])
    sock.sendall(conn.data_to_send())
    t0 = time.monotonic()
    body_left, status, reset, chunk = limit + 1 + (0 if declared else 1 << 20), None, None, bytes(16384)
    while time.monotonic() - t0 < 10 and (status is None or reset is None):
        n = min(body_left, conn.local_flow_control_window(1), 16384) if reset is None else 0
        if n > 0:
            conn.send_data(1, chunk[:n])
            body_left -= n
        out = conn.data_to_send()
        if out:
            sock.sendall(out)           # blocking: a partial non-blocking send would garble the frames
        readable, _, _ = select.select([sock], [], [], 0 if n > 0 else 0.01)
        if not readable:
            continue
        data = sock.recv(1 << 16)
        if not data:
            break
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived) and status is None:
                status, ms = dict(ev.headers)[b":status"].decode(), (time.monotonic() - t0) * 1e3
            elif isinstance(ev, h2.events.StreamReset):
                reset = ErrorCodes(ev.error_code).name
    sock.close()
    if status is None:
        return Answer(f"no answer in {time.monotonic() - t0:.1f} s", "none")
    return Answer(f"{status} in {ms:.1f} ms, then RST_STREAM {reset}", f"{status}+rst:{reset}")


def big_prompt(port: int, scale: Scale) -> Answer:
    """A prompt of megabytes, far under the body limit, far over the context."""
    body = b'{"prompt": "' + b"tok " * (scale.prompt_bytes // 4) + b'", "max_tokens": 1}'
    sock = connect(port, HELLO + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30)))
    t0 = time.monotonic()
    sock.sendall(frame(HEADERS, 4, 1, request_block("/v1/completions")))
    for i in range(0, len(body), 16384):
        sock.sendall(frame(DATA, 1 if i + 16384 >= len(body) else 0, 1, body[i:i + 16384]))
    frames, _ = read_frames(sock, 30.0, until=lambda fs: any(f.type == DATA and f.flags & 1 for f in fs))
    ms = (time.monotonic() - t0) * 1e3
    sock.close()
    status = _status(frames)
    return Answer(f"{status} in {ms:.0f} ms ({len(body) / 1e6:.1f} MB)", str(status))


def _status(frames: list) -> int | None:
    decoder = hpack.Decoder()
    for f in frames:
        if f.type == HEADERS:
            return int(dict(decoder.decode(f.payload, raw=True))[b":status"])
    return None


# ---------------------------------------------------------------- deadlines

def slowloris(port: int, scale: Scale) -> Answer:
    """Many connections sending the preface one byte at a time, once a second."""
    sel = selectors.DefaultSelector()
    socks = [connect(port, b"") for _ in range(scale.num_slowloris)]
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    t0, pos, closed_at = time.monotonic(), 0, {}
    while len(closed_at) < len(socks) and time.monotonic() - t0 < scale.slowloris_s:
        for s in socks:
            if s not in closed_at and pos < len(PREFACE):
                try:
                    s.send(PREFACE[pos:pos + 1])
                except OSError:
                    closed_at[s] = time.monotonic() - t0
        pos += 1
        tick = time.monotonic() + 1.0
        while time.monotonic() < tick:
            for key, _ in sel.select(max(0.0, tick - time.monotonic())):
                try:
                    gone = not key.fileobj.recv(4096)
                except OSError:
                    gone = True
                if gone and key.fileobj not in closed_at:
                    closed_at[key.fileobj] = time.monotonic() - t0
                    sel.unregister(key.fileobj)
    for s in socks:
        s.close()
    if len(closed_at) < len(socks):
        return Answer(f"{len(socks) - len(closed_at)} of {len(socks)} still open after {scale.slowloris_s:g} s",
                      "open")
    return Answer(f"all {len(socks)} closed by {max(closed_at.values()):.1f} s", "closed")


def zero_window(port: int, scale: Scale) -> Answer:
    """Streams whose window never opens: the client reads the socket, never sends WINDOW_UPDATE."""
    hello = PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 0))       # INITIAL_WINDOW_SIZE 0
    sock = connect(port, hello)
    sids = list(range(1, 2 * scale.zero_window_streams, 2))
    sock.sendall(b"".join(completion(sid, scale.zero_window_tokens) for sid in sids))
    t0 = time.monotonic()

    def settled(frames):
        return goaway_of(frames) or {f.stream_id for f in frames if f.type == RST_STREAM} >= set(sids)
    frames, closed = read_frames(sock, scale.wait_s, until=settled)
    sock.close()
    took = time.monotonic() - t0
    code = goaway_of(frames)
    if code is not None:
        return Answer(f"GOAWAY {code} after {took:.1f} s", f"goaway:{code}")
    codes = {ErrorCodes(struct.unpack(">I", f.payload)[0]).name for f in frames if f.type == RST_STREAM}
    num = len({f.stream_id for f in frames if f.type == RST_STREAM})
    if not num:
        return Answer(f"nothing in {took:.1f} s", "none")
    return Answer(f"{num}/{len(sids)} streams RST_STREAM {'/'.join(sorted(codes))} by {took:.1f} s",
                  f"rst:{'/'.join(sorted(codes))}" if num == len(sids) else "some")


def never_reads(port: int, scale: Scale) -> Answer:
    """Wide-open windows, many tokens, and the client never reads a byte: the server's socket fills."""
    hello = (PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31 - 1))
             + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535)))
    sock = connect(port, hello, rcvbuf=4096)
    sids = list(range(1, 2 * scale.zero_window_streams, 2))
    sock.sendall(b"".join(completion(sid, scale.zero_window_tokens * 10) for sid in sids))
    t0 = time.monotonic()
    deadline = t0 + scale.wait_s
    alive = True
    sock.settimeout(1.0)
    while alive and time.monotonic() < deadline:       # probe without reading: a reset shows as an error
        time.sleep(0.1)
        try:
            sock.send(frame(PING, 0, 0, bytes(8)))
        except socket.timeout:
            pass                                        # our send buffer is full too: still connected
        except OSError:
            alive = False
    sock.close()
    took = time.monotonic() - t0
    if alive:
        return Answer(f"still open after {took:.1f} s", "open")
    return Answer(f"connection dropped after {took:.1f} s", "closed")


# ------------------------------------------------------------- responses

def head_request(port: int, http2: bool) -> Answer:
    """HEAD /metrics (AIPerf sends it), then GET /health on the same connection."""
    if http2:
        sock = connect(port)
        sock.sendall(frame(HEADERS, 5, 1, request_block("/metrics", "HEAD"))
                     + frame(HEADERS, 5, 3, request_block("/health", "GET")))
        frames, _ = read_frames(sock, 5.0, until=lambda fs: sum(f.flags & 1 and f.type in (DATA, HEADERS)
                                                               for f in fs) >= 2)
        sock.close()
        head_data = sum(len(f.payload) for f in frames if f.type == DATA and f.stream_id == 1)
        ok = not any(f.type in (RST_STREAM, GOAWAY) for f in frames) and head_data == 0
        statuses = _statuses(frames)
        return Answer(f"HEAD {statuses.get(1)} (no body), then GET {statuses.get(3)}",
                      f"{statuses.get(1)},{statuses.get(3)}" if ok else "broken")
    sock = connect(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    raw = b""
    while raw.count(b"HTTP/1.1 ") < 2 or not raw.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        raw += chunk
    sock.close()
    heads = [r.split(b" ", 2)[1].decode() for r in raw.split(b"\r\n") if r.startswith(b"HTTP/1.1 ")]
    return Answer(f"HEAD {heads[0] if heads else None} (no body), then GET {heads[1] if len(heads) > 1 else None}",
                  ",".join(heads))


def _statuses(frames: list) -> dict:
    decoder, out = hpack.Decoder(), {}
    for f in frames:
        if f.type == HEADERS:
            fields = dict(decoder.decode(f.payload, raw=True))
            if b":status" in fields:
                out[f.stream_id] = int(fields[b":status"])
    return out


def invalid_preface(port: int) -> Answer:
    sock = connect(port, b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + frame(SETTINGS, 0, 0))
    frames, closed = read_frames(sock, 5.0, until=goaway_of)
    sock.close()
    code = goaway_of(frames)
    return Answer(f"GOAWAY {code}" if code else "no GOAWAY", f"goaway:{code}")


# ------------------------------------------------------- server-wide budgets

def never_reading_connections(port: int, num_conns: int, num_streams: int, num_tokens: int,
                              in_flight: Callable[[], float], hold_s: float) -> Answer:
    """`num_conns` connections with wide-open windows that never read, opening chat streams of
    `num_tokens` tokens (`wordy_chat`) round robin so that `num_streams` are in flight in all:
    each tick tops up to that count, read from the server (`in_flight`, its running requests),
    since a client that never reads cannot see its streams end. Pacing by an assumed step time
    instead let the streams pile up to --max-num-seqs when steps ran slower on a loaded machine,
    and the legitimate client then waited seconds in the engine's queue, which measured the
    scheduler, not the network. The server's output for them piles up until it ends them (a
    connection's --max-unsent-bytes, --max-total-unsent-bytes, or the write timeout). Returns
    once every one was ended, or after `hold_s` (then they are closed here)."""
    hello = (PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31 - 1))
             + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535)))
    socks = [connect(port, hello, rcvbuf=4096) for _ in range(num_conns)]
    next_sid = dict.fromkeys(socks, 1)
    t0, turn = time.monotonic(), 0
    ended = {}
    while len(ended) < num_conns and time.monotonic() - t0 < hold_s:
        alive = [sock for sock in socks if sock not in ended]
        due = num_streams - int(in_flight())
        while due >= 1 and alive:           # the next streams, round robin over the live connections
            sock = alive[turn % len(alive)]
            turn, due = turn + 1, due - 1
            if _send(sock, wordy_chat(next_sid[sock], num_tokens)):
                next_sid[sock] += 2
        for sock in alive:                  # probe without reading: an ended connection was reset (aborted)
            if sock not in ended and not _send(sock, frame(PING, 0, 0, bytes(8))):
                ended[sock] = time.monotonic() - t0
        time.sleep(0.1)
    for sock in socks:
        sock.close()
    if len(ended) < num_conns:
        return Answer(f"{len(ended)}/{num_conns} ended by the server in {hold_s:g} s", "open")
    return Answer(f"all {num_conns} ended by {max(ended.values()):.1f} s", "closed")


def _send(sock: socket.socket, data: bytes) -> bool:
    """-> False once the connection was reset (the server aborted it)."""
    try:
        sock.settimeout(0.2)
        sock.sendall(data)
    except socket.timeout:
        pass                        # our send buffer is full too: still connected
    except OSError:
        return False
    return True


def _open_quietly(sock: socket.socket) -> bool:
    """Not closed by the server, found without sending it anything (a probe to 2,000 connections
    at once would be an attack of its own)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def idle_connections(port: int, num_conns: int, hold_s: float) -> Answer:
    """`num_conns` HTTP/2 connections that each make one request (GET /health) and then stay
    idle for `hold_s`, then close."""
    hello = HELLO + frame(HEADERS, 5, 1, request_block("/health", "GET"))
    socks = [connect(port, hello) for _ in range(num_conns)]
    time.sleep(hold_s)
    num_open = sum(_open_quietly(sock) for sock in socks)
    for sock in socks:
        sock.close()
    return Answer(f"{num_open}/{num_conns} still open after {hold_s:g} s", "open" if num_open == num_conns else "some")
