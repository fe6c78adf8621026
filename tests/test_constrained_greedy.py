"""Greedy decoding (temperature 0, what most people use for tools and extraction) under every
kind of output constraint, through a real server on 127.0.0.1 over HTTP/2, on every backend
whose `kernels.BACKENDS` row masks constrained rows: many requests per kind at once, each
prompt different, every answer valid and finished by its grammar, no 5xx. A backend that
does no constrained decoding (the mock) refuses each kind with a 400 naming the field.

Requests per kind: 24 on cpu, 6 on the numpy reference (CI's time);
`TOKENWIRE_GREEDY_REQUESTS=100` runs 100 per kind on each backend (issue 25's acceptance).

The cpu backend's lm_head finds each row's argmax while its outputs are in cache; that
argmax is taken before the grammar's mask, so a sampler that trusted it for a greedy row
answered a token the grammar refuses (500 engine_error) for every kind here."""

import asyncio
import json
import os
import re

import httpx
import jsonschema
import pytest

import tokenwire
from tokenwire.core.constraint import ConstraintSpec
from tokenwire.kernels import BACKENDS

NUM_REQUESTS = {"cpu": 24}               # per kind; other backends: DEFAULT_NUM_REQUESTS
DEFAULT_NUM_REQUESTS = 6
CONSTRAINED_BACKENDS = [name for name, row in BACKENDS.items() if row.samples_constrained]
CPU_ONLY = ("cuda", "trt")                  # need a GPU: their rows do not mask anyway (samples_constrained False)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["reasoning", "mood", "score"],
          "properties": {"reasoning": {"type": "string", "maxLength": 12},
                         "mood": {"enum": ["happy", "sad", "calm"]},
                         "score": {"type": "integer", "minimum": 0, "maximum": 99}}}
REGEX = r"(yes|no), [a-z]{2,5} [0-9]{1,3}"
GRAMMAR = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[a-c]/'    # bounded: a greedy random model loops
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["zone"],
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _text(r: dict) -> str:
    choice = r["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _check_schema(r: dict) -> bool:
    text = _text(r)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return list(value) == list(SCHEMA["properties"])             # the schema's order, not sorted


def _check_calls(r: dict, *, one: bool = False) -> bool:
    message = r["choices"][0]["message"]
    for call in message.get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[call["function"]["name"]])
    return message["content"] is None and bool(message.get("tool_calls")) and (
        not one or len(message["tool_calls"]) == 1)


def _check_streamed_call(events: list) -> bool:
    deltas = [d for e in events if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    if not deltas or deltas[0]["function"]["name"] != "get_time":
        return False
    zone = json.loads("".join(d["function"]["arguments"] for d in deltas))["zone"]
    return bool(re.fullmatch("[A-Z]{3}", zone))


# kind -> (route, request fields, the field a refusal names, check of one answer: True when valid)
KINDS = {
    "guided_choice": ("/v1/completions", {"guided_choice": ["happy", "sad"]}, "guided_choice",
                      lambda r: _text(r) in ("happy", "sad")),
    "guided_regex": ("/v1/completions", {"guided_regex": REGEX}, "guided_regex",
                     lambda r: bool(re.fullmatch(REGEX, _text(r)))),
    "guided_grammar": ("/v1/completions", {"guided_grammar": GRAMMAR}, "guided_grammar",
                       lambda r: bool(re.fullmatch(r"\([a-c](,[a-c]){0,2}\)", _text(r)))),
    "structured_outputs": ("/v1/completions", {"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json",
                           _check_schema),
    "json_object": ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format",
                    lambda r: isinstance(json.loads(_text(r)), dict)),
    "json_schema": ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "mood", "schema": SCHEMA}}}, "response_format", _check_schema),
    "tools_required": ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required",
                                                "parallel_tool_calls": False}, "tools",
                       lambda r: _check_calls(r, one=True)),
    "tools_named": ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}, "stream": True}, "tools", _check_streamed_call),
}


# json_object has no bound, and on most prompts the default (random) model's greedy object
# opens a string it never closes. On these it mostly closes; where it runs to max_tokens the
# answer must still be a prefix the grammar allows (the model's loop, not the constraint's).
PROMPTS = {"json_object": "Request number {k} says"}
UNBOUNDED = {"json_object": ConstraintSpec("json_object", "")}


def _body(kind: str, route: str, fields: dict, k: int) -> dict:
    prompt = PROMPTS.get(kind, "Request {k}: say what you think of number {n}.").format(k=k, n=k * 7919 % 1000)
    where = {"prompt": prompt} if route == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]}
    return {**where, "max_tokens": 120, "temperature": 0, **fields}


def _grammar_allows(server, spec: ConstraintSpec, text: str) -> bool:
    """Whether `spec`'s grammar takes `text` (re-tokenized) as a prefix of a valid answer."""
    model = server.app.model
    constraint = model.grammars.compile(spec).constraint()
    return all(constraint.accept(i) for i in model.tokenizer.encode(text, add_special_tokens=False).ids)


def _parse(r: httpx.Response):
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    return r.json()


async def _post_all(url: str, route: str, bodies: list) -> list:
    async with httpx.AsyncClient(http2=True, timeout=600) as client:
        # one HTTP/2 connection; the server batches the requests in its engine steps
        return await asyncio.gather(*(client.post(url + route, json=b) for b in bodies))


def num_requests(backend: str) -> int:
    return int(os.environ.get("TOKENWIRE_GREEDY_REQUESTS", 0)) or NUM_REQUESTS.get(backend, DEFAULT_NUM_REQUESTS)


@pytest.fixture(scope="module", params=[b for b in CONSTRAINED_BACKENDS if b not in CPU_ONLY])
def server(request):
    s = tokenwire.Server(backend=request.param, port=0, max_num_seqs=num_requests(request.param)).start()
    yield s
    s.stop()


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_answers_match_their_constraint(server, kind):
    route, fields, _, check = KINDS[kind]
    num = num_requests(server.options.backend)
    responses = asyncio.run(_post_all(server.url, route, [_body(kind, route, fields, k) for k in range(num)]))
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * num, [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
    answers = [_parse(r) for r in responses]
    num_cut = 0
    for answer in answers:
        last = [e for e in answer if e["choices"]][-1] if isinstance(answer, list) else answer    # streamed: events
        if kind in UNBOUNDED and last["choices"][0]["finish_reason"] == "length":
            assert _grammar_allows(server, UNBOUNDED[kind], _text(answer)), answer
            num_cut += 1
            continue
        assert last["choices"][0]["finish_reason"] in ("stop", "tool_calls"), answer
        assert check(answer) is True, answer
    print(f"{server.options.backend} {kind}: {num - num_cut} of {num} complete and valid, "
          f"{num_cut} cut by max_tokens inside an unbounded value (a valid prefix)")
    texts = {json.dumps(a)[-400:] for a in answers}
    assert len(texts) > 1                   # the prompts differ, and so (mostly) do the answers


@pytest.fixture(scope="module")
def mock_server():
    s = tokenwire.Server(backend="mock", port=0).start()
    yield s
    s.stop()


def test_a_backend_without_grammars_refuses_every_kind_naming_its_field(mock_server):
    assert not BACKENDS["mock"].samples_constrained
    for kind, (route, fields, param, _) in KINDS.items():
        responses = asyncio.run(_post_all(mock_server.url, route, [_body(kind, route, fields, k) for k in range(10)]))
        for r in responses:
            assert r.status_code == 400, (kind, r.status_code, r.text)
            error = r.json()["error"]
            assert error["param"] == param and "no constrained decoding" in error["message"], (kind, error)
