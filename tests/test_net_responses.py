"""Every status the routes answer, on both protocols, for GET, POST and HEAD: the response is
well formed (an OpenAI error body, `Allow` on 405, no body at all for HEAD but the GET's
content-length), and the connection goes on serving the next request. A HEAD on any route
used to end the HTTP/1.1 connection with h11's "Too much data for declared Content-Length"
and reset the HTTP/2 stream. Also: a response that raises while it is written costs only
its own stream, and the HTTP/1.1 stage-timing trailer follows `TE: trailers`.

Runs on asyncio and uvloop, against a real server (mock engine) over real sockets.
"""

import json
import socket
import time

import h11
import pytest

import tokenwire
from tokenwire.net.protocol.events import Limits

from clients.rawh2 import RawH2
from engines import wait_for

KEY = "sekrit"
AUTH = [("authorization", f"Bearer {KEY}")]
GOOD = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def server(request):
    s = tokenwire.Server(backend="mock", port=0, loop=request.param, api_key=KEY, max_num_seqs=1,
                         mock_step_us=2000, max_queued_requests=1, limits=Limits(max_body_bytes=1000)).start()

    def boom(proto, req):
        raise RuntimeError("a route that fails")
    s.app.routes["/boom"] = {"GET": boom}
    yield s
    s.stop()


# (name, method, path, headers, body, status)
CASES = [
    ("health", "GET", "/health", [], None, 200),
    ("models", "GET", "/v1/models", AUTH, None, 200),
    ("metrics", "GET", "/metrics", [], None, 200),
    ("completion", "POST", "/v1/completions", AUTH + [("content-type", "application/json")], GOOD, 200),
    ("bad json", "POST", "/v1/completions", AUTH + [("content-type", "application/json")], b"{nope", 400),
    ("no key", "GET", "/v1/models", [], None, 401),
    ("no route", "GET", "/nope", [], None, 404),
    ("wrong method", "DELETE", "/health", [], None, 405),
    ("get on post", "GET", "/v1/completions", AUTH, None, 405),
    ("too large", "POST", "/v1/completions", AUTH + [("content-type", "application/json")],
     {"prompt": "x" * 2000}, 413),
    ("media type", "POST", "/v1/completions", AUTH + [("content-type", "text/plain")], GOOD, 415),
    ("failing route", "GET", "/boom", [], None, 500),
]
HEADS = [("HEAD " + name, "HEAD", path, headers, None, status) for name, m, path, headers, _, status in CASES
         if m == "GET"] + [("HEAD on post", "HEAD", "/v1/completions", AUTH, None, 405)]


def encode(body) -> bytes:
    return b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()


def check(method, status, got_status, headers: dict, body: bytes, expected_status):
    assert got_status == expected_status
    if method == "HEAD":
        assert body == b"" and int(headers[b"content-length"]) > 0
    else:
        assert int(headers.get(b"content-length", len(body))) == len(body)
    if expected_status >= 400 and method != "HEAD":
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    if expected_status == 405:
        assert b"GET" in headers[b"allow"] or b"POST" in headers[b"allow"]
        if headers[b"allow"].startswith(b"GET"):
            assert headers[b"allow"] == b"GET, HEAD"


# --------------------------------------------------------------- HTTP/1.1

class H1:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h11.Connection(h11.CLIENT)

    def request(self, method, path, headers, body):
        raw = encode(body)
        hdrs = [("host", "x")] + headers + ([("content-length", str(len(raw)))] if method == "POST" else [])
        self.sock.sendall(self.conn.send(h11.Request(method=method, target=path, headers=hdrs)))
        if raw:
            self.sock.sendall(self.conn.send(h11.Data(data=raw)))
        self.sock.sendall(self.conn.send(h11.EndOfMessage()))
        response, body = None, b""
        while True:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(ev, h11.Response):
                response = ev
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return response.status_code, dict(response.headers), body, ev.headers

    def next_cycle_or_closed(self) -> bool:
        """True if the connection can carry another request."""
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.MUST_CLOSE:
            return False
        self.conn.start_next_cycle()
        return True


@pytest.mark.parametrize("name,method,path,headers,body,status", CASES + HEADS, ids=[c[0] for c in CASES + HEADS])
def test_http1_every_status_keeps_the_connection(server, name, method, path, headers, body, status):
    c = H1(server.port)
    got, hdrs, data, _ = c.request(method, path, headers, body)
    check(method, status, got, hdrs, data, status)
    if status == 413:       # the body was never read: the connection cannot go on (Connection: close)
        assert hdrs.get(b"connection") == b"close" and not c.next_cycle_or_closed()
        return
    assert c.next_cycle_or_closed()
    assert c.request("GET", "/health", [], None)[0] == 200


# ----------------------------------------------------------------- HTTP/2

def h2_request(c: RawH2, method, path, headers, body) -> int:
    sid = c.conn.get_next_available_stream_id()
    raw = encode(body)
    c.conn.send_headers(sid, [(":method", method), (":path", path), (":scheme", "http"), (":authority", c.host)]
                        + headers, end_stream=not raw)
    if raw:
        c.conn.send_data(sid, raw, end_stream=True)
    c.flush()
    return sid


@pytest.mark.parametrize("name,method,path,headers,body,status", CASES + HEADS, ids=[c[0] for c in CASES + HEADS])
def test_http2_every_status_keeps_the_connection(server, name, method, path, headers, body, status):
    c = RawH2("127.0.0.1", server.port)
    try:
        sid = h2_request(c, method, path, headers, body)
        c.read_until(lambda: sid in c.ended or sid in c.resets)
        assert sid not in c.resets
        headers_seen = {k: v for k, v in c.headers[sid] if not k.startswith(b":")}
        check(method, status, int(c.status[sid]), headers_seen, c.data.get(sid, b""), status)
        sid2 = c.get("/health")
        c.read_until(lambda: sid2 in c.ended)
        assert c.status[sid2] == b"200" and c.goaway is None
    finally:
        c.close()


def test_429_on_both_protocols(server):
    """Queue of one: one request running (max_num_seqs=1), one waiting, the next is 429."""
    c = RawH2("127.0.0.1", server.port)
    try:
        body = {"prompt": "hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}   # within the context (a larger max_tokens is a 400)
        busy = [c.post("/v1/completions", body, AUTH)]
        c.read_until(lambda: busy[0] in c.data)
        busy.append(c.post("/v1/completions", body, AUTH))      # waits: the running batch holds one
        deadline = time.monotonic() + 10
        while server.engine.stats().num_waiting != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        sid = c.post("/v1/completions", GOOD, AUTH)
        c.read_until(lambda: sid in c.ended)
        assert c.status[sid] == b"429" and json.loads(c.data[sid])["error"]["code"] == "queue_full"
        h1 = H1(server.port)
        got, hdrs, data, _ = h1.request("POST", "/v1/completions", AUTH + [("content-type", "application/json")], GOOD)
        check("POST", 429, got, hdrs, data, 429)
        assert hdrs[b"retry-after"] == b"1" and h1.next_cycle_or_closed()
        for s in busy:
            c.reset(s)
    finally:
        c.close()


def test_503_on_both_protocols_when_the_engine_is_gone():
    s = tokenwire.Server(backend="mock", port=0).start()
    try:
        s.loop.call_soon_threadsafe(s.engine.shutdown)
        deadline = time.monotonic() + 10
        while s.engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        h1 = H1(s.port)
        for method in ("GET", "HEAD"):
            got, hdrs, data, _ = h1.request(method, "/health", [], None)
            check(method, 503, got, hdrs, data, 503)
            assert h1.next_cycle_or_closed()
        c = RawH2("127.0.0.1", s.port)
        sid = c.get("/health")
        c.read_until(lambda: sid in c.ended)
        assert c.status[sid] == b"503"
        c.close()
    finally:
        s.stop()


# --------------------------------------------------------------- trailers

def test_http1_trailer_only_with_te_trailers(server):
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    headers = AUTH + [("content-type", "application/json")]
    # one sequence and one queued request at most (the fixture's limits): a stream an earlier
    # test left must end first, or this one is a 429, whose whole body has no trailers
    assert wait_for(lambda: not server.engine.has_unfinished())
    plain = H1(server.port).request("POST", "/v1/completions", headers, body)
    assert plain[0] == 200 and b"trailer" not in plain[1] and plain[3] == [], plain
    assert wait_for(lambda: not server.engine.has_unfinished())
    te = H1(server.port).request("POST", "/v1/completions", headers + [("te", "trailers")], body)
    assert te[0] == 200 and b"trailer" in te[1], te
    announced = {t.strip() for t in te[1][b"trailer"].split(b",")}
    assert {name for name, _ in te[3]} <= announced and b"server-timing" in {name for name, _ in te[3]}
