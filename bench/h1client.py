"""A lean HTTP/1.1 streaming client: one request at a time per keep-alive connection.

The HTTP/1.1 peer (uvicorn) streams each token as one chunk of a chunked response; this
client parses that by hand, the same way the HTTP/2 client parses frames, so the client
side costs the same few bytes-level calls per message on both protocols. The request is
built once; responses are a status line, headers, then a chunked or Content-Length body.
"""

import asyncio
from typing import Callable, Optional

from .wire import StreamRecord, counter_for, failed, now_ns

HEAD, CHUNK_SIZE, CHUNK_DATA, CHUNK_END, TRAILERS, FIXED_BODY, IDLE = range(7)
MAX_HEAD = 64 * 1024


def build_request(host: str, path: str, body: bytes, content_type: str = "application/json",
                  headers: tuple = ()) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class H1ClientConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; `start` sends the next request when idle."""

    def __init__(self, framing: str):
        self._count = counter_for(framing)
        self._state = IDLE
        self._buf = b""
        self._left = 0                  # bytes left in the current chunk or fixed-length body
        self._keep_alive = True
        self._rec: Optional[StreamRecord] = None
        self.transport = None
        self.closed_reason = None

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed_reason = f"connection lost: {exc}" if exc else "connection closed by the server"
        if self._rec is not None:
            rec, self._rec = self._rec, None
            failed(rec, self.closed_reason)

    @property
    def reusable(self) -> bool:
        """The server keeps the connection open for another request."""
        return self.closed_reason is None and self._keep_alive

    def start(self, request: bytes, done: Callable[[StreamRecord], None]) -> StreamRecord:
        """Send one request (hot path: per request); the connection must be idle."""
        rec = StreamRecord(0)
        rec.done = done
        if self.closed_reason is not None or not self._keep_alive:
            return failed(rec, self.closed_reason or "server closed the keep-alive connection")
        if self._state != IDLE:
            return failed(rec, "HTTP/1.1 connection is busy with another request")
        self._rec, self._state, self._buf = rec, HEAD, b""
        rec.start_ns = now_ns()
        self.transport.write(request)
        return rec

    async def request(self, request: bytes) -> StreamRecord:
        future = asyncio.get_running_loop().create_future()
        self.start(request, future.set_result)
        return await future

    def close(self):
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes):
        """Walk the response (hot path: per read; chunk payloads counted in place)."""
        now = now_ns()
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        rec = self._rec
        while pos < end and rec is not None:
            state = self._state
            if state == CHUNK_DATA or state == FIXED_BODY:
                stop = min(end, pos + self._left)
                self._left -= stop - pos
                rec.num_bytes += stop - pos
                k = self._count(rec, buf, pos, stop)
                if k == 1:
                    rec.token_ns.append(now)
                elif k:
                    rec.token_ns.extend([now] * k)
                pos = stop
                if self._left == 0:
                    if state == FIXED_BODY:
                        rec = self._finish()
                    else:
                        self._state = CHUNK_END
                continue
            line_end = buf.find(b"\r\n\r\n" if state == HEAD else b"\r\n", pos)
            if line_end < 0:
                if end - pos > MAX_HEAD:
                    rec = self._fail("response head or chunk line too long")
                break
            if state == HEAD:
                self._on_head(buf[pos:line_end])
                pos = line_end + 4
            elif state == CHUNK_SIZE:
                self._on_chunk_size(buf[pos:line_end])
                pos = line_end + 2
            elif state == CHUNK_END:
                if line_end != pos:
                    rec = self._fail("chunk data not followed by CRLF")
                    break
                self._state = CHUNK_SIZE
                pos += 2
            else:  # TRAILERS: trailer lines, then the empty line that ends the message
                empty = line_end == pos
                pos = line_end + 2
                if empty:
                    self._finish()
            rec = self._rec
        self._buf = buf[pos:] if pos < end else b""

    def _on_head(self, head: bytes):
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            self._fail(f"bad status line {lines[0][:80]!r}")
            return
        rec = self._rec
        rec.status = int(parts[1])
        chunked, length = False, None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                self._keep_alive = value != b"close"
        if rec.status != 200:
            rec.error = f"HTTP status {rec.status}"
        if chunked:
            self._state = CHUNK_SIZE
        elif length is not None:
            self._state, self._left = FIXED_BODY, length
            if length == 0:
                self._finish()
        else:
            self._fail("response has neither chunked encoding nor Content-Length")

    def _on_chunk_size(self, line: bytes):
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            self._fail(f"bad chunk size line {line[:40]!r}")
            return
        if size == 0:
            self._state = TRAILERS
        else:
            self._state, self._left = CHUNK_DATA, size

    def _finish(self) -> None:
        rec, self._rec = self._rec, None
        self._state = IDLE
        done, rec.done = rec.done, None
        done(rec)
        return None

    def _fail(self, why: str) -> None:
        rec, self._rec = self._rec, None
        self._keep_alive = False
        self.transport.close()
        failed(rec, why)
        return None


async def open_connection(host: str, port: int, framing: str, timeout_s: float = 10.0) -> H1ClientConnection:
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(loop.create_connection(lambda: H1ClientConnection(framing), host, port),
                                     timeout_s)
    return conn
