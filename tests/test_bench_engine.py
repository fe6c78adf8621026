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
