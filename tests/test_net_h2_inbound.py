"""The session's own inbound HTTP/2 stream layer (net/protocol/http2.py) against h2.

1. Differential: a real h2 client does what hypothesis chooses (requests with random
   fields, bodies in padded DATA frames, CONTINUATION, trailers, resets, window updates,
   priorities, pings, settings changes, on interleaved streams); the same bytes, cut at
   random points, go to our session and to h2's own server connection. Both must see the
   same requests with the same bodies, the same resets and no error; and the client's view
   of its send windows must equal the session's receive windows, byte for byte.
2. One test per RFC 9113 error case the session handles itself: crafted frames, the exact
   RST_STREAM or GOAWAY that must come back, and where h2 answers the same way, h2's answer
   too. Where RFC 9113 asks for a stream error and h2 ends the connection, the test says so.
"""

import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import pytest
from h2.errors import ErrorCodes
from h2.stream import StreamState
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tokenwire.net.protocol.events import BodyTooLarge, ConnectionClosed, Limits, Request, StreamReset
from tokenwire.net.protocol.http2 import CONNECTION_WINDOW, H2Session
from tokenwire.net.protocol.request_headers import MalformedRequest, split_headers

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
BASE = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"), (":authority", "localhost")]


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">BHBBI", len(payload) >> 16, len(payload) & 0xFFFF, ftype, flags, sid) + payload


def frames(raw: bytes):
    i, out = 0, []
    while i < len(raw):
        length = int.from_bytes(raw[i:i + 3], "big")
        out.append((raw[i + 3], raw[i + 4], int.from_bytes(raw[i + 5:i + 9], "big") & 0x7FFFFFFF,
                    raw[i + 9:i + 9 + length]))
        i += 9 + length
    return out


def sent_resets(raw: bytes) -> list:
    return [(sid, struct.unpack(">I", p)[0]) for t, _, sid, p in frames(raw) if t == 3]


def sent_goaway(raw: bytes):
    """(last stream id, error code) of the GOAWAY in `raw`, or None."""
    for t, _, _, p in frames(raw):
        if t == 7:
            return struct.unpack(">II", p[:8])
    return None


def normalized(events) -> list:
    out = []
    for ev in events:
        if type(ev) is Request:
            out.append(("request", ev.stream_id, ev.method, ev.target, ev.headers, ev.body))
        elif type(ev) is BodyTooLarge:
            out.append(("too_large", ev.stream_id))
        elif type(ev) is StreamReset:
            out.append(("reset", ev.stream_id))
        elif type(ev) is ConnectionClosed:
            out.append(("closed",))
    return out


class Reference:
    """h2's server connection, its events put into the session's vocabulary (header checks by
    the same split_headers, bodies against the same limit). Never answers a request."""

    def __init__(self, limits: Limits):
        config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: max(limits.max_body_bytes, 65535)})
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.conn.data_to_send()
        self.limits = limits
        self.open = {}          # stream id -> [method, target, headers, body, too large]
        self.events = []
        self.error = None
        self.out = b""

    def receive(self, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            evs = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.error = exc.error_code
            evs = []
        first = len(self.events)
        for ev in evs:
            self._event(ev)
        self._withdraw_reset_requests(first)
        self.out += self.conn.data_to_send()

    def _withdraw_reset_requests(self, first: int) -> None:
        """The session's rule that h2 does not have: a request whose stream is reset within
        the same read is withdrawn (neither it nor the reset reaches the app)."""
        read = self.events[first:]
        gone = {e[1] for e in read if e[0] == "reset"} & {e[1] for e in read if e[0] == "request"}
        if gone:
            self.events[first:] = [e for e in read if not (e[0] in ("request", "reset") and e[1] in gone)]

    def _event(self, ev) -> None:
        if isinstance(ev, h2.events.RequestReceived):
            try:
                method, target, headers, _ = split_headers(ev.headers)
            except MalformedRequest:
                self.conn.reset_stream(ev.stream_id, ErrorCodes.PROTOCOL_ERROR)
                return
            self.open[ev.stream_id] = [method, target, headers, b"", False]
        elif isinstance(ev, h2.events.DataReceived):
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            req = self.open.get(ev.stream_id)
            if req is None or req[4]:
                return
            if len(req[3]) + len(ev.data) > self.limits.max_body_bytes:
                req[4] = True
                self.events.append(("too_large", ev.stream_id))
            else:
                req[3] += ev.data
        elif isinstance(ev, h2.events.StreamEnded):
            req = self.open.get(ev.stream_id)
            if req is not None and not req[4]:
                self.events.append(("request", ev.stream_id, *req[:4]))
                req[3] = b""
        elif isinstance(ev, h2.events.StreamReset) and ev.remote_reset:
            if self.open.pop(ev.stream_id, None) is not None:
                self.events.append(("reset", ev.stream_id))


# ------------------------------------------------------------ differential

FIELDS = [("content-type", "application/json"), ("accept", "text/event-stream"), ("cookie", "a=1"),
          ("cookie", "b=2"), ("x-trace", "abc"), ("x-trace", "def"), ("authorization", "Bearer k"),
          ("user-agent", "hypothesis/1.0"), ("x-big", "v" * 17000)]
BIG = len(FIELDS) - 1           # a block over 16 KiB: HEADERS + CONTINUATION

open_action = st.tuples(st.just("open"), st.lists(st.sampled_from(range(len(FIELDS))), max_size=4),
                        st.text("abcxyz019-", max_size=12), st.booleans(), st.booleans())
data_action = st.tuples(st.just("data"), st.integers(0, 7), st.integers(0, 3000), st.integers(0, 40), st.booleans())
action = st.one_of(
    open_action, open_action, data_action, data_action, data_action,
    st.tuples(st.just("trailers"), st.integers(0, 7)),
    st.tuples(st.just("reset"), st.integers(0, 7)),
    st.tuples(st.just("window"), st.integers(0, 8), st.integers(1, 100_000)),
    st.tuples(st.just("priority"), st.integers(0, 7), st.integers(1, 256)),
    st.tuples(st.just("ping")),
    st.tuples(st.just("settings"), st.sampled_from([0, 1, 100, 65535, 1 << 20])),
    st.tuples(st.just("deliver"), st.integers(1, 200)),
)


def _client_act(c, act, opened):
    """One client action through h2's client API, on streams where it is legal (h2 closes a
    stream on an illegal input, so nothing illegal is tried)."""
    kind = act[0]
    live = [sid for sid in opened if sid in c.streams and not c.streams[sid].closed]
    sending = [sid for sid in live if c.streams[sid].state_machine.state == StreamState.OPEN]
    if kind == "open":
        _, picks, value, end_stream, weighted = act
        sid = c.get_next_available_stream_id()
        headers = BASE + [FIELDS[i] for i in picks] + [("x-value", value)]
        weighted = weighted and BIG not in picks        # h2's client cannot split a block with priority
        c.send_headers(sid, headers, end_stream=end_stream, priority_weight=16 if weighted else None)
        opened.append(sid)
    elif kind == "data" and sending:
        sid = sending[act[1] % len(sending)]
        size = min(act[2], c.local_flow_control_window(sid))
        pad = min(act[3], 255) if size + act[3] + 1 <= c.max_outbound_frame_size else 0
        c.send_data(sid, bytes([sid & 0xFF]) * size, end_stream=act[4], pad_length=pad or None)
    elif kind == "trailers" and sending:
        c.send_headers(sending[act[1] % len(sending)], [("x-checksum", "0")], end_stream=True)
    elif kind == "reset" and live:
        c.reset_stream(live[act[1] % len(live)])
    elif kind == "window":
        sid = live[act[1] % len(live)] if live and act[1] < 8 else 0
        if act[2] + (c.inbound_flow_control_window if not sid else 0) < 2**31 - 1 - 2**24:
            c.increment_flow_control_window(act[2], stream_id=sid or None)
    elif kind == "priority" and live:
        c.prioritize(live[act[1] % len(live)], weight=act[2])
    elif kind == "ping":
        c.ping(b"12345678")
    elif kind == "settings":
        c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: act[1]})


@example([("open", [BIG] * 4, "", False, False)], [1], 200)    # 68 KB of fields: both end the connection
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.tuples(open_action, st.lists(action, max_size=60)).map(lambda t: [t[0], *t[1]]), st.lists(st.integers(1, 600), min_size=1, max_size=20),
       st.sampled_from([200, 4096, 1 << 20]))
def test_same_requests_bodies_and_resets_as_h2(actions, cuts, max_body):
    limits = Limits(max_body_bytes=max_body, max_concurrent_streams=100)
    s, ref = H2Session(limits), Reference(limits)
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    c.initiate_connection()
    c.receive_data(s.data_to_send())            # our SETTINGS and connection window
    ours, opened, sent, ours_out, k = [], [], b"", b"", 0

    def deliver():
        nonlocal sent, ours_out, k
        raw = c.data_to_send()
        sent += raw
        i = 0
        while i < len(raw):                     # the same bytes, cut where hypothesis says, to both:
            n = cuts[k % len(cuts)]             # what one read brings decides a withdrawn request
            k += 1
            ref.receive(raw[i:i + n])
            ours.extend(s.receive_data(raw[i:i + n]))
            i += n
        back = s.data_to_send()
        ours_out += back
        if back:
            c.receive_data(back)                # our ACKs and WINDOW_UPDATEs keep the client going

    for act in actions:
        if c.state_machine.state == h2.connection.ConnectionState.CLOSED:
            break                               # the server ended the connection (a header list too big)
        if act[0] == "deliver":
            deliver()
        else:
            _client_act(c, act, opened)
    deliver()
    for sid in opened:                          # finish every request still being sent
        if (c.state_machine.state != h2.connection.ConnectionState.CLOSED and sid in c.streams
                and c.streams[sid].state_machine.state == StreamState.OPEN):
            c.end_stream(sid)
    deliver()
    deliver()
    if ref.error is not None or s.closed:      # both end the connection, for the same reason
        assert goaway_code(ours_out) == ref.error == ErrorCodes.ENHANCE_YOUR_CALM
        assert normalized(ours)[:-1] == ref.events and normalized(ours)[-1] == ("closed",)
        return
    assert normalized(ours) == ref.events
    event(f"{sum(e[0] == 'request' for e in ref.events)} requests, {sum(e[0] != 'request' for e in ref.events)} "
          "too large or reset")
    assert sent_resets(ref.out) == []
    # inbound flow control is exact: what the client may still send is what we still accept
    assert c.outbound_flow_control_window == s._recv_window
    for sid, stream in s._open.items():
        assert sid in c.streams and c.streams[sid].outbound_flow_control_window == stream.recv_window


# ------------------------------------------------------------ RFC 9113 error cases

def connected(limits: Limits | None = None):
    """Our session and h2's, both past the preface and SETTINGS; -> (session, reference, hpack encoder)."""
    limits = limits or Limits()
    s, ref = H2Session(limits), Reference(limits)
    hello = PREFACE + frame(4, 0, 0)
    s.receive_data(hello)
    ref.receive(hello)
    s.data_to_send()
    ref.out = b""
    return s, ref, hpack.Encoder()


def request_block(enc, extra=()) -> bytes:
    return enc.encode([(b":method", b"POST"), (b":path", b"/x"), (b":scheme", b"http"),
                       (b":authority", b"a"), *extra])


def both(s, ref, raw: bytes):
    """Feed raw frames to both; -> (our events, our output, h2's error code or None, h2's output)."""
    events = s.receive_data(raw)
    ref.receive(raw)
    return events, s.data_to_send(), ref.error, ref.out


def goaway_code(out: bytes):
    g = sent_goaway(out)
    return None if g is None else g[1]


def open_request(s, ref, enc, sid=1, end_stream=False, extra=()):
    flags = 0x4 | (0x1 if end_stream else 0)
    return both(s, ref, frame(1, flags, sid, request_block(enc, extra)))


# (name, setup: opens these streams with END_STREAM?, frames, expected ours, h2 agrees)
#   expected: ("goaway", code) or ("rst", stream, code) or ("ignored",)
CASES = [
    ("data on an idle stream", [], lambda e: frame(0, 1, 5, b"x"), ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("headers on an even stream", [], lambda e: frame(1, 5, 2, request_block(e)),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("headers below the last stream opened", [(3, True)], lambda e: frame(1, 5, 1, request_block(e)),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("data on a half-closed (remote) stream", [(1, True)], lambda e: frame(0, 0, 1, b"late"),
     ("rst", 1, ErrorCodes.STREAM_CLOSED), True),
    ("headers on a half-closed (remote) stream", [(1, True)], lambda e: frame(1, 5, 1, e.encode([(b"x", b"y")])),
     ("rst", 1, ErrorCodes.STREAM_CLOSED), True),
    ("header block interrupted", [], lambda e: frame(1, 0, 1, request_block(e)) + frame(8, 0, 0, b"\0\0\0\1"),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("continuation on another stream", [], lambda e: frame(1, 0, 1, request_block(e)) + frame(9, 4, 3, b""),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("padding as long as the frame", [(1, False)], lambda e: frame(0, 0x8, 1, b"\x05abcd"),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("frame over SETTINGS_MAX_FRAME_SIZE", [(1, False)], lambda e: frame(0, 0, 1, bytes(16385)),
     ("goaway", ErrorCodes.FRAME_SIZE_ERROR), True),
    ("rst_stream of 3 bytes", [(1, False)], lambda e: frame(3, 0, 1, b"\0\0\0"),
     ("goaway", ErrorCodes.FRAME_SIZE_ERROR), True),
    ("rst_stream on an idle stream", [], lambda e: frame(3, 0, 7, b"\0\0\0\x08"),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("rst_stream on stream 0", [], lambda e: frame(3, 0, 0, b"\0\0\0\x08"), ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("window_update of 0 on the connection", [], lambda e: frame(8, 0, 0, b"\0\0\0\0"),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("connection window over 2**31-1", [], lambda e: frame(8, 0, 0, struct.pack(">I", 2**31 - 1)),
     ("goaway", ErrorCodes.FLOW_CONTROL_ERROR), True),
    ("window_update of 5 bytes", [(1, False)], lambda e: frame(8, 0, 1, b"\0\0\0\1\0"),
     ("goaway", ErrorCodes.FRAME_SIZE_ERROR), True),
    ("window_update on an idle stream", [], lambda e: frame(8, 0, 9, b"\0\0\0\1"), ("goaway", ErrorCodes.PROTOCOL_ERROR),
     True),
    ("push_promise from a client", [(1, False)], lambda e: frame(5, 4, 1, b"\0\0\0\2" + e.encode([(b"a", b"b")])),
     ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("priority on stream 0", [], lambda e: frame(2, 0, 0, b"\0\0\0\1\x10"), ("goaway", ErrorCodes.PROTOCOL_ERROR), True),
    ("priority on an idle stream", [], lambda e: frame(2, 0, 11, b"\0\0\0\1\x10"), ("ignored",), True),
    ("unknown frame type", [(1, False)], lambda e: frame(0xEE, 0xFF, 1, b"whatever"), ("ignored",), True),
    ("window_update on a closed stream", [], lambda e: b"", ("ignored",), True),
    ("undecodable header block", [], lambda e: frame(1, 5, 1, b"\xff\xff\xff\xff\xff"),
     ("goaway", ErrorCodes.COMPRESSION_ERROR), False),          # h2: PROTOCOL_ERROR; RFC 9113 4.3
    ("goaway of 4 bytes", [], lambda e: frame(7, 0, 0, b"\0\0\0\0"), ("goaway", ErrorCodes.FRAME_SIZE_ERROR), True),
    # RFC 9113 asks for a stream error where h2 ends the connection:
    ("window_update of 0 on a stream", [(1, False)], lambda e: frame(8, 0, 1, b"\0\0\0\0"),
     ("rst", 1, ErrorCodes.PROTOCOL_ERROR), False),
    ("stream window over 2**31-1", [(1, False)], lambda e: frame(8, 0, 1, struct.pack(">I", 2**31 - 1)),
     ("rst", 1, ErrorCodes.FLOW_CONTROL_ERROR), True),
    ("priority of 4 bytes", [(1, False)], lambda e: frame(2, 0, 1, b"\0\0\0\3"),
     ("rst", 1, ErrorCodes.FRAME_SIZE_ERROR), False),
    ("stream depending on itself", [(1, False)], lambda e: frame(2, 0, 1, b"\0\0\0\1\x10"),
     ("rst", 1, ErrorCodes.PROTOCOL_ERROR), False),
    ("trailers without END_STREAM", [(1, False)], lambda e: frame(1, 4, 1, e.encode([(b"x-t", b"1")])),
     ("rst", 1, ErrorCodes.PROTOCOL_ERROR), False),
    ("trailers with a pseudo-header", [(1, False)], lambda e: frame(1, 5, 1, e.encode([(b":path", b"/")])),
     ("rst", 1, ErrorCodes.PROTOCOL_ERROR), False),
    ("body longer than content-length", [], lambda e: frame(1, 4, 1, request_block(e, [(b"content-length", b"2")]))
     + frame(0, 1, 1, b"abc"), ("rst", 1, ErrorCodes.PROTOCOL_ERROR), False),
    ("body shorter than content-length", [], lambda e: frame(1, 4, 1, request_block(e, [(b"content-length", b"9")]))
     + frame(0, 1, 1, b"abc"), ("rst", 1, ErrorCodes.PROTOCOL_ERROR), False),
]


@pytest.mark.parametrize("name,setup,make,expected,h2_agrees", CASES, ids=[c[0] for c in CASES])
def test_rfc9113_error_case(name, setup, make, expected, h2_agrees):
    s, ref, enc = connected()
    for sid, end_stream in setup:
        open_request(s, ref, enc, sid, end_stream)
    ref.out = b""
    raw = make(enc)
    if name == "window_update on a closed stream":       # a stream we finished: updates may still come
        open_request(s, ref, enc, 1, True)
        s.respond(1, 200, [], b"ok")
        s.data_to_send()
        raw = frame(8, 0, 1, b"\0\0\0\x10")
    events, out, ref_error, ref_out = both(s, ref, raw)
    if expected[0] == "goaway":
        assert goaway_code(out) == expected[1] and s.closed and s.wants_close
        assert [type(e) for e in events] == [ConnectionClosed]
        if h2_agrees:
            assert ref_error == expected[1]
        else:
            assert ref_error != expected[1]
    elif expected[0] == "rst":
        assert sent_resets(out) == [expected[1:]] and not s.closed
        assert expected[1] not in s._open
        if h2_agrees:
            assert ref_error is None and sent_resets(ref_out) == [expected[1:]]
        else:               # h2 ends the connection, or lets the malformed request through
            assert ref_error is not None or sent_resets(ref_out) == []
    else:
        assert out == b"" and not s.closed and events == []
        assert ref_error is None and sent_resets(ref_out) == []
    # after a stream error the connection goes on
    if expected[0] != "goaway":
        nxt = 101
        (ev,) = s.receive_data(frame(1, 5, nxt, request_block(enc)))
        assert type(ev) is Request and ev.stream_id == nxt


def test_first_frame_after_the_preface_must_be_settings():
    s = H2Session(Limits())
    events = s.receive_data(PREFACE + frame(6, 0, 0, bytes(8)))
    assert [type(e) for e in events] == [ConnectionClosed]
    assert goaway_code(s.data_to_send()) == ErrorCodes.PROTOCOL_ERROR


def test_bad_preface_is_a_protocol_error():
    s = H2Session(Limits())
    assert [type(e) for e in s.receive_data(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")] == [ConnectionClosed]
    assert goaway_code(s.data_to_send()) == ErrorCodes.PROTOCOL_ERROR


def test_data_after_our_reset_is_ignored_but_counted_against_the_connection_window():
    s, ref, enc = connected(Limits(max_concurrent_streams=1))
    open_request(s, ref, enc, 1)
    events, out, _, _ = both(s, ref, frame(1, 4, 3, request_block(enc)))     # one stream too many
    assert sent_resets(out) == [(3, ErrorCodes.REFUSED_STREAM)]
    window = s._recv_window
    events, out, _, _ = both(s, ref, frame(0, 1, 3, b"x" * 1000))
    assert events == [] and out == b"" and s._recv_window == window - 1000


def test_refused_streams_still_feed_the_hpack_table():
    """A stream refused for the concurrency limit had its block decoded: the next block, which
    refers to the dynamic entry that one added, still decodes to the same fields."""
    s, ref, enc = connected(Limits(max_concurrent_streams=1))
    open_request(s, ref, enc, 1, True)
    s.receive_data(frame(1, 5, 3, request_block(enc, [(b"x-id", b"seven")])))      # refused; x-id enters the table
    assert sent_resets(s.data_to_send()) == [(3, ErrorCodes.REFUSED_STREAM)]
    s.data_to_send()
    s.respond(1, 200, [], b"")
    (ev,) = s.receive_data(frame(1, 5, 5, request_block(enc, [(b"x-id", b"seven")])))
    assert ev.headers["x-id"] == "seven"


def test_trailers_end_the_request_and_are_not_part_of_it():
    s, ref, enc = connected()
    open_request(s, ref, enc, 1)
    s.receive_data(frame(0, 0, 1, b"{}"))
    (ev,) = s.receive_data(frame(1, 5, 1, enc.encode([(b"x-checksum", b"0")])))
    assert type(ev) is Request and ev.body == b"{}" and "x-checksum" not in ev.headers


def test_continuation_frames_and_padding_carry_a_request():
    s, ref, enc = connected()
    block = request_block(enc, [(b"x-long", b"L" * 300)])
    parts = [block[:100], block[100:250], block[250:]]
    raw = (frame(1, 0x8 | 0x20, 1, b"\x03" + b"\0\0\0\0\x0f" + parts[0] + b"pad") + frame(9, 0, 1, parts[1])
           + frame(9, 4, 1, parts[2]) + frame(0, 0x8, 1, b"\x02{}zz") + frame(0, 1, 1, b""))
    for cut in (len(raw), 7, 1):        # whole, in pieces, byte by byte
        s, ref, enc = connected()
        block = request_block(enc, [(b"x-long", b"L" * 300)])
        events = []
        for i in range(0, len(raw), cut):
            events += s.receive_data(raw[i:i + cut])
        (ev,) = events
        assert ev.headers["x-long"] == "L" * 300 and ev.body == b"{}"
        ref.receive(raw)
        assert ref.events == normalized(events)


def test_window_updates_are_batched_and_exact():
    """Request bodies come back to the client as connection window in one WINDOW_UPDATE per read,
    once half the window is used, and never per DATA frame."""
    s, ref, enc = connected(Limits(max_body_bytes=1 << 20, max_concurrent_streams=1000))
    total, updates, sid = 0, [], 1
    chunk = b"x" * 16000
    while total < CONNECTION_WINDOW * 3 // 4:
        raw = frame(1, 4, sid, request_block(enc)) + b"".join(frame(0, 0, sid, chunk) for _ in range(8)) \
            + frame(0, 1, sid, b"")
        events = s.receive_data(raw)
        assert [type(e) for e in events] == [Request] and len(events[0].body) == 8 * len(chunk)
        total += 8 * len(chunk)
        out = frames(s.data_to_send())
        updates += [struct.unpack(">I", p)[0] for t, _, i, p in out if t == 8 and i == 0]
        s.respond(sid, 200, [], b"")
        s.data_to_send()
        sid += 2
    assert len(updates) == 1 and CONNECTION_WINDOW // 2 <= updates[0] < CONNECTION_WINDOW // 2 + 8 * len(chunk)
    assert s._recv_window == CONNECTION_WINDOW - total + updates[0]


def test_data_beyond_the_stream_window_is_a_flow_control_error():
    s, ref, enc = connected(Limits(max_body_bytes=100_000))      # stream window: 100 000 bytes
    open_request(s, ref, enc, 1)
    events = s.receive_data(b"".join(frame(0, 0, 1, bytes(16384)) for _ in range(7)))
    assert [type(e) for e in events] == [ConnectionClosed]
    assert goaway_code(s.data_to_send()) == ErrorCodes.FLOW_CONTROL_ERROR


def test_a_discarded_body_gets_its_stream_window_back_in_batches():
    """413 bodies: the client may finish sending, the window comes back every half window."""
    s, ref, enc = connected(Limits(max_body_bytes=10))           # stream window: the 65535 minimum
    open_request(s, ref, enc, 1)
    events = s.receive_data(b"".join(frame(0, 0, 1, bytes(16384)) for _ in range(3)))
    assert [type(e) for e in events] == [BodyTooLarge]
    updates = [(sid, struct.unpack(">I", p)[0]) for t, _, sid, p in frames(s.data_to_send()) if t == 8]
    assert updates == [(1, 3 * 16384)]                      # one per read, once half the window is used
    events = s.receive_data(b"".join(frame(0, 0, 1, bytes(16384)) for _ in range(3)) + frame(0, 1, 1, b""))
    assert events == []
    updates = [(sid, struct.unpack(">I", p)[0]) for t, _, sid, p in frames(s.data_to_send()) if t == 8]
    assert updates == []                                    # the stream ended: the rest is not handed back


def test_data_beyond_the_connection_window_is_a_flow_control_error():
    s, ref, enc = connected(Limits(max_body_bytes=1 << 30, max_concurrent_streams=1000))
    raw, sid, n = b"", 1, 0
    while n <= CONNECTION_WINDOW:
        raw += frame(1, 4, sid, request_block(enc)) + b"".join(frame(0, 0, sid, bytes(16384)) for _ in range(64))
        n += 64 * 16384
        sid += 2
    events = s.receive_data(raw)
    assert ConnectionClosed in [type(e) for e in events]
    assert goaway_code(s.data_to_send()) == ErrorCodes.FLOW_CONTROL_ERROR


def test_peer_initial_window_change_moves_every_open_stream_and_overflow_is_an_error():
    s, ref, enc = connected()
    open_request(s, ref, enc, 1, True)
    open_request(s, ref, enc, 3, True)
    s.receive_data(frame(4, 0, 0, struct.pack(">HI", 4, 1000)))
    assert s.window_for(1) == s.window_for(3) == 1000
    s.receive_data(frame(8, 0, 1, struct.pack(">I", 2**31 - 1 - 1000)))
    assert s.streams[1].send_window == 2**31 - 1
    events = s.receive_data(frame(4, 0, 0, struct.pack(">HI", 4, 1001)))
    assert [type(e) for e in events] == [ConnectionClosed]
    assert goaway_code(s.data_to_send()) == ErrorCodes.FLOW_CONTROL_ERROR


def test_client_reset_of_a_held_stream_is_reported_and_of_a_closed_one_ignored():
    s, ref, enc = connected()
    open_request(s, ref, enc, 1, True)
    open_request(s, ref, enc, 3, True)
    s.respond(3, 200, [], b"done")
    s.data_to_send()
    assert s.receive_data(frame(3, 0, 1, struct.pack(">I", 8))) == [StreamReset(1)]
    assert s.receive_data(frame(3, 0, 3, struct.pack(">I", 8))) == []
    assert s.data_to_send() == b"" and not s.closed


def test_stream_error_on_a_held_stream_tells_the_app():
    s, ref, enc = connected()
    open_request(s, ref, enc, 1, True)
    events = s.receive_data(frame(8, 0, 1, b"\0\0\0\0"))
    assert events == [StreamReset(1)] and 1 not in s.streams
