"""Speculative decoding behind the real server: the OpenAI SDK (HTTP/1.1 and HTTP/2) and the
native NDJSON route stream speculated tokens one chunk per token, with run.c's greedy text;
the final chunk and the trailers carry `spec_proposed` / `spec_accepted`; /metrics counts
them; a request's `speculative` field chooses (or refuses, with a 400 naming it)."""

import json
import os
import subprocess

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tokenwire


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    data = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    run = max(data["runs"], key=lambda r: len(r["generated_token_ids"]))
    return {"prompt": data["prompt"], "ids": run["generated_token_ids"],
            "text": run["stdout"][len(data["prompt"]):].rstrip("\n")}


@pytest.fixture(scope="module")
def server(stories260k_dir, tmp_path_factory):
    from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
    from tokenwire.engine_build.quantize import QuantOptions
    engine = build_engine(open_source(str(stories260k_dir / "stories260K.bin")),
                          tmp_path_factory.mktemp("stories") / "engine", BuildOptions(QuantOptions(method="none")))
    s = tokenwire.Server(str(engine), backend="reference", port=0, speculative="ngram", num_speculative_tokens=6,
                         response_cache_size=0, enable_prefix_caching=False).start()
    yield s
    s.stop()


def metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}


@pytest.mark.parametrize("http2", [False, True])
def test_sdk_streams_one_chunk_per_speculated_token(server, reference, http2):
    n = len(reference["ids"])
    before = metrics(server)
    with httpx.Client(http1=not http2, http2=http2, timeout=60) as http_client:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http_client)
        chunks = list(client.completions.create(model="stories260K", prompt=reference["prompt"], max_tokens=n,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == reference["text"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == n
    # one chunk per token: the byte-level tokens that end inside a character are held (no
    # chunk), so every text chunk is at most one token and together they are the n tokens
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(token_chunks) == n
    timings = chunks[-1].model_extra["timings"]
    assert 0 < timings["spec_accepted"] <= timings["spec_proposed"]
    after = metrics(server)
    assert after["tokenwire_spec_proposed_tokens"] - before["tokenwire_spec_proposed_tokens"] == timings["spec_proposed"]
    assert after["tokenwire_spec_accepted_tokens"] - before["tokenwire_spec_accepted_tokens"] == timings["spec_accepted"]
    assert after["tokenwire_spec_verify_steps"] > before["tokenwire_spec_verify_steps"]


def test_native_route_and_trailers_per_request_choice(server, reference):
    n = len(reference["ids"])
    body = {"prompt": reference["prompt"], "max_tokens": n, "temperature": 0}
    with httpx.Client(http2=True, timeout=60) as client:
        spec = client.post(server.url + "/generate", json=body).text.splitlines()
        plain = client.post(server.url + "/generate", json={**body, "speculative": "off"}).text.splitlines()
    ids = [json.loads(line)["id"] for line in spec[:-1]]
    assert ids == reference["ids"] == [json.loads(line)["id"] for line in plain[:-1]]
    assert json.loads(spec[-1])["timings"]["spec_accepted"] > 0
    assert "spec_proposed" not in json.loads(plain[-1])["timings"]          # it did not speculate
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients", "h2_stream.mjs")
    node = subprocess.run(["node", script, server.url, "/v1/completions",
                           json.dumps({"prompt": reference["prompt"], "max_tokens": n, "temperature": 0,
                                       "stream": True, "num_speculative_tokens": 3})],
                          capture_output=True, text=True, timeout=60)
    trailers = json.loads(node.stdout)["trailers"]
    assert 0 < int(trailers["tokenwire-spec-accepted"]) <= int(trailers["tokenwire-spec-proposed"])


@pytest.mark.parametrize("body, param", [({"speculative": "draft"}, "speculative"),
                                         ({"speculative": "medusa"}, "speculative"),
                                         ({"speculative": 3}, "speculative"),
                                         ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
                                         ({"num_speculative_tokens": "4"}, "num_speculative_tokens")])
def test_bad_speculative_fields_are_400s_that_name_them(server, body, param):
    for path in ("/v1/completions", "/generate"):
        r = httpx.post(server.url + path, json={"prompt": "Once", "max_tokens": 2, **body})
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param


def test_every_route_parses_the_speculative_fields():
    from tokenwire.net.api.anthropic import parse_messages
    from tokenwire.net.api.native import parse_generate
    from tokenwire.net.api.openai import parse_chat, parse_completions
    from tokenwire.net.api.responses import parse_responses
    fields = {"speculative": "draft", "num_speculative_tokens": 7}
    for parse, body in ((parse_completions, {"prompt": "x"}), (parse_generate, {"prompt": "x"}),
                        (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
                        (parse_responses, {"input": "x"}),
                        (parse_messages, {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})):
        params = parse({**body, **fields}, on_unknown=lambda name: pytest.fail(name)).params
        assert (params.speculative, params.num_speculative_tokens) == ("draft", 7)
        assert parse(body).params.speculative is None
