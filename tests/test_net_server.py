"""The server over real sockets with real clients: curl (h2c prior knowledge, h2c upgrade, TLS
ALPN h2, HTTP/1.1), nghttp, h2load, Node's http2 module, the OpenAI Python SDK (its default
HTTP/1.1 client and an httpx HTTP/2 client), plus a raw h2 client for resets and windows.

The whole module runs twice: once on asyncio's event loop and once on uvloop. The engine is
the mock (kernels/mock.py), so the tests measure the network layer, not a model.
"""

import json
import os
import shutil
import struct
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tokenwire
from tokenwire.net.protocol.events import Limits

from clients.rawh2 import RawH2
from clients.tls import self_signed_cert

HERE = os.path.dirname(os.path.abspath(__file__))
MOCK_START = "Once upon a time, there was a little robot named Tok."

for tool in ("curl", "nghttp", "h2load", "node"):
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is not installed; scripts/test.sh installs curl, nghttp2-client and nodejs",
                    pytrace=False)


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def loop_kind(request):
    return request.param


@pytest.fixture(scope="module")
def server(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow_server(loop_kind):
    """20 ms per engine step: long enough to act, and to read /metrics, between two steps."""
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, mock_step_us=20000).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for localhost / 127.0.0.1 (clients/tls.py)."""
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(loop_kind, tls_files):
    cert, key = tls_files
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, tls_cert=cert, tls_key=key).start()
    yield s
    s.stop()


def completion_body(max_tokens=8, **extra):
    return json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "stream": True, **extra})


def curl(*args, timeout=30):
    r = subprocess.run(["curl", "-sS", "--fail-with-body", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"curl {args} failed ({r.returncode}): {r.stderr} {r.stdout}"
    return r


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


def completion_text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def metrics(url) -> dict:
    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name if not sample.labels else (sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


# ------------------------------------------------------------------ curl

def test_curl_http2_prior_knowledge_streams(server):
    r = curl("-v", "--http2-prior-knowledge", "-H", "content-type: application/json",
             "-d", completion_body(8), server.url + "/v1/completions")
    assert "< HTTP/2 200" in r.stderr
    assert "< server-timing: tokenize;dur=" in r.stderr          # the trailer
    events = sse_events(r.stdout)
    assert len(events) == 9 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert set(events[-1]["timings"]) >= {"ttft_us", "queue_us", "total_us"}
    assert MOCK_START.startswith(completion_text(events))


def test_curl_h2c_upgrade_streams(server):
    r = curl("-v", "--http2", "-H", "content-type: application/json",
             "-d", completion_body(8), server.url + "/v1/completions")
    assert "< HTTP/1.1 101" in r.stderr and "< HTTP/2 200" in r.stderr
    assert len(sse_events(r.stdout)) == 9


def test_curl_tls_alpn_h2_streams(tls_server, tls_files):
    r = curl("-v", "--cacert", tls_files[0], "--http2", "-H", "content-type: application/json",
             "-d", completion_body(8), tls_server.url.replace("127.0.0.1", "localhost") + "/v1/completions")
    assert "ALPN: server accepted h2" in r.stderr and "< HTTP/2 200" in r.stderr
    assert MOCK_START.startswith(completion_text(sse_events(r.stdout)))


FAMILY_STREAMS = {"/v1/responses": ({"input": "Hello", "max_output_tokens": 8, "stream": True},
                                     "response.output_text.delta", "response.completed"),
                  "/v1/messages": ({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                                    "stream": True}, "content_block_delta", "message_stop")}


@pytest.mark.parametrize("mode", ["prior-knowledge", "h2c-upgrade", "tls"])
@pytest.mark.parametrize("path", list(FAMILY_STREAMS))
def test_curl_streams_the_api_families_in_every_http2_mode(server, tls_server, tls_files, path, mode):
    """/v1/responses and /v1/messages stream their typed events over HTTP/2 reached all three
    ways, with the server-timing trailer, one delta event per token."""
    body, delta, last = FAMILY_STREAMS[path]
    args = {"prior-knowledge": ["--http2-prior-knowledge", server.url + path],
            "h2c-upgrade": ["--http2", server.url + path],
            "tls": ["--cacert", tls_files[0], "--http2", tls_server.url.replace("127.0.0.1", "localhost") + path]}[mode]
    r = curl("-v", "-H", "content-type: application/json", "-d", json.dumps(body), *args)
    assert "< HTTP/2 200" in r.stderr and "< server-timing: tokenize;dur=" in r.stderr
    assert ("< HTTP/1.1 101" in r.stderr) == (mode == "h2c-upgrade")
    names = [block.split("\n", 1)[0] for block in r.stdout.split("\n\n") if block]
    assert names.count(f"event: {delta}") == 8 and names[-1] == f"event: {last}", names


def test_curl_tls_http11(tls_server, tls_files):
    r = curl("-v", "--cacert", tls_files[0], "--http1.1", tls_server.url.replace("127.0.0.1", "localhost") + "/health")
    assert "ALPN: server accepted http/1.1" in r.stderr and r.stdout == '{"status":"ok"}'


def test_curl_http11_streams(server):
    r = curl("-v", "--http1.1", "-H", "content-type: application/json", "-d", completion_body(8),
             server.url + "/v1/completions")
    assert "< HTTP/1.1 200 OK" in r.stderr and "< Transfer-Encoding: chunked" in r.stderr
    assert len(sse_events(r.stdout)) == 9


def test_curl_http11_keepalive_serves_several_requests(server):
    url = server.url + "/health"
    r = curl("-v", "--http1.1", url, url, url)
    assert r.stdout == '{"status":"ok"}' * 3
    assert r.stderr.count("Re-using existing connection") == 2


# ------------------------------------------------------------- nghttp2

def test_nghttp_one_data_frame_per_token(server, tmp_path):
    body = tmp_path / "body.json"
    body.write_text(completion_body(12))
    r = subprocess.run(["nghttp", "-nv", "-d", str(body), "-H", "content-type: application/json",
                        server.url + "/v1/completions"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    frames = [line for line in r.stdout.splitlines() if "recv DATA frame" in line]
    assert len(frames) == 12 + 1          # one per token, then the finish chunk with [DONE]
    assert "recv HEADERS frame" in r.stdout and "server-timing" in r.stdout


def test_nghttp_one_byte_window_receives_everything(server, tmp_path):
    body = tmp_path / "body.json"
    body.write_text(completion_body(6))
    r = subprocess.run(["nghttp", "-w", "1", "-d", str(body), "-H", "content-type: application/json",
                        server.url + "/v1/completions"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(sse_events(r.stdout)) == 7


def test_h2load_thousands_of_requests_without_errors(server, tmp_path):
    body = tmp_path / "body.json"
    body.write_text(completion_body(4))
    r = subprocess.run(["h2load", "-n", "3000", "-c", "4", "-m", "16", "-d", str(body),
                        "-H", "content-type: application/json", server.url + "/v1/completions"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3000 succeeded, 0 failed, 0 errored, 0 timeout" in r.stdout, r.stdout
    assert "status codes: 3000 2xx" in r.stdout


# -------------------------------------------------------------- Node.js

def test_node_http2_client_streams(server):
    script = os.path.join(HERE, "clients", "h2_stream.mjs")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True})
    r = subprocess.run(["node", script, server.url, "/v1/chat/completions", body],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == 200 and out["headers"]["content-type"] == "text/event-stream"
    assert len(out["chunks"]) == 7            # Node sees the DATA frames one by one
    events = sse_events("".join(out["chunks"]))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "ttft" in out["trailers"]["server-timing"]


# ---------------------------------------------------------- OpenAI SDK

@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_openai_sdk_streams_chat_and_completions(server, http2):
    # httpx speaks HTTP/2 over plain TCP only with prior knowledge, i.e. with HTTP/1.1 off
    with httpx.Client(http1=not http2, http2=http2) as http_client:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http_client)
        stream = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=7, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert MOCK_START.startswith(text) and len(text) > 10
        assert chunks[-1].usage.completion_tokens == 7
        completion = "".join(c.choices[0].text for c in client.completions.create(
            model="mock", prompt="hi", max_tokens=7, stream=True))
        assert completion == text
        whole = client.completions.create(model="mock", prompt="hi", max_tokens=7)
        assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
        response = http_client.get(server.url + "/health")
        assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")


# ------------------------------------------------------- native stream

def test_generate_ndjson(server):
    lines = httpx.post(server.url + "/generate", json={"prompt": "hi", "max_tokens": 5}).text.splitlines()
    tokens, final = [json.loads(x) for x in lines[:-1]], json.loads(lines[-1])
    assert len(tokens) == 5 and all(set(t) == {"id", "text"} for t in tokens)
    assert MOCK_START.startswith("".join(t["text"] for t in tokens))
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 5
    assert final["timings"]["total_us"] > 0


def test_generate_binary(server):
    r = httpx.post(server.url + "/generate", json={"prompt_token_ids": [5, 6, 7], "max_tokens": 6},
                   headers={"accept": "application/octet-stream"})
    data = r.content
    ids = []
    while True:
        (value,) = struct.unpack_from("<i", data, 4 * len(ids))
        if value < 0:
            break
        ids.append(value)
    offset = 4 * len(ids) + 4
    (length,) = struct.unpack_from("<I", data, offset)
    summary = json.loads(data[offset + 4:offset + 4 + length])
    assert offset + 4 + length == len(data)
    assert len(ids) == 6 and summary["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                                    "prompt_tokens_details": {"cached_tokens": 0}}
    ndjson = [json.loads(x) for x in httpx.post(server.url + "/generate", json={
        "prompt_token_ids": [5, 6, 7], "max_tokens": 6}).text.splitlines()[:-1]]
    assert [t["id"] for t in ndjson] == ids


# ------------------------------------------------------- info routes

def test_health_models_and_metrics_exposition(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "mock" and models["data"][0]["object"] == "model"
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    m = metrics(server.url)            # prometheus_client's parser accepts the whole exposition
    for name in ("tokenwire_kv_blocks_used", "tokenwire_kv_blocks_total", "tokenwire_requests_running",
                 "tokenwire_requests_waiting", "tokenwire_preemptions_total", "tokenwire_cancellations_total",
                 "tokenwire_generated_tokens_total", "tokenwire_time_to_first_token_seconds_count",
                 "tokenwire_inter_token_latency_seconds_count", "tokenwire_queue_time_seconds_count",
                 "tokenwire_engine_step_seconds_count", "tokenwire_engine_to_wire_seconds_count",
                 "tokenwire_e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["tokenwire_kv_blocks_total"] > 0
    assert ("tokenwire_time_to_first_token_seconds_bucket", (("le", "0.0001"),)) in m     # sub-ms buckets
    assert m["tokenwire_time_to_first_token_seconds_count"] >= 1                       # the request above
    assert m["tokenwire_inter_token_latency_seconds_count"] >= 2
    assert m[("tokenwire_requests_total", (("outcome", "length"),))] >= 1


# --------------------------------------------------------- flow control

def test_many_streams_on_one_connection_with_tiny_windows(server):
    c = RawH2("127.0.0.1", server.port, window=16)
    try:
        sids = [c.post("/generate", {"prompt": "hi", "max_tokens": 20}) for _ in range(8)]
        c.read_until(lambda: c.ended >= set(sids))
    finally:
        c.close()
    tokens = [c.data[s].splitlines()[:-1] for s in sids]   # the last line holds per-request timings
    assert len(tokens[0]) == 20 and all(t == tokens[0] for t in tokens)


def test_stalled_stream_does_not_stall_the_others(server):
    """A stream whose reader never opens its window stays queued; the others complete."""
    c = RawH2("127.0.0.1", server.port, window=0)
    try:
        stalled = c.post("/generate", {"prompt": "hi", "max_tokens": 30})
        others = [c.post("/generate", {"prompt": "hi", "max_tokens": 30}) for _ in range(3)]
        for sid in others:
            c.conn.increment_flow_control_window(1 << 20, stream_id=sid)
        c.flush()
        c.read_until(lambda: c.ended >= set(others))
        assert stalled not in c.ended and not c.data.get(stalled)
        c.conn.increment_flow_control_window(1 << 20, stream_id=stalled)
        c.flush()
        c.read_until(lambda: stalled in c.ended)
    finally:
        c.close()
    assert c.data[stalled].splitlines()[:-1] == c.data[others[0]].splitlines()[:-1]


def test_transport_back_pressure_pauses_then_resumes(server):
    """A client that stops reading fills the socket: the transport pauses the session's output,
    which stays queued in the session and leaves, complete and in order, once the client reads."""
    c = RawH2("127.0.0.1", server.port, window=2**31 - 1, rcvbuf=4096)
    try:
        c.conn.increment_flow_control_window(2**31 - 1 - 65535)
        c.flush()
        # ~3.6 MB of SSE: more than the kernel's socket buffers hold while the client does not read
        sids = [c.post("/v1/completions", {"prompt": "hi", "max_tokens": 3000, "stream": True}) for _ in range(8)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(p.paused for p in list(server.app.connections)):
            time.sleep(0.005)
        assert any(p.paused for p in list(server.app.connections)), "the transport never paused"
        c.read_until(lambda: c.ended >= set(sids))
    finally:
        c.close()
    texts = {completion_text(sse_events(c.data[sid].decode())) for sid in sids}
    assert len(texts) == 1 and MOCK_START in texts.pop()
    assert all(c.data[sid].count(b"data: ") == 3002 for sid in sids)


def test_tcp_nodelay_is_set(server):
    import socket as socketlib
    c = RawH2("127.0.0.1", server.port)
    try:
        sid = c.get("/health")
        c.read_until(lambda: sid in c.ended)
        socks = [p.transport.get_extra_info("socket") for p in list(server.app.connections)]
        assert socks and all(s.getsockopt(socketlib.IPPROTO_TCP, socketlib.TCP_NODELAY) for s in socks)
    finally:
        c.close()


# -------------------------------------------------------- cancellation

def _wait_blocks_free(url, steps_before, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["tokenwire_kv_blocks_used"] == 0 and m["tokenwire_requests_running"] == 0:
            return m
        time.sleep(0.001)
    raise AssertionError(f"KV blocks still used after {timeout} s: {m['tokenwire_kv_blocks_used']}")


@pytest.mark.parametrize("how", ["rst_stream", "tcp_close"])
def test_client_going_away_frees_kv_blocks_within_a_step(slow_server, how):
    c = RawH2("127.0.0.1", slow_server.port)
    sid = c.post("/v1/completions", {"prompt": "hello " * 40, "max_tokens": 2000, "stream": True})
    c.read_until(lambda: c.data.get(sid, b"").count(b"data:") >= 3)
    before = metrics(slow_server.url)
    assert before["tokenwire_kv_blocks_used"] > 0 and before["tokenwire_requests_running"] == 1
    cancelled = before["tokenwire_cancellations_total"]
    if how == "rst_stream":
        c.reset(sid)
    else:
        c.close()
    after = _wait_blocks_free(slow_server.url, before["tokenwire_engine_steps_total"])
    # the cancel lands in the engine's inbox; the step in flight finishes, the next one frees the blocks
    assert after["tokenwire_engine_steps_total"] - before["tokenwire_engine_steps_total"] <= 3
    assert after["tokenwire_cancellations_total"] == cancelled + 1
    if how == "rst_stream":      # the connection itself is still good
        sid2 = c.get("/health")
        c.read_until(lambda: sid2 in c.ended)
        assert c.data[sid2] == b'{"status":"ok"}'
        c.close()


def test_resets_racing_the_stream_never_break_the_connection(server):
    """A request reset in the same write that sends it, and streams reset while a step for them
    is already waiting to be written: the reset streams get nothing more, every other stream on
    the connection completes, and the connection keeps serving (either race used to end the
    connection with a KeyError from the session)."""
    c = RawH2("127.0.0.1", server.port)
    try:
        for _ in range(20):
            sid = c.conn.get_next_available_stream_id()
            c.conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                                      (":authority", c.host), ("content-type", "application/json")])
            c.conn.send_data(sid, b'{"prompt": "hi", "max_tokens": 50, "stream": true}', end_stream=True)
            c.conn.reset_stream(sid)
            c.flush()
        num_reset = 0
        for _ in range(5):
            sids = [c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2000, "stream": True})
                    for _ in range(16)]
            c.read_until(lambda: all(c.data.get(x, b"").count(b"data:") >= 2 for x in sids))
            # half of them, those still streaming (the KV cache may have let some finish first)
            reset = [x for x in sids[::2] if x not in c.ended]
            num_reset += len(reset)
            for x in reset:
                c.reset(x)
            rest = [x for x in sids if x not in reset]
            c.read_until(lambda: all(x in c.ended for x in rest))
            assert all(c.data[x].endswith(b"data: [DONE]\n\n") for x in rest)
        assert num_reset >= 8
        sid = c.get("/health")
        c.read_until(lambda: sid in c.ended)
        assert c.data[sid] == b'{"status":"ok"}'
    finally:
        c.close()


# --------------------------------------------------------- connection life

def test_idle_connection_is_closed(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, limits=Limits(idle_timeout_s=0.2)).start()
    try:
        c = RawH2("127.0.0.1", s.port)
        sid = c.get("/health")
        c.read_until(lambda: sid in c.ended)
        t0 = time.monotonic()
        c.read_until(lambda: c.goaway is not None)
        assert c.goaway.error_code == 0 and time.monotonic() - t0 < 2.0
        c.close()
    finally:
        s.stop()


def test_trace_file_is_chrome_trace_json(loop_kind, tmp_path):
    path = tmp_path / "trace.json"
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, trace=str(path)).start()
    try:
        httpx.post(s.url + "/generate", json={"prompt": "hi", "max_tokens": 4})
    finally:
        s.stop()
    events = json.loads(path.read_text())
    names = {e["name"] for e in events}
    assert {"tokenize", "queue", "decode", "request", "token"} <= names
    assert sum(e["name"] == "token" for e in events) == 4
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
