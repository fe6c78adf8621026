"""Structured output and tool calling through a real server on 127.0.0.1 (the default
random-weight model on the CPU backend) with the OpenAI Python SDK, over HTTP/1.1 and
HTTP/2: `chat.completions.parse(response_format=PydanticModel)`,
`beta.chat.completions.stream(...)`, vLLM's guided_* keys, /generate, 400s for bad
grammars, and a tool round trip (required, a tool message, the final answer), streamed and not."""

import json
import re
from typing import Literal

import httpx
import openai
import pydantic
import pytest

import tokenwire
from tokenwire.net.api.chat_template import ChatTemplate
from tokenwire.net.api.structured import ToolPlan, tool_calls, tool_family


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: int = pydantic.Field(ge=-30, le=45)
    rain: bool


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                           "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}]
MODEL = "tokenwire-default-random"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = tokenwire.Server(backend="cpu", port=0).start()
    yield s
    s.stop()


@pytest.fixture(scope="module", params=["http1.1", "http2"])
def client(request, server):
    http2 = request.param == "http2"
    with httpx.Client(http1=not http2, http2=http2, timeout=120) as http_client:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http_client)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather,
                                                   seed=seed, max_tokens=200)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Weather), message.content
    greedy = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather, temperature=0,
                                           max_tokens=200)
    assert isinstance(greedy.choices[0].message.parsed, Weather), greedy


def test_beta_stream_with_a_pydantic_model(client):
    with client.beta.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=Weather,
                                             seed=5, max_tokens=200) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3                      # it streamed, token by token
    assert isinstance(final.choices[0].message.parsed, Weather)
    assert "".join(deltas) == final.choices[0].message.content


def test_guided_keys_and_generate(client, server):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=1, max_tokens=50,
                                       extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="Pick:", seed=2, max_tokens=20,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=3, max_tokens=50,
                                       extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert r.choices[0].message.content in ("up", "down")
    lines = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": "x", "max_tokens": 200, "seed": 4,
        "guided_json": {"type": "object", "required": ["n"], "additionalProperties": False,
                        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}}}).text.splitlines()
    summary = json.loads(lines[-1])
    text = "".join(json.loads(line).get("text", "") for line in lines[:-1])
    assert 1 <= json.loads(text)["n"] <= 9 and summary["finish_reason"] == "stop"
    assert summary["timings"]["mask_us_per_token"] > 0


@pytest.mark.parametrize("body, param, words", [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),             # each 400 names the field sent
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_json": {"type": 7}}, "guided_json", "json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format", "json schema"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar", "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
      "tool_choice": "required"}, "tools", "json schema"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "not supported"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"n": 2, "guided_regex": "a"}, "n", "not supported"),
    ({"n": 2, "tools": TOOLS}, "n", "not supported"),                         # auto: read back, one choice
    ({"n": 2, "tools": TOOLS, "tool_choice": "required"}, "n", "not supported"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_n_choices_with_tools_that_are_never_called(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", n=2,
                                       seed=1, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1] and all(c.message.content for c in r.choices)


def test_parallel_tool_calls_false_is_one_call_at_most(client):
    """At temperature 1 the default model, left to itself, writes several calls or keeps adding
    them until max_tokens; false ends the grammar after one."""
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=300)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r
        json.loads(calls[0].function.arguments)
    several = [client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=seed, max_tokens=300) for seed in range(6)]
    assert any(len(r.choices[0].message.tool_calls) > 1 for r in several)       # true (the default) allows more


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_cut_by_max_tokens_is_still_a_tool_call(client, streamed):
    """finish_reason "length" keeps tool_calls (the last one's arguments cut, as OpenAI does),
    never the raw markup as content."""
    for max_tokens in (8, 20, 30):                  # cut before the name is complete, after it, in the arguments
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
                      max_tokens=max_tokens)
        if streamed:
            chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
            calls, finish = _stream_tool_calls(chunks)
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            r = client.chat.completions.create(**kwargs)
            finish, content = r.choices[0].finish_reason, r.choices[0].message.content or ""
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in r.choices[0].message.tool_calls or []]
        assert finish == "length" and content == "", (max_tokens, finish, content)
        if max_tokens >= 20:
            assert calls and calls[-1]["name"] in ("get_weather", "get_time"), (max_tokens, calls)
            assert '"name"' not in calls[-1]["arguments"], calls


def _stream_tool_calls(stream) -> tuple:
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return list(calls.values()), finish


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_tool_round_trip(client, streamed):
    messages = list(MESSAGES)
    if streamed:
        calls, finish = _stream_tool_calls(client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", seed=7, max_tokens=300, stream=True))
    else:
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           seed=7, max_tokens=300)
        finish = r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["name"] in ("get_weather", "get_time")
        args = json.loads(call["arguments"])
        assert set(args) == ({"city", "unit"} if call["name"] == "get_weather" else {"zone"})
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": '{"celsius": 21}'} for c in calls]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           seed=8, max_tokens=8, stream=streamed)
    if streamed:
        chunks = [c for c in final if c.choices]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        assert final.choices[0].finish_reason == "length" and final.choices[0].message.content


def test_named_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=9, max_tokens=100,
                                       tool_choice=named)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_time" and re.fullmatch("[A-Z]{3}", json.loads(call.function.arguments)["zone"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=9,
                                                 max_tokens=100, tool_choice=named, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) > 3 and deltas[0].id and deltas[0].function.name == "get_time"   # token by token
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments     # same seed, same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_parses_hermes_and_llama3_markup():
    plan = ToolPlan("auto", ("get_weather",), "hermes")
    content, calls = tool_calls(plan, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                      '</tool_call>')
    assert content == "Sure." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    assert tool_calls(plan, "no call here") == ("no call here", [])
    plan = ToolPlan("auto", ("get_weather", "get_time"), "llama3")
    content, calls = tool_calls(plan, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                      '{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET"}
    assert tool_family("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_family("<|start_header_id|>ipython<|end_header_id|>") == "llama3"


def test_tool_calls_cut_by_max_tokens_read_back():
    required = ToolPlan("required", ("get_weather", "get_time"), "hermes")
    text = '[{"name":"get_time","arguments":{"zone":"CET"}},{"name":"get_weather","arguments":{"city":"Pa'
    content, calls = tool_calls(required, text, cut=True)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", '{"zone":"CET"}'), ("get_weather", '{"city":"Pa')]
    assert tool_calls(required, '[{"name":"get_ti', cut=True) == (None, [])          # cut inside the name
    assert [c["function"]["arguments"] for c in tool_calls(required, '[{"name":"get_time"', cut=True)[1]] == [""]
    hermes = ToolPlan("auto", ("get_weather",), "hermes")
    content, calls = tool_calls(hermes, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"ci', cut=True)
    assert content == "Sure." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert tool_calls(hermes, "Sure. <tool_call>\n{\"na", cut=True) == ("Sure.", [])   # no markup as content
    llama3 = ToolPlan("auto", ("get_weather", "get_time"), "llama3")
    content, calls = tool_calls(llama3, '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_w'
                                        'eather", "parameters": {"ci', cut=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    single = ToolPlan("auto", ("get_weather",), "hermes", parallel=False)
    two = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
          '"arguments": {"city": "Oslo"}}</tool_call>'
    assert len(tool_calls(single, two)[1]) == 1 and len(tool_calls(hermes, two)[1]) == 2


def test_tools_reach_the_chat_template():
    template = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                            "{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}")
    assert template.render([{"role": "user", "content": "hi"}], tools=TOOLS) == "[get_weather][get_time]user:hi"
