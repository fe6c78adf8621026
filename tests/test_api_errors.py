"""One test per bad input: the right status, an OpenAI-style error body, and the server goes
on serving other requests. Runs on asyncio and on uvloop, over HTTP/2 (httpx with prior
knowledge) and, where HTTP/1.1 behaves differently, over HTTP/1.1.
"""

import contextlib
import json
import re
import socket
import threading

import httpx
import pytest

import tokenwire
from tokenwire.net.protocol.events import Limits

MAX_MODEL_LEN = 64
MAX_BODY = 4000


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def loop_kind(request):
    return request.param


@pytest.fixture(scope="module")
def server(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, max_model_len=MAX_MODEL_LEN,
                         limits=Limits(max_body_bytes=MAX_BODY)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def h2(server):
    with httpx.Client(http1=False, http2=True, base_url=server.url, timeout=10) as client:
        yield client


def check_error(response, status, *, param=None, code=None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def still_serving(client):
    lines = client.post("/generate", json={"prompt": "ok", "max_tokens": 2}).text.splitlines()
    assert json.loads(lines[-1])["finish_reason"] == "length"


def post_raw(client, path, content, content_type="application/json"):
    return client.post(path, content=content, headers={"content-type": content_type})


# ------------------------------------------------------------------- 400

def test_malformed_json(h2):
    error = check_error(post_raw(h2, "/v1/completions", b'{"prompt": "hi",'), 400, code="invalid_json")
    assert "not valid JSON" in error["message"]
    still_serving(h2)


def test_non_utf8_body(h2):
    error = check_error(post_raw(h2, "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400, code="invalid_encoding")
    assert "UTF-8" in error["message"]
    still_serving(h2)


def test_body_not_an_object(h2):
    check_error(post_raw(h2, "/v1/completions", b"[1, 2]"), 400, code="invalid_json")
    still_serving(h2)


def test_wrong_type(h2):
    error = check_error(h2.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"}), 400,
                        param="temperature")
    assert "must be a number" in error["message"]
    check_error(h2.post("/v1/completions", json={"prompt": "hi", "max_tokens": True}), 400, param="max_tokens")
    still_serving(h2)


@pytest.mark.parametrize("param,value", [("top_p", 2.0), ("temperature", -1), ("max_tokens", 0),
                                         ("top_k", -3), ("presence_penalty", 9), ("seed", -1)])
def test_out_of_range(h2, param, value):
    check_error(h2.post("/v1/completions", json={"prompt": "hi", param: value}), 400, param=param)
    still_serving(h2)


def test_prompt_longer_than_context(h2):
    error = check_error(h2.post("/v1/completions", json={"prompt": "tok " * 200}), 400, param="prompt",
                        code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    check_error(h2.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "tok " * 200}]}),
                400, param="messages", code="context_length_exceeded")
    still_serving(h2)


@pytest.mark.parametrize("max_tokens", [1, 4, MAX_MODEL_LEN])
def test_prompt_longer_than_context_whatever_max_tokens_says(h2, max_tokens):
    """Not "the context leaves -210 tokens ... ask for at most -210": the prompt is the problem."""
    for body, param in (({"prompt": "tok " * 200}, "prompt"),
                        ({"prompt": list(range(5, 5 + MAX_MODEL_LEN + 10))}, "prompt"),
                        ({"messages": [{"role": "user", "content": "tok " * 200}]}, "messages")):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        error = check_error(h2.post(route, json={**body, "max_tokens": max_tokens}), 400, param=param,
                            code="context_length_exceeded")
        assert not re.search(r"-\d", error["message"]), error["message"]
    still_serving(h2)


def test_unsupported_parameters_are_refused_not_ignored(h2):
    check_error(h2.post("/v1/completions", json={"prompt": "hi", "n": 99}), 400, param="n")
    check_error(h2.post("/v1/completions", json={"prompt": "hi", "echo": True}), 400, param="echo")
    check_error(h2.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "tools": [{"type": "function"}]}), 400, param="tools")
    check_error(h2.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, param="prompt")
    check_error(h2.post("/v1/completions", json={"prompt": "hi", "logprobs": 2}), 400, param="logprobs")
    still_serving(h2)


def test_bad_messages(h2):
    check_error(h2.post("/v1/chat/completions", json={"messages": []}), 400, param="messages")
    check_error(h2.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400,
                param="messages")
    check_error(h2.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}), 400, param="messages")
    check_error(h2.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "stream_options": {"include_usage": True}}), 400,
                param="stream_options")
    still_serving(h2)


def test_wrong_model_name(h2):
    check_error(h2.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}), 404, param="model",
                code="model_not_found")
    still_serving(h2)


def test_prompt_token_outside_vocabulary(h2):
    check_error(h2.post("/v1/completions", json={"prompt": [1, 2, 10**9]}), 400, param="prompt")
    still_serving(h2)


# -------------------------------------------------------------- 404 / 405

def test_unknown_path(h2):
    error = check_error(h2.get("/v2/everything"), 404, code="unknown_url")
    assert "/v2/everything" in error["message"]
    still_serving(h2)


def test_wrong_method(h2):
    response = h2.get("/v1/completions")
    check_error(response, 405, code="method_not_allowed")
    assert response.headers["allow"] == "POST"
    check_error(h2.delete("/health"), 405, code="method_not_allowed")
    still_serving(h2)


# -------------------------------------------------------------- 413 / 415

def test_body_over_limit_http2(h2):
    error = check_error(h2.post("/v1/completions", json={"prompt": "x" * (MAX_BODY + 10)}), 413,
                        code="body_too_large")
    assert str(MAX_BODY) in error["message"]
    still_serving(h2)


def test_body_over_limit_http1(server):
    with httpx.Client(base_url=server.url) as h1:
        check_error(h1.post("/v1/completions", json={"prompt": "x" * (MAX_BODY + 10)}), 413, code="body_too_large")
        still_serving(h1)


def test_wrong_content_type(h2):
    error = check_error(post_raw(h2, "/v1/completions", b"prompt=hi", "application/x-www-form-urlencoded"),
                        415, code="unsupported_media_type")
    assert "application/json" in error["message"]
    still_serving(h2)


def test_malformed_http11_request(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    with httpx.Client(base_url=server.url) as h1:
        still_serving(h1)


# ------------------------------------------------------------------- 401

def test_api_key(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, api_key="s3cret").start()
    try:
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
                response = client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
                check_error(response, 401, code="invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
            check_error(client.get("/v1/models"), 401, code="invalid_api_key")
            assert client.get("/health").status_code == 200        # probes stay open
            ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             headers={"authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        s.stop()


# ------------------------------------------------------------------- 429

def test_queue_full(loop_kind):
    with full_queue(loop_kind) as client:
        response = client.post("/generate", json={"prompt": "hi", "max_tokens": 2})
        error = check_error(response, 429, code="queue_full")
        assert response.headers["retry-after"] == "1" and "queue is full" in error["message"]


@contextlib.contextmanager
def full_queue(loop_kind):
    """A server whose one sequence slot runs a request and whose queue of one holds another: the
    body's requests find the queue full. -> an HTTP/2 client. The running request (1,000 steps of
    20 ms) is held on a raw HTTP/1.1 socket for as long as the body runs, whatever the machine's
    speed; on exit that socket is closed, which cancels it, and the waiting request must then be
    served (a cancel frees its slot for the queue) and the server must still serve. The waiting
    request has a client of its own: httpx's HTTP/2 connection, shared by threads, lets a thread
    blocked on one stream's response hold back every other stream's (a /metrics read waited 20 s
    behind the queued request's)."""
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, mock_step_us=20000, max_num_seqs=1,
                         max_queued_requests=1).start()
    running = None
    try:
        with httpx.Client(http1=False, http2=True, base_url=s.url, timeout=30) as client:
            body = json.dumps({"prompt": "hi", "max_tokens": 1000}).encode()
            running = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            running.sendall(b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n" % len(body) + body)
            _wait_for(lambda: _gauge(client, "tokenwire_requests_running") == 1)
            results = {}

            def wait_in_queue():
                with httpx.Client(http1=False, http2=True, base_url=s.url, timeout=30) as own:
                    results["waiting"] = own.post("/generate", json={"prompt": "hi", "max_tokens": 2})

            waiting = threading.Thread(target=wait_in_queue)
            waiting.start()
            _wait_for(lambda: _gauge(client, "tokenwire_requests_waiting") == 1)
            yield client
            running.close()
            waiting.join(10)                # the running request had ~20 s left: only its cancel frees the slot
            assert not waiting.is_alive() and results["waiting"].status_code == 200
            last = json.loads(results["waiting"].text.splitlines()[-1])
            assert last["usage"]["completion_tokens"] == 2
            _wait_for(lambda: _gauge(client, "tokenwire_requests_running") == 0)
            still_serving(client)
    finally:
        if running is not None:
            running.close()
        s.stop()


def _gauge(client, name) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def _wait_for(predicate, timeout=10.0):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.002)
    raise AssertionError("condition not reached")


# ------------------------------------------------------------------- 503

def test_model_not_ready(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind).start()
    try:
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:
            assert client.get("/health").status_code == 200
            s.engine.shutdown(timeout=5)            # the engine thread is gone: not ready any more
            error = check_error(client.get("/health"), 503, code="model_not_ready")
            assert "engine" in error["message"]
            response = client.post("/v1/completions", json={"prompt": "hi"})
            check_error(response, 503, code="model_not_ready")
            assert response.headers["retry-after"] == "1"
            assert client.get("/metrics").status_code == 200   # the server itself still answers
    finally:
        s.stop()


def test_model_that_fails_to_load_is_reported(loop_kind, tmp_path):
    s = tokenwire.Server(str(tmp_path / "no-such-engine"), backend="reference", port=0, loop=loop_kind)
    with pytest.raises(RuntimeError, match="failed to start"):
        s.start(timeout=60)
    s.stop()


# ------------------------------------------------- header and stream limits

def test_header_list_over_limit(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, limits=Limits(max_header_list_size=2048)).start()
    try:
        big = {"x-big": "y" * 4000}
        with httpx.Client(base_url=s.url) as h1:              # HTTP/1.1: 431 from the header parser
            response = h1.get("/health", headers=big)
            assert response.status_code == 431 and response.json()["error"]["type"] == "invalid_request_error"
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:   # HTTP/2: the connection is refused
            with pytest.raises(httpx.RemoteProtocolError):
                client.get("/health", headers=big)
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:
            still_serving(client)
    finally:
        s.stop()


def test_max_concurrent_streams_over_the_limit_are_refused_one_by_one(loop_kind):
    """Streams opened before the client saw our SETTINGS (RFC 7540 5.1.2) get REFUSED_STREAM;
    the connection and the streams within the limit carry on."""
    import subprocess
    from h2.errors import ErrorCodes
    from clients.rawh2 import RawH2
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, mock_step_us=1000,
                         limits=Limits(max_concurrent_streams=2)).start()
    try:
        c = RawH2("127.0.0.1", s.port)
        sids = [c.post("/generate", {"prompt": "hi", "max_tokens": 5}) for _ in range(5)]
        c.read_until(lambda: len(c.ended) + len(c.resets) == 5)
        assert sorted(c.ended) == sids[:2] and sorted(c.resets) == sids[2:]
        assert set(c.resets.values()) == {ErrorCodes.REFUSED_STREAM}
        again = c.get("/health")
        c.read_until(lambda: again in c.ended)
        assert c.data[again] == b'{"status":"ok"}'
        c.close()
        v = subprocess.run(["nghttp", "-nv", s.url + "/health"], capture_output=True, text=True, timeout=30).stdout
        assert "SETTINGS_MAX_CONCURRENT_STREAMS(0x03):2" in v
    finally:
        s.stop()


# ------------------------------------------------------------ engine errors

def _failing_server(loop_kind, fail_from_step: int):
    """The mock engine, made to raise from its `fail_from_step`-th step on (a device lost mid-stream)."""
    from tokenwire.core.engine_core import EngineCore
    from tokenwire.kernels.mock import MockExecutor
    from tokenwire.net.api.model_info import ModelInfo

    class FailingExecutor(MockExecutor):
        def sample(self, seqs):
            if self.num_steps + 1 >= fail_from_step:
                raise RuntimeError("device lost")
            return super().sample(seqs)

    executor = FailingExecutor(max_model_len=512)
    engine = EngineCore(executor, executor.tokenizer, eos_token_ids=(1,), max_model_len=512)
    tok = executor.tokenizer
    info = ModelInfo("mock", tok, lambda text: tok.encode(text, add_special_tokens=False).ids, None, 512, 0,
                     "failing mock", False)
    return tokenwire.Server(port=0, loop=loop_kind, engine=engine, model_info=info).start()


def test_engine_failure_before_the_first_token_is_a_500(loop_kind):
    s = _failing_server(loop_kind, fail_from_step=1)
    try:
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:
            for stream in (False, True):
                response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": stream})
                error = check_error(response, 500, code="engine_error")
                assert "device lost" in error["message"]
            assert client.get("/health").status_code == 200      # the engine thread lives on
    finally:
        s.stop()


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_chunk(loop_kind):
    s = _failing_server(loop_kind, fail_from_step=4)
    try:
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:
            text = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10, "stream": True}).text
        events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "error" and "device lost" in last["error"]["message"]
        assert len(events) == 3 + 2                              # 3 tokens, the error chunk, [DONE]
    finally:
        s.stop()
