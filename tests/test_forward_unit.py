"""Unit tests of the numpy reference forward's parts against direct formulas, and of its
paged-cache bookkeeping (scattered blocks, chunked prefill, mixed batches) against itself
run the plain way. The transformers comparison lives in test_forward_hf.py."""

import math

import numpy as np
import pytest

from tokenwire.core.config import ModelConfig, RopeScaling
from tokenwire.core.executor import SeqStep
from tokenwire.kernels.forward_batch import build_forward_batch
from tokenwire.kernels.engine_format import linear_shapes, vector_shapes
from tokenwire.kernels.model import ReferenceModel, attention_mask, paged_attention, sequence_logits
from tokenwire.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.kernels.reference import dequantize_int4


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_tensors(config: ModelConfig, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    t = {f"{n}.weight": (rng.standard_normal(s) / math.sqrt(s[1]) * 2).astype(np.float32)
         for n, s in linear_shapes(config).items()}
    t["embed.weight"] = rng.standard_normal(linear_shapes(config)["embed"]).astype(np.float32)
    for n, s in vector_shapes(config).items():
        t[n] = (1 + 0.1 * rng.standard_normal(s)).astype(np.float32)
    return t


def seq_step(token_ids, start_pos, block_table, sample=True, seq_id=0):
    return SeqStep(seq_id, list(token_ids), start_pos, list(block_table), sample,
                   SamplingParams(temperature=0.0), 0, [], [])


# ------------------------------------------------------------------ RoPE

def test_rope_is_a_complex_rotation_of_half_pairs():
    cfg = tiny_config(rope_theta=500.0)
    rng = np.random.default_rng(1)
    positions = np.array([0, 1, 7, 100], dtype=np.int32)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), positions)
    got = apply_rope(x, cos, sin)
    for t, p in enumerate(positions):
        for h in range(3):
            for j in range(4):
                z = complex(x[t, h, j], x[t, h, j + 4]) * complex(math.cos(p * 500.0 ** (-2 * j / 8)),
                                                                   math.sin(p * 500.0 ** (-2 * j / 8)))
                assert got[t, h, j] == pytest.approx(z.real, abs=1e-5)
                assert got[t, h, j + 4] == pytest.approx(z.imag, abs=1e-5)


def test_llama3_scaling_per_frequency():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    cfg = tiny_config(head_dim=16, rope_theta=10000.0, rope_scaling=scaling)
    got = rope_inv_freq(cfg)
    for j, f in enumerate(10000.0 ** (-np.arange(0, 16, 2) / 16)):
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4:
            want = f
        elif wavelen > 64 / 1:
            want = f / 8
        else:
            smooth = (64 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert got[j] == pytest.approx(want, rel=1e-12)
    assert got[0] == rope_inv_freq(tiny_config(head_dim=16))[0]          # highest frequency untouched
    assert got[-1] == pytest.approx(rope_inv_freq(tiny_config(head_dim=16))[-1] / 8)


# ------------------------------------------------------------------ attention

def dense_attention(q, k, v, window=None):
    """q: [n, Hq, hd], k/v: [n, Hkv, hd], queries at positions 0..n-1. Plain loops."""
    n, hq, hd = q.shape
    group = hq // k.shape[1]
    out = np.zeros((n, hq, hd))
    for h in range(hq):
        for i in range(n):
            js = [j for j in range(i + 1) if window is None or i - j < window]
            s = np.array([q[i, h] @ k[j, h // group] for j in js]) / math.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(pj * v[j, h // group] for pj, j in zip(p, js))
    return out.reshape(n, hq * hd)


@pytest.mark.parametrize("num_kv_heads,window", [(4, None), (2, None), (1, None), (2, 5)])
def test_paged_attention_matches_dense_causal(num_kv_heads, window):
    rng = np.random.default_rng(2)
    n, hq, hd, block_size = 13, 4, 8, 4
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    k = rng.standard_normal((n, num_kv_heads, hd)).astype(np.float32)
    v = rng.standard_normal((n, num_kv_heads, hd)).astype(np.float32)
    block_table = np.array([6, 1, 4, 0], dtype=np.int32)               # scattered, not in order
    k_cache = np.full((8, block_size, num_kv_heads, hd), np.nan, dtype=np.float32)  # unused slots poison
    v_cache = k_cache.copy()
    for p in range(n):
        k_cache[block_table[p // block_size], p % block_size] = k[p]
        v_cache[block_table[p // block_size], p % block_size] = v[p]
    table, ctx = block_table[None], np.array([n])
    got = paged_attention(q[None], k_cache, v_cache, table, ctx, np.arange(n)[None], window, np.float32(hd ** -0.5))[0]
    np.testing.assert_allclose(got, dense_attention(q, k, v, window), atol=1e-5)
    # the last 3 queries alone (a later chunk) see the same cache and give the same rows
    tail = paged_attention(q[None, -3:], k_cache, v_cache, table, ctx, np.arange(n - 3, n)[None], window,
                           np.float32(hd ** -0.5))[0]
    np.testing.assert_allclose(tail, got[-3:], atol=1e-6)
    # one query per sequence for several sequences of different lengths (the decode path), padded to
    # the longest: each sees only its own context, never the (NaN) slots past it
    lens = np.array([n, 5, 1, 9])
    tables = np.stack([block_table, block_table[[0, 1, 3, 2]], block_table, block_table])
    queries = np.stack([q[n - 1], q[4], q[0], q[8]])[:, None]                     # [4, 1, Hq, hd]
    got = paged_attention(queries, k_cache, v_cache, tables, lens, (lens - 1)[:, None], window,
                          np.float32(hd ** -0.5))[:, 0]
    np.testing.assert_allclose(got[0], dense_attention(q, k, v, window)[n - 1], atol=1e-5)
    np.testing.assert_allclose(got[1], dense_attention(q[:5], k[:5], v[:5], window)[4], atol=1e-5)
    np.testing.assert_allclose(got[2], dense_attention(q[:1], k[:1], v[:1], window)[0], atol=1e-5)
    np.testing.assert_allclose(got[3], dense_attention(q[:9], k[:9], v[:9], window)[8], atol=1e-5)


def test_sliding_window_mask_keeps_last_w_positions():
    mask = attention_mask(np.array([0, 5, 9]), 10, 3)
    assert mask[0].nonzero()[0].tolist() == [0]
    assert mask[1].nonzero()[0].tolist() == [3, 4, 5]
    assert mask[2].nonzero()[0].tolist() == [7, 8, 9]


# ------------------------------------------------------------------ whole model, paged bookkeeping

@pytest.fixture(scope="module", params=["llama", "gemma_like", "qwen_like_window"])
def model_pair(request):
    cfg = {"llama": tiny_config(),
           "gemma_like": tiny_config(activation="gelu_tanh", embedding_multiplier=math.sqrt(32), num_kv_heads=1,
                                     head_dim=16, tie_word_embeddings=True),
           "qwen_like_window": tiny_config(qkv_bias=True, sliding_window=6)}[request.param]
    tensors = random_tensors(cfg)
    return cfg, tensors


def test_mixed_batch_with_scattered_blocks_matches_one_sequence_at_a_time(model_pair):
    cfg, tensors = model_pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 3, 20)]
    want = [sequence_logits(ReferenceModel(cfg, tensors, block_size=4), p) for p in prompts]

    model = ReferenceModel(cfg, tensors, block_size=4, num_blocks=32)
    tables = np.random.default_rng(4).permutation(32).reshape(4, 8)[:3].tolist()   # disjoint, shuffled
    # step 1: seq 0 prefills its first chunk of 7 (no sample), seq 1 all 3, seq 2 the first 9
    step1 = [seq_step(prompts[0][:7], 0, tables[0], sample=False, seq_id=0),
             seq_step(prompts[1], 0, tables[1], seq_id=1),
             seq_step(prompts[2][:9], 0, tables[2], sample=False, seq_id=2)]
    logits = model.forward(build_forward_batch(step1, 4))
    np.testing.assert_allclose(logits[0], want[1][-1], atol=1e-4)
    # step 2: the remaining chunks, plus a decode token for seq 1
    step2 = [seq_step(prompts[0][7:], 7, tables[0], seq_id=0),
             seq_step([5], 3, tables[1], seq_id=1),
             seq_step(prompts[2][9:], 9, tables[2], seq_id=2)]
    logits = model.forward(build_forward_batch(step2, 4))
    np.testing.assert_allclose(logits[0], want[0][-1], atol=1e-4)
    np.testing.assert_allclose(logits[2], want[2][-1], atol=1e-4)
    np.testing.assert_allclose(logits[1], sequence_logits(ReferenceModel(cfg, tensors, 4), prompts[1] + [5])[-1],
                               atol=1e-4)


def test_decode_steps_match_full_prefill(model_pair):
    cfg, tensors = model_pair
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 18).tolist()
    want = sequence_logits(ReferenceModel(cfg, tensors, block_size=8), ids)      # [18, V]
    model = ReferenceModel(cfg, tensors, block_size=8, num_blocks=6)
    table = [5, 2, 3]
    got = [model.forward(build_forward_batch([seq_step(ids[:10], 0, table)], 8))[0]]
    for p in range(10, 18):
        got.append(model.forward(build_forward_batch([seq_step([ids[p]], p, table)], 8))[0])
    np.testing.assert_allclose(np.stack(got), want[9:], atol=1e-4)


def test_int4_tensors_decode_to_their_dequantized_weights():
    cfg = tiny_config(hidden_size=40)                      # K = 40: padded to 64 with G = 32
    rng = np.random.default_rng(6)
    tensors = random_tensors(cfg)
    n, k = linear_shapes(cfg)["layers.0.qkv_proj"]
    qweight = rng.integers(0, 256, (n, 32), dtype=np.uint8)
    scales = (rng.random((n, 2)) * 0.1).astype(np.float16)
    zeros = np.full((n, 2), 8, dtype=np.float16)
    del tensors["layers.0.qkv_proj.weight"]
    tensors.update({"layers.0.qkv_proj.qweight": qweight, "layers.0.qkv_proj.scales": scales,
                    "layers.0.qkv_proj.zeros": zeros})
    model = ReferenceModel(cfg, tensors)
    np.testing.assert_array_equal(model.layers[0].qkv_proj, dequantize_int4(qweight, scales, zeros, k))


def test_int8_embedding():
    cfg = tiny_config(tie_word_embeddings=True)
    tensors = random_tensors(cfg)
    q = np.random.default_rng(7).integers(-127, 128, (97, 32)).astype(np.int8)
    s = np.linspace(0.01, 0.02, 97).astype(np.float16)
    del tensors["embed.weight"]
    tensors.update({"embed.qweight": q, "embed.scales": s})
    model = ReferenceModel(cfg, tensors)
    np.testing.assert_allclose(model.embed[3], q[3] * np.float32(s[3]))
    assert model.lm_head is model.embed


# ------------------------------------------------------------------ bad input

def test_missing_and_misshapen_tensors_are_named():
    cfg = tiny_config()
    tensors = random_tensors(cfg)
    del tensors["layers.1.down_proj.weight"]
    with pytest.raises(KeyError, match="layers.1.down_proj"):
        ReferenceModel(cfg, tensors)
    tensors = random_tensors(cfg)
    tensors["norm"] = np.ones(31, dtype=np.float32)
    with pytest.raises(ValueError, match="'norm' has shape \\[31\\]"):
        ReferenceModel(cfg, tensors)


def test_inconsistent_int4_parts_are_named():
    cfg = tiny_config()
    tensors = random_tensors(cfg)
    n, _ = linear_shapes(cfg)["layers.0.o_proj"]
    del tensors["layers.0.o_proj.weight"]
    tensors.update({"layers.0.o_proj.qweight": np.zeros((n, 16), dtype=np.uint8),
                    "layers.0.o_proj.scales": np.ones((n, 1), dtype=np.float16),
                    "layers.0.o_proj.zeros": np.ones((n, 2), dtype=np.float16)})      # zeros disagree with scales
    with pytest.raises(ValueError, match="'layers.0.o_proj' is not a valid encoding"):
        ReferenceModel(cfg, tensors)


def test_bad_batches_are_rejected_with_the_problem_named():
    cfg = tiny_config()
    model = ReferenceModel(cfg, random_tensors(cfg), block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="token id out of range"):
        model.forward(build_forward_batch([seq_step([1, 97], 0, [0])], 4))
    with pytest.raises(ValueError, match="block id out of range"):
        model.forward(build_forward_batch([seq_step([1, 2], 0, [9])], 4))
    with pytest.raises(ValueError, match="shorter than its sequence"):
        batch = build_forward_batch([seq_step([1] * 3, 0, [0])], 4)
        model.forward(batch._replace(context_lens=np.array([6], dtype=np.int32)))
