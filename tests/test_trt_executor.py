"""The TensorRT executor (kernels/trt/).

Host-side, without TensorRT or a GPU: the executor over kernels/cuda/fake.py's driver and
kernels/trt/fake.py's engine (the exported ONNX graph on onnxruntime, reading and writing
the fake device memory at the addresses the executor binds). These check the executor's own
work: KV rows, staging offsets, decode buckets and idle rows, prefill chunks beside decodes,
the ring, graph replay, host sampling, and the stories260K golden through it.

With TensorRT and a GPU (`gpu` marker, skipped with the reason otherwise): the stories260K
golden through real TensorRT engines built from the export."""

import json

import numpy as np
import pytest

from tokenwire.core.executor import SeqStep
from tokenwire.kernels.model import ReferenceModel, greedy_generate, sequence_logits
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.kernels.trt.onnx_export import OnnxExportOptions, export_onnx, read_export
from tokenwire.engine_build.quantize import QuantOptions, quantize_model
from tokenwire.kernels.cuda.fake import FakeDriver

from tokenwire.kernels.trt.executor import TrtExecutor, TrtOptions
from tokenwire.kernels.trt.fake import FakeTrtEngine      # onnxruntime, imported when a fake engine is made

GREEDY = SamplingParams(temperature=0.0)
MAX_LEN = 258                     # 257 tokens per sequence (run.c run 1: 5 + 252) + the scratch position


@pytest.fixture(scope="module")
def stories(stories260k_dir, tmp_path_factory):
    from tokenwire.engine_build.llama2c import import_llama2c
    src = import_llama2c(stories260k_dir / "stories260K.bin")
    reference = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    fp = quantize_model(src.config, src.tensors, QuantOptions(method="none"))[0]
    int4 = quantize_model(src.config, src.tensors, QuantOptions(algorithm="rtn"))[0]
    exports = {}
    for name, tensors in (("fp", fp), ("int4", int4)):
        exports[name] = tmp_path_factory.mktemp(f"onnx_{name}")
        export_onnx(src.config, tensors, exports[name], OnnxExportOptions(max_len=MAX_LEN))
    return src, reference, {"fp": fp, "int4": int4}, exports


def make_executor(config, export_dir, drv=None, **options):
    drv = drv or FakeDriver()
    options = {"max_batch": 4, "max_num_tokens": 64, **options}
    return TrtExecutor(config, TrtOptions(**options), manifest=read_export(export_dir),
                       engine_fn=lambda graph, profile, device: FakeTrtEngine(export_dir, graph, drv), driver=drv)


def step(seq_id, ids, start, row, sample=True, sampling=GREEDY, out=()):
    return SeqStep(seq_id, list(ids), start, [row], sample, sampling, 7, [], list(out))


def run_greedy(ex, prompt, num_new, row=0, chunk=None):
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        out = ex.step([step(0, part, start, row, sample=start + chunk >= len(prompt))]).token_ids
    ids = [out[0]]
    for k in range(num_new - 1):
        ids.append(ex.step([step(0, [ids[-1]], len(prompt) + k, row)]).token_ids[0])
    return ids


# ------------------------------------------------------------ the golden

def test_stories260k_unquantized_reproduces_run_c(stories):
    src, reference, _, exports = stories
    want = reference["runs"][1]["generated_token_ids"]
    ex = make_executor(src.config, exports["fp"])
    assert run_greedy(ex, reference["prompt_token_ids"], len(want), row=3) == want
    assert set(ex.decode_contexts) == {4} and ex.drv.count("graph_launch") == len(want) - 1


def test_stories260k_int4_matches_the_reference_with_chunked_prefill(stories):
    src, reference, tensors, exports = stories
    prompt = reference["prompt_token_ids"]
    want = greedy_generate(ReferenceModel(src.config, tensors["int4"]), prompt, 64)
    assert run_greedy(make_executor(src.config, exports["int4"]), prompt, 64, row=1, chunk=3) == want


def test_staggered_sequences_in_scattered_rows(stories):
    """Three copies join at steps 0, 3 and 7, prefilling in chunks of 2 beside the others'
    decode tokens, in rows 3, 0 and 2: each reproduces the reference alone."""
    src, reference, tensors, exports = stories
    prompt, num_new = reference["prompt_token_ids"], 24
    want = greedy_generate(ReferenceModel(src.config, tensors["int4"]), prompt, num_new)
    ex = make_executor(src.config, exports["int4"])
    rows, joins = [3, 0, 2], [0, 3, 7]
    state = [{"fed": 0, "out": []} for _ in rows]
    for t in range(200):
        seqs, owners = [], []
        for k, st in enumerate(state):
            if t < joins[k] or len(st["out"]) == num_new:
                continue
            if st["fed"] < len(prompt):
                part = prompt[st["fed"]:st["fed"] + 2]
                seqs.append(step(k, part, st["fed"], rows[k], sample=st["fed"] + 2 >= len(prompt)))
                st["fed"] += len(part)
            else:
                seqs.append(step(k, [st["out"][-1]], len(prompt) + len(st["out"]) - 1, rows[k]))
            owners.append(k)
        if not seqs:
            break
        ids = iter(ex.step(seqs).token_ids)
        for s, k in zip(seqs, owners):
            if s.sample:
                state[k]["out"].append(next(ids))
    assert [st["out"] for st in state] == [want] * 3


def test_logprobs_are_sampled_on_the_host_from_the_engine_logits(stories):
    src, reference, tensors, exports = stories
    prompt = reference["prompt_token_ids"][:6]
    ex = make_executor(src.config, exports["int4"])
    with_logprobs = SamplingParams(temperature=0.0, logprobs=3)
    out = ex.step([step(0, prompt, 0, 0, sampling=with_logprobs)])
    logits = sequence_logits(ReferenceModel(src.config, tensors["int4"]), prompt)[-1]
    assert out.token_ids == [int(np.argmax(logits))]
    top = out.logprobs[0]
    assert top.top_ids == list(np.argsort(-logits)[:3])
    want_lp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    np.testing.assert_allclose(top.top_logprobs, want_lp[top.top_ids], atol=1e-3)


# ------------------------------------------------------------ the ring and the stream

def test_launch_returns_before_the_engine_ran_and_on_ready_fires(stories):
    src, reference, _, exports = stories
    drv = FakeDriver(deferred=True)
    ex = make_executor(src.config, exports["int4"], drv=drv, use_graphs=False)
    ready = []
    ex.on_ready = ready.append
    engine = ex.prefill_engine
    handle = ex.launch([step(0, reference["prompt_token_ids"][:5], 0, 0)])
    assert engine.num_enqueued == 0 and ready == []            # queued, not run
    second = ex.launch([step(1, reference["prompt_token_ids"][:4], 0, 1)])
    with pytest.raises(RuntimeError, match="launch order"):
        ex.collect(second)
    assert len(ex.collect(handle).token_ids) == 1 and engine.num_enqueued >= 1
    assert len(ex.collect(second).token_ids) == 1
    drv.run_pending()                                          # the host function queued after `ready`
    assert ready == [0, 1]


def test_bad_steps_are_refused_with_their_problem_named(stories):
    src, _, _, exports = stories
    ex = make_executor(src.config, exports["int4"])
    with pytest.raises(ValueError, match="KV capacity"):
        ex.step([step(0, [1], MAX_LEN - 1, 0)])
    with pytest.raises(ValueError, match="out of range"):
        ex.step([step(0, [src.config.vocab_size], 0, 0)])
    with pytest.raises(ValueError, match="no KV row"):
        ex.step([step(0, [1, 2], 0, 4)])
    with pytest.raises(ValueError, match="max_num_tokens"):
        ex.step([step(0, [1] * 65, 0, 0)])
    ex.close()


def test_create_executor_exports_once_and_reuses_it(tmp_path, stories260k_dir, monkeypatch):
    from tokenwire.cli import main
    from tokenwire.core.options import EngineOptions
    from tokenwire.kernels.engine_format import load_engine
    from tokenwire.kernels.trt import create_executor
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    engine = tmp_path / "engine"
    assert main(["build", str(stories260k_dir / "stories260K.bin"), "-o", str(engine), "--quiet", "--no-eval",
                 "--algorithm", "rtn"]) == 0
    drv = FakeDriver()
    made = []
    exports = tmp_path / "cache" / "trt" / "onnx"

    def engine_fn(graph, profile, device):         # the export exists by the time engines are asked for
        made.append((graph, profile, device))
        [export] = sorted(exports.iterdir())
        return FakeTrtEngine(export, graph, drv)
    engine = load_engine(engine)
    two = EngineOptions(max_num_seqs=2)
    ex = create_executor(engine, two, 64, driver=drv, engine_fn=engine_fn)
    assert ex.block_size == 127 and ex.num_blocks == 2           # 64 + scratch, rounded up to 64 positions
    [export] = sorted(exports.iterdir())
    assert read_export(export)["max_len"] == 128
    assert [m[0] for m in made] == ["decode", "prefill"] and made[0][2]["name"] == "Fake GPU"
    assert made[0][1]["input_ids"] == ((1, 1), (2, 1), (2, 1))
    mtime = (export / "weights.bin").stat().st_mtime_ns
    create_executor(engine, two, 64, driver=drv, engine_fn=engine_fn)
    assert sorted(exports.iterdir()) == [export] and (export / "weights.bin").stat().st_mtime_ns == mtime
    # rows are what the memory holds: one whole context each
    with pytest.raises(ValueError, match="lower --max-model-len"):     # no room for one context
        create_executor(engine, two, 64, driver=FakeDriver(total_memory=1 << 18), engine_fn=engine_fn)
    small = create_executor(engine, EngineOptions(max_num_seqs=256), 64, driver=FakeDriver(total_memory=8 << 20),
                            engine_fn=engine_fn)
    per_row = 2 * 5 * 4 * 128 * 8 * 4                           # layers, kv heads, positions, head dim, fp32
    assert 1 <= small.num_blocks < 256 and small.num_blocks * per_row <= 8 << 20


# ------------------------------------------------------------ real TensorRT

def tensorrt_reason():
    try:
        from tokenwire.kernels.trt.engine import import_tensorrt
        import_tensorrt()
    except Exception as exc:
        return str(exc)
    return None


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_reason() is not None, reason=f"TensorRT: {tensorrt_reason()}")
def test_stories260k_golden_on_tensorrt(stories, tmp_path):
    from tokenwire.kernels.trt.engine import TrtEngine, engine_plan
    src, reference, tensors, exports = stories
    manifest = read_export(exports["fp"])
    want = reference["runs"][1]["generated_token_ids"]

    def engine_fn(graph, profile, device):
        return TrtEngine(engine_plan(exports["fp"], manifest, graph, profile, device, tmp_path))
    ex = TrtExecutor(src.config, TrtOptions(max_batch=4, max_num_tokens=64), manifest=manifest,
                     engine_fn=engine_fn)
    assert run_greedy(ex, reference["prompt_token_ids"], len(want), row=2) == want
    ex.close()
    assert len(list(tmp_path.glob("*.plan"))) == 2            # cached: a second executor builds nothing


# ------------------------------------------------------------ the benchmark

def test_bench_engine_trt_runs_end_to_end_on_the_fake(tmp_path, monkeypatch, capsys):
    """The rows `tokenwire bench engine --backend trt` prints; the figures themselves need a GPU."""
    import argparse

    from tokenwire.bench import engine, engine_trt, shapes
    monkeypatch.setitem(shapes.SHAPES_CUDA, "tiny", dict(
        architecture="LlamaForCausalLM", vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0))
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    args = parser.parse_args(["--backend", "trt", "--shape", "tiny", "--batch", "1,3", "--steps", "3",
                              "--context", "20", "--prompt-len", "16", "--json", str(tmp_path / "rows.json")])
    drv = FakeDriver(total_memory=1 << 30)
    assert engine_trt.run(args, driver=drv, engine_factory=lambda d: lambda g, p, dev: FakeTrtEngine(d, g, drv)) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["batch"] for r in rows] == [1, 3] and all(r["backend"] == "trt" and r["graph"] for r in rows)
    assert all(r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in rows)
    assert "on TensorRT" in capsys.readouterr().out


def test_bench_engine_trt_without_tensorrt_says_why():
    import argparse

    from tokenwire.bench import engine
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    if tensorrt_reason() is None:
        pytest.skip("TensorRT is importable here")
    with pytest.raises(SystemExit, match="backend trt"):
        engine.run(parser.parse_args(["--backend", "trt", "--shape", "llama-3.2-1b"]))


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_reason() is not None, reason=f"TensorRT: {tensorrt_reason()}")
@pytest.mark.parametrize("matmul_dtype", ["float32", "float16"])
def test_stories260k_int4_on_tensorrt_matches_the_reference(stories, tmp_path, matmul_dtype):
    """The INT4 path TensorRT is for: blocked DequantizeLinear into MatMul (float16: its W4A16 GEMMs)."""
    from tokenwire.kernels.trt.engine import TrtEngine, engine_plan
    src, reference, tensors, _ = stories
    export = tmp_path / "onnx"
    export_onnx(src.config, tensors["int4"], export, OnnxExportOptions(max_len=MAX_LEN, matmul_dtype=matmul_dtype))
    manifest = read_export(export)
    prompt = reference["prompt_token_ids"]
    want = greedy_generate(ReferenceModel(src.config, tensors["int4"]), prompt, 64)

    def engine_fn(graph, profile, device):
        return TrtEngine(engine_plan(export, manifest, graph, profile, device, tmp_path / "plans"))
    ex = TrtExecutor(src.config, TrtOptions(max_batch=4, max_num_tokens=64), manifest=manifest,
                     engine_fn=engine_fn)
    got = run_greedy(ex, prompt, 64, row=1, chunk=3)
    ex.close()
    agree = sum(a == b for a, b in zip(got, want))
    assert got == want if matmul_dtype == "float32" else agree >= 48, (agree, got, want)


def test_serve_backend_trt_without_the_gpu_stack_says_why(tmp_path, stories260k_dir, monkeypatch):
    """`tokenwire serve --backend trt` where cuda-python or TensorRT is missing: a ValueError naming
    what is missing (the server logs it), and nothing exported."""
    from tokenwire.cli import main
    from tokenwire.core.options import EngineOptions
    from tokenwire.runtime import build_engine
    if tensorrt_reason() is None:
        pytest.skip("TensorRT is importable here")
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "cache"))
    engine = tmp_path / "engine"
    assert main(["build", str(stories260k_dir / "stories260K.bin"), "-o", str(engine), "--quiet", "--no-eval",
                 "--algorithm", "rtn"]) == 0
    with pytest.raises(ValueError, match="the trt backend is not available: .*(cuda-python|TensorRT)"):
        build_engine(EngineOptions(model=str(engine), backend="trt"))
    assert not (tmp_path / "cache" / "trt").exists()
