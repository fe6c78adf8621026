"""The ONNX export (kernels/trt/onnx_export.py) run by onnxruntime on the CPU against the numpy
reference forward: logits to 1e-3 relative and greedy tokens equal for 64 steps, on
stories260K and on random models of every family and encoding; onnx.checker with full
checking; no operator outside the set TensorRT supports; the `export-onnx` command."""

import dataclasses
import json

import numpy as np
import onnx
import pytest

from tokenwire.cli import main
from tokenwire.kernels.model import ReferenceModel, greedy_generate, sequence_logits
from tokenwire.kernels.trt.onnx_check import TRT_OPS, OrtModel, trt_problems
from tokenwire.kernels.trt.onnx_export import OnnxExportOptions, export_onnx, read_export
from tokenwire.engine_build.quantize import QuantOptions, quantize_model

pytest.importorskip("onnxruntime")
from test_cpu_kernels_model import CONFIGS, ENCODINGS, engine_tensors  # noqa: E402

RTOL = 1e-3          # of the largest |logit|


def assert_logits_close(got, want):
    assert got.shape == want.shape
    err = float(np.max(np.abs(got - want)))
    assert err <= RTOL * float(np.max(np.abs(want))), f"max error {err:.3g}, largest logit {np.max(np.abs(want)):.3g}"


def exported(tmp_path, config, tensors, **options) -> OrtModel:
    export_onnx(config, tensors, tmp_path, OnnxExportOptions(max_len=64, **options))
    return OrtModel(tmp_path)


def reference_steps(config, tensors, prompts, num_decode):
    """Per prompt: the reference's prefill logits, then num_decode greedy decode logits. -> list of [1+n, V]"""
    out = []
    for prompt in prompts:
        model = ReferenceModel(config, tensors, block_size=4, num_blocks=32)
        ids = list(prompt)
        rows = []
        for _ in range(num_decode + 1):
            rows.append(sequence_logits(model, ids)[-1])
            ids.append(int(np.argmax(rows[-1])))
        out.append(np.stack(rows))
    return out


# ------------------------------------------------------------ every family and encoding

@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("family", CONFIGS)
def test_prefill_and_batched_decode_match_the_reference(tmp_path, family, encoding):
    """Two sequences prefilled (one in two chunks) into cache slots 2 and 0, then decoded together at
    different positions: every step's logits match the reference."""
    config = CONFIGS[family]
    tensors = engine_tensors(config, ENCODINGS[encoding])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (13, 6)]
    want = reference_steps(config, tensors, prompts, num_decode=3)
    ort = exported(tmp_path, config, tensors)
    logits_a, _ = ort.prefill(2, prompts[0][:8])
    logits_a, _ = ort.prefill(2, prompts[0][8:], start_pos=8)
    logits_b, _ = ort.prefill(0, prompts[1])
    assert_logits_close(logits_a, want[0][0])
    assert_logits_close(logits_b, want[1][0])
    seqs = [list(p) for p in prompts]
    for step in range(1, 4):
        nxt = [int(np.argmax(want[0][step - 1])), int(np.argmax(want[1][step - 1]))]
        logits, ids = ort.decode([2, 0], nxt, [len(seqs[0]), len(seqs[1])])
        for s in range(2):
            seqs[s].append(nxt[s])
            assert_logits_close(logits[s], want[s][step])
            assert ids[s] == int(np.argmax(logits[s]))


@pytest.mark.parametrize("family", ["llama_gqa", "qwen_bias_window"])
def test_onnx_zero_points_match_the_reference_too(tmp_path, family):
    """ONNX's own asymmetric form (uint4 + zero point): onnxruntime runs it, TensorRT would refuse it."""
    config = CONFIGS[family]
    tensors = engine_tensors(config, ENCODINGS["int4_g32_fp16_embed"])
    prompt = np.random.default_rng(4).integers(0, config.vocab_size, 9).tolist()
    ort = exported(tmp_path, config, tensors, zero_points="onnx")
    logits, _ = ort.prefill(0, prompt)
    assert_logits_close(logits, sequence_logits(ReferenceModel(config, tensors), prompt)[-1])
    problems = trt_problems(onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False))
    assert problems and all("zero point" in p for p in problems)


@pytest.mark.parametrize("family", ["llama_gqa", "gemma_tied_gelu"])
def test_float16_products_stay_close(tmp_path, family):
    """matmul_dtype="float16" (TensorRT's W4A16 form): the weight products in half precision,
    everything else float32; the logits stay within 1e-2 of the largest."""
    config = CONFIGS[family]
    tensors = engine_tensors(config, ENCODINGS["int4_g64_int8_embed"])
    prompt = np.random.default_rng(6).integers(0, config.vocab_size, 9).tolist()
    ort = exported(tmp_path, config, tensors, matmul_dtype="float16")
    logits, _ = ort.prefill(0, prompt)
    want = sequence_logits(ReferenceModel(config, tensors), prompt)[-1]
    assert np.max(np.abs(logits - want)) <= 1e-2 * np.max(np.abs(want))
    model = onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and types[n.input[0]] == onnx.TensorProto.INT4]
    assert dq and all(types[n.input[1]] == onnx.TensorProto.FLOAT16 for n in dq)
    assert trt_problems(model) == []


def test_tensorrt_refuses_group_size_32(tmp_path):
    config = CONFIGS["llama_gqa"]
    export_onnx(config, engine_tensors(config, ENCODINGS["int4_g32_fp16_embed"]), tmp_path,
                OnnxExportOptions(max_len=64))
    problems = trt_problems(onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False))
    assert problems and all("block size 32" in p for p in problems)


# ------------------------------------------------------------ 64 greedy steps

def test_random_llama_64_greedy_steps(tmp_path):
    config = dataclasses.replace(CONFIGS["llama_gqa"], max_position_embeddings=128)
    tensors = engine_tensors(config, QuantOptions(algorithm="rtn", group_size=32))
    prompt = np.random.default_rng(5).integers(0, config.vocab_size, 7).tolist()
    want = greedy_generate(ReferenceModel(config, tensors), prompt, 64)
    export_onnx(config, tensors, tmp_path, OnnxExportOptions(max_len=128))
    assert OrtModel(tmp_path).greedy(prompt, 64) == want


@pytest.fixture(scope="module")
def stories(stories260k_dir):
    from tokenwire.engine_build.llama2c import import_llama2c
    src = import_llama2c(stories260k_dir / "stories260K.bin")
    reference = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    return src, reference


@pytest.mark.parametrize("options", [QuantOptions(algorithm="rtn"), QuantOptions(algorithm="rtn", symmetric=True,
                                                                                 group_size=32)],
                         ids=["int4_g64_asym", "int4_g32_sym"])
def test_stories260k_64_greedy_steps_and_logits(tmp_path, stories, options):
    src, reference = stories
    tensors = quantize_model(src.config, src.tensors, options)[0]
    prompt = reference["prompt_token_ids"]
    want = greedy_generate(ReferenceModel(src.config, tensors), prompt, 64)
    export_onnx(src.config, tensors, tmp_path, OnnxExportOptions(max_len=128))
    ort = OrtModel(tmp_path)
    assert ort.greedy(prompt, 64) == want
    ids = prompt + want[:-1]                  # every position's logits, through the prefill graph
    got, _ = ort.run("prefill", [1], np.array([ids]), np.arange(len(ids))[None], [len(ids)])
    assert_logits_close(got[0], sequence_logits(ReferenceModel(src.config, tensors), ids)[-1])


# ------------------------------------------------------------ checker and TensorRT's operator set

@pytest.fixture(scope="module")
def stories_export(tmp_path_factory, stories):
    src, _ = stories
    out = tmp_path_factory.mktemp("onnx")
    tensors = quantize_model(src.config, src.tensors, QuantOptions(algorithm="rtn"))[0]
    return out, export_onnx(src.config, tensors, out, OnnxExportOptions(max_len=128))


@pytest.mark.parametrize("graph", ["decode", "prefill"])
def test_checker_full_check_passes(stories_export, graph):
    out, _ = stories_export
    onnx.checker.check_model(str(out / f"{graph}.onnx"), full_check=True)


@pytest.mark.parametrize("graph", ["decode", "prefill"])
def test_only_operators_tensorrt_supports(stories_export, graph):
    out, _ = stories_export
    model = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
    assert trt_problems(model) == []
    ops = {n.op_type for n in model.graph.node}
    assert {"DequantizeLinear", "MatMul", "TensorScatter", "Softmax"} <= ops <= set(TRT_OPS)
    assert model.opset_import[0].version == 24


def test_int4_weights_are_block_quantized_int4(stories_export):
    out, manifest = stories_export
    model = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 4 * manifest["model"]["num_layers"]        # qkv, o, gate_up, down (lm_head is the fp16 embed)
    for node in dq:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"axis": 0, "block_size": 64} and types[node.input[0]] == onnx.TensorProto.INT4


def test_the_two_graphs_share_one_weights_file(stories_export):
    out, manifest = stories_export
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "export.json", "prefill.onnx", "weights.bin"]
    assert (out / "decode.onnx").stat().st_size < 100_000 and read_export(out)["sha256"] == manifest["sha256"]
    external = {graph: {tuple((e.key, e.value) for e in t.external_data)
                        for t in onnx.load(str(out / f"{graph}.onnx"), load_external_data=False).graph.initializer
                        if t.data_location == onnx.TensorProto.EXTERNAL} for graph in ("decode", "prefill")}
    assert external["decode"] and external["decode"] == external["prefill"]       # the same bytes of one file
    assert {dict(entry)["location"] for entry in external["decode"]} == {"weights.bin"}


def test_read_export_rejects_other_versions(tmp_path, stories_export):
    out, manifest = stories_export
    (tmp_path / "export.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        read_export(tmp_path)


# ------------------------------------------------------------ the command

def test_export_onnx_command(tmp_path, stories260k_dir, capsys):
    engine = tmp_path / "engine"
    assert main(["build", str(stories260k_dir / "stories260K.bin"), "-o", str(engine), "--quiet", "--no-eval",
                 "--algorithm", "rtn", "--export-onnx", str(tmp_path / "built")]) == 0
    assert main(["export-onnx", str(engine), "-o", str(tmp_path / "onnx"), "--max-len", "96"]) == 0
    assert "decode.onnx" in capsys.readouterr().err
    manifest = read_export(tmp_path / "onnx")
    assert manifest["max_len"] == 96 and manifest["engine"]["source_sha256"]
    assert main(["export-onnx", str(engine), "-o", str(tmp_path / "again")]) == 0          # deterministic
    assert read_export(tmp_path / "again")["files"] == read_export(tmp_path / "built")["files"]
    assert main(["export-onnx", str(engine), "-o", str(tmp_path / "onnx")]) == 2          # exists
    assert "already exists" in capsys.readouterr().err
    assert main(["export-onnx", str(tmp_path / "nope"), "-o", str(tmp_path / "x")]) == 2
    assert "error:" in capsys.readouterr().err
