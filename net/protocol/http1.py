"""Sans-IO HTTP/1.1 server session on h11, with the same surface as `http2.H2Session`.

For clients that do not speak HTTP/2 (the OpenAI Python SDK's default client is one).
Requests are served one at a time, in order: h11 holds pipelined bytes until the current
response is complete, and `poll_events()` picks them up then. A streamed response uses
chunked transfer encoding; trailers ride on the last chunk, only for a client that said
`TE: trailers` (RFC 9110 6.5.1), and are announced with `Trailer:` in the response head.
A response to HEAD carries the headers only (h11 refuses body bytes for it).

Rules: h11 owns the state machine; a transition it refuses is a `LocalProtocolError` (our
bug) or `RemoteProtocolError` (the client's: answered with 400 and a closed connection).
`Upgrade: h2c` with an `HTTP2-Settings` header is reported as `UpgradeRequested`; the
shell then calls `accept_h2c_upgrade()` and switches to an `H2Session`.
Nothing here awaits or touches a socket.
"""

import time
from functools import partial
from http import HTTPStatus

import h11
import orjson

from .events import BodyTooLarge, ConnectionClosed, Limits, Request, UpgradeRequested
from .frames import payload

TRAILER_NAMES = b"server-timing, tokenwire-cached-tokens"     # the trailers dispatch.py sends, for `Trailer:`


class H1Session:
    """The server side of one HTTP/1.1 connection."""

    def __init__(self, limits: Limits):
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_list_size)
        self.limits = limits
        self._out: list[bytes] = []
        self._stream_id = 0             # one per request, counting from 1
        self._request = None            # h11.Request being read
        self._arrived_ns = 0
        self._received_ns = 0
        self._body = bytearray()
        self._too_large = False
        self._active = False            # a request was handed out and its response is not complete
        self._chunked = False           # the current response uses chunked encoding (trailers allowed)
        self._draining = False
        self._head = False              # the current request is HEAD: no body goes out
        self._trailers_ok = False       # the current request said `TE: trailers`
        self.closed = False
        self.wants_poll = False         # a response completed: pipelined bytes may hold the next request
        self.num_pending_bytes = 0      # the H2Session counters the shell reads: nothing is ever queued here
        self.num_control_frames = 0

    @property
    def num_body_bytes(self) -> int:
        """Body bytes held for the request being read (the server-wide budget counts them)."""
        return len(self._body)

    # ----------------------------------------------------------------- input

    def receive_data(self, data: bytes) -> list:
        """Feed bytes from the peer (b"" means EOF); returns complete requests etc."""
        if self.closed:
            return []
        self._received_ns = time.monotonic_ns()   # a request's arrival: when its last header bytes came in
        self.conn.receive_data(data)
        return self.poll_events()

    def poll_events(self) -> list:
        """Parse what is buffered; called again after each response completes (pipelining)."""
        self.wants_poll = False
        events = []
        while not self.closed and not self._active:
            try:
                ev = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error(exc, events)
                break
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                break
            handler = _HANDLERS.get(type(ev))
            if handler is not None:
                handler(self, ev, events)
        return events

    def _on_request(self, ev, events):
        # HTTP/2's accounting (name + value + 32 per field), so one limit means the same on both;
        # h11's own limit only catches header blocks that arrive in pieces
        size = sum(len(name) + len(value) + 32 for name, value in ev.headers)
        if size > self.limits.max_header_list_size:
            self._reject(431, f"request headers are {size} bytes, over the limit of "
                              f"{self.limits.max_header_list_size}", events)
            return
        self._stream_id += 1
        self._request = ev
        self._head = ev.method == b"HEAD"
        self._trailers_ok = _accepts_trailers(ev.headers)
        self._arrived_ns = self._received_ns
        self._body = bytearray()
        self._too_large = False
        length = _content_length(ev.headers)
        if length is not None and length > self.limits.max_body_bytes:
            self._reject_too_large(events)
        elif self.conn.they_are_waiting_for_100_continue:
            self._send(h11.InformationalResponse(status_code=100, headers=[]))

    def _on_data(self, ev, events):
        if self._too_large:
            return
        if len(self._body) + len(ev.data) > self.limits.max_body_bytes:
            self._reject_too_large(events)
            return
        self._body += ev.data

    def _on_end(self, ev, events):
        if self._too_large:
            return
        req = self._request
        method, target, headers = _split_headers(req)
        request = Request(self._stream_id, method, target, headers, bytes(self._body), self._arrived_ns)
        self._body = bytearray()
        self._active = True
        if self.conn.their_state is h11.MIGHT_SWITCH_PROTOCOL and _wants_h2c(headers):
            events.append(UpgradeRequested(request, headers["http2-settings"].encode("latin-1")))
        else:
            events.append(request)

    def _on_closed(self, ev, events):
        self.closed = True
        events.append(ConnectionClosed("peer closed the connection"))

    def _reject_too_large(self, events):
        """The body is over the limit: answer now (413 from the routes) and close afterwards."""
        self._too_large = True
        self._body = bytearray()
        self._active = True
        method, target, headers = _split_headers(self._request)
        events.append(BodyTooLarge(self._stream_id, method, target, headers, self._arrived_ns))

    def _protocol_error(self, exc, events):
        self._reject(exc.error_status_hint or 400, f"malformed HTTP/1.1 request: {exc}", events)

    def _reject(self, status: int, message: str, events) -> None:
        """Answer an unusable request here (the app never sees it) and close the connection."""
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}})
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._send(h11.Response(status_code=status, headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]))
            self._send(h11.Data(data=body))
            self._send(h11.EndOfMessage())
        self.closed = True
        events.append(ConnectionClosed(f"HTTP/1.1 request refused: {message}", "protocol_error"))

    # ---------------------------------------------------------------- output

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        self._out = []
        return b"".join(out)

    def start_response(self, stream_id: int, status: int, headers, extra=()) -> None:
        """The response head. `extra`: fields that differ per response (x-request-id,
        content-length), after `headers` (HTTP/2's session caches `headers`' block; here
        they are simply joined)."""
        self._check(stream_id)
        headers = [*headers, *extra]
        if self._draining or self._too_large:
            headers.append((b"connection", b"close"))
        self._chunked = (self.conn.their_http_version == b"1.1" and not self._head
                         and not any(name == b"content-length" for name, _ in headers))
        if self._chunked and self._trailers_ok:
            headers = [*headers, (b"trailer", TRAILER_NAMES)]
        self._send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))

    def data_writer(self, stream_id: int):
        """`send_data` for one stream, as a one-argument function (per token)."""
        return partial(self.send_data, stream_id)

    def data_key(self, stream_id: int) -> int:
        """The stream's key for `send_batch`."""
        return stream_id

    def send_batch(self, items) -> None:
        """`send_data` for each (data_key, *pieces) in `items`, in order (frames.py: the
        payload is the pieces, a str as its JSON string)."""
        for item in items:
            self.send_data(item[0], payload(item))

    def send_data(self, stream_id: int, payload: bytes) -> None:
        """One chunk of the response body (hot path: once per token when streaming).

        Chunked framing is written here: h11's chunked writer keeps no state per chunk, so
        going through h11's event machinery for every token buys nothing. An empty chunk
        would end the body, so an empty payload writes nothing (as h11 does)."""
        self._check(stream_id)
        if self._chunked:
            if payload:
                self._out.append(b"%x\r\n" % len(payload))
                self._out.append(payload)
                self._out.append(b"\r\n")
        else:
            self._send(h11.Data(data=payload))

    def end_response(self, stream_id: int, trailers: list | None = None) -> None:
        if stream_id != self._stream_id or not self._active:
            return
        self._send(h11.EndOfMessage(headers=trailers if (trailers and self._chunked and self._trailers_ok) else []))
        self._active = False
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is not h11.DONE:
            self.closed = True      # the client asked to close, or its body was never read
        else:
            self.conn.start_next_cycle()
            self.wants_poll = True

    def respond(self, stream_id: int, status: int, headers: list, body: bytes,
                trailers: list | None = None, extra=()) -> None:
        self.start_response(stream_id, status, headers, (*extra, (b"content-length", b"%d" % len(body))))
        if body and not self._head:
            self.send_data(stream_id, body)
        self.end_response(stream_id, trailers)

    def end_connection(self, cause: str, message: str, calm: bool = True) -> list:
        """The shell ends the connection for one of its limits; -> the events to hand the app."""
        if self.closed:
            return []
        self.closed = True
        self._active = False
        return [ConnectionClosed(f"HTTP/1.1 connection ended: {message}", cause)]

    def expire_stalled(self, cutoff_ns: int) -> list:
        """Nothing queues per stream here (the transport holds HTTP/1.1 output)."""
        return []

    def fail_response(self, stream_id: int, status: int, headers: list, body: bytes, extra=()) -> bool:
        """As H2Session's: a response not started is answered `status`; one started is cut
        short by closing the connection (no last chunk: the client sees it incomplete);
        -> whether `status` was sent."""
        if stream_id != self._stream_id or not self._active:
            return False
        if self.conn.our_state is h11.SEND_RESPONSE:
            self.respond(stream_id, status, headers, body, extra=extra)
            return True
        self.reset_stream(stream_id)
        return False

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None:
        """HTTP/1.1 has no stream reset: the only way to abandon a response is to close."""
        if stream_id == self._stream_id and self._active:
            self._active = False
            self.closed = True

    def accept_h2c_upgrade(self) -> bytes:
        """Answer `101 Switching Protocols`; returns the bytes after the request (the HTTP/2 preface)."""
        self._send(h11.InformationalResponse(status_code=101, headers=[
            (b"connection", b"Upgrade"), (b"upgrade", b"h2c")]))
        self._active = False
        data, _ = self.conn.trailing_data
        return bytes(data)

    def begin_shutdown(self) -> None:
        """Finish the response in flight with `Connection: close`; serve nothing after it."""
        self._draining = True
        if not self._active:
            self.closed = True

    @property
    def num_active_streams(self) -> int:
        return 1 if self._active else 0

    @property
    def wants_close(self) -> bool:
        return self.closed or (self._draining and not self._active)

    def _send(self, event) -> None:
        data = self.conn.send(event)
        if data:
            self._out.append(data)

    def _check(self, stream_id: int) -> None:
        if stream_id != self._stream_id or not self._active:
            raise h11.LocalProtocolError(f"no active HTTP/1.1 request {stream_id} on this connection")


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _accepts_trailers(headers) -> bool:
    """`TE: trailers` (a list of transfer codings; `trailers` is one token of it)."""
    for name, value in headers:
        if name == b"te" and b"trailers" in {t.split(b";", 1)[0].strip().lower() for t in value.split(b",")}:
            return True
    return False


def _content_length(headers) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # h11 has validated it
    return None


def _split_headers(req) -> tuple[str, str, dict]:
    headers = {}
    for name, value in req.headers:
        key = name.decode("latin-1")
        val = value.decode("latin-1")
        headers[key] = headers[key] + ", " + val if key in headers else val
    return req.method.decode("latin-1"), req.target.decode("latin-1"), headers


def _wants_h2c(headers: dict) -> bool:
    upgrade = {t.strip().lower() for t in headers.get("upgrade", "").split(",")}
    return "h2c" in upgrade and "http2-settings" in headers


_HANDLERS = {
    h11.Request: H1Session._on_request,
    h11.Data: H1Session._on_data,
    h11.EndOfMessage: H1Session._on_end,
    h11.ConnectionClosed: H1Session._on_closed,
}
