"""Sans-IO tests of the HTTP/2 and HTTP/1.1 sessions: bytes in, exact events and bytes out.

The peer is a real client-side h2 (or h11) connection in memory; no sockets, no event loop.
"""

import base64
import collections
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from h2.errors import ErrorCodes

from tokenwire.net.protocol.events import (
    BodyTooLarge,
    ConnectionClosed,
    Limits,
    Request,
    StreamReset,
    UpgradeRequested,
)
from tokenwire.net.protocol.http1 import H1Session
from tokenwire.net.protocol.http2 import H2Session

REQUEST_HEADERS = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                   (":authority", "localhost"), ("content-type", "application/json")]


def client(window: int | None = None, **settings) -> h2.connection.H2Connection:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    c.initiate_connection()
    if window is not None:
        settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE] = window
    if settings:
        c.update_settings(settings)
    return c


def handshake(c, s, streams=(1,), body=b"{}"):
    """Open `streams` with a complete request each; returns the server's Request events."""
    for sid in streams:
        c.send_headers(sid, REQUEST_HEADERS)
        c.send_data(sid, body, end_stream=True)
    events = s.receive_data(c.data_to_send())
    pump(c, s)
    return events


def pump(c, s):
    """Exchange bytes until quiet; returns the client's h2 events."""
    got = []
    for _ in range(1000):
        out = s.data_to_send()
        if not out:
            return got
        got += c.receive_data(out)
        back = c.data_to_send()
        if back:
            s.receive_data(back)
    raise AssertionError("the session never went quiet")


def data_by_stream(events):
    out = {}
    for ev in events:
        if isinstance(ev, h2.events.DataReceived):
            out[ev.stream_id] = out.get(ev.stream_id, b"") + ev.data
    return out


def frames(raw: bytes):
    """Split raw HTTP/2 bytes into (type, flags, stream, payload)."""
    i, out = 0, []
    while i < len(raw):
        length = int.from_bytes(raw[i:i + 3], "big")
        ftype, flags = raw[i + 3], raw[i + 4]
        sid = int.from_bytes(raw[i + 5:i + 9], "big") & 0x7FFFFFFF
        out.append((ftype, flags, sid, raw[i + 9:i + 9 + length]))
        i += 9 + length
    return out


# ---------------------------------------------------------------- HTTP/2

def test_request_event_carries_method_path_headers_body():
    s, c = H2Session(Limits()), client()
    (ev,) = handshake(c, s, body=b'{"prompt": "hi"}')
    assert type(ev) is Request
    assert (ev.stream_id, ev.method, ev.target, ev.body) == (1, "POST", "/v1/completions", b'{"prompt": "hi"}')
    assert ev.headers == {"host": "localhost", "content-type": "application/json"}
    assert ev.arrived_ns > 0


def test_data_frame_bytes_are_exact():
    s, c = H2Session(Limits()), client()
    handshake(c, s)
    s.start_response(1, 200, [(b"content-type", b"text/event-stream")])
    s.data_to_send()
    s.send_data(1, b"hello")
    s.send_data(3 - 2, b"!")
    assert s.data_to_send() == b"\x00\x00\x05\x00\x00\x00\x00\x00\x01hello" + b"\x00\x00\x01\x00\x00\x00\x00\x00\x01!"


def test_response_headers_are_context_free_hpack():
    """HEADERS built here: static-table :status, literal fields, never the dynamic table."""
    s, c = H2Session(Limits()), client()
    handshake(c, s)
    s.start_response(1, 200, ((b"content-type", b"text/event-stream"), (b"x-a", b"b")))
    block = b"\x88" + b"\x0f\x10\x11text/event-stream" + b"\x00\x03x-a\x01b"
    raw = s.data_to_send()
    assert raw == struct.pack(">BHBBI", 0, len(block), 1, 4, 1) + block
    s.end_response(1, [(b"server-timing", b"t;dur=1")])
    events = c.receive_data(raw + s.data_to_send())
    assert [type(e) for e in events] == [h2.events.ResponseReceived, h2.events.TrailersReceived,
                                         h2.events.StreamEnded]
    assert events[0].headers == [(b":status", b"200"), (b"content-type", b"text/event-stream"), (b"x-a", b"b")]
    assert c.decoder.header_table.dynamic_entries == collections.deque()


def test_peer_table_size_change_is_announced_before_our_next_block():
    s, c = H2Session(Limits()), client()
    handshake(c, s, streams=(1, 3))
    s.respond(1, 200, [(b"content-type", b"application/json")], b"{}")
    c.receive_data(s.data_to_send())
    c.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    s.receive_data(c.data_to_send())
    s.respond(3, 404, [(b"content-type", b"application/json")], b"{}")
    events = c.receive_data(s.data_to_send())
    response = next(e for e in events if isinstance(e, h2.events.ResponseReceived))
    assert response.headers[0] == (b":status", b"404")
    assert s.conn.encoder.table_size_changes == []


def test_one_frame_per_send_and_trailers_after_last_data():
    s, c = H2Session(Limits()), client()
    handshake(c, s)
    s.start_response(1, 200, [(b"content-type", b"text/plain")])
    for i in range(5):
        s.send_data(1, b"tok%d" % i)
    s.end_response(1, [(b"server-timing", b"total;dur=1.5")])
    raw = s.data_to_send()
    kinds = [(t, f) for t, f, sid, _ in frames(raw)]
    assert kinds == [(1, 4)] + [(0, 0)] * 5 + [(1, 5)]   # HEADERS, 5 DATA, trailers (END_HEADERS|END_STREAM)
    events = c.receive_data(raw)
    assert data_by_stream(events) == {1: b"tok0tok1tok2tok3tok4"}
    trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert trailers[0].headers == [(b"server-timing", b"total;dur=1.5")]
    assert isinstance(events[-1], h2.events.StreamEnded)
    assert s.num_active_streams == 0


def test_one_byte_window_delivers_whole_stream_in_order():
    s, c = H2Session(Limits()), client(window=1)
    handshake(c, s)
    s.start_response(1, 200, [])
    payload = [b"chunk-%02d;" % i for i in range(20)]
    for p in payload:
        s.send_data(1, p)
    s.end_response(1, [(b"server-timing", b"x;dur=1")])
    received, ended = b"", False
    for _ in range(1000):
        raw = s.data_to_send()
        for ftype, _, sid, body in frames(raw):
            if ftype == 0:
                assert len(body) <= 1       # never more than the window
        for ev in c.receive_data(raw):
            if isinstance(ev, h2.events.DataReceived):
                received += ev.data
            ended = ended or isinstance(ev, h2.events.StreamEnded)
        if ended:
            break
        c.increment_flow_control_window(1, stream_id=1)
        s.receive_data(c.data_to_send())
    assert ended and received == b"".join(payload)


def test_connection_window_of_one_byte():
    """Consume the connection window down to 1 byte, then stream against it."""
    s, c = H2Session(Limits()), client(window=1_000_000)
    handshake(c, s)
    s.start_response(1, 200, [])
    s.send_data(1, b"x" * 16384)
    s.send_data(1, b"x" * 16384)
    s.send_data(1, b"x" * 16384)
    s.send_data(1, b"x" * 16382)
    c.receive_data(s.data_to_send())        # the client does not acknowledge: window stays at 1
    assert s.send_window == 1
    for i in range(10):
        s.send_data(1, b"%d" % i)
    s.end_response(1)
    got, ended = b"", False
    for _ in range(100):
        for ev in c.receive_data(s.data_to_send()):
            if isinstance(ev, h2.events.DataReceived):
                got += ev.data
            ended = ended or isinstance(ev, h2.events.StreamEnded)
        if ended:
            break
        c.increment_flow_control_window(1)   # connection-level only
        s.receive_data(c.data_to_send())
    assert ended and got.endswith(b"0123456789")


def test_stalled_stream_does_not_delay_others():
    s, c = H2Session(Limits()), client(window=0)
    handshake(c, s, streams=(1, 3, 5))
    c.increment_flow_control_window(10_000, stream_id=3)
    c.increment_flow_control_window(10_000, stream_id=5)
    s.receive_data(c.data_to_send())
    for sid in (1, 3, 5):
        s.start_response(sid, 200, [])
    for i in range(10):
        for sid in (1, 3, 5):
            s.send_data(sid, b"%d:%d;" % (sid, i))
    s.end_response(3)
    s.end_response(5)
    events = c.receive_data(s.data_to_send())
    got = data_by_stream(events)
    expected = {sid: b"".join(b"%d:%d;" % (sid, i) for i in range(10)) for sid in (3, 5)}
    assert got == expected                   # stream 1 (window 0) sent nothing and held nobody up
    ended = {e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)}
    assert ended == {3, 5}
    c.increment_flow_control_window(10_000, stream_id=1)
    s.receive_data(c.data_to_send())
    assert data_by_stream(c.receive_data(s.data_to_send())) == {1: b"".join(b"1:%d;" % i for i in range(10))}


def test_max_frame_size_splits_large_payloads():
    s, c = H2Session(Limits()), client()
    handshake(c, s)
    s.start_response(1, 200, [])
    s.data_to_send()
    s.send_data(1, bytes(40000))
    sizes = [len(body) for t, _, _, body in frames(s.data_to_send()) if t == 0]
    assert sizes == [16384, 16384, 40000 - 2 * 16384]


def test_peer_window_updates_never_overflow_h2_accounting():
    """Each DATA frame debits both send windows by its length; else these updates would overflow 2**31-1."""
    s, c = H2Session(Limits()), client()
    handshake(c, s)
    s.start_response(1, 200, [])
    c.increment_flow_control_window(2**31 - 1 - 65535)              # connection window to the maximum
    c.increment_flow_control_window(2**31 - 1 - 65535, stream_id=1)  # stream window to the maximum
    s.receive_data(c.data_to_send())
    assert s.window_for(1) == 2**31 - 1
    for _ in range(200):
        for _ in range(8):
            s.send_data(1, bytes(1000))
        c.receive_data(s.data_to_send())
        c.increment_flow_control_window(8000)
        c.increment_flow_control_window(8000, stream_id=1)
        events = s.receive_data(c.data_to_send())
        assert not any(isinstance(e, ConnectionClosed) for e in events)
        assert s.window_for(1) == 2**31 - 1
    s.end_response(1)
    assert isinstance(pump(c, s)[-1], h2.events.StreamEnded)


def test_window_shrink_by_settings_then_growth_drains_queue():
    s, c = H2Session(Limits()), client()
    handshake(c, s)
    s.start_response(1, 200, [])
    c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    s.receive_data(c.data_to_send())
    s.send_data(1, b"held")
    s.end_response(1)
    assert data_by_stream(c.receive_data(s.data_to_send())) == {}
    c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    s.receive_data(c.data_to_send())
    events = c.receive_data(s.data_to_send())
    assert data_by_stream(events) == {1: b"held"}
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


def test_rst_stream_reports_reset_and_drops_queue():
    s, c = H2Session(Limits()), client(window=0)
    handshake(c, s, streams=(1, 3))
    s.start_response(1, 200, [])
    s.send_data(1, b"queued")
    c.reset_stream(1, ErrorCodes.CANCEL)
    events = s.receive_data(c.data_to_send())
    assert events == [StreamReset(1)]
    assert 1 not in s.streams and s.num_active_streams == 1
    c.increment_flow_control_window(100, stream_id=3)
    s.receive_data(c.data_to_send())
    assert data_by_stream(c.receive_data(s.data_to_send())) == {}


def test_a_request_reset_in_the_same_read_never_reaches_the_app():
    """HEADERS, DATA (END_STREAM) and RST_STREAM in one read: the stream is closed before the
    app sees its Request, so the Request is withdrawn (no StreamReset either); the other
    request of the read and the connection go on."""
    s, c = H2Session(Limits()), client()
    s.receive_data(c.data_to_send())
    for sid in (1, 3):
        c.send_headers(sid, REQUEST_HEADERS)
        c.send_data(sid, b"{}", end_stream=True)
    c.reset_stream(1, ErrorCodes.CANCEL)
    events = s.receive_data(c.data_to_send())
    assert [type(e) for e in events] == [Request] and events[0].stream_id == 3
    assert 1 not in s.streams and 3 in s.streams
    s.start_response(3, 200, [])
    s.send_data(3, b"served")
    s.end_response(3)
    assert data_by_stream(c.receive_data(s.data_to_send())) == {3: b"served"}


def test_graceful_shutdown_finishes_inflight_refuses_new_then_goaway():
    s, c = H2Session(Limits()), client()
    handshake(c, s, streams=(1,))
    s.begin_shutdown()
    assert s.data_to_send() == b""            # GOAWAY waits for stream 1 (curl <= 8.0 truncates on GOAWAY)
    c.send_headers(3, REQUEST_HEADERS, end_stream=True)
    assert s.receive_data(c.data_to_send()) == []
    assert frames(s.data_to_send()) == [(3, 0, 3, struct.pack(">I", ErrorCodes.REFUSED_STREAM))]
    assert not s.wants_close
    s.start_response(1, 200, [])
    s.send_data(1, b"still served")
    s.end_response(1)
    raw = s.data_to_send()
    sent = frames(raw)
    assert [(t, sid) for t, _, sid, _ in sent] == [(1, 1), (0, 1), (0, 1), (6, 0)]   # ..., PING
    assert sent[1][3] == b"still served" and sent[2][1] == 1       # END_STREAM on the last DATA
    assert not s.wants_close
    # GOAWAY only once the PING's ACK shows the client read everything before it
    c.receive_data(raw)
    s.receive_data(c.data_to_send())
    assert s.data_to_send() == struct.pack(">BHBBIII", 0, 8, 7, 0, 0, 1, 0)   # GOAWAY, last stream 1, NO_ERROR
    assert s.wants_close


def test_shutdown_of_idle_connection_sends_goaway_at_once():
    s, c = H2Session(Limits()), client()
    handshake(c, s, streams=(1,))
    s.respond(1, 200, [], b"")
    s.data_to_send()
    s.begin_shutdown()
    assert s.data_to_send() == struct.pack(">BHBBIII", 0, 8, 7, 0, 0, 1, 0)
    assert s.wants_close


def test_peer_goaway_lets_inflight_streams_finish():
    """A client's GOAWAY(NO_ERROR) means no new streams; RFC 7540 6.8 lets open ones complete."""
    s, c = H2Session(Limits()), client()
    handshake(c, s, streams=(1,))
    c.close_connection()
    assert s.receive_data(c.data_to_send()) == []
    s.respond(1, 200, [], b"done")
    assert [(t, sid) for t, _, sid, _ in frames(s.data_to_send())] == [(1, 1), (0, 1), (0, 1)]
    assert s.wants_close


def test_peer_goaway_with_error_closes():
    s, c = H2Session(Limits()), client()
    handshake(c, s, streams=(1,))
    c.close_connection(error_code=ErrorCodes.INTERNAL_ERROR)
    assert [type(e) for e in s.receive_data(c.data_to_send())] == [ConnectionClosed]
    assert s.wants_close


def test_body_over_limit():
    s, c = H2Session(Limits(max_body_bytes=10)), client()
    c.receive_data(s.data_to_send())
    c.send_headers(1, REQUEST_HEADERS)
    c.send_data(1, b"0123456789ab", end_stream=True)
    events = s.receive_data(c.data_to_send())
    assert [type(e) for e in events] == [BodyTooLarge]
    assert events[0].stream_id == 1 and events[0].target == "/v1/completions"


def test_protocol_error_sends_goaway_and_reports_close():
    s = H2Session(Limits())
    events = s.receive_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x09\x00\x00\x00\x00\x00garb")
    assert [type(e) for e in events] == [ConnectionClosed]
    assert any(t == 7 for t, *_ in frames(s.data_to_send()))    # GOAWAY
    assert s.wants_close


def test_settings_advertise_limits():
    limits = Limits(max_concurrent_streams=7, max_header_list_size=1234, max_body_bytes=100_000)
    s, c = H2Session(limits), client()
    events = c.receive_data(s.data_to_send())
    changed = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)).changed_settings
    codes = h2.settings.SettingCodes
    assert changed[codes.MAX_CONCURRENT_STREAMS].new_value == 7
    assert changed[codes.MAX_HEADER_LIST_SIZE].new_value == 1234
    assert changed[codes.INITIAL_WINDOW_SIZE].new_value == 100_000


def test_h2c_upgrade_hands_request_to_stream_one():
    h1 = H1Session(Limits())
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    settings = c.initiate_upgrade_connection()
    c.data_to_send()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
           b"Upgrade: h2c\r\nHTTP2-Settings: " + settings.rstrip(b"=") + b"\r\nContent-Length: 2\r\n\r\n{}")
    (offer,) = h1.receive_data(req)
    assert type(offer) is UpgradeRequested and offer.request.body == b"{}"
    s = H2Session(Limits(), upgrade_settings=offer.settings)
    trailing = h1.accept_h2c_upgrade()
    assert h1.data_to_send().startswith(b"HTTP/1.1 101 ")
    request = s.upgraded_request(offer.request)
    assert request.stream_id == 1 and s.receive_data(trailing) == []
    c.initiate_connection()
    s.receive_data(c.data_to_send())
    s.respond(1, 200, [(b"content-type", b"application/json")], b'{"ok":1}')
    events = c.receive_data(s.data_to_send())
    assert data_by_stream(events) == {1: b'{"ok":1}'}
    assert base64.urlsafe_b64decode(settings)  # the client's settings header was real


# -------------------------------------------------------------- HTTP/1.1

def h1_request(body=b"{}", extra=b""):
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_h1_request_and_chunked_stream_with_trailers():
    """Trailers only for a client that said `TE: trailers`, announced with `Trailer:`."""
    s = H1Session(Limits())
    (ev,) = s.receive_data(h1_request(b'{"a":1}', b"TE: trailers\r\n"))
    assert (type(ev), ev.stream_id, ev.method, ev.target, ev.body) == (Request, 1, "POST", "/v1/completions", b'{"a":1}')
    s.start_response(1, 200, [(b"content-type", b"text/event-stream")])
    s.send_data(1, b"data: x\n\n")
    s.send_data(1, b"")                      # an empty chunk would end the body: nothing is written
    s.end_response(1, [(b"server-timing", b"total;dur=1")])
    raw = s.data_to_send()
    assert raw.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                          b"trailer: server-timing, tokenwire-cached-tokens\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
    assert raw.endswith(b"9\r\ndata: x\n\n\r\n0\r\nserver-timing: total;dur=1\r\n\r\n")
    assert not s.wants_close


def test_h1_no_trailers_without_te_trailers():
    s = H1Session(Limits())
    s.receive_data(h1_request(b'{"a":1}'))
    s.start_response(1, 200, [(b"content-type", b"text/event-stream")])
    s.send_data(1, b"data: x\n\n")
    s.end_response(1, [(b"server-timing", b"total;dur=1")])
    raw = s.data_to_send()
    assert b"trailer" not in raw.lower().split(b"\r\n\r\n")[0]
    assert raw.endswith(b"9\r\ndata: x\n\n\r\n0\r\n\r\n")


def test_h1_head_gets_headers_and_the_content_length_only():
    s = H1Session(Limits())
    (ev,) = s.receive_data(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ev.method == "HEAD"
    s.respond(1, 405, [(b"allow", b"GET, HEAD")], b'{"error": "x"}')
    raw = s.data_to_send()
    assert raw.endswith(b"content-length: 14\r\n\r\n") and not s.wants_close


def test_h1_pipelined_requests_served_in_order():
    s = H1Session(Limits())
    events = s.receive_data(h1_request(b"[1]") + h1_request(b"[2]"))
    assert [e.body for e in events] == [b"[1]"]
    s.respond(1, 200, [], b"one")
    assert s.wants_poll
    (second,) = s.poll_events()
    assert (second.stream_id, second.body) == (2, b"[2]")


def test_h1_content_length_over_limit_is_rejected_before_the_body():
    s = H1Session(Limits(max_body_bytes=4))
    (ev,) = s.receive_data(h1_request(b"0123456789"))
    assert type(ev) is BodyTooLarge
    s.respond(ev.stream_id, 413, [], b"too big")
    assert b"connection: close" in s.data_to_send().lower()
    assert s.wants_close


def test_h1_malformed_request_gets_400_and_close():
    s = H1Session(Limits())
    events = s.receive_data(b"NOT HTTP\r\n\r\n")
    assert [type(e) for e in events] == [ConnectionClosed]
    assert s.data_to_send().startswith(b"HTTP/1.1 400 ")
    assert s.wants_close


def test_h1_expect_100_continue():
    s = H1Session(Limits())
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert s.receive_data(head) == []
    assert s.data_to_send().startswith(b"HTTP/1.1 100 ")
    (ev,) = s.receive_data(b"{}")
    assert ev.body == b"{}"


def test_h1_client_close_reports_connection_closed():
    s = H1Session(Limits())
    assert [type(e) for e in s.receive_data(b"")] == [ConnectionClosed]


def test_h1_http10_client_gets_body_until_close_and_no_trailers():
    s = H1Session(Limits())
    (ev,) = s.receive_data(b"GET /health HTTP/1.0\r\n\r\n")
    s.start_response(ev.stream_id, 200, [])
    s.send_data(ev.stream_id, b"ok")
    s.end_response(ev.stream_id, [(b"server-timing", b"x;dur=1")])   # HTTP/1.0 has no trailers: dropped
    assert s.data_to_send() == b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nok"
    assert s.wants_close


@pytest.mark.parametrize("session_cls", [H1Session, H2Session])
def test_shutdown_with_no_streams_closes(session_cls):
    s = session_cls(Limits())
    s.begin_shutdown()
    assert s.wants_close


# ------------------------------------------------------- malformed requests

def raw_client():
    """A client that sends whatever headers it is given (no outbound validation)."""
    c = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False))
    c.initiate_connection()
    return c


@pytest.mark.parametrize("headers", [
    REQUEST_HEADERS + [("Content-Length", "2")],                       # upper-case name
    REQUEST_HEADERS + [("connection", "keep-alive")],                  # connection-specific
    REQUEST_HEADERS + [("te", "gzip")],
    REQUEST_HEADERS + [("x-a", "b\r\nx-b: c")],                        # CR LF in a value
    [h for h in REQUEST_HEADERS if h[0] != ":path"],                   # no :path
    [h for h in REQUEST_HEADERS if h[0] != ":scheme"],
    REQUEST_HEADERS[:2] + [("x-a", "b")] + REQUEST_HEADERS[2:],        # pseudo-header after a field
    REQUEST_HEADERS + [(":status", "200")],                            # response pseudo-header
    REQUEST_HEADERS[:1] + REQUEST_HEADERS,                             # repeated :method
], ids=["uppercase", "connection", "te", "crlf", "no-path", "no-scheme", "late-pseudo", "status", "repeated"])
def test_malformed_request_is_a_stream_error(headers):
    s, c = H2Session(Limits()), raw_client()
    s.receive_data(c.data_to_send())
    c.send_headers(1, headers, end_stream=True)
    c.send_headers(3, REQUEST_HEADERS, end_stream=True)       # the connection goes on
    events = s.receive_data(c.data_to_send())
    assert [(type(e), e.stream_id) for e in events] == [(Request, 3)]
    sent = [f for f in frames(s.data_to_send()) if f[0] == 3]
    assert sent == [(3, 0, 1, struct.pack(">I", ErrorCodes.PROTOCOL_ERROR))]
    assert not s.wants_close


def test_cookie_fields_are_combined_and_authority_becomes_host():
    s, c = H2Session(Limits()), client()
    c.send_headers(1, REQUEST_HEADERS + [("cookie", "a=1"), ("cookie", "b=2")], end_stream=True)
    (ev,) = s.receive_data(c.data_to_send())
    assert ev.headers["cookie"] == "a=1; b=2" and ev.headers["host"] == "localhost"


def test_request_decoder_replays_a_block_only_against_the_same_table():
    from tokenwire.net.protocol.request_headers import RequestDecoder
    import hpack
    enc, dec = hpack.Encoder(), RequestDecoder()
    pseudo = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/")]
    a, c = [(b"x-a", b"1")], [(b"x-c", b"3")]
    dec.decode_request(enc.encode(pseudo + a))          # literal with indexing: x-a enters the table
    pure = enc.encode(pseudo + a)                       # now the static pseudo-headers and dynamic index 62
    assert dec.decode_request(pure)[2] == {"x-a": "1"}
    assert pure in dec._memo
    assert dec.decode_request(pure)[2] == {"x-a": "1"}  # replayed from the memo
    dec.decode_request(enc.encode(pseudo + c))          # x-c enters in front: index 62 is x-c now
    assert dec.decode_request(pure)[2] == {"x-c": "3"}  # the memo does not answer for the old table
