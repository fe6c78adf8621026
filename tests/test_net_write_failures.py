"""One stream whose write raises fails alone (issue 30): over a real server with several
streams on one HTTP/2 connection and on other connections (HTTP/2 and HTTP/1.1), one
stream's write raises mid-step, at each place the step writer can raise: the response
headers, the first token, a token its encoder's `splice(text)` builds (the step's columns),
an encoder's token, the finish chunk, and the session's batch framing (where an SSE token's
pieces are spliced). The others of that step get every token, the failing one ends with
RST_STREAM(INTERNAL_ERROR) (a 500 JSON body when it had sent nothing), its request is
cancelled in the engine, it is logged once as an error with its request id, the connection
keeps serving, and no exception reaches the event loop's handler.

Runs on asyncio and uvloop, with the engine's steps inline on the loop (the zero-cost mock)
and on the engine thread (2 ms mock steps). Then the same without sockets: the outbox's
batch after a fault (byte-exact against a batch without the faulty stream), each session's
`fail_response`, and a connection whose flush raises.
"""

import json
import logging
import socket
import time

import httpx
import h2.events
import orjson
import pytest
from h2.errors import ErrorCodes

import tokenwire
from tokenwire.core.outputs import StepTokens, Timeline
from tokenwire.net.api.openai import parse_completions
from tokenwire.net.metrics import Metrics
from tokenwire.net.protocol import frames
from tokenwire.net.protocol.events import Limits
from tokenwire.net.protocol.http1 import H1Session
from tokenwire.net.protocol.http2 import H2Session
from tokenwire.net.writer import encoders
from tokenwire.net.writer.dispatch import Dispatcher, Exchange
from tokenwire.net.writer.outbox import Outbox

from clients.rawh2 import RawH2
from test_net_session import client, data_by_stream, handshake, pump

COMPLETION = parse_completions({"prompt": "x", "stream": True})

FAIL_AT = 6                 # the victim's 6th write of the failing kind raises
NUM_TOKENS = 40             # every other stream's max_tokens
VICTIM_TOKENS = 4000        # the victim's: were it not cancelled, it would run for seconds


class InjectedFault(RuntimeError):
    pass


class FaultyEncoder:
    """One exchange's encoder, whose writes of kind `how` raise (from the FAIL_AT-th on)."""

    def __init__(self, inner, how: str, session_victims: set):
        self._inner, self._how, self._num_calls = inner, how, 0
        self._session_victims = session_victims

    def __getattr__(self, name):
        if name == "text_parts" and self._how == "session":
            return self._text_parts
        if name == "text_parts" and self._how == "splice":     # later tokens go through `splice(text)`
            return lambda: (None, None)
        if name == "splice" and self._how == "splice":
            return self._splice
        if name == "response_headers" and self._how == "headers":
            raise InjectedFault("injected headers fault")
        return getattr(self._inner, name)

    def _count(self, how: str) -> None:
        if self._how == how:
            self._num_calls += 1
            if self._num_calls >= FAIL_AT:
                raise InjectedFault(f"injected {how} fault")

    def first_token(self, out):
        if self._how == "first_token":
            raise InjectedFault("injected first_token fault")
        return self._inner.first_token(out)

    def token(self, out):
        self._count("token")
        self._count("splice")               # a row's later token: the chunk `splice` builds in the columns
        return self._inner.token(out)

    def finish(self, *args, **kwargs):
        if self._how == "finish":
            raise InjectedFault("injected finish fault")
        return self._inner.finish(*args, **kwargs)

    def _text_parts(self):
        prefix, suffix = self._inner.text_parts()
        self._session_victims.add(prefix)   # the session's batch raises on this stream's chunks
        return prefix, suffix

    def _splice(self, text):
        """A later token's chunk, built in the step's columns (as the Responses encoder's)."""
        self._count("splice")
        prefix, suffix = self._inner.text_parts()
        return prefix + orjson.dumps(text) + suffix


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def loop_kind(request):
    return request.param


@pytest.fixture(scope="module", params=[0, 2000], ids=["inline", "thread"])
def server(loop_kind, request):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, mock_step_us=request.param).start()
    yield s
    s.stop()


@pytest.fixture
def faults(server, monkeypatch):
    """Requests with an `x-test-fail: <how>` header get a FaultyEncoder; "session" victims'
    chunks raise in H2Session.send_batch (patched on the class for this test)."""
    session_victims = set()
    make_encoder = server.app._encoder

    def encoder(g, req, *args, **kwargs):
        enc = make_encoder(g, req, *args, **kwargs)
        how = req.headers.get("x-test-fail")
        return enc if how is None else FaultyEncoder(enc, how, session_victims)
    monkeypatch.setattr(server.app, "_encoder", encoder)

    send_batch = H2Session.send_batch
    num_sent = [0]

    def faulty_send_batch(self, items):
        for item in items:                  # one at a time, so the items before a fault are framed
            if any(frames.payload(item).startswith(p) for p in session_victims):
                num_sent[0] += 1
                if num_sent[0] >= FAIL_AT:
                    raise InjectedFault("injected session fault")
            send_batch(self, [item])
    monkeypatch.setattr(H2Session, "send_batch", faulty_send_batch)


def sse(max_tokens: int) -> dict:
    return {"prompt": "hi", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


def metrics(server) -> dict:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def http1_stream(port: int, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return sock


def read_http1(sock: socket.socket) -> bytes:
    """Until the chunked body's last chunk, or until the server closes."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    return data


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached")


WHERE = {   # how -> (route, the victim's body, what the victim gets)
    "splice": ("/v1/completions", sse(VICTIM_TOKENS), "reset"),
    "token": ("/generate", {"prompt": "hi", "max_tokens": VICTIM_TOKENS, "ignore_eos": True}, "reset"),
    "headers": ("/v1/completions", sse(VICTIM_TOKENS), "500"),
    "first_token": ("/v1/completions", sse(VICTIM_TOKENS), "reset"),
    "finish": ("/v1/completions", sse(FAIL_AT + 4), "reset"),
    "session": ("/v1/completions", sse(VICTIM_TOKENS), "reset"),
}


@pytest.mark.parametrize("how", list(WHERE))
def test_a_stream_whose_write_raises_fails_alone(server, faults, how, caplog):
    caplog.set_level(logging.INFO)
    route, victim_body, expected = WHERE[how]
    before = metrics(server)
    a, b = RawH2("127.0.0.1", server.port), RawH2("127.0.0.1", server.port)
    try:
        a_sids = [a.post("/v1/completions", sse(NUM_TOKENS)) for _ in range(2)]
        victim = a.post(route, victim_body, headers=[("x-test-fail", how)])
        a_sids += [a.post("/v1/completions", sse(NUM_TOKENS)) for _ in range(2)]
        b_sids = [b.post("/v1/completions", sse(NUM_TOKENS)) for _ in range(3)]
        h1 = http1_stream(server.port, sse(NUM_TOKENS))
        a.read_until(lambda: a.ended >= set(a_sids) and (victim in a.ended or victim in a.resets))
        b.read_until(lambda: b.ended >= set(b_sids))
        h1_body = read_http1(h1)
        for c, sid in [(a, s) for s in a_sids] + [(b, s) for s in b_sids]:
            assert c.status[sid] == b"200" and sid not in c.resets
            assert c.data[sid].count(b"data: ") == NUM_TOKENS + 2 and c.data[sid].endswith(b"data: [DONE]\n\n")
        assert h1_body.count(b"data: ") == NUM_TOKENS + 2 and b"data: [DONE]" in h1_body
        if expected == "reset":
            assert a.resets.get(victim) == ErrorCodes.INTERNAL_ERROR and a.status[victim] == b"200"
        else:
            assert victim not in a.resets and a.status[victim] == b"500"
            error = json.loads(a.data[victim])["error"]
            assert error["code"] == "internal_error", error
        victim_id = dict(a.headers[victim])[b"x-request-id"].decode()
        # the connection keeps serving
        again = a.post("/v1/completions", sse(3))
        a.read_until(lambda: again in a.ended)
        assert a.data[again].count(b"data: ") == 5 and a.goaway is None
        # the victim's request is cancelled in the engine: its KV blocks are free
        wait_for(lambda: metrics(server)["tokenwire_requests_running"] == 0)
        after = metrics(server)
        assert after["tokenwire_kv_blocks_used"] == 0
        assert after["tokenwire_cancellations_total"] - before["tokenwire_cancellations_total"] == \
            (0 if how == "finish" else 1)       # a finishing request is over in the engine already
        assert after['tokenwire_requests_total{outcome="error"}'] - \
            before['tokenwire_requests_total{outcome="error"}'] == 1
    finally:
        a.close()
        b.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["tokenwire.net"], [r.getMessage() for r in errors]
    assert victim_id in errors[0].getMessage() and errors[0].exc_info is not None
    access = [r.getMessage() for r in caplog.records if r.name == "tokenwire.access" and victim_id in r.getMessage()]
    assert len(access) == 1 and (" 500 " in access[0] if expected == "500" else " 200 " in access[0]), access


def test_an_http1_stream_whose_write_raises_is_cut_short(server, faults, caplog):
    """HTTP/1.1 has no stream reset: the victim's connection closes before the last chunk; a
    concurrent HTTP/2 stream is untouched."""
    caplog.set_level(logging.INFO)
    c = RawH2("127.0.0.1", server.port)
    try:
        sid = c.post("/v1/completions", sse(NUM_TOKENS))
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        raw = json.dumps(sse(VICTIM_TOKENS)).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"x-test-fail: splice\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
        body = read_http1(sock)
        c.read_until(lambda: sid in c.ended)
    finally:
        c.close()
    assert body.startswith(b"HTTP/1.1 200") and not body.endswith(b"\r\n0\r\n\r\n")
    assert b"data: [DONE]" not in body and body.count(b"data: ") >= FAIL_AT - 1
    assert c.data[sid].count(b"data: ") == NUM_TOKENS + 2
    wait_for(lambda: metrics(server)["tokenwire_requests_running"] == 0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["tokenwire.net"], [r.getMessage() for r in errors]


# ------------------------------------------------ the same, without sockets

class Conn:
    """A ServerProtocol's part the step writer uses: its session, its outbox, flush, the transport."""

    def __init__(self, session, flush_raises: bool = False):
        self.session = session
        self.outbox = Outbox(self)
        self.flush_raises = flush_raises
        self.written = b""
        self.aborted = False
        self.transport = self

    def flush(self):
        if self.flush_raises:
            raise InjectedFault("injected flush fault")
        self.written += self.session.data_to_send()

    def abort(self):
        self.aborted = True

    def get_extra_info(self, name):
        return None


def h2_pair(sids):
    c = client()
    s = H2Session(Limits())
    handshake(c, s, sids)
    for sid in sids:
        s.start_response(sid, 200, ((b"content-type", b"text/event-stream"),))
    s.data_to_send()
    return c, s


def test_a_chunk_that_raises_in_the_batch_fails_its_stream_and_the_rest_go_out_exactly():
    """The outbox's slow path after a fault: the same bytes and windows as a batch without the
    faulty stream's chunks (its stream was reset after its exchange took its data key:
    framing a chunk for it raises KeyError)."""
    _, s = h2_pair((1, 3, 5))
    _, ref = h2_pair((1, 3, 5))
    keys = {sid: s.data_key(sid) for sid in (1, 3, 5)}
    for session in (s, ref):
        session.reset_stream(3)
        session.data_to_send()
    items = [(sid, bytes([65 + i]) * (10 + i)) for i, sid in enumerate((1, 3, 5, 1, 3, 5))]
    conn = Conn(s)
    conn.outbox.sends.extend((keys[sid], p) for sid, p in items)
    conn.outbox.write_step()
    ref.send_batch([(ref.data_key(sid), p) for sid, p in items if sid != 3])
    assert conn.written == ref.data_to_send() and s.send_window == ref.send_window
    assert [(key.id, type(exc)) for key, exc in conn.outbox.failed] == [(3, KeyError)]
    assert conn.outbox.sends == []


@pytest.mark.parametrize("started", [False, True])
def test_h2_fail_response_answers_500_or_resets(started):
    c, s = h2_pair(())
    handshake(c, s, (1,))
    if started:
        s.start_response(1, 200, ((b"content-type", b"text/event-stream"),))
        s.send_data(1, b"data: x\n\n")
    assert s.fail_response(1, 500, [(b"content-type", b"application/json")], b'{"error":{}}') is not started
    events = pump(c, s)
    if started:
        assert type(events[-1]) is h2.events.StreamReset and events[-1].error_code == ErrorCodes.INTERNAL_ERROR
    else:
        assert dict(next(e for e in events if isinstance(e, h2.events.ResponseReceived)).headers)[b":status"] == b"500"
        assert data_by_stream(events) == {1: b'{"error":{}}'}
        assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    assert s.fail_response(1, 500, [], b"") is False and s.data_to_send() == b""      # gone: nothing more


@pytest.mark.parametrize("started", [False, True])
def test_h1_fail_response_answers_500_or_closes(started):
    s = H1Session(Limits())
    (req,) = s.receive_data(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    if started:
        s.start_response(req.stream_id, 200, [(b"content-type", b"text/event-stream")])
        s.send_data(req.stream_id, b"data: x\n\n")
    assert s.fail_response(req.stream_id, 500, [(b"content-type", b"application/json")], b"{}") is not started
    out = s.data_to_send()
    if started:
        assert s.wants_close and not out.endswith(b"0\r\n\r\n")
    else:
        assert out.startswith(b"HTTP/1.1 500") and out.endswith(b"\r\n\r\n{}") and not s.wants_close


def test_a_connection_whose_flush_raises_is_aborted_and_the_others_are_written():
    d = Dispatcher(Metrics())
    cancelled = []
    d.engine = type("Engine", (), {"cancel": lambda self, rid: cancelled.append(rid)})()
    step = StepTokens([], 1)
    conns = []
    for n, flush_raises in enumerate((True, False)):
        _, s = h2_pair((1, 3))
        conn = Conn(s, flush_raises)
        conns.append(conn)
        for sid in (1, 3):
            rid = 10 * n + sid
            enc = encoders.CompletionSse(f"cmpl-{rid}", 0, "m", False, lambda i: "")
            ex = Exchange(rid, conn, sid, COMPLETION, enc, True, Timeline(arrived_ns=0), f"cmpl-{rid}", 0, False)
            ex.last_ns = 1
            d.add(ex)
            step.request_ids.append(rid)
            step.token_ids.append(7)
            step.texts.append(" a")
    d.write_step(step)
    assert conns[0].aborted and sorted(cancelled) == [1, 3] and sorted(d.exchanges) == [11, 13]
    assert not conns[1].aborted and conns[1].written.count(b'" a"') == 2
