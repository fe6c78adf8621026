"""EngineCore over the mock executor: the API net/ builds on (submit, cancel, thread, errors)."""

import threading
import time

import pytest

from tokenwire.core.engine_core import EngineCore
from tokenwire.core.errors import InvalidRequest, PromptTooLong, QueueFull
from tokenwire.core.executor import StepOutput
from engines import attached, mock_engine_core
from tokenwire.kernels.mock import MOCK_TEXT, MockExecutor
from tokenwire.core.outputs import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Timeline
from tokenwire.core.sampling_params import SamplingParams


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> dict:
    """Drive step() until idle. -> {request_id: [RequestOutput, ...]}"""
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for out in engine.step().rows:
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def prompt(engine, text="Hello there"):
    return engine.tokenizer.encode(text, add_special_tokens=False).ids


def test_mock_stream_text_and_usage():
    engine = mock_engine_core()
    tl = Timeline()
    engine.add_request(7, prompt(engine), SamplingParams(max_tokens=30), tl)
    outs = run_to_completion(engine)[7]
    assert len(outs) == 30 and all(len(o.token_ids) == 1 for o in outs)
    assert [o.num_output_tokens for o in outs] == list(range(1, 31))
    assert outs[-1].finish_reason == FINISH_LENGTH and all(o.finish_reason is None for o in outs[:-1])
    text = "".join(o.text for o in outs)
    ids = [o.token_ids[0] for o in outs]
    assert text == engine.tokenizer.decode(ids)
    assert MOCK_TEXT.startswith(text)
    assert 0 < tl.queued_ns <= tl.first_scheduled_ns <= tl.step_done_ns[0] <= tl.finished_ns
    assert len(tl.step_done_ns) == 30 and tl.step_done_ns == sorted(tl.step_done_ns)
    assert engine.stats().num_kv_blocks_used == 0 and engine.stats().num_tokens_generated == 30


def test_stop_string_cut_and_never_leaked():
    engine = mock_engine_core()
    engine.add_request(1, prompt(engine), SamplingParams(stop=("bonjour",)), Timeline())
    outs = run_to_completion(engine)[1]
    text = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == FINISH_STOP
    assert text == MOCK_TEXT[:MOCK_TEXT.index("bonjour")]


def test_eos_in_stop_token_ids_ends_without_its_text():
    engine = mock_engine_core()
    ex = engine.executor
    stop_id = ex.text_token_ids[3]
    engine.add_request(1, prompt(engine), SamplingParams(stop_token_ids=(stop_id,)), Timeline())
    outs = run_to_completion(engine)[1]
    assert [o.token_ids[0] for o in outs] == ex.text_token_ids[:4]
    assert outs[-1].finish_reason == FINISH_STOP
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(ex.text_token_ids[:3])


def test_context_length_ends_the_request():
    engine = mock_engine_core(max_model_len=64)
    p = prompt(engine)
    engine.add_request(1, p, SamplingParams(), Timeline())
    outs = run_to_completion(engine)[1]
    assert outs[-1].finish_reason == FINISH_LENGTH
    assert len(p) + len(outs) == 64


def test_bad_requests_are_refused_with_the_problem_named():
    engine = mock_engine_core(max_model_len=32, max_queued_requests=2)
    with pytest.raises(PromptTooLong, match="32"):
        engine.add_request(1, [5] * 32, SamplingParams(), Timeline())
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request(1, [], SamplingParams(), Timeline())
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request(1, [5, 10**6], SamplingParams(), Timeline())
    engine.add_request(1, [5], SamplingParams(), Timeline())
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(1, [5], SamplingParams(), Timeline())
    engine.add_request(2, [5], SamplingParams(), Timeline())
    with pytest.raises(QueueFull):
        engine.add_request(3, [5], SamplingParams(), Timeline())


def test_cancel_gives_one_final_output_and_frees_blocks():
    engine = mock_engine_core()
    engine.add_request(1, prompt(engine), SamplingParams(), Timeline())
    engine.step()
    engine.step()
    assert engine.stats().num_kv_blocks_used > 0
    engine.cancel(1)
    engine.cancel(1)                # idempotent
    outs = engine.step().rows
    assert [(o.request_id, o.finish_reason) for o in outs] == [(1, FINISH_CANCELLED)]
    assert engine.stats().num_kv_blocks_used == 0 and not engine.has_unfinished()
    assert engine.step().rows == [] and engine.stats().num_cancellations == 1
    engine.cancel(12345)            # unknown ids are ignored
    assert engine.step().rows == []


class FlakyExecutor(MockExecutor):
    """Raises on chosen step numbers."""

    def __init__(self, fail_on, **kw):
        super().__init__(**kw)
        self.fail_on = set(fail_on)
        self.num_calls = 0

    def sample(self, seqs):
        self.num_calls += 1
        if self.num_calls in self.fail_on:
            raise RuntimeError("device on fire")
        return StepOutput([self.text_token_ids[len(s.output_token_ids) % 10] for s in seqs if s.sample])


def test_engine_exception_fails_running_requests_and_the_engine_goes_on():
    ex = FlakyExecutor(fail_on={3})
    engine = EngineCore(ex, ex.tokenizer, eos_token_ids=(1,), max_model_len=128)
    engine.add_request(1, [5, 6], SamplingParams(max_tokens=5), Timeline())
    engine.add_request(2, [5, 6], SamplingParams(max_tokens=5), Timeline())
    engine.step(), engine.step()
    outs = engine.step().rows
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [(1, FINISH_ERROR), (2, FINISH_ERROR)]
    assert "device on fire" in outs[0].error
    assert engine.stats().num_kv_blocks_used == 0
    engine.add_request(1, [5, 6], SamplingParams(max_tokens=5), Timeline())   # the id is free again
    assert run_to_completion(engine)[1][-1].finish_reason == FINISH_LENGTH


def test_engine_thread_hands_off_once_per_step():
    calls = []
    done = threading.Event()

    def on_step(outs):
        calls.append((threading.current_thread().name, list(outs)))
        if sum(o.finish_reason is not None for _, batch in calls for o in batch) == 8:
            done.set()

    engine = mock_engine_core(on_step=on_step)
    engine.start()
    assert engine.is_alive()
    for i in range(8):
        engine.add_request(i, prompt(engine), SamplingParams(max_tokens=20), Timeline())
    assert done.wait(10)
    assert {name for name, _ in calls} == {"tokenwire-engine"}
    per_request = {}
    for _, batch in calls:
        ids = [o.request_id for o in batch]
        assert len(ids) == len(set(ids))            # one output per request per hand-off
        for o in batch:
            per_request.setdefault(o.request_id, []).append(o)
    assert all(len(v) == 20 for v in per_request.values()) and len(per_request) == 8
    assert len(calls) < 8 * 20                        # batched: fewer hand-offs than tokens
    time.sleep(0.05)
    assert engine.is_alive() and engine.stats().engine_alive   # idle, sleeping, alive
    engine.shutdown(timeout=5)
    assert not engine.is_alive()


def test_shutdown_fails_what_is_left():
    seen = []
    engine = mock_engine_core(step_us=2000, on_step=seen.extend)
    engine.start()
    engine.add_request(1, [5, 6], SamplingParams(), Timeline())
    time.sleep(0.02)
    engine.shutdown(timeout=5)
    assert seen and seen[-1].request_id == 1 and seen[-1].finish_reason == FINISH_ERROR
    assert "shut down" in seen[-1].error


def test_engine_thread_survives_an_executor_failure():
    seen = []
    got = threading.Condition()

    def on_step(outs):
        with got:
            seen.extend(outs)
            got.notify_all()

    def wait_for(pred):
        with got:
            assert got.wait_for(lambda: pred(seen), timeout=10)

    ex = FlakyExecutor(fail_on={2})
    engine = attached(EngineCore(ex, ex.tokenizer, eos_token_ids=(1,), max_model_len=128), on_step)
    engine.start()
    engine.add_request(1, [5, 6], SamplingParams(max_tokens=50), Timeline())
    wait_for(lambda s: any(o.finish_reason == FINISH_ERROR for o in s))
    assert engine.is_alive()
    engine.add_request(2, [5, 6], SamplingParams(max_tokens=3), Timeline())
    wait_for(lambda s: any(o.request_id == 2 and o.finish_reason == FINISH_LENGTH for o in s))
    engine.shutdown(timeout=5)


def test_shutdown_called_from_on_step_does_not_deadlock():
    engine = None
    stopped = threading.Event()

    def on_step(outs):
        engine.shutdown(timeout=5)
        stopped.set()

    engine = mock_engine_core(on_step=on_step)
    engine.start()
    engine.add_request(1, [5, 6], SamplingParams(max_tokens=100), Timeline())
    assert stopped.wait(5)
    engine.driver._thread.join(5)
    assert not engine.is_alive()
