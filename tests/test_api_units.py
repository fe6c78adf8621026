"""Units of the API layer, no sockets: request validation, encoders (exact bytes), chat
templates against transformers' own renderer, context-free HPACK against the hpack decoder,
and the metrics exposition against prometheus_client's parser.
"""

import json
import struct

import hpack
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tokenwire.core.executor import TopLogprobs
from tokenwire.core.outputs import EngineStats, RequestOutput, Timeline
from tokenwire.net.api.chat_template import ChatTemplate
from tokenwire.net.api.errors import ApiError
from tokenwire.net.api.fields import parse_json
from tokenwire.net.api.native import parse_generate
from tokenwire.net.api.openai import parse_chat, parse_completions
from tokenwire.net.metrics import Metrics
from tokenwire.net.protocol.hpack_plain import encode_block, encode_int
from tokenwire.net.writer import encoders


def out(text="tok", ids=(7,), finish=None, logprobs=None, n_out=1):
    return RequestOutput(1, list(ids), text, logprobs, finish, 3, n_out, 0)


# ------------------------------------------------------------ validation

def test_completion_defaults_and_types():
    g = parse_completions({"prompt": "hi", "temperature": 0, "stop": "\n", "seed": 3, "top_k": 5})
    assert g.prompt == "hi" and g.params.max_tokens is None and g.params.greedy
    assert g.params.stop == ("\n",) and g.params.seed == 3 and g.params.top_k == 5
    assert not g.stream and not g.include_usage
    g = parse_completions({"prompt": [[1, 2, 3]], "max_tokens": 4, "stream": True,
                           "stream_options": {"include_usage": True}})
    assert g.prompt_token_ids == [1, 2, 3] and g.stream and g.include_usage


def test_chat_max_completion_tokens_and_logprobs():
    g = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    assert g.messages == [{"role": "user", "content": "ab"}]
    assert g.params.max_tokens == 9 and g.params.logprobs == 3


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "1"}, "temperature"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
])
def test_completion_rejections_name_the_parameter(body, param):
    with pytest.raises(ApiError) as exc:
        parse_completions(body)
    assert exc.value.status == 400 and exc.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": "3"}, "n"),
])
def test_chat_rejections_name_the_parameter(body, param):
    with pytest.raises(ApiError) as exc:
        parse_chat(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_generate_needs_exactly_one_prompt_form():
    assert parse_generate({"prompt_token_ids": [1, 2]}).prompt_token_ids == [1, 2]
    for body in ({}, {"prompt": "a", "prompt_token_ids": [1]}):
        with pytest.raises(ApiError):
            parse_generate(body)


def test_parse_json_distinguishes_encoding_from_syntax():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    with pytest.raises(ApiError) as exc:
        parse_json(b'{"a": "\xc3\x28"}')
    assert exc.value.code == "invalid_encoding"
    with pytest.raises(ApiError) as exc:
        parse_json(b"{'a': 1}")
    assert exc.value.code == "invalid_json"


# -------------------------------------------------------------- encoders

def test_completion_sse_chunk_bytes():
    enc = encoders.CompletionSse("cmpl-9", 1700000000, "m", False, str)
    assert enc.token(out(' he said "hi"')) == (
        b'data: {"id":"cmpl-9","object":"text_completion","created":1700000000,"model":"m","choices":'
        b'[{"index":0,"text":" he said \\"hi\\"","logprobs":null,"finish_reason":null}]}\n\n')
    final = enc.finish(out("", (), "stop"), "stop", encoders.usage(3, 1), {"total_us": 5.0})
    chunks = final.split(b"\n\n")
    assert chunks[-2:] == [b"data: [DONE]", b""]
    last = json.loads(chunks[0][len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "stop" and last["timings"] == {"total_us": 5.0}


def test_chat_sse_role_first_then_content_and_usage_chunk():
    enc = encoders.ChatSse("chatcmpl-1", 1, "m", True, str)
    first = json.loads(enc.first_token(out("A"))[6:])
    second = json.loads(enc.token(out("B"))[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "A"} and first["usage"] is None
    assert second["choices"][0]["delta"] == {"content": "B"}
    parts = [json.loads(p[6:]) for p in enc.finish(out(), "length", encoders.usage(3, 2), {"t": 1}).split(b"\n\n")
             if p.startswith(b"data: {")]
    assert parts[0]["choices"][0]["finish_reason"] == "length" and parts[0]["usage"] is None
    assert parts[1]["choices"] == [] and parts[1]["usage"]["total_tokens"] == 5 and parts[1]["timings"] == {"t": 1}


def test_sse_logprobs_in_openai_shapes():
    lp = [TopLogprobs(-0.5, [7, 8], [-0.5, -1.5])]
    chat = json.loads(encoders.ChatSse("c", 1, "m", False, lambda i: f"<{i}>").token(out("x", logprobs=lp))[6:])
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "<7>" and entry["logprob"] == -0.5 and entry["bytes"] == list(b"<7>")
    assert [t["token"] for t in entry["top_logprobs"]] == ["<7>", "<8>"]
    comp = json.loads(encoders.CompletionSse("c", 1, "m", False, lambda i: f"<{i}>").token(out("x", logprobs=lp))[6:])
    assert comp["choices"][0]["logprobs"] == {"tokens": ["<7>"], "token_logprobs": [-0.5],
                                              "top_logprobs": [{"<7>": -0.5, "<8>": -1.5}], "text_offset": [0]}


def test_ndjson_and_binary_layouts():
    nd = encoders.Ndjson()
    assert nd.token(out("é", (300,))) == '{"id":300,"text":"é"}\n'.encode()
    assert [json.loads(x) for x in nd.token(out("ab", (1, 2))).splitlines()] == [
        {"id": 1, "text": ""}, {"id": 2, "text": "ab"}]
    binary = encoders.BinaryTokens()
    assert binary.token(out("x", (5, 70000))) == struct.pack("<2i", 5, 70000)
    end = binary.finish(out(), "stop", encoders.usage(1, 2), {"total_us": 1.0})
    assert end[:4] == struct.pack("<i", -1)
    (n,) = struct.unpack("<I", end[4:8])
    assert json.loads(end[8:]) == {"finish_reason": "stop", "usage": encoders.usage(1, 2), "timings": {"total_us": 1.0}}
    assert n == len(end) - 8


def test_timings_and_server_timing_header():
    t = Timeline(arrived_ns=1_000_000, tokenized_ns=1_050_000, queued_ns=1_060_000, first_scheduled_ns=1_100_000,
                 step_done_ns=[1_400_000, 1_500_000], first_token_emitted_ns=1_420_000, finished_ns=1_500_000)
    timings = encoders.timings_us(t, 1_600_000)
    assert timings == {"tokenize_us": 50.0, "queue_us": 40.0, "prefill_us": 300.0, "first_token_to_wire_us": 20.0,
                       "ttft_us": 420.0, "decode_us": 100.0, "total_us": 600.0}
    assert encoders.server_timing(timings).startswith(b"tokenize;dur=0.050, queue;dur=0.040, prefill;dur=0.300")


# ---------------------------------------------------------- chat template

TEMPLATES = {
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "alternating": (
        "{{ bos_token }}{% for message in messages %}\n"
        "  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "    {{ raise_exception('roles must alternate user/assistant') }}\n"
        "  {% endif %}\n"
        "  {% if message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]"
        "{% else %} {{ message['content'] | trim }} {{ eos_token }}{% endif %}\n"
        "{% endfor %}"),
    "system_json": (
        "{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"
        "{% set ns.system = m.content %}{% endif %}{% endfor %}"
        "<s>{{ ns.system | tojson }}\n{% for m in messages if m.role != 'system' %}"
        "{% if loop.first %}>>{% endif %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
}
CONVERSATION = [{"role": "system", "content": "Be brief. Ünïcode ✓"}, {"role": "user", "content": " Hello "},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Tell me a story"}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_template_renders_like_transformers(name):
    from transformers.utils.chat_template_utils import render_jinja_template
    source = TEMPLATES[name]
    messages = CONVERSATION[1:] if name == "alternating" else CONVERSATION
    ours = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(messages)
    theirs = render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True,
                                   bos_token="<s>", eos_token="</s>")
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    theirs = theirs[0] if isinstance(theirs, list) else theirs
    assert ours == theirs


def test_template_raise_exception_is_a_400():
    template = ChatTemplate(TEMPLATES["alternating"], {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ApiError) as exc:
        template.render([{"role": "assistant", "content": "x"}])
    assert exc.value.status == 400 and "roles must alternate" in exc.value.message


def test_template_that_does_not_compile_is_a_clear_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_special_tokens_given_as_added_token_dicts():
    template = ChatTemplate("{{ bos_token }}x", {"bos_token": {"content": "<s>", "lstrip": False}})
    assert template.render([{"role": "user", "content": "y"}]) == "<s>x"


# ------------------------------------------------------------------ HPACK

header_value = st.binary(min_size=0, max_size=300).filter(lambda b: b"\r" not in b and b"\n" not in b and b"\0" not in b)


@settings(max_examples=200, deadline=None)
@given(status=st.sampled_from([200, 201, 400, 404, 413, 429, 503]),
       headers=st.lists(st.tuples(st.sampled_from([b"content-type", b"retry-after", b"x-custom",
                                                   b"server-timing", b"cache-control", b"a" * 200]),
                                  header_value), max_size=6))
def test_plain_hpack_decodes_with_hpack_and_never_touches_its_table(status, headers):
    decoder = hpack.Decoder()
    decoded = decoder.decode(encode_block(status, headers), raw=True)
    assert decoded == [(b":status", str(status).encode())] + headers
    assert len(decoder.header_table.dynamic_entries) == 0


def test_hpack_integer_encoding_rfc7541_examples():
    assert encode_int(10, 5, 0) == bytes([0b01010])               # C.1.1
    assert encode_int(1337, 5, 0) == bytes([31, 154, 10])         # C.1.2
    assert encode_int(42, 8, 0) == bytes([42])                    # C.1.3


# ---------------------------------------------------------------- metrics

def test_metrics_exposition_parses_and_buckets_are_cumulative():
    m = Metrics()
    for ns in (5_000, 30_000, 30_000, 700_000, 2_000_000_000, 100 * 10**9):
        m.ttft.observe_ns(ns)
    m.engine_to_wire.observe_many_ns(40_000, 64)
    m.count_request("stop")
    families = {f.name: f for f in text_string_to_metric_families(
        m.render(EngineStats(2, 3, 10, 100, 1, 4, 500, 60, True)).decode())}
    buckets = {s.labels["le"]: s.value for s in families["tokenwire_time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["1e-05"] == 1 and buckets["5e-05"] == 3 and buckets["0.001"] == 4
    assert buckets["60.0"] == 5 and buckets["+Inf"] == 6
    e2w = {s.name: s.value for s in families["tokenwire_engine_to_wire_seconds"].samples}
    assert e2w["tokenwire_engine_to_wire_seconds_count"] == 64
    assert e2w["tokenwire_engine_to_wire_seconds_sum"] == pytest.approx(64 * 40e-6)
    gauges = {name: families[name].samples[0].value for name in (
        "tokenwire_requests_running", "tokenwire_requests_waiting", "tokenwire_kv_blocks_used",
        "tokenwire_kv_blocks_total")}
    assert gauges == {"tokenwire_requests_running": 2, "tokenwire_requests_waiting": 3,
                      "tokenwire_kv_blocks_used": 10, "tokenwire_kv_blocks_total": 100}
    assert families["tokenwire_preemptions"].type == "counter"
    assert orjson.loads(orjson.dumps(m.requests))["stop"] == 1


# ------------------------------------------------------------ API families' encoders

def test_responses_delta_events_are_numbered_past_the_table():
    """The splice's sequence numbers come from a table of 8192 tails, then from formatting:
    each event is the JSON orjson makes of it, numbered on from the four opening events."""
    from tokenwire.net.api.responses import ResponsesSse, parse_responses
    from tokenwire.net.api.route import Served
    enc = ResponsesSse(parse_responses({"input": "hi", "stream": True}), Served("m", str, frozenset()), "resp_7", 0)
    first = enc.first_token(out("a"))
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in first.split(b"\n\n") if e]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3, 4] and events[-1]["delta"] == "a"
    for n in range(5, 8200):
        chunk = enc.splice(f"t{n}")
    head, data = chunk.split(b"\ndata: ")
    assert head == b"event: response.output_text.delta" and data.endswith(b"\n\n")
    assert json.loads(data) == {"type": "response.output_text.delta", "item_id": "msg_7", "output_index": 0,
                                "content_index": 0, "logprobs": [], "delta": "t8199", "sequence_number": 8199}
    done = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in enc.finish(out("", finish="stop"), "stop", {
        "prompt_tokens": 3, "completion_tokens": 8196, "total_tokens": 8199,
        "prompt_tokens_details": {"cached_tokens": 0}}, {"ttft_us": 1.0}).split(b"\n\n") if e]
    assert [e["sequence_number"] for e in done] == list(range(8200, 8204))
    assert done[-1]["type"] == "response.completed" and done[-1]["response"]["status"] == "completed"
    assert done[-1]["response"]["output"][0]["content"][0]["text"] == "a" + "".join(f"t{n}" for n in range(5, 8200))


def test_anthropic_errors_lead_with_the_field():
    from tokenwire.net.api.anthropic import error_body
    assert orjson.loads(error_body(ApiError(400, "max_tokens must be an integer", param="max_tokens"))) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: max_tokens must be an integer"}}
    assert orjson.loads(error_body(ApiError(429, "the queue is full")))["error"] == {
        "type": "rate_limit_error", "message": "the queue is full"}
    assert orjson.loads(error_body(ApiError(413, "too big")))["error"]["type"] == "request_too_large"


def test_messages_stream_token_is_spliced_from_constant_bytes():
    from tokenwire.net.api.anthropic import MessagesSse, parse_messages
    from tokenwire.net.api.route import Served
    enc = MessagesSse(parse_messages({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                      Served("m", str, frozenset({2})), "msg_1", 3)
    prefix, suffix = enc.text_parts()
    assert enc.token(out('é "x"')) == prefix + orjson.dumps('é "x"') + suffix
    head, data = enc.token(out("z")).split(b"\ndata: ")
    assert head == b"event: content_block_delta" and json.loads(data) == {
        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "z"}}


def test_responses_stream_bytes_are_the_response_objects():
    """The stream's opening and closing events are byte templates: they must say what the
    whole-response builders say (response_object, _Events), field for field."""
    from tokenwire.net.api.responses import ResponsesSse, _Events, _message_item, parse_responses, response_object
    from tokenwire.net.api.route import Served
    served = Served("m", str, frozenset())
    g = parse_responses({"input": "hi", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5,
                         "metadata": {"k": "v"}, "stream": True, "text": {"format": {"type": "json_object"}}})
    enc = ResponsesSse(g, served, "resp_3", 1700000000)
    use = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    stream = enc.first_token(out('{"a"')) + enc.splice(": 1}") + enc.finish(out("", finish="length"), "length", use,
                                                                          {"ttft_us": 2.0})
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in stream.split(b"\n\n") if e]
    expected = _Events()
    start = response_object(g, served, "resp_3", 1700000000, "in_progress", [], None)
    expected.open(start)
    expected.start_message(0, "msg_3")
    for delta in ('{"a"', ": 1}"):
        expected.add("response.output_text.delta", item_id="msg_3", output_index=0, content_index=0, delta=delta,
                     logprobs=[])
    expected.end_message(0, "msg_3", '{"a": 1}')
    final = response_object(g, served, "resp_3", 1700000000, "incomplete", [_message_item("msg_3", '{"a": 1}')], use,
                            {"reason": "max_output_tokens"})
    expected.add("response.completed", response=final, timings={"ttft_us": 2.0})
    assert events == [json.loads(e.split(b"\ndata: ", 1)[1]) for e in expected.bytes().split(b"\n\n") if e]
    assert [e.split(b"\n", 1)[0] for e in stream.split(b"\n\n") if e] == \
        [e.split(b"\n", 1)[0] for e in expected.bytes().split(b"\n\n") if e]
    assert final["instructions"] == "be brief" and final["metadata"] == {"k": "v"} and final["usage"] == {
        "input_tokens": 3, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
