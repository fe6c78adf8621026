"""The numpy reference forward: the specification every faster backend is tested against.

Contract:
- `ReferenceModel(config, tensors, block_size, num_blocks)` reads the engine tensors of
  docs/ENGINE_FORMAT.md (dense, int4 or int8; decoded once through kernels/reference.py into
  float32) and owns a paged KV cache.
- `forward(batch)` runs one step over a `ForwardBatch`: prefill chunks and decode tokens of
  many sequences in one flat batch. Each new token's K/V is written to its cache slot first;
  then every token attends to the cached positions of its own sequence up to and including
  itself (causal, optionally a sliding window), gathered through the block table. A prefill
  chunk therefore sees the earlier chunks already in the cache. Returns float32 logits
  `[S_sample, vocab]` for `batch.logits_indices` only.
- Family quirks are plain config fields (core/config.py); nothing branches on a family name:
  per-head q/k RMSNorm before RoPE (`qk_norm`), norms on the attention and MLP outputs before
  the residual adds (`post_norms`), the softmax scale, attention-logit and final-logit
  soft-capping (`cap * tanh(x / cap)`), and per-layer sliding windows and RoPE bases.

Clarity over speed: one Python loop over layers; attention is one padded call for all the
step's decode tokens plus one call per prefill chunk; everything else is a whole-batch
matrix product. All math is float32; RoPE angles float64. Weights are decoded to float32
once at load, so an INT4 engine runs exactly the function its dequantized weights define.
"""

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from ..core.config import ModelConfig
from ..core.executor import SeqStep
from ..core.options import DEFAULTS
from ..core.sampling_params import SamplingParams
from .engine_format import linear_shapes, vector_shapes
from .forward_batch import ForwardBatch, build_forward_batch
from .reference import dequantize_int4, dequantize_int8
from .rope import apply_rope, rope_cos_sin, rope_inv_freq


def decode_weight(tensors: Mapping[str, np.ndarray], name: str, shape: tuple) -> np.ndarray:
    """One matrix weight in any engine encoding -> float32 [N, K]."""
    try:
        if f"{name}.weight" in tensors:
            w = np.asarray(tensors[f"{name}.weight"], dtype=np.float32)
        elif f"{name}.zeros" in tensors:
            w = dequantize_int4(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"], shape[1])
        elif f"{name}.qweight" in tensors:
            w = dequantize_int8(tensors[f"{name}.qweight"], tensors[f"{name}.scales"])
        else:
            raise KeyError(f"engine tensor {name!r} is missing: expected {name}.weight or {name}.qweight")
    except (AssertionError, ValueError) as exc:       # parts of mismatched dtype or shape
        raise ValueError(f"engine tensor {name!r} is not a valid encoding: {exc or 'inconsistent parts'}") from None
    if w.shape != tuple(shape):
        raise ValueError(f"engine tensor {name!r} has shape {list(w.shape)}, the config needs {list(shape)}")
    return w


def decode_vector(tensors: Mapping[str, np.ndarray], name: str, shape: tuple) -> np.ndarray:
    if name not in tensors:
        raise KeyError(f"engine tensor {name!r} is missing")
    v = np.asarray(tensors[name], dtype=np.float32)
    if v.shape != tuple(shape):
        raise ValueError(f"engine tensor {name!r} has shape {list(v.shape)}, the config needs {list(shape)}")
    return v


@dataclass
class LayerWeights:
    attn_norm: np.ndarray             # float32 [D]
    qkv_proj: np.ndarray              # float32 [Hq*hd + 2*Hkv*hd, D]
    qkv_bias: Optional[np.ndarray]    # float32 [Hq*hd + 2*Hkv*hd], or None
    o_proj: np.ndarray                # float32 [D, Hq*hd]
    mlp_norm: np.ndarray              # float32 [D]
    gate_up_proj: np.ndarray          # float32 [2*I, D]
    down_proj: np.ndarray             # float32 [D, I]
    q_norm: Optional[np.ndarray] = None         # float32 [hd] (qk_norm)
    k_norm: Optional[np.ndarray] = None         # float32 [hd]
    post_attn_norm: Optional[np.ndarray] = None  # float32 [D] (post_norms)
    post_mlp_norm: Optional[np.ndarray] = None   # float32 [D]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, D] -> [T, D]; x / sqrt(mean(x^2) + eps) * weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


ACTIVATION_FNS = {"silu": silu, "gelu_tanh": gelu_tanh}


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def attention_mask(positions: np.ndarray, context_len: int, sliding_window: Optional[int]) -> np.ndarray:
    """positions [..., n] of the queries -> bool [..., n, context_len]: key j is visible to a query at p."""
    keys = np.arange(context_len)
    visible = keys <= positions[..., None]
    if sliding_window is not None:
        visible &= keys > positions[..., None] - sliding_window   # the last `sliding_window` positions, self included
    return visible


def softcap(x: np.ndarray, cap: Optional[float]) -> np.ndarray:
    """Gemma 2's soft-capping: cap * tanh(x / cap), float32; identity when cap is None."""
    return x if cap is None else np.float32(cap) * np.tanh(x / np.float32(cap))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, positions, sliding_window, scale,
                    logit_cap: Optional[float] = None):
    """S sequences' n new queries each against their cached keys/values, gathered by block table.

    q: [S, n, Hq, hd]; positions: [S, n]; context_lens: [S];
    block_tables: [S, >= ceil(max(context_lens) / block_size)] physical blocks in position order;
    k_cache/v_cache: [num_blocks, block_size, Hkv, hd] (one layer).  -> [S, n, Hq * hd]
    Keys past a sequence's own context (padding up to the longest) are masked out.
    """
    S, n, num_heads, hd = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    C = int(context_lens.max())
    nb = -(-C // block_size)
    k = k_cache[block_tables[:, :nb]].reshape(S, nb * block_size, num_kv_heads, hd)[:, :C]    # [S, C, Hkv, hd]
    v = v_cache[block_tables[:, :nb]].reshape(S, nb * block_size, num_kv_heads, hd)[:, :C]    # [S, C, Hkv, hd]
    v = np.where((np.arange(C) < context_lens[:, None])[:, :, None, None], v, 0)  # padding slots may hold anything
    group = num_heads // num_kv_heads                                      # query heads per KV head (GQA)
    # [S, Hkv, group*n, hd] @ [S, Hkv, hd, C]: one GEMM per (sequence, KV head)
    qg = q.reshape(S, n, num_kv_heads, group, hd).transpose(0, 2, 3, 1, 4).reshape(S, num_kv_heads, group * n, hd)
    scores = softcap((qg @ k.transpose(0, 2, 3, 1)) * scale, logit_cap)    # [S, Hkv, group*n, C]
    mask = np.tile(attention_mask(positions, C, sliding_window), (1, group, 1))   # [S, group*n, C], rows (group, n)
    probs = softmax(np.where(mask[:, None], scores, -np.inf))
    out = probs @ v.transpose(0, 2, 1, 3)                                  # [S, Hkv, group*n, hd]
    return out.reshape(S, num_kv_heads, group, n, hd).transpose(0, 3, 1, 2, 4).reshape(S, n, num_heads * hd)


class ReferenceModel:
    """Paged-KV numpy forward over engine tensors; see the module docstring."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray],
                 block_size: int = DEFAULTS.block_size, num_blocks: Optional[int] = None):
        c = config
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.block_size = block_size
        # default: room for 4 sequences of the full context
        self.num_blocks = num_blocks or 4 * -(-c.max_position_embeddings // block_size)
        self.load_weights(tensors)
        self.inv_freq = [rope_inv_freq(c, c.layer_rope_theta(i)) for i in range(c.num_layers)]   # float64 [hd/2] each
        self.act = ACTIVATION_FNS[c.activation]
        cache_shape = (c.num_layers, self.num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = np.zeros(cache_shape, dtype=np.float32)   # [L, num_blocks, block_size, Hkv, hd]
        self.v_cache = np.zeros(cache_shape, dtype=np.float32)   # [L, num_blocks, block_size, Hkv, hd]

    def load_weights(self, tensors: Mapping[str, np.ndarray]) -> None:
        c, mats, vecs = self.config, linear_shapes(self.config), vector_shapes(self.config)
        self.embed = decode_weight(tensors, "embed", mats["embed"])              # [V, D]
        self.lm_head = self.embed if c.tie_word_embeddings else decode_weight(tensors, "lm_head", mats["lm_head"])
        self.norm = decode_vector(tensors, "norm", vecs["norm"])                 # [D]
        self.layers = [self.load_layer(tensors, f"layers.{i}", mats, vecs) for i in range(c.num_layers)]

    def load_layer(self, tensors, prefix, mats, vecs) -> LayerWeights:
        def mat(n):
            return decode_weight(tensors, f"{prefix}.{n}", mats[f"{prefix}.{n}"])

        def vec(n):
            return decode_vector(tensors, f"{prefix}.{n}", vecs[f"{prefix}.{n}"])
        c = self.config
        bias = vec("qkv_bias") if c.qkv_bias else None
        qk = (vec("q_norm"), vec("k_norm")) if c.qk_norm else (None, None)
        post = (vec("post_attn_norm"), vec("post_mlp_norm")) if c.post_norms else (None, None)
        return LayerWeights(vec("attn_norm"), mat("qkv_proj"), bias, mat("o_proj"),
                            vec("mlp_norm"), mat("gate_up_proj"), mat("down_proj"), *qk, *post)

    # ---------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """One engine step (hot path: once per step). -> float32 [S_sample, vocab]"""
        self.check_batch(batch)
        c = self.config
        x = self.embed[batch.token_ids] * np.float32(c.embedding_multiplier)     # [T, D]
        for i, layer in enumerate(self.layers):
            cos, sin = rope_cos_sin(self.inv_freq[i], batch.positions)            # [T, hd/2] each
            x = x + self.attention_block(i, layer, x, batch, cos, sin)
            x = x + self.mlp_block(i, layer, x)
        h = rms_norm(x[batch.logits_indices], self.norm, c.rms_norm_eps)         # [S_sample, D]
        return softcap(self.linear(-1, "lm_head", h, self.lm_head), c.final_logit_softcap)   # [S_sample, V]

    def attention_block(self, i: int, layer: LayerWeights, x, batch: ForwardBatch, cos, sin) -> np.ndarray:
        c, T = self.config, batch.num_tokens
        h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)                               # [T, D]
        qkv = self.linear(i, "qkv_proj", h, layer.qkv_proj)                            # [T, q + 2kv]
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q = qkv[:, :c.q_size].reshape(T, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(T, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].reshape(T, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:                                                   # per head, over hd
            q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.write_kv(i, k, v, batch.slot_mapping)
        out = np.empty((T, c.q_size), dtype=np.float32)                                 # [T, Hq*hd]
        lens = np.diff(batch.seq_starts)
        decode = np.flatnonzero(lens == 1)          # one-token sequences: all in one padded call
        if len(decode):
            rows = batch.seq_starts[decode]
            out[rows] = self.attend(i, q[rows][:, None], batch, decode)[:, 0]
        for s in np.flatnonzero(lens > 1):          # prefill chunks: one call each
            a, b = batch.seq_starts[s], batch.seq_starts[s + 1]
            out[a:b] = self.attend(i, q[a:b][None], batch, [s])[0]
        o = self.linear(i, "o_proj", out, layer.o_proj)                                # [T, D]
        return o if layer.post_attn_norm is None else rms_norm(o, layer.post_attn_norm, c.rms_norm_eps)

    def attend(self, i: int, q: np.ndarray, batch: ForwardBatch, seqs) -> np.ndarray:
        """q: [S', n, Hq, hd] of the sequences `seqs` (n new tokens each) -> [S', n, Hq*hd]"""
        c, starts = self.config, batch.seq_starts[seqs]
        positions = batch.positions[starts[:, None] + np.arange(q.shape[1])]              # [S', n]
        return paged_attention(q, self.k_cache[i], self.v_cache[i], batch.block_tables[seqs], batch.context_lens[seqs],
                               positions, c.layer_window(i), np.float32(c.softmax_scale), c.attn_logit_softcap)

    def mlp_block(self, i: int, layer: LayerWeights, x) -> np.ndarray:
        h = rms_norm(x, layer.mlp_norm, self.config.rms_norm_eps)                      # [T, D]
        gate_up = self.linear(i, "gate_up_proj", h, layer.gate_up_proj)                # [T, 2I]
        gate, up = np.split(gate_up, 2, axis=-1)
        y = self.linear(i, "down_proj", self.act(gate) * up, layer.down_proj)          # [T, D]
        return y if layer.post_mlp_norm is None else rms_norm(y, layer.post_mlp_norm, self.config.rms_norm_eps)

    def linear(self, layer: int, name: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x: [T, K] @ w.T -> [T, N]. One seam for every projection (the quantizer's calibration
        subclass records its inputs here); `layer` is -1 for lm_head."""
        return x @ w.T

    def write_kv(self, i: int, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
        """k, v: [T, Hkv, hd] into layer i's cache at the flat slots (block * block_size + offset)."""
        c = self.config
        flat = (self.num_blocks * self.block_size, c.num_kv_heads, c.head_dim)
        self.k_cache[i].reshape(flat)[slot_mapping] = k
        self.v_cache[i].reshape(flat)[slot_mapping] = v

    def check_batch(self, batch: ForwardBatch) -> None:
        """Cheap bounds checks, so a bad batch fails with its problem named, not deep in numpy."""
        if batch.num_tokens and not (0 <= batch.token_ids.min() and batch.token_ids.max() < self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        needed = -(-batch.context_lens // self.block_size)
        if batch.num_seqs and needed.max() > batch.block_tables.shape[1]:
            raise ValueError("a block table is shorter than its sequence's context")
        if batch.num_seqs and batch.block_tables.max() >= self.num_blocks:
            raise ValueError(f"block id out of range: the cache has {self.num_blocks} blocks")
        if batch.num_tokens and not (0 <= batch.slot_mapping.min()
                                     and batch.slot_mapping.max() < self.num_blocks * self.block_size):
            raise ValueError(f"KV slot out of range: the cache has {self.num_blocks} blocks of {self.block_size}")


# ------------------------------------------------------------ single-sequence helpers
# For tests, the quantizer's calibration and the error report: one sequence at a time,
# laid out in blocks 0, 1, 2, ... of the cache.

def sequence_logits(model: ReferenceModel, token_ids: Sequence[int]) -> np.ndarray:
    """Prefill one sequence from position 0 and return the logits of every position. -> [T, V]"""
    n = len(token_ids)
    steps = [_step(token_ids, 0, model.block_size, sample=True)]
    batch = build_forward_batch(steps, model.block_size)
    return model.forward(batch._replace(logits_indices=np.arange(n, dtype=np.int32)))


def greedy_generate(model: ReferenceModel, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] = ()) -> list:
    """Prefill the prompt, then decode one token per step, argmax. -> generated ids (stop id included)."""
    ids = list(prompt_ids)
    out = []
    feed, start = ids, 0
    for _ in range(max_new_tokens):
        batch = build_forward_batch([_step(feed, start, model.block_size, sample=True)], model.block_size)
        next_id = int(np.argmax(model.forward(batch)[0]))
        out.append(next_id)
        if next_id in stop_ids:
            break
        start += len(feed)
        feed = [next_id]
    return out


def _step(token_ids, start_pos, block_size, sample):
    end = start_pos + len(token_ids)
    blocks = list(range(-(-end // block_size)))
    return SeqStep(0, list(token_ids), start_pos, blocks, sample, SamplingParams(temperature=0.0), 0, [], [])
