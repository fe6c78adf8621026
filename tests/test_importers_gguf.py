"""GGUF import: tiny random models written with the `gguf` package (tokenwire/bench/gguf_random.py), built
into engines, and checked against the file's own dequantization:

- Q4_0: every imported INT4 matrix dequantizes bit-exactly to what the gguf package
  dequantizes (after undoing llama.cpp's Q/K permutation), the report says "exact" with error 0,
  and greedy decoding of the engine on the C backend equals the numpy reference run on the
  source's dequantized float weights;
- Q4_1 and Q4_K: the source's codes are kept (unpacked engine codes equal the file's nibbles),
  scales and minimums rounded to float16 ("mapped"), and why Q4_K cannot in general be exact;
- Q8_0, Q5_0, F16 and a Q4_K/Q8_0 mix: dequantized and requantized, with the error reported;
- SentencePiece- and byte-level-BPE tokenizers and the chat template from the metadata;
- `tokenwire build model.gguf -o OUT` and the `--model model.gguf` resolver;
- bad files: truncated, unknown tensor type, mismatched shapes, metadata disagreeing with the
  tensors, unsupported architecture: each a BuildError naming the file and the problem.
"""

import json
import struct

import gguf
import numpy as np
import pytest

from tokenwire.bench.gguf_random import SHAPE, llama_unpermute, write_gguf
from tokenwire.cli import main
from tokenwire.kernels.model import ReferenceModel, greedy_generate, linear_shapes, sequence_logits
from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
from tokenwire.kernels.engine_format import load_engine
from tokenwire.core.errors import BuildError
from tokenwire.engine_build.quantize import QuantOptions, dense_engine_tensors
from tokenwire.kernels import cpu
from tokenwire.kernels.reference import dequantize_int4, unpack_int4

K_SHAPE = dict(dim=256, hidden=512)          # Q4_K blocks are 256 wide
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def canonical_expected(w: dict, config) -> dict:
    """The source's dequantized weights (gguf_random's own unpermuted dequantization) fused as the engine fuses."""
    out = {"embed": w["token_embd.weight"], "norm": w["output_norm.weight"]}
    if "output.weight" in w:
        out["lm_head"] = w["output.weight"]
    for i in range(config.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        out[p + "qkv_proj"] = np.concatenate([w[b + "attn_q.weight"], w[b + "attn_k.weight"], w[b + "attn_v.weight"]])
        out[p + "o_proj"] = w[b + "attn_output.weight"]
        out[p + "gate_up_proj"] = np.concatenate([w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"]])
        out[p + "down_proj"] = w[b + "ffn_down.weight"]
        out[p + "attn_norm"], out[p + "mlp_norm"] = w[b + "attn_norm.weight"], w[b + "ffn_norm.weight"]
        if config.qkv_bias:
            out[p + "qkv_bias"] = np.concatenate([w[b + f"attn_{x}.bias"] for x in "qkv"])
        if config.qk_norm:
            out[p + "q_norm"], out[p + "k_norm"] = w[b + "attn_q_norm.weight"], w[b + "attn_k_norm.weight"]
    return out


def engine_matrix(engine, name, shape):
    t = engine.tensors
    return dequantize_int4(t[f"{name}.qweight"], t[f"{name}.scales"], t[f"{name}.zeros"], shape[1])


@pytest.fixture(scope="module")
def q4_0_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4_0")
    weights = write_gguf(root / "tiny.gguf", "llama", "Q4_0", chat_template=TEMPLATE)
    out = build_engine(open_source(root / "tiny.gguf"), root / "engine", BuildOptions(evaluate=False))
    return root, weights, load_engine(out)


def test_q4_0_imports_bit_exact(q4_0_llama):
    _, weights, engine = q4_0_llama
    config = engine.config
    expected = canonical_expected(weights, config)
    for name, shape in linear_shapes(config).items():
        assert engine.manifest["tensors"][name]["kind"] == "int4"
        np.testing.assert_array_equal(engine_matrix(engine, name, shape), expected[name], err_msg=name)
    report = engine.manifest["report"]["tensors"]
    assert {r["origin"] for r in report.values()} == {"exact"}
    assert all(r["weight_rel_error"] == 0.0 and r["source"] == "gguf Q4_0" for r in report.values())
    assert engine.manifest["quantization"]["group_size"] == 32


def test_q4_0_greedy_c_backend_equals_reference_on_dequantized_weights(q4_0_llama):
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    _, weights, engine = q4_0_llama
    config = engine.config
    expected = canonical_expected(weights, config)
    dense = dense_engine_tensors(config, expected)
    prompt = engine.encode_prompt("the cat in the hat")
    want = greedy_generate(ReferenceModel(config, dense, block_size=4, num_blocks=32), prompt, 24)
    from test_golden_stories import staggered_greedy
    got = staggered_greedy(lambda bs, nb: cpu.create_model(config, engine.tensors, block_size=bs, num_blocks=nb),
                           prompt, 24, copies=1, joins=(0,))
    assert got[0] == want


def test_qwen3_q4_0_with_q_k_norms(tmp_path):
    """qwen3: per-head q/k norms from attn_q_norm / attn_k_norm; greedy on the C backend equals the
    reference on the dequantized weights."""
    weights = write_gguf(tmp_path / "q3.gguf", "qwen3", "Q4_0", tokenizer="gpt2")
    engine = load_engine(build_engine(open_source(tmp_path / "q3.gguf"), tmp_path / "e", BuildOptions(evaluate=False)))
    config = engine.config
    assert config.qk_norm and not config.qkv_bias and config.architecture == "Qwen3ForCausalLM"
    expected = canonical_expected(weights, config)
    np.testing.assert_array_equal(engine.tensors["layers.1.k_norm"], expected["layers.1.k_norm"])
    for name, shape in linear_shapes(config).items():
        np.testing.assert_array_equal(engine_matrix(engine, name, shape), expected[name], err_msg=name)
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    prompt = engine.encode_prompt("the cat in the hat")
    want = greedy_generate(ReferenceModel(config, dense_engine_tensors(config, expected), block_size=4,
                                          num_blocks=32), prompt, 16)
    model = cpu.create_model(config, engine.tensors, block_size=4, num_blocks=32)
    assert greedy_generate(model, prompt, 16) == want


def test_llama31_rope_freqs(tmp_path):
    """rope_freqs.weight (Llama 3.1's RoPE scaling as llama.cpp stores it) divides each frequency;
    the C backend and the reference agree on it."""
    from dataclasses import replace

    from tokenwire.core.config import RopeScaling
    from tokenwire.kernels.rope import rope_inv_freq
    hd = SHAPE["dim"] // SHAPE["heads"]
    plain = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)          # the file's rope.freq_base
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    wavelen = 2 * np.pi / plain                               # Llama 3.1's rule, written out here
    smooth = (32 / wavelen - 1.0) / (4.0 - 1.0)
    scaled = np.where(wavelen < 32 / 4.0, plain, np.where(wavelen > 32 / 1.0, plain / 8.0,
                                                          (1 - smooth) * plain / 8.0 + smooth * plain))
    factors = (plain / scaled).astype(np.float32)
    assert factors.max() == 8.0 and factors.min() == 1.0
    write_gguf(tmp_path / "l31.gguf", "llama", "Q4_0", rope_freqs=factors)
    src = open_source(tmp_path / "l31.gguf")
    assert src.config.rope_freq_factors == tuple(float(f) for f in factors)
    as_hf = replace(src.config, rope_freq_factors=None, rope_scaling=scaling)       # the same model from its HF config
    np.testing.assert_allclose(rope_inv_freq(src.config), rope_inv_freq(as_hf), rtol=1e-7)
    engine = load_engine(build_engine(src, tmp_path / "e", BuildOptions(evaluate=False)))
    assert engine.config.rope_freq_factors == src.config.rope_freq_factors         # through engine.json
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    prompt = engine.encode_prompt("the cat in the hat the cat in the hat the cat")
    want = greedy_generate(ReferenceModel(engine.config, engine.tensors, block_size=4, num_blocks=32), prompt, 16)
    model = cpu.create_model(engine.config, engine.tensors, block_size=4, num_blocks=32)
    assert greedy_generate(model, prompt, 16) == want
    batch_logits = sequence_logits(ReferenceModel(engine.config, engine.tensors, block_size=4, num_blocks=32), prompt)
    plain_logits = sequence_logits(ReferenceModel(replace(engine.config, rope_freq_factors=None), engine.tensors,
                                                  block_size=4, num_blocks=32), prompt)
    assert not np.allclose(batch_logits[1:], plain_logits[1:])                  # the factors reach the forward


def test_q4_0_config_tokenizer_and_template(q4_0_llama):
    _, _, engine = q4_0_llama
    c = engine.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (300, 64, 96, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.rope_theta) == (4, 2, 16, 1e-6, 10000.0)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and not c.tie_word_embeddings
    ids = engine.encode_prompt("the cat in the hat")
    assert ids[0] == 1 and engine.tokenizer.decode(ids[1:]) == "the cat in the hat"
    assert engine.tokenizer.token_to_id("\u2581the") in ids            # highest-scored merge applied
    marker = engine.tokenizer.token_to_id("<|im_start|>")              # user-defined: matched whole
    assert marker is not None and engine.encode_chat("<|im_start|>user")[:1] == [marker]


def test_q4_1_and_q4_k_keep_the_codes(tmp_path):
    for qtype, shape in (("Q4_1", None), ("Q4_K", K_SHAPE)):
        path = tmp_path / f"{qtype}.gguf"
        weights = write_gguf(path, "qwen2", qtype, shape=shape)
        engine = load_engine(build_engine(open_source(path), tmp_path / qtype, BuildOptions(evaluate=False)))
        expected = canonical_expected(weights, engine.config)
        report = engine.manifest["report"]["tensors"]
        for name, shape_ in linear_shapes(engine.config).items():
            got = engine_matrix(engine, name, shape_)
            scale = np.abs(expected[name]).max()
            assert np.abs(got - expected[name]).max() <= 2e-3 * scale, (qtype, name)
            assert report[name]["origin"] in ("exact", "mapped") and report[name]["weight_rel_error"] < 2e-3
        # the codes are the file's: the embedding's first block, nibbles in ggml's order
        reader = gguf.GGUFReader(path)
        t = next(t for t in reader.tensors if t.name == "token_embd.weight")
        raw = np.asarray(t.data[0], dtype=np.uint8)
        if qtype == "Q4_1":
            want = np.concatenate([raw[4:20] & 15, raw[4:20] >> 4])
        else:
            want = np.concatenate([raw[16:48] & 15, raw[16:48] >> 4])      # sub-blocks 0 and 1
        np.testing.assert_array_equal(unpack_int4(engine.tensors["embed.qweight"])[0, :len(want)], want)
        if cpu.AVAILABLE:           # non-integer zero points (the mapped minimums) in the C products
            prompt = engine.encode_prompt("the cat in the hat")
            ref = ReferenceModel(engine.config, engine.tensors, block_size=4, num_blocks=32)
            model = cpu.create_model(engine.config, engine.tensors, block_size=4, num_blocks=32)
            assert greedy_generate(model, prompt, 12) == greedy_generate(ref, prompt, 12), qtype


def q4_k_block(d: float, dmin: float, sc: int, m: int) -> np.ndarray:
    """One Q4_K block (256 values) with every sub-block's scale `sc` and minimum `m`, codes 0..15 cycling."""
    scales = np.zeros(12, dtype=np.uint8)
    scales[0:4], scales[4:8], scales[8:12] = sc & 63 | (sc >> 4) << 6, m & 63 | (m >> 4) << 6, sc & 15 | (m & 15) << 4
    q = (np.arange(256) % 16).astype(np.uint8).reshape(4, 2, 32)
    qs = (q[:, 0] | (q[:, 1] << 4)).reshape(128)
    head = np.array([d], dtype=np.float16).view(np.uint8).tolist() + np.array([dmin], dtype=np.float16).view(np.uint8).tolist()
    return np.concatenate([np.array(head, dtype=np.uint8), scales, qs]).reshape(1, 144)


def test_q4_k_is_exact_only_when_its_scales_are_float16():
    """Why Q4_K is "mapped", not "exact": a sub-block's scale is d * sc, an fp16 times a 6-bit
    integer, which needs up to 11 + 6 significant bits; the engine's fp16 scale holds 11. With
    d = 1 + 2^-10 and sc = 63 the product 63.06... is not a float16, so no fp16 (s, z) can give
    the same weights; with d = 2^-6, sc = 5, dmin = 2^-7, m = 10 every rounding is exact."""
    from tokenwire.engine_build.gguf_import import q4_k_codes
    inexact = q4_k_block(1 + 2 ** -10, 0.5, 63, 3)
    assert np.float16(np.float32(1 + 2 ** -10) * 63) != np.float32(1 + 2 ** -10) * 63
    codes = q4_k_codes(inexact, 1, 256)
    assert codes.origin == "mapped"
    source = gguf.quants.dequantize(inexact, gguf.GGMLQuantizationType.Q4_K).reshape(1, 256)
    assert not np.array_equal(codes.dequantize(), source)
    assert np.abs(codes.dequantize() - source).max() <= 2 ** -10 * np.abs(source).max()
    exact = q4_k_block(2 ** -6, 2 ** -7, 5, 10)
    codes = q4_k_codes(exact, 1, 256)
    assert codes.origin == "exact"
    np.testing.assert_array_equal(codes.dequantize(),
                                  gguf.quants.dequantize(exact, gguf.GGMLQuantizationType.Q4_K).reshape(1, 256))


@pytest.mark.parametrize("types", ["Q8_0", "Q5_0", "F16", {"attn_v": "Q8_0", "ffn_down": "Q8_0", "*": "Q4_K"}],
                         ids=["Q8_0", "Q5_0", "F16", "Q4_K_mix"])
def test_other_types_are_requantized_with_their_error(tmp_path, types):
    shape = K_SHAPE if isinstance(types, dict) else None
    weights = write_gguf(tmp_path / "m.gguf", "llama", types, shape=shape)
    options = BuildOptions(QuantOptions(algorithm="rtn"), evaluate=False)     # awq would rescale the stored basis
    engine = load_engine(build_engine(open_source(tmp_path / "m.gguf"), tmp_path / "e", options))
    expected = canonical_expected(weights, engine.config)
    report = engine.manifest["report"]["tensors"]
    int4 = [name for name in linear_shapes(engine.config) if report[name]["encoding"] == "int4"]
    assert {n for n in linear_shapes(engine.config) if n.startswith("layers.")} <= set(int4), int4   # all checked
    for name in int4:
        row, shape_ = report[name], linear_shapes(engine.config)[name]
        got = engine_matrix(engine, name, shape_)
        err = np.linalg.norm(got - expected[name]) / np.linalg.norm(expected[name])
        assert row["weight_rel_error"] == pytest.approx(err, rel=1e-4) and 0 < err < 0.15, name
        want = {"F16": "quantized", "Q8_0": "requantized", "Q5_0": "requantized"}.get(types if isinstance(types, str) else "")
        if want:
            assert row["origin"] == want
    if isinstance(types, dict):
        assert report["layers.0.qkv_proj"]["origin"] == "requantized"      # its V rows were Q8_0
        assert report["layers.0.qkv_proj"]["source"] == "gguf Q4_K+Q8_0"
        assert report["layers.0.gate_up_proj"]["origin"] == "mapped"
        assert engine.manifest["quantization"]["group_size"] == 32


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_q8_0_embedding_and_classifier_stay_int8(tmp_path, tied):
    """A Q8_0 embedding / classifier is built as int8 (per-row scale), not grown to fp16: the
    classifier is the largest matrix a decode step reads. The stated error of the int8 path:
    every weight within half its row's scale of what the file dequantizes to, so each logit
    within s_n / 2 * sum |h| of h . w_n, h the final hidden state (read from the reference
    model with an identity classifier); the C backend's logits are checked against that."""
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    types = {"token_embd": "Q8_0", "output": "Q8_0", "*": "Q4_0"}
    weights = write_gguf(tmp_path / "m.gguf", "llama", types, tied=tied)
    engine = load_engine(build_engine(open_source(tmp_path / "m.gguf"), tmp_path / "e", BuildOptions(evaluate=False)))
    config, tensors = engine.config, engine.tensors
    parts = {"embed": "token_embd.weight"} | ({} if tied else {"lm_head": "output.weight"})
    assert engine.manifest["quantization"]["embedding"] == "int8"
    for name, gguf_name in parts.items():
        assert engine.manifest["tensors"][name]["kind"] == "int8", name
        q, scales = tensors[f"{name}.qweight"], tensors[f"{name}.scales"].astype(np.float32)
        assert q.dtype == np.int8 and q.nbytes + scales.nbytes * 2 < weights[gguf_name].size * 2   # below fp16's bytes
        err = np.abs(q * scales[:, None] - weights[gguf_name])
        assert np.all(err <= scales[:, None] / 2), name
    head = weights[parts.get("lm_head", "token_embd.weight")]
    head_scales = tensors[f"{'embed' if tied else 'lm_head'}.scales"].astype(np.float32)
    prompt = engine.encode_prompt("the cat in the hat sat")
    reference = ReferenceModel(config, tensors, block_size=4, num_blocks=32)
    reference.lm_head = np.eye(config.vocab_size, config.hidden_size, dtype=np.float32)   # logits[:, :D] = h
    h = sequence_logits(reference, prompt)[:, :config.hidden_size]
    got = sequence_logits(cpu.create_model(config, tensors, block_size=4, num_blocks=32), prompt)
    bound = head_scales[None, :] / 2 * np.abs(h).sum(axis=1, keepdims=True)
    np.testing.assert_array_less(np.abs(got - h @ head.T), bound + 1e-4)
    assert np.abs(got - h @ head.T).max() > 0       # the int8 classifier is what computed them


def test_spm_without_the_dummy_prefix(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0", meta_overrides=dict(add_space_prefix=False))
    tok = open_source(tmp_path / "m.gguf").tokenizer
    from tokenizers import Tokenizer
    t = Tokenizer.from_str(tok.files["tokenizer.json"].decode())
    ids = t.encode("the cat", add_special_tokens=False).ids
    assert [t.id_to_token(i) for i in ids] == ["t", "he", "\u2581", "c", "at"]     # with the prefix: "▁the" first
    assert t.decode(ids) == "the cat"


def test_byte_level_tokenizer_and_chat_template(tmp_path):
    write_gguf(tmp_path / "q.gguf", "qwen2", "Q4_0", chat_template=TEMPLATE)
    src = open_source(tmp_path / "q.gguf")
    engine = load_engine(build_engine(src, tmp_path / "e", BuildOptions(evaluate=False)))
    assert engine.config.qkv_bias and engine.config.eos_token_ids == (engine.tokenizer.token_to_id("<|im_end|>"),)
    assert engine.manifest["tokenizer"]["chat_template"] == TEMPLATE and not engine.manifest["tokenizer"]["add_bos"]
    text = "the cat in the hat, 123!"
    ids = engine.encode_prompt(text)
    assert engine.tokenizer.decode(ids) == text
    assert engine.tokenizer.token_to_id("Ġthe") in ids                  # the merges are applied
    import jinja2
    rendered = jinja2.Template(engine.manifest["tokenizer"]["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}])
    chat = engine.encode_chat(rendered)
    assert chat[0] == engine.tokenizer.token_to_id("<|im_start|>")      # special tokens stay whole


def test_cli_build_and_resolve(tmp_path, capsys):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    assert main(["build", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "out"), "--no-eval", "--quiet"]) == 0
    engine = load_engine(tmp_path / "out")
    assert engine.manifest["source"]["kind"] == "gguf"
    from tokenwire.engine_build.resolve import resolve_model
    path = resolve_model(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache")
    assert load_engine(path).manifest["report"]["tensors"]["embed"]["origin"] == "exact"
    assert main(["build", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "o2"), "--no-eval"]) == 0
    assert "10 exact" in capsys.readouterr().err


# ---- bad files --------------------------------------------------------------------------

def expect_error(path, *fragments):
    with pytest.raises(BuildError) as info:
        open_source(path)
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_truncated_file(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 700])
    expect_error(tmp_path / "cut.gguf", "truncated GGUF file", "runs past the end")
    (tmp_path / "head.gguf").write_bytes(data[:300])
    expect_error(tmp_path / "head.gguf", "GGUF")


def test_unknown_tensor_type(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    expect_error(tmp_path / "bad.gguf", "unknown GGUF tensor type", "99")


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0", shapes={"blk.1.ffn_down.weight": (64, 128)})
    with pytest.raises(BuildError) as info:
        build_engine(open_source(tmp_path / "m.gguf"), tmp_path / "e", BuildOptions(evaluate=False))
    assert str(tmp_path / "m.gguf") in str(info.value)
    assert "'blk.1.ffn_down.weight' has shape [64, 128], the metadata implies [64, 96]" in str(info.value)


def test_metadata_disagrees_with_tensors(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0", meta_overrides=dict(kv_heads=1))
    with pytest.raises(BuildError, match=r"m\.gguf: GGUF tensor 'blk.0.attn_k.weight' has shape \[32, 64\], "
                                         r"the metadata implies \[16, 64\]"):
        build_engine(open_source(tmp_path / "m.gguf"), tmp_path / "e", BuildOptions(evaluate=False))
    write_gguf(tmp_path / "v.gguf", "llama", "Q4_0", meta_overrides=dict(vocab=400))
    expect_error(tmp_path / "v.gguf", "token_embd.weight only 300 rows")


def test_missing_tensor_and_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q4_0", skip={"blk.1.ffn_up.weight"})
    with pytest.raises(BuildError, match="GGUF tensor 'blk.1.ffn_up.weight' is missing"):
        build_engine(open_source(tmp_path / "m.gguf"), tmp_path / "e", BuildOptions(evaluate=False))
    writer = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    expect_error(tmp_path / "f.gguf", "GGUF architecture 'falcon' is not supported")


def test_serve_model_gguf(tmp_path):
    """`tokenwire serve --model model.gguf`: built into the cache, then served (chat template from the file)."""
    import signal

    import httpx
    from test_server_cli import Served
    write_gguf(tmp_path / "tiny.gguf", "qwen2", "Q4_0", chat_template=TEMPLATE)
    served = Served("--backend", "cpu", "--model", str(tmp_path / "tiny.gguf"),
                    env={"TOKENWIRE_CACHE_DIR": str(tmp_path / "cache")}, timeout=240)
    try:
        assert httpx.get(served.url + "/v1/models").json()["data"][0]["id"] == "tiny"
        out = httpx.post(served.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 4}, timeout=120).json()
        assert out["usage"]["completion_tokens"] == 4
        chat = httpx.post(served.url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
        assert chat["usage"]["prompt_tokens"] > 2 and chat["usage"]["completion_tokens"] >= 1
        served.proc.send_signal(signal.SIGTERM)
        assert served.wait() == 0
    finally:
        served.kill()


# ---- a real checkpoint: stories260K written as GGUF ---------------------------------------

def stories_gguf(path, src, qtype: str) -> None:
    """stories260K (llama2.c) as a llama GGUF: tensors in llama.cpp's names and Q/K layout, its
    SentencePiece vocabulary (tok512.model) in the tokenizer metadata."""
    from tokenwire.engine_build.tokenizer_convert import read_sentencepiece_model
    from tokenwire.bench.gguf_random import encode, llama_permute
    c = src.config
    vocab = read_sentencepiece_model(path.parent / "tok512.model") if (path.parent / "tok512.model").exists() else None
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_layers), writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size), writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads), writer.add_head_count_kv(c.num_kv_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps), writer.add_rope_freq_base(c.rope_theta)
    writer.add_tokenizer_model("llama"), writer.add_token_list(vocab.pieces), writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types), writer.add_bos_token_id(vocab.bos_id), writer.add_eos_token_id(vocab.eos_id)
    writer.add_unk_token_id(vocab.unk_id), writer.add_add_bos_token(True)
    t, rng = src.tensors, np.random.default_rng(0)
    def mat(name, w):              # rows not a multiple of 32 wide stay F32, as llama.cpp's quantizer leaves them
        kind = qtype if np.shape(w)[1] % 32 == 0 else "F32"
        writer.add_tensor(name, encode(np.ascontiguousarray(w, dtype=np.float32), kind, rng),
                          raw_dtype=None if kind == "F32" else gguf.GGMLQuantizationType[kind])
    mat("token_embd.weight", t["embed"])
    writer.add_tensor("output_norm.weight", np.asarray(t["norm"], dtype=np.float32))
    for i in range(c.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q, k, v = np.split(np.asarray(t[p + "qkv_proj"]), [c.q_size, c.q_size + c.kv_size])
        gate, up = np.split(np.asarray(t[p + "gate_up_proj"]), 2)
        writer.add_tensor(b + "attn_norm.weight", np.asarray(t[p + "attn_norm"], dtype=np.float32))
        writer.add_tensor(b + "ffn_norm.weight", np.asarray(t[p + "mlp_norm"], dtype=np.float32))
        mat(b + "attn_q.weight", llama_permute(q, c.num_heads)), mat(b + "attn_k.weight", llama_permute(k, c.num_kv_heads))
        mat(b + "attn_v.weight", v), mat(b + "attn_output.weight", t[p + "o_proj"])
        mat(b + "ffn_gate.weight", gate), mat(b + "ffn_up.weight", up), mat(b + "ffn_down.weight", t[p + "down_proj"])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def test_stories260k_as_gguf_reproduces_run_c(tmp_path, stories260k_dir):
    """F32 GGUF of a real checkpoint: its metadata tokenizer encodes the prompt as run.c does and
    the unquantized engine's greedy tokens are run.c's; as Q4_0 the imported matrices are the
    file's bit for bit and the C backend's greedy tokens equal the reference's."""
    import json
    import shutil
    from tokenwire.engine_build.llama2c import import_llama2c
    from tokenwire.engine_build.quantize import QuantOptions
    src = import_llama2c(stories260k_dir / "stories260K.bin")
    shutil.copy(stories260k_dir / "tok512.model", tmp_path / "tok512.model")
    reference = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    prompt, want = reference["prompt_token_ids"], reference["runs"][0]
    stories_gguf(tmp_path / "f32.gguf", src, "F32")
    engine = load_engine(build_engine(open_source(tmp_path / "f32.gguf"), tmp_path / "f32",
                                      BuildOptions(QuantOptions(method="none"), evaluate=False)))
    assert engine.encode_prompt(reference["prompt"]) == prompt
    num_new = want["steps"] - (len(prompt) - 1)
    assert greedy_generate(ReferenceModel(engine.config, engine.tensors), prompt, num_new) == want["generated_token_ids"]
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    stories_gguf(tmp_path / "q4.gguf", src, "Q4_0")
    q4 = open_source(tmp_path / "q4.gguf")
    engine = load_engine(build_engine(q4, tmp_path / "q4", BuildOptions(evaluate=False)))
    origins = {n: r["origin"] for n, r in engine.manifest["report"]["tensors"].items()}
    assert origins["layers.0.qkv_proj"] == origins["embed"] == "exact" and origins["layers.4.down_proj"] == "quantized"
    for name, shape in linear_shapes(q4.config).items():
        if origins[name] == "exact":
            np.testing.assert_array_equal(engine_matrix(engine, name, shape), q4.tensors[name], err_msg=name)
    # down_proj (172 wide) stays F32 in the file and is rounded by the build: the reference runs the engine's weights
    reference_q4 = greedy_generate(ReferenceModel(engine.config, engine.tensors), prompt, 60)
    model = cpu.create_model(engine.config, engine.tensors, block_size=16, num_blocks=64)
    assert greedy_generate(model, prompt, 60) == reference_q4
