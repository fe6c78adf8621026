"""Large request bodies interleaved on one HTTP/2 connection all complete (issue 30).

A client that uploads N bodies at once sends a little of each in turn. When held bodies
counted against our 16 MiB connection window until their request was complete, more than
four bodies of nearly 4 MiB left the window spent with none complete: the upload stalled
until the idle timeout. Here 8 bodies of 3.9 MiB go out round-robin in 16 KiB frames, with
exact flow control (h2's client), against a real server whose idle and handshake deadlines
are short, so a stall ends the connection and fails the test instead of hanging it.

Runs on asyncio and uvloop.
"""

import json

import pytest

import tokenwire
from tokenwire.net.protocol.events import Limits

from clients.rawh2 import RawH2

NUM_BODIES = 8
BODY_BYTES = int(3.9 * 1024 * 1024)
FRAME = 16384


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def server(request):
    s = tokenwire.Server(backend="mock", port=0, loop=request.param,
                         limits=Limits(idle_timeout_s=3.0, handshake_timeout_s=3.0)).start()
    yield s
    s.stop()


def body(i: int) -> bytes:
    """A completion request padded to BODY_BYTES with a field the route ignores."""
    head = b'{"prompt": "hi", "max_tokens": 1, "pad_%d": "' % i
    return head + b"x" * (BODY_BYTES - len(head) - 2) + b'"}'


def upload_interleaved(c: RawH2, bodies: dict) -> None:
    """Round-robin one frame per stream while the windows allow; else read (WINDOW_UPDATE)."""
    left = {sid: memoryview(b) for sid, b in bodies.items()}
    while left:
        sent = False
        for sid in list(left):
            n = min(FRAME, c.conn.local_flow_control_window(sid), len(left[sid]))
            if n == 0 and len(left[sid]):
                continue
            chunk, left[sid] = left[sid][:n], left[sid][n:]
            c.conn.send_data(sid, bytes(chunk), end_stream=not len(left[sid]))
            if not len(left[sid]):
                del left[sid]
            sent = True
        c.flush()
        if not sent:
            c.read_once()               # windows spent: wait for the server's WINDOW_UPDATE
            assert c.goaway is None, f"the server ended the connection mid-upload: {c.goaway}"


def test_interleaved_large_bodies_on_one_connection_all_complete(server):
    c = RawH2("127.0.0.1", server.port, timeout=30)
    try:
        c.read_until(lambda: c.conn.outbound_flow_control_window > 65535)    # our SETTINGS and connection window
        bodies = {}
        for i in range(NUM_BODIES):
            sid = c.conn.get_next_available_stream_id()
            bodies[sid] = body(i)
            c.conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                                      (":authority", c.host), ("content-type", "application/json"),
                                      ("content-length", str(BODY_BYTES))])
        upload_interleaved(c, bodies)
        c.read_until(lambda: c.ended >= set(bodies) or c.goaway is not None)
        assert c.goaway is None, c.goaway
        for sid in bodies:
            assert c.status[sid] == b"200", (sid, c.status.get(sid), c.data.get(sid))
            assert json.loads(c.data[sid])["usage"]["completion_tokens"] == 1
        sid = c.get("/health")          # the connection goes on
        c.read_until(lambda: sid in c.ended)
        assert c.data[sid] == b'{"status":"ok"}'
    finally:
        c.close()
