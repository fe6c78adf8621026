"""Inline steps (core/step_driver.py rule 4, net/writer/handoff.py): executor steps shorter than a hand-off
run on the event loop, longer ones on the engine thread.

Over a real event loop and the real StepHandoff: the engine lends its steps to the loop
after LEND_AFTER_SHORT_STEPS short executor steps and takes them back after a long one;
every stream gets all its tokens in order whichever thread ran each step; a step is
written before the next one runs; cancellation, a failing executor, many streams and
shutdown behave as on the engine thread.
"""

import asyncio
import threading
import time

import pytest

from engines import mock_engine_core, wait_for
from tokenwire.core.step_driver import LEND_AFTER_SHORT_STEPS
from tokenwire.core.outputs import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.net.writer.handoff import StepHandoff

LOOP = "loop"
ENGINE = "tokenwire-engine"


class Host:
    """An EngineCore started behind a StepHandoff on an event loop of its own thread (the
    server's arrangement without sockets). Records, per step the executor ran, the thread
    that ran it, and every output written, in order."""

    def __init__(self, inline_step_ns=50_000_000, step_s=0.0, fail_on=()):
        self.engine = mock_engine_core(max_model_len=4096)
        self.engine.driver.inline_step_ns = inline_step_ns
        self.step_s = step_s                # executor step time: changed by the tests while it runs
        self.fail_on = set(fail_on)         # executor steps (1-based) that raise
        self.threads = []                   # per executor step: which thread ran it
        self.outputs = {}                   # request id -> [RequestOutput]
        self.num_ahead = []                 # per written step: engine steps not yet written
        self.most_ahead = 1 if self.engine.driver.overlap else 0    # see _write
        self.num_written = 0
        self._wrap_executor()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=LOOP, daemon=True)
        made = threading.Event()
        self.loop.call_soon(lambda: (setattr(self, "handoff", StepHandoff(self.loop, self._write, self.engine.driver)),
                                     made.set()))
        self._thread.start()
        assert made.wait(5)
        self.engine.start()

    def _run_loop(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _wrap_executor(self):
        executor = self.engine.executor
        launch, collect = executor.launch, executor.collect

        def recorded_launch(seqs):
            self.threads.append(threading.current_thread().name)
            if len(self.threads) in self.fail_on:
                raise RuntimeError("device on fire")
            return launch(seqs)

        def timed_collect(handle):
            if self.step_s:
                time.sleep(self.step_s)
            return collect(handle)
        executor.launch, executor.collect = recorded_launch, timed_collect

    def _write(self, step):
        self.num_written += 1
        # the engine counts a step when it returns it: written at once on the loop; behind the
        # next step when the engine thread overlaps them (the hand-off's write-behind), never more
        self.num_ahead.append(self.engine.num_steps - self.num_written)
        for out in step.rows:
            self.outputs.setdefault(out.request_id, []).append(out)
        for rid, token_id, text in zip(step.request_ids, step.token_ids, step.texts):
            self.outputs.setdefault(rid, []).append((token_id, text))

    def on_loop(self, fn, *args):
        """Run fn(*args) on the loop's thread (where net/ calls the engine) and wait for it."""
        done = threading.Event()
        result = []
        self.loop.call_soon_threadsafe(lambda: (result.append(fn(*args)), done.set()))
        assert done.wait(5)
        return result[0]

    def submit(self, request_id, max_tokens, prompt=(5, 6, 7)):
        self.on_loop(self.engine.add_request, request_id, list(prompt), SamplingParams(max_tokens=max_tokens),
                     Timeline())

    def finished(self, request_id):
        outs = self.outputs.get(request_id, [])
        return bool(outs) and getattr(outs[-1], "finish_reason", None) is not None

    def num_tokens(self, request_id):
        return sum(1 if type(o) is tuple else len(o.token_ids) for o in self.outputs.get(request_id, []))

    def close(self):
        def stop():
            self.handoff.detach()
            self.engine.shutdown(timeout=5)
        self.on_loop(stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.handoff.close()


@pytest.fixture
def host():
    made = []

    def make(**kw):
        made.append(Host(**kw))
        return made[-1]
    yield make
    for h in made:
        h.close()


def test_short_steps_move_to_the_loop_and_long_ones_back_to_the_engine_thread(host):
    # 50 ms: the zero-cost mock is short however loaded the machine (a 2 ms limit flipped when a
    # busy machine preempted a step), and a 100 ms step is long
    h = host(inline_step_ns=50_000_000)
    h.submit(1, 40)
    assert wait_for(lambda: h.finished(1))
    lent = LEND_AFTER_SHORT_STEPS
    assert h.threads[:lent] == [ENGINE] * lent and set(h.threads[lent:]) == {LOOP}
    assert h.engine.driver.lent and h.num_tokens(1) == 40

    h.step_s = 0.1                                          # 100 ms steps: longer than the limit
    n = len(h.threads)
    h.submit(2, 6)
    assert wait_for(lambda: h.finished(2))
    assert h.threads[n] == LOOP and set(h.threads[n + 1:]) == {ENGINE}   # one long step, then the thread
    assert not h.engine.driver.lent and h.num_tokens(2) == 6

    h.step_s = 0.0
    n = len(h.threads)
    h.submit(3, 30)
    assert wait_for(lambda: h.finished(3))
    assert h.threads[n:n + lent] == [ENGINE] * lent and set(h.threads[n + lent:]) == {LOOP}
    assert h.num_tokens(3) == 30 and max(h.num_ahead) <= h.most_ahead
    texts = {rid: [o[1] if type(o) is tuple else o.text for o in h.outputs[rid]] for rid in (1, 3)}
    assert texts[1][:30] == texts[3]                        # the same story whichever thread ran it


def test_inline_step_us_zero_keeps_every_step_on_the_engine_thread(host):
    h = host(inline_step_ns=0)
    h.submit(1, 30)
    assert wait_for(lambda: h.finished(1))
    assert set(h.threads) == {ENGINE} and not h.engine.driver.lent


def test_a_stream_switching_threads_mid_way_gets_every_token_in_order(host):
    h = host(inline_step_ns=50_000_000, step_s=0.0002)     # 0.6 s of short steps: the switch comes mid-way
    h.submit(1, 3000)
    assert wait_for(lambda: h.engine.driver.lent)
    h.step_s = 0.1
    assert wait_for(lambda: not h.engine.driver.lent)
    h.step_s = 0.0002
    assert wait_for(lambda: h.finished(1), timeout=30)
    assert {LOOP, ENGINE} <= set(h.threads)
    assert h.num_tokens(1) == 3000 and h.outputs[1][-1].finish_reason == FINISH_LENGTH
    assert max(h.num_ahead) <= h.most_ahead


def test_cancel_while_inline_ends_the_request_and_frees_its_blocks(host):
    h = host(inline_step_ns=50_000_000, step_s=0.001)       # 1 ms steps, run on the loop
    h.submit(1, 100_000, prompt=list(range(5, 100)))
    assert wait_for(lambda: h.engine.driver.lent and h.num_tokens(1) > 10)
    assert h.on_loop(lambda: h.engine.block_manager.num_used_blocks) > 0
    h.on_loop(h.engine.cancel, 1)
    assert wait_for(lambda: h.finished(1))
    assert h.outputs[1][-1].finish_reason == FINISH_CANCELLED
    assert h.on_loop(lambda: (h.engine.block_manager.num_used_blocks, h.engine.has_work())) == (0, False)
    assert h.engine.driver.lent                                  # idle on the loop, the thread still lent


def test_a_failing_executor_while_inline_fails_the_running_requests_and_serving_goes_on(host):
    fail_at = LEND_AFTER_SHORT_STEPS + 5
    h = host(inline_step_ns=50_000_000, fail_on={fail_at})     # every mock step short, however loaded
    h.submit(1, 50)
    h.submit(2, 50)
    assert wait_for(lambda: h.finished(1) and h.finished(2))
    assert h.threads[fail_at - 1] == LOOP
    for rid in (1, 2):
        assert h.outputs[rid][-1].finish_reason == FINISH_ERROR and "device on fire" in h.outputs[rid][-1].error
    h.submit(3, 20)
    assert wait_for(lambda: h.finished(3))
    assert h.outputs[3][-1].finish_reason == FINISH_LENGTH and h.num_tokens(3) == 20
    assert h.engine.driver.lent and h.engine.is_alive()


def test_many_streams_inline_each_get_one_token_per_step(host):
    h = host(inline_step_ns=50_000_000)     # a 128-row mock step is short by any measure, however loaded the machine
    h.submit(0, 8)                                          # lends the steps to the loop
    assert wait_for(lambda: h.finished(0) and h.engine.driver.lent)

    def submit_all():
        for rid in range(1, 129):
            h.engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=64), Timeline(), wake=False)
        h.engine.wake()
    n = len(h.threads)
    h.on_loop(submit_all)
    assert wait_for(lambda: all(h.finished(rid) for rid in range(1, 129)))
    assert set(h.threads[n:]) == {LOOP} and len(h.threads) - n <= 64 + 2     # batched, not one by one
    first = [o[1] if type(o) is tuple else o.text for o in h.outputs[1]]
    for rid in range(1, 129):
        assert h.num_tokens(rid) == 64
        assert [o[1] if type(o) is tuple else o.text for o in h.outputs[rid]] == first
    assert max(h.num_ahead) <= h.most_ahead and h.on_loop(lambda: h.engine.block_manager.num_used_blocks) == 0


def test_shutdown_while_inline_fails_what_is_left_on_the_engine_thread(host):
    h = host(inline_step_ns=50_000_000, step_s=0.001)
    h.submit(1, 100_000)
    assert wait_for(lambda: h.engine.driver.lent and h.num_tokens(1) > 5)
    seen = []
    driver = h.engine.driver          # the thread's last hand-off, after detach
    driver.host = driver.host._replace(deliver=lambda step: seen.extend(step.rows))
    h.on_loop(lambda: (h.handoff.detach(), h.engine.shutdown(timeout=5)))
    assert not h.engine.is_alive()
    assert [(o.request_id, o.finish_reason) for o in seen] == [(1, FINISH_ERROR)] and "shut down" in seen[0].error
