"""Bad input, limits and deadlines on the routes of the newer API families (/v1/responses,
/v1/messages, /v1/messages/count_tokens, /tokenize, /detokenize), tested as
test_api_errors.py tests chat/completions: the right status, the family's own error body
with the field named (OpenAI's `{"error": {...}}`; Anthropic's `{"type": "error", "error":
{"type", "message"}}`, the message starting with the field), and the server goes on. On
asyncio and uvloop, over HTTP/2 and, where HTTP/1.1 differs, HTTP/1.1. Also: n > 1 and
best_of requests keep their x-request-timeout-ms deadline.
"""

import json
import time

import anthropic
import httpx
import httpx2
import openai
import pytest

import tokenwire
from tokenwire.net.protocol.events import Limits

from test_api_errors import check_error, full_queue, post_raw, still_serving

MAX_MODEL_LEN = 64
MAX_BODY = 4000
USER = [{"role": "user", "content": "hi"}]


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


def check_anthropic_error(response, status, kind, field=None):
    """Anthropic's error shape; `field`: the message names it first."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert len(body["error"]["message"]) > 10
    if field is not None:
        assert body["error"]["message"].startswith(field + ":"), body["error"]["message"]
    return body["error"]


# ------------------------------------------------------------------- 400

@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "top_p": 2}, "top_p"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "stream": "yes"}, "stream"),
])
def test_responses_400_names_the_field(h2, body, param):
    check_error(h2.post("/v1/responses", json=body), 400, param=param)
    still_serving(h2)


def test_responses_max_output_tokens_named_in_the_message_too(h2):
    error = check_error(h2.post("/v1/responses", json={"input": "hi", "max_output_tokens": 0}), 400,
                        param="max_output_tokens")
    assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"]
    ok = h2.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tool_choice": "auto"})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


def test_responses_prompt_and_max_output_tokens_against_the_context(h2):
    check_error(h2.post("/v1/responses", json={"input": "tok " * 200}), 400, param="input",
                code="context_length_exceeded")
    error = check_error(h2.post("/v1/responses", json={"input": "hi", "max_output_tokens": MAX_MODEL_LEN}), 400,
                        param="max_output_tokens")
    assert "max_output_tokens is 64" in error["message"] and "max_tokens" not in error["message"]
    check_error(h2.post("/v1/responses", json={"input": "hi", "model": "gpt-9"}), 404, param="model",
                code="model_not_found")
    check_error(post_raw(h2, "/v1/responses", b'{"input": "hi",'), 400, code="invalid_json")


@pytest.mark.parametrize("body,field", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages"),
    ({"max_tokens": 4, "messages": USER, "system": 5}, "system"),
    ({"max_tokens": "4", "messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": USER, "temperature": -1}, "temperature"),
    ({"max_tokens": 4, "messages": USER, "top_k": "x"}, "top_k"),
    ({"max_tokens": 4, "messages": USER, "stop_sequences": [1]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f"}]}, "tools"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "x"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "tok " * 200}]}, "messages"),
    ({"max_tokens": MAX_MODEL_LEN, "messages": USER}, "max_tokens"),
])
def test_messages_400_names_the_field(h2, body, field):
    check_anthropic_error(h2.post("/v1/messages", json=body), 400, "invalid_request_error", field)
    still_serving(h2)


def test_messages_other_errors_in_anthropic_shape(h2):
    check_anthropic_error(post_raw(h2, "/v1/messages", b'{"max_tokens": 4,'), 400, "invalid_request_error")
    check_anthropic_error(h2.post("/v1/messages", json={"max_tokens": 4, "messages": USER, "model": "claude-9"}),
                          404, "not_found_error", "model")
    check_anthropic_error(post_raw(h2, "/v1/messages", b"x", "text/plain"), 415, "invalid_request_error")
    check_anthropic_error(h2.get("/v1/messages"), 405, "invalid_request_error")
    check_anthropic_error(h2.post("/v1/messages/count_tokens", json={"messages": "hi"}), 400,
                          "invalid_request_error", "messages")
    check_anthropic_error(h2.post("/v1/messages/count_tokens", json={"messages": USER, "model": "x"}), 404,
                          "not_found_error", "model")
    assert h2.post("/v1/messages/count_tokens", json={"messages": USER}).json()["input_tokens"] > 0


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_token_routes_400_name_the_field(h2, path, body, param):
    check_error(h2.post(path, json=body), 400, param=param)
    still_serving(h2)


def test_token_routes_model_and_method(h2):
    check_error(h2.post("/tokenize", json={"prompt": "a", "model": "gpt-9"}), 404, param="model")
    check_error(h2.get("/tokenize"), 405, code="method_not_allowed")
    assert h2.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


# -------------------------------------------------------------- 413

@pytest.mark.parametrize("http2", [True, False], ids=["http2", "http1.1"])
def test_body_over_limit(server, http2):
    big = "x" * (MAX_BODY + 10)
    with httpx.Client(http1=not http2, http2=http2, base_url=server.url, timeout=10) as client:
        check_error(client.post("/v1/responses", json={"input": big}), 413, code="body_too_large")
        check_anthropic_error(client.post("/v1/messages", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": big}]}), 413, "request_too_large")
        check_anthropic_error(client.post("/v1/messages/count_tokens", json={"messages": [
            {"role": "user", "content": big}]}), 413, "request_too_large")
        check_error(client.post("/tokenize", json={"prompt": big}), 413, code="body_too_large")
        check_error(client.post("/detokenize", json={"tokens": [1] * MAX_BODY}), 413, code="body_too_large")
        still_serving(client)


# -------------------------------------------------------------- 401

def test_api_key(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, api_key="s3cret").start()
    try:
        with httpx.Client(http1=False, http2=True, base_url=s.url) as client:
            for path, body in (("/v1/responses", {"input": "hi"}), ("/tokenize", {"prompt": "hi"}),
                               ("/detokenize", {"tokens": [1]})):
                for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                    response = client.post(path, json=body, headers=headers)
                    check_error(response, 401, code="invalid_api_key")
                    assert response.headers["www-authenticate"] == "Bearer"
                for headers in ({"authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
                    assert client.post(path, json=body, headers=headers).status_code == 200
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                body = {"max_tokens": 2, "messages": USER} if path == "/v1/messages" else {"messages": USER}
                for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
                    check_anthropic_error(client.post(path, json=body, headers=headers), 401, "authentication_error")
                for headers in ({"x-api-key": "s3cret"}, {"authorization": "Bearer s3cret"}):
                    assert client.post(path, json=body, headers=headers).status_code == 200
        # the SDKs: anthropic sends x-api-key, OpenAI a Bearer token
        with httpx2.Client() as http:
            ok = anthropic.Anthropic(base_url=s.url, api_key="s3cret", http_client=http)
            assert ok.messages.create(model="mock", max_tokens=2, messages=USER).usage.output_tokens == 2
            with pytest.raises(anthropic.AuthenticationError):
                anthropic.Anthropic(base_url=s.url, api_key="nope", http_client=http, max_retries=0).messages.create(
                    model="mock", max_tokens=2, messages=USER)
        assert openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret").responses.create(
            model="mock", input="hi", max_output_tokens=2).usage.output_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).responses.create(model="mock",
                                                                                                  input="hi")
    finally:
        s.stop()


# -------------------------------------------------------------- 429

def test_queue_full(loop_kind):
    with full_queue(loop_kind) as client:
        response = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        error = check_error(response, 429, code="queue_full")
        assert response.headers["retry-after"] == "1" and "queue is full" in error["message"]
        response = client.post("/v1/messages", json={"max_tokens": 2, "messages": USER, "stream": True})
        error = check_anthropic_error(response, 429, "rate_limit_error")
        assert response.headers["retry-after"] == "1" and "queue is full" in error["message"]
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200     # never queued


# -------------------------------------------------------------- deadlines

@pytest.fixture(scope="module")
def slow(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, mock_step_us=2000).start()
    yield s
    s.stop()


def sse_events(text: str) -> list:
    """(event name, data) of each SSE event."""
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines and lines["data"].startswith("{"):
            out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def test_deadline_ends_the_new_streams(slow):
    headers = {"x-request-timeout-ms": "60"}
    with httpx.Client(http1=False, http2=True, base_url=slow.url, timeout=10) as client:
        r = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2000, "stream": True},
                        headers=headers)
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1][0] == "response.completed"
        final = events[-1][1]["response"]
        assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "deadline"}
        assert 0 < final["usage"]["output_tokens"] < 2000
        r = client.post("/v1/messages", json={"max_tokens": 2000, "messages": USER, "stream": True}, headers=headers)
        events = sse_events(r.text)
        assert r.status_code == 200 and [e for e, _ in events[-2:]] == ["message_delta", "message_stop"]
        assert events[-2][1]["delta"]["stop_reason"] == "deadline"


def test_deadline_before_anything_was_sent_is_a_504_in_the_familys_shape(slow):
    headers = {"x-request-timeout-ms": "30"}
    with httpx.Client(http1=False, http2=True, base_url=slow.url, timeout=10) as client:
        r = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2000}, headers=headers)
        check_error(r, 504, code="deadline_exceeded")
        r = client.post("/v1/messages", json={"max_tokens": 2000, "messages": USER}, headers=headers)
        check_anthropic_error(r, 504, "timeout_error")
        bad = {"x-request-timeout-ms": "soon"}
        check_error(client.post("/v1/responses", json={"input": "x"}, headers=bad), 400, param="x-request-timeout-ms")
        check_anthropic_error(client.post("/v1/messages", json={"max_tokens": 2, "messages": USER}, headers=bad), 400,
                              "invalid_request_error", "x-request-timeout-ms")
        ok = client.post("/v1/messages", json={"max_tokens": 3, "messages": USER},
                         headers={"x-request-timeout-ms": "5000"})
        assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"


def test_deadline_applies_to_every_choice(slow):
    """n > 1 and best_of: each choice is its own engine request; all of them end at the deadline."""
    headers = {"x-request-timeout-ms": "60"}
    with httpx.Client(http1=False, http2=True, base_url=slow.url, timeout=30) as client:
        r = client.post("/v1/chat/completions", json={"messages": USER, "n": 3, "max_tokens": 2000, "stream": True},
                        headers=headers)
        chunks = [data for _, data in sse_events(r.text)]
        finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                    if c["choices"] and c["choices"][0]["finish_reason"]}
        assert r.status_code == 200 and finishes == {0: "deadline", 1: "deadline", 2: "deadline"}, finishes
        r = client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2000}, headers=headers)
        check_error(r, 504, code="deadline_exceeded")
    deadline = time.monotonic() + 5
    while slow.engine.stats().num_running:            # every choice was cancelled in the engine
        assert time.monotonic() < deadline
        time.sleep(0.002)
