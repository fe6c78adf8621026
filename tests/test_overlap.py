"""Overlapped steps (core/step_driver.py rule 3, core/scheduler.py "Overlapped steps"): the next
step is launched before the last one's ids are processed, and the outputs do not change.

Over the mock and over the CUDA executor on the fake driver: every request's tokens, text
and finish are those of synchronous steps; the extra token a finished request gets computed
is never sent and its blocks are free; a cancel still ends a stream within one step.
"""

import threading
import time

import pytest

from engines import wait_for
from test_cuda_executor_fake import NO_IMAGE, tiny_config, tiny_engine
from tokenwire.core.engine_core import EngineCore
from tokenwire.core.outputs import FINISH_CANCELLED, Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.core.step_driver import Mode, StepHost
from tokenwire.kernels.cuda.executor import CudaExecutor, CudaOptions
from tokenwire.kernels.cuda.fake import FakeDriver
from tokenwire.kernels.mock import MockExecutor

# (max_tokens, stop strings, temperature): lengths, a stop string the scheduler cannot foresee
REQUESTS = [(5, (), 0.0), (17, (), 0.8), (40, (" robot",), 0.0), (3, (), 0.0), (25, (), 1.0),
            (60, ("wire",), 0.0), (9, (), 0.5), (30, (), 0.0), (1, (), 0.0), (33, (" time",), 0.7)]


class RecordingMock(MockExecutor):
    """The mock, remembering which sequences each launched step sampled for."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.launched = []                  # per launch: [seq_id of each sampled row]

    def sample(self, seqs):
        self.launched.append([s.seq_id for s in seqs if s.sample])
        return super().sample(seqs)


def mock_core(step_us=0.0, overlap=True, **kw):
    ex = RecordingMock(step_us=step_us, max_model_len=512)
    return EngineCore(ex, ex.tokenizer, eos_token_ids=(1,), max_model_len=512, overlap=overlap, **kw)


def cuda_core(overlap=True):
    """The CUDA executor on the fake driver (numpy kernels), the mock's tokenizer for text."""
    c = tiny_config()
    ex = CudaExecutor(c, tiny_engine(c), CudaOptions(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=128,
                                                     split_size=32), driver=FakeDriver(), image_fn=NO_IMAGE)
    tokenizer = MockExecutor().tokenizer    # ids below the tiny vocabulary are its byte tokens
    return EngineCore(ex, tokenizer, eos_token_ids=(1,), max_model_len=256, overlap=overlap)


def submit(core, requests=REQUESTS, prompt=(36, 37, 38, 39)):
    for i, (n, stop, temperature) in enumerate(requests):
        core.add_request(i, list(prompt), SamplingParams(max_tokens=n, stop=stop, temperature=temperature,
                                                         seed=i, ignore_eos=True), Timeline())


def record(got, step):
    for out in step.rows:
        g = got.setdefault(out.request_id, [[], "", None])
        assert g[2] is None, f"request {out.request_id}: an output after its finish"
        g[0] += out.token_ids
        g[1] += out.text
        g[2] = out.finish_reason
    for rid, token_id, text in zip(step.request_ids, step.token_ids, step.texts):
        g = got.setdefault(rid, [[], "", None])
        assert g[2] is None, f"request {rid}: a token after its finish"
        g[0].append(token_id)
        g[1] += text


def synchronous(core) -> dict:
    got = {}
    while core.has_unfinished():
        record(got, core.step(columns=True))
    return got


def threaded(core, timeout: float = 10.0) -> tuple:
    """The engine thread drives the steps (overlapped where it may), for at most `timeout` s.
    -> (outputs, modes seen)"""
    got, modes, lock = {}, set(), threading.Lock()

    def deliver(step):
        with lock:
            modes.add(core.driver.mode)
            record(got, step)
    core.driver.attach(StepHost(deliver, columns=True))
    core.start()
    try:
        submit(core)
        assert wait_for(lambda: len(got) == len(REQUESTS) and all(g[2] for g in got.values()), timeout)
    finally:
        core.shutdown(timeout=5)
    return got, modes


@pytest.mark.parametrize("make", [lambda overlap: mock_core(300, overlap), cuda_core], ids=["mock", "cuda-fake"])
def test_overlapped_steps_give_the_outputs_of_synchronous_ones(make):
    sync = make(overlap=False)
    submit(sync)
    want = synchronous(sync)
    got, modes = threaded(make(overlap=True))
    assert got == want
    assert Mode.OVERLAPPING in modes
    assert all(g[2] for g in want.values()) and sum(len(g[0]) for g in want.values()) > 100


def test_the_extra_token_of_a_finished_request_is_never_sent_and_its_blocks_are_freed():
    core = mock_core()
    # the story's first words: "Once upon a time, there was a little robot": " upon" ends request 0
    # on its second token, which the scheduler cannot foresee, so its third is launched meanwhile
    core.add_request(0, [36, 37], SamplingParams(max_tokens=50, stop=(" upon",)), Timeline())
    core.add_request(1, [36, 37], SamplingParams(max_tokens=6), Timeline())
    got = {}
    record(got, core.step())                # the prefills: "Once" for both
    in_flight = core.begin_step()
    while True:
        launched = core.begin_step()        # launched before the last step is processed
        record(got, core.finish_step(in_flight))
        if got[0][2] is not None and core.has_unfinished():    # request 1's blocks alone are held
            assert core.block_manager.num_used_blocks == len(core.scheduler.running[0].block_table)
        if launched.plan is None:
            record(got, core.finish_step(launched))
            break
        in_flight = launched
    assert got[0][1] == "Once" and got[0][2] == "stop" and len(got[0][0]) == 2     # " upon" is cut
    assert len(got[1][0]) == 6
    rows_of_0 = sum(ids.count(0) for ids in core.executor.launched)
    assert rows_of_0 == 3                   # prefill, " upon" (the stop), and the extra one
    assert core.block_manager.num_used_blocks == 0 and not core.has_unfinished()


def test_a_cancel_ends_an_overlapped_stream_within_one_step():
    core = mock_core(step_us=2000)
    seen, cancelled_at = [], []

    def deliver(step):
        seen.extend((o.request_id, len(o.token_ids), o.finish_reason) for o in step.rows)
    core.driver.attach(StepHost(deliver))
    core.start()
    try:
        core.add_request(1, [36, 37], SamplingParams(max_tokens=10_000), Timeline())
        assert wait_for(lambda: len(seen) > 5 and core.driver.mode is Mode.OVERLAPPING)
        cancelled_at.append(len(seen))
        core.cancel(1)
        assert wait_for(lambda: seen[-1][2] == FINISH_CANCELLED)
        assert len(seen) - cancelled_at[0] <= 2     # at most the token of the step already collected
        assert wait_for(lambda: core.block_manager.num_used_blocks == 0)
    finally:
        core.shutdown(timeout=5)
    assert [s for s in seen if s[2] is not None] == [(1, 0, FINISH_CANCELLED)]


def test_a_constrained_or_penalized_request_takes_the_synchronous_path():
    core = mock_core()
    core.add_request(1, [36], SamplingParams(max_tokens=4), Timeline())
    core.add_request(2, [36], SamplingParams(max_tokens=4, repetition_penalty=1.2), Timeline())
    core.step()
    assert [r.sync_only for r in core.scheduler.running] == [False, True] and not core.can_overlap()
    while core.has_unfinished():
        core.step()
    core.add_request(3, [36], SamplingParams(max_tokens=4), Timeline())
    core.step()
    assert core.can_overlap()


def test_the_driver_modes_are_a_table():
    core = mock_core()
    with pytest.raises(Exception, match="running -> running is not a legal transition"):
        core.driver._to(Mode.RUNNING)
    core.driver._to(Mode.OVERLAPPING)
    with pytest.raises(Exception, match="overlapping -> sleeping"):
        core.driver._to(Mode.SLEEPING)
    assert core.driver.mode is Mode.OVERLAPPING


class HostDelayedMock(RecordingMock):
    """A mock whose host is slow to come back from a step that took prompt tokens (a loop busy
    with the arrivals holds the GIL): the device time is the same."""

    def collect(self, handle):
        out = super().collect(handle)
        if self.prefill_step:
            time.sleep(0.003)
        return out

    def launch(self, seqs):
        self.prefill_step = any(len(s.token_ids) > 1 for s in seqs)
        return super().launch(seqs)


def test_the_cost_model_learns_from_the_executors_own_step_time():
    """The cost model's sample is the executor's time for the step (StepOutput.busy_ns) where it
    keeps one: timed from the host, a step that took prompts also counted the host's delay, and
    on a busy host the measured prefill cap fell to MIN_PREFILL_TOKENS, a prompt or two a step
    (bench overlap at 256 streams: 135 running, 110 waiting)."""
    ex = HostDelayedMock(step_us=1000, max_model_len=512)
    core = EngineCore(ex, ex.tokenizer, eos_token_ids=(1,), max_model_len=512, prefill_cap=-1)
    core.add_request(0, [36, 37, 38], SamplingParams(max_tokens=60, ignore_eos=True), Timeline())
    for i in range(1, 25):
        core.step()
        core.step()
        core.add_request(i, list(range(36, 36 + 4 * i)), SamplingParams(max_tokens=2, ignore_eos=True), Timeline())
    costs = core.scheduler.costs
    assert costs.prefill and costs.decode_ns[1] == 1_000_000         # prompts were seen beside a decode
    assert costs.prefill_cap(1) is None                             # and cost the mock's device nothing
