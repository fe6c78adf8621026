"""The real CPU engine (engine directory -> forward -> ModelRunner -> EngineCore) on the trained
stories260K checkpoint, with both CPU forwards (the numpy ReferenceModel and the C kernels'
CpuModel): run.c's greedy output, batch-composition independence of greedy and seeded
outputs, and preemption on a real paged cache."""

import functools
import json
import threading

import pytest

from engines import engine_core
from tokenwire.kernels import cpu
from tokenwire.kernels.model_runner import kv_cache_num_blocks
from tokenwire.core.outputs import FINISH_LENGTH, Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
from tokenwire.kernels.engine_format import load_engine
from tokenwire.engine_build.quantize import QuantOptions

FORWARDS = ["reference", "cpu", "cpu_int8"]    # the C forward exact (the golden path) and with its int8 default
PROMPTS = ["Once upon a time", "Lily", "The dog", "One day, a little boy named Tom went to the park with his mom.",
           "She was sad", "Tim and Sue", "The sun was", "A big red ball", "He said,", "They"]


@pytest.fixture(scope="module")
def engines(stories260k_dir, tmp_path_factory):
    """{"fp32": Engine, "int4": Engine} built from the real checkpoint."""
    src = open_source(stories260k_dir / "stories260K.bin")
    out = {}
    for name, quant in (("fp32", QuantOptions(method="none")), ("int4", QuantOptions(method="int4", algorithm="rtn"))):
        out[name] = load_engine(build_engine(src, tmp_path_factory.mktemp(name) / "engine", BuildOptions(quant=quant)))
    return out


@pytest.fixture(params=FORWARDS)
def build(request):
    """engine_core on one of the CPU backends ("reference": numpy; "cpu": the C forward)."""
    if request.param != "reference" and not cpu.AVAILABLE:
        pytest.skip("the C extension kernels/cpu/_cpu is not built")
    if request.param == "reference":
        return functools.partial(engine_core, backend="reference")
    return functools.partial(engine_core, backend="cpu", activations="int8" if request.param == "cpu_int8" else "fp32")


def generate(core, requests):
    """requests: [(request_id, prompt ids, SamplingParams)] all submitted at once.
    -> {request_id: (token ids, text, finish_reason)}"""
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params, Timeline())
    tokens, texts, finish = {}, {}, {}
    while core.has_unfinished():
        for o in core.step().rows:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            texts[o.request_id] = texts.get(o.request_id, "") + o.text
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    assert core.stats().num_kv_blocks_used == 0
    return {rid: (tokens[rid], texts[rid], finish[rid]) for rid in finish}


def prompts(engine, n):
    return [engine.encode_prompt(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(n)]


def test_greedy_reproduces_run_c(engines, stories260k_dir, build):
    if build.keywords.get("activations") == "int8":
        pytest.skip("int8 activations are not run.c's arithmetic: the golden run is the exact path's")
    ref = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    run = max(ref["runs"], key=lambda r: len(r["generated_token_ids"]))
    engine = engines["fp32"]
    prompt = engine.encode_prompt("Once upon a time")
    assert prompt == ref["prompt_token_ids"]
    want = run["generated_token_ids"]
    core = build(engine, max_num_seqs=4)
    tokens, text, finish = generate(core, [(1, prompt, SamplingParams(temperature=0.0, max_tokens=len(want)))])[1]
    assert tokens == want and finish == FINISH_LENGTH
    assert "Once upon a time" + text == run["stdout"].rstrip("\n")[:len("Once upon a time" + text)]


def test_32_concurrent_greedy_requests_match_their_solo_runs(engines, build):
    engine = engines["int4"]
    ps = prompts(engine, 32)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    solo, one_at_a_time = {}, build(engine, max_num_seqs=1)
    for i, p in enumerate(ps):
        solo.update(generate(one_at_a_time, [(i, p, params)]))
    # a small token budget forces chunked prefill mixed with decodes
    core = build(engine, max_num_seqs=32, max_num_batched_tokens=64)
    batched = generate(core, [(i, p, params) for i, p in enumerate(ps)])
    for i in range(32):
        assert batched[i] == solo[i], f"request {i}: {batched[i][1]!r} != {solo[i][1]!r}"
    assert len({tuple(t) for t, _, _ in solo.values()}) > 5                 # the prompts lead to different stories


def test_seeded_sampling_is_the_same_in_any_batch(engines, build):
    engine = engines["int4"]
    ps = prompts(engine, 24)
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=48, ignore_eos=True)
    other = [SamplingParams(temperature=t, seed=s, max_tokens=m, repetition_penalty=r)
             for t, s, m, r in [(0.0, 1, 30, 1.0), (1.2, 2, 60, 1.1), (0.7, 3, 12, 1.0)]]
    alone = generate(build(engine), [(0, ps[0], target)])[0]
    small = generate(build(engine), [(5, ps[5], other[0]), (0, ps[0], target), (6, ps[6], other[1])])[0]
    mix = [(i, ps[i], other[i % 3]) for i in range(1, 24)]
    crowd = generate(build(engine, max_num_batched_tokens=48), mix[:11] + [(0, ps[0], target)] + mix[11:])[0]
    assert alone == small == crowd
    reseeded = generate(build(engine), [(0, ps[0], SamplingParams(**{**target.__dict__, "seed": 99}))])[0]
    assert reseeded[0] != alone[0]


def test_preemption_on_the_real_cache_keeps_greedy_outputs(engines, build):
    engine = engines["int4"]
    ps = prompts(engine, 12)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    roomy = generate(build(engine, max_num_seqs=12), [(i, p, params) for i, p in enumerate(ps)])
    # 512 positions fit; 12 requests of up to ~80 tokens need ~60 blocks of 16: give 40
    tight = build(engine, max_num_seqs=12, kv_cache_bytes=40 * 16 * 1280)
    assert tight.executor.num_blocks == 40
    cramped = generate(tight, [(i, p, params) for i, p in enumerate(ps)])
    assert tight.stats().num_preemptions > 0
    assert cramped == roomy


def test_engine_thread_streams_a_story(engines):
    engine = engines["int4"]
    done = threading.Event()
    texts = []

    def on_step(outs):
        texts.extend(o.text for o in outs)
        if any(o.finish_reason for o in outs):
            done.set()
    core = engine_core(engine, "reference", on_step=on_step)
    core.start()
    core.add_request(1, engine.encode_prompt("Once upon a time"), SamplingParams(temperature=0.0, max_tokens=30),
                     Timeline())
    assert done.wait(30)
    core.shutdown(timeout=5)
    assert "".join(texts).startswith(",")


def test_kv_cache_sizing():
    from tokenwire.kernels.mock import mock_config
    c = mock_config(512, 512)                                     # 1 layer, 1 kv head of 8: 64 B/token
    assert kv_cache_num_blocks(c, 16, 512, 4) == 4 * 32           # 4 full contexts fit the default budget
    assert kv_cache_num_blocks(c, 16, 512, 4, kv_cache_bytes=64 * 16 * 40) == 40
    with pytest.raises(ValueError, match="fewer than one context"):
        kv_cache_num_blocks(c, 16, 512, 4, kv_cache_bytes=64 * 16 * 10)


def test_logprobs_reach_the_request_outputs(engines, build):
    engine = engines["int4"]
    core = build(engine)
    prompt = engine.encode_prompt("Once upon a time")
    core.add_request(1, prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), Timeline())
    core.add_request(2, prompt, SamplingParams(temperature=0.0, max_tokens=6), Timeline())
    outs = []
    while core.has_unfinished():
        outs += core.step().rows
    mine = [o for o in outs if o.request_id == 1]
    assert len(mine) == 6 and all(o.logprobs is not None and len(o.logprobs) == 1 for o in mine)
    for o in mine:
        lp = o.logprobs[0]
        assert lp.top_ids[0] == o.token_ids[0] and len(lp.top_ids) == 3       # greedy: the top token
        assert 0 >= lp.token_logprob == lp.top_logprobs[0] >= lp.top_logprobs[1] >= lp.top_logprobs[2]
    assert all(o.logprobs is None for o in outs if o.request_id == 2)
