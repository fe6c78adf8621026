"""The session's limits, byte-exact over an in-memory pair (net/protocol/http2.py rule 3 and rule 9,
net/protocol/flood.py): bodies that end, flood budgets that end in GOAWAY ENHANCE_YOUR_CALM, the
unsent-output counters and the write timeout's stream reset, HEAD, and the invalid preface."""

import struct

import pytest
from h2.errors import ErrorCodes

from tokenwire.net.protocol.events import BodyTooLarge, ConnectionClosed, Limits, Request, StreamReset
from tokenwire.net.protocol.flood import RateBudget
from tokenwire.net.protocol.http2 import CONNECTION_WINDOW, PREFACE, H2Session

from test_net_h2_inbound import connected, frame, frames, goaway_code, open_request, request_block


def updates(out: bytes) -> list:
    return [(sid, struct.unpack(">I", p)[0]) for t, _, sid, p in frames(out) if t == 8]


def resets(out: bytes) -> list:
    return [(sid, struct.unpack(">I", p)[0]) for t, _, sid, p in frames(out) if t == 3]


# ------------------------------------------------------------------ bodies

def test_content_length_over_the_limit_is_413_before_any_body_then_rst_no_error():
    s, ref, enc = connected(Limits(max_body_bytes=1000))
    events, out, _, _ = open_request(s, ref, enc, 1, extra=[(b"content-length", b"1001")])
    assert [type(e) for e in events] == [BodyTooLarge]
    s.respond(1, 413, [], b'{"error": {}}')
    out = frames(s.data_to_send())
    assert [t for t, *_ in out] == [1, 0, 0, 3]             # HEADERS, body, END_STREAM, RST_STREAM
    assert resets(s.data_to_send()) == [] and struct.unpack(">I", out[-1][3])[0] == ErrorCodes.NO_ERROR
    # the rest of the body is ignored, and its connection window is handed back
    assert s.receive_data(frame(0, 1, 1, bytes(500))) == [] and not s.closed


def test_a_body_without_length_past_the_limit_ends_even_when_larger_than_the_window():
    """The stream window is handed back as the body arrives, so the client can always pass the
    limit and be told (the window was once the limit: the request hung forever)."""
    s, ref, enc = connected(Limits(max_body_bytes=100_000))     # stream window: 100 000
    open_request(s, ref, enc, 1)
    sent, events = 0, []
    while not events:
        events = s.receive_data(b"".join(frame(0, 0, 1, bytes(16384)) for _ in range(3)))
        sent += 3 * 16384
        s.data_to_send()
        assert sent < 300_000, "no 413"
    assert [type(e) for e in events] == [BodyTooLarge] and 100_000 < sent <= 100_000 + 3 * 16384


def test_a_large_body_below_the_limit_arrives_whole_across_window_updates():
    s, ref, enc = connected(Limits(max_body_bytes=1 << 20))
    open_request(s, ref, enc, 1)
    s.receive_data(frame(4, 0, 0, b""))
    s.data_to_send()
    chunk = bytes(range(256)) * 64                       # 16384
    got = []
    for i in range(60):                                  # 983 040 bytes: more than the 2**20 // 2 credit point
        got += s.receive_data(frame(0, 1 if i == 59 else 0, 1, chunk))
    assert [type(e) for e in got] == [Request] and got[0].body == chunk * 60
    assert updates(s.data_to_send())[:1] == [(1, 32 * 16384)]


def test_interleaved_bodies_are_credited_as_they_arrive_and_counted_while_held():
    """Bodies interleaved on one connection never wait for each other: their bytes go back to
    the connection window as they arrive (one WINDOW_UPDATE per read), none complete (held
    bodies once counted against the window until complete: this read spent 15 of its 16 MiB
    and more than five such bodies stalled). What is held is `num_body_bytes` until each
    request completes or its stream goes."""
    s, ref, enc = connected(Limits(max_body_bytes=1 << 22, max_concurrent_streams=100))
    one = 192 * 16384                                    # 3 MiB
    raw = b""
    for sid in range(1, 11, 2):                          # 5 bodies of 3 MiB, a frame of each in turn
        raw += frame(1, 4, sid, request_block(enc))
    raw += b"".join(frame(0, 0, sid, bytes(16384)) for _ in range(192) for sid in range(1, 11, 2))
    assert s.receive_data(raw) == []
    assert [u for u in updates(s.data_to_send()) if u[0] == 0] == [(0, 5 * one)]
    assert s._recv_window == CONNECTION_WINDOW and s.num_body_bytes == 5 * one
    s.receive_data(frame(3, 0, 1, struct.pack(">I", ErrorCodes.CANCEL)))     # stream 1 reset: its body dropped
    assert s.num_body_bytes == 4 * one
    events = s.receive_data(b"".join(frame(0, 1, sid, b"") for sid in range(3, 11, 2)))
    assert [(type(e), len(e.body)) for e in events] == [(Request, one)] * 4
    assert s.num_body_bytes == 0 and [u for u in updates(s.data_to_send()) if u[0] == 0] == []


# ----------------------------------------------------------------- floods

def flood(limits: Limits, one: bytes, n: int, cause: str):
    s, ref, enc = connected(limits)
    events = s.receive_data(one * n)
    assert [type(e) for e in events][-1:] == [ConnectionClosed] and events[-1].cause == cause
    assert goaway_code(s.data_to_send()) == ErrorCodes.ENHANCE_YOUR_CALM
    return s


def test_settings_flood_is_goaway_enhance_your_calm():
    flood(Limits(max_settings_per_s=50), frame(4, 0, 0), 51, "settings_flood")


def test_ping_flood_is_goaway_enhance_your_calm():
    flood(Limits(max_pings_per_s=50), frame(6, 0, 0, bytes(8)), 51, "ping_flood")


def test_window_update_flood_is_goaway_enhance_your_calm():
    flood(Limits(max_window_updates_per_s=50), frame(8, 0, 0, struct.pack(">I", 1)), 51, "window_update_flood")


@pytest.mark.parametrize("one", [frame(0x20, 0, 0, b"x"), frame(2, 0, 1, struct.pack(">IB", 0, 16))],
                         ids=["unknown type", "priority"])
def test_frames_that_do_nothing_are_budgeted(one):
    flood(Limits(max_empty_frames_per_s=50), one, 51, "empty_frame_flood")


def test_empty_data_frames_are_budgeted():
    s, ref, enc = connected(Limits(max_empty_frames_per_s=50))
    open_request(s, ref, enc, 1)
    events = s.receive_data(frame(0, 0, 1, b"") * 51)
    assert events[-1].cause == "empty_frame_flood"


def test_within_a_budget_nothing_happens():
    s, ref, enc = connected(Limits(max_pings_per_s=50))
    assert s.receive_data(frame(6, 0, 0, bytes(8)) * 50) == [] and not s.closed


def test_rapid_reset_is_goaway_enhance_your_calm():
    s, ref, enc = connected(Limits(max_resets_per_s=20))
    raw = b"".join(frame(1, 5, sid, request_block(enc)) + frame(3, 0, sid, struct.pack(">I", 8))
                   for sid in range(1, 44, 2))          # 22 streams, each reset before its response
    events = s.receive_data(raw)
    assert events[-1].cause == "rapid_reset" and not any(type(e) is Request for e in events)
    assert goaway_code(s.data_to_send()) == ErrorCodes.ENHANCE_YOUR_CALM


def test_resets_of_finished_or_streaming_streams_do_not_count():
    s, ref, enc = connected(Limits(max_resets_per_s=5))
    for sid in range(1, 41, 2):
        (req,) = s.receive_data(frame(1, 5, sid, request_block(enc)))
        s.respond(sid, 200, [], b"ok")
        assert s.receive_data(frame(3, 0, sid, struct.pack(">I", 8))) == []
    for sid in range(41, 81, 2):       # a client cancelling streams it is reading
        (req,) = s.receive_data(frame(1, 5, sid, request_block(enc)))
        s.start_response(sid, 200, [])
        s.send_data(sid, b"token")
        assert s.receive_data(frame(3, 0, sid, struct.pack(">I", 8))) == [StreamReset(sid)]
    assert not s.closed


def test_stream_errors_we_send_count_as_resets():
    """A client that makes us reset its streams ("made you reset") spends the same budget."""
    s, ref, enc = connected(Limits(max_resets_per_s=10))
    raw = b"".join(frame(1, 4, sid, request_block(enc)) + frame(8, 0, sid, b"\0\0\0\0") for sid in range(1, 24, 2))
    events = s.receive_data(raw)
    assert events[-1].cause == "rapid_reset"


def test_rate_budget_refills_with_time():
    b = RateBudget(10.0)
    assert all(b.take(0) for _ in range(10)) and not b.take(0)
    assert b.take(200_000_000) and b.take(200_000_000) and not b.take(200_000_000)


# ---------------------------------------------------------- unsent output

def test_queued_bytes_are_counted_and_a_stalled_stream_expires():
    s, ref, enc = connected()
    s.receive_data(frame(4, 0, 0, struct.pack(">HI", 4, 0)))     # the client's window: 0
    open_request(s, ref, enc, 1, True)
    open_request(s, ref, enc, 3, True)
    s.start_response(1, 200, [])
    s.start_response(3, 200, [])
    s.send_data(1, b"x" * 1000)
    s.send_data(3, b"y" * 500)
    s.data_to_send()
    assert s.num_pending_bytes == 1500
    s.receive_data(frame(8, 0, 3, struct.pack(">I", 100)))       # stream 3 makes progress
    assert s.num_pending_bytes == 1400
    cutoff = s.streams[3].stalled_ns
    assert s.expire_stalled(cutoff) == [1]                        # 1 stalled since before; 3 moved at `cutoff`
    assert resets(s.data_to_send()) == [(1, ErrorCodes.CANCEL)]
    assert s.num_pending_bytes == 400 and 1 not in s.streams and 3 in s.streams


def test_control_frames_are_counted():
    s, ref, enc = connected()
    n = s.num_control_frames
    s.receive_data(frame(6, 0, 0, bytes(8)) * 5)
    assert s.num_control_frames == n + 5


def test_end_connection_is_goaway_with_the_cause():
    s, ref, enc = connected()
    open_request(s, ref, enc, 1, True)
    (ev,) = s.end_connection("unsent_bytes", "too much")
    assert ev.cause == "unsent_bytes" and goaway_code(s.data_to_send()) == ErrorCodes.ENHANCE_YOUR_CALM
    (s2, *_), = [connected()]
    s2.end_connection("idle", "idle", calm=False)
    assert goaway_code(s2.data_to_send()) == ErrorCodes.NO_ERROR


# -------------------------------------------------------------- responses

def test_head_response_has_the_content_length_and_no_body():
    s, ref, enc = connected()
    block = enc.encode([(b":method", b"HEAD"), (b":path", b"/metrics"), (b":scheme", b"http"), (b":authority", b"a")])
    (req,) = s.receive_data(frame(1, 5, 1, block))
    assert req.method == "HEAD"
    s.respond(1, 200, [], b"0123456789")
    out = frames(s.data_to_send())
    assert [(t, f, len(p)) for t, f, _, p in out] == [(1, 4, out[0][3].__len__()), (0, 1, 0)]
    assert b"10" in out[0][3]          # content-length: 10, as a plain literal (hpack_plain)


def test_an_invalid_preface_is_goaway_protocol_error():
    s = H2Session(Limits())
    events = s.receive_data(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + frame(4, 0, 0))
    assert [type(e) for e in events] == [ConnectionClosed]
    assert goaway_code(s.data_to_send()) == ErrorCodes.PROTOCOL_ERROR
    assert PREFACE.startswith(b"PRI ")
