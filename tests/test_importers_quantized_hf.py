"""4-bit Hugging Face checkpoints: AWQ (GEMM), GPTQ (original and v2 zero points, act-order
g_idx) and compressed-tensors pack-quantized, written from tiny random transformers models by
tests/quantized_checkpoints.py, imported, and checked against each format's dequantization:

- every imported INT4 matrix dequantizes bit-exactly to the format's own dequantized weights
  ("exact" in the report, error 0); act-order matrices are rounded again ("requantized") with
  their error reported;
- greedy decoding of the engine (C backend) equals the numpy reference on those weights;
- unsupported group sizes, bit widths, packings, and tensors that disagree with config.json
  are BuildErrors naming the file and the problem.
"""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from quantized_checkpoints import quantize_checkpoint  # noqa: E402
from test_importers_hf import make_tiny_hf  # noqa: E402
from tokenwire.kernels.model import ReferenceModel, greedy_generate, linear_shapes  # noqa: E402
from tokenwire.engine_build.build import BuildOptions, build_engine, open_source  # noqa: E402
from tokenwire.kernels.engine_format import load_engine  # noqa: E402
from tokenwire.core.errors import BuildError  # noqa: E402
from tokenwire.engine_build.hf import linear_parts  # noqa: E402
from tokenwire.engine_build.quantize import dense_engine_tensors  # noqa: E402
from tokenwire.kernels import cpu  # noqa: E402
from tokenwire.kernels.reference import dequantize_int4  # noqa: E402

SIZES = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
CASES = {  # name: (family, method, group size, symmetric, act order, original GPTQ zeros)
    "awq_g128_llama": ("llama", "awq", 128, False, False, True),
    "awq_g32_qwen2": ("qwen2", "awq", 32, False, False, True),
    "gptq_v1_g64_sym": ("llama", "gptq", 64, True, False, True),
    "gptq_v1_g32_asym": ("qwen2", "gptq", 32, False, False, True),
    "gptq_v2_g128": ("llama", "gptq", 128, False, False, False),
    "ct_sym_g128": ("llama", "compressed-tensors", 128, True, False, True),
    "ct_asym_g32": ("qwen2", "compressed-tensors", 32, False, False, True),
}


def make_checkpoint(root, family, method, group_size, symmetric=False, act_order=False, v1=True):
    make_tiny_hf(root, family, dtype="float16", tie=False, **SIZES)
    return quantize_checkpoint(root, method, group_size, symmetric, act_order, v1)


def expected_matrices(config, source, expected_modules) -> dict:
    """canonical name -> the format's dequantization, fused; other tensors as the importer reads them."""
    out = {}
    for name, parts in linear_parts(config).items():
        if all(prefix in expected_modules for prefix, _ in parts):
            out[name] = np.concatenate([expected_modules[prefix] for prefix, _ in parts])
    return out


def engine_matrix(engine, name, shape):
    t = engine.tensors
    return dequantize_int4(t[f"{name}.qweight"], t[f"{name}.scales"], t[f"{name}.zeros"], shape[1])


@pytest.mark.parametrize("case", CASES)
def test_imported_weights_are_bit_exact_and_decode_like_the_reference(tmp_path, case):
    family, method, group_size, symmetric, act_order, v1 = CASES[case]
    modules = make_checkpoint(tmp_path / "src", family, method, group_size, symmetric, act_order, v1)
    source = open_source(tmp_path / "src")
    engine = load_engine(build_engine(source, tmp_path / "engine", BuildOptions(evaluate=False)))
    config = engine.config
    assert engine.manifest["quantization"]["group_size"] == group_size
    expected = expected_matrices(config, source, modules)
    assert len(expected) == 4 * config.num_layers
    report = engine.manifest["report"]["tensors"]
    for name, want in expected.items():
        np.testing.assert_array_equal(engine_matrix(engine, name, linear_shapes(config)[name]), want, err_msg=name)
        np.testing.assert_array_equal(source.tensors[name], want, err_msg=name)
        assert report[name]["origin"] == "exact" and report[name]["weight_rel_error"] == 0.0
        assert report[name]["source"] == f"{method} g{group_size}"
    assert report["lm_head"]["origin"] == "float" and report["embed"]["origin"] == "float"
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    dense = dense_engine_tensors(config, {**{n: source.tensors[n] for n in source.tensors}, **expected})
    prompt = engine.encode_prompt("once upon a time")
    want = greedy_generate(ReferenceModel(config, dense, block_size=4, num_blocks=32), prompt, 20)
    from test_golden_stories import staggered_greedy
    got = staggered_greedy(lambda bs, nb: cpu.create_model(config, engine.tensors, block_size=bs, num_blocks=nb),
                           prompt, 20, copies=1, joins=(0,))
    assert got[0] == want


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_act_order(tmp_path, method):
    """Act-order: down_proj's columns sorted by group, gate and up rows in the same order, so it is
    taken exactly (the same function); q/k/v, o and gate/up, whose inputs cannot be reordered, are
    rounded again with their error. Greedy decoding still equals the reference on the format's
    dequantized weights in their original order."""
    modules = make_checkpoint(tmp_path / "src", "llama", method, 32, act_order=True)
    source = open_source(tmp_path / "src")
    engine = load_engine(build_engine(source, tmp_path / "engine", BuildOptions(evaluate=False)))
    config = engine.config
    expected = expected_matrices(config, source, modules)
    report = engine.manifest["report"]["tensors"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        order = np.argsort(_g_idx(tmp_path / "src", method, f"model.layers.{i}.mlp.down_proj"), kind="stable")
        np.testing.assert_array_equal(source.tensors[p + "down_proj"], expected[p + "down_proj"][:, order])
        rows = np.concatenate([order, config.intermediate_size + order])
        np.testing.assert_array_equal(source.tensors[p + "gate_up_proj"], expected[p + "gate_up_proj"][rows])
        np.testing.assert_array_equal(engine_matrix(engine, p + "down_proj", linear_shapes(config)[p + "down_proj"]),
                                      expected[p + "down_proj"][:, order])
        assert report[p + "down_proj"]["origin"] == "exact" and report[p + "down_proj"]["weight_rel_error"] == 0
        for name in ("qkv_proj", "o_proj", "gate_up_proj"):
            want = source.tensors[p + name]
            got = engine_matrix(engine, p + name, linear_shapes(config)[p + name])
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert report[p + name]["origin"] == "requantized" and report[p + name]["source"] == f"{method} g32 (act-order)"
            assert report[p + name]["weight_rel_error"] == pytest.approx(err, rel=1e-4) and 0 < err < 0.1
    # the reordered model is the same function: greedy on the original order equals greedy on the import's
    original = dense_engine_tensors(config, {**{n: source.tensors[n] for n in source.tensors}, **expected})
    reordered = dense_engine_tensors(config, {n: source.tensors[n] for n in source.tensors})
    prompt = engine.encode_prompt("once upon a time")
    want = greedy_generate(ReferenceModel(config, original, block_size=4, num_blocks=32), prompt, 20)
    assert greedy_generate(ReferenceModel(config, reordered, block_size=4, num_blocks=32), prompt, 20) == want


def _g_idx(root, method, prefix):
    from safetensors.numpy import load_file
    return load_file(str(root / "model.safetensors"))[prefix + (".g_idx" if method == "gptq" else ".weight_g_idx")]


def test_cli_builds_an_awq_directory(tmp_path, capsys):
    from tokenwire.cli import main
    make_checkpoint(tmp_path / "src", "llama", "awq", 64)
    assert main(["build", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--no-eval"]) == 0
    err = capsys.readouterr().err
    assert "8 exact" in err and "awq g64" in err
    assert load_engine(tmp_path / "out").manifest["quantization"]["group_size"] == 64


# ---- bad checkpoints ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq") / "src"
    make_checkpoint(root, "llama", "awq", 64)
    return root


def broken(tmp_path, awq_dir, **changes):
    import shutil
    shutil.copytree(awq_dir, tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["quantization_config"].update(changes)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    return tmp_path / "bad"


@pytest.mark.parametrize("changes,fragment", [
    (dict(group_size=48), "awq group size 48 is not supported: tokenwire's INT4 kernels use groups of 32, 64, 128"),
    (dict(group_size=-1), "group size -1 is not supported"),
    (dict(bits=8), "awq checkpoints with 8-bit weights are not supported"),
    (dict(version="gemv"), "AWQ version 'gemv'"),
    (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
])
def test_unsupported_quantization_configs(tmp_path, awq_dir, changes, fragment):
    bad = broken(tmp_path, awq_dir, **changes)
    with pytest.raises(BuildError) as info:
        open_source(bad)
    assert str(bad / "config.json") in str(info.value) and fragment in str(info.value)


def test_config_and_tensors_disagree(tmp_path, awq_dir):
    bad = broken(tmp_path, awq_dir, group_size=32)          # the tensors were packed with groups of 64
    with pytest.raises(BuildError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.qzeros' "
                                         r"has shape \[2, 16\], config\.json implies \[4, 16\]"):
        build_engine(open_source(bad), tmp_path / "e", BuildOptions(evaluate=False))


def test_compressed_tensors_weight_shape_disagrees(tmp_path):
    make_checkpoint(tmp_path / "src", "llama", "compressed-tensors", 32, symmetric=True)
    from safetensors.numpy import load_file, save_file
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight_shape"] = np.array([128, 96], dtype=np.int64)
    save_file(tensors, str(path))
    with pytest.raises(BuildError, match=r"config\.json: model\.layers\.1\.mlp\.up_proj\.weight_shape is \[128, 96\], "
                                         r"config\.json implies \[128, 128\]"):
        build_engine(open_source(tmp_path / "src"), tmp_path / "e", BuildOptions(evaluate=False))
