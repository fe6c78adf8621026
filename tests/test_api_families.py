"""The API families clients speak besides chat/completions, through their own SDKs against a
real server (the default random-weight model on the CPU backend), on asyncio and uvloop,
over HTTP/1.1 and HTTP/2: OpenAI's Responses API (`client.responses.create / stream /
parse`, a function-tool round trip), Anthropic's Messages API (the `anthropic` SDK's
`messages.create / stream / count_tokens`, a tool_use / tool_result round trip) and vLLM's
/tokenize and /detokenize. Greedy answers are compared with /v1/chat/completions' for the
same messages: every family renders the same chat template and samples the same tokens.
"""

import json
from typing import Literal

import anthropic
import httpx
import httpx2
import openai
import pydantic
import pytest

import tokenwire

MODEL = "tokenwire-default-random"
QUESTION = "What is the weather in Paris?"


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: int = pydantic.Field(ge=-30, le=45)
    rain: bool


WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}}}


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def server(request):
    s = tokenwire.Server(backend="cpu", port=0, loop=request.param).start()
    yield s
    s.stop()


@pytest.fixture(scope="module", params=["http1.1", "http2"])
def http2(request):
    return request.param == "http2"


@pytest.fixture(scope="module")
def http_client(server, http2):
    with httpx.Client(http1=not http2, http2=http2, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server, http_client):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=http_client)


@pytest.fixture(scope="module")
def claude(server, http2):
    """The anthropic SDK on its own HTTP stack (httpx2, which it requires instead of httpx)."""
    with httpx2.Client(http1=not http2, http2=http2, timeout=120) as client:
        yield anthropic.Anthropic(base_url=server.url, api_key="unused", http_client=client)


def chat_text(oai, messages, max_tokens):
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


# ------------------------------------------------------------------ OpenAI Responses

def test_responses_text_is_chat_completions_answer(oai):
    r = oai.responses.create(model=MODEL, instructions="Answer briefly.", input=QUESTION, max_output_tokens=12,
                             temperature=0)
    text, use = chat_text(oai, [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": QUESTION}], 12)
    assert r.output_text == text and text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == use.prompt_tokens and r.usage.output_tokens == 12
    assert r.id.startswith("resp_") and r.output[0].type == "message" and r.model == MODEL


def test_responses_stream(oai):
    with oai.responses.stream(model=MODEL, input=[{"role": "user", "content": QUESTION}], max_output_tokens=16,
                              temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 8                                 # token by token
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == chat_text(oai, [{"role": "user", "content": QUESTION}], 16)[0]
    assert final.usage.output_tokens == 16 and final.status == "incomplete"
    raw = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, stream=True))
    assert raw[-1].type == "response.completed" and raw[-1].response.usage.output_tokens == 4


def test_responses_parse_with_a_pydantic_model(oai):
    for seed in range(2):
        r = oai.responses.parse(model=MODEL, input=QUESTION, text_format=Weather, max_output_tokens=200,
                                temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed" and isinstance(r.output_parsed, Weather), r.output_text
    r = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=200, temperature=0,
                             text={"format": {"type": "json_schema", "name": "weather",
                                              "schema": Weather.model_json_schema(), "strict": True}})
    Weather.model_validate_json(r.output_text)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_responses_function_tool_round_trip(oai, streamed):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER_SCHEMA, "strict": True}]
    items = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model=MODEL, tools=tools, tool_choice="required", max_output_tokens=200, extra_body={"seed": 7})
    if streamed:
        with oai.responses.stream(input=items, **kwargs) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    else:
        first = oai.responses.create(input=items, **kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        assert set(json.loads(call.arguments)) == {"city", "unit"} and call.call_id.startswith("call_")
    items += first.output                                   # the SDK's items go back as they came
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": '{"celsius": 21}'} for c in calls]
    final = oai.responses.create(model=MODEL, input=items, tools=tools, tool_choice="none", max_output_tokens=8,
                                 temperature=0, stream=False)
    assert final.output_text and final.status == "incomplete"
    # the call and its output reached the template: the prompt is the chat route's for the same turns
    chat = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]}]
    chat += [{"role": "tool", "tool_call_id": c.call_id, "content": '{"celsius": 21}'} for c in calls]
    r = oai.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, temperature=0,
                                    tools=[{"type": "function", "function": {
                                        "name": "get_weather", "description": "Current weather in a city",
                                        "parameters": WEATHER_SCHEMA}}], tool_choice="none")
    assert final.output_text == r.choices[0].message.content
    assert final.usage.input_tokens == r.usage.prompt_tokens


# ------------------------------------------------------------------ Anthropic Messages

def test_messages_text_is_chat_completions_answer(claude, oai):
    m = claude.messages.create(model=MODEL, max_tokens=12, system="Answer briefly.", extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": QUESTION}])
    text, use = chat_text(oai, [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": QUESTION}], 12)
    assert m.content[0].type == "text" and m.content[0].text == text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12 and m.usage.input_tokens == use.prompt_tokens
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == MODEL


def test_messages_stream(claude, oai):
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    with claude.messages.stream(model=MODEL, max_tokens=16, messages=messages, extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 8                                 # token by token
    assert "".join(pieces) == final.content[0].text == chat_text(oai, [{"role": "user", "content": QUESTION}], 16)[0]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16


def test_messages_stop_sequence(claude):
    m = claude.messages.create(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "x"}],
                               extra_body={"temperature": 0})
    text = m.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    cut = claude.messages.create(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "x"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_messages_tool_round_trip(claude, streamed):
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}]
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model=MODEL, max_tokens=200, tools=tools, tool_choice={"type": "any"},
                  extra_body={"temperature": 0})
    if streamed:
        with claude.messages.stream(messages=messages, **kwargs) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_message()
        assert "content_block_start" in kinds and kinds[-1] == "message_stop"
    else:
        first = claude.messages.create(messages=messages, **kwargs)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses
    assert all(u.name == "get_weather" and set(u.input) == {"city", "unit"} for u in uses)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "21 C"}
                                              for u in uses]}]
    final = claude.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=messages,
                                   extra_body={"temperature": 0})
    assert final.content[0].type == "text" and final.content[0].text and final.stop_reason == "max_tokens"
    count = claude.messages.count_tokens(model=MODEL, tools=tools, messages=messages)
    assert count.input_tokens == final.usage.input_tokens


def test_messages_named_tool(claude):
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA},
             {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["CET"]}},
                                                   "required": ["zone"], "additionalProperties": False}}]
    m = claude.messages.create(model=MODEL, max_tokens=100, tools=tools, tool_choice={"type": "tool", "name": "get_time"},
                               messages=[{"role": "user", "content": "time?"}])
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_time", {"zone": "CET"})]


def test_count_tokens_is_the_prompt_messages_submits(claude):
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "And tomorrow?"}]
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    m = claude.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=messages)
    assert count.input_tokens == m.usage.input_tokens > 20


# ------------------------------------------------------------------ /tokenize, /detokenize

def test_tokenize_detokenize_round_trip(server, http_client):
    text = "Héllo, wörld! Once upon a time\n\tthere were 42 tokens."
    r = http_client.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["count"] == len(r["tokens"]) > 5 and r["max_model_len"] == http_client.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    back = http_client.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    # the default tokenizes as a completion prompt does, with the model's BOS rule
    default = http_client.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert default["count"] == completion["usage"]["prompt_tokens"] and len(default["token_strs"]) == default["count"]
    messages = [{"role": "user", "content": text}]
    chat = http_client.post(server.url + "/tokenize", json={"messages": messages}).json()
    used = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == used["usage"]["prompt_tokens"]


def test_tokenize_a_large_prompt_off_the_loop(server, http_client):
    """A prompt of 16 KiB or more is tokenized on the worker threads, as a generation's is:
    the same ids as the same text tokenized in pieces on the loop."""
    piece = "Once upon a time, a small robot counted 12 stars. "
    text = piece * 400                                      # ~20 KB
    big = http_client.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    small = http_client.post(server.url + "/tokenize", json={"prompt": piece * 20, "add_special_tokens": False}).json()
    assert 19 * small["count"] <= big["count"] <= 21 * small["count"]
    assert big["tokens"][:small["count"] // 2] == small["tokens"][:small["count"] // 2]
    assert http_client.post(server.url + "/detokenize", json={"tokens": big["tokens"]}).json() == {"prompt": text}
    with_bos = http_client.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert with_bos["tokens"][-big["count"]:] == big["tokens"]
