"""Inline steps over real sockets (net/writer/handoff.py): a server whose executor steps are shorter
than `inline_step_us` runs them on its event loop, and streams, resets and many streams
behave there as on the engine thread. On asyncio and uvloop, with a raw h2 client."""

import json
import time

import httpx
import pytest

import tokenwire
from tokenwire.kernels.mock import MOCK_TEXT

from clients.rawh2 import RawH2


def sse_events(body: bytes) -> list:
    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", body[-300:]
    return [json.loads(e) for e in events[:-1]]


def completion_text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def inline_server(request):
    """1 ms mock steps under a 100 ms inline limit: steps run on the loop, slowly enough to
    reset a stream in the middle."""
    s = tokenwire.Server(backend="mock", port=0, loop=request.param, mock_step_us=1000, inline_step_us=100_000).start()
    yield s
    s.stop()


def stream(c, max_tokens, prompt="hello"):
    return c.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": True})


def test_streams_run_on_the_loop_and_carry_every_token(inline_server):
    c = RawH2("127.0.0.1", inline_server.port)
    try:
        sid = stream(c, 40)
        c.read_until(lambda: sid in c.ended)
        assert inline_server.engine.driver.lent                   # the engine thread lent its steps
        events = sse_events(c.data[sid])
        assert len(events) == 41 and events[-1]["choices"][0]["finish_reason"] == "length"   # 40 tokens, the finish
        assert MOCK_TEXT.startswith(completion_text(events)) and len(completion_text(events)) > 40
    finally:
        c.close()


def test_reset_while_inline_frees_the_blocks_and_the_connection_goes_on(inline_server):
    c = RawH2("127.0.0.1", inline_server.port)
    try:
        sid = stream(c, 2000, prompt="hello " * 40)
        c.read_until(lambda: c.data.get(sid, b"").count(b"data:") >= 5)
        assert inline_server.engine.driver.lent
        url = inline_server.url
        assert metric(url, "tokenwire_kv_blocks_used") > 0
        cancelled = metric(url, "tokenwire_cancellations_total")
        c.reset(sid)
        deadline = time.monotonic() + 5
        while metric(url, "tokenwire_kv_blocks_used") and time.monotonic() < deadline:
            time.sleep(0.002)
        assert metric(url, "tokenwire_kv_blocks_used") == 0 and metric(url, "tokenwire_requests_running") == 0
        assert metric(url, "tokenwire_cancellations_total") == cancelled + 1
        sid2 = stream(c, 8)
        c.read_until(lambda: sid2 in c.ended)
        assert c.data[sid2].endswith(b"data: [DONE]\n\n")
    finally:
        c.close()


def test_many_streams_inline_each_complete(inline_server):
    c = RawH2("127.0.0.1", inline_server.port)
    try:
        sids = [stream(c, 24) for _ in range(64)]
        c.read_until(lambda: all(s in c.ended for s in sids))
        texts = {completion_text(sse_events(c.data[s])) for s in sids}
        assert len(texts) == 1 and MOCK_TEXT.startswith(texts.pop())
        assert inline_server.engine.driver.lent
    finally:
        c.close()
