"""The C forward as the CPU backend's forward object.

Contract: `CpuModel(config, tensors, block_size, num_blocks, activations="fp32")` takes the
same arguments as `kernels.model.ReferenceModel` and has the same `forward(ForwardBatch) ->
float32 [S_sample, vocab]`, with its own float32 paged KV cache of `num_blocks` x
`block_size`, so `kernels.model_runner.ModelRunner` drives either. One call runs the whole step
in C (kernels/cpu/src/model.c) on the thread pool with the GIL released.

`activations="fp32"` matches the reference to float32 accumulation order (the stories260K
greedy tokens are identical); `"int8"` runs the INT4 products on int8-quantized activations
(the VNNI batch path; see `kernels.cpu.int8_error_bound`).

Weights: INT4 matrices are repacked once into the kernels' tiled layout (memory the model
owns); dense (fp32 / fp16) and int8 matrices are read in place from the given arrays (the
engine's mmap), which the model keeps alive.
"""

from typing import Mapping, Optional

import numpy as np

from ...core.config import ModelConfig
from ...core.options import DEFAULTS
from ..engine_format import linear_shapes, vector_shapes
from ..forward_batch import ForwardBatch
from ..rope import rope_inv_freq
from .ext import PRECISIONS, _cpu, _require

LAYER_MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LAYER_VECTORS = ("attn_norm", "mlp_norm", "qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


class CpuModel:
    """The C forward over engine tensors; see the module docstring."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray],
                 block_size: int = DEFAULTS.block_size, num_blocks: Optional[int] = None, *, activations: str = "fp32",
                 threads: Optional[int] = None):
        _require()
        if activations not in PRECISIONS:
            raise ValueError(f"activations must be one of {PRECISIONS}, got {activations!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        c = config
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks or 4 * -(-c.max_position_embeddings // block_size)   # as ReferenceModel
        self.activations = activations
        # None: each step uses as many pool threads as its work is worth (a tiny model's decode
        # step runs on one: barriers would cost more than they save); n: at most n.
        self.threads = threads
        self._model = _cpu.Model(c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
                                 c.head_dim, c.vocab_size, c.activation, c.sliding_window or 0, c.rms_norm_eps,
                                 c.embedding_multiplier, rope_inv_freq(c), block_size, self.num_blocks, activations)
        self._set_attention(c)
        self._load(tensors)

    def _set_attention(self, c: ModelConfig) -> None:
        """Per-layer windows and RoPE bases, the softmax scale and the soft caps (core/config.py)."""
        windows = np.array([c.layer_window(i) or 0 for i in range(c.num_layers)], dtype=np.int32)
        local = np.array([c.layer_rope_theta(i) != c.rope_theta for i in range(c.num_layers)], dtype=np.uint8)
        inv_local = rope_inv_freq(c, c.rope_local_theta) if local.any() else None
        self._model.set_attention(float(np.float32(c.softmax_scale)), c.attn_logit_softcap or 0.0,
                                  c.final_logit_softcap or 0.0, windows, local, inv_local)

    def _load(self, tensors: Mapping[str, np.ndarray]) -> None:
        c, shapes = self.config, linear_shapes(self.config)
        self._vector_shapes = vector_shapes(c)
        self._set_matrix(tensors, "embed", -1, shapes["embed"])
        if not c.tie_word_embeddings:
            self._set_matrix(tensors, "lm_head", -1, shapes["lm_head"])
        self._set_vector(tensors, "norm", -1)
        for i in range(c.num_layers):
            for name in LAYER_MATRICES:
                self._set_matrix(tensors, f"layers.{i}.{name}", i, shapes[f"layers.{i}.{name}"])
            for name in LAYER_VECTORS:
                if f"layers.{i}.{name}" in self._vector_shapes:
                    self._set_vector(tensors, f"layers.{i}.{name}", i)

    def _set_matrix(self, tensors, full_name: str, layer: int, shape: tuple) -> None:
        """One matrix in whichever engine encoding it has (docs/ENGINE_FORMAT.md)."""
        slot = full_name.rsplit(".", 1)[-1]
        if f"{full_name}.weight" in tensors:
            w = tensors[f"{full_name}.weight"]
            if w.dtype not in (np.float32, np.float16):
                w = np.asarray(w, dtype=np.float32)
            self._model.set_dense(slot, layer, np.ascontiguousarray(w))
        elif f"{full_name}.zeros" in tensors:
            self._model.set_int4(slot, layer, *(np.ascontiguousarray(tensors[f"{full_name}.{p}"])
                                                for p in ("qweight", "scales", "zeros")))
        elif f"{full_name}.qweight" in tensors:
            self._model.set_int8(slot, layer, np.ascontiguousarray(tensors[f"{full_name}.qweight"]),
                                 np.ascontiguousarray(tensors[f"{full_name}.scales"]))
        else:
            raise KeyError(f"engine tensor {full_name!r} is missing: expected {full_name}.weight or {full_name}.qweight")

    def _set_vector(self, tensors, full_name: str, layer: int) -> None:
        if full_name not in tensors:
            raise KeyError(f"engine tensor {full_name!r} is missing")
        want = self._vector_shapes[full_name]
        v = np.ascontiguousarray(tensors[full_name], dtype=np.float32)
        if v.shape != want:
            raise ValueError(f"engine tensor {full_name!r} has shape {list(v.shape)}, the config needs {list(want)}")
        self._model.set_vector(full_name.rsplit(".", 1)[-1], layer, v)

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of matrix weights one decode step reads: every layer's products plus lm_head."""
        return self._model.weight_bytes_per_token

    def profile(self, reset: bool = False) -> dict:
        """Where thread 0's time went, summed over the steps since the last reset:
        {"steps": n, "step_ns": total, stage: ns} for the stages of kernels/cpu/src/model.h."""
        return self._model.profile(reset)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """One engine step (hot path: once per step). -> float32 [S_sample, vocab]"""
        logits = np.empty((len(batch.logits_indices), self.config.vocab_size), dtype=np.float32)
        self._model.forward(*self._arrays(batch), logits, self.threads or 0)
        return logits

    def forward_argmax(self, batch: ForwardBatch) -> tuple:
        """`forward`, plus each logits row's argmax (int32 [S_sample]) found inside the lm_head
        product while its outputs are in cache: np.argmax(logits, axis=1) exactly, ties (first
        maximum) and NaN (the first NaN) included, without a second pass over [S, vocab]."""
        logits = np.empty((len(batch.logits_indices), self.config.vocab_size), dtype=np.float32)
        ids = np.empty(len(batch.logits_indices), dtype=np.int32)
        self._model.forward(*self._arrays(batch), logits, self.threads or 0, ids)
        return logits, ids

    @staticmethod
    def _arrays(batch: ForwardBatch) -> tuple:
        arrays = (batch.token_ids, batch.positions, batch.seq_starts, batch.context_lens, batch.block_tables,
                  batch.slot_mapping, batch.logits_indices)
        return tuple(np.ascontiguousarray(a, dtype=np.int32) for a in arrays)
