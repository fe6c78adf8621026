"""The exact-match response cache: a repeated greedy or seeded request is answered without
the model, with the live answer's outputs one by one; any other parameter, an unseeded
sample, logprobs, a cancelled or failed answer never match; the LRU stays bounded. Over HTTP
(mock engine) the replayed stream has the live one's event shape."""

import json

import pytest

from tokenwire.core.outputs import Timeline
from tokenwire.core.sampling_params import SamplingParams

from engines import mock_engine_core
from test_scheduler import KVCheckingExecutor, make_engine, run

PROMPT = [5, 6, 7, 8, 9]


def ask(engine, rid, prompt=PROMPT, **params):
    params.setdefault("max_tokens", 6)
    t = Timeline()
    engine.add_request(rid, prompt, SamplingParams(**params), t)
    outs = []
    while engine.has_unfinished() or not outs:
        outs += [o for o in engine.step().rows if o.request_id == rid]
        if outs and outs[-1].finish_reason:
            break
    assert outs[-1].finish_reason in ("length", "stop"), outs[-1]   # a failed answer is never cached either
    return outs, t


def fields(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.num_output_tokens) for o in outs]


@pytest.fixture
def engine():
    ex = KVCheckingExecutor(sampled_logits=True)
    core = make_engine(ex, response_cache_size=2)
    core.test_executor = ex
    return core


def test_a_repeated_greedy_request_is_replayed_without_the_model(engine):
    live, t1 = ask(engine, 1, temperature=0.0)
    num_steps = len(engine.test_executor.log)
    again, t2 = ask(engine, 2, temperature=0.0)
    assert fields(again) == fields(live) and len(again) == 6        # one output per token, as live
    assert len(engine.test_executor.log) == num_steps               # the model never ran
    assert t2.response_cached and not t1.response_cached and len(t2.step_done_ns) == 6
    assert engine.stats().num_response_cache_hits == 1 and engine._live_ids == set()


@pytest.mark.parametrize("other", [dict(max_tokens=5), dict(temperature=0.0, stop=["x"]),
                                   dict(temperature=0.0, repetition_penalty=1.2), dict(temperature=0.0, seed=3),
                                   dict(temperature=0.0, logprobs=1)])
def test_different_parameters_never_match(engine, other):
    ask(engine, 1, temperature=0.0)
    params = dict(temperature=0.0)
    params.update(other)
    ask(engine, 2, **params)
    assert engine.stats().num_response_cache_hits == 0
    ask(engine, 3, prompt=PROMPT + [10], temperature=0.0)
    assert engine.stats().num_response_cache_hits == 0


def test_seeded_samples_are_cached_unseeded_and_logprobs_are_not(engine):
    first, _ = ask(engine, 1, temperature=1.0, seed=11)
    again, t = ask(engine, 2, temperature=1.0, seed=11)
    assert fields(again) == fields(first) and t.response_cached
    ask(engine, 3, temperature=1.0)
    ask(engine, 4, temperature=1.0)
    ask(engine, 5, temperature=0.0, logprobs=2)
    ask(engine, 6, temperature=0.0, logprobs=2)
    assert engine.stats().num_response_cache_hits == 1


def test_cancelled_answers_are_not_stored_and_the_lru_is_bounded(engine):
    engine.add_request(1, PROMPT, SamplingParams(temperature=0.0, max_tokens=50), Timeline())
    engine.step()
    engine.cancel(1)
    run(engine)
    ask(engine, 2, temperature=0.0, max_tokens=50)
    assert engine.stats().num_response_cache_hits == 0              # the cancelled one was not stored
    for rid, n in enumerate((1, 2, 3), start=10):                   # three answers, room for two
        ask(engine, rid, temperature=0.0, max_tokens=n)
    assert len(engine.response_cache.entries) == 2
    ask(engine, 20, temperature=0.0, max_tokens=1)                  # the oldest was evicted
    ask(engine, 21, temperature=0.0, max_tokens=3)
    assert engine.stats().num_response_cache_hits == 1


def test_stop_strings_replay_the_same_cut_text():
    core = mock_engine_core(max_model_len=256, response_cache_size=4)
    texts = []
    for rid in (1, 2):
        outs, t = ask(core, rid, prompt=[3, 4], temperature=0.0, max_tokens=40, stop=["robot"])
        texts.append(("".join(o.text for o in outs), outs[-1].finish_reason, t.response_cached))
    assert texts[0][0] == texts[1][0] and "robot" not in texts[0][0] and texts[0][1] == texts[1][1] == "stop"
    assert texts[1][2] and not texts[0][2]


def test_over_http_a_cached_answer_has_the_live_event_shape():
    import httpx
    import tokenwire
    server = tokenwire.Server(backend="mock", port=0, loop="asyncio", response_cache_size=8).start()
    try:
        body = {"model": "mock", "prompt": "hi", "max_tokens": 7, "temperature": 0, "stream": True}
        with httpx.Client(http2=True) as client:
            streams = [client.post(server.url + "/v1/completions", json=body).text for _ in range(2)]
            metrics = client.get(server.url + "/metrics").text
        assert "\ntokenwire_response_cache_hits_total 1\n" in metrics
        events = [[json.loads(line[6:]) for line in s.splitlines() if line.startswith("data: {")] for s in streams]
        shape = [[(c["index"], c["text"], c["finish_reason"]) for e in evs for c in e["choices"]] for evs in events]
        assert shape[0] == shape[1] and len(shape[0]) == 8                  # 7 token chunks and the finish chunk
        assert [evs[-1]["timings"].get("response_cached") for evs in events] == [None, True]
        assert all(s.endswith("data: [DONE]\n\n") for s in streams)
    finally:
        server.stop()


def test_a_choice_whose_leader_is_replayed_runs_on_its_own(engine):
    from tokenwire.core.sampling_params import choice_params
    ask(engine, 1, temperature=1.0, seed=5)                         # choice 0's answer is cached
    params = choice_params(SamplingParams(temperature=1.0, seed=5, max_tokens=6), 2)
    engine.add_choices([2, 3], PROMPT, params, [Timeline(), Timeline()])
    tokens, finish, _ = run(engine)
    assert set(finish) == {2, 3} and engine.stats().num_response_cache_hits == 1


def test_serve_flags_parse_and_reach_the_engine():
    from tokenwire.cli import build_parser
    argv = ["serve", "--no-prefix-cache", "--response-cache-size", "5"]
    args = build_parser(argv).parse_args(argv)
    assert args.enable_prefix_caching is False and args.response_cache_size == 5
    default = build_parser(["serve"]).parse_args(["serve"])
    assert default.enable_prefix_caching is True and default.response_cache_size == 0
    import tokenwire
    server = tokenwire.Server(backend="mock", port=0, loop="asyncio", enable_prefix_caching=False,
                              response_cache_size=5).start()
    try:
        assert server.engine.scheduler.prefix_cache is None and server.engine.response_cache.max_entries == 5
    finally:
        server.stop()
    default_core = mock_engine_core()
    assert default_core.response_cache is None and default_core.scheduler.prefix_cache is not None
