"""Speculative decoding (core/speculative.py, core/draft.py) through the real engine: greedy
with speculation is token for token greedy without it (stories260K against run.c's ids, and
random engines of every family, on the C and reference backends, batch 1 and 16, with chunked
prefill, preemption and cancellation); rejected tokens leave no KV blocks and never reach the
prefix cache; sampling keeps the model's distribution (a chi-square test) and seeded runs
repeat; penalties, logprobs, stop strings, min_tokens, n > 1 and grammars stay correct."""

import functools
import json
import random

import numpy as np
import pytest

from engines import engine_core
from tokenwire.core.block_manager import chain_hashes
from tokenwire.core.config import ModelConfig
from tokenwire.core.outputs import FINISH_CANCELLED, Timeline
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.core.speculative import FixedCosts
from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
from tokenwire.engine_build.quantize import QuantOptions
from tokenwire.kernels import cpu
from tokenwire.kernels.engine_format import load_engine
from spec_engines import random_engine, tiny_configs

BACKENDS = ["reference", "cpu", "cpu_int8"]
PROMPTS = ["Once upon a time", "Lily", "The dog", "One day, a little boy named Tom went to the park with his mom.",
           "She was sad", "Tim and Sue", "The sun was", "A big red ball", "He said,", "They"]


@pytest.fixture(scope="module")
def stories(stories260k_dir, tmp_path_factory):
    """{"fp32": Engine, "int4": Engine} of the real checkpoint."""
    src = open_source(stories260k_dir / "stories260K.bin")
    out = {}
    for name, quant in (("fp32", QuantOptions(method="none")), ("int4", QuantOptions(method="int4", algorithm="rtn"))):
        out[name] = load_engine(build_engine(src, tmp_path_factory.mktemp(name) / "engine", BuildOptions(quant=quant)))
    return out


def untimed_core(model, backend, **options):
    """engine_core, its speculation deciding from acceptance alone (verified rows taken as free,
    not timed): what these tests check must not depend on the machine's load."""
    core = engine_core(model, backend, **options)
    if core.speculator is not None:
        core.speculator.costs = FixedCosts()
    return core


def builder(name):
    if name != "reference" and not cpu.AVAILABLE:
        pytest.skip("the C extension kernels/cpu/_cpu is not built")
    if name == "reference":
        return functools.partial(untimed_core, backend="reference")
    return functools.partial(untimed_core, backend="cpu", activations="int8" if name == "cpu_int8" else "fp32")


@pytest.fixture(params=BACKENDS)
def build(request):
    return builder(request.param)


def generate(core, requests, cancel_at=None, check=None):
    """requests: [(request_id, prompt ids, SamplingParams)] submitted at once; `cancel_at`:
    {request_id: step number}; `check(core)` runs after every step.
    -> {request_id: (token ids, text, finish_reason)}"""
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params, Timeline())
    tokens, texts, finish = {}, {}, {}
    step_no = 0
    while core.has_unfinished():
        for rid, at in (cancel_at or {}).items():
            if at == step_no:
                core.cancel(rid)
        for o in core.step().rows:
            assert len(o.token_ids) <= 1            # one output per token, speculated or not
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            texts[o.request_id] = texts.get(o.request_id, "") + o.text
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
        step_no += 1
        if check is not None:
            check(core)
    assert core.stats().num_kv_blocks_used == 0
    return {rid: (tokens.get(rid, []), texts.get(rid, ""), finish[rid]) for rid in finish}


def prompts(engine, n):
    return [engine.encode_prompt(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(n)]


def spec_params(params, method="ngram", k=None):
    return SamplingParams(**{**params.__dict__, "speculative": method, "num_speculative_tokens": k})


def prefix_cache_check(core):
    """After a step: every running request's registered blocks hold its verified tokens only."""
    bm = core.block_manager
    for req in core.scheduler.running:
        num = req.num_hashed_blocks
        assert num * bm.block_size <= req.num_computed_tokens
        want = chain_hashes(bm.root_hash, req.tokens(0, num * bm.block_size), bm.block_size)
        assert [bm.block_hashes[b] for b in req.block_table[:num]] == want


# ------------------------------------------------------------------ greedy: the golden run


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_with_speculation_reproduces_run_c(stories, stories260k_dir, method, tmp_path):
    for name in ("reference", "cpu"):
        build = builder(name)
        ref = json.loads((stories260k_dir / "reference_greedy.json").read_text())
        run = max(ref["runs"], key=lambda r: len(r["generated_token_ids"]))
        engine = stories["fp32"]
        want = run["generated_token_ids"]
        options = {"speculative": method}
        if method == "draft":               # the model as its own draft: every greedy proposal is accepted
            options["speculative_model"] = str(engine.path)
        core = build(engine, max_num_seqs=4, **options)
        params = SamplingParams(temperature=0.0, max_tokens=len(want))
        tokens, _, _ = generate(core, [(1, ref["prompt_token_ids"], params)])[1]
        assert tokens == want
        stats = core.stats()
        assert stats.num_spec_proposed > 0 and stats.num_spec_steps < len(want)
        if method == "draft":
            assert stats.num_spec_accepted == stats.num_spec_proposed
        else:
            assert 0 < stats.num_spec_accepted < stats.num_spec_proposed


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_16_greedy_requests_chunked_preempted_and_cancelled_match_without_speculation(stories, build, method):
    engine = stories["int4"]
    ps = prompts(engine, 16)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    plain = generate(build(engine, max_num_seqs=16), [(i, p, params) for i, p in enumerate(ps)])
    # 16 requests of up to ~100 tokens need ~100 blocks of 16; a budget of 48 tokens chunks the
    # prompts beside the decodes (and the proposals); the draft is the unquantized model, so
    # some of its proposals are rejected
    options = {"speculative_model": str(stories["fp32"].path)} if method == "draft" else {}
    core = build(engine, max_num_seqs=16, max_num_batched_tokens=48, kv_cache_bytes=40 * 16 * 1280,
                 speculative=method, **options)
    cancel_at = {3: 5, 11: 30}
    spec = generate(core, [(i, p, params) for i, p in enumerate(ps)], cancel_at, prefix_cache_check)
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.num_spec_accepted > 0 and stats.num_spec_proposed > stats.num_spec_accepted
    if method == "draft":
        draft = core.speculator.proposers["draft"]
        assert draft.num_steps > 0 and not draft.seqs and draft.block_manager.num_used_blocks == 0
    for i in range(16):
        if i in cancel_at:
            assert spec[i][2] == FINISH_CANCELLED and plain[i][0][:len(spec[i][0])] == spec[i][0]
        else:
            assert spec[i] == plain[i], f"request {i}"


class ScriptedProposer:
    """Proposes each request's true greedy continuation (from a run without speculation), each
    token replaced by another with probability `noise`: every acceptance length is exercised."""
    looks_up = False                # asked for the k that adaptive k chose

    def __init__(self, continuations, noise, vocab_size, seed=0):
        self.continuations, self.noise, self.vocab_size = continuations, noise, vocab_size
        self.rng = random.Random(seed)

    def propose_many(self, reqs, ks):
        out = []
        for req, k in zip(reqs, ks):
            done = len(req.output_token_ids)
            truth = self.continuations[req.request_id][done:done + k]
            out.append([t if self.rng.random() >= self.noise else (t + 1 + self.rng.randrange(self.vocab_size - 1))
                        % self.vocab_size for t in truth])
        return out

    def release(self, req):
        pass


@pytest.mark.parametrize("family", sorted(tiny_configs()))
def test_random_engines_of_every_family_greedy_identical(family, tmp_path):
    engine = random_engine(tiny_configs()[family], tmp_path)
    (tmp_path / "draft").mkdir()
    draft = random_engine(tiny_configs()[family], tmp_path / "draft", seed=1, quant="none")   # other weights
    rng = np.random.default_rng(1)
    ps = [[int(t) for t in rng.integers(3, engine.config.vocab_size, size=int(n))] for n in rng.integers(3, 40, 16)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for name in ("reference", "cpu", "cpu_int8"):
        build = builder(name)
        for batch in (1, 16):
            reqs = [(i, p, params) for i, p in enumerate(ps[:batch])]
            plain = generate(build(engine, max_num_seqs=16), reqs)
            ngram = build(engine, max_num_seqs=16, max_num_batched_tokens=32, speculative="ngram")
            assert generate(ngram, reqs, check=prefix_cache_check) == plain, (name, batch)
            assert ngram.stats().num_spec_proposed > 0
            drafted = build(engine, max_num_seqs=16, max_num_batched_tokens=32, speculative="draft",
                            speculative_model=str(draft.path), num_speculative_tokens=3)
            assert generate(drafted, reqs, check=prefix_cache_check) == plain, (name, batch, "draft")
            assert drafted.stats().num_spec_proposed > 0
            scripted = build(engine, max_num_seqs=16, max_num_batched_tokens=40, kv_cache_bytes=None,
                             speculative="ngram", num_speculative_tokens=5)
            scripted.speculator.proposers["ngram"] = ScriptedProposer({i: plain[i][0] for i in plain}, 0.25,
                                                                      engine.config.vocab_size)
            got = generate(scripted, reqs, cancel_at={1: 4} if batch > 1 else None, check=prefix_cache_check)
            for i in plain:
                if i == 1 and batch > 1:
                    assert got[i][2] == FINISH_CANCELLED and plain[i][0][:len(got[i][0])] == got[i][0]
                else:
                    assert got[i] == plain[i], (name, batch, i)
            stats = scripted.stats()
            assert 0 < stats.num_spec_accepted < stats.num_spec_proposed


# ------------------------------------------------------------------ what rides along


def test_penalties_logprobs_stops_min_tokens_and_choices_match_without_speculation(stories, build):
    engine = stories["int4"]
    ps = prompts(engine, 6)
    period = engine.tokenizer.encode(".", add_special_tokens=False).ids[-1]
    cases = [SamplingParams(temperature=0.0, max_tokens=60, repetition_penalty=1.15, frequency_penalty=0.3,
                            presence_penalty=0.2, logprobs=3),
             SamplingParams(temperature=0.0, max_tokens=60, stop=(" park", "sad"), logprobs=0),
             SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=(period,), min_tokens=20),
             SamplingParams(temperature=0.8, top_p=0.9, max_tokens=50, seed=7, repetition_penalty=1.1),
             SamplingParams(temperature=1.0, top_k=20, max_tokens=50, seed=8, logprobs=2),
             SamplingParams(temperature=0.0, max_tokens=50, min_tokens=50, ignore_eos=False)]

    def run(core, method):
        for i, params in enumerate(cases):
            core.add_request(i, ps[i], spec_params(params, method), Timeline())
        core.add_choices([10, 11, 12], ps[0], [spec_params(SamplingParams(temperature=0.9, seed=s, max_tokens=40),
                                                           method) for s in (1, 2, 3)], [Timeline() for _ in range(3)])
        outs = {}
        while core.has_unfinished():
            for o in core.step().rows:
                outs.setdefault(o.request_id, []).append((tuple(o.token_ids), o.text, o.finish_reason, o.logprobs))
        return outs

    plain = run(build(engine), "off")
    core = build(engine)
    spec = run(core, "ngram")
    # tokens, texts, finishes and the top ids exactly; the fp32 paths' logprobs to float rounding
    # (a row's logits in a step of 1 + k rows are not bit for bit those of a one-row step)
    assert strip_logprobs(spec) == strip_logprobs(plain)
    for rid in plain:
        for got, want in zip(spec[rid], plain[rid]):
            if want[3] is not None:
                assert got[3][0].top_ids == want[3][0].top_ids
                np.testing.assert_allclose(got[3][0].top_logprobs, want[3][0].top_logprobs, rtol=1e-5, atol=1e-6)
                assert abs(got[3][0].token_logprob - want[3][0].token_logprob) < 1e-5
    assert core.stats().num_spec_accepted > 0
    assert any(len(v) < 60 and v[-1][2] == "stop" for v in plain.values())      # a stop string or id ended one


def strip_logprobs(outs):
    return {rid: [(ids, text, finish, lp is not None) for ids, text, finish, lp in v] for rid, v in outs.items()}


def test_constrained_rows_do_not_speculate(stories):
    from tokenwire.core.constraint import ConstraintSpec
    from tokenwire.kernels.grammar import GrammarCompiler
    engine = stories["fp32"]
    grammars = GrammarCompiler(engine.tokenizer, engine.config.vocab_size, engine.eos_token_ids)
    compiled = grammars.compile(ConstraintSpec("regex", "(ab|cd)+ the end"))
    params = SamplingParams(temperature=0.0, max_tokens=30, speculative="ngram")
    out = {}
    for method in ("off", "ngram"):
        core = builder("reference")(engine)
        core.add_request(1, engine.encode_prompt("Once upon a time"), spec_params(params, method), Timeline(),
                         constraint=compiled.constraint())
        toks = []
        while core.has_unfinished():
            toks += [t for o in core.step().rows for t in o.token_ids]
        out[method] = toks
        assert core.stats().num_spec_proposed == 0
    assert out["ngram"] == out["off"] and out["off"]


def test_proposals_never_pass_max_tokens_or_the_context(stories):
    engine = stories["fp32"]
    core = builder("cpu")(engine, max_model_len=40, speculative="ngram", num_speculative_tokens=8)
    prompt = engine.encode_prompt("Once upon a time")
    core.add_request(1, prompt, SamplingParams(temperature=0.0, max_tokens=7), Timeline())
    core.add_request(2, prompt, SamplingParams(temperature=0.0), Timeline())
    got = generate(core, [])
    assert len(got[1][0]) == 7 and len(prompt) + len(got[2][0]) == 40
    plain = generate(builder("cpu")(engine, max_model_len=40),
                     [(1, prompt, SamplingParams(temperature=0.0, max_tokens=7)), (2, prompt, SamplingParams(temperature=0.0))])
    assert got == plain


# ------------------------------------------------------------------ sampling: the distribution


def test_seeded_sampling_with_speculation_repeats_and_is_sampling_itself(stories, build):
    engine = stories["int4"]
    ps = prompts(engine, 8)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s, max_tokens=64, ignore_eos=True)
              for t, p, k, s in [(0.7, 1.0, 0, 1), (1.0, 0.9, 0, 2), (1.3, 1.0, 30, 3), (0.5, 0.8, 10, 4)] * 2]
    reqs = [(i, p, spec_params(q)) for i, (p, q) in enumerate(zip(ps, params))]
    core = build(engine, speculative="ngram")
    first = generate(core, reqs)
    assert core.stats().num_spec_accepted > 0
    assert generate(build(engine, speculative="ngram"), reqs) == first
    # the coupling of core/speculative.py rule 3: the same draws as sampling one token a step
    assert generate(build(engine), [(i, p, spec_params(q, "off")) for i, p, q in reqs]) == first


# ------------------------------------------------------------------ the parts


def request(prompt, output=()):
    from tokenwire.core.request import Request
    from tokenwire.core.speculative import SpecState
    req = Request(1, list(prompt), SamplingParams(), Timeline(), seed=0, priority=0, arrival_seq=0,
                  max_model_len=1000, stop_token_ids=frozenset(), text_stream=None)
    req.output_token_ids.extend(output)
    req.spec = SpecState(None, 4)
    return req


def test_ngram_proposes_what_followed_the_longest_latest_match():
    from tokenwire.core.speculative import NgramProposer
    ngram = NgramProposer(min_n=2, max_n=4)
    assert ngram.propose(request([1, 2, 3, 4, 9, 1, 2, 3]), 4) == [4, 9, 1, 2]       # 3 tokens matched
    assert ngram.propose(request([5, 6, 7, 5, 6, 8, 5, 6]), 3) == [8, 5, 6]          # the latest of two
    assert ngram.propose(request([7, 1, 2, 7, 3, 1, 2]), 4) == [7, 3, 1, 2]          # (1, 2), not (7,)
    assert ngram.propose(request([1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]                # copied on past the end
    assert ngram.propose(request([1, 2, 3, 4]), 4) == []
    req = request([4, 5, 6, 7], [8])                                                  # grows with the output
    assert ngram.propose(req, 2) == []
    req.output_token_ids += [4, 5]
    assert ngram.propose(req, 3) == [6, 7, 8]
    req.output_token_ids += [9, 4, 5]
    assert ngram.propose(req, 2) == [9, 4]


def test_adaptive_k_weighs_acceptance_against_what_verifying_costs():
    from tokenwire.core.speculative import FIRST_PAUSE, SpecState, StepCosts
    spec = SpecState(object(), 8)
    assert spec.next_k((0.0, 0.0)) == 8 and spec.next_k((0.5, 0.2)) == 8   # nothing rejected yet
    for _ in range(8):
        spec.record(4, 2)                                           # kept 2 of 3 decided: r ~ 2/3
    ks = [spec.next_k((0.0, cost)) for cost in (0.0, 0.05, 0.15, 0.3)]
    assert ks[0] == 8 and ks == sorted(ks, reverse=True) and 0 < ks[-1] < 8
    assert spec.next_k((0.3, 0.05)) > spec.next_k((0.0, 0.3))       # a fixed part favours more rows
    for _ in range(12):
        spec.record(1, 0)
    assert spec.next_k((0.0, 0.3)) == 0 and spec.num_paused == FIRST_PAUSE      # nothing pays: a pause
    assert spec.next_k((0.0, 0.3)) == 1                             # then a probe of one token
    spec.record(1, 0)
    assert spec.next_k((0.0, 0.3)) == 0 and spec.num_paused == 2 * FIRST_PAUSE  # the next pause is longer
    assert spec.next_k((0.0, 0.3)) == 1                             # the probe
    for _ in range(6):
        spec.record(4, 4)
    assert spec.next_k((0.0, 0.3)) > 0 and spec.pause == FIRST_PAUSE   # it pays again: the next pause is shorter
    assert (spec.num_proposed, spec.num_accepted) == (8 * 4 + 12 + 1 + 6 * 4, 8 * 2 + 6 * 4)
    costs = StepCosts()
    assert costs.row_costs(1) == (0.0, 0.0)
    for _ in range(20):
        costs.observe(1, 0, 0, 1000)
        costs.observe(1, 2, 0, 1000 + 600 + 2 * 400)                   # a fixed 600 and 400 a row
        costs.observe(16, 0, 0, 4000)
    assert costs.row_costs(1) == pytest.approx((0.0, 0.7))          # one row count seen: proportional
    for _ in range(20):
        costs.observe(1, 4, 0, 1000 + 600 + 4 * 400)
    assert costs.row_costs(1) == pytest.approx((0.6, 0.4)) and costs.row_costs(16) == (0.0, 0.0)


# ------------------------------------------------------------------ the CUDA executor (fake driver)


def test_cuda_executor_verifies_speculated_rows_through_its_prefill_path():
    """The CUDA executor's eager (prefill) path takes a speculating sequence's 1 + k rows and
    samples each on the device (kernels/cuda/fake.py runs its numpy twins here)."""
    from tokenizers import Tokenizer
    from test_cuda_executor_fake import make, tiny_config as cuda_config, tiny_engine
    from tokenwire.core.engine_core import EngineCore
    from tokenwire.core.speculative import Speculator
    from spec_engines import word_tokenizer
    c = cuda_config()
    tensors = tiny_engine(c)
    tokenizer = Tokenizer.from_str(word_tokenizer(c.vocab_size).files["tokenizer.json"].decode())

    def core(speculate: bool, scripted=None):
        executor = make(c, tensors, max_num_seqs=8, max_num_batched_tokens=64)
        spec = Speculator("ngram", 4, max_rows=executor.max_sample_rows) if speculate else None
        if spec is not None:
            spec.costs = FixedCosts()
        engine = EngineCore(executor, tokenizer, eos_token_ids=[2], max_model_len=128, max_num_seqs=4,
                            max_num_batched_tokens=64, speculator=spec)
        if scripted is not None:
            spec.proposers["ngram"] = scripted
        return engine

    rng = np.random.default_rng(5)
    ps = [[int(t) for t in rng.integers(3, c.vocab_size, 6)] * 3 for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2, logprobs=2),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=8, seed=4, max_tokens=30, ignore_eos=True)]
    reqs = [(i, p, q) for i, (p, q) in enumerate(zip(ps, params))]
    plain = generate(core(False), reqs)
    ngram = core(True)
    assert generate(ngram, reqs) == plain
    scripted = core(True, ScriptedProposer({i: plain[i][0] for i in plain}, 0.3, c.vocab_size))
    assert generate(scripted, reqs) == plain
    assert 0 < scripted.stats().num_spec_accepted < scripted.stats().num_spec_proposed
