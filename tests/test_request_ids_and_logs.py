"""Every response names its request, and the log says what happened (issue 25, points 8-9).

- Every response carries `x-request-id`, streamed or whole, on every route, errors included,
  over HTTP/2 and HTTP/1.1 (and gRPC's, as metadata): a generation's is its response id
  (the body's "id"), any other's `req-N`. The access line ends with the same id.
- A request the engine fails is a WARNING naming its id and the engine's reason.
- A 413's access line has the method and path; a gRPC call's has its grpc-status beside the
  HTTP status; the unknown-parameter line names the route.
- llguidance writes nothing to stderr: a refused token is a WARNING in the log's format.
Against real servers on 127.0.0.1 (the mock engine)."""

import json
import logging
import socket

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

import tokenwire
from tokenwire.core.constraint import ConstraintSpec
from tokenwire.core.engine_core import EngineCore
from tokenwire.kernels.grammar import GrammarCompiler
from tokenwire.kernels.mock import MockExecutor, build_mock_tokenizer
from tokenwire.net.api import grpc as tw_grpc
from tokenwire.net.api import grpc_schema
from tokenwire.net.api.model_info import ModelInfo
from tokenwire.net.protocol.events import Limits

MAX_BODY = 2048
GENERATE = "/tokenwire.v1.Generator/Generate"


@pytest.fixture(scope="module")
def server():
    s = tokenwire.Server(backend="mock", port=0, max_model_len=256, limits=Limits(max_body_bytes=MAX_BODY)).start()
    yield s
    s.stop()


class FailingExecutor(MockExecutor):
    def sample(self, seqs):
        raise RuntimeError("device lost")


@pytest.fixture(scope="module")
def failing():
    """The mock engine, every step of which raises: every request fails in the engine."""
    executor = FailingExecutor(max_model_len=256)
    engine = EngineCore(executor, executor.tokenizer, eos_token_ids=(1,), max_model_len=256)
    tok = executor.tokenizer
    info = ModelInfo("mock", tok, lambda text: tok.encode(text, add_special_tokens=False).ids, None, 256, 0,
                     "failing mock", False)
    s = tokenwire.Server(port=0, engine=engine, model_info=info).start()
    yield s
    s.stop()


@pytest.fixture(params=["http1.1", "http2"])
def client(request, server):
    http2 = request.param == "http2"
    with httpx.Client(http1=not http2, http2=http2, base_url=server.url, timeout=10) as c:
        yield c


def access_lines(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "tokenwire.access"]


def body_id(response, rid: str) -> str:
    """The response id inside a generation's body: the whole JSON's, or the first SSE chunk's
    (/generate's NDJSON carries none: `rid` itself)."""
    text = response.text
    if text.startswith("data: "):
        return json.loads(text.split("\n\n")[0][len("data: "):])["id"]
    return rid if rid.startswith("gen-") else json.loads(text)["id"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
GENERATIONS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 3}, "cmpl-"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}, "cmpl-"),
    ("/v1/chat/completions", CHAT, "chatcmpl-"),
    ("/v1/chat/completions", {**CHAT, "stream": True}, "chatcmpl-"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "n": 2}, "chatcmpl-"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "chatcmpl-"),
    ("/generate", {"prompt": "x", "max_tokens": 3}, "gen-"),
]


@pytest.mark.parametrize("path, body, prefix", GENERATIONS)
def test_every_generation_response_has_its_id_as_x_request_id(client, caplog, path, body, prefix):
    with caplog.at_level(logging.INFO, logger="tokenwire.access"):
        r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    rid = r.headers.get("x-request-id")
    assert rid is not None and rid.startswith(prefix) and rid == body_id(r, rid), (rid, r.text[:200])
    assert any(f'"POST {path}" 200 ' in line and line.endswith(f" id={rid}") for line in access_lines(caplog))


OTHERS = [
    ("GET", "/health", None, 200),
    ("HEAD", "/health", None, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/nope", None, 404),
    ("DELETE", "/v1/completions", None, 405),
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 9999}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"prompt": "x" * MAX_BODY}).encode(), 413),
]


@pytest.mark.parametrize("method, path, body, status", OTHERS)
def test_every_other_response_and_error_has_an_x_request_id(client, caplog, method, path, body, status):
    with caplog.at_level(logging.INFO, logger="tokenwire.access"):
        r = client.request(method, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    rid = r.headers.get("x-request-id")
    assert rid is not None and rid.startswith("req-"), r.headers
    # the access line has the method and path (a 413's too) and the id
    assert any(f'"{method} {path}" {status} id={rid}' in line for line in access_lines(caplog)), access_lines(caplog)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_a_warning_with_the_request_id_and_the_reason(failing, caplog, stream):
    with caplog.at_level(logging.INFO):
        with httpx.Client(http1=False, http2=True, base_url=failing.url) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream})
    rid = r.headers.get("x-request-id")
    assert rid is not None and rid.startswith("cmpl-"), (r.status_code, r.headers)
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert any(rid in w and "device lost" in w for w in warnings), warnings


def grpc_call(server, body: bytes) -> tuple:
    """One Generate call over a plain h2 connection -> (response headers, trailers)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", GENERATE),
                                ("content-type", "application/grpc"), ("te", "trailers")])
        conn.send_data(sid, tw_grpc.frame(body), end_stream=True)
        sock.sendall(conn.data_to_send())
        headers, trailers = {}, None
        while trailers is None:
            chunk = sock.recv(65536)
            assert chunk, "connection closed"
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    headers = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, h2.events.TrailersReceived):
                    trailers = dict(ev.headers)
            sock.sendall(conn.data_to_send())
    return headers, trailers


@pytest.mark.parametrize("case", ["ok", "invalid", "engine failure"])
def test_grpc_calls_have_an_id_and_log_their_grpc_status(server, failing, caplog, case):
    target = failing if case == "engine failure" else server
    message = grpc_schema.GenerateRequest(max_tokens=3, **({} if case == "invalid" else {"text": "x"}))
    with caplog.at_level(logging.INFO, logger="tokenwire.access"):
        headers, trailers = grpc_call(target, message.SerializeToString())
    code = {"ok": 0, "invalid": 3, "engine failure": 13}[case]
    assert trailers["grpc-status"] == str(code), trailers
    rid = headers.get("x-request-id")
    assert rid is not None and rid.startswith("req-" if case == "invalid" else "grpc-"), headers
    assert any(f'"POST {GENERATE}" 200 grpc-status={code} ' in line and line.endswith(f" id={rid}")
               for line in access_lines(caplog)), access_lines(caplog)


def test_the_unknown_parameter_line_names_the_route(server, caplog):
    with caplog.at_level(logging.INFO, logger="tokenwire.net"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "prompt": "x"})
    assert r.status_code == 200, r.text
    lines = [r.getMessage() for r in caplog.records if "'prompt'" in r.getMessage()]
    assert lines and "/v1/chat/completions" in lines[0], lines


def test_llguidance_writes_nothing_to_stderr_a_refused_token_is_a_warning(capfd, caplog):
    tokenizer = build_mock_tokenizer()
    grammars = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [1])
    constraint = grammars.compile(ConstraintSpec("choice", '["happy", "sad"]')).constraint()
    refused = tokenizer.encode("z", add_special_tokens=False).ids[0]
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="tokenwire.kernels.grammar"):
        assert constraint.accept(refused) is False
    assert capfd.readouterr().err == ""         # llguidance printed "Warning: Parser Error: ..." here
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokenwire.kernels.grammar"]
    assert warnings and f"refuses token {refused}" in warnings[0] and "doesn't satisfy the grammar" in warnings[0]
