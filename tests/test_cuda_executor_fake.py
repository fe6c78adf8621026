"""CudaExecutor's host-side orchestration against the fake driver (CPU only).

kernels/cuda/fake.py runs every kernel as a numpy twin, so these tests check what the host
does — pointers, strides, grids, graph capture and replay, the pinned ring, events, the
sampler's parameters — end to end against kernels/model.py and the CPU executor, and they
check the call log for the backend's rules: memory allocated once, one graph per bucket,
`launch` never blocks, no synchronize while stepping.
"""

import math

import numpy as np
import pytest

from tokenwire.core.config import ModelConfig
from tokenwire.core.executor import SeqStep
from tokenwire.kernels.model import ReferenceModel, greedy_generate
from tokenwire.kernels.engine_format import linear_shapes, vector_shapes
from tokenwire.kernels.model_runner import ModelRunner
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.engine_build.quantize import quantize_int4, quantize_int8
from tokenwire.core.options import EngineOptions
from tokenwire.kernels.cuda import create_executor
from tokenwire.kernels.cuda.executor import CudaExecutor, CudaOptions
from tokenwire.kernels.cuda.fake import FakeDriver

GREEDY = SamplingParams(temperature=0.0)
NO_IMAGE = lambda arch: b"fake cubin"      # noqa: E731  the fake driver loads anything


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_engine(c: ModelConfig, group_size=32, embed="fp16", seed=0) -> dict:
    """Random weights in the engine encodings: int4 matrices, the embedding as asked."""
    rng = np.random.default_rng(seed)
    t = {}
    for name, shape in linear_shapes(c).items():
        w = (rng.standard_normal(shape) / math.sqrt(shape[1]) * 2).astype(np.float32)
        if name == "embed" and embed in ("fp16", "fp32"):
            t["embed.weight"] = w.astype(np.float16 if embed == "fp16" else np.float32)
        elif name == "embed" and embed == "int8":
            t.update({f"embed.{k}": v for k, v in quantize_int8(w).items()})
        else:
            t.update({f"{name}.{k}": v for k, v in quantize_int4(w, group_size, symmetric=False).items()})
    for name, shape in vector_shapes(c).items():
        t[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return t


def make(c, t, driver=None, **options) -> CudaExecutor:
    opts = dict(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128, split_size=32)
    opts.update(options)
    return CudaExecutor(c, t, CudaOptions(**opts), driver=driver or FakeDriver(), image_fn=NO_IMAGE)


def run_greedy(executor, prompt, num_tokens, block_size=16, first_block=0, seq_id=0) -> list:
    out, feed, start = [], list(prompt), 0
    for _ in range(num_tokens):
        end = start + len(feed)
        blocks = list(range(first_block, first_block + -(-end // block_size)))
        step = SeqStep(seq_id, feed, start, blocks, True, GREEDY, 0, list(prompt), list(out))
        tok = executor.step([step]).token_ids[0]
        out.append(tok)
        start, feed = end, [tok]
    return out


class Seq:
    """A request as the scheduler would carry it: fixed blocks, prompt, outputs."""

    def __init__(self, seq_id, prompt, params, seed, first_block, block_size=16, blocks=8):
        self.seq_id, self.prompt, self.params, self.seed = seq_id, list(prompt), params, seed
        self.blocks = list(range(first_block, first_block + blocks))
        self.out, self.done = [], 0

    def step(self) -> SeqStep:
        feed = self.prompt if not self.out else self.out[-1:]
        return SeqStep(self.seq_id, list(feed), self.done, self.blocks, True, self.params, self.seed,
                       self.prompt, list(self.out))

    def advance(self, tok):
        self.done += len(self.prompt) if not self.out else 1
        self.out.append(tok)


def run_batch(executor, seqs, num_steps) -> list:
    outs = []
    for _ in range(num_steps):
        steps = [s.step() for s in seqs]
        res = executor.step(steps)
        for s, tok in zip(seqs, res.token_ids):
            s.advance(tok)
        outs.append(res)
    return outs


# ------------------------------------------------------------------ numbers end to end

@pytest.mark.parametrize("overrides,engine", [
    ({}, {}),
    (dict(num_kv_heads=1), dict(group_size=64, embed="int8")),                       # MQA
    (dict(qkv_bias=True, tie_word_embeddings=True), dict(group_size=128, embed="fp32")),
    (dict(activation="gelu_tanh", embedding_multiplier=8.0, num_kv_heads=4), dict(embed="int4")),
    (dict(sliding_window=12), {}),
    (dict(num_heads=8, num_kv_heads=2, head_dim=8), {}),
    (dict(qk_norm=True, rope_theta=1e6), {}),                                       # Qwen3
    # Gemma 2: windows of 12 (< the 40-token prompt) on even layers, soft caps, scale, sandwich norms
    (dict(activation="gelu_tanh", embedding_multiplier=8.0, post_norms=True, attn_scale=0.3, attn_logit_softcap=3.0,
          final_logit_softcap=8.0, sliding_window=12, sliding_layers=(True, False)), dict(embed="int4")),
    # Gemma 3: q/k norms, sandwich norms, the sliding layer's own RoPE base
    (dict(activation="gelu_tanh", qk_norm=True, post_norms=True, sliding_window=12, sliding_layers=(False, True),
          rope_theta=1e6, rope_local_theta=10000.0), {}),
])
def test_greedy_decode_matches_the_reference(overrides, engine):
    c = tiny_config(**overrides)
    t = tiny_engine(c, **engine)
    prompt = list(np.random.default_rng(1).integers(3, c.vocab_size, 40))     # crosses splits of 32 keys
    want = greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 30)
    assert run_greedy(make(c, t), prompt, 30) == want


def test_stories260k_greedy_matches_the_cpu_backend(stories260k_dir):
    from tokenwire.engine_build.build import open_source
    from tokenwire.engine_build.quantize import QuantOptions, quantize_model
    source = open_source(stories260k_dir / "stories260K.bin")
    tensors, _, _ = quantize_model(source.config, source.tensors, QuantOptions(algorithm="rtn"))
    prompt = [1, 403, 407, 261, 378]                                         # BOS "Once upon a time"
    cpu = ModelRunner(ReferenceModel(source.config, tensors, block_size=16, num_blocks=64), 16, 64)
    want = run_greedy(cpu, prompt, 100)
    got = run_greedy(make(source.config, tensors, max_num_batched_tokens=64, split_size=64), prompt, 100)
    assert got == want


def test_mixed_sampling_batch_matches_the_cpu_executor():
    c = tiny_config()
    t = tiny_engine(c)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.7, top_k=5, logprobs=3),
              SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=0.2),
              SamplingParams(temperature=0.0, logprobs=0)]
    rng = np.random.default_rng(3)

    def seqs():
        return [Seq(i, rng_prompt, p, seed=100 + i, first_block=8 * i)
                for i, (p, rng_prompt) in enumerate(zip(params, prompts))]
    prompts = [list(rng.integers(3, c.vocab_size, n)) for n in (5, 17, 33, 8, 21, 3)]
    cpu = ModelRunner(ReferenceModel(c, t, block_size=16, num_blocks=64), 16, 64)
    want = run_batch(cpu, seqs(), 12)
    got = run_batch(make(c, t), seqs(), 12)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    asked = [p.logprobs is not None for p in params]                 # rows 3 and 5
    for g, w in zip(got, want):
        assert [a is not None for a in g.logprobs] == [b is not None for b in w.logprobs] == asked
        for a, b in zip(g.logprobs, w.logprobs):
            if a is not None:
                assert a.top_ids == b.top_ids
                np.testing.assert_allclose([a.token_logprob, *a.top_logprobs], [b.token_logprob, *b.top_logprobs],
                                           rtol=1e-4, atol=1e-5)


def test_old_gpus_take_the_simt_path_and_fp16_cache_runs():
    c = tiny_config()
    t = tiny_engine(c, group_size=64)
    prompt = [5, 9, 13, 2, 77, 31, 4]
    want = greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 10)
    old = make(c, t, driver=FakeDriver(compute_capability=(7, 5)))
    assert old.matmul == "simt" and run_greedy(old, prompt, 10) == want
    half = make(c, t, kv_dtype="float16")
    assert run_greedy(half, prompt, 10) == want


# ------------------------------------------------------------------ the backend's rules

def test_memory_is_allocated_once_and_graphs_replay():
    c = tiny_config()
    t = tiny_engine(c)
    drv = FakeDriver()
    ex = make(c, t, driver=drv, capture_at_start=False)
    setup_calls = len(drv.calls)
    rng = np.random.default_rng(0)
    for batch in (1, 2, 3, 1, 2, 3, 4):
        seqs = [Seq(i, list(rng.integers(3, 90, 6)), GREEDY, 0, 8 * i) for i in range(batch)]
        run_batch(ex, seqs, 3)                        # one eager prefill, then two graph decodes
    stepping = [m for m, _ in drv.calls[setup_calls:]]
    for forbidden in ("mem_alloc", "host_alloc", "event_create", "stream_create"):
        assert forbidden not in stepping, f"{forbidden} while stepping"
    # buckets 1, 2, 4 captured once each (at first use), every decode step replays one
    assert stepping.count("begin_capture") == 3 and sorted(b for b, _ in ex.graphs) == [1, 2, 4]
    assert stepping.count("graph_launch") == 2 * 7
    # the only synchronizes are the three captures' warm-up runs
    assert stepping.count("stream_synchronize") == 3


def test_launch_returns_before_the_work_runs_and_the_ring_wraps():
    c = tiny_config()
    t = tiny_engine(c)
    prompt = [4, 8, 15, 16, 23, 42]
    want = greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 1)[0]
    drv = FakeDriver(deferred=True)
    ex = make(c, t, driver=drv, ring_slots=3)
    handles = []
    for i in range(3):                                # three independent prefills in flight
        before = len(drv.calls)
        handles.append(ex.launch([SeqStep(i, prompt, 0, [8 * i], True, GREEDY, 0, prompt, [])]))
        called = {m for m, _ in drv.calls[before:]}
        assert not called & {"stream_synchronize", "event_synchronize", "event_query"}
    assert [h.slot for h in handles] == [0, 1, 2]
    assert not drv.event_query(ex.ring[0].ready)      # nothing ran yet
    with pytest.raises(RuntimeError, match="ring slots"):
        ex.launch([SeqStep(9, prompt, 0, [40], True, GREEDY, 0, prompt, [])])
    with pytest.raises(RuntimeError, match="launch order"):
        ex.collect(handles[1])
    assert [ex.collect(h).token_ids for h in handles] == [[want]] * 3
    h = ex.launch([SeqStep(0, [want], 6, [0], True, GREEDY, 0, prompt, [want])])
    assert h.slot == 0 and h.graph
    ex.collect(h)


@pytest.mark.parametrize("wait", ["spin", "block"])
def test_wait_is_one_event_synchronize_and_no_host_callback(wait):
    """The engine thread waits in cuEventSynchronize (GIL released, kernels/cuda/driver.py),
    never in a Python loop over cuEventQuery, and no Python runs in a CUDA host callback."""
    c = tiny_config()
    t = tiny_engine(c)
    drv = FakeDriver(deferred=True)
    ex = make(c, t, driver=drv, wait=wait)
    assert all(e.blocking == (wait == "block") for s in ex.ring for e in (s.ready,))
    before = len(drv.calls)
    run_greedy(ex, [3, 4, 5], 3)
    called = [m for m, _ in drv.calls[before:]]
    assert called.count("event_synchronize") == 3
    assert not {"event_query", "stream_synchronize", "launch_host_func"} & set(called)


def test_pdl_is_passed_to_every_launch_and_needs_sm90():
    c = tiny_config()
    t = tiny_engine(c)

    class Recording(FakeDriver):
        flags = []

        def launch(self, *args, pdl=False):
            self.flags.append(pdl)
            return super().launch(*args, pdl=pdl)
    drv = Recording()
    run_greedy(make(c, t, driver=drv, pdl=True), [3, 4], 2)
    assert drv.flags and all(drv.flags)
    with pytest.raises(ValueError, match="sm_90"):
        make(c, t, driver=FakeDriver(compute_capability=(8, 0)), pdl=True)


def test_close_frees_all_device_memory():
    c = tiny_config()
    drv = FakeDriver()
    ex = make(c, tiny_engine(c), driver=drv)
    run_greedy(ex, [3, 4, 5], 2)
    ex.close()
    assert drv.used_memory == 0


def test_create_executor_takes_a_loaded_engine():
    class Engine:
        config = tiny_config()
        tensors = tiny_engine(config)
    options = EngineOptions(backend="cuda", num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    ex = create_executor(Engine(), options, driver=FakeDriver(), image_fn=NO_IMAGE)
    assert (ex.num_blocks, ex.block_size, ex.options.max_num_seqs) == (40, 16, 4)


# ------------------------------------------------------------------ bad input is named

@pytest.mark.parametrize("step,message", [
    (SeqStep(0, [500], 0, [0], True, GREEDY, 0, [], []), "token id .*out of range"),
    (SeqStep(0, [500], 3, [0], True, GREEDY, 0, [], []), "token id 500 out of range"),        # a graph step
    (SeqStep(0, [5], 3, [70], True, GREEDY, 0, [], []), "block id out of range"),
    (SeqStep(0, [1] * 40, 0, [0], True, GREEDY, 0, [], []), "KV blocks for 40 tokens"),
    (SeqStep(0, [1], 0, [99], True, GREEDY, 0, [], []), "block id out of range"),
    (SeqStep(0, [1] * 200, 0, list(range(13)), True, GREEDY, 0, [], []), "max_num_batched_tokens"),
    (SeqStep(0, [1], 300, list(range(19)), True, GREEDY, 0, [], []), "max_model_len"),
])
def test_bad_steps_are_rejected_with_the_problem_named(step, message):
    c = tiny_config()
    ex = make(c, tiny_engine(c))
    with pytest.raises(ValueError, match=message):
        ex.step([step])


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="kv_dtype"):
        CudaOptions(kv_dtype="int8")
    with pytest.raises(ValueError, match="split_size"):
        CudaOptions(split_size=100)
    c = tiny_config()
    with pytest.raises(ValueError, match="cannot hold one context"):
        make(c, tiny_engine(c), num_blocks=4)


def test_stepping_from_another_thread_binds_the_context_there():
    import threading
    c = tiny_config()
    drv = FakeDriver()
    ex = make(c, tiny_engine(c), driver=drv)
    done = []
    worker = threading.Thread(target=lambda: done.append(run_greedy(ex, [3, 4, 5], 2)))
    worker.start()
    worker.join()
    assert done and ("make_current", worker.ident) in drv.calls


def test_fractional_zero_points_take_the_simt_kernel():
    c = tiny_config()
    t = tiny_engine(c)
    t["layers.0.o_proj.zeros"] = (t["layers.0.o_proj.zeros"].astype(np.float32) + 0.5).astype(np.float16)
    ex = make(c, t)
    assert ex.weights.layers[0].o.kind == "int4_simt" and ex.weights.layers[0].qkv.kind == "int4_tc"
    prompt = [5, 9, 13, 2, 77]
    assert run_greedy(ex, prompt, 6) == greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 6)


def test_fp16_activations_run_the_fp16_kernels():
    c = tiny_config()
    drv = FakeDriver()
    ex = make(c, tiny_engine(c), driver=drv, activations="fp16")
    run_greedy(ex, [3, 4, 5, 6], 3)
    assert any(k.startswith("int4_mm_tc_h") for k in drv.launches)
    assert not any(k.startswith("int4_mm_tc_x") for k in drv.launches)


def test_a_tied_fp16_embedding_is_the_classifier_in_place():
    c = tiny_config(tie_word_embeddings=True)
    t = tiny_engine(c, embed="fp16")
    ex = make(c, t)
    assert ex.weights.lm_head.w == ex.weights.embed.table and ex.weights.lm_head.kind == "dense_f16"
    prompt = [5, 9, 13, 2, 77]
    assert run_greedy(ex, prompt, 6) == greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 6)


# ------------------------------------------------------------------ the fused decoder (forward.py)

def one_decode_step_kernels(ex, drv, prompt=(3, 4, 5, 6, 7)) -> list:
    """The kernels one greedy decode step runs (a graph replay), after a prefill."""
    first = run_greedy(ex, list(prompt), 1)[0]
    before = len(drv.launches)
    ex.step([SeqStep(0, [first], len(prompt), [0], True, GREEDY, 0, list(prompt), [first])])
    return drv.launches[before:]


def test_fused_decode_is_five_kernels_per_layer():
    c = tiny_config(head_dim=32, num_layers=3)
    drv = FakeDriver()
    ex = make(c, tiny_engine(c), driver=drv, max_model_len=64)
    assert ex.options.fused and ex.dev.pdl                  # both on by default (the fake is sm_90)
    assert all(l.qkv.rows == "rope" and l.gate_up.rows == "glu" for l in ex.weights.layers)
    kernels = one_decode_step_kernels(ex, drv)
    layer = ["int4_mm_tc_x4g32_rope_f32", "attention_paged_fused_f32", "int4_mm_tc_x4g32", "int4_mm_tc_x4g32_silu",
             "int4_mm_tc_x4g32"]
    assert kernels == ["embed_f16"] + layer * 3 + ["int4_mm_tc_x4g32_argmax"]


def test_unfused_reference_is_ten_kernels_per_layer():
    c = tiny_config(head_dim=32, num_layers=3)
    drv = FakeDriver()
    ex = make(c, tiny_engine(c), driver=drv, fused=False, pdl=False, max_model_len=64)
    assert all(l.qkv.rows == "plain" and l.gate_up.rows == "plain" for l in ex.weights.layers)
    kernels = one_decode_step_kernels(ex, drv)
    layer = ["rmsnorm", "int4_mm_tc_x4g32", "rope_kv_append_f32", "attention_paged_f32", "attention_combine",
             "int4_mm_tc_x4g32", "rmsnorm", "int4_mm_tc_x4g32", "glu_silu", "int4_mm_tc_x4g32"]
    assert kernels == ["embed_f16"] + layer * 3 + ["rmsnorm", "int4_mm_tc_x4g32", "argmax_rows"]


@pytest.mark.parametrize("overrides,options", [
    (dict(head_dim=32), {}),                                          # RoPE pairs 16 rows apart: a real reorder
    (dict(head_dim=64, qkv_bias=True), dict(kv_dtype="float16")),     # the bias follows the rows
    (dict(head_dim=32, activation="gelu_tanh", num_kv_heads=1), dict(activations="fp16")),
    (dict(head_dim=48, sliding_window=12), dict(use_graphs=False)),   # eager steps fuse too
])
def test_fused_decoder_matches_the_reference_and_the_unfused_kernels(overrides, options):
    c = tiny_config(**overrides)
    t = tiny_engine(c)
    prompt = list(np.random.default_rng(2).integers(3, c.vocab_size, 40))
    want = greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 20)
    drv = FakeDriver()
    assert run_greedy(make(c, t, driver=drv, **options), prompt, 20) == want
    assert any(k.endswith("_rope_f32") or k.endswith("_rope_f16") for k in drv.launches)
    assert run_greedy(make(c, t, fused=False, **options), prompt, 20) == want


def test_shapes_without_a_fused_order_take_the_unfused_kernels():
    c = tiny_config(head_dim=8, intermediate_size=100)               # hd % 16 and I % 8 rule the reorders out
    t = tiny_engine(c)
    drv = FakeDriver()
    ex = make(c, t, driver=drv)
    assert all(l.qkv.rows == "plain" and l.gate_up.rows == "plain" for l in ex.weights.layers)
    prompt = [5, 9, 13, 2, 77]
    assert run_greedy(ex, prompt, 6) == greedy_generate(ReferenceModel(c, t, block_size=16, num_blocks=64), prompt, 6)
    kernels = set(drv.launches)
    assert {"rope_kv_append_f32", "glu_silu", "attention_paged_fused_f32", "int4_mm_tc_x4g32_argmax"} <= kernels
    assert not any(k.endswith(("_rope_f32", "_silu")) and k.startswith("int4") for k in kernels)


def test_sampling_steps_keep_the_full_sampler():
    c = tiny_config(head_dim=32)
    drv = FakeDriver()
    ex = make(c, tiny_engine(c), driver=drv)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    ex.step([SeqStep(0, [3, 4, 5], 0, [0], True, params, 7, [3, 4, 5], [])])
    before = len(drv.launches)
    ex.step([SeqStep(0, [6], 3, [0], True, params, 7, [3, 4, 5], [6])])
    kernels = drv.launches[before:]
    assert kernels[-5:] == ["rmsnorm", "int4_mm_tc_x4g32", "apply_penalties", "sample_tokens", "compute_logprobs"]


@pytest.mark.parametrize("step_timing", [True, False])
def test_each_step_is_timed_on_the_device_for_the_cost_model(step_timing):
    """StepOutput.busy_ns: from an event recorded before the step's kernels to its `done` event
    (CudaOptions.step_timing), what the engine's cost model learns from; 0 without it."""
    c = tiny_config()
    t = tiny_engine(c)
    drv = FakeDriver(deferred=True)
    ex = make(c, t, driver=drv, step_timing=step_timing)
    prompt = [4, 8, 15, 16]
    h = ex.launch([SeqStep(0, prompt, 0, [0], True, GREEDY, 0, prompt, [])])
    slot = ex.ring[h.slot]
    out = ex.collect(h)
    if step_timing:
        assert slot.start is not None and slot.start.timing and slot.done.timing
        assert out.busy_ns == round((slot.done.time - slot.start.time) * 1e9) and out.busy_ns > 0
    else:
        assert slot.start is None and not slot.done.timing and out.busy_ns == 0
    num_slots, before = len(ex.ring), len(drv.calls)
    ex.close()                                          # the timing events are given back too
    assert [m for m, _ in drv.calls[before:]].count("event_destroy") == (3 if step_timing else 2) * num_slots
