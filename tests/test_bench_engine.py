"""`tokenwire bench engine` end to end on a toy shape (the real shapes take minutes): the
printed table and the JSON rows carry measured, self-consistent figures; the random engine
is a valid engine of the requested shape; bad arguments fail with a message."""

import json
import os
import statistics

import numpy as np
import pytest

from tokenwire.bench import engine as bench
from tokenwire.bench import shapes
from tokenwire.cli import main
from tokenwire.core.config import ModelConfig
from tokenwire.kernels.model import ReferenceModel
from tokenwire.kernels.engine_format import linear_shapes
from tokenwire.kernels.reference import dequantize_int4
from tokenwire.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason=f"C kernels not built: {cpu.IMPORT_ERROR}")

TOY = dict(architecture="Qwen2ForCausalLM", vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2,
           num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
           rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True)
KEYS = {"shape", "backend", "batch", "threads", "decode_tokens_per_s", "prefill_tokens_per_s", "weight_bytes_per_token",
        "read_bandwidth_bytes_per_s", "roofline_fraction"}


@pytest.fixture
def toy_shape(monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "toy", TOY)
    monkeypatch.setattr(bench, "LARGE_PROBE_BYTES", 32 << 20)
    threads = cpu.num_threads()
    yield "toy"
    cpu.set_num_threads(threads)


def test_bench_prints_and_writes_rows_against_the_roofline(toy_shape, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "engine", "--shape", "toy", "--batch", "1,3", "--threads", "2", "--steps", "3",
                 "--prompt-len", "5", "--probe-reps", "3", "--repeat", "2", "--profile", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "read bandwidth: streaming read on 2 threads" in text and "the row's roofline" in text
    assert "batch 3 decodes" in text
    assert text.count("profile: ") == 4 and "down_proj" in text and "attention" in text
    rows = json.loads(out.read_text())
    assert [(r["activations"], r["batch"]) for r in rows] == [("fp32", 1), ("fp32", 3), ("int8", 1), ("int8", 3)]
    model = bench.CpuBackend(None).build(ModelConfig.from_dict(TOY), shapes.random_engine(
        ModelConfig.from_dict(TOY), 64, "int4"), 16, 4, "fp32")
    for r in rows:
        assert KEYS <= set(r)
        assert r["shape"] == "toy" and r["backend"] == "cpu" and r["threads"] == 2
        assert r["weight_bytes_per_step"] == model.weight_bytes_per_token
        assert r["weight_bytes_per_token"] == pytest.approx(r["weight_bytes_per_step"] / r["batch"])
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["read_bandwidth_bytes_per_s"] > 1e6        # any working probe (60 MB/s seen with both cores busy)
        # the fraction is exactly the roofline step time over the measured one
        roofline_s = r["weight_bytes_per_step"] / r["read_bandwidth_bytes_per_s"]
        assert r["roofline_fraction"] == pytest.approx(roofline_s / (r["decode_step_ms"] / 1e3))
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] / (r["decode_step_ms"] / 1e3))


@pytest.mark.parametrize("embedding", ["fp16", "int8", "int4"])
def test_random_engine_is_a_valid_engine_of_the_shape(embedding):
    config = ModelConfig.from_dict(TOY)
    tensors = shapes.random_engine(config, 32, embedding)
    assert tensors["layers.1.gate_up_proj.qweight"].shape == (512, 64)
    assert tensors["layers.0.qkv_proj.scales"].shape == (256, 4)
    assert ("embed.weight" in tensors) == (embedding == "fp16") and "lm_head.qweight" not in tensors
    reference = ReferenceModel(config, tensors, block_size=4, num_blocks=4)     # decodes every tensor
    assert reference.layers[0].qkv_proj.shape == linear_shapes(config)["layers.0.qkv_proj"]
    assert np.all(np.isfinite(reference.embed))


def test_every_published_shape_is_a_valid_config():
    for name, fields in shapes.SHAPES.items():
        config = ModelConfig.from_dict(fields)
        assert config.q_size + 2 * config.kv_size > config.hidden_size, name


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0,2"], "--batch must be positive integers"),
    (["--activations", "fp16"], "--activations must be from"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--steps", "0"], "must be >= 1"),
])
def test_bad_arguments_are_named(toy_shape, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "engine", "--shape", "toy", *argv])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--contend needs 2 CPUs")
def test_contend_times_quiet_and_contended_pairs_and_stops_its_busy_loop(toy_shape, tmp_path, capsys, monkeypatch):
    started = []
    real = bench.BusyLoop.__init__

    def spy(self):
        real(self)
        started.append(self.proc)
    monkeypatch.setattr(bench.BusyLoop, "__init__", spy)
    out = tmp_path / "rows.json"
    assert main(["bench", "engine", "--shape", "toy", "--batch", "1", "--activations", "fp32", "--steps", "3",
                 "--prompt-len", "5", "--repeat", "2", "--contend", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "quiet vs contended" in text and "pinned to CPU" in text
    (row,) = json.loads(out.read_text())
    assert len(row["quiet_tokens_per_s"]) == len(row["contended_tokens_per_s"]) == 2
    assert min(row["quiet_tokens_per_s"] + row["contended_tokens_per_s"]) > 0
    assert row["ratio"] == pytest.approx(statistics.median(row["contended_tokens_per_s"])
                                         / statistics.median(row["quiet_tokens_per_s"]))
    assert len(started) == 1 and started[0].poll() is not None          # the busy loop is gone


# ------------------------------------------------------------------ --vs llama.cpp

TINY_LLAMA = dict(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def test_vs_llama_builds_one_gguf_that_tokenwire_imports_with_its_own_q4_0_codes(tmp_path):
    """The comparison's premise: tokenwire's engine holds the GGUF's Q4_0 blocks as they are (group
    32, the same 4-bit codes), so both sides read the same weights; and it decodes."""
    gguf = pytest.importorskip("gguf")
    from tokenwire.bench import vs_llama
    from tokenwire.bench.forward_timing import bench_prompt
    from tokenwire.kernels.engine_format import load_engine
    config = ModelConfig.from_dict(TINY_LLAMA)
    path, engine_dir = vs_llama.build_pair(config, "tiny", tmp_path, log=lambda line: None)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_0" and types["token_embd.weight"] == "Q4_0"
    engine = load_engine(engine_dir)
    assert engine.manifest["quantization"]["group_size"] == 32
    assert (engine.config.hidden_size, engine.config.num_layers, engine.config.vocab_size) == (64, 2, 320)
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = np.asarray(gguf.quants.dequantize(down.data, down.tensor_type), np.float32).reshape(64, 128)
    t = engine.tensors
    got = dequantize_int4(t["layers.0.down_proj.qweight"], t["layers.0.down_proj.scales"],
                          t["layers.0.down_proj.zeros"], 128)
    np.testing.assert_array_equal(got, want)            # the very codes and scales, not a re-quantization
    tw = vs_llama.Tokenwire(engine_dir, "int8", context=40, max_batch=2)
    r = tw.time_batch(2, bench_prompt(config, 2, 16), 3)
    assert r["prefill_tokens_per_s"] > 0 and len(r["step_s"]) == 3


def test_vs_llama_without_llama_cpp_python_says_how_to_get_it(monkeypatch, capsys):
    from tokenwire.bench import vs_llama
    monkeypatch.setattr(vs_llama, "llama_cpp", None)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--vs", "llama.cpp"])
    assert "llama-cpp-python" in str(exc.value) and "tokenwire[llama]" in str(exc.value)
