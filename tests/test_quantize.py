"""The INT4 quantizer's pure steps against kernels/reference.py (their inverse), the error
searches against plain round-to-nearest, and the AWQ fold against the float model it must
leave unchanged."""

import json
import math

import numpy as np
import pytest

from tokenwire.core.config import ModelConfig
from tokenwire.kernels.model import ReferenceModel, sequence_logits
from tokenwire.kernels.engine_format import linear_shapes, vector_shapes
from tokenwire.engine_build.calibration import capture_activations, fold_awq_layer, split_sequences
from tokenwire.core.errors import BuildError
from tokenwire.engine_build.int4 import get_group_qparams, pack, pad_k, quantize, quantize_int4, quantize_int8
from tokenwire.engine_build.quant_search import awq_input_scales, gptq_int4, group_gram, search_clip
from tokenwire.engine_build.quantize import QuantOptions, dense_engine_tensors, quantize_model
from tokenwire.kernels.reference import dequantize_int4, dequantize_int8, unpack_int4


def heavy_tailed(shape, seed=0) -> np.ndarray:
    """Student-t weights: a few large values per group, as trained weights have."""
    return (np.random.default_rng(seed).standard_t(3, shape) * 0.02).astype(np.float32)


# ------------------------------------------------------------------ pure steps

def test_pack_layout_is_low_nibble_first_and_unpacks_exactly():
    q = np.array([[1, 2, 15, 0, 7, 8]], dtype=np.uint8)
    packed = pack(q)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert np.array_equal(unpack_int4(packed), q)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size,k", [(32, 64), (64, 100), (128, 40)])
def test_int4_round_trip_through_the_reference(group_size, k, symmetric):
    w = heavy_tailed((24, k))
    parts = quantize_int4(w, group_size, symmetric)
    kp = -(-k // group_size) * group_size
    assert parts["qweight"].dtype == np.uint8 and parts["qweight"].shape == (24, kp // 2)
    assert parts["scales"].dtype == parts["zeros"].dtype == np.float16
    assert parts["scales"].shape == parts["zeros"].shape == (24, kp // group_size)
    w_hat = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], k)
    assert w_hat.shape == w.shape
    step = np.repeat(parts["scales"].astype(np.float32), group_size, axis=1)[:, :k]
    # round to nearest: within half a step of every weight (the range covers every weight)
    assert np.all(np.abs(w - w_hat) <= 0.5 * step * (1 + 1e-3) + 1e-7)
    if symmetric:
        assert np.all(parts["zeros"] == 8)
    else:
        assert np.all(parts["zeros"] == np.round(parts["zeros"]))       # integer zero points
    # the padding (zeros) stays exactly zero
    padded = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], kp)
    assert np.all(padded[:, k:] == 0)


def test_each_group_uses_the_full_code_range():
    w = heavy_tailed((8, 128))
    wp = pad_k(w, 32)
    scales, zeros = get_group_qparams(wp, 32, symmetric=False)
    q = quantize(wp, scales, zeros, 32).reshape(8, 4, 32)
    assert np.all(q.max(-1) - q.min(-1) >= 14)


def test_zero_and_constant_rows_quantize_without_nan():
    w = np.zeros((3, 64), dtype=np.float32)
    w[1] = 0.5
    parts = quantize_int4(w, 32, symmetric=False)
    w_hat = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], 64)
    assert np.all(np.isfinite(w_hat))
    assert np.array_equal(w_hat[0], w[0])
    np.testing.assert_allclose(w_hat[1], w[1], rtol=1e-3)


def test_int8_round_trip():
    w = heavy_tailed((16, 48))
    parts = quantize_int8(w)
    assert parts["qweight"].dtype == np.int8 and parts["scales"].dtype == np.float16
    w_hat = dequantize_int8(parts["qweight"], parts["scales"])
    assert np.all(np.abs(w - w_hat) <= 0.5 * parts["scales"].astype(np.float32)[:, None] * 1.001 + 1e-7)


def test_non_finite_weights_are_a_clear_error():
    w = heavy_tailed((4, 32))
    w[0, 0] = np.inf
    with pytest.raises(BuildError, match="float16"):
        quantize_int4(w, 32, symmetric=False)


@pytest.mark.parametrize("bad,match", [(dict(group_size=48), "group size"), (dict(algorithm="hqq"), "algorithm"),
                                       (dict(method="int3"), "method"), (dict(embedding="bf16"), "embedding")])
def test_bad_options_name_the_problem(bad, match):
    with pytest.raises(BuildError, match=match):
        QuantOptions(**bad)


# ------------------------------------------------------------------ the error searches beat RTN

def weight_error(w, parts, k):
    return float(np.linalg.norm(w - dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], k)))


@pytest.mark.parametrize("symmetric,gain", [(False, 0.99), (True, 0.95)])
def test_clip_search_reduces_weight_error_without_activations(symmetric, gain):
    """Asymmetric ranges already fit each group's ends, so clipping gains less there (measured ~2.5%)."""
    w = heavy_tailed((64, 256), seed=1)
    rtn = quantize_int4(w, 64, symmetric)
    clipped = quantize_int4(w, 64, symmetric, search_clip(w, group_gram(None, 256, 64), 64, symmetric))
    assert weight_error(w, clipped, 256) < gain * weight_error(w, rtn, 256)


def test_activation_weighted_clip_and_awq_reduce_output_error():
    rng = np.random.default_rng(2)
    w = heavy_tailed((96, 128), seed=3)
    channel_scale = np.exp(rng.standard_normal(128) * 1.2).astype(np.float32)     # outlier input channels
    # correlated inputs (a few latent directions plus noise), as real activations are: GPTQ needs them
    latent = rng.standard_normal((2048, 16)) @ rng.standard_normal((16, 128)) + 0.3 * rng.standard_normal((2048, 128))
    x = (latent * channel_scale).astype(np.float32)
    fit, held = x[:1536], x[1536:]

    def output_error(w_hat):
        return float(np.linalg.norm(held @ (w - w_hat).T) / np.linalg.norm(held @ w.T))

    def deq(parts):
        return dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], 128)
    rtn = output_error(deq(quantize_int4(w, 64, False)))
    clip = output_error(deq(quantize_int4(w, 64, False, search_clip(w, group_gram(fit, 128, 64), 64, False))))
    s = awq_input_scales(w, fit, 64, False)
    ws = w * s
    awq = output_error(deq(quantize_int4(ws, 64, False, search_clip(ws, group_gram(fit / s, 128, 64), 64, False))) / s)
    gptq = output_error(deq(gptq_int4(w, fit, 64, False)))
    print(f"held-out output error: rtn {rtn:.4f} clip {clip:.4f} awq {awq:.4f} gptq {gptq:.4f}")
    assert clip < rtn and awq < clip and gptq < clip
    assert awq < 0.8 * rtn and gptq < 0.8 * rtn


def test_gptq_codes_are_a_valid_encoding():
    rng = np.random.default_rng(7)
    w = heavy_tailed((16, 100), seed=8)                  # K = 100: padded to 128 with G = 32
    x = rng.standard_normal((300, 100)).astype(np.float32)
    x[:, 7] = 0                                          # a dead input channel is handled, not inverted
    parts = gptq_int4(w, x, 32, symmetric=False)
    assert parts["qweight"].shape == (16, 64) and parts["scales"].shape == parts["zeros"].shape == (16, 4)
    assert np.all(parts["zeros"] == np.round(parts["zeros"]))
    w_hat = dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], 100)
    assert np.all(np.isfinite(w_hat)) and np.linalg.norm(w - w_hat) < 0.2 * np.linalg.norm(w)


# ------------------------------------------------------------------ the AWQ fold preserves the float model

def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=40,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                  rms_norm_eps=1e-6, rope_theta=10000.0, qkv_bias=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def canonical_tensors(config, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    t = {n: (rng.standard_normal(s) * 2 / math.sqrt(s[1])).astype(np.float32) for n, s in linear_shapes(config).items()}
    t.update({n: (1 + 0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in vector_shapes(config).items()})
    return t


@pytest.mark.parametrize("overrides", [{}, dict(num_kv_heads=1, qkv_bias=False, activation="gelu_tanh")])
def test_awq_fold_leaves_the_float_model_unchanged(overrides):
    cfg = tiny_config(**overrides)
    tensors = canonical_tensors(cfg)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 40).tolist()
    acts = capture_activations(cfg, dense_engine_tensors(cfg, tensors), [ids])
    weights = {n: tensors[n].copy() for n in linear_shapes(cfg)}
    vectors = {n: tensors[n].copy() for n in vector_shapes(cfg)}
    rng = np.random.default_rng(5)

    def search(w, x, tie=None):     # any positive scales, tied across GQA groups where asked
        s = np.exp(rng.standard_normal(w.shape[1])).astype(np.float32)
        if tie is not None:
            s = np.repeat(s.reshape(tie)[:, :1], tie[1], axis=1).reshape(-1)
        return s
    for i in range(cfg.num_layers):
        scales = fold_awq_layer(cfg, i, weights, vectors, acts, search)
        assert not np.allclose(weights[f"layers.{i}.o_proj"], tensors[f"layers.{i}.o_proj"])
        row, col = scales[f"layers.{i}.qkv_proj"]
        np.testing.assert_allclose(weights[f"layers.{i}.qkv_proj"] / row[:, None] / col,
                                   tensors[f"layers.{i}.qkv_proj"], rtol=1e-5, atol=1e-7)
    folded = dense_engine_tensors(cfg, {**weights, **vectors})
    want = sequence_logits(ReferenceModel(cfg, dense_engine_tensors(cfg, tensors)), ids)
    got = sequence_logits(ReferenceModel(cfg, folded), ids)
    np.testing.assert_allclose(got, want, atol=1e-4)


# ------------------------------------------------------------------ quantize_model

def test_quantize_model_encodings_and_meta_follow_the_engine_format():
    cfg = tiny_config(hidden_size=40)             # K = 40, padded to 64
    tensors = canonical_tensors(cfg)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, 200).tolist()
    encoded, meta, report = quantize_model(cfg, tensors, QuantOptions(group_size=32, embedding="int8", lm_head="int4"),
                                           split_sequences(ids, 64), evaluation_token_ids=[ids[:50], ids[50:90]])
    assert meta["embed"] == {"kind": "int8", "shape": [64, 40]}
    assert meta["lm_head"] == {"kind": "int4", "shape": [64, 40]}
    assert meta["layers.0.down_proj"] == {"kind": "int4", "shape": [40, 40]}
    assert meta["layers.0.qkv_bias"] == {"kind": "dense", "shape": [64]}
    assert encoded["layers.1.gate_up_proj.qweight"].shape == (80, 32)
    assert encoded["layers.1.gate_up_proj.scales"].shape == (80, 2)
    assert encoded["embed.qweight"].dtype == np.int8
    assert encoded["layers.0.attn_norm"].dtype == np.float32
    assert {t.name for t in report.tensors} == set(linear_shapes(cfg))
    assert all(0 < t.weight_rel_error < 0.3 for t in report.tensors)
    assert all(t.output_rel_error is not None for t in report.tensors if t.name != "embed")
    d = json.loads(json.dumps(report.to_dict()))        # goes into engine.json as is
    assert d["quantization"]["algorithm"] == "awq" and d["num_calibration_tokens"] == 200
    assert d["evaluation"]["num_eval_tokens"] == 49 + 39
    assert d["evaluation"]["quant_perplexity"] > 0 and d["evaluation"]["fp_perplexity"] > 0
    model = ReferenceModel(cfg, encoded)          # the reference forward reads every encoding
    assert np.all(np.isfinite(sequence_logits(model, ids[:10])))


def test_quant_none_is_exact_float32():
    cfg = tiny_config(tie_word_embeddings=True)
    tensors = canonical_tensors(cfg)
    encoded, meta, report = quantize_model(cfg, tensors, QuantOptions(method="none"))
    assert "lm_head.weight" not in encoded and meta["embed"]["kind"] == "dense"
    assert all(np.array_equal(encoded[f"{n}.weight"], tensors[n]) for n in linear_shapes(cfg))
    assert all(encoded[f"{n}.weight"].dtype == np.float32 for n in linear_shapes(cfg))
    assert report.mean_weight_error() is None


def test_awq_without_calibration_is_a_clear_error():
    cfg = tiny_config()
    with pytest.raises(BuildError, match="calibration"):
        quantize_model(cfg, canonical_tensors(cfg), QuantOptions(algorithm="awq"))


def test_missing_or_misshapen_source_tensor_is_named():
    cfg = tiny_config()
    tensors = canonical_tensors(cfg)
    tensors["layers.1.o_proj"] = tensors["layers.1.o_proj"][:, :5]
    with pytest.raises(BuildError, match="layers.1.o_proj"):
        quantize_model(cfg, tensors, QuantOptions(algorithm="rtn"))
