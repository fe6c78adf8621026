"""Calibration for the quantizer: record each projection's input activations on real text,
and fold AWQ's per-channel scales exactly into the float model.

Contract:
- `capture_activations(config, tensors, sequences)` runs the float reference forward
  (kernels/model.py) over token sequences and returns `{projection name: Activations}`, the
  inputs of every qkv/o/gate_up/down projection (and lm_head), split into rows the searches
  fit on and held-out rows the report measures on.
- `fold_awq_layer(config, i, weights, vectors, acts, search)` rewrites one layer's float weights in place
  so the model computes the same function while each projection's input channels are
  rescaled for quantization; it returns each projection's row and column scales, so the
  report can map a quantized weight back to the original basis.
- `default_calibration_text()` / `default_eval_text()`: the shipped texts (engine_build/data/),
  short original children's stories (in distribution for stories260K; plain English for
  any other model). The eval text is a different set of stories, never calibrated on.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from tqdm import tqdm

from ..core.config import ModelConfig
from ..core.errors import BuildError
from ..kernels.model import ReferenceModel, sequence_logits

DATA_DIR = Path(__file__).resolve().parent / "data"
MAX_ROWS = 4096                 # activation rows kept per projection (evenly subsampled beyond)
HELD_OUT_FRACTION = 0.25        # the last quarter of the rows (the end of the text) is never fitted on


def default_calibration_text() -> str:
    return (DATA_DIR / "calibration.txt").read_text(encoding="utf-8")


def default_eval_text() -> str:
    return (DATA_DIR / "eval.txt").read_text(encoding="utf-8")


def split_sequences(token_ids: Sequence[int], max_len: int) -> list:
    """One long id list -> consecutive windows of at most max_len ids (each run from position 0)."""
    ids = list(token_ids)
    return [ids[i:i + max_len] for i in range(0, len(ids), max_len) if len(ids[i:i + max_len]) > 1]


@dataclass
class Activations:
    fit: np.ndarray                 # float32 [T_fit, K] rows the searches use
    held_out: np.ndarray            # float32 [T_held, K] rows only the report measures on


class _RecordingModel(ReferenceModel):
    """The reference forward, with every projection's input appended to `self.records`."""

    def __init__(self, *args, **kwargs):
        self.records = {}                   # projection name -> [float32 [T, K] per forward]
        super().__init__(*args, **kwargs)

    def linear(self, layer, name, x, w):
        key = "lm_head" if layer < 0 else f"layers.{layer}.{name}"
        self.records.setdefault(key, []).append(np.array(x, dtype=np.float32))
        return super().linear(layer, name, x, w)


def capture_activations(config: ModelConfig, engine_tensors: Mapping[str, np.ndarray],
                        sequences: Sequence[Sequence[int]], progress: bool = False) -> dict:
    """-> {projection name: Activations}, from the float model (dense engine tensors) run over each sequence."""
    if not sequences or sum(len(s) for s in sequences) < 8:
        raise BuildError(None, "calibration needs at least 8 tokens of text")
    longest = max(len(s) for s in sequences)
    if longest > config.max_position_embeddings:
        raise BuildError(None, f"a calibration sequence has {longest} tokens, more than the model's "
                               f"{config.max_position_embeddings} positions (use split_sequences)")
    model = _RecordingModel(config, engine_tensors, block_size=16, num_blocks=-(-longest // 16))
    for seq in tqdm(sequences, desc="calibrating", unit="seq", disable=not progress):
        sequence_logits(model, seq)
    return {key: _split(np.concatenate(rows)) for key, rows in model.records.items()}


def _split(x: np.ndarray) -> Activations:
    if len(x) > MAX_ROWS:
        x = x[np.linspace(0, len(x) - 1, MAX_ROWS).astype(np.int64)]
    cut = max(1, int(round(len(x) * (1 - HELD_OUT_FRACTION))))
    return Activations(fit=x[:cut], held_out=x[cut:] if cut < len(x) else x[:cut])


def fold_awq_layer(config: ModelConfig, i: int, weights: dict, vectors: dict,
                   acts: Mapping[str, Activations], search) -> dict:
    """Rescale layer i's projections in place, function-preserving in float arithmetic.

    weights: canonical name -> float32 matrix (this layer's four); vectors: canonical name ->
    float32 (norms, biases). `search(w, x, tie=None) -> s float32 [K]` picks a projection's
    input scales. A stored weight is then diag(row) @ W @ diag(col) of the original;
    returns {name: (row or None, col)}.
    """
    c, p = config, f"layers.{i}"
    v_rows = slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)
    # o_proj's input is attention output, a mix of V rows: scale V rows down, o_proj columns up.
    group = c.num_heads // c.num_kv_heads
    s_o = search(weights[f"{p}.o_proj"], acts[f"{p}.o_proj"].fit, tie=(c.num_kv_heads, group, c.head_dim))
    s_kv = s_o.reshape(c.num_kv_heads, group, c.head_dim)[:, 0].reshape(-1)          # [Hkv*hd]
    qkv_row = np.ones(c.q_size + 2 * c.kv_size, dtype=np.float32)
    qkv_row[v_rows] = 1 / s_kv
    _scale_rows(weights, vectors, f"{p}.qkv_proj", f"{p}.qkv_bias" if c.qkv_bias else None, qkv_row)
    weights[f"{p}.o_proj"] = weights[f"{p}.o_proj"] * s_o
    # down_proj's input is act(gate) * up, linear in up: scale up rows down, down columns up.
    s_d = search(weights[f"{p}.down_proj"], acts[f"{p}.down_proj"].fit)
    gu_row = np.concatenate([np.ones(c.intermediate_size, dtype=np.float32), 1 / s_d])
    _scale_rows(weights, vectors, f"{p}.gate_up_proj", None, gu_row)
    weights[f"{p}.down_proj"] = weights[f"{p}.down_proj"] * s_d
    # qkv and gate_up read an RMSNorm output: the norm weight takes 1/s.
    s_qkv = search(weights[f"{p}.qkv_proj"], acts[f"{p}.qkv_proj"].fit)
    s_gu = search(weights[f"{p}.gate_up_proj"], acts[f"{p}.gate_up_proj"].fit)
    _scale_cols(weights, vectors, f"{p}.qkv_proj", f"{p}.attn_norm", s_qkv)
    _scale_cols(weights, vectors, f"{p}.gate_up_proj", f"{p}.mlp_norm", s_gu)
    return {f"{p}.qkv_proj": (qkv_row, s_qkv), f"{p}.o_proj": (None, s_o),
            f"{p}.gate_up_proj": (gu_row, s_gu), f"{p}.down_proj": (None, s_d)}


def _scale_rows(weights, vectors, name, bias_name, row):
    weights[name] = weights[name] * row[:, None]
    if bias_name is not None:
        vectors[bias_name] = vectors[bias_name] * row


def _scale_cols(weights, vectors, name, norm_name, s):
    weights[name] = weights[name] * s
    vectors[norm_name] = vectors[norm_name] / s
