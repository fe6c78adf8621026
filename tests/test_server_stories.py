"""End to end on a real trained model: stories260K (../shared/models), built by engine_build
into an unquantized engine, served by the numpy reference backend, queried through the
OpenAI SDK over HTTP/2 and HTTP/1.1 and through the native stream. Greedy output must be
run.c's, token for token.
"""

import json

import httpx
import openai
import pytest

import tokenwire

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
                 "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Story:{% endif %}")


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    data = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    run = data["runs"][0]
    return {"prompt": data["prompt"], "prompt_ids": data["prompt_token_ids"], "ids": run["generated_token_ids"],
            "text": run["stdout"][len(data["prompt"]):].rstrip("\n")}


@pytest.fixture(scope="module")
def engine_dir(stories260k_dir, tmp_path_factory):
    from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
    from tokenwire.engine_build.quantize import QuantOptions
    root = tmp_path_factory.mktemp("stories")
    (root / "template.jinja").write_text(CHAT_TEMPLATE)
    return build_engine(open_source(str(stories260k_dir / "stories260K.bin")), root / "engine",
                        BuildOptions(QuantOptions(method="none")))


@pytest.fixture(scope="module")
def server(engine_dir):
    template = engine_dir.parent / "template.jinja"
    s = tokenwire.Server(str(engine_dir), backend="reference", port=0, chat_template=str(template)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module", params=["http1.1", "http2"])
def client(request, server):
    http2 = request.param == "http2"
    with httpx.Client(http1=not http2, http2=http2, timeout=60) as http_client:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http_client)


def test_greedy_completion_matches_run_c(client, reference):
    n = len(reference["ids"])
    whole = client.completions.create(model="stories260K", prompt=reference["prompt"], max_tokens=n, temperature=0)
    assert whole.choices[0].text == reference["text"]
    assert whole.usage.prompt_tokens == len(reference["prompt_ids"]) and whole.usage.completion_tokens == n
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="stories260K", prompt=reference["prompt"], max_tokens=n, temperature=0, stream=True))
    assert streamed == reference["text"]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_native_stream_token_ids_match_run_c(server, engine_dir, reference, backend):
    # the C backend's exact path (its default, int8 activations, is close but not run.c's arithmetic)
    s = server if backend == "reference" else tokenwire.Server(str(engine_dir), backend="cpu", activations="fp32",
                                                               port=0).start()
    try:
        n = len(reference["ids"])
        lines = httpx.post(s.url + "/generate", json={"prompt_token_ids": reference["prompt_ids"],
                                                      "max_tokens": n, "temperature": 0}, timeout=60).text
    finally:
        if s is not server:
            s.stop()
    objs = [json.loads(x) for x in lines.splitlines()]
    assert [o["id"] for o in objs[:-1]] == reference["ids"]
    assert "".join(o["text"] for o in objs[:-1]) == reference["text"]


def test_chat_uses_the_template_and_streams(client, server):
    messages = [{"role": "user", "content": "Tell me about a cat."}]
    stream = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text and len(text) > 5
    from tokenwire.kernels.engine_format import load_engine
    engine = load_engine(server.options.model)
    rendered = f"{engine.manifest['tokenizer']['bos_token']}User: Tell me about a cat.\nStory:"
    expected = engine.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert expected[0] == engine.bos_token_id                  # the template's BOS is the real BOS token
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(expected)


def test_stop_string_and_seeded_sampling(client, reference):
    cut = reference["text"].index(" little")
    r = client.completions.create(model="stories260K", prompt=reference["prompt"], max_tokens=30, temperature=0,
                                  stop=[" little"])
    assert r.choices[0].text == reference["text"][:cut] and r.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="stories260K", prompt="Once", max_tokens=20, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_logprobs(client, reference):
    r = client.completions.create(model="stories260K", prompt=reference["prompt"], max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 3
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(token_lp) and top[token] == pytest.approx(token_lp)
    chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


# ------------------------------------------------------- n > 1, best_of (net/writer/choices.py)

def test_n_greedy_choices_are_identical(client, reference):
    whole = client.completions.create(model="stories260K", prompt=reference["prompt"], max_tokens=12,
                                      temperature=0, n=4)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert len({c.text for c in whole.choices}) == 1 and whole.choices[0].text == reference["text"][:len(whole.choices[0].text)]
    assert whole.usage.completion_tokens == 4 * 12 and whole.usage.prompt_tokens == len(reference["prompt_ids"])


def test_seeded_n_equals_single_requests_with_the_derived_seeds(client):
    kw = dict(model="stories260K", messages=[{"role": "user", "content": "a cat"}], max_tokens=10, temperature=1.0)
    together = client.chat.completions.create(n=4, seed=1234, **kw)
    alone = [client.chat.completions.create(seed=1234 + i, **kw).choices[0].message.content for i in range(4)]
    assert [c.message.content for c in together.choices] == alone
    assert len(set(alone)) > 1
    texts, finished, usage = {}, set(), None        # streamed: interleaved by index, the same texts
    for chunk in client.chat.completions.create(n=4, seed=1234, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == alone and finished == {0, 1, 2, 3}
    assert usage.completion_tokens == 40


def test_best_of_returns_the_best_ranked_choices(client):
    kw = dict(model="stories260K", prompt="Once", max_tokens=8, temperature=1.0, seed=7)
    best = client.completions.create(best_of=4, n=2, logprobs=0, **kw)
    singles = [client.completions.create(logprobs=0, **dict(kw, seed=7 + i)).choices[0] for i in range(4)]
    def mean(c):
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)
    ranked = sorted(singles, key=mean, reverse=True)[:2]
    assert [c.text for c in best.choices] == [c.text for c in ranked] and [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 4 * 8


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_tokenize_detokenize_round_trip(server, reference, http2):
    """vLLM's /tokenize gives run.c's prompt ids (BOS included, as a completion prompt is
    tokenized), and /detokenize gives the text back."""
    with httpx.Client(http1=not http2, http2=http2, base_url=server.url, timeout=60) as client:
        r = client.post("/tokenize", json={"model": "stories260K", "prompt": reference["prompt"]}).json()
        assert r["tokens"] == reference["prompt_ids"] and r["count"] == len(reference["prompt_ids"])
        for text in (reference["prompt"], reference["text"], "Lily and Tom went to the park. They saw a big dog!"):
            plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
            assert client.post("/detokenize", json={"tokens": plain}).json() == {"prompt": text}
        story = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a cat"}]}).json()
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a cat"}],
                                                         "max_tokens": 1}).json()
        assert story["count"] == chat["usage"]["prompt_tokens"]
