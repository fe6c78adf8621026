"""EngineCore.step(columns=True): the same outputs as rows, the common ones as columns
(from COLUMNS_MIN_RUNNING running requests on; smaller steps have rows only).

Two engines get the same requests; one steps without columns, the other with. Every request
must end with the same token ids, text, finish reason and usage, and every output that is
not a plain "one token, goes on" entry must still be a RequestOutput.
"""

from tokenwire.core.executor import StepOutput, TopLogprobs
from engines import mock_engine_core
from tokenwire.kernels.mock import MockExecutor
from tokenwire.core.engine_core import COLUMNS_MIN_RUNNING, EngineCore
from tokenwire.core.outputs import FINISH_CANCELLED, StepTokens, Timeline
from tokenwire.core.sampling_params import SamplingParams

REQUESTS = [  # (max_tokens, stop strings, stop token ids)
    (5, (), ()), (17, (), ()), (40, ("the",), ()), (3, (), ()), (25, (), (1,)), (60, (".",), ()),
    (9, (), ()), (30, (), ()), (12, ("a",), ()), (33, (), ()), (20, (), ()), (45, (), ()),
]


def submit(engine):
    ids = engine.tokenizer.encode("Once upon a time", add_special_tokens=False).ids
    for i, (n, stop, stop_ids) in enumerate(REQUESTS):
        engine.add_request(i, ids, SamplingParams(max_tokens=n, stop=stop, stop_token_ids=stop_ids, seed=i),
                           Timeline())


def collect(engine, cancel_at=None, columns=False):
    """Drive to completion. -> {request_id: [token ids, text, finish, usage]}, plain entries seen"""
    got, plain, step = {}, 0, 0
    while engine.has_unfinished():
        running = engine.scheduler.num_running
        out = engine.step(columns)
        step += 1
        if step == cancel_at:
            engine.cancel(1)
        assert type(out) is StepTokens      # every step is one; columns only when asked, from MIN on
        assert (columns and running >= COLUMNS_MIN_RUNNING) or not out.request_ids
        assert len(out) == len(out.request_ids) + len(out.rows)
        for rid, tid, text in zip(out.request_ids, out.token_ids, out.texts):
            assert rid not in (r.request_id for r in out.rows)
            g = got.setdefault(rid, [[], "", None, None])
            g[0].append(tid)
            g[1] += text
            plain += 1
        for r in out.rows:
            g = got.setdefault(r.request_id, [[], "", None, None])
            g[0].extend(r.token_ids)
            g[1] += r.text
            if r.finish_reason is not None:
                g[2], g[3] = r.finish_reason, (r.num_prompt_tokens, r.num_output_tokens)
    return got, plain


def test_columns_carry_the_same_outputs_as_lists():
    rows_engine, cols_engine = mock_engine_core(), mock_engine_core()
    submit(rows_engine)
    submit(cols_engine)
    want, none = collect(rows_engine)
    got, plain = collect(cols_engine, columns=True)
    assert got == want and none == 0
    assert all(g[2] is not None for g in got.values())
    assert plain > 50            # the common case took the columns
    assert cols_engine.num_tokens_generated == rows_engine.num_tokens_generated == sum(len(g[0]) for g in got.values())


def test_a_cancelled_request_ends_in_rows_with_columns_on():
    engine = mock_engine_core()
    submit(engine)
    got, _ = collect(engine, cancel_at=2, columns=True)
    assert got[1][2] == FINISH_CANCELLED


class LogprobExecutor(MockExecutor):
    """The mock stream, with logprobs for request 0's tokens."""

    def sample(self, seqs):
        ids = super().sample(seqs).token_ids
        sampled = [s for s in seqs if s.sample]
        return StepOutput(ids, [TopLogprobs(-0.5, (t,), (-0.5,)) if s.seq_id == 0 else None
                                for s, t in zip(sampled, ids)])


def test_a_step_with_logprobs_is_all_rows():
    ex = LogprobExecutor()
    engine = EngineCore(ex, ex.tokenizer, eos_token_ids=(1,), max_model_len=512)
    submit(engine)
    num_with_logprobs = 0
    while engine.has_unfinished():
        out = engine.step(columns=True)
        assert out.request_ids == []
        for r in out.rows:
            assert r.finish_reason != "error", r.error
            assert (r.logprobs is not None) == (r.request_id == 0 and bool(r.token_ids))
            num_with_logprobs += r.logprobs is not None
    assert num_with_logprobs == REQUESTS[0][0]          # each of request 0's tokens came with its logprobs


def test_small_batches_are_steps_without_columns():
    engine = mock_engine_core()
    ids = engine.tokenizer.encode("Once", add_special_tokens=False).ids
    for i in range(COLUMNS_MIN_RUNNING - 1):
        engine.add_request(i, ids, SamplingParams(max_tokens=4), Timeline())
    while engine.has_unfinished():
        step = engine.step(columns=True)
        assert type(step) is StepTokens and not step.request_ids and step.rows
