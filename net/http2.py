"""Sans-IO HTTP/2 server session: `receive_data(bytes) -> list[Event]`, `data_to_send() -> bytes`.

Rule 1: h2 owns the connection: SETTINGS, PING, frame parsing, GOAWAY on protocol errors,
        stream states, inbound flow control, RST_STREAM. Two things are ours on the way in:
        request header checks (request_headers.py: a malformed request is a stream error,
        as RFC 7540 8.1.2.6 says, where h2 makes it a connection error) and the concurrent
        stream limit (one stream too many is refused with REFUSED_STREAM instead of h2
        ending the connection); HPACK decoding stays h2's, through a memoizing decoder.
Rule 2: response frames (HEADERS, DATA, trailers) are built here, from 9-byte headers packed
        by a precompiled struct, because h2's per-frame work costs several microseconds and
        the hot path writes one frame per token per stream. Header blocks use context-free
        HPACK (hpack_plain.py), cached per session. Each frame drives h2's own connection and
        stream state machines with the input h2's send methods would use (SEND_HEADERS,
        SEND_END_STREAM), so h2 keeps knowing exactly which streams are open.
Rule 3: the send windows are h2's own fields (`H2Connection.outbound_flow_control_window`,
        `H2Stream.outbound_flow_control_window`). Each DATA frame built here debits both by
        exactly its length, so h2's view of the windows never drifts from the bytes on the
        wire, and a peer's WINDOW_UPDATEs can never push h2's view past 2**31 - 1.
Rule 4: whatever h2 produces is moved into the output list right after each h2 call, so
        frames leave in the order they were made (HEADERS before DATA before trailers).
Rule 5: every stream has its own send queue: a stream whose window is shut queues its
        bytes and never holds up the others; WINDOW_UPDATE and SETTINGS changes drain it.
Rule 6: nothing here awaits or touches a socket.

Graceful shutdown: streams the client opens after `begin_shutdown()` are refused at once
(RST_STREAM REFUSED_STREAM: not processed, safe to retry elsewhere); the in-flight ones run
to their end; then a PING, and GOAWAY once the PING's ACK shows the peer has read every
byte before it; then close. GOAWAY waits that long because curl up to 8.0 drops whatever it
received in the same read as a GOAWAY, silently truncating the streams. GOAWAY is written
here, not through h2: h2 moves its state machine to CLOSED on sending GOAWAY. A peer's
GOAWAY(NO_ERROR) lets the open streams finish (RFC 7540 6.8); h2 would refuse them, so its
state machine is put back to open.
"""

import base64
import struct
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.connection import ConnectionInputs
from h2.errors import ErrorCodes
from h2.stream import StreamInputs

from .events import BodyTooLarge, ConnectionClosed, Limits, Request, StreamReset
from .hpack_plain import encode_block
from .request_headers import MalformedRequest, MemoDecoder, split_headers

# frame header: 24-bit length (as 8 + 16 bits), type, flags, 31-bit stream id
FRAME_HEADER = struct.Struct(">BHBBI")
DATA_HEADER = FRAME_HEADER              # type 0x0 DATA
TYPE_HEADERS = 0x1
END_STREAM = 0x1
END_HEADERS = 0x4
GOAWAY = struct.Struct(">BHBBIII")      # header + last stream id + error code
DRAIN_PING = b"tw-drain"                # PING payload that asks "have you read everything?"
TYPE_GOAWAY = 0x7
MAX_WINDOW = 2**31 - 1


class _Stream:
    """One request/response exchange as the session sees it."""
    __slots__ = ("id", "h2", "method", "target", "headers", "body", "arrived_ns",
                 "too_large", "pending", "end_after")

    def __init__(self, stream_id, h2_stream, method, target, headers, arrived_ns):
        self.id = stream_id
        self.h2 = h2_stream             # h2's H2Stream: holds this stream's send window
        self.method = method
        self.target = target
        self.headers = headers
        self.body = bytearray()
        self.arrived_ns = arrived_ns
        self.too_large = False
        self.pending = bytearray()      # response bytes waiting for window
        self.end_after = None           # trailers list (maybe empty) once the response is ended


class H2Session:
    """The server side of one HTTP/2 connection (prior knowledge, TLS ALPN `h2`, or after h2c upgrade)."""

    def __init__(self, limits: Limits, upgrade_settings: bytes | None = None):
        # inbound header checks happen in request_headers.split_headers (see there)
        config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = _local_settings(limits, limits.max_concurrent_streams)
        self.conn.decoder = MemoDecoder()
        # enforced from the first request, not only once the client has acknowledged our SETTINGS;
        # over it, h2 ends the connection (GOAWAY) rather than answering 431 on the stream
        self.conn.decoder.max_header_list_size = limits.max_header_list_size
        self.limits = limits
        self.streams: dict[int, _Stream] = {}
        self._blocked: dict[int, _Stream] = {}      # streams with queued bytes, oldest first
        self._out: list[bytes] = []
        self._received_ns = 0
        self._blocks: dict = {}                      # (status, headers) -> encoded header block
        self.goaway_last_id: int | None = None       # set once a graceful shutdown began: the last stream served
        self.goaway_sent = False
        self._drain_pinged = False
        self.closed = False                          # peer went away or broke the protocol
        self.wants_poll = False                      # HTTP/1.1 pipelining flag; never set here
        self.peer_goaway = False                     # the peer sent GOAWAY(NO_ERROR): finish and close
        if upgrade_settings is None:
            self.conn.initiate_connection()
        else:
            padded = upgrade_settings + b"=" * (-len(upgrade_settings) % 4)
            base64.urlsafe_b64decode(padded)  # raises binascii.Error on garbage before h2 sees it
            self.conn.initiate_upgrade_connection(padded)
        self._drain_h2()
        # The SETTINGS just written advertise our stream limit; h2 itself gets no limit, because
        # it would end the whole connection over one stream too many. A client may open streams
        # before our SETTINGS reach it (RFC 7540 5.1.2: the limit starts unlimited), so the extra
        # ones are refused one by one (RST_STREAM REFUSED_STREAM, safe to retry) in _on_request.
        self.conn.local_settings = _local_settings(limits, 2**31 - 1)

    # ----------------------------------------------------------------- input

    def receive_data(self, data: bytes) -> list:
        """Feed bytes from the peer; returns complete requests and stream/connection events."""
        if self.closed:
            return []
        self._received_ns = time.monotonic_ns()   # a request's arrival: when its last header bytes came in
        try:
            h2_events = self.conn.receive_data(data)
        except (h2.exceptions.ProtocolError, ValueError) as exc:  # h2 has queued GOAWAY
            self._drain_h2()
            self.closed = True
            return [ConnectionClosed(f"HTTP/2 protocol error: {exc}")]
        self._drain_h2()            # ACKs and the like go before anything the handlers write
        events = []
        for ev in h2_events:
            handler = _HANDLERS.get(type(ev))
            if handler is not None:
                handler(self, ev, events)
        return events

    def poll_events(self) -> list:
        """HTTP/2 delivers every event from `receive_data`; present for symmetry with HTTP/1.1."""
        return []

    def upgraded_request(self, request: Request) -> Request:
        """Adopt the HTTP/1.1 request that carried `Upgrade: h2c` as stream 1."""
        self.streams[1] = _Stream(1, self.conn.streams[1], request.method, request.target,
                                  request.headers, request.arrived_ns)
        return request._replace(stream_id=1)

    def _on_request(self, ev, events):
        sid = ev.stream_id
        try:
            method, target, headers = split_headers(ev.headers)
        except MalformedRequest:         # RFC 7540 8.1.2.6: a stream error, not a connection error
            self.conn.reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
            self._drain_h2()
            return
        if ((self.goaway_last_id is not None and sid > self.goaway_last_id)
                or len(self.streams) >= self.limits.max_concurrent_streams):
            self.conn.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            self._drain_h2()
            return
        self.streams[sid] = _Stream(sid, self.conn.streams[sid], method, target, headers, self._received_ns)

    def _on_data(self, ev, events):
        self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        self._drain_h2()
        st = self.streams.get(ev.stream_id)
        if st is None or st.too_large:
            return
        if len(st.body) + len(ev.data) > self.limits.max_body_bytes:
            st.too_large = True
            st.body = bytearray()
            events.append(BodyTooLarge(st.id, st.method, st.target, st.headers, st.arrived_ns))
            return
        st.body += ev.data

    def _on_stream_ended(self, ev, events):
        st = self.streams.get(ev.stream_id)
        if st is not None and not st.too_large:
            events.append(Request(st.id, st.method, st.target, st.headers, bytes(st.body), st.arrived_ns))
            st.body = bytearray()

    def _on_stream_reset(self, ev, events):
        st = self.streams.pop(ev.stream_id, None)
        self._blocked.pop(ev.stream_id, None)
        if st is not None:
            events.append(StreamReset(ev.stream_id))
            self._maybe_goaway()

    def _on_window_updated(self, ev, events):
        if ev.stream_id == 0:
            self._drain_blocked()
        else:
            st = self._blocked.get(ev.stream_id)
            if st is not None:
                self._drain_stream(st)

    def _on_settings_changed(self, ev, events):
        codes = ev.changed_settings
        if (h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in codes
                or h2.settings.SettingCodes.MAX_FRAME_SIZE in codes):
            self._drain_blocked()

    def _on_terminated(self, ev, events):
        """Peer GOAWAY. NO_ERROR: no new streams, but open ones may finish (RFC 7540 6.8); h2 moved
        its state machine to CLOSED, which would refuse them, so it goes back to open here."""
        if ev.error_code == ErrorCodes.NO_ERROR and self.streams:
            self.conn.state_machine.state = h2.connection.ConnectionState.SERVER_OPEN
            self.peer_goaway = True
            return
        self.closed = True
        events.append(ConnectionClosed(f"peer sent GOAWAY (error code {ev.error_code!r})"))

    # ---------------------------------------------------------------- output

    def data_to_send(self) -> bytes:
        """Everything written since the last call, in order (one transport write)."""
        out = self._out
        if not out:
            return b""
        self._out = []
        return b"".join(out)

    def start_response(self, stream_id: int, status: int, headers) -> None:
        """Send the response HEADERS (once per request). `headers`: (name, value) byte pairs;
        pass the same tuple for every stream and its block is encoded once per connection."""
        self._send_headers(self.streams[stream_id], status, headers, 0)

    def _send_headers(self, st: _Stream, status: int | None, headers, flags: int) -> None:
        """One HEADERS frame (response or trailers), through h2's state machines but not its encoder."""
        conn = self.conn
        key = (status, headers if type(headers) is tuple else tuple(headers))
        block = self._blocks.get(key)
        if block is None:
            block = encode_block(status, key[1])
            if len(self._blocks) < 64:
                self._blocks[key] = block
        if conn.encoder.table_size_changes or len(block) > conn.max_outbound_frame_size:
            # rare: the peer resized its HPACK table (the next block must say so) or a huge block
            full = ([(b":status", str(status).encode())] if status is not None else []) + list(key[1])
            conn.send_headers(st.id, full, end_stream=bool(flags & END_STREAM))
            self._drain_h2()
            return
        conn.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
        st.h2.state_machine.process_input(StreamInputs.SEND_HEADERS)
        if flags & END_STREAM:
            st.h2.state_machine.process_input(StreamInputs.SEND_END_STREAM)
        n = len(block)
        self._out.append(FRAME_HEADER.pack(n >> 16, n & 0xFFFF, TYPE_HEADERS, flags | END_HEADERS, st.id))
        self._out.append(block)

    def send_data(self, stream_id: int, payload: bytes) -> None:
        """Queue `payload` as DATA on the stream (hot path: once per token per stream).

        One frame when the windows and the peer's max frame size allow, else it joins the
        stream's queue and leaves as the windows open.
        """
        st = self.streams[stream_id]
        n = len(payload)
        conn = self.conn
        if (st.pending or n > conn.outbound_flow_control_window
                or n > st.h2.outbound_flow_control_window or n > conn.max_outbound_frame_size):
            st.pending += payload
            self._drain_stream(st)
            return
        conn.outbound_flow_control_window -= n
        st.h2.outbound_flow_control_window -= n
        self._out.append(DATA_HEADER.pack(n >> 16, n & 0xFFFF, 0, 0, stream_id))
        self._out.append(payload)

    def end_response(self, stream_id: int, trailers: list | None = None) -> None:
        """End the stream after its queued bytes: with trailers (HEADERS, END_STREAM) or an empty DATA frame."""
        st = self.streams.get(stream_id)
        if st is None:
            return  # already reset by the peer
        st.end_after = trailers or []
        if not st.pending:
            self._finish(st)

    def respond(self, stream_id: int, status: int, headers: list, body: bytes,
                trailers: list | None = None) -> None:
        """A complete response in one call (errors, JSON bodies)."""
        self.start_response(stream_id, status, headers + [(b"content-length", str(len(body)).encode())])
        if body:
            self.send_data(stream_id, body)
        self.end_response(stream_id, trailers)

    def reset_stream(self, stream_id: int, error_code: int = ErrorCodes.CANCEL) -> None:
        st = self.streams.pop(stream_id, None)
        self._blocked.pop(stream_id, None)
        if st is not None:
            self.conn.reset_stream(stream_id, error_code)
            self._drain_h2()
            self._maybe_goaway()

    def begin_shutdown(self) -> None:
        """Graceful shutdown: serve the open streams, refuse new ones, GOAWAY once the open ones end."""
        if self.goaway_last_id is not None or self.closed:
            return
        self.goaway_last_id = self.conn.highest_inbound_stream_id
        self._maybe_goaway(served_any=bool(self.streams))

    def _maybe_goaway(self, served_any: bool = True) -> None:
        """Once the last in-flight stream ended: PING, then GOAWAY on its ACK (see the module rules)."""
        if self.goaway_last_id is None or self.streams or self.goaway_sent or self._drain_pinged:
            return
        if served_any:
            self._drain_pinged = True
            self.conn.ping(DRAIN_PING)
            self._drain_h2()
        else:
            self._send_goaway()

    def _send_goaway(self) -> None:
        self.goaway_sent = True
        self._out.append(GOAWAY.pack(0, 8, TYPE_GOAWAY, 0, 0, self.goaway_last_id, ErrorCodes.NO_ERROR))

    def _on_ping_ack(self, ev, events):
        if ev.ping_data == DRAIN_PING and self._drain_pinged and not self.goaway_sent:
            self._send_goaway()

    @property
    def num_active_streams(self) -> int:
        return len(self.streams)

    @property
    def wants_close(self) -> bool:
        """True when the transport should be closed once `data_to_send()` is written."""
        return self.closed or self.goaway_sent or (self.peer_goaway and not self.streams)

    def window_for(self, stream_id: int) -> int:
        """Bytes the stream may send now (both windows), for tests and diagnostics."""
        return min(self.conn.outbound_flow_control_window,
                   self.streams[stream_id].h2.outbound_flow_control_window)

    # -------------------------------------------------------------- internals

    def _drain_h2(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self._out.append(data)

    def _drain_stream(self, st: _Stream) -> None:
        """Send as much of the stream's queue as both windows and the frame size allow."""
        conn = self.conn
        pending = st.pending
        while pending:
            n = min(len(pending), conn.outbound_flow_control_window,
                    st.h2.outbound_flow_control_window, conn.max_outbound_frame_size)
            if n <= 0:
                break
            conn.outbound_flow_control_window -= n
            st.h2.outbound_flow_control_window -= n
            self._out.append(DATA_HEADER.pack(n >> 16, n & 0xFFFF, 0, 0, st.id))
            self._out.append(bytes(pending[:n]))
            del pending[:n]
        if pending:
            self._blocked.pop(st.id, None)
            self._blocked[st.id] = st       # to the back: the others get the next window first
        else:
            self._blocked.pop(st.id, None)
            if st.end_after is not None:
                self._finish(st)

    def _drain_blocked(self) -> None:
        for st in list(self._blocked.values()):
            if self.conn.outbound_flow_control_window <= 0:
                break
            self._drain_stream(st)

    def _finish(self, st: _Stream) -> None:
        """END_STREAM: on the trailers' HEADERS frame, or on an empty DATA frame."""
        del self.streams[st.id]
        if st.end_after:
            self._send_headers(st, None, st.end_after, END_STREAM)
        else:
            self.conn.state_machine.process_input(ConnectionInputs.SEND_DATA)
            st.h2.state_machine.process_input(StreamInputs.SEND_END_STREAM)
            self._out.append(FRAME_HEADER.pack(0, 0, 0, END_STREAM, st.id))
        self._maybe_goaway()


def _local_settings(limits: Limits, max_concurrent_streams: int) -> h2.settings.Settings:
    return h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
        # never below the default: a client may send 65535 bytes before it sees our SETTINGS
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: min(max(limits.max_body_bytes, 65535), MAX_WINDOW),
    })


_HANDLERS = {
    h2.events.RequestReceived: H2Session._on_request,
    h2.events.DataReceived: H2Session._on_data,
    h2.events.StreamEnded: H2Session._on_stream_ended,
    h2.events.StreamReset: H2Session._on_stream_reset,
    h2.events.WindowUpdated: H2Session._on_window_updated,
    h2.events.RemoteSettingsChanged: H2Session._on_settings_changed,
    h2.events.ConnectionTerminated: H2Session._on_terminated,
    h2.events.PingAckReceived: H2Session._on_ping_ack,
}
