"""Constrained decoding on the default random-weight model: every constrained completion
matches its schema, regex or choice, at temperature 1.0 over many seeds (the engine driven
directly, as the server drives it, through tokenwire/runtime.py); grammar errors; the
sampler's mask agrees between the fast path and the reference."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
from engines import mock_engine_core

from tokenwire.core.constraint import ConstraintSpec, InvalidConstraint
from tokenwire.core.executor import SeqStep
from tokenwire.core.options import EngineOptions
from tokenwire.core.outputs import Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.kernels import BACKENDS
from tokenwire.kernels.grammar import apply_bitmask
from tokenwire.kernels.sampling import sample, sample_reference
from tokenwire.net.api.structured import schema_spec
from tokenwire.runtime import build_engine

NUM_SAMPLES = 64                         # per schema, seeded at temperature 1 (200 took ~4 min of CI at load)
MAX_TOKENS = 400

SCHEMAS = {
    "nested": {
        "type": "object", "additionalProperties": False, "required": ["user", "active"],
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                     "properties": {"name": {"type": "string", "maxLength": 10},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
            "active": {"type": "boolean"},
        },
    },
    "array_enum": {
        "type": "object", "additionalProperties": False, "required": ["tags", "level"],
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "level": {"enum": ["low", "mid", "high"]},
        },
    },
    "bounded_numbers": {
        "type": "object", "additionalProperties": False, "required": ["x", "ratio"],
        "properties": {"x": {"type": "integer", "minimum": -20, "maximum": 300},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
    },
    "patterned": {
        "type": "object", "additionalProperties": False, "required": ["code", "when"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "when": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
    },
}


@pytest.fixture(scope="module")
def built():
    return build_engine(EngineOptions(backend="cpu", max_num_seqs=64))


def run_constrained(built, spec: ConstraintSpec, num: int, temperature: float = 1.0,
                    prompt: str = "Answer in JSON:") -> list:
    """`num` seeded requests under `spec`, run to the end -> [(text, finish_reason)]. `prompt`
    may hold `{k}`, the request's index (greedy requests differ by their prompts)."""
    core, card = built
    compiled = card.grammars.compile(spec)
    base = 10_000 * (abs(hash(spec)) % 1000)
    texts, finish = {}, {}
    for k in range(num):
        core.add_request(base + k, card.encode_prompt(prompt.format(k=k)),
                         SamplingParams(temperature=temperature, seed=k, max_tokens=MAX_TOKENS),
                         Timeline(), constraint=compiled.constraint())
    while core.has_unfinished():
        for out in core.step().rows:
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return [(texts.get(base + k, ""), finish[base + k]) for k in range(num)]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(built, name):
    schema = SCHEMAS[name]
    outputs = run_constrained(built, schema_spec(schema), NUM_SAMPLES)
    for text, reason in outputs:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema)
    assert len({t for t, _ in outputs}) > NUM_SAMPLES // 4       # the seeds really sample


def test_regex_and_choice_outputs_match(built):
    pattern = r"(yes|no), [a-z]{2,5} [0-9]{1,3}"
    for text, reason in run_constrained(built, ConstraintSpec("regex", pattern), 100):
        assert re.fullmatch(pattern, text), text
    choices = ["alpha", "beta", "gamma delta"]
    seen = set()
    for text, reason in run_constrained(built, ConstraintSpec("choice", json.dumps(choices)), 100):
        assert text in choices
        seen.add(text)
    assert len(seen) > 1


def test_json_object_and_grammar(built):
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    outputs = run_constrained(built, ConstraintSpec("grammar", grammar), 30)
    assert len(outputs) == 30
    for text, reason in outputs:
        assert reason == "stop" and re.fullmatch(r"\([a-c](,[a-c])*\)", text), (reason, text)
    # greedy: each request its own prompt (json_object has no bound; on these the random model closes it)
    outputs = run_constrained(built, ConstraintSpec("json_object", ""), 20, temperature=0.0,
                              prompt="Request number {k} says")
    assert len(outputs) == 20
    for text, reason in outputs:
        assert reason == "stop" and isinstance(json.loads(text), dict), (reason, text)


@pytest.mark.parametrize("backend", [name for name, row in BACKENDS.items()
                                     if row.samples_constrained and name not in ("cuda", "trt")])
def test_greedy_decoding_keeps_to_every_kind_of_constraint(backend):
    """temperature 0 on every backend that masks (the cpu forward's fused argmax is taken
    before the mask: the sampler must not trust it for a constrained row)."""
    built = build_engine(EngineOptions(backend=backend, max_num_seqs=16))
    cases = [(ConstraintSpec("choice", json.dumps(["happy", "sad"])), lambda t: t in ("happy", "sad")),
             (ConstraintSpec("regex", r"(yes|no), [a-z]{2,5} [0-9]{1,3}"),
              lambda t: re.fullmatch(r"(yes|no), [a-z]{2,5} [0-9]{1,3}", t)),
             (ConstraintSpec("grammar", 'start: "(" item ("," item)? ")"\nitem: /[a-c]/'),
              lambda t: re.fullmatch(r"\([a-c](,[a-c])?\)", t)),
             (schema_spec(SCHEMAS["array_enum"]), lambda t: jsonschema.validate(json.loads(t), SCHEMAS["array_enum"])
              is None)]
    for spec, valid in cases:
        outputs = run_constrained(built, spec, 8, temperature=0.0, prompt="Request {k}: the answer is")
        assert len(outputs) == 8
        for text, reason in outputs:
            assert reason == "stop" and valid(text), (spec.kind, reason, text)


def _out_of_order_schemas(num: int) -> list:
    """`num` object schemas of 2-6 bounded properties, none listed in alphabetical order."""
    rng = random.Random(25)
    names = ["zeta", "reasoning", "answer", "id", "mood", "beta", "alpha", "count", "verdict", "note"]
    kinds = [{"type": "boolean"}, {"enum": ["low", "high"]}, {"type": "integer", "minimum": 0, "maximum": 9},
             {"type": "string", "maxLength": 6}]
    schemas = []
    for i in range(num):
        props = rng.sample(names, 2 + i % 5)
        if props == sorted(props):
            props.reverse()
        schemas.append({"type": "object", "additionalProperties": False, "required": props,
                        "properties": {p: kinds[(i + j) % len(kinds)] for j, p in enumerate(props)}})
    return schemas


def test_json_follows_the_schemas_property_order(built):
    """"reasoning, answer" thinks before it answers: the output's keys come in the schema's
    order, never sorted (20 schemas, greedy and sampled)."""
    schemas = _out_of_order_schemas(20)
    assert all(list(s["properties"]) != sorted(s["properties"]) for s in schemas)
    for schema in schemas:
        outputs = run_constrained(built, schema_spec(schema), 2, temperature=0.0) + \
            run_constrained(built, schema_spec(schema), 2, temperature=1.0)
        assert len(outputs) == 4
        for text, reason in outputs:
            assert reason == "stop", (reason, text)
            value = json.loads(text)
            jsonschema.validate(value, schema)
            assert list(value) == list(schema["properties"]), (text, list(schema["properties"]))


@pytest.mark.parametrize("spec", [ConstraintSpec("regex", "a(b"), ConstraintSpec("json_schema", '{"type": 12}'),
                                  ConstraintSpec("grammar", "start: undefined_rule")])
def test_invalid_constraints_name_the_problem(built, spec):
    with pytest.raises(InvalidConstraint) as exc:
        built.card.grammars.compile(spec)
    assert spec.kind.replace("_", " ") in str(exc.value)


def test_mask_is_applied_alike_by_fast_path_and_reference(built):
    """Constrained and unconstrained rows in one batch: the fast path and the reference pick
    the same tokens, every constrained pick is allowed by its grammar."""
    _, card = built
    vocab_size = 781
    compiled = card.grammars.compile(schema_spec(SCHEMAS["nested"]))
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, vocab_size)).astype(np.float32) * 3
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=20)] * 2
    seqs = [SeqStep(i, [1], 0, [0], True, params[i], i, [1], [], compiled.constraint() if i % 2 == 0 else None)
            for i in range(8)]
    fast = sample(logits.copy(), seqs).token_ids
    seqs = [s._replace(constraint=compiled.constraint() if s.constraint is not None else None) for s in seqs]
    # the cpu forward hands over the argmax of the unmasked logits: a masked row's must be taken again
    assert sample(logits.copy(), seqs, np.argmax(logits, axis=1)).token_ids == fast
    seqs = [s._replace(constraint=compiled.constraint() if s.constraint is not None else None) for s in seqs]
    ref = sample_reference(logits.copy(), seqs).token_ids
    assert fast == ref
    for i in range(0, 8, 2):
        assert card.tokenizer.id_to_token(fast[i]) == "{"      # the only token a JSON object starts with here


def test_apply_bitmask_keeps_exactly_the_allowed_tokens():
    rng = np.random.default_rng(1)
    for vocab_size, density in ((781, 0.01), (781, 0.9), (1000, 0.0), (150_000, 0.0001), (150_000, 0.05)):
        words = (vocab_size + 31) // 32
        allowed = rng.random((3, words * 32)) < density                                  # [k, 32 W]
        allowed[1] = rng.random(words * 32) < 0.5                                        # a dense row among sparse
        bitmask = np.packbits(allowed, axis=1, bitorder="little").view(np.int32)          # [k, W]
        logits = rng.standard_normal((5, vocab_size)).astype(np.float32)
        rows = [4, 0, 2]
        got = logits.copy()
        apply_bitmask(got, rows, bitmask)
        want = logits.copy()
        for k, i in enumerate(rows):
            want[i][~allowed[k, :vocab_size]] = -np.inf
        np.testing.assert_array_equal(got, want)


class RefusingConstraint:
    """A TokenConstraint that takes nothing: what an executor ignoring the mask would meet."""
    mask_ns = 0

    def accept(self, token_id):
        return False

    def is_finished(self):
        return False


def test_a_token_the_grammar_refuses_fails_only_that_request():
    core = mock_engine_core()
    core.add_request(1, [1, 2], SamplingParams(max_tokens=5), Timeline(), constraint=RefusingConstraint())
    core.add_request(2, [1, 2], SamplingParams(max_tokens=5), Timeline())
    finished = {}
    while core.has_unfinished():
        for out in core.step().rows:
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert finished[1].finish_reason == "error" and "grammar" in finished[1].error
    assert finished[2].finish_reason == "length" and finished[2].num_output_tokens == 5


def test_a_constrained_request_is_never_answered_from_the_response_cache():
    core, card = build_engine(EngineOptions(backend="cpu", response_cache_size=8))
    prompt = card.encode_prompt("Answer:")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12)
    texts = {}
    for request_id, constraint in ((1, None), (2, card.grammars.compile(ConstraintSpec("regex", "[0-9]{4}")))):
        core.add_request(request_id, prompt, params, Timeline(),
                         constraint=constraint.constraint() if constraint else None)
        while core.has_unfinished():
            for out in core.step().rows:
                texts[out.request_id] = texts.get(out.request_id, "") + out.text
    assert re.fullmatch("[0-9]{4}", texts[2]), texts
    assert core.response_cache.num_hits == 0
