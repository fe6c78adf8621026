"""The API details users of OpenAI-compatible servers expect (issue 15): models.retrieve,
max_tokens against the context, min_tokens, continuous usage, cached_tokens, unknown fields
ignored (or refused with --strict-params), the access log and the periodic engine line,
--kv-cache-memory, --version and the CLI's help. Against a real server on 127.0.0.1."""

import json
import logging
import subprocess
import sys

import httpx
import openai
import pytest

import tokenwire
from tokenwire.core.engine_core import EngineCore
from tokenwire.core.executor import StepOutput, SyncExecutor
from tokenwire.core.outputs import EngineStats, FINISH_STOP, Timeline
from tokenwire.core.sampling_params import InvalidParameter, SamplingParams
from tokenwire.kernels.mock import build_mock_tokenizer, mock_config
from tokenwire.core.options import EngineOptions
from tokenwire.net.access_log import EngineLog
from tokenwire.runtime import build_engine
from tokenwire.serve import byte_size

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server():
    s = tokenwire.Server(backend="mock", port=0, max_model_len=MAX_MODEL_LEN).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def h2(server):
    with httpx.Client(http1=False, http2=True, base_url=server.url, timeout=10) as client:
        yield client


def sse_chunks(text: str) -> list:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def test_models_retrieve_with_the_openai_sdk(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.retrieve("mock")
    assert model.id == "mock" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(h2):
    r = h2.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 200})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "200" in error["message"]
    num_prompt = h2.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 1}).json()["usage"][
        "prompt_tokens"]
    assert f"leaves {MAX_MODEL_LEN - num_prompt} tokens" in error["message"]
    chat = h2.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_completion_tokens": 1000})
    assert chat.status_code == 400 and "1000" in chat.json()["error"]["message"]


def test_max_tokens_absent_uses_the_rest_of_the_context(h2):
    body = h2.post("/v1/completions", json={"prompt": "Once upon"}).json()
    use = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert use["prompt_tokens"] + use["completion_tokens"] == MAX_MODEL_LEN
    assert use["prompt_tokens_details"] == {"cached_tokens": 0}


def test_min_tokens_holds_back_stop_strings(h2):
    # the mock's story: "Once upon a time, there was a little robot named Tok. Tok loved ..."
    early = h2.post("/v1/completions", json={"prompt": "x", "stop": "Tok", "max_tokens": 50}).json()
    assert early["choices"][0]["finish_reason"] == "stop"
    num_early = early["usage"]["completion_tokens"]
    held = h2.post("/v1/completions", json={"prompt": "x", "stop": "Tok", "max_tokens": 50,
                                             "min_tokens": num_early + 2}).json()
    assert held["usage"]["completion_tokens"] > num_early + 1
    assert held["choices"][0]["text"].startswith(early["choices"][0]["text"] + "Tok")
    r = h2.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


class EosExecutor(SyncExecutor):
    """Always samples EOS (id 1)."""
    def __init__(self):
        self.config = mock_config(64, 128)
        self.block_size, self.num_blocks = 4, 64

    def step(self, seqs):
        return StepOutput([1 for s in seqs if s.sample])

    def close(self):
        pass


def test_min_tokens_holds_back_eos_in_the_scheduler():
    engine = EngineCore(EosExecutor(), build_mock_tokenizer(), eos_token_ids=(1,), max_model_len=128)
    engine.add_request(1, [5, 6], SamplingParams(min_tokens=5), Timeline())
    engine.add_request(2, [5, 6], SamplingParams(), Timeline())
    done = {}
    while engine.has_unfinished():
        for out in engine.step().rows:
            if out.finish_reason is not None:
                done[out.request_id] = (out.finish_reason, out.num_output_tokens)
    assert done == {1: (FINISH_STOP, 6), 2: (FINISH_STOP, 1)}
    with pytest.raises(InvalidParameter):
        SamplingParams(min_tokens=-1)


def test_continuous_usage_stats_on_every_chunk(h2):
    r = h2.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = sse_chunks(r.text)
    token_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(range(1, 7))
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks if c.get("usage"))
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["choices"] == []
    plain = sse_chunks(h2.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True,
                                                         "stream_options": {"continuous_usage_stats": True}}).text)
    assert [c["usage"]["completion_tokens"] for c in plain] == [1, 2, 3, 3]


def test_unknown_fields_are_ignored_and_logged_once(h2, caplog):
    with caplog.at_level(logging.INFO, logger="tokenwire.net"):
        for _ in range(2):
            r = h2.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": 1,
                                                 "nvext": {"ignore_eos": True}, "user": "u"})
            assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(lines) == 1
    assert not any("nvext" in rec.getMessage() for rec in caplog.records)
    # known but not implemented: still a 400
    assert h2.post("/v1/completions", json={"prompt": "x", "echo": True}).status_code == 400


def test_strict_params_refuses_unknown_fields():
    with tokenwire.Server(backend="mock", port=0, strict_params=True) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                            "nvext": {}}).status_code == 200


def test_access_log_line_per_request(h2, caplog):
    with caplog.at_level(logging.INFO, logger="tokenwire.access"):
        h2.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
        h2.get("/v1/models/nope")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tokenwire.access"]
    assert any('"POST /v1/completions" 200 prompt=' in line and "completion=3" in line
               and "finish=length" in line and "ttft=" in line for line in lines), lines
    assert any('"GET /v1/models/nope" 404' in line for line in lines), lines


def test_no_access_log():
    with tokenwire.Server(backend="mock", port=0, access_log=False) as s:
        assert s.app.access_log.enabled is False


def test_engine_log_reports_throughput_while_busy():
    log = EngineLog()
    assert log.tick(EngineStats(0, 0, 0, 10, 0, 0, 0, 0, True), 0.0) is None
    log.num_prompt_tokens = 100
    line = log.tick(EngineStats(2, 3, 5, 10, 0, 0, 40, 0, True), 2.0)
    assert ("prompt throughput 50.0 tokens/s" in line and "generation throughput 20.0 tokens/s" in line
            and "running 2, waiting 3" in line and "KV cache 50.0%" in line)
    assert log.tick(EngineStats(0, 0, 0, 10, 0, 0, 40, 0, True), 4.0) is not None   # the interval was busy
    assert log.tick(EngineStats(0, 0, 0, 10, 0, 0, 40, 0, True), 6.0) is None


def test_kv_cache_memory_units():
    assert byte_size("512MiB") == 512 * 2**20 and byte_size("2GB") == 2 * 10**9
    assert byte_size("1.5g") == 1_500_000_000 and byte_size("4096") == 4096
    for bad in ("", "12 parsecs", "-1G", "0"):
        with pytest.raises(ValueError):
            byte_size(bad)


def test_kv_cache_memory_sizes_the_cache():
    def num_blocks(budget):      # the embedded default model, as `tokenwire serve --kv-cache-memory` uses it
        core = build_engine(EngineOptions(kv_cache_bytes=budget, max_model_len=64)).core
        n = core.block_manager.num_blocks
        core.executor.close()
        return n
    small, big = num_blocks(16 * 2**20), num_blocks(32 * 2**20)
    assert 2 * small <= big <= 2 * small + 1        # floor(budget / bytes per block)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tokenwire", *args], capture_output=True, text=True, timeout=60)


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"tokenwire {tokenwire.__version__}"
    top = run_cli("--help").stdout
    assert "inference server" in top


def test_every_serve_flag_has_help():
    import argparse
    from tokenwire import serve
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    missing = [a.option_strings for a in parser._actions if a.help in (None, "") and a.option_strings]
    assert not missing


def test_start_hint_has_the_authorization_header(caplog):
    with caplog.at_level(logging.INFO, logger="tokenwire.net"):
        with tokenwire.Server(backend="mock", port=0, api_key="s3cret"):
            pass
    assert any("try: curl" in r.getMessage() and "authorization: Bearer s3cret" in r.getMessage()
               for r in caplog.records)


def test_second_ctrl_c_exits_at_once():
    import re
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-m", "tokenwire", "serve", "--backend", "mock", "--port", "0",
                             "--mock-step-us", "200000"], stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            match = re.search(r"listening on (http://\S+)", line)
            url = url or (match and match.group(1))
            if "serving mock" in line:
                break
        client = httpx.Client(http2=True, http1=False, base_url=url, timeout=30)
        with client.stream("POST", "/generate", json={"prompt": "x", "max_tokens": 200}) as r:
            next(r.iter_bytes())                    # one request in flight, ~40 s from its end
            proc.send_signal(signal.SIGINT)
            waited = ""
            for line in proc.stderr:
                if "waiting for" in line:
                    waited = line
                    break
            assert "1 requests in flight" in waited
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) == 130 and time.monotonic() - start < 5
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("http2", [False, True])
def test_head_on_get_routes_and_errors(server, http2):
    """AIPerf's server-metrics probe sends HEAD /metrics; over HTTP/1.1 an error body on a HEAD
    response used to make h11 drop the connection."""
    with httpx.Client(http1=not http2, http2=http2, base_url=server.url, timeout=10) as client:
        r = client.head("/metrics")
        assert r.status_code == 200 and r.content == b""
        assert client.head("/v1/models/nope").status_code == 404
        assert client.head("/v1/completions").status_code == 405
        assert client.get("/health").status_code == 200          # the same connection goes on
