"""Readiness means ready (issue 25, point 7): before /health turns 200 a server runs a
prefill, a decode step, and greedy and sampled rows with and without a grammar through its
own engine's executor (tokenwire/runtime.py: `warm_up`), logs how long that took, and
leaves no trace: no KV block held or cached, no answer in the response cache, no grammar
in the grammar cache, no counter moved, and the first client request is still `cmpl-1`.

These tests check the mechanism on stories260K served by the C kernels, through a
recording executor; what the warm-up saves is measured, not asserted: `tokenwire bench
cold-start` (bench/cold_start.py) prints the first request's TTFT against the fifth's."""

import logging
import threading

import httpx
import pytest

import tokenwire
from tokenwire import kernels
from tokenwire.core.constraint import ConstraintSpec
from tokenwire.core.engine_core import EngineCore
from tokenwire.core.outputs import EngineStats
from tokenwire.core.executor import SyncExecutor
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.core.options import EngineOptions
from tokenwire.kernels.mock import build_mock_tokenizer
from tokenwire.kernels.mock import create_executor as create_mock_executor
from tokenwire.kernels.mock import load_model as load_mock_model


@pytest.fixture(scope="module")
def engine_dir(stories260k_dir, tmp_path_factory):
    from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
    from tokenwire.engine_build.quantize import QuantOptions
    return build_engine(open_source(str(stories260k_dir / "stories260K.bin")),
                        tmp_path_factory.mktemp("warm") / "engine", BuildOptions(QuantOptions(method="none")))


class Recorder(SyncExecutor):
    """The cpu backend's executor, noting what each step held and whether the server was
    ready (its `start()` had returned) when the step ran. Set `fail_constrained` to make
    every step with a constrained row raise, as a broken sampler would."""

    def __init__(self, executor, log: list, ready: threading.Event, fail_constrained: bool):
        self.executor, self.log, self.ready, self.fail_constrained = executor, log, ready, fail_constrained

    def step(self, seqs):
        rows = [("prefill" if len(s.token_ids) > 1 else "decode", s.sample and s.sampling.greedy,
                 s.constraint is not None) for s in seqs]
        self.log.append((self.ready.is_set(), rows))
        if self.fail_constrained and any(constrained for _, _, constrained in rows):
            raise RuntimeError("the sampler cannot mask this row")
        return self.executor.step(seqs)

    def __getattr__(self, name):
        return getattr(self.executor, name)


@pytest.fixture
def recorded(monkeypatch):
    """-> (steps seen, an Event the test sets once the server is ready, failure switch)"""
    steps, ready, switch = [], threading.Event(), {"fail_constrained": False}
    row = kernels.BACKENDS["cpu"]

    def create(model, options, max_model_len):
        return Recorder(row.create_executor(model, options, max_model_len), steps, ready, switch["fail_constrained"])
    monkeypatch.setitem(kernels.BACKENDS, "cpu", row._replace(create_executor=create))
    return steps, ready, switch


def serve(engine_dir, ready: threading.Event, **options) -> tokenwire.Server:
    server = tokenwire.Server(str(engine_dir), backend="cpu", port=0, **options).start()
    ready.set()
    return server


def test_the_executor_has_run_every_first_request_path_before_health_is_200(engine_dir, recorded, caplog):
    steps, ready, _ = recorded
    with caplog.at_level(logging.INFO):
        server = serve(engine_dir, ready)
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        before = [row for was_ready, rows in steps if not was_ready for row in rows]
        assert {"prefill", "decode"} <= {kind for kind, _, _ in before}, before
        sampled_rows = {(greedy, constrained) for _, greedy, constrained in before}
        assert sampled_rows >= {(True, False), (False, False), (True, True), (False, True)}, sampled_rows
        lines = [r.getMessage() for r in caplog.records]
        warm = [i for i, line in enumerate(lines) if line.startswith("warm-up: 4 requests") and " ms" in line]
        serving = [i for i, line in enumerate(lines) if line.startswith("serving ")]
        assert warm and serving and warm[0] < serving[0], lines
    finally:
        server.stop()


def test_the_warm_up_leaves_no_trace(engine_dir, recorded):
    _, ready, _ = recorded
    # 4-token blocks: the warm-up prompt fills one, which the prefix cache would keep; a queue
    # of one and one sequence at a time: the warm-up's four requests still run, one after another
    server = serve(engine_dir, ready, block_size=4, response_cache_size=8, max_queued_requests=1, max_num_seqs=1)
    try:
        engine = server.engine
        assert engine.stats() == EngineStats(0, 0, 0, engine.block_manager.num_blocks, 0, 0, 0, 0, True, 0, 0, 0, 0)
        assert engine.block_manager.free_block_ids == list(range(engine.block_manager.num_blocks - 1, -1, -1))
        assert not engine.response_cache.entries
        assert server.app.model.grammars.cached(ConstraintSpec("json_object", "")) is None   # the one it compiled
        metrics = httpx.get(server.url + "/metrics").text
        for name in ("tokenwire_engine_steps_total", "tokenwire_generated_tokens_total",
                     "tokenwire_prefix_cache_blocks", "tokenwire_streamed_tokens_total"):
            assert f"\n{name} 0\n" in metrics, name
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2,
                                                             "temperature": 0, "ignore_eos": True})
        body = r.json()
        assert r.status_code == 200 and body["id"] == "cmpl-1"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        server.stop()


def test_a_failed_warm_up_request_is_a_warning_and_the_server_still_serves(engine_dir, recorded, caplog):
    _, ready, switch = recorded
    switch["fail_constrained"] = True
    with caplog.at_level(logging.INFO):
        server = serve(engine_dir, ready)
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "warm-up" in
                    r.getMessage()]
        assert warnings and "the sampler cannot mask this row" in warnings[0], warnings
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_no_warm_up_runs_nothing_before_ready(engine_dir, recorded, caplog):
    steps, ready, _ = recorded
    with caplog.at_level(logging.INFO):
        server = serve(engine_dir, ready, warm_up=False)
    server.stop()
    assert steps == [] and not any("warm-up" in r.getMessage() for r in caplog.records)


def test_engine_core_warm_up_runs_to_the_end_then_forgets_and_only_before_start():
    options = EngineOptions(backend="mock", response_cache_size=4, block_size=2)
    model = load_mock_model(options)
    executor = create_mock_executor(model, options, 64)
    core = EngineCore(executor, build_mock_tokenizer(), eos_token_ids=(1,), max_model_len=64, response_cache_size=4)
    finals = core.warm_up([5, 6, 7, 8, 9], [SamplingParams(max_tokens=3, temperature=0.0)] * 2)
    assert sorted(out.request_id for out in finals) == [-2, -1]
    assert all(out.finish_reason == "length" and out.num_output_tokens == 3 for out in finals)
    assert core.stats() == EngineStats(0, 0, 0, executor.num_blocks, 0, 0, 0, 0, False, 0, 0, 0, 0)
    assert not core.response_cache.entries and not core.block_manager.cached
    core.start()
    try:
        with pytest.raises(RuntimeError, match="before the engine thread starts"):
            core.warm_up([5, 6], [SamplingParams(max_tokens=1)])
    finally:
        core.shutdown(timeout=5)


def test_bench_cold_start_reports_medians_and_ratios_of_synthetic_starts():
    from tokenwire.bench import cold_start
    runs = [{"start_s": s, "warm_up_ms": w, "server_ttft_us": ttfts, "client_ttft_us": [t + 100 for t in ttfts]}
            for s, w, ttfts in ((1.0, 10.0, [300, 120, 100]), (3.0, 30.0, [200, 100, 100]),
                                (2.0, None, [900, 100, 300]))]
    s = cold_start.summary(runs)
    assert s["ratios"] == [3.0, 2.0, 3.0] and s["ratio"] == 3.0
    assert (s["first_us"], s["last_us"], s["start_s"], s["warm_up_ms"]) == (300, 100, 2.0, 20.0)
    assert (s["client_first_us"], s["client_last_us"]) == (400, 200)
    args = type("Args", (), {"starts": 3, "requests": 3, "max_tokens": 8})
    text = cold_start.report({"m": {"warm-up": runs}}, args)
    row = text.splitlines()[-1].split()
    assert "target <= 2" in text and row[:10] == ["m", "warm-up", "0.30", "0.10", "3.00", "no", "3.00", "2.00",
                                                  "3.00", "0.40"], text
    assert cold_start.warm_up_ms("x warm-up: 4 requests (prefill, decode) in 125 ms\n") == 125.0


def test_bench_cold_start_runs(engine_dir):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tokenwire", "bench", "cold-start", "--model", str(engine_dir),
                          "--starts", "1", "--requests", "2", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = [line for line in out.stdout.splitlines() if line.startswith(str(engine_dir))]
    assert len(row) == 1 and "warm-up" in row[0] and row[0].split()[-1] != "-", out.stdout   # warm-up ms read
