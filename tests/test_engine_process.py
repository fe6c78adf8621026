"""The engine in a process of its own (`engine_process`, tokenwire/engine_process.py), served
over real sockets: the same answers as in one process, cancels and deadlines reach it, the
engine's stamps reach the front end's timings, a dead engine process fails its requests and
turns /health 503, and a stop leaves no process behind. (Any server suite runs against this
mode with TOKENWIRE_TEST_ENGINE_PROCESS=1, tests/conftest.py.)"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import tokenwire
from tokenwire.bench.proc import read_cpu
from tokenwire.core.options import EngineOptions
from tokenwire.core.outputs import Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.core.step_driver import StepHost
from tokenwire.engine_process import ACK, MAX_STEPS_AHEAD, Channel, EngineProcess
from tokenwire.kernels.mock import MockModel

from clients.rawh2 import RawH2
from engines import engine_idle, wait_for

PROMPT = {"model": "mock", "prompt": "Once upon a time", "max_tokens": 24}


@pytest.fixture(scope="module")
def pair():
    """An engine-process server and an in-process one, on the same mock."""
    split = tokenwire.Server(backend="mock", port=0, engine_process=True, mock_step_us=200).start()
    single = tokenwire.Server(backend="mock", port=0, mock_step_us=200).start()
    yield split, single
    split.stop()
    single.stop()


def _completion(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body: dict) -> list:
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_answers_are_those_of_an_engine_in_the_same_process(pair):
    split, single = pair
    assert isinstance(split.engine, EngineProcess) and split.engine.process.poll() is None
    for body in (PROMPT, {**PROMPT, "n": 3, "temperature": 1.0, "seed": 7}, {**PROMPT, "max_tokens": 1}):
        a, b = _completion(split, body), _completion(single, body)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        assert a["usage"] == b["usage"]
    streamed = "".join(c["choices"][0]["text"] for c in _stream(split, PROMPT))
    assert streamed == _completion(single, PROMPT)["choices"][0]["text"]


def test_many_streams_at_once_each_get_their_whole_answer(pair):
    split, single = pair
    want = _completion(single, {**PROMPT, "max_tokens": 40})["choices"][0]["text"]
    results = [None] * 24

    def one(i):
        results[i] = "".join(c["choices"][0]["text"] for c in _stream(split, {**PROMPT, "max_tokens": 40}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [want] * len(results)


def test_the_engine_stamps_reach_the_front_ends_timings(pair):
    """Queue and prefill come from the engine process's scheduler (rule 3)."""
    split, _ = pair
    c = RawH2("127.0.0.1", split.port)
    try:
        sid = c.post("/v1/completions", PROMPT)
        c.read_until(lambda: sid in c.ended)
        trailer = dict(c.trailers[sid])[b"server-timing"].decode()
    finally:
        c.close()
    timing = dict(part.split(";dur=") for part in trailer.split(", ") if ";dur=" in part)
    assert float(timing["prefill"]) > 0 and float(timing["decode"]) > 0, trailer


def test_a_reset_stream_is_cancelled_in_the_engine_process_and_its_blocks_freed(pair):
    split, _ = pair
    c = RawH2("127.0.0.1", split.port)
    try:
        sid = c.post("/v1/completions", {**PROMPT, "max_tokens": 2000, "stream": True})
        c.read_until(lambda: c.data.get(sid, b"").count(b"data:") >= 3)
        c.reset(sid)
    finally:
        c.close()
    assert wait_for(lambda: engine_idle(split)), split.engine.stats()
    assert split.engine.stats().num_cancellations >= 1


def test_a_deadline_ends_the_stream_and_frees_the_engine_process(pair):
    split, _ = pair
    start = time.monotonic()
    r = httpx.post(f"{split.url}/v1/completions", json={**PROMPT, "max_tokens": 2000, "stream": True},
                   headers={"x-request-timeout-ms": "150"}, timeout=30)
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "deadline" and time.monotonic() - start < 5
    assert wait_for(lambda: engine_idle(split)), split.engine.stats()


def test_metrics_come_from_the_engine_process(pair):
    split, _ = pair
    before = split.engine.stats().num_tokens_generated
    _completion(split, PROMPT)
    text = httpx.get(f"{split.url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("tokenwire_generated_tokens_total"))
    assert float(line.split()[-1]) >= before + PROMPT["max_tokens"]


def test_a_dead_engine_process_fails_its_streams_and_health_turns_503():
    server = tokenwire.Server(backend="mock", port=0, engine_process=True, mock_step_us=2000).start()
    try:
        c = RawH2("127.0.0.1", server.port)
        sid = c.post("/v1/completions", {**PROMPT, "max_tokens": 2000, "stream": True})
        c.read_until(lambda: c.data.get(sid, b"").count(b"data:") >= 2)
        os.kill(server.engine.process.pid, signal.SIGKILL)
        c.read_until(lambda: sid in c.ended)
        events = [json.loads(x[6:]) for x in c.data[sid].decode().split("\n\n") if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "error"
        assert "engine process" in events[-1]["error"]["message"]
        c.close()
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        assert httpx.post(f"{server.url}/v1/completions", json=PROMPT, timeout=10).status_code == 503
    finally:
        server.stop()


def test_a_stop_leaves_no_engine_process_behind():
    server = tokenwire.Server(backend="mock", port=0, engine_process=True).start()
    process = server.engine.process
    _completion(server, PROMPT)
    server.stop()
    assert process.poll() == 0


def test_an_engine_that_fails_to_build_fails_the_servers_start_with_its_reason(tmp_path):
    """The draft model is loaded by the engine process alone: its failure is the server's."""
    before = _engine_processes()
    server = tokenwire.Server(backend="cpu", port=0, engine_process=True, speculative="draft",
                              speculative_model=str(tmp_path / "no-such-model"))
    with pytest.raises(RuntimeError, match="engine process failed to start: .*no-such-model"):
        server.start()
    server.stop()
    assert _engine_processes() == before


def test_a_bad_chat_template_fails_before_an_engine_process_starts(tmp_path):
    before = _engine_processes()
    server = tokenwire.Server(backend="mock", port=0, engine_process=True, chat_template=str(tmp_path / "none.jinja"))
    with pytest.raises(RuntimeError, match="cannot read the chat template"):
        server.start()
    server.stop()
    assert _engine_processes() == before


def _engine_processes() -> set:
    found = subprocess.run(["pgrep", "-f", "tokenwire engine-process"], capture_output=True, text=True).stdout
    return set(found.split())


def test_steps_wait_for_the_front_end_beyond_max_steps_ahead():
    """Rule 2: the engine process sends at most MAX_STEPS_AHEAD steps the front end has not
    taken; taking them lets the rest come."""
    engine = EngineProcess.spawn(EngineOptions(backend="mock", warm_up=False),
                                 *_mock_model_parts())
    try:
        engine.start()
        timeline = Timeline(arrived_ns=time.monotonic_ns(), tokenized_ns=time.monotonic_ns())
        engine.add_request(1, [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), timeline)
        steps = []                      # none acknowledged: the engine runs ahead as far as it may
        assert wait_for(lambda: steps.extend(_take(engine, ack=False)) or len(steps) >= MAX_STEPS_AHEAD, timeout=20)
        time.sleep(0.2)                 # a step past the credit would have come by now (it comes never)
        steps += _take(engine, ack=False)
        assert len(steps) == MAX_STEPS_AHEAD
        engine.send((ACK, len(steps)))
        assert wait_for(lambda: steps.extend(_take(engine)) or any(out.finish_reason for s in steps for out in s.rows),
                        timeout=20)
        assert sum(len(s.request_ids) + sum(len(out.token_ids) for out in s.rows) for s in steps) == 50
        assert timeline.first_scheduled_ns >= timeline.queued_ns > 0 and len(timeline.step_done_ns) == 50
    finally:
        engine.shutdown(10)
    assert engine.process.poll() == 0


def test_a_step_whose_write_raises_is_logged_and_the_steps_go_on(caplog):
    """As the step driver's deliver: one failed write neither stops the reading nor keeps the
    engine process's credit."""
    engine = EngineProcess.spawn(EngineOptions(backend="mock", warm_up=False), *_mock_model_parts())
    written = []

    def write(step):
        if not written:
            written.append(None)
            raise RuntimeError("a broken writer")
        written.append(step)

    try:
        engine.driver.attach(StepHost(write, columns=True))
        engine.start()
        engine.add_request(1, [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True),
                           Timeline(arrived_ns=time.monotonic_ns(), tokenized_ns=time.monotonic_ns()))
        assert wait_for(lambda: engine.driver.pull() and any(
            out.finish_reason for s in written[1:] for out in s.rows), timeout=20)
        assert "a broken writer" in caplog.text
    finally:
        engine.shutdown(10)


def _take(engine: EngineProcess, ack: bool = True) -> list:
    """The steps that have arrived (acknowledged, as the loop's reader does, unless `ack` is False)."""
    steps = [s for s in map(engine.take, engine.channel.recv_ready() or []) if s is not None]
    if steps and ack:
        engine.send((ACK, len(steps)))
    return steps


def _mock_model_parts() -> tuple:
    model = MockModel(0.0, 4096)
    return model.tokenizer, model.eos_token_ids, 4096, model.config.vocab_size


def test_the_channel_carries_messages_split_and_joined_across_reads():
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    messages = [(1, "x" * 3000000, list(range(1000))), (2,), (3, {"k": None})]
    writer = threading.Thread(target=lambda: [sender.send(m) for m in messages])   # more than the socket holds
    writer.start()
    got = []
    while len(got) < len(messages):
        got += receiver.recv_ready() or []
    writer.join()
    assert got == messages
    a.close()
    assert receiver.recv_ready() is None and receiver.recv() is None
    b.close()


def test_a_servers_cpu_counts_its_child_processes():
    """bench/proc.read_cpu: the front end's CPU figure includes its engine process's."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                                                    "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and read_cpu(child.pid).stat_ns < 300_000_000:
            time.sleep(0.05)
        own = read_cpu(os.getpid())
        alone = read_cpu(child.pid)
        assert alone.stat_ns >= 300_000_000
        assert own.stat_ns >= alone.stat_ns
    finally:
        child.kill()
        child.wait()
