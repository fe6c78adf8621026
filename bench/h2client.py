"""A lean HTTP/2 client for load generation: hand-parsed frames, one HPACK encode per template.

The h2 library spends ~10 µs of Python per frame, which would cap a client at ~100k
frames/s and make the load generator the bottleneck. This client does the least HTTP/2
that stays correct:

- Prior knowledge (h2c): preface + SETTINGS (push off, a 2^31-1 stream window) + a
  connection WINDOW_UPDATE to 2^31-1; received bytes are handed back with WINDOW_UPDATEs
  (connection and stream) once 2^30 of a window is used, so flow control never stalls.
- Requests come from a `RequestTemplate`: its header block is HPACK-encoded once with
  never-indexed literals, so it touches no dynamic table and the same bytes serve every
  stream; only the 4-byte stream id changes per request.
- Incoming frames are parsed by hand from their 9-byte headers. DATA payloads go to the
  stream's message counter in place; header blocks (response headers, trailers) are
  decoded with hpack, in order, since HPACK decoding is stateful.
- SETTINGS and PING are ACKed; the peer's MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE and
  our send window are honoured: a request that does not fit waits in a queue (counted).
- RST_STREAM, GOAWAY and a lost connection fail the affected streams with a reason.
"""

import asyncio
import collections
import struct
from typing import Callable, Sequence

import hpack

from .wire import StreamRecord, counter_for, failed, now_ns

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_ENABLE_PUSH = 0x2
MAX_WINDOW = 2**31 - 1
REFILL_AT = 2**30                 # bytes of a receive window used before we hand them back
DEFAULT_WINDOW = 65535
MAX_FRAME = 16384                 # every peer accepts frames this large (RFC 9113 §4.2)
STREAM_ID_MASK = 0x7FFFFFFF

_frame_head = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _frame_head.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


class RequestTemplate:
    """One request's frames, encoded once; `frames(stream_id)` fills in the stream id."""

    def __init__(self, authority: str, path: str, body: bytes, headers: Sequence[tuple] = (),
                 scheme: str = "http", content_length: bool = True):
        fields = [(":method", "POST"), (":scheme", scheme), (":authority", authority), (":path", path)]
        fields += list(headers)
        if content_length:
            fields.append(("content-length", str(len(body))))
        block = _stateless_block(fields)
        if len(block) > MAX_FRAME:
            raise ValueError(f"request headers encode to {len(block)} bytes, more than one frame")
        chunks = [body[i:i + MAX_FRAME] for i in range(0, len(body), MAX_FRAME)] or [b""]
        # parts joined by the 4-byte stream id: HEADERS head | block + DATA head | chunk + DATA head | ...
        parts = [_frame_head.pack(len(block) << 8 | HEADERS, FLAG_END_HEADERS, 0)[:5], block]
        for i, chunk in enumerate(chunks):
            flags = FLAG_END_STREAM if i == len(chunks) - 1 else 0
            parts[-1] += _frame_head.pack(len(chunk) << 8 | DATA, flags, 0)[:5]
            parts.append(chunk)
        self._parts = parts
        self.body_len = len(body)   # flow-controlled bytes one request sends

    def frames(self, stream_id: int) -> bytes:
        """The request's HEADERS and DATA frames for one stream (hot path: per request)."""
        return stream_id.to_bytes(4, "big").join(self._parts)


def _stateless_block(fields: Sequence[tuple]) -> bytes:
    """HPACK with never-indexed literals: the block is valid on any stream of any connection."""
    encoder = hpack.Encoder()
    block = encoder.encode([(n, v, True) for n, v in fields])
    again = encoder.encode([(n, v, True) for n, v in fields])
    assert block == again, "header block used the HPACK dynamic table"
    return block


class H2ClientConnection(asyncio.Protocol):
    """One HTTP/2 connection carrying many concurrent request streams."""

    def __init__(self, framing: str, grpc: bool = False):
        self._count = counter_for(framing)
        self._grpc = grpc
        self._streams = {}                 # stream id -> StreamRecord, open streams only
        self._next_stream_id = 1
        self._buf = b""                    # an incomplete frame carried to the next read
        self._header_block = None          # (stream id, flags, bytes) while CONTINUATIONs come
        self._decoder = hpack.Decoder()
        self._send_window = DEFAULT_WINDOW     # connection-level, for request bodies
        self._peer_stream_window = DEFAULT_WINDOW
        self._recv_used = 0                # connection receive window used since the last refill
        self._waiting = collections.deque()  # (stream record, template) that did not fit yet
        self.max_streams = None            # the peer's MAX_CONCURRENT_STREAMS (None: unlimited)
        self.num_queued = 0                # requests that had to wait for a window or a slot
        self.transport = None
        self.closed_reason = None
        self.ready = asyncio.get_running_loop().create_future()  # set by the peer's first SETTINGS

    # -- connection lifecycle -------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
        refill = struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW)
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, refill))

    def connection_lost(self, exc):
        self._close(f"connection lost: {exc}" if exc else "connection closed by the server")

    def _close(self, why: str):
        self.closed_reason = self.closed_reason or why
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(why))
        streams, self._streams = self._streams, {}
        for rec in streams.values():
            failed(rec, why)
        while self._waiting:
            failed(self._waiting.popleft()[0], why)

    @property
    def num_open(self) -> int:
        return len(self._streams) + len(self._waiting)

    def close(self):
        if self.transport is not None:
            self.transport.write(frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
            self.transport.close()

    # -- requests ------------------------------------------------------------------------
    def start(self, template: RequestTemplate, done: Callable[[StreamRecord], None]) -> StreamRecord:
        """Open one stream; `done(record)` runs when it ends (hot path: per request)."""
        rec = StreamRecord(0)
        rec.done = done
        if self.closed_reason is not None:
            return failed(rec, self.closed_reason)
        if template.body_len > self._peer_stream_window:
            return failed(rec, f"request body of {template.body_len} bytes exceeds the server's "
                               f"stream window of {self._peer_stream_window}")
        if self._waiting or not self._fits(template):
            self.num_queued += 1
            self._waiting.append((rec, template))
            return rec
        self._send(rec, template)
        return rec

    async def request(self, template: RequestTemplate) -> StreamRecord:
        future = asyncio.get_running_loop().create_future()
        self.start(template, future.set_result)
        return await future

    def _fits(self, template: RequestTemplate) -> bool:
        slots_ok = self.max_streams is None or len(self._streams) < self.max_streams
        return slots_ok and template.body_len <= self._send_window

    def _send(self, rec: StreamRecord, template: RequestTemplate):
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        self._streams[stream_id] = rec
        self._send_window -= template.body_len
        rec.start_ns = now_ns()
        self.transport.write(template.frames(stream_id))

    def _flush_waiting(self):
        while self._waiting and self._fits(self._waiting[0][1]):
            self._send(*self._waiting.popleft())

    # -- receiving -----------------------------------------------------------------------
    def data_received(self, data: bytes):
        """Parse every complete frame (hot path: per read; DATA frames handled inline).

        A DATA frame's stream id is used unmasked: a set reserved bit finds no stream, and
        the frame is then only counted against the connection window.
        """
        now = now_ns()
        buf = self._buf + data if self._buf else data
        end_of_buf = len(buf)
        pos = 0
        streams = self._streams
        count = self._count
        recv_used = 0
        while end_of_buf - pos >= 9:
            head, flags, stream_id = _frame_head.unpack_from(buf, pos)
            end = pos + 9 + (head >> 8)
            if end > end_of_buf:
                break
            if head & 0xFF == DATA:
                recv_used += end - pos - 9
                start = pos + 9
                stop = end
                if flags & FLAG_PADDED:
                    stop -= buf[start]
                    start += 1
                rec = streams.get(stream_id)
                if rec is not None and stop > start:
                    num_bytes = rec.num_bytes = rec.num_bytes + stop - start
                    k = count(rec, buf, start, stop)
                    if k == 1:
                        rec.token_ns.append(now)
                    elif k:
                        rec.token_ns.extend([now] * k)
                    if num_bytes >= rec.refill_at:
                        self._refill_stream(stream_id, rec)
                if flags & FLAG_END_STREAM:
                    self._finish(stream_id)
            else:
                self._control(head & 0xFF, flags, stream_id & STREAM_ID_MASK, buf[pos + 9:end])
            pos = end
        self._buf = buf[pos:] if pos < end_of_buf else b""
        self._recv_used += recv_used
        if self._recv_used >= REFILL_AT:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_used)))
            self._recv_used = 0

    def _refill_stream(self, stream_id: int, rec: StreamRecord):
        used = rec.num_bytes - (rec.refill_at - REFILL_AT)
        self.transport.write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", used)))
        rec.refill_at = rec.num_bytes + REFILL_AT

    def _control(self, ftype: int, flags: int, stream_id: int, payload: bytes):
        if ftype == HEADERS:
            self._on_headers(stream_id, flags, payload)
        elif ftype == CONTINUATION:
            self._on_continuation(stream_id, flags, payload)
        elif ftype == SETTINGS:
            if not flags & FLAG_ACK:
                self._on_settings(payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif ftype == PING:
            if not flags & FLAG_ACK:
                self.transport.write(frame(PING, FLAG_ACK, 0, payload))
        elif ftype == RST_STREAM:
            rec = self._streams.pop(stream_id, None)
            if rec is not None:
                failed(rec, f"stream reset by the server (error code {int.from_bytes(payload[:4], 'big')})")
            self._flush_waiting()
        elif ftype == GOAWAY:
            self._on_goaway(payload)
        elif ftype == PUSH_PROMISE:
            self._protocol_error("server sent PUSH_PROMISE although push is disabled")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 requires

    def _on_settings(self, payload: bytes):
        for offset in range(0, len(payload) - len(payload) % 6, 6):
            ident, value = struct.unpack_from(">HI", payload, offset)
            if ident == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.max_streams = value
            elif ident == SETTINGS_INITIAL_WINDOW_SIZE:
                self._peer_stream_window = value
        self.transport.write(frame(SETTINGS, FLAG_ACK, 0))
        if not self.ready.done():
            self.ready.set_result(None)
        self._flush_waiting()

    def _on_window_update(self, stream_id: int, payload: bytes):
        if stream_id == 0:
            self._send_window += int.from_bytes(payload[:4], "big") & STREAM_ID_MASK
            self._flush_waiting()
        # stream-level updates: request bodies never exceed the initial stream window (checked in start)

    def _on_goaway(self, payload: bytes):
        last_stream_id = int.from_bytes(payload[:4], "big") & STREAM_ID_MASK
        code = int.from_bytes(payload[4:8], "big")
        why = f"server sent GOAWAY (error code {code})"
        self.closed_reason = self.closed_reason or why
        for stream_id in [s for s in self._streams if s > last_stream_id]:
            failed(self._streams.pop(stream_id), why)
        while self._waiting:
            failed(self._waiting.popleft()[0], why)

    def _protocol_error(self, why: str):
        self.transport.write(frame(GOAWAY, 0, 0, struct.pack(">II", 0, 1)))
        self.transport.close()
        self._close(why)

    # -- header blocks -------------------------------------------------------------------
    def _on_headers(self, stream_id: int, flags: int, payload: bytes):
        start, stop = 0, len(payload)
        if flags & FLAG_PADDED:
            stop -= payload[0]
            start = 1
        if flags & FLAG_PRIORITY:
            start += 5
        self._header_block = (stream_id, flags, payload[start:stop])
        if flags & FLAG_END_HEADERS:
            self._end_header_block()

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes):
        if self._header_block is None or self._header_block[0] != stream_id:
            return self._protocol_error("CONTINUATION without a header block in progress")
        sid, first_flags, block = self._header_block
        self._header_block = (sid, first_flags, block + payload)
        if flags & FLAG_END_HEADERS:
            self._end_header_block()

    def _end_header_block(self):
        stream_id, flags, block = self._header_block
        self._header_block = None
        try:
            fields = self._decoder.decode(block)
        except hpack.HPACKError as exc:
            return self._protocol_error(f"bad HPACK block from the server: {exc}")
        rec = self._streams.get(stream_id)
        if rec is not None:
            _apply_fields(rec, fields, self._grpc)
        if flags & FLAG_END_STREAM:
            self._finish(stream_id)

    def _finish(self, stream_id: int):
        rec = self._streams.pop(stream_id, None)
        if rec is None:
            return
        if rec.error is None and rec.status != 200:
            rec.error = f"HTTP status {rec.status}" if rec.status else "stream ended without a status"
        done, rec.done = rec.done, None
        done(rec)
        if self._waiting:
            self._flush_waiting()


def _apply_fields(rec: StreamRecord, fields, grpc: bool):
    """Response headers set the status; trailers (and gRPC trailers-only responses) the gRPC outcome."""
    for name, value in fields:
        if name == ":status":
            rec.status = int(value)
        elif grpc and name == "grpc-status" and value != "0":
            rec.error = f"grpc-status {value}"
        elif grpc and name == "grpc-message" and rec.error:
            rec.error += f": {value}"


async def open_connection(host: str, port: int, framing: str, grpc: bool = False,
                          timeout_s: float = 10.0) -> H2ClientConnection:
    """Connect, exchange SETTINGS, and return the ready connection."""
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(
        loop.create_connection(lambda: H2ClientConnection(framing, grpc), host, port), timeout_s)
    await asyncio.wait_for(conn.ready, timeout_s)
    return conn
