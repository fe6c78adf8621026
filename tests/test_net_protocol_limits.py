"""The Protocol shell's deadlines and caps (net/protocol/shell.py), driven byte by byte over an
in-memory transport, with the real App and sessions: the handshake and idle deadlines that
trickled bytes do not refresh, the write timeout, the unsent-output cap and the control-frame
backlog of a peer that does not read. Then the invalid preface over a real socket, both
the `PRI ` case (HTTP/2: GOAWAY PROTOCOL_ERROR, what h2spec 3.5 checks) and other bytes
(HTTP/1.1: 400)."""

import asyncio
import functools
import socket
import struct

import pytest
from h2.errors import ErrorCodes

import tokenwire
from tokenwire.net.app import App
from tokenwire.net.protocol.events import Limits
from tokenwire.net.protocol.http2 import PREFACE
from tokenwire.net.protocol.shell import ServerProtocol

from test_net_h2_inbound import frame, frames


class MemoryTransport:
    """What ServerProtocol uses of an asyncio transport, in memory."""

    def __init__(self):
        self.written = b""
        self.eof = self.closed = self.aborted = False

    def write(self, data):
        self.written += data

    def get_extra_info(self, name):
        return None

    def can_write_eof(self):
        return True

    def write_eof(self):
        self.eof = True

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True


def connection(limits: Limits, hello: bytes = PREFACE + frame(4, 0, 0)):
    app = App()
    proto = ServerProtocol(app, limits)
    transport = MemoryTransport()
    proto.connection_made(transport)
    if hello:
        proto.data_received(hello)
    return app, proto, transport


def goaway_code(raw: bytes):
    codes = [struct.unpack(">II", p[:8])[1] for t, _, _, p in frames(raw) if t == 7]
    return codes[-1] if codes else None


def in_loop(test):
    """Run the test inside a running event loop: close() schedules its linger on it."""
    @functools.wraps(test)
    def run():
        async def body():
            test()
        asyncio.run(body())
    return run


@in_loop
def test_handshake_deadline_is_not_refreshed_by_trickled_bytes():
    app, proto, t = connection(Limits(handshake_timeout_s=10), hello=b"")
    start = proto.connected_at
    for i, byte in enumerate(PREFACE):                  # one byte a second
        proto.data_received(bytes([byte]))
        proto.check_deadlines(start + i)
        if proto.closing:
            break
    assert proto.close_cause == "handshake_timeout" and i == 11


@in_loop
def test_idle_deadline_is_not_refreshed_by_pings():
    app, proto, t = connection(Limits(idle_timeout_s=5, handshake_timeout_s=3))
    proto.served_any = True         # the handshake deadline is met (a request came and went)
    start = proto.last_active
    for second in range(1, 8):
        proto.data_received(frame(6, 0, 0, bytes(8)))        # PING: bytes, no event
        proto.check_deadlines(start + second)
    assert proto.close_cause == "idle" and goaway_code(t.written) == ErrorCodes.NO_ERROR


@in_loop
def test_idle_connection_with_an_unfinished_request_is_closed_one_handshake_deadline_later():
    import hpack
    app, proto, t = connection(Limits(idle_timeout_s=5, handshake_timeout_s=3))
    proto.served_any = True
    block = hpack.Encoder().encode([(":method", "POST"), (":path", "/x"), (":scheme", "http"), (":authority", "a")])
    proto.data_received(frame(1, 4, 1, block) + frame(0, 0, 1, b"{"))    # a body that never ends
    start = proto.last_active
    proto.check_deadlines(start + 6)
    assert not proto.closing                # GOAWAY sent, waiting for the stream
    proto.check_deadlines(start + 10)
    assert proto.closing and proto.close_cause == "idle"


@in_loop
def test_write_timeout_drops_a_connection_that_reads_nothing():
    app, proto, t = connection(Limits(write_timeout_s=2))
    proto.served_any = True
    proto.pause_writing()
    proto.check_deadlines(proto.paused_at + 1)
    assert not proto.closing
    proto.check_deadlines(proto.paused_at + 3)
    assert proto.close_cause == "write_timeout" and t.aborted


@in_loop
def test_unsent_output_cap_ends_the_connection():
    app, proto, t = connection(Limits(max_unsent_bytes=10_000))
    proto.pause_writing()
    proto.data_received(frame(6, 0, 0, bytes(8)) * 50)        # 50 ACKs held: 850 bytes
    assert not proto.closing and proto.num_held_bytes == 850
    proto.session._out.append(bytes(10_000))                  # a response the peer will not read
    proto.flush()
    assert proto.close_cause == "unsent_bytes" and t.aborted and proto.num_held_bytes == 0


@in_loop
def test_control_frames_owed_to_a_peer_that_does_not_read_are_capped():
    app, proto, t = connection(Limits(max_queued_control_frames=40, max_pings_per_s=1e6))
    proto.pause_writing()
    proto.data_received(frame(6, 0, 0, bytes(8)) * 40)
    assert not proto.closing
    proto.data_received(frame(6, 0, 0, bytes(8)))
    assert proto.close_cause == "control_frame_backlog" and t.aborted


@in_loop
def test_held_output_leaves_in_order_on_resume():
    app, proto, t = connection(Limits())
    before = len(t.written)
    proto.pause_writing()
    proto.data_received(frame(6, 0, 0, b"pingpong"))
    assert len(t.written) == before
    proto.resume_writing()
    assert [(ft, p) for ft, _, _, p in frames(t.written[before:])] == [(6, b"pingpong")]


# ------------------------------------------------------------ real sockets

@pytest.fixture(scope="module")
def server():
    s = tokenwire.Server(backend="mock", port=0).start()
    yield s
    s.stop()


def read_all(sock) -> bytes:
    sock.settimeout(5)
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    return raw


@pytest.mark.parametrize("preface", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\rQ", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n",
                                     b"PRI foo\r\n\r\n"])
def test_invalid_preface_starting_pri_is_goaway_protocol_error(server, preface):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(preface)
        raw = read_all(sock)
    assert goaway_code(raw) == ErrorCodes.PROTOCOL_ERROR


def test_other_bytes_stay_http1(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"INVALID CONNECTION PREFACE\r\n\r\n")
        raw = read_all(sock)
    assert raw.startswith(b"HTTP/1.1 400 ")
