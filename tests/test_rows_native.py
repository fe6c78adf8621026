"""core/_rows.c: the scheduler's per-row loops in C take the common rows, the Python bodies
(core/scheduler.py) every other; the steps are those of the Python bodies alone.

Two engines over the same mock get the same requests, one with the C loops and one without
(`Scheduler.rows = None`), and step in lockstep, synchronously and overlapped (the next step
begun before the last one's ids are applied, as core/step_driver.py does): every step's rows
and columns, and the KV cache's books after it (block tables, free stack, holders, cached
hashes), must be equal, whatever the rows are: stop ids, stop strings, min_tokens, lengths,
a small KV cache that preempts, the prefix cache, byte tokens that split UTF-8 characters, a
cancel, a grammar-free request and one with logprobs (no columns then).
"""

import subprocess
import sys

import pytest

from tokenwire.core import scheduler as scheduler_module
from tokenwire.core.engine_core import EngineCore
from tokenwire.core.executor import StepOutput, TopLogprobs
from tokenwire.core.outputs import Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.kernels.mock import MockExecutor

needs_c = pytest.mark.skipif(scheduler_module.ROWS is None, reason="the C extension core/_rows.c is not built")

# (prompt length, max_tokens, stop strings, stop token ids, min_tokens, logprobs)
REQUESTS = [(5, 40, (), (), 0, None), (17, 60, (), (318,), 0, None), (33, 25, ("robot",), (), 0, None),
            (3, 90, (), (), 0, None), (40, 42, (), (295, 46), 20, None), (9, 70, ("\n",), (), 5, None),
            (16, 33, (), (), 0, None), (31, 6, (), (), 0, 2), (2, 80, (), (), 0, None),
            (12, 45, (), (343,), 0, None), (48, 30, (), (), 0, None), (7, 64, (" Tok",), (), 0, None)]


class VariedMock(MockExecutor):
    """The story's ids, and every ninth or so any id of the vocabulary (byte tokens: split UTF-8
    characters; EOS), each sequence its own, a function of what the row will be the token of (so synchronous and
    overlapped steps sample alike)."""

    def sample(self, seqs):
        vocab, text = self.config.vocab_size, self.text_token_ids
        keys = [s.seq_id * 7919 + (len(s.output_token_ids) + s.num_pending) * 104729 for s in seqs if s.sample]
        ids = [text[k % len(text)] if k % 9 else k % vocab for k in keys]   # the story, now and then any id
        logprobs = [TopLogprobs(-1.0, (i,), (-1.0,)) if s.sampling.logprobs else None
                    for s, i in zip([s for s in seqs if s.sample], ids)]
        return StepOutput(ids, logprobs if any(lp is not None for lp in logprobs) else None)


def make(native: bool, num_blocks: int) -> EngineCore:
    ex = VariedMock(num_blocks=num_blocks, block_size=16, max_model_len=256)
    core = EngineCore(ex, ex.tokenizer, eos_token_ids=(1,), max_model_len=256, max_num_seqs=16,
                      enable_prefix_caching=True)
    if not native:
        core.scheduler.rows = None
    elif core.scheduler.rows is not None:
        core.scheduler.rows = Counting(core.scheduler.rows)
    for i, (n, max_tokens, stop, stop_ids, min_tokens, logprobs) in enumerate(REQUESTS):
        prompt = [36 + (j * (i + 3)) % 50 for j in range(n)]
        core.add_request(i, prompt, SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids,
                                                   min_tokens=min_tokens, logprobs=logprobs, seed=i), Timeline())
    return core


class Counting:
    """core/_rows, counting the rows its loops took, and the new blocks those rows got."""

    def __init__(self, rows):
        self.rows, self.num_scheduled, self.num_appended, self.num_new_blocks = rows, 0, 0, 0

    def schedule_decodes(self, running, i, *args):
        before = [len(req.block_table) for req in running]
        j = self.rows.schedule_decodes(running, i, *args)
        self.num_scheduled += j - i
        self.num_new_blocks += sum(len(req.block_table) - n for req, n in zip(running[i:j], before[i:j]))
        return j

    def append_tokens(self, reqs, sampled, i, *args):
        j = self.rows.append_tokens(reqs, sampled, i, *args)
        self.num_appended += j - i
        return j


def plain(step, core) -> tuple:
    """A StepTokens without its clock readings, and the KV cache's books after it: every
    live request's block table, the free stack, the holders and the cached hashes."""
    bm = core.block_manager
    tables = {req.request_id: list(req.block_table) for req in core.scheduler.running}
    return (list(step.request_ids), list(step.token_ids), list(step.texts),
            [out._replace(step_done_ns=0) for out in step.rows],
            tables, list(bm.free_block_ids), list(bm.ref_counts), dict(bm.cached), list(bm.evictable))


def synchronous(core, cancel_at: int):
    n = 0
    while core.has_unfinished():
        n += 1
        if n == cancel_at:
            core.cancel(3)
        yield plain(core.step(columns=True), core)


def overlapped(core, cancel_at: int):
    """As the step driver overlaps: begin the next step, then finish the last one."""
    n = 0
    in_flight = core.begin_step(True)
    while in_flight.plan is not None:
        n += 1
        if n == cancel_at:
            core.cancel(3)
        launched = core.begin_step(True) if core.can_overlap() else None
        step = core.finish_step(in_flight)
        if launched is None:
            launched = core.begin_step(True)
        step.rows += launched.step.rows
        launched.step.rows.clear()
        yield plain(step, core)
        in_flight = launched
    yield plain(core.finish_step(in_flight), core)


@needs_c
@pytest.mark.parametrize("drive", [synchronous, overlapped])
@pytest.mark.parametrize("num_blocks", [400, 24], ids=["roomy", "preempting"])
def test_the_c_loops_make_the_steps_the_python_bodies_make(drive, num_blocks):
    python, native = make(False, num_blocks), make(True, num_blocks)
    want, got = list(drive(python, 40)), list(drive(native, 40))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"step {k} differs"
    rows = native.scheduler.rows
    num_tokens = sum(len(s[1]) + sum(len(o.token_ids) for o in s[3]) for s in want)
    # the C loops took most rows (the rest: ends, stops, evictions, split characters, logprobs),
    # decodes that stepped into a new block among them
    assert rows.num_scheduled > num_tokens // 2 and rows.num_appended > num_tokens // 4, \
        (rows.num_scheduled, rows.num_appended, num_tokens)
    assert rows.num_new_blocks > 0
    if num_blocks == 24:
        assert native.scheduler.num_preemptions > 0
    assert native.scheduler.num_preemptions == python.scheduler.num_preemptions
    finishes = {o.request_id: o.finish_reason for s in want for o in s[3] if o.finish_reason}
    assert set(finishes) == set(range(len(REQUESTS)))
    assert {"stop", "length", "cancelled"} <= set(finishes.values())



def test_without_the_extensions_the_python_bodies_take_every_row():
    """Built without a compiler: the scheduler and the step writer run on their Python bodies alone."""
    code = ("import sys; sys.modules['tokenwire.core._rows'] = sys.modules['tokenwire.net.writer._columns'] = None\n"
            "from tokenwire.core import scheduler\n"
            "from tokenwire.net.writer import dispatch\n"
            "from tokenwire.net.metrics import Metrics\n"
            "assert scheduler.ROWS is None and dispatch.COLUMNS is None\n"
            "assert dispatch.Dispatcher(Metrics()).columns is None\n"
            "sys.path.insert(0, %r)\n"
            "import test_rows_native as t\n"
            "core = t.make(True, 24)\n"
            "assert core.scheduler.rows is None\n"
            "steps = list(t.synchronous(core, 40))\n"
            "assert sum(len(s[1]) for s in steps) > 100\n") % str(__import__("pathlib").Path(__file__).parent)
    subprocess.run([sys.executable, "-c", code], check=True)
