"""The engine <-> event loop hand-off (core/doorbell.Doorbell, net/handoff.StepHandoff) and
the per-request fast paths that must say exactly what the general code says.

Hand-off: the engine thread sleeps until rung and is rung once per batch of submissions;
each step reaches the loop in order, the engine never runs more than one step ahead of the
loop (overlapping, it hands a step over and waits for its write at the next), and a detached hand-off never blocks the engine again. Fast paths: the spliced SSE
finish chunk is byte-identical to orjson's, and shared SamplingParams are equal to fresh ones.
"""

import asyncio
import threading
import time

import orjson
import pytest

from engines import mock_engine_core, wait_for
from tokenwire.core.doorbell import Doorbell
from tokenwire.core.outputs import RequestOutput, Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.core.step_driver import Mode
from tokenwire.net.api.errors import ApiError
from tokenwire.net.api.openai import parse_completions
from tokenwire.net.writer import encoders
from tokenwire.net.writer.handoff import StepHandoff


def test_doorbell_keeps_a_ring_made_before_the_wait_and_times_out_without_one():
    bell = Doorbell()
    try:
        bell.ring()
        bell.ring()
        t0 = time.monotonic()
        bell.wait()                          # both rings are consumed by one wait
        bell.wait(0.05)                      # nothing left: returns after the timeout
        assert 0.04 < time.monotonic() - t0 < 1.0
    finally:
        bell.close()
    assert bell.closed


def test_doorbell_wakes_a_thread_blocked_on_it():
    bell, woke = Doorbell(), threading.Event()

    def sleeper():
        bell.wait()
        woke.set()

    t = threading.Thread(target=sleeper)
    t.start()
    time.sleep(0.02)
    assert not woke.is_set()
    bell.ring()
    t.join(2)
    assert woke.is_set()
    bell.close()


def test_engine_sleeps_until_woken_once_for_a_batch_of_requests():
    seen = []
    engine = mock_engine_core(on_step=seen.extend, max_model_len=256)
    engine.start()
    try:
        assert wait_for(lambda: engine.driver.mode is Mode.SLEEPING)
        params = SamplingParams(max_tokens=3)
        for rid in (1, 2):
            engine.add_request(rid, [5, 6], params, Timeline(), wake=False)
        time.sleep(0.05)
        assert seen == [] and engine.driver.mode is Mode.SLEEPING          # submitted, not woken: nothing ran
        engine.wake()
        assert wait_for(lambda: sum(o.finish_reason is not None for o in seen) == 2)
        engine.add_request(3, [5], params, Timeline())  # the default wakes it at once
        assert wait_for(lambda: any(o.request_id == 3 and o.finish_reason for o in seen))
        engine.cancel(99)                               # a cancel of nothing wakes it and does no harm
        assert wait_for(lambda: engine.driver.mode is Mode.SLEEPING)
    finally:
        engine.shutdown(timeout=5)
    assert not engine.is_alive() and engine.driver._doorbell.closed


def test_steps_reach_the_loop_in_order_and_the_engine_never_runs_ahead():
    """The engine thread's on_step returns only after the loop has written that step."""
    loop = asyncio.new_event_loop()
    written, ahead, made = [], [], []
    loop.call_soon(lambda: made.append(StepHandoff(loop, lambda step: written.append(step[0]))))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    assert wait_for(lambda: made)
    handoff = made[0]

    def engine_thread():
        for i in range(200):
            handoff.on_step_threadsafe([i])
            ahead.append(i + 1 - len(written))      # steps handed over but not yet written

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join(10)
    assert written == list(range(200)) and max(ahead) == 0
    loop.call_soon_threadsafe(handoff.detach)
    assert wait_for(lambda: handoff.detached)
    t0 = time.monotonic()
    handoff.on_step_threadsafe([0])                 # detached: returns at once, written nowhere
    assert time.monotonic() - t0 < 0.5 and len(written) == 200
    loop.call_soon_threadsafe(loop.stop)
    handoff.close()


class _OverlappingDriver:
    """What StepHandoff reads of a core.step_driver.StepDriver that overlaps its steps."""
    overlap = True

    def attach(self, host):
        pass


def test_overlapped_steps_are_written_behind_the_next_one_and_never_two_ahead():
    """With overlap (core/step_driver.py rule 3) the engine thread hands a step over and goes
    on: it waits for that step's write only when it hands over the next one."""
    loop = asyncio.new_event_loop()
    written, ahead, made, gate = [], [], [], threading.Event()

    def write(step):
        if step[0] == 0:
            gate.wait(5)                            # the loop is slow with the first step
        written.append(step[0])
    loop.call_soon(lambda: made.append(StepHandoff(loop, write, _OverlappingDriver())))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    assert wait_for(lambda: made)
    handoff, returned = made[0], []

    def engine_thread():
        for i in range(100):
            handoff.on_step_threadsafe([i])
            returned.append(i)
            ahead.append(i + 1 - len(written))      # steps handed over but not yet written

    t = threading.Thread(target=engine_thread)
    t.start()
    assert wait_for(lambda: returned == [0])        # step 0 unwritten, and the engine went on
    time.sleep(0.05)
    assert returned == [0] and written == []        # step 1 waits for step 0's write
    gate.set()
    t.join(10)
    assert wait_for(lambda: len(written) == 100)    # the last step is written behind the engine's return
    assert written == list(range(100)) and max(ahead) == 1
    loop.call_soon_threadsafe(handoff.detach)
    assert wait_for(lambda: handoff.detached)
    loop.call_soon_threadsafe(loop.stop)
    handoff.close()


def test_detach_releases_an_engine_waiting_for_the_loop():
    loop = asyncio.new_event_loop()
    handoff = StepHandoff(loop, lambda step: None)      # the loop never runs
    t = threading.Thread(target=handoff.on_step_threadsafe, args=([1],))
    t.start()
    time.sleep(0.05)
    assert t.is_alive()                             # waiting for a loop that is not there
    handoff.detach()
    t.join(2)
    assert not t.is_alive()
    handoff.close()
    loop.close()


# ------------------------------------------------------------ fast paths

def _out(reason):
    return RequestOutput(1, (), "", None, reason, 3, 2, 1)


@pytest.mark.parametrize("cls", [encoders.CompletionSse, encoders.ChatSse])
@pytest.mark.parametrize("started", [False, True])
def test_spliced_sse_finish_chunk_is_what_orjson_makes_of_it(cls, started):
    enc = cls('cmpl-"7\\', 1700000000, 'm\u00e9 "x"', False, str)
    if started:
        enc.first_token(_out(None)._replace(text="hi"))
    timings = {"tokenize_us": 1.5, "ttft_us": 120.0, "total_us": 3000.1}
    spliced = enc.finish(_out("length"), "length", encoders.usage(3, 2), timings)
    chunk = enc._finish_chunk("length")
    chunk["timings"] = timings
    assert spliced == b"data: " + orjson.dumps(chunk) + b"\n\n" + encoders.SSE_DONE


def test_shared_sampling_params_equal_fresh_ones_and_bad_values_still_fail():
    body = {"prompt": "x", "max_tokens": 7, "temperature": 0.5, "stop": ["a", "b"], "seed": 3}
    a, b = parse_completions(dict(body)).params, parse_completions(dict(body)).params
    assert a is b                                   # one object for one set of fields
    assert a == SamplingParams(max_tokens=7, temperature=0.5, stop=("a", "b"), seed=3)
    assert parse_completions(dict(body, temperature=1)).params.temperature == 1.0
    assert parse_completions(dict(body, seed=4)).params.seed == 4
    for _ in range(2):                              # an error is not remembered as a result
        with pytest.raises(ApiError) as exc:
            parse_completions(dict(body, top_p=0))
        assert exc.value.param == "top_p"
