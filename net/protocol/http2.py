"""Sans-IO HTTP/2 server session: `receive_data(bytes) -> list[Event]`, `data_to_send() -> bytes`.

Streams are ours; the connection's negotiation is h2's.

Rule 1: every frame that belongs to a stream (HEADERS, CONTINUATION, DATA, RST_STREAM,
        WINDOW_UPDATE, PRIORITY) is split from the bytes here (9-byte headers), checked and
        applied to our own stream table. A stream's life is the table `TRANSITIONS` (RFC 9113
        5.1, server side); a transition that is not in it is an error, never a silent default.
        h2 never sees a stream frame (after an h2c upgrade it keeps the stream 1 its upgrade
        call made, and never hears of it again).
Rule 2: h2's `H2Connection` keeps what it does well and what is off the hot path: the client
        preface, SETTINGS (ours, the peer's, value checks, both ACKs) and PING (the ACK, and our
        drain PING). Those frames are handed to it one at a time, in arrival order, so a
        SETTINGS change lands between the same stream frames as on the wire; what the peer's
        settings mean for us (frame size, initial window, HPACK table size) is read back from
        it. GOAWAY is ours both ways (h2 would close its state machine on one).
Rule 3: flow control is exact and ours in both directions. Out: every DATA frame debits the
        connection and stream send windows by exactly its length; WINDOW_UPDATE and SETTINGS
        credit them, never past 2**31 - 1. In: every DATA byte (padding included) counts
        against both receive windows, and a peer that overruns one ends the connection
        (FLOW_CONTROL_ERROR). Consumed bytes go back in at most one connection WINDOW_UPDATE per
        read, once half the window is used (our connection window is 2**24: one WINDOW_UPDATE
        follows our SETTINGS). Every DATA byte counts as consumed for the connection as it
        arrives, held body bytes too: bodies interleaved on one connection never wait for each
        other (when held bodies counted against the window until their request was complete,
        five bodies of nearly 4 MiB sent a little of each in turn spent it with none complete,
        and the upload stalled until the idle timeout). What one connection can make us hold
        is bounded by `max_body_bytes` per stream and `max_concurrent_streams`, and counted in
        `num_body_bytes` (added in `_add_body`, released in `_release_body`: the one place the
        server-wide body budget reads). A stream's window starts as large as the largest body
        we accept (a request body usually needs no stream WINDOW_UPDATE) and is handed back in
        batches of half a window as its bytes arrive, so the window is flow control, never the
        size limit: a body past `max_body_bytes` (or a content-length over it, before any body)
        is `BodyTooLarge`, answered 413, then RST_STREAM(NO_ERROR) (RFC 9113 8.1). A message
        stream (rule 11) holds only its incomplete message, plus the delivered messages the app
        keeps until the request ends (`keep_message`): both are in `num_body_bytes`.
Rule 4: every header block is HPACK-decoded, in arrival order, also for streams we refuse or
        reset: the dynamic table must see them all. Repeated blocks replay from a memo that is
        valid only against the same table (request_headers.py).
Rule 5: response frames (HEADERS, DATA, trailers) are built here from precompiled 9-byte
        headers, a step's batch of DATA frames by frames.py (in C when built, rule 3's windows
        debited there); header blocks are context-free HPACK (hpack_plain.py), cached per session.
Rule 6: whatever h2 produces is moved into the output list right after each h2 call, so
        frames leave in the order they were made.
Rule 7: every stream has its own send queue: a stream whose window is shut queues its bytes
        and never holds up the others; WINDOW_UPDATE and SETTINGS changes drain it.
Rule 8: nothing here awaits or touches a socket.
Rule 9: a peer spends from per-connection budgets (flood.py, `Limits`): streams it resets
        before their response started (a client cancelling a stream it is reading spends
        nothing) and streams we reset for its errors, SETTINGS, PING, WINDOW_UPDATE, frames
        that do nothing. Over one: GOAWAY ENHANCE_YOUR_CALM. Control frames we owe a peer that
        does not read are counted (`num_control_frames`).
        Queued response bytes and held body bytes are counted (`num_pending_bytes`,
        `num_body_bytes`: the server-wide budgets read both) and a stream whose queue made
        no progress for the write timeout can be reset (`expire_stalled`); the shell enforces
        both (protocol.py).
Rule 10: of the extension frames, PRIORITY_UPDATE (RFC 9218 7.1) is read, on stream 0: for
        a request the app holds, it becomes a `PriorityUpdate` event; for a stream whose request
        is not complete yet, or not opened yet, its value replaces the request's `priority`
        header when the request is delivered. Those for streams not opened yet are kept, at most
        MAX_EARLY_PRIORITIES per connection (the oldest is dropped for a new one; a newer value
        for the same stream replaces the older), until their HEADERS come, or a higher stream
        opens, which closes the idle streams below it (RFC 9113 5.1.1). Every other unknown
        frame type is ignored (RFC 9113 5.5).
Rule 11: a request whose content-type is `application/grpc*` is a message stream: its body is
        gRPC's length-prefixed messages (1-byte compressed flag, 4-byte length, the message),
        and a call may keep it open for as long as it lasts (a bidirectional stream), so it is
        delivered as it arrives: `MessageRequest` at its headers, a `RequestMessage` for each
        message as soon as the message is complete, `RequestEnd` at END_STREAM. The limit is
        per message: one longer than `max_body_bytes` is `BodyTooLarge`. Every other request
        is delivered whole (`Request`), at END_STREAM. A response that ends while its request
        still comes is followed by RST_STREAM(NO_ERROR) (RFC 9113 8.1).

Errors (RFC 9113 5.4). A connection error writes GOAWAY (last stream id, code), reports
`ConnectionClosed` and ignores all later input. A stream error writes RST_STREAM; if the app
holds the stream it gets `StreamReset`. Frames that arrive on a stream we reset are ignored
(their DATA still counts against the connection window). Where RFC 9113 asks for a stream
error and h2 ends the connection, the RFC is followed: malformed requests (8.1.1: bad fields,
content-length not matching the body, trailers without END_STREAM or with pseudo-headers),
a stream WINDOW_UPDATE of 0 (6.9), a PRIORITY frame of the wrong size or depending on its
own stream (6.3, RFC 7540 5.3.1). An HPACK decoding error is a
COMPRESSION_ERROR (4.3). One stream over our SETTINGS_MAX_CONCURRENT_STREAMS is refused
(REFUSED_STREAM, safe to retry): a client may open streams before our SETTINGS reach it.

Graceful shutdown: streams the client opens after `begin_shutdown()` are refused at once
(REFUSED_STREAM: not processed, safe to retry elsewhere); the in-flight ones run to their
end; then a PING, and GOAWAY once the PING's ACK shows the peer has read every byte before
it; then close. GOAWAY waits that long because curl up to 8.0 drops whatever it received in
the same read as a GOAWAY, silently truncating the streams. A peer's GOAWAY(NO_ERROR) lets
the open streams finish (RFC 9113 6.8).

This is the protocol core, hence one long file: the stream table, both directions of flow
control and the frame handlers share their state and must change together. The receive
path is one function per frame type: each runs per frame of every request, and its checks
read in the order RFC 9113 gives them.
"""

import base64
import struct
import time
from functools import partial

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from h2.errors import ErrorCodes

from . import frames
from .events import (
    BodyTooLarge,
    ConnectionClosed,
    Limits,
    MessageRequest,
    PriorityUpdate,
    Request,
    RequestEnd,
    RequestMessage,
    StreamReset,
)
from .flood import RateBudget
from .frames import FRAME_HEADER, frame_data
from .hpack_plain import encode_block
from .request_headers import MalformedRequest, RequestDecoder

DATA_HEADER = FRAME_HEADER              # (frames.py) 24-bit length, type, flags, 31-bit stream id
RECV_HEADER = struct.Struct(">IBI")     # (length << 8 | type), flags, stream id: one unpack per frame
GOAWAY = struct.Struct(">BHBBIII")      # header + last stream id + error code
RST_STREAM_FRAME = struct.Struct(">BHBBII")     # header + error code
WINDOW_UPDATE_FRAME = struct.Struct(">BHBBII")  # header + increment
U32 = struct.Struct(">I")
MESSAGE_PREFIX = struct.Struct(">BI")   # a gRPC message's compressed flag and length (rule 11)
MESSAGE_CONTENT_TYPE = "application/grpc"   # requests whose content-type starts so are message streams
DRAIN_PING = b"tw-drain"                # PING payload that asks "have you read everything?"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types (RFC 9113 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, TYPE_GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
PRIORITY_UPDATE = 0x10             # RFC 9218 7.1, an extension frame
TYPE_HEADERS = HEADERS
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

MAX_WINDOW = 2**31 - 1
CONNECTION_WINDOW = 2**24               # our connection receive window, raised to this at the start
MAX_CONTINUATIONS = 64                  # CONTINUATION frames per header block (h2's limit)
CLOSED_MEMORY = 1024                    # recently closed streams remembered (how they closed)
MAX_EARLY_PRIORITIES = 16               # PRIORITY_UPDATEs kept for streams not opened yet (rule 10)

# stream states (RFC 9113 5.1, as a server sees them; idle and closed streams are not in the table)
IDLE, OPEN, HALF_CLOSED_REMOTE, HALF_CLOSED_LOCAL, CLOSED = range(5)
STATE_NAMES = ("idle", "open", "half-closed (remote)", "half-closed (local)", "closed")
# inputs
RECV_HEADERS, RECV_DATA, RECV_TRAILERS, RECV_END_STREAM, RECV_RST_STREAM, SEND_END_STREAM, SEND_RST_STREAM = range(7)
# how a stream closed, for frames that arrive after
CLOSED_BY_END, CLOSED_BY_RESET_SENT, CLOSED_BY_RESET_RECV = range(3)

# (state, input) -> next state; anything else is an error: a stream error STREAM_CLOSED for
# what the peer sends on a half-closed (remote) stream (RFC 9113 5.1), our bug for what we send
TRANSITIONS = {
    (IDLE, RECV_HEADERS): OPEN,
    (OPEN, RECV_DATA): OPEN,
    (OPEN, RECV_TRAILERS): OPEN,
    (OPEN, RECV_END_STREAM): HALF_CLOSED_REMOTE,
    (OPEN, SEND_END_STREAM): HALF_CLOSED_LOCAL,
    (OPEN, RECV_RST_STREAM): CLOSED,
    (OPEN, SEND_RST_STREAM): CLOSED,
    (HALF_CLOSED_REMOTE, SEND_END_STREAM): CLOSED,
    (HALF_CLOSED_REMOTE, RECV_RST_STREAM): CLOSED,
    (HALF_CLOSED_REMOTE, SEND_RST_STREAM): CLOSED,
    (HALF_CLOSED_LOCAL, RECV_DATA): HALF_CLOSED_LOCAL,
    (HALF_CLOSED_LOCAL, RECV_TRAILERS): HALF_CLOSED_LOCAL,
    (HALF_CLOSED_LOCAL, RECV_END_STREAM): CLOSED,
    (HALF_CLOSED_LOCAL, RECV_RST_STREAM): CLOSED,
    (HALF_CLOSED_LOCAL, SEND_RST_STREAM): CLOSED,
}
_RECV_INPUTS = frozenset({RECV_HEADERS, RECV_DATA, RECV_TRAILERS, RECV_END_STREAM, RECV_RST_STREAM})
# the events that carry a request to the app (withdrawn when its stream is gone before the app saw them)
_REQUEST_EVENTS = (Request, MessageRequest, RequestMessage, RequestEnd)


class ConnectionError_(Exception):
    """A connection error (RFC 9113 5.4.1): GOAWAY with `code`, then nothing more.
    `cause`: the metric's reason (flood.CLOSE_CAUSES)."""

    def __init__(self, code: ErrorCodes, message: str, cause: str = "protocol_error"):
        super().__init__(message)
        self.code = code
        self.cause = cause


class StreamError(Exception):
    """A stream error (RFC 9113 5.4.2): RST_STREAM with `code` on `stream_id`."""

    def __init__(self, stream_id: int, code: ErrorCodes, message: str):
        super().__init__(message)
        self.stream_id = stream_id
        self.code = code


class _Stream:
    """One request/response exchange as the session sees it."""
    __slots__ = ("id", "state", "method", "target", "headers", "body", "body_len", "content_length",
                 "arrived_ns", "too_large", "send_window", "recv_window", "recv_unacked", "held", "pending",
                 "end_after", "stalled_ns", "started", "by_message")

    def __init__(self, stream_id, method, target, headers, content_length, arrived_ns, send_window, recv_window):
        self.id = stream_id
        self.state = OPEN
        self.method = method
        self.target = target
        self.headers = headers
        self.body = None                # bytes of the first DATA frame; a list of chunks from the second on;
                                        # a message stream's: a bytearray, its incomplete message
        self.body_len = 0
        self.content_length = content_length    # the request's content-length, None if it gave none
        self.arrived_ns = arrived_ns
        self.too_large = False
        self.send_window = send_window  # bytes we may send (the peer's window for this stream)
        self.recv_window = recv_window  # bytes the peer may send
        self.recv_unacked = 0           # received bytes whose stream window is not handed back yet
        self.held = 0                   # body bytes held here (in the session's num_body_bytes)
        self.pending = bytearray()      # response bytes waiting for window
        self.end_after = None           # trailers list (maybe empty) once the response is ended
        self.stalled_ns = 0             # when `pending` last made progress (or filled), monotonic ns
        self.started = False            # the response HEADERS went out
        self.by_message = False         # a message stream (rule 11): delivered message by message


def transition(st: _Stream, event: int) -> int:
    """Apply one input to a stream's state machine; -> the new state (see TRANSITIONS)."""
    new = TRANSITIONS.get((st.state, event))
    if new is None:
        if event in _RECV_INPUTS:
            raise StreamError(st.id, ErrorCodes.STREAM_CLOSED,
                              f"stream {st.id} is {STATE_NAMES[st.state]}: the peer may not send that on it")
        raise RuntimeError(f"stream {st.id}: input {event} in state {STATE_NAMES[st.state]} (a bug in the session)")
    st.state = new
    return new


class H2Session:
    """The server side of one HTTP/2 connection (prior knowledge, TLS ALPN `h2`, or after h2c upgrade)."""

    def __init__(self, limits: Limits, upgrade_settings: bytes | None = None):
        config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = _local_settings(limits)
        self.decoder = self.conn.decoder = RequestDecoder()     # h2 sets its table size on our SETTINGS' ACK
        # enforced from the first request, not only once the client has acknowledged our SETTINGS;
        # a header list over it ends the connection (ENHANCE_YOUR_CALM)
        self.decoder.max_header_list_size = limits.max_header_list_size
        self.limits = limits
        self.streams: dict[int, _Stream] = {}       # streams whose response is not over: the app writes to these
        self._open: dict[int, _Stream] = {}         # every stream not closed (RFC 9113 5.1)
        self._closed: dict[int, int] = {}           # recently closed stream id -> CLOSED_BY_*
        self._blocked: dict[int, _Stream] = {}      # streams with queued bytes, oldest first
        self._out: list[bytes] = []
        self._buf = b""                             # an incomplete frame, kept for the next read
        self._received_ns = 0
        self._preface_left = len(PREFACE)
        self._first_frame = True                    # the preface must be followed by SETTINGS
        self._header_block = None                   # (stream id, HEADERS flags, [fragments], self-dependent) until END_HEADERS
        self._blocks: dict = {}                     # (status, headers) -> encoded header block
        self.highest_stream_id = 0                  # the highest stream the peer opened
        self.stream_recv_window = _initial_window(limits)
        self._recv_window = CONNECTION_WINDOW       # connection: bytes the peer may still send
        self._recv_unacked = 0                      # consumed, not yet handed back
        self.send_window = 65535                    # connection: bytes we may send (RFC 9113 6.9.2)
        self.goaway_last_id: int | None = None      # set once a graceful shutdown began: the last stream served
        self.goaway_sent = False
        self._drain_pinged = False
        self.closed = False                         # peer went away or broke the protocol
        self.wants_poll = False                     # HTTP/1.1 pipelining flag; never set here
        self.peer_goaway = False                    # the peer sent GOAWAY(NO_ERROR): finish and close
        self._credit_due: dict[int, _Stream] = {}   # streams owed a WINDOW_UPDATE at the end of this read
        self._early_priorities: dict[int, str] = {}  # stream id -> PRIORITY_UPDATE value, for streams not
                                                    # opened yet (rule 10), oldest first
        self.num_pending_bytes = 0                  # response bytes queued in streams (waiting for windows)
        self.num_body_bytes = 0                     # body bytes held for requests not yet complete (all streams)
        self.num_control_frames = 0                 # control frames we wrote (ACKs, RST_STREAM, WINDOW_UPDATE)
        self._resets = RateBudget(limits.max_resets_per_s)
        self._settings = RateBudget(limits.max_settings_per_s)
        self._pings = RateBudget(limits.max_pings_per_s)
        self._window_updates = RateBudget(limits.max_window_updates_per_s)
        self._empty = RateBudget(limits.max_empty_frames_per_s)
        if upgrade_settings is None:
            self.conn.initiate_connection()
        else:
            padded = upgrade_settings + b"=" * (-len(upgrade_settings) % 4)
            base64.urlsafe_b64decode(padded)  # raises binascii.Error on garbage before h2 sees it
            self.conn.initiate_upgrade_connection(padded)
        self._drain_h2()
        self._out.append(WINDOW_UPDATE_FRAME.pack(0, 4, WINDOW_UPDATE, 0, 0, CONNECTION_WINDOW - 65535))
        self.max_frame_size = self.conn.max_outbound_frame_size     # the peer's SETTINGS_MAX_FRAME_SIZE
        self.peer_initial_window = self.conn.remote_settings.initial_window_size

    # ----------------------------------------------------------------- input

    def receive_data(self, data: bytes) -> list:
        """Feed bytes from the peer; returns complete requests and stream/connection events."""
        if self.closed:
            return []
        self._received_ns = time.monotonic_ns()   # a request's arrival: when its last header bytes came in
        if self._buf:
            data = self._buf + data
            self._buf = b""
        events = []
        try:
            if self._preface_left:
                data = self._take_preface(data)
            pos = self._frames(data, events)
        except ConnectionError_ as exc:
            self._connection_error(exc.code, str(exc), events, exc.cause)
            return events
        if pos < len(data):
            self._buf = data[pos:]
        if self._credit_due:
            self._hand_back_stream_windows()
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self._hand_back_connection_window()
        return events

    def _take_preface(self, data: bytes) -> bytes:
        n = min(self._preface_left, len(data))
        self._to_h2(data[:n], [])                   # h2 checks it
        self._preface_left -= n
        return data[n:]

    def _frames(self, data: bytes, events: list) -> int:
        """Handle every complete frame in `data` (hot path: per read); -> bytes used."""
        pos, end = 0, len(data)
        handlers = self._handlers
        max_size = self.conn.max_inbound_frame_size
        while end - pos >= 9:
            head, flags, stream_id = RECV_HEADER.unpack_from(data, pos)
            length, ftype = head >> 8, head & 0xFF
            if length > max_size:
                raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, f"a frame of {length} bytes, over the "
                                       f"{max_size} of SETTINGS_MAX_FRAME_SIZE")
            stop = pos + 9 + length
            if stop > end:
                break
            if self._header_block is not None and ftype != CONTINUATION:
                raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "a header block was interrupted by another frame")
            if self._first_frame:
                if ftype != SETTINGS:
                    raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "the client preface must end with SETTINGS")
                self._first_frame = False
            stream_id &= 0x7FFFFFFF
            try:
                if ftype < 10:
                    handlers[ftype](self, flags, stream_id, data, pos, stop, events)
                elif ftype == PRIORITY_UPDATE:
                    self._on_priority_update(stream_id, data, pos + 9, stop, events)
                else:               # other unknown frame types are ignored (RFC 9113 5.5), within the budget
                    self._spend(self._empty, "empty_frame_flood", "frames of unknown types")
            except StreamError as exc:
                self._stream_error(exc.stream_id, exc.code, events)
            pos = stop
            if self.closed:
                break
        return pos

    # --------------------------------------------------- stream frames

    def _on_headers(self, flags, sid, data, pos, stop, events):
        """HEADERS: a request's header block, or its trailers (maybe continued by CONTINUATION)."""
        start = pos + 9
        if sid == 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            start, stop = _unpad(data, start, stop)
        if flags & PRIORITY_FLAG:
            if stop - start < 5:
                raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            self_dependent = U32.unpack_from(data, start)[0] & 0x7FFFFFFF == sid
            start += 5
        else:
            self_dependent = False
        fragment = data[start:stop]
        if not flags & END_HEADERS:
            if not fragment:
                self._spend(self._empty, "empty_frame_flood", "empty HEADERS frames")
            self._header_block = (sid, flags, [fragment], self_dependent)
            return
        self._on_header_block(sid, flags, fragment, self_dependent, events)

    def _on_continuation(self, flags, sid, data, pos, stop, events):
        block = self._header_block
        if block is None or block[0] != sid:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, f"CONTINUATION on stream {sid} without a header block "
                                   "in progress on it")
        fragments = block[2]
        if stop == pos + 9 and not flags & END_HEADERS:
            self._spend(self._empty, "empty_frame_flood", "empty CONTINUATION frames")
        fragments.append(data[pos + 9:stop])
        if len(fragments) > MAX_CONTINUATIONS:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, f"more than {MAX_CONTINUATIONS} CONTINUATION frames")
        if flags & END_HEADERS:
            self._header_block = None
            self._on_header_block(sid, block[1], b"".join(fragments), block[3], events)

    def _on_header_block(self, sid, flags, block, self_dependent, events):
        """A complete header block (hot path: once per request)."""
        st = self._open.get(sid)
        if st is not None:
            self._on_trailers(st, flags, block, events)
            return
        if sid <= self.highest_stream_id or not sid & 1:
            self._decode(block)                      # keeps the table in step if this is only a stream error
            how = self._closed.get(sid)
            if how is CLOSED_BY_RESET_SENT or how is CLOSED_BY_RESET_RECV:
                raise StreamError(sid, ErrorCodes.STREAM_CLOSED, f"HEADERS on reset stream {sid}")
            if how is CLOSED_BY_END:
                raise ConnectionError_(ErrorCodes.STREAM_CLOSED, f"HEADERS on closed stream {sid}")
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, f"stream id {sid} is even or not above "
                                   f"{self.highest_stream_id}, the last one opened")
        self.highest_stream_id = sid
        early = self._take_early_priority(sid) if self._early_priorities else None
        try:
            method, target, headers, content_length = self._decode_request(block)
        except MalformedRequest:         # RFC 9113 8.1.1: a stream error, not a connection error
            self._spend_reset()
            self._reset(sid, ErrorCodes.PROTOCOL_ERROR)
            return
        if self_dependent:
            self._spend_reset()
            self._reset(sid, ErrorCodes.PROTOCOL_ERROR)
            return
        if ((self.goaway_last_id is not None and sid > self.goaway_last_id)
                or len(self._open) >= self.limits.max_concurrent_streams):
            self._reset(sid, ErrorCodes.REFUSED_STREAM)
            return
        st = _Stream(sid, method, target, headers, content_length, self._received_ns,
                     self.peer_initial_window, self.stream_recv_window)
        self._open[sid] = self.streams[sid] = st
        if early is not None:
            headers["priority"] = early         # (the dict is this request's own: request_headers.py)
        if content_length is not None and content_length > self.limits.max_body_bytes:
            self._too_large(st, events)         # 413 before any of the body is read
        elif headers.get("content-type", "").startswith(MESSAGE_CONTENT_TYPE):
            st.by_message = True
            events.append(MessageRequest(sid, method, target, headers, st.arrived_ns))
        if flags & END_STREAM:
            self._end_request(st, events)

    def _on_trailers(self, st: _Stream, flags: int, block: bytes, events: list) -> None:
        """A second header block on a request: trailers. They must end the stream and carry no
        pseudo-header (RFC 9113 8.1); their fields are not used."""
        fields = self._decode(block)
        transition(st, RECV_TRAILERS)
        if not flags & END_STREAM or any(name[:1] == b":" for name, _ in fields):
            raise StreamError(st.id, ErrorCodes.PROTOCOL_ERROR, "malformed trailers")
        self._end_request(st, events)

    def _on_data(self, flags, sid, data, pos, stop, events):
        """DATA: request body bytes (hot path: once per request, usually)."""
        start = pos + 9
        length = stop - start                        # flow-controlled: padding included
        if sid == 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "DATA on stream 0")
        self._recv_window -= length
        if self._recv_window < 0:
            raise ConnectionError_(ErrorCodes.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_unacked += length                 # consumed at once, a held body too (Rule 3)
        if flags & PADDED:
            start, stop = _unpad(data, start, stop)
        st = self._open.get(sid)
        if st is None:
            self._on_data_closed(sid)
            return
        st.recv_window -= length
        if st.recv_window < 0:
            raise ConnectionError_(ErrorCodes.FLOW_CONTROL_ERROR, f"DATA beyond the window of stream {sid}")
        transition(st, RECV_DATA)
        if stop > start and not st.too_large and st.end_after is None:
            if st.by_message:
                self._add_messages(st, data[start:stop], events)
            else:
                self._add_body(st, data[start:stop], events)
        elif not length and not flags & END_STREAM:
            self._spend(self._empty, "empty_frame_flood", "empty DATA frames")
        if flags & END_STREAM:
            self._end_request(st, events)
        elif length:
            self._credit_stream(st, length)

    def _on_data_closed(self, sid: int) -> None:
        """DATA on a stream not open: on an idle one, a connection error; on one we reset,
        ignored; on one otherwise closed, a stream error (h2 does the same)."""
        if sid > self.highest_stream_id:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        if self._closed.get(sid) is not CLOSED_BY_RESET_SENT:
            raise StreamError(sid, ErrorCodes.STREAM_CLOSED, f"DATA on closed stream {sid}")

    def _add_body(self, st: _Stream, chunk: bytes, events: list) -> None:
        n = st.body_len + len(chunk)
        if n > self.limits.max_body_bytes:
            self._too_large(st, events)
            return
        if st.content_length is not None and n > st.content_length:
            raise StreamError(st.id, ErrorCodes.PROTOCOL_ERROR, "body longer than its content-length")
        st.held += len(chunk)
        self.num_body_bytes += len(chunk)
        body = st.body
        if body is None:
            st.body = chunk
        elif type(body) is list:
            body.append(chunk)
        else:
            st.body = [body, chunk]
        st.body_len = n

    def _add_messages(self, st: _Stream, chunk: bytes, events: list) -> None:
        """A message stream's body bytes (rule 11): every message they complete is delivered;
        what is left of an incomplete one is held (hot path: once per DATA frame of a gRPC call;
        a frame of whole messages, the usual case, is read without a copy into the buffer)."""
        st.body_len += len(chunk)
        if st.content_length is not None and st.body_len > st.content_length:
            raise StreamError(st.id, ErrorCodes.PROTOCOL_ERROR, "body longer than its content-length")
        held = st.body                  # a bytearray: an incomplete message, or None
        num_held = 0
        if held is None:
            data = chunk
        else:
            num_held = len(held)
            held += chunk               # in place: a large message arriving frame by frame is copied once
            data = held
        pos, end, limit = 0, len(data), self.limits.max_body_bytes
        while end - pos >= 5:
            compressed, length = MESSAGE_PREFIX.unpack_from(data, pos)
            if length > limit:
                self._too_large(st, events)
                return
            stop = pos + 5 + length
            if stop > end:
                break
            events.append(RequestMessage(st.id, bool(compressed), bytes(data[pos + 5:stop])))
            pos = stop
        if pos == end:
            st.body = None
        elif held is None:
            st.body = bytearray(data[pos:])
        elif pos:
            del held[:pos]
        delta = end - pos - num_held
        st.held += delta
        self.num_body_bytes += delta

    def keep_message(self, stream_id: int, num_bytes: int) -> None:
        """The app keeps a delivered message until the request ends (a unary gRPC call waits
        for the half-close): its bytes count in `num_body_bytes`, and so in the server-wide
        budget, until then."""
        st = self._open.get(stream_id)
        if st is not None and st.by_message and st.state == OPEN:
            st.held += num_bytes
            self.num_body_bytes += num_bytes

    def _too_large(self, st: _Stream, events: list) -> None:
        """The body is over the limit: what is held is dropped, the app answers 413 at once
        (RST_STREAM(NO_ERROR) follows the response, see `_finish`)."""
        st.too_large = True
        st.body = None
        self._release_body(st)
        events.append(BodyTooLarge(st.id, st.method, st.target, st.headers, st.arrived_ns))

    def _release_body(self, st: _Stream) -> None:
        """The held body is no longer ours to keep (the request is complete, too large or gone)."""
        self.num_body_bytes -= st.held
        st.held = 0

    def _credit_stream(self, st: _Stream, length: int) -> None:
        """Received bytes of a stream that goes on: its window comes back in batches of half a
        window, after the read (the peer cannot have seen a WINDOW_UPDATE written during it)."""
        st.recv_unacked += length
        if st.recv_unacked >= self.stream_recv_window // 2:
            self._credit_due[st.id] = st

    def _hand_back_stream_windows(self) -> None:
        for st in self._credit_due.values():
            if st.id in self._open and (st.state == OPEN or st.state == HALF_CLOSED_LOCAL):    # more may come
                self._out.append(WINDOW_UPDATE_FRAME.pack(0, 4, WINDOW_UPDATE, 0, st.id, st.recv_unacked))
                self.num_control_frames += 1
                st.recv_window += st.recv_unacked
                st.recv_unacked = 0
        self._credit_due.clear()

    def _end_request(self, st: _Stream, events: list) -> None:
        """The peer's END_STREAM: the request is complete (unless it was too large)."""
        self._release_body(st)
        if transition(st, RECV_END_STREAM) == CLOSED:
            self._close(st, CLOSED_BY_END)
        if st.too_large or st.end_after is not None:
            return
        if st.content_length is not None and st.body_len != st.content_length:
            raise StreamError(st.id, ErrorCodes.PROTOCOL_ERROR, "body shorter than its content-length")
        body = st.body
        st.body = None
        if st.by_message:
            events.append(RequestEnd(st.id, len(body) if body is not None else 0))
            return
        if body is None:
            body = b""
        elif type(body) is list:
            body = b"".join(body)
        events.append(Request(st.id, st.method, st.target, st.headers, body, st.arrived_ns))

    def _on_rst_stream(self, flags, sid, data, pos, stop, events):
        if stop - pos != 13:
            raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, "RST_STREAM must be 4 bytes")
        if sid == 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        st = self._open.get(sid)
        if st is None:
            if sid > self.highest_stream_id:
                raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            return                                  # already closed: nothing to do
        if not st.started:                          # its work was for nothing: the rapid-reset budget
            self._spend_reset()
        transition(st, RECV_RST_STREAM)
        held = sid in self.streams
        self._close(st, CLOSED_BY_RESET_RECV)
        if held:
            self._report_reset(sid, events)

    def _on_window_update(self, flags, sid, data, pos, stop, events):
        if stop - pos != 13:
            raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
        self._spend(self._window_updates, "window_update_flood", "WINDOW_UPDATE frames")
        increment = U32.unpack_from(data, pos + 9)[0] & 0x7FFFFFFF
        if sid == 0:
            if not increment:
                raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(ErrorCodes.FLOW_CONTROL_ERROR, "connection window above 2**31 - 1")
            if self._blocked:
                self._drain_blocked()
            return
        st = self._open.get(sid)
        if st is None:
            if sid > self.highest_stream_id:
                raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return                                  # closed: may arrive for a while (RFC 9113 5.1)
        if not increment:
            raise StreamError(sid, ErrorCodes.PROTOCOL_ERROR, f"WINDOW_UPDATE of 0 on stream {sid}")
        st.send_window += increment
        if st.send_window > MAX_WINDOW:
            raise StreamError(sid, ErrorCodes.FLOW_CONTROL_ERROR, f"window of stream {sid} above 2**31 - 1")
        if st.pending:
            self._drain_stream(st)

    def _on_priority(self, flags, sid, data, pos, stop, events):
        """Priority signals are ignored, once checked (RFC 9113 6.3), within the budget of frames that do nothing."""
        self._spend(self._empty, "empty_frame_flood", "PRIORITY frames")
        if sid == 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if stop - pos != 14:
            self._priority_error(sid, ErrorCodes.FRAME_SIZE_ERROR, "PRIORITY must be 5 bytes")
        elif U32.unpack_from(data, pos + 9)[0] & 0x7FFFFFFF == sid:
            self._priority_error(sid, ErrorCodes.PROTOCOL_ERROR, f"stream {sid} depends on itself")

    def _on_priority_update(self, sid, data, start, stop, events):
        """PRIORITY_UPDATE (RFC 9218 7.1): on stream 0, naming a request stream; reported for a
        request the app holds, put in the request's headers for one not complete yet, kept for a
        stream not opened yet (rule 10), ignored for a closed one."""
        if sid != 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "PRIORITY_UPDATE on a stream other than 0")
        if stop - start < 4:
            raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, "PRIORITY_UPDATE shorter than 4 bytes")
        target = int.from_bytes(data[start:start + 4], "big") & 0x7FFFFFFF
        if target == 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "PRIORITY_UPDATE for stream 0")
        value = data[start + 4:stop].decode("latin-1")
        st = self._open.get(target)
        if st is not None:
            if st.state == OPEN:                # its request still comes: it is delivered with this value
                st.headers["priority"] = value  # (a message stream's too: a unary gRPC call starts at the end)
            if target in self.streams and (st.by_message or st.state != OPEN):     # the app holds the request
                events.append(PriorityUpdate(target, value))
        elif target > self.highest_stream_id and target & 1:              # not opened yet (we never push)
            early = self._early_priorities
            early.pop(target, None)             # a newer value replaces the older one, and is the newest
            if len(early) >= MAX_EARLY_PRIORITIES:
                del early[next(iter(early))]    # the oldest goes
            early[target] = value

    def _take_early_priority(self, sid: int) -> str | None:
        """The kept PRIORITY_UPDATE value for the stream `sid` opens, if any; those for the
        streams below it are dropped: opening `sid` closed them (RFC 9113 5.1.1)."""
        early = self._early_priorities
        value = early.pop(sid, None)
        for stale in [k for k in early if k < sid]:
            del early[stale]
        return value

    def _priority_error(self, sid: int, code: ErrorCodes, message: str) -> None:
        """A stream error, but RST_STREAM may not name an idle stream (RFC 9113 6.4): then the connection's."""
        if sid > self.highest_stream_id:
            raise ConnectionError_(code, message)
        raise StreamError(sid, code, message)

    # ------------------------------------------------ connection frames

    def _on_settings(self, flags, sid, data, pos, stop, events):
        """SETTINGS: h2's (see rule 2), within its budget."""
        self._spend(self._settings, "settings_flood", "SETTINGS frames")
        self._to_h2(data[pos:stop], events)

    def _on_ping(self, flags, sid, data, pos, stop, events):
        """PING: h2's (see rule 2), within its budget."""
        self._spend(self._pings, "ping_flood", "PING frames")
        self._to_h2(data[pos:stop], events)

    def _spend(self, budget: RateBudget, cause: str, what: str) -> None:
        if not budget.take(self._received_ns):
            raise ConnectionError_(ErrorCodes.ENHANCE_YOUR_CALM, f"more {what} than the limit of "
                                   f"{budget.capacity:g} per second", cause)

    def _spend_reset(self) -> None:
        """A stream ends before its response started, by the client's doing (rule 9)."""
        self._spend(self._resets, "rapid_reset", "streams reset before their response")

    def _on_push_promise(self, flags, sid, data, pos, stop, events):
        raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "a client may not send PUSH_PROMISE")

    def _on_goaway(self, flags, sid, data, pos, stop, events):
        """The peer is going away. NO_ERROR: no new streams, but the open ones may finish (RFC 9113 6.8)."""
        if sid != 0:
            raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "GOAWAY on a stream")
        if stop - pos < 17:
            raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
        code = U32.unpack_from(data, pos + 13)[0]
        if code == ErrorCodes.NO_ERROR and self.streams:
            self.peer_goaway = True
            return
        self.closed = True
        events.append(ConnectionClosed(f"peer sent GOAWAY (error code {_code_name(code)})"))

    def _to_h2(self, raw: bytes, events: list) -> None:
        try:
            h2_events = self.conn.receive_data(raw)
        except (h2.exceptions.ProtocolError, ValueError) as exc:  # h2 queued its own GOAWAY: ours replaces it
            self.conn.data_to_send()
            raise ConnectionError_(getattr(exc, "error_code", ErrorCodes.PROTOCOL_ERROR), str(exc)) from None
        if self._drain_h2():        # ACKs go before anything written after this frame
            self.num_control_frames += 1
        for ev in h2_events:
            if type(ev) is h2.events.RemoteSettingsChanged:
                self._on_settings_changed(ev)
            elif type(ev) is h2.events.PingAckReceived:
                self._on_ping_ack(ev)

    def _on_settings_changed(self, ev) -> None:
        """The peer's new SETTINGS: a new initial window moves every stream's send window by the
        difference (RFC 9113 6.9.2); a new frame size or window may let queued bytes go."""
        changed = ev.changed_settings.get(h2.settings.SettingCodes.INITIAL_WINDOW_SIZE)
        if changed is not None:
            delta = changed.new_value - self.peer_initial_window
            self.peer_initial_window = changed.new_value
            for st in self._open.values():
                st.send_window += delta
                if st.send_window > MAX_WINDOW:
                    raise ConnectionError_(ErrorCodes.FLOW_CONTROL_ERROR,
                                           f"SETTINGS_INITIAL_WINDOW_SIZE puts stream {st.id} above 2**31 - 1")
        self.max_frame_size = self.conn.max_outbound_frame_size
        if self._blocked:
            self._drain_blocked()

    def _on_ping_ack(self, ev) -> None:
        if ev.ping_data == DRAIN_PING and self._drain_pinged and not self.goaway_sent:
            self._send_goaway(self.goaway_last_id, ErrorCodes.NO_ERROR)

    # ------------------------------------------------------------ errors

    def _connection_error(self, code: ErrorCodes, message: str, events: list, cause: str = "protocol_error") -> None:
        self._send_goaway(self.highest_stream_id, code)
        self.closed = True
        events[:] = [ev for ev in events if type(ev) not in _REQUEST_EVENTS]     # no response could reach the peer
        events.append(ConnectionClosed(f"HTTP/2 protocol error ({_code_name(code)}): {message}", cause))

    def end_connection(self, cause: str, message: str, calm: bool = True) -> list:
        """The shell ends the connection for one of its limits (protocol.py): GOAWAY
        ENHANCE_YOUR_CALM (`calm`: an abuse), else NO_ERROR (a deadline); -> the events to
        hand the app (ConnectionClosed)."""
        events = []
        if not self.closed:
            code = ErrorCodes.ENHANCE_YOUR_CALM if calm else ErrorCodes.NO_ERROR
            self._connection_error(code, message, events, cause)
        return events

    def expire_stalled(self, cutoff_ns: int) -> list:
        """Reset (CANCEL) every stream whose queued response made no progress since `cutoff_ns`
        (the peer does not read it); -> the ids of those the app held."""
        expired = []
        for st in list(self._blocked.values()):
            if st.stalled_ns < cutoff_ns and st.id in self.streams:
                self._reset(st.id, ErrorCodes.CANCEL)
                expired.append(st.id)
        if expired:
            self._maybe_goaway()
        return expired

    def _stream_error(self, sid: int, code: ErrorCodes, events: list) -> None:
        """RST_STREAM; the app hears of it if it holds the stream."""
        self._spend_reset()
        held = sid in self.streams
        self._reset(sid, code)
        if held:
            self._report_reset(sid, events)

    def _report_reset(self, sid: int, events: list) -> None:
        """A stream the app may hold is gone: its request events among this read's are
        withdrawn, so the app never receives a request, or a message, whose stream is already
        closed; then StreamReset, unless the app had not seen the request at all."""
        seen = True
        for i in range(len(events) - 1, -1, -1):
            ev = events[i]
            kind = type(ev)
            if kind in _REQUEST_EVENTS and ev.stream_id == sid:
                del events[i]
                if kind is Request or kind is MessageRequest:
                    seen = False
        if seen:
            events.append(StreamReset(sid))
        self._maybe_goaway()

    def _reset(self, sid: int, code: ErrorCodes) -> None:
        st = self._open.get(sid)
        if st is not None:
            transition(st, SEND_RST_STREAM)
            self._close(st, CLOSED_BY_RESET_SENT)
        else:
            self._remember_closed(sid, CLOSED_BY_RESET_SENT)
        self._out.append(RST_STREAM_FRAME.pack(0, 4, RST_STREAM, 0, sid, code))
        self.num_control_frames += 1

    def _close(self, st: _Stream, how: int) -> None:
        del self._open[st.id]
        self.streams.pop(st.id, None)
        if st.pending:
            self._blocked.pop(st.id, None)
            self.num_pending_bytes -= len(st.pending)
            st.pending = bytearray()
        if st.held:
            self._release_body(st)
        self._remember_closed(st.id, how)

    def _remember_closed(self, sid: int, how: int) -> None:
        closed = self._closed
        closed[sid] = how
        if len(closed) > 2 * CLOSED_MEMORY:        # keep the newest half: amortized O(1) per stream
            self._closed = dict(list(closed.items())[-CLOSED_MEMORY:])

    # ---------------------------------------------------------------- output

    def poll_events(self) -> list:
        """HTTP/2 delivers every event from `receive_data`; present for symmetry with HTTP/1.1."""
        return []

    def upgraded_request(self, request: Request) -> Request:
        """Adopt the HTTP/1.1 request that carried `Upgrade: h2c` as stream 1 (half-closed (remote))."""
        st = _Stream(1, request.method, request.target, request.headers, None, request.arrived_ns,
                     self.peer_initial_window, self.stream_recv_window)
        st.state = HALF_CLOSED_REMOTE
        self._open[1] = self.streams[1] = st
        self.highest_stream_id = 1
        return request._replace(stream_id=1)

    def data_to_send(self) -> bytes:
        """Everything written since the last call, in order (one transport write)."""
        out = self._out
        if not out:
            return b""
        data = b"".join(out)
        out.clear()                 # the same list: data writers hold its append
        return data

    def start_response(self, stream_id: int, status: int, headers, extra=()) -> None:
        """Send the response HEADERS (once per request). `headers`: (name, value) byte pairs;
        pass the same tuple for every stream and its block is encoded once per connection.
        `extra`: the fields whose values differ per response (x-request-id, content-length),
        encoded each time after them (a context-free block is a concatenation of its fields)."""
        st = self.streams[stream_id]
        st.started = True
        self._send_headers(st, status, headers, 0, extra)

    def _send_headers(self, st: _Stream, status: int | None, headers, flags: int, extra=()) -> None:
        """One HEADERS frame (response or trailers), continued by CONTINUATION frames if it is too big."""
        if status is None:              # trailers: their values differ per stream, nothing to cache
            block = encode_block(None, headers)
        else:
            key = (status, headers if type(headers) is tuple else tuple(headers))
            block = self._blocks.get(key)
            if block is None:
                block = encode_block(status, key[1])
                if len(self._blocks) < 64:
                    self._blocks[key] = block
            if extra:
                block += encode_block(None, extra)
        encoder = self.conn.encoder
        if encoder.table_size_changes:      # the peer resized its table: the next block says so first
            block = encoder.encode([]) + block
        n = len(block)
        if n <= self.max_frame_size:
            self._out.append(FRAME_HEADER.pack(n >> 16, n & 0xFFFF, HEADERS, flags | END_HEADERS, st.id))
            self._out.append(block)
            return
        self._send_continued(st.id, block, flags)

    def _send_continued(self, sid: int, block: bytes, flags: int) -> None:
        size = self.max_frame_size
        chunks = [block[i:i + size] for i in range(0, len(block), size)]
        for i, chunk in enumerate(chunks):
            ftype = HEADERS if i == 0 else CONTINUATION
            fflags = (flags if i == 0 else 0) | (END_HEADERS if i == len(chunks) - 1 else 0)
            n = len(chunk)
            self._out.append(FRAME_HEADER.pack(n >> 16, n & 0xFFFF, ftype, fflags, sid))
            self._out.append(chunk)

    def send_data(self, stream_id: int, payload: bytes) -> None:
        """Queue `payload` as DATA on the stream.

        One frame when the windows and the peer's max frame size allow, else it joins the
        stream's queue and leaves as the windows open.
        """
        self._send(self.streams[stream_id], payload)

    def data_writer(self, stream_id: int):
        """`send_data` for one stream, as a one-argument function (hot path: called once per token)."""
        return partial(self._send, self.streams[stream_id])    # a C-level call into _send: one frame, not two

    def data_key(self, stream_id: int) -> _Stream:
        """The stream's key for `send_batch` (taken once per request)."""
        return self.streams[stream_id]

    def send_batch(self, items) -> None:
        """`send_data` for each (data_key, *pieces) in `items` (frames.py: the payload is the
        pieces, a str as its JSON string), in order: a step's token chunks for this connection
        in one pass (hot path: once per step), framed by `frames.frame_data` (C when built)
        into one bytes object. Same frames and window accounting as one `send_data` per item;
        a chunk that does not fit at once takes the general path. An item that raises leaves
        the windows exact for the frames made before it."""
        items = iter(items)
        out = self._out
        while (item := frame_data(self, items, out, HALF_CLOSED_LOCAL)) is not None:
            self._send(item[0], frames.payload(item))

    def _send(self, st: _Stream, payload: bytes) -> None:
        n = len(payload)
        if (st.pending or n > self.send_window or n > st.send_window or n > self.max_frame_size
                or st.state >= HALF_CLOSED_LOCAL):
            if st.id not in self.streams:
                raise KeyError(f"stream {st.id} is not open for a response (reset, or its response ended)")
            if not st.pending:
                st.stalled_ns = time.monotonic_ns()
            st.pending += payload
            self.num_pending_bytes += n
            self._drain_stream(st)
            return
        self.send_window -= n
        st.send_window -= n
        out = self._out
        out.append(DATA_HEADER.pack(n >> 16, n & 0xFFFF, 0, 0, st.id))
        out.append(payload)

    def end_response(self, stream_id: int, trailers: list | None = None) -> None:
        """End the stream after its queued bytes: with trailers (HEADERS, END_STREAM) or an empty DATA frame."""
        st = self.streams.get(stream_id)
        if st is None:
            return  # already reset by the peer
        st.end_after = trailers or []
        if not st.pending:
            self._finish(st)

    def respond(self, stream_id: int, status: int, headers: list, body: bytes,
                trailers: list | None = None, extra=()) -> None:
        """A complete response in one call (errors, JSON bodies). To a HEAD request: the
        headers only, with the content-length the body would have. `extra`: as in
        `start_response` (the content-length follows them)."""
        self.start_response(stream_id, status, headers, (*extra, (b"content-length", b"%d" % len(body))))
        if body and self.streams[stream_id].method != "HEAD":
            self.send_data(stream_id, body)
        self.end_response(stream_id, trailers)

    def fail_response(self, stream_id: int, status: int, headers: list, body: bytes, extra=()) -> bool:
        """The app cannot complete this stream's response (writing it raised): one not started
        is answered `status` with `body`; one started is reset with INTERNAL_ERROR, so the
        client never takes what it got for a whole response (RFC 9113 8.1); a stream the
        response no longer holds (reset, or ended) is left alone. -> whether `status` was sent."""
        st = self.streams.get(stream_id)
        if st is None:
            return False
        if not st.started:
            self.respond(stream_id, status, headers, body, extra=extra)
            return True
        self.reset_stream(stream_id, ErrorCodes.INTERNAL_ERROR)
        return False

    def reset_stream(self, stream_id: int, error_code: int = ErrorCodes.CANCEL) -> None:
        if stream_id in self.streams:
            self._reset(stream_id, error_code)
            self._maybe_goaway()

    def begin_shutdown(self) -> None:
        """Graceful shutdown: serve the open streams, refuse new ones, GOAWAY once the open ones end."""
        if self.goaway_last_id is not None or self.closed:
            return
        self.goaway_last_id = self.highest_stream_id
        self._maybe_goaway(served_any=bool(self.streams))

    def _maybe_goaway(self, served_any: bool = True) -> None:
        """Once the last in-flight stream ended: PING, then GOAWAY on its ACK (see the module docstring)."""
        if self.goaway_last_id is None or self.streams or self.goaway_sent or self._drain_pinged:
            return
        if served_any:
            self._drain_pinged = True
            self.conn.ping(DRAIN_PING)
            self._drain_h2()
        else:
            self._send_goaway(self.goaway_last_id, ErrorCodes.NO_ERROR)

    def _send_goaway(self, last_stream_id: int, code: ErrorCodes) -> None:
        self.goaway_sent = True
        self._out.append(GOAWAY.pack(0, 8, TYPE_GOAWAY, 0, 0, last_stream_id, code))

    @property
    def num_active_streams(self) -> int:
        return len(self.streams)

    @property
    def wants_close(self) -> bool:
        """True when the transport should be closed once `data_to_send()` is written."""
        return self.closed or self.goaway_sent or (self.peer_goaway and not self.streams)

    def window_for(self, stream_id: int) -> int:
        """Bytes the stream may send now (both windows), for tests and diagnostics."""
        return min(self.send_window, self.streams[stream_id].send_window)

    # -------------------------------------------------------------- internals

    def _decode(self, block: bytes) -> list:
        """HPACK-decode a block that is not a new request's (trailers, or one we will refuse)."""
        try:
            return self.decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError as exc:
            raise ConnectionError_(ErrorCodes.ENHANCE_YOUR_CALM, str(exc)) from None
        except (hpack.HPACKError, IndexError, TypeError) as exc:
            raise ConnectionError_(ErrorCodes.COMPRESSION_ERROR, f"header block does not decode: {exc}") from None

    def _decode_request(self, block: bytes) -> tuple:
        try:
            return self.decoder.decode_request(block)
        except hpack.OversizedHeaderListError as exc:
            raise ConnectionError_(ErrorCodes.ENHANCE_YOUR_CALM, str(exc)) from None
        except (hpack.HPACKError, IndexError, TypeError) as exc:
            raise ConnectionError_(ErrorCodes.COMPRESSION_ERROR, f"header block does not decode: {exc}") from None

    def _hand_back_connection_window(self) -> None:
        n = self._recv_unacked
        self._recv_unacked = 0
        self._recv_window += n
        self._out.append(WINDOW_UPDATE_FRAME.pack(0, 4, WINDOW_UPDATE, 0, 0, n))
        self.num_control_frames += 1

    def _drain_h2(self) -> bool:
        data = self.conn.data_to_send()
        if data:
            self._out.append(data)
        return bool(data)

    def _drain_stream(self, st: _Stream) -> None:
        """Send as much of the stream's queue as both windows and the frame size allow."""
        pending = st.pending
        num_sent = 0
        while pending:
            n = min(len(pending), self.send_window, st.send_window, self.max_frame_size)
            if n <= 0:
                break
            self.send_window -= n
            st.send_window -= n
            self._out.append(DATA_HEADER.pack(n >> 16, n & 0xFFFF, 0, 0, st.id))
            self._out.append(bytes(pending[:n]))
            del pending[:n]
            num_sent += n
        self.num_pending_bytes -= num_sent
        if num_sent and pending:
            st.stalled_ns = time.monotonic_ns()     # progress: the write timeout starts over
        if pending:
            self._blocked.pop(st.id, None)
            self._blocked[st.id] = st       # to the back: the others get the next window first
        else:
            self._blocked.pop(st.id, None)
            if st.end_after is not None:
                self._finish(st)

    def _drain_blocked(self) -> None:
        for st in list(self._blocked.values()):
            if self.send_window <= 0:
                break
            if st.id in self.streams:
                self._drain_stream(st)

    def _finish(self, st: _Stream) -> None:
        """END_STREAM: on the trailers' HEADERS frame, or on an empty DATA frame."""
        del self.streams[st.id]
        if st.end_after:
            self._send_headers(st, None, st.end_after, END_STREAM)
        else:
            self._out.append(FRAME_HEADER.pack(0, 0, DATA, END_STREAM, st.id))
        if transition(st, SEND_END_STREAM) == CLOSED:
            self._close(st, CLOSED_BY_END)
        else:       # answered while the request still comes (413, a gRPC status): stop it (RFC 9113 8.1)
            self._reset(st.id, ErrorCodes.NO_ERROR)
        self._maybe_goaway()

    _handlers = (_on_data, _on_headers, _on_priority, _on_rst_stream, _on_settings, _on_push_promise,
                 _on_ping, _on_goaway, _on_window_update, _on_continuation)


def _unpad(data: bytes, start: int, stop: int) -> tuple:
    """(start, stop) of a padded frame's content (RFC 9113 6.1): padding as long as the payload is an error."""
    if start == stop:
        raise ConnectionError_(ErrorCodes.FRAME_SIZE_ERROR, "padded frame without its pad length")
    pad = data[start]
    if pad >= stop - start:
        raise ConnectionError_(ErrorCodes.PROTOCOL_ERROR, "padding as long as the frame")
    return start + 1, stop - pad


def _code_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return str(code)


def _initial_window(limits: Limits) -> int:
    """Our SETTINGS_INITIAL_WINDOW_SIZE: the largest body we accept, and never below the default,
    since a client may send 65535 bytes before it sees our SETTINGS."""
    return min(max(limits.max_body_bytes, 65535), MAX_WINDOW)


def _local_settings(limits: Limits) -> h2.settings.Settings:
    return h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _initial_window(limits),
    })
