"""The prefix cache: block-manager units and a hypothesis state machine (sharing, eviction,
preemption, cancellation never leak, double-free or evict a held block, and a table never
points at a block cached with other content), the scheduler over the KV-checking fake model
(cache on and off give the same tokens, the cached part is not fed again), and the real
stories260K checkpoint on both CPU forwards: greedy output with and without the cache is the
same for prompts sharing prefixes of every length around block boundaries."""

import functools
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenwire.core.block_manager import BlockManager, chain_hashes, root_hash
from tokenwire.core.errors import BlockAccountingError
from tokenwire.core.outputs import Timeline
from tokenwire.core.sampling_params import SamplingParams

from engines import engine_core
from test_scheduler import Collector, KVCheckingExecutor, make_engine, run
from tokenwire.kernels import cpu

BS = 4


def test_root_and_chain_hashes_name_the_whole_prefix():
    a, b = root_hash("model-a"), root_hash("model-b")
    assert a != b and len(a) == 16
    tokens = list(range(12))
    h = chain_hashes(a, tokens, BS)
    assert len(h) == 3 and len(set(h)) == 3
    assert chain_hashes(a, tokens[:8], BS) == h[:2]                 # a prefix's hashes are a prefix
    assert chain_hashes(h[0], tokens[4:12], BS) == h[1:]            # chained: resumable from any block
    assert chain_hashes(b, tokens, BS)[0] != h[0]                   # another model: nothing matches
    assert chain_hashes(a, [0, 1, 2, 9] + tokens[4:], BS)[1] != h[1]  # a change upstream changes every later hash


def test_released_cached_blocks_are_reused_and_evicted_only_when_needed():
    bm = BlockManager(num_blocks=4, block_size=BS, prefix_cache_identity="m")
    hashes = chain_hashes(bm.root_hash, list(range(8)), BS)
    table = bm.allocate(3)
    for b, h in zip(table, hashes):
        bm.cache_block(b, h)
    bm.free(table)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2 and list(bm.evictable) == table[1::-1]
    assert bm.match_prefix(hashes) == table[:2]
    other = bm.allocate(2)                          # the plain free blocks go first
    assert bm.num_cached_blocks == 2 and table[2] in other
    got = []
    bm.take_cached(bm.match_prefix(hashes[:1]), got)
    assert got == table[:1] and bm.ref_counts[table[0]] == 1 and table[0] not in bm.evictable
    (evicted,) = bm.allocate(1)                     # now only the second cached block is evictable
    assert evicted == table[1] and bm.num_evictions == 1 and bm.match_prefix(hashes) == table[:1]
    with pytest.raises(BlockAccountingError):
        bm.allocate(1)
    bm.free(got + other + [evicted])
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 1


def test_the_first_block_with_some_content_stays_the_cached_one():
    bm = BlockManager(num_blocks=4, block_size=BS, prefix_cache_identity="m")
    (h,) = chain_hashes(bm.root_hash, [5, 6, 7, 8], BS)
    a, b = bm.allocate(2)
    bm.cache_block(a, h)
    bm.cache_block(b, h)                            # computed twice at once: b stays plain
    bm.free([a, b])
    assert bm.match_prefix([h]) == [a] and b in bm.free_block_ids and a in bm.evictable
    with pytest.raises(BlockAccountingError, match="no holder"):
        bm.cache_block(b, h)
    bm.reset_prefix_cache()
    assert bm.match_prefix([h]) == [] and bm.num_free_blocks == 4 and not bm.evictable


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences over a 3-token alphabet (so prefixes repeat) are admitted through the cache,
    grow, have their computed blocks registered, and end (finish, cancel or preemption: each
    frees the table). The model: each live table's tokens; the checks: reference counts equal
    the tables' holdings, every block is held, plain free or evictable (exactly one), the cache
    index matches the blocks' hashes, and a table's cached block holds that table's content."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=BS, prefix_cache_identity="m")
        self.seqs = []              # [table, tokens, num_computed]

    def hashes(self, tokens, n):
        return chain_hashes(self.bm.root_hash, tokens[:n * BS], BS)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, tokens):
        bm = self.bm
        cached = bm.match_prefix(self.hashes(tokens, (len(tokens) - 1) // BS))
        need = bm.num_blocks_for(len(tokens)) - len(cached) + bm.num_evictable_in(cached)
        if need > bm.num_free_blocks:
            return
        table = []
        bm.take_cached(cached, table)
        bm.append_slot(table, len(tokens))
        assert len(set(table)) == len(table)
        self.seqs.append([table, tokens, len(cached) * BS])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute_and_register(self, data):
        """A step computed the sequence up to its end: its full blocks join the cache."""
        seq = data.draw(st.sampled_from(self.seqs))
        table, tokens, _ = seq
        seq[2] = len(tokens)
        for b, h in zip(table, self.hashes(tokens, len(tokens) // BS)):
            self.bm.cache_block(b, h)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data, more):
        seq = data.draw(st.sampled_from(self.seqs))
        if self.bm.can_append_slot(seq[0], len(seq[1]) + len(more)):
            self.bm.append_slot(seq[0], len(seq[1]) + len(more))
            seq[1] = seq[1] + more

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        """Finish, cancel or preemption: the table is freed once; again is a double free."""
        table = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))[0]
        self.bm.free(table)
        if table and all(self.bm.ref_counts[b] == 0 for b in table):
            with pytest.raises(BlockAccountingError):
                self.bm.free(table)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        """n > 1: a second table shares a sequence's full blocks."""
        table, tokens, computed = data.draw(st.sampled_from(self.seqs))
        n = computed // BS
        self.bm.share(table[:n])
        self.seqs.append([table[:n], tokens[:n * BS], n * BS])

    @invariant()
    def accounting_is_exact(self):
        bm = self.bm
        expected = [0] * bm.num_blocks
        for table, _, _ in self.seqs:
            for b in table:
                expected[b] += 1
        assert bm.ref_counts == expected
        free, evictable = set(bm.free_block_ids), set(bm.evictable)
        assert len(free) == len(bm.free_block_ids) and not free & evictable
        assert free | evictable == {b for b, c in enumerate(expected) if c == 0}     # no leak
        assert all(bm.block_hashes[b] is not None for b in evictable)
        assert {h: b for b, h in enumerate(bm.block_hashes) if h is not None} == bm.cached
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks

    @invariant()
    def cached_blocks_hold_their_tables_content(self):
        for table, tokens, _ in self.seqs:
            for b, h in zip(table, self.hashes(tokens, len(tokens) // BS)):
                assert self.bm.block_hashes[b] in (None, h)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ scheduler over the checking fake

SYSTEM = [3 + (i * 5) % 60 for i in range(19)]


def submit(engine, rid, prompt, max_tokens=6, **params):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), Timeline())


def test_a_shared_prefix_is_fed_once():
    ex = KVCheckingExecutor(block_size=BS)
    engine = make_engine(ex)
    submit(engine, 1, SYSTEM + [7, 8])
    first, _, _ = run(engine)
    ex.log.clear()
    submit(engine, 2, SYSTEM + [9])
    second, _, _ = run(engine)
    fed = [(start, n) for step in ex.log for rid, start, n, _ in step if rid == 2]
    assert fed[0] == (16, 4)                        # 4 full blocks of the 19-token system prompt cached
    assert engine._requests == {} and engine.stats().num_kv_blocks_used == 0
    assert engine.scheduler.num_prefix_hits == 16 and engine.scheduler.num_prefix_queries == 21 + 20
    ex2 = KVCheckingExecutor(block_size=BS)
    off = make_engine(ex2, enable_prefix_caching=False)
    submit(off, 2, SYSTEM + [9])
    assert run(off)[0] == second


def test_a_prompt_wholly_cached_still_feeds_its_last_token():
    ex = KVCheckingExecutor(block_size=BS)
    engine = make_engine(ex)
    prompt = SYSTEM[:16]
    submit(engine, 1, prompt)
    want = run(engine)[0][1]
    ex.log.clear()
    submit(engine, 2, prompt)
    assert run(engine)[0][2] == want
    first = [(start, n) for step in ex.log for rid, start, n, _ in step if rid == 2][0]
    assert first == (12, 4)                         # the last block is recomputed: its last token is sampled


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.tuples(st.integers(0, 19), st.lists(st.integers(3, 9), max_size=6), st.integers(1, 8)),
                        min_size=1, max_size=8),
       num_blocks=st.integers(12, 30), budget=st.sampled_from([4, 7, 64]), cancel=st.integers(-1, 7))
def test_cache_on_and_off_give_the_same_tokens_under_pressure(prompts, num_blocks, budget, cancel):
    """Prefixes of the system prompt of every length, chunked prefill (small budgets),
    preemption (few blocks), a cancellation: the same tokens with and without the cache, and
    no block held once everything ended."""
    results = []
    for on in (True, False):
        engine = make_engine(KVCheckingExecutor(num_blocks=num_blocks, block_size=BS, max_model_len=40),
                             enable_prefix_caching=on, max_num_batched_tokens=budget, max_num_seqs=4)
        for rid, (k, tail, max_tokens) in enumerate(prompts):
            submit(engine, rid, SYSTEM[:k] + tail or [3], max_tokens=max_tokens)
        c = Collector(engine)                       # from the first step: its outputs count too
        if 0 <= cancel < len(prompts):
            c.step()
            engine.cancel(cancel)
        tokens, finish, _ = c.run()
        assert engine.stats().num_kv_blocks_used == 0
        assert sum(engine.block_manager.ref_counts) == 0
        assert set(finish) == set(range(len(prompts)))
        assert all(finish[rid] == "length" and len(tokens[rid]) == max_tokens      # the context holds them all
                   for rid, (_, _, max_tokens) in enumerate(prompts) if rid != cancel)
        results.append({rid: t for rid, t in tokens.items() if rid != cancel})
    assert results[0] == results[1]


# ------------------------------------------------------------------ stories260K, both CPU forwards

@pytest.fixture(scope="module")
def stories_engine(stories260k_dir, tmp_path_factory):
    from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
    from tokenwire.kernels.engine_format import load_engine
    from tokenwire.engine_build.quantize import QuantOptions
    src = open_source(stories260k_dir / "stories260K.bin")
    path = build_engine(src, tmp_path_factory.mktemp("fp32") / "engine", BuildOptions(quant=QuantOptions(method="none")))
    return load_engine(path)


@pytest.fixture(params=["reference", "cpu"])
def build(request):
    """engine_core on one of the CPU backends ("reference": numpy; "cpu": the C forward)."""
    if request.param == "cpu" and not cpu.AVAILABLE:
        pytest.skip("the C extension kernels/cpu/_cpu is not built")
    return functools.partial(engine_core, backend=request.param, block_size=BS, max_model_len=256, max_num_seqs=4)


def greedy(core, requests, together=False):
    """Submit one after another (each sees what the earlier ones cached), or all at once.
    -> {rid: token ids}"""
    out = {}
    for batch in [requests] if together else [[r] for r in requests]:
        for rid, prompt in batch:
            core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12), Timeline())
        while core.has_unfinished():
            for o in core.step().rows:
                assert o.finish_reason != "error", o.error
                out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def test_stories_greedy_output_is_the_same_with_and_without_the_cache(stories_engine, build):
    tok = stories_engine.tokenizer
    base = [1] + tok.encode("One day, a little girl named Lily went to the park with her mom and saw a big dog.",
                            add_special_tokens=False).ids
    tails = [tok.encode(t, add_special_tokens=False).ids for t in (" The dog", " She was happy")]
    assert len(base) > 3 * BS + 2
    requests, rid = [], 0
    for k in range(BS - 1, 3 * BS + 2):             # prefix lengths around the first three block boundaries
        for tail in tails:
            requests.append((rid, base[:k] + tail))
            rid += 1
    cached_core, plain_core = build(stories_engine), build(stories_engine, enable_prefix_caching=False)
    with_cache, without = greedy(cached_core, requests), greedy(plain_core, requests)
    assert with_cache == without
    assert cached_core.scheduler.num_prefix_hits > 0 and plain_core.scheduler.num_prefix_hits == 0
    assert cached_core.stats().num_kv_blocks_used == 0
    # all at once, prefilled in chunks of 16 tokens: later requests take blocks the earlier
    # ones registered a chunk ago while those still prefill or decode beside them
    concurrent = build(stories_engine, max_num_batched_tokens=16)
    assert greedy(concurrent, requests, together=True) == without
    assert concurrent.scheduler.num_prefix_hits > 0 and concurrent.stats().num_kv_blocks_used == 0


def admission_order(ex):
    order = []
    for step in ex.log:
        for rid, _, _, _ in step:
            if rid not in order:
                order.append(rid)
    return order


def test_cache_aware_admission_is_bounded():
    """One sequence slot: after the cached system prompt is known, requests that share it go
    before an older one that does not, until the older one has been passed over
    MAX_PASSED_OVER times; then it goes, and the rest follow in arrival order."""
    from tokenwire.core.prefix_cache import MAX_PASSED_OVER
    ex = KVCheckingExecutor(block_size=BS)
    engine = make_engine(ex, max_num_seqs=1)
    submit(engine, 0, SYSTEM + [7])
    run(engine)
    ex.log.clear()
    submit(engine, 1, [50, 51, 52], max_tokens=3)           # running while the others queue
    engine.step()
    submit(engine, 2, [40, 41, 42, 43, 44, 45])             # the oldest waiting one: nothing cached
    for rid in range(3, 10):
        submit(engine, rid, SYSTEM + [rid])
    run(engine)
    cached_first = list(range(3, 3 + MAX_PASSED_OVER))
    assert admission_order(ex) == [1] + cached_first + [2] + list(range(3 + MAX_PASSED_OVER, 10))


def test_without_the_cache_admission_is_first_come_first_served():
    ex = KVCheckingExecutor(block_size=BS)
    engine = make_engine(ex, max_num_seqs=1, enable_prefix_caching=False)
    submit(engine, 0, SYSTEM + [7])
    run(engine)
    ex.log.clear()
    submit(engine, 1, [50, 51, 52], max_tokens=3)
    engine.step()
    for rid in range(2, 6):
        submit(engine, rid, [40, 41, 42] if rid == 2 else SYSTEM + [rid])
    run(engine)
    assert admission_order(ex) == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------ over HTTP (mock engine)

def test_usage_trailer_trace_and_metrics_report_cached_tokens(tmp_path):
    import os
    import subprocess
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    import tokenwire
    trace = tmp_path / "trace.json"
    server = tokenwire.Server(backend="mock", port=0, loop="asyncio", trace=str(trace)).start()
    try:
        ids = list(range(5, 45))                            # 40 tokens: 2 full blocks of 16 are cacheable
        with httpx.Client(http2=True) as client:
            bodies = [client.post(server.url + "/v1/completions",
                                  json={"model": "mock", "prompt": ids, "max_tokens": 3}).json() for _ in range(2)]
            streamed = client.post(server.url + "/generate", json={"prompt_token_ids": ids, "max_tokens": 2})
            metrics = client.get(server.url + "/metrics").text
        assert [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies] == [0, 32]
        final = json.loads(streamed.text.splitlines()[-1])
        assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert final["timings"]["cached_prompt_tokens"] == 32
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients", "h2_stream.mjs")
        node = subprocess.run(["node", script, server.url, "/v1/completions",
                               json.dumps({"prompt": ids, "max_tokens": 2, "stream": True})],
                              capture_output=True, text=True, timeout=60)
        assert json.loads(node.stdout)["trailers"]["tokenwire-cached-tokens"] == "32"     # the HTTP/2 trailer
        families = {f.name: f.samples[0].value for f in text_string_to_metric_families(metrics)}
        assert families["tokenwire_prefix_cache_queries"] == 3 * 40
        assert families["tokenwire_prefix_cache_hits"] == 64
        assert families["tokenwire_prefix_cache_blocks"] >= 2
    finally:
        server.stop()
    spans = [e for e in json.loads(trace.read_text()) if e.get("name") == "request"]     # closed by stop()
    assert [s["args"]["cached_prompt_tokens"] for s in spans] == [0, 32, 32, 32]


# ------------------------------------------------------------------ n > 1 in the engine

def choices(engine, base_id, prompt, n, **params):
    from tokenwire.core.sampling_params import choice_params
    ps = choice_params(SamplingParams(max_tokens=6, **params), n)
    engine.add_choices(list(range(base_id, base_id + n)), prompt, ps, [Timeline() for _ in range(n)])


def test_n_greedy_choices_are_identical_and_share_the_prompt():
    ex = KVCheckingExecutor(block_size=BS, sampled_logits=True)
    engine = make_engine(ex)
    choices(engine, 10, SYSTEM + [7, 8], 4, temperature=0.0)
    tokens, finish, _ = run(engine)
    assert finish == dict.fromkeys(range(10, 14), "length") and len(tokens[10]) == 6
    assert len(tokens) == 4 and all(tokens[r] == tokens[10] for r in tokens)
    firsts = {rid: (start, n) for step in reversed(ex.log) for rid, start, n, _ in step}
    assert firsts[10] == (0, 21)                        # the leader computes the prompt
    assert all(firsts[r] == (20, 1) for r in (11, 12, 13))  # the others only its last, partial block
    assert engine.stats().num_kv_blocks_used == 0


def test_seeded_choices_equal_single_requests_with_the_derived_seeds():
    from tokenwire.core.sampling_params import choice_params
    seed, prompt = 2**64 - 2, SYSTEM + [9]              # the derived seeds wrap around 2**64
    engine = make_engine(KVCheckingExecutor(block_size=BS, sampled_logits=True))
    choices(engine, 0, prompt, 4, temperature=1.0, seed=seed)
    together = run(engine)[0]
    assert [p.seed for p in choice_params(SamplingParams(seed=seed), 4)] == [seed, seed + 1, 0, 1]
    for i, derived in enumerate([seed, seed + 1, 0, 1]):
        alone = make_engine(KVCheckingExecutor(block_size=BS, sampled_logits=True))
        submit(alone, 0, prompt, temperature=1.0, seed=derived)
        assert run(alone)[0][0] == together[i]
    assert len({tuple(t) for t in together.values()}) > 1   # they do sample independently


def test_cancelling_choices_while_they_wait_on_their_leader():
    engine = make_engine(KVCheckingExecutor(block_size=BS), max_num_batched_tokens=8)
    choices(engine, 0, SYSTEM + [5], 3, temperature=0.0)
    engine.step()                                       # the leader prefills in chunks: the others wait
    assert engine.scheduler.num_waiting == 0 and len(engine.scheduler.running[0].followers) == 2
    engine.cancel(1)
    tokens, finish, _ = run(engine)
    assert finish == {0: "length", 1: "cancelled", 2: "length"} and tokens[0] == tokens[2]
    assert engine.stats().num_kv_blocks_used == 0


def test_n_over_http_streams_every_choice_and_a_reset_cancels_them_all():
    import httpx
    import tokenwire
    server = tokenwire.Server(backend="mock", port=0, loop="asyncio", mock_step_us=2000).start()
    try:
        with httpx.Client(http2=True, timeout=30) as client:
            body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 3}
            events = [json.loads(line[6:]) for line in client.post(server.url + "/v1/chat/completions",
                                                                   json=dict(body, stream=True)).text.splitlines()
                      if line.startswith("data: {")]
            firsts = {}
            for e in events:
                for c in e["choices"]:
                    firsts.setdefault(c["index"], c["delta"])
            assert firsts == {i: {"role": "assistant", "content": firsts[0]["content"]} for i in range(3)}
            assert sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"]) == [0, 1, 2]
            refused = client.post(server.url + "/v1/completions", json={"prompt": "hi", "best_of": 2})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"
            with client.stream("POST", server.url + "/v1/completions",
                               json={"prompt": "hi", "max_tokens": 500, "n": 4, "stream": True}) as r:
                next(r.iter_lines())
            for _ in range(200):
                stats = server.engine.stats()
                if stats.num_running == 0 and stats.num_waiting == 0:
                    break
                time.sleep(0.01)
            assert stats.num_running == 0 and stats.num_kv_blocks_used == 0 and stats.num_cancellations == 4
    finally:
        server.stop()


# ------------------------------------------------------------------ the CUDA executor (fake driver, CPU only)

def test_cuda_executor_prefills_from_a_cached_position():
    """The CUDA backend's host side takes a first chunk that starts at the cached position
    (eager step over shared blocks) and gives the same greedy tokens as without the cache."""
    from test_cuda_executor_fake import make, tiny_config, tiny_engine
    from test_scheduler import TOKENIZER
    from tokenwire.core.engine_core import EngineCore
    c = tiny_config(vocab_size=64)
    t = tiny_engine(c)
    base = [3 + (i * 7) % 60 for i in range(40)]
    results = []
    for on in (True, False):
        engine = EngineCore(make(c, t, block_size=BS), TOKENIZER, eos_token_ids=(), max_model_len=128,
                            max_num_seqs=4, enable_prefix_caching=on)
        out = {}
        for rid, k in enumerate((40, 17, 16, 15, 33, 8)):
            engine.add_request(rid, base[:k] + [5, 6], SamplingParams(temperature=0.0, max_tokens=5), Timeline())
            while engine.has_unfinished():
                for o in engine.step().rows:
                    out.setdefault(o.request_id, []).extend(o.token_ids)
        results.append((out, engine.scheduler.num_prefix_hits))
    assert results[0][0] == results[1][0] and results[0][1] > 0 and results[1][1] == 0


def test_cache_version_moves_with_the_cached_content():
    """A waiting request's memoized lookup is keyed on it: caching, eviction and a reset each change it."""
    bm = BlockManager(num_blocks=2, block_size=4, prefix_cache_identity="m")
    v0 = bm.cache_version
    table = []
    bm.append_slot(table, 4)
    bm.cache_block(table[0], chain_hashes(bm.root_hash, [1, 2, 3, 4], 4)[0])
    v1 = bm.cache_version
    assert v1 > v0
    bm.free(table)                          # released: evictable, still cached
    assert bm.cache_version == v1
    bm.append_slot([], 8)                   # needs both blocks: evicts the cached one
    assert bm.cache_version > v1
    bm.reset_prefix_cache()
    assert bm.cache_version > v1 + 1
