"""The HTTP/2 session's message streams (http2.py rule 11) and PRIORITY_UPDATE frames that
come before their request (rule 10), over an in-memory pair: h2's client on one side, our
session on the other, asserting exact events, the body bytes the session counts, and the
frames it writes."""

import struct

from h2.errors import ErrorCodes

from tokenwire.net.protocol.events import (
    BodyTooLarge,
    Limits,
    MessageRequest,
    Request,
    RequestEnd,
    RequestMessage,
    StreamReset,
)
from tokenwire.net.protocol.http2 import MAX_EARLY_PRIORITIES, PRIORITY_UPDATE, RST_STREAM, H2Session

from test_net_session import REQUEST_HEADERS, client, frames, pump

GRPC_HEADERS = [(":method", "POST"), (":path", "/pkg.Svc/Chat"), (":scheme", "http"), (":authority", "x"),
                ("content-type", "application/grpc"), ("te", "trailers")]


def message(payload: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BI", compressed, len(payload)) + payload


def connected(limits: Limits | None = None):
    c, s = client(), H2Session(limits or Limits())
    s.receive_data(c.data_to_send())
    pump(c, s)
    return c, s


def priority_update(stream_id: int, value: bytes) -> bytes:
    payload = stream_id.to_bytes(4, "big") + value
    return len(payload).to_bytes(3, "big") + bytes([PRIORITY_UPDATE, 0]) + (0).to_bytes(4, "big") + payload


# ------------------------------------------------------------------ message streams

def test_messages_are_delivered_as_they_complete_and_only_the_incomplete_one_is_counted():
    c, s = connected()
    c.send_headers(1, GRPC_HEADERS)
    [head] = s.receive_data(c.data_to_send())
    assert type(head) is MessageRequest and (head.stream_id, head.method, head.target) == (1, "POST", "/pkg.Svc/Chat")
    assert head.headers["content-type"] == "application/grpc" and s.num_body_bytes == 0
    second = message(b"b" * 100)
    c.send_data(1, message(b"a" * 10) + second[:3])
    assert s.receive_data(c.data_to_send()) == [RequestMessage(1, False, b"a" * 10)]
    assert s.num_body_bytes == 3                       # the second message's first bytes
    c.send_data(1, second[3:-1])
    assert s.receive_data(c.data_to_send()) == [] and s.num_body_bytes == 104
    c.send_data(1, second[-1:] + message(b"", compressed=1))
    assert s.receive_data(c.data_to_send()) == [RequestMessage(1, False, b"b" * 100), RequestMessage(1, True, b"")]
    assert s.num_body_bytes == 0
    s.keep_message(1, 100)                             # the app keeps one until the half-close
    assert s.num_body_bytes == 100
    c.end_stream(1)
    assert s.receive_data(c.data_to_send()) == [RequestEnd(1, 0)] and s.num_body_bytes == 0
    s.start_response(1, 200, ((b"content-type", b"application/grpc"),))
    s.end_response(1, [(b"grpc-status", b"0")])
    assert 1 not in s.streams and not any(f[0] == RST_STREAM for f in frames(s.data_to_send()))


def test_other_requests_are_still_delivered_whole_at_their_end():
    c, s = connected()
    c.send_headers(1, REQUEST_HEADERS)
    c.send_data(1, b'{"a":')
    assert s.receive_data(c.data_to_send()) == [] and s.num_body_bytes == 5
    c.send_data(1, b"1}", end_stream=True)
    [req] = s.receive_data(c.data_to_send())
    assert type(req) is Request and req.body == b'{"a":1}' and s.num_body_bytes == 0


def test_a_message_over_the_limit_is_too_large_and_the_rest_of_the_stream_is_dropped():
    c, s = connected(Limits(max_body_bytes=1000))
    c.send_headers(1, GRPC_HEADERS)
    c.send_data(1, message(b"x" * 1000) + message(b"y" * 1001)[:300])
    head, first, too_large = s.receive_data(c.data_to_send())
    assert first == RequestMessage(1, False, b"x" * 1000)      # exactly the limit: delivered
    assert type(too_large) is BodyTooLarge and too_large.stream_id == 1 and s.num_body_bytes == 0
    c.send_data(1, b"z" * 800)
    assert s.receive_data(c.data_to_send()) == [] and s.num_body_bytes == 0
    s.start_response(1, 200, ((b"content-type", b"application/grpc"),))
    s.end_response(1, [(b"grpc-status", b"8")])
    out = frames(s.data_to_send())
    assert out[-1][0] == RST_STREAM and int.from_bytes(out[-1][3], "big") == ErrorCodes.NO_ERROR


def test_a_request_that_ends_inside_a_message_says_how_many_bytes_are_cut():
    c, s = connected()
    c.send_headers(1, GRPC_HEADERS)
    c.send_data(1, message(b"abc") + message(b"defgh")[:4], end_stream=True)
    assert s.receive_data(c.data_to_send())[1:] == [RequestMessage(1, False, b"abc"), RequestEnd(1, 4)]
    assert s.num_body_bytes == 0


def test_a_response_that_ends_while_messages_still_come_resets_the_request_side():
    c, s = connected()
    c.send_headers(1, GRPC_HEADERS)
    c.send_data(1, message(b"q" * 50)[:20])
    s.receive_data(c.data_to_send())
    assert s.num_body_bytes == 20
    s.start_response(1, 200, ((b"content-type", b"application/grpc"),))
    s.end_response(1, [(b"grpc-status", b"12")])           # e.g. UNIMPLEMENTED at the headers
    out = frames(s.data_to_send())
    assert [f[0] for f in out][-1] == RST_STREAM and int.from_bytes(out[-1][3], "big") == ErrorCodes.NO_ERROR
    assert s.num_body_bytes == 0 and 1 not in s.streams


def test_a_reset_withdraws_the_streams_events_of_the_same_read():
    c, s = connected()
    c.send_headers(1, GRPC_HEADERS)
    c.send_data(1, message(b"hello"))
    c.reset_stream(1)
    assert s.receive_data(c.data_to_send()) == []          # the app never saw the call: nothing at all
    c.send_headers(3, GRPC_HEADERS)
    assert type(s.receive_data(c.data_to_send())[0]) is MessageRequest
    c.send_data(3, message(b"hello"))
    c.reset_stream(3)
    assert s.receive_data(c.data_to_send()) == [StreamReset(3)]    # the message is withdrawn, the reset told
    assert s.num_body_bytes == 0


def test_a_long_lived_message_stream_gets_its_window_back():
    """Many times the stream's window in messages, on one stream that never ends: h2's client
    would raise FlowControlError if the window did not come back."""
    c, s = connected(Limits(max_body_bytes=65535))
    c.send_headers(1, GRPC_HEADERS)
    s.receive_data(c.data_to_send())
    delivered = 0
    for _ in range(20):
        c.send_data(1, message(b"m" * 16000))         # 20 of them: ~5 windows
        delivered += len(s.receive_data(c.data_to_send()))
        pump(c, s)
    assert delivered == 20 and s.num_body_bytes == 0 and 1 in s.streams


# ------------------------------------------------------------------ PRIORITY_UPDATE before its request

def open_request(c, s, sid: int, headers=REQUEST_HEADERS) -> Request:
    c.send_headers(sid, headers, end_stream=True)
    [req] = s.receive_data(c.data_to_send())
    return req


def test_a_priority_update_before_its_headers_is_applied_when_the_stream_opens():
    c, s = connected()
    assert s.receive_data(priority_update(3, b"u=0")) == []
    req = open_request(c, s, 1)
    assert "priority" not in req.headers
    req = open_request(c, s, 3, REQUEST_HEADERS + [("priority", "u=5")])
    assert req.headers["priority"] == "u=0"                # the frame overrides the header
    s.receive_data(priority_update(5, b"u=1") + priority_update(5, b"u=6"))
    assert open_request(c, s, 5).headers["priority"] == "u=6"      # the newest value for a stream
    assert "priority" not in open_request(c, s, 7).headers          # used once


def test_early_priority_updates_are_bounded_the_oldest_dropped_and_stale_ones_forgotten():
    c, s = connected()
    streams = [3 + 2 * i for i in range(MAX_EARLY_PRIORITIES + 1)]
    s.receive_data(b"".join(priority_update(sid, b"u=%d" % (i % 8)) for i, sid in enumerate(streams)))
    assert "priority" not in open_request(c, s, 3).headers          # the oldest, dropped for the newest
    assert open_request(c, s, 5).headers["priority"] == "u=1"
    assert open_request(c, s, streams[-1]).headers["priority"] == "u=0"    # 16 % 8
    s.receive_data(priority_update(101, b"u=2"))
    open_request(c, s, 103)                                          # 101 can never open now
    assert s._early_priorities == {}


def test_a_priority_update_while_the_body_still_comes_is_in_the_delivered_request():
    c, s = connected()
    c.send_headers(1, REQUEST_HEADERS)
    c.send_data(1, b"{")
    assert s.receive_data(c.data_to_send() + priority_update(1, b"u=7")) == []
    c.send_data(1, b"}", end_stream=True)
    [req] = s.receive_data(c.data_to_send())
    assert req.headers["priority"] == "u=7" and req.body == b"{}"
