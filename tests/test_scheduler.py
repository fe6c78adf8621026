"""Scheduler policy through EngineCore.step() with fake engines.

`KVCheckingExecutor` is a fake model with a real paged cache of token ids: it writes every fed
token into its slot, then computes each sampled token from the context it reads back through
the block table, checking every slot holds this sequence's token for that position. A wrong
block table, start position or chunk, a block reused while still live, or a token lost across
a preemption changes the output or fails the step."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenwire.core.detokenizer import byte_level_alphabet
from tokenwire.core.engine_core import EngineCore
from tokenwire.core.executor import StepOutput, SyncExecutor
from tokenwire.kernels.mock import build_mock_tokenizer, mock_config
from tokenwire.core.outputs import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Timeline
from tokenwire.core.request import RequestState
from tokenwire.kernels.sampling import sample
from tokenwire.core.sampling_params import SamplingParams

VOCAB = 64
TOKENIZER = build_mock_tokenizer()


class KVCheckingExecutor(SyncExecutor):
    def __init__(self, num_blocks=64, block_size=4, max_model_len=256, sampled_logits=False, vocab_size=VOCAB):
        self.config = mock_config(vocab_size, max_model_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.cache = [None] * (num_blocks * block_size)     # slot -> (seq_id, position, token)
        self.sampled_logits = sampled_logits                 # True: logits from the context, then core sampling
        self.log = []                                        # per step: [(seq_id, start_pos, num_tokens, sample)]

    def slot(self, s, pos):
        return s.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, seqs):
        self.log.append([(s.seq_id, s.start_pos, len(s.token_ids), s.sample) for s in seqs])
        for s in seqs:
            assert len(s.block_table) * self.block_size >= s.start_pos + len(s.token_ids)
            for j, tok in enumerate(s.token_ids):
                self.cache[self.slot(s, s.start_pos + j)] = (s.seq_id, s.start_pos + j, tok)
        contexts = [self.read_context(s) for s in seqs if s.sample]
        if not self.sampled_logits:
            return StepOutput([context_token(c) for c in contexts])
        logits = np.stack([context_logits(c) for c in contexts]) if contexts else np.zeros((0, VOCAB), np.float32)
        return sample(logits, [s for s in seqs if s.sample])

    def read_context(self, s):
        """The context through the block table; each slot must hold this sequence's own token
        for that position (written by it, or by another sequence with the same prefix: the
        prefix cache shares such blocks)."""
        ctx, own = [], list(s.prompt_token_ids) + list(s.output_token_ids)
        for pos in range(s.start_pos + len(s.token_ids)):
            entry = self.cache[self.slot(s, pos)]
            if entry is None or entry[1:] != (pos, own[pos]):
                raise AssertionError(f"seq {s.seq_id} position {pos}: cache slot holds {entry}, "
                                     f"expected token {own[pos]}")
            ctx.append(entry[2])
        return ctx

    def close(self):
        pass


def context_hash(ctx):
    h = 7
    for t in ctx:
        h = (h * 1_000_003 + t) % (1 << 61)
    return h


def context_token(ctx):
    return 3 + context_hash(ctx) % (VOCAB - 3)               # never 0..2 (specials)


def context_logits(ctx):
    return np.random.default_rng(context_hash(ctx)).standard_normal(VOCAB).astype(np.float32)


def make_engine(executor=None, **kw):
    executor = executor or KVCheckingExecutor()
    kw.setdefault("max_model_len", executor.config.max_position_embeddings)
    return EngineCore(executor, TOKENIZER, eos_token_ids=kw.pop("eos_token_ids", (1,)), **kw)


def add(engine, rid, prompt_len=5, priority=0, **params):
    prompt = [3 + (rid * 7 + i) % (VOCAB - 3) for i in range(prompt_len)]
    params.setdefault("max_tokens", 8)
    tl = Timeline()
    engine.add_request(rid, prompt, SamplingParams(**params), tl, priority=priority)
    return tl


class Collector:
    """Drives an engine's step() and records every output, checking none follows a final one and
    none failed: the engine turns an executor's exception (the KV check above) into an error
    output, which would otherwise pass any test that looks at order or timelines only."""

    def __init__(self, engine):
        self.engine, self.tokens, self.finish, self.steps = engine, {}, {}, []

    def step(self):
        outs = self.engine.step().rows
        self.steps.append(outs)
        for o in outs:
            assert o.request_id not in self.finish, "an output after the final one"
            assert o.finish_reason != FINISH_ERROR, f"request {o.request_id} failed: {o.error}"
            self.tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
        return outs

    def run(self, max_steps=5000):
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return self.tokens, self.finish, self.steps
            self.step()
        raise AssertionError("the engine did not finish")


def run(engine):
    """-> ({request_id: [token ids]}, {request_id: finish_reason}, [outputs per step])"""
    return Collector(engine).run()


def alone(rid, prompt_len=5, **params):
    engine = make_engine(KVCheckingExecutor(num_blocks=256))
    add(engine, rid, prompt_len, **params)
    return run(engine)[0][rid]


# ------------------------------------------------------------------ admission

def test_admission_is_first_come_first_served():
    engine = make_engine(max_num_seqs=2)
    timelines = [add(engine, i, max_tokens=4) for i in range(6)]
    run(engine)
    firsts = [tl.first_scheduled_ns for tl in timelines]
    assert firsts == sorted(firsts) and len(set(firsts)) == 3    # pairs, in arrival order


def test_smaller_priority_value_is_admitted_first():
    engine = make_engine(max_num_seqs=1)
    low = [add(engine, i, max_tokens=2, priority=5) for i in range(3)]
    high = [add(engine, 10 + i, max_tokens=2, priority=-1) for i in range(2)]
    run(engine)
    order = sorted((tl.first_scheduled_ns, name) for name, tls in (("high", high), ("low", low)) for tl in tls)
    assert [name for _, name in order] == ["high", "high", "low", "low", "low"]


def test_every_running_request_decodes_every_step():
    engine = make_engine(max_num_seqs=8)
    for i in range(8):
        add(engine, i, max_tokens=20)
    _, finish, steps = run(engine)
    assert len(steps) == 20 and all(len(outs) == 8 for outs in steps)
    assert set(finish.values()) == {FINISH_LENGTH}


def test_a_big_prompt_is_not_starved_by_later_small_ones():
    ex = KVCheckingExecutor(num_blocks=24, block_size=4)             # 96 slots
    engine = make_engine(ex, max_num_seqs=8, max_model_len=96)
    for i in range(3):
        add(engine, i, prompt_len=20, max_tokens=12)                # 3 x 8 blocks in use at the end
    engine.step()
    big = add(engine, 100, prompt_len=60, max_tokens=4)              # cannot fit until others finish
    smalls = [add(engine, 200 + i, prompt_len=4, max_tokens=4) for i in range(4)]
    run(engine)
    assert all(big.first_scheduled_ns <= tl.first_scheduled_ns for tl in smalls)


# ------------------------------------------------------------------ chunked prefill

def test_chunked_prefill_interleaves_with_decoding():
    ex = KVCheckingExecutor(num_blocks=128)
    engine = make_engine(ex, max_num_seqs=8, max_num_batched_tokens=8)
    for i in range(3):
        add(engine, i, prompt_len=3, max_tokens=30)
    c = Collector(engine)
    c.step(), c.step()                                            # 3 prompts of 3 tokens in one step, a decode
    add(engine, 99, prompt_len=41, max_tokens=3)
    tokens, _, steps = c.run()
    long_steps = [[e for e in step if e[0] == 99] for step in ex.log]
    chunks = [e[0] for e in long_steps if e and e[0][1] < 41]        # steps feeding the prompt
    assert [c[2] for c in chunks] == [5] * 8 + [1]                 # 8 - 3 decodes per step, 41 tokens
    assert [c[1] for c in chunks] == list(range(0, 41, 5))         # contiguous positions
    assert [c[3] for c in chunks] == [False] * 8 + [True]          # sample only at the end of the prompt
    prefill_steps = [i for i, e in enumerate(long_steps) if e and e[0][1] < 41]
    for i in prefill_steps:                                        # the decodes never paused
        assert sorted(e[0] for e in ex.log[i] if e[2] == 1 and e[0] != 99) == [0, 1, 2]
        assert sum(e[2] for e in ex.log[i]) <= 8
    assert tokens[99] == alone(99, prompt_len=41, max_tokens=3)
    for i in range(3):
        assert tokens[i] == alone(i, prompt_len=3, max_tokens=30)


def test_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    ex = KVCheckingExecutor(num_blocks=128)
    engine = make_engine(ex, max_num_seqs=4, max_num_batched_tokens=16)
    add(engine, 1, prompt_len=100, max_tokens=5)
    tokens, _, _ = run(engine)
    assert [e[0][2] for e in ex.log[:7]] == [16] * 6 + [4]
    assert tokens[1] == alone(1, prompt_len=100, max_tokens=5)


# ------------------------------------------------------------------ preemption

@pytest.mark.parametrize("sampled", [False, True])
def test_preempted_requests_produce_their_unpreempted_output(sampled):
    params = dict(max_tokens=40, temperature=0.0 if not sampled else 0.9, ignore_eos=True)
    ex = KVCheckingExecutor(num_blocks=30, block_size=4, max_model_len=120, sampled_logits=sampled)
    engine = make_engine(ex, max_num_seqs=8)
    for i in range(8):
        add(engine, i, prompt_len=6, **{**params, "seed": 1000 + i})
    tokens, finish, _ = run(engine)
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_kv_blocks_used == 0 and set(finish.values()) == {FINISH_LENGTH}
    for i in range(8):
        ref = make_engine(KVCheckingExecutor(num_blocks=256, max_model_len=120, sampled_logits=sampled))
        add(ref, i, prompt_len=6, **{**params, "seed": 1000 + i})
        assert tokens[i] == run(ref)[0][i], f"request {i}"


def test_preemption_takes_the_newest_lowest_priority_request():
    ex = KVCheckingExecutor(num_blocks=12, block_size=4, max_model_len=48)
    engine = make_engine(ex, max_num_seqs=4)
    add(engine, 1, prompt_len=8, max_tokens=30, priority=0)
    add(engine, 2, prompt_len=8, max_tokens=30, priority=9)
    add(engine, 3, prompt_len=8, max_tokens=30, priority=0)
    preempted = []
    while engine.has_unfinished() and not preempted:
        engine.step()
        preempted = [r.request_id for r in engine._requests.values() if r.num_preemptions]
    assert preempted == [2]


# ------------------------------------------------------------------ cancellation

def cancel_when(c, rid, predicate, max_steps=200):
    for _ in range(max_steps):
        req = c.engine._requests.get(rid)
        if req is not None and predicate(req):
            break
        c.step()
    else:
        raise AssertionError("the state to cancel in was never reached")
    c.engine.cancel(rid)


@pytest.mark.parametrize("state", ["inbox", "waiting", "prefilling", "decoding", "preempted"])
def test_cancel_in_every_state_frees_every_block(state):
    ex = KVCheckingExecutor(num_blocks=14, block_size=4, max_model_len=56)
    engine = make_engine(ex, max_num_seqs=3, max_num_batched_tokens=6)
    c = Collector(engine)
    for i in range(3):
        add(engine, i, prompt_len=10, max_tokens=25)
    target = 7
    add(engine, target, prompt_len=12, max_tokens=25)
    if state == "inbox":
        engine.cancel(target)
    elif state == "waiting":
        c.step()
        assert engine._requests[target].state is RequestState.WAITING
        engine.cancel(target)
    elif state == "prefilling":
        engine.cancel(0)                                         # make room for the target to start
        cancel_when(c, target, lambda r: r.state is RequestState.PREFILLING and r.num_computed_tokens > 0)
    elif state == "decoding":
        engine.cancel(0)
        cancel_when(c, target, lambda r: r.state is RequestState.DECODING and r.output_token_ids)
    elif state == "preempted":
        cancel_when(c, 2, lambda r: r.num_preemptions > 0 and r.state is RequestState.WAITING)
        target = 2
    tokens, finish, _ = c.run()
    # exactly the requests cancelled here end cancelled: a cancel that took a neighbour along fails
    cancelled = {target} | ({0} if state in ("prefilling", "decoding") else set())
    assert finish == {rid: FINISH_CANCELLED if rid in cancelled else FINISH_LENGTH for rid in (0, 1, 2, 7)}
    assert engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0
    assert all(b == 0 for b in engine.block_manager.ref_counts)
    for rid in finish.keys() - cancelled:
        assert tokens[rid] == alone(rid, prompt_len=10 if rid < 7 else 12, max_tokens=25)


def test_cancel_after_finish_is_a_no_op():
    engine = make_engine()
    add(engine, 1, max_tokens=2)
    run(engine)
    engine.cancel(1)
    assert engine.step().rows == [] and engine.stats().num_cancellations == 0


# ------------------------------------------------------------------ stop conditions

class ScriptedExecutor(KVCheckingExecutor):
    """Emits a fixed token list per request (by seq_id), regardless of context."""

    def __init__(self, scripts, **kw):
        super().__init__(vocab_size=TOKENIZER.get_vocab_size(), **kw)
        self.scripts = scripts

    def step(self, seqs):
        super().step(seqs)
        return StepOutput([self.scripts[s.seq_id][len(s.output_token_ids)] for s in seqs if s.sample])


BYTE_CHARS = {b: c for c, b in byte_level_alphabet().items()}


def byte_ids(text):
    """One mock-tokenizer id per UTF-8 byte (no merges), so a string spans many tokens."""
    return [TOKENIZER.token_to_id(BYTE_CHARS[b]) for b in text.encode()]


def test_stop_string_split_across_single_byte_tokens():
    script = byte_ids("Hello, wor") + byte_ids("ld! STOP") + byte_ids("P here")
    ex = ScriptedExecutor({1: script}, max_model_len=256)
    engine = EngineCore(ex, TOKENIZER, eos_token_ids=(1,), max_model_len=256)
    engine.add_request(1, byte_ids("x"), SamplingParams(stop=("world!", "zzz")), Timeline())
    outs = []
    while engine.has_unfinished():
        outs += engine.step().rows
    assert "".join(o.text for o in outs) == "Hello, "
    assert outs[-1].finish_reason == FINISH_STOP and len(outs) == len(byte_ids("Hello, world!"))
    # the held-back "wor" was never emitted early: text up to each step never ends in a stop prefix
    assert all("w" not in o.text for o in outs)


def test_stop_ids_eos_ignore_eos_and_lengths():
    script = [10, 11, 1, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    cases = [
        (dict(), [10, 11, 1], FINISH_STOP),                          # EOS
        (dict(ignore_eos=True, max_tokens=5), script[:5], FINISH_LENGTH),
        (dict(ignore_eos=True, stop_token_ids=(13,)), script[:5], FINISH_STOP),
        (dict(stop_token_ids=(11,)), [10, 11], FINISH_STOP),
        (dict(ignore_eos=True), script[:8], FINISH_LENGTH),          # context: 4 prompt + 8 = 12
    ]
    for params, want, reason in cases:
        ex = ScriptedExecutor({1: script}, max_model_len=12)
        engine = EngineCore(ex, TOKENIZER, eos_token_ids=(1,), max_model_len=12)
        engine.add_request(1, [5, 6, 7, 8], SamplingParams(**params), Timeline())
        tokens, finish, _ = run(engine)
        assert (tokens[1], finish[1]) == (want, reason), params


# ------------------------------------------------------------------ random workloads

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "cancel", "step", "step", "step"]),
                              st.integers(0, 11), st.integers(1, 30), st.integers(1, 20)), max_size=60),
       num_blocks=st.integers(8, 24), budget=st.integers(4, 24))
def test_random_workloads_keep_every_invariant(ops, num_blocks, budget):
    """Any interleaving of submissions, cancellations and steps under memory pressure: every
    request ends exactly once, uncancelled ones produce their solo output, no block leaks."""
    ex = KVCheckingExecutor(num_blocks=num_blocks, block_size=4, max_model_len=32)
    engine = make_engine(ex, max_num_seqs=4, max_num_batched_tokens=max(budget, 4))
    c = Collector(engine)
    submitted, cancelled = {}, set()
    for op, rid, prompt_len, max_tokens in ops:
        if op == "add" and rid not in submitted:
            prompt_len = min(prompt_len, 31)
            add(engine, rid, prompt_len=prompt_len, max_tokens=max_tokens)
            submitted[rid] = (prompt_len, max_tokens)
        elif op == "cancel":
            engine.cancel(rid)          # before its add too: then ignored
            if rid in submitted and rid not in c.finish:
                cancelled.add(rid)
        else:
            c.step()
    tokens, finish, _ = c.run()
    assert set(finish) == set(submitted)
    assert engine.block_manager.num_used_blocks == 0 and all(c == 0 for c in engine.block_manager.ref_counts)
    for rid, (prompt_len, max_tokens) in submitted.items():
        if finish[rid] == FINISH_CANCELLED:
            assert rid in cancelled, f"request {rid} ended cancelled, and nothing cancelled it"
        else:
            assert rid not in cancelled or finish[rid] == FINISH_LENGTH
            want = alone(rid, prompt_len=prompt_len, max_tokens=max_tokens)
            assert tokens[rid] == want[:len(tokens[rid])] and finish[rid] == FINISH_LENGTH
            assert len(tokens[rid]) == min(max_tokens, 32 - prompt_len)


def test_a_cancel_of_an_unknown_id_does_not_cancel_a_later_request_with_that_id():
    engine = make_engine()
    engine.cancel(5)                    # no request 5 yet: ignored, as any unknown id
    add(engine, 5, max_tokens=3)
    tokens, finish, _ = run(engine)
    assert finish == {5: FINISH_LENGTH} and len(tokens[5]) == 3


def test_logprobs_reach_their_own_requests_in_mixed_steps():
    """Decodes and prefills that complete in the same step: each output carries the logprobs
    its request asked for (greedy here, so the top id is the token itself), and no other."""
    engine = make_engine(KVCheckingExecutor(sampled_logits=True), max_num_seqs=8)
    asks = {0: 2, 1: None, 2: 0, 3: 5}
    engine.add_request(0, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=12, logprobs=2), Timeline())
    seen = {i: 0 for i in asks}
    for step in range(14):
        if step == 3:
            for i in (1, 2, 3):
                engine.add_request(i, [8 + i, 9], SamplingParams(temperature=0.0, max_tokens=6, logprobs=asks[i]),
                                   Timeline())
        for out in engine.step().rows:
            seen[out.request_id] += 1
            if asks[out.request_id] is None:
                assert out.logprobs is None
            else:
                (lp,) = out.logprobs
                assert len(lp.top_ids) == asks[out.request_id]
                assert lp.top_ids[:1] in ([], [out.token_ids[0]]) and lp.token_logprob <= 0
    assert seen == {0: 12, 1: 6, 2: 6, 3: 6}


# ------------------------------------------------------------------ the prefill cap

def test_a_step_with_decodes_takes_at_most_the_prefill_cap_and_a_long_prompt_still_finishes():
    """Stall-free batching: while requests decode, prefill chunks and admissions together take
    at most prefill_cap tokens a step, so the decodes' step stays short; the long prompt still
    moves every step and finishes (no starvation), and every output is what it is alone."""
    ex = KVCheckingExecutor(num_blocks=256)
    engine = make_engine(ex, max_num_seqs=16, max_num_batched_tokens=256, prefill_cap=12)
    for i in range(4):
        add(engine, i, prompt_len=3, max_tokens=200)       # a steady decode load
    c = Collector(engine)
    c.step()
    add(engine, 99, prompt_len=150, max_tokens=3)
    later = [add(engine, 200 + i, prompt_len=6, max_tokens=3) for i in range(3)]
    tokens, finish, _ = c.run()
    for step in ex.log[1:]:
        decodes = [e for e in step if e[2] == 1 and e[1] >= 3]
        prefill = sum(e[2] for e in step if e not in decodes)
        if decodes:
            assert prefill <= 12, step
    long_steps = [i for i, step in enumerate(ex.log) if any(e[0] == 99 and e[1] < 150 for e in step)]
    assert len(long_steps) == 13 and long_steps == list(range(long_steps[0], long_steps[0] + 13))   # 150 / 12
    assert all(finish[200 + i] == FINISH_LENGTH for i in range(3)) and finish[99] == FINISH_LENGTH
    assert tokens[99] == alone(99, prompt_len=150, max_tokens=3)


def test_without_decodes_a_prompt_takes_the_whole_budget():
    ex = KVCheckingExecutor(num_blocks=256)
    engine = make_engine(ex, max_num_seqs=16, max_num_batched_tokens=128, prefill_cap=12)
    add(engine, 1, prompt_len=100, max_tokens=2)
    run(engine)
    assert ex.log[0] == [(1, 0, 100, True)]


def test_the_measured_cap_keeps_a_step_within_a_quarter_of_a_decode_step():
    """core/step_costs.py on synthetic step times (no timing here): decode steps of 10 ms at
    batch 4; prefill steps adding 1 ms + 0.2 ms a token: the cap is (2.5 - 1) / 0.2 = 7 tokens;
    never below one; none until both kinds of step were seen."""
    from tokenwire.core.step_costs import StepCosts
    ms = 1_000_000
    costs = StepCosts()
    assert costs.prefill_cap(4) is None
    costs.observe(4, 0, 0, 10 * ms)
    assert costs.prefill_cap(4) is None
    for tokens in (8, 64, 256):
        costs.observe(4, 0, tokens, 10 * ms + 1 * ms + tokens * ms // 5)
    assert costs.prefill_cap(4) == 7
    assert costs.prefill_cap(64) is None            # another batch bucket: not seen yet
    costs.observe(4, 0, 0, 1 * ms)                  # decode steps got faster: the cap shrinks, to one token
    for _ in range(20):
        costs.observe(4, 0, 0, 1 * ms)
    assert costs.prefill_cap(4) == 1


def test_the_floor_is_a_quarter_of_the_pending_prompt_tokens_at_most_16():
    from tokenwire.core.step_costs import MAX_PREFILL_CHUNKS, MIN_PREFILL_TOKENS, prefill_floor
    assert (MAX_PREFILL_CHUNKS, MIN_PREFILL_TOKENS) == (4, 16)
    assert [prefill_floor(n) for n in (0, 1, 3, 4, 5, 8, 16, 63, 64, 65, 5000)] == [1, 1, 1, 1, 2, 2, 4, 16, 16, 16, 16]


def _prefill_chunks(prompt_lens: list, cached: bool = False) -> tuple:
    """Prompts of `prompt_lens` arriving together while 4 requests decode, under a measured
    cap of one token, after request 90's prompt ran alone when `cached` (its prefix is in the
    prefix cache then) -> ({id: its prefill chunks in order}, steps that carried any)."""
    from tokenwire.core.step_costs import FixedCosts
    ex = KVCheckingExecutor(num_blocks=256)
    engine = make_engine(ex, max_num_seqs=16, max_num_batched_tokens=256, prefill_cap=-1)
    engine.scheduler._costs = FixedCosts(prefill_cap=1)
    c = Collector(engine)
    if cached:                      # request 90's prompt (as add() makes it), alone: no cap
        prompt = [3 + (90 * 7 + i) % (VOCAB - 3) for i in range(prompt_lens[0])]
        engine.add_request(80, prompt, SamplingParams(max_tokens=1), Timeline())
        c.step()
    for i in range(4):
        add(engine, i, prompt_len=3, max_tokens=200)       # a steady decode load
    c.step()
    ids = [90 + i for i in range(len(prompt_lens))]
    for rid, n in zip(ids, prompt_lens):
        add(engine, rid, prompt_len=n, max_tokens=3)
    tokens, finish, _ = c.run()
    chunks, num_steps = {rid: [] for rid in ids}, 0
    for step in ex.log[1:]:
        moved = [e for e in step if e[0] in chunks and e[1] < prompt_lens[e[0] - 90]]
        num_steps += bool(moved)
        for e in moved:
            chunks[e[0]].append(e[2])
    assert all(finish[rid] == FINISH_LENGTH for rid in ids)
    for rid, n in zip(ids, prompt_lens):
        assert tokens[rid] == alone(rid, prompt_len=n, max_tokens=3)
    return chunks, num_steps


def test_under_a_one_token_measured_cap_prompts_still_move_by_the_floor_and_finish():
    """A measured cap may be one token (decode steps cheap against what a prompt token adds);
    a capped step still takes the floor of the pending prompt tokens: a short prompt in 4
    chunks; two arriving together at twice that while both are pending (the prefill keeps
    up with arrivals); a long one 16 tokens a step (no starvation). Outputs are what each
    makes alone."""
    assert _prefill_chunks([8]) == ({90: [2, 2, 2, 2]}, 4)
    assert _prefill_chunks([8, 8]) == ({90: [4, 4], 91: [2, 2, 2, 2]}, 6)
    assert _prefill_chunks([150]) == ({90: [16] * 9 + [6]}, 10)
    chunks, num_steps = _prefill_chunks([150, 8])
    assert sum(chunks[90]) == 150 and sum(chunks[91]) == 8 and num_steps == 10
    chunks, num_steps = _prefill_chunks([24], cached=True)     # 20 of 24 cached (blocks of 4): its floor is 1
    assert chunks == {90: [1, 1, 1, 1]} and num_steps == 4
