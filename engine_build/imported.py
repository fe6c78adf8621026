"""Weights that arrive already quantized (GGUF, AWQ, GPTQ, compressed-tensors): their 4-bit
codes carried into the INT4 encoding of docs/ENGINE_FORMAT.md without rounding them again.

Contract:
- An importer unpacks each 4-bit matrix into `Int4Codes`: codes `q` uint8 [N, K] in 0..15 in
  nn.Linear order (row n = output, column k = input), and per-group `scales` and `zeros`
  (float16 [N, K/G]) such that W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G],
  the engine's own formula. Fusing Q|K|V or gate|up is a row concatenation (`concat_rows`),
  a RoPE layout change a row permutation (`permute_rows`): neither touches a code.
- `origin` says how faithful the encoding is to the source's dequantized weights:
  "exact": bit-exact (Q4_0, AWQ, GPTQ, compressed-tensors with float16 scales);
  "mapped": the codes are the source's, but its scale or minimum had to be rounded to float16
  (Q4_1's and Q4_K's `d * q + m` form; bfloat16 scales outside float16's range), so the
  report's error is small but not zero;
  "requantized": (part of) the matrix had no 4-bit codes in this layout (a Q6_K V projection
  fused with Q4_K Q and K rows; GPTQ act-order groups): its dequantized weights were rounded
  again, round-to-nearest at the shared group size (`codes_by_rtn`).
- `ImportedInt4` is what a SourceModel carries: the group size every imported matrix shares,
  loaders per canonical name, and a note per canonical name saying what the source held
  ("gguf Q4_0", "awq", "gguf Q6_K -> requantized"), for the build report. The float view of
  every tensor (the source's own dequantization) stays in `SourceModel.tensors`; quantize.py
  measures each imported matrix against it, so the report shows 0 for the exact paths.
"""

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..kernels.reference import dequantize_int4
from ..core.errors import BuildError
from .int4 import pack, quantize_int4

ORIGINS = ("exact", "mapped", "requantized")         # most faithful first


@dataclass
class Int4Codes:
    q: np.ndarray                   # uint8 [N, K], 0..15
    scales: np.ndarray              # float16 [N, K / G]
    zeros: np.ndarray               # float16 [N, K / G]
    origin: str                     # "exact" | "mapped"

    def __post_init__(self):
        n, k = self.q.shape
        assert self.q.dtype == np.uint8 and self.scales.dtype == np.float16 and self.zeros.dtype == np.float16
        assert self.scales.shape == self.zeros.shape and self.scales.shape[0] == n and k % self.scales.shape[1] == 0
        assert self.origin in ORIGINS, self.origin

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def engine_parts(self) -> dict:
        """-> {"qweight": uint8 [N, K/2], "scales", "zeros"}: the stored encoding."""
        return {"qweight": pack(self.q), "scales": self.scales, "zeros": self.zeros}

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], by the kernels' own definition (kernels/reference.py)."""
        return dequantize_int4(pack(self.q), self.scales, self.zeros, self.q.shape[1])


def concat_rows(parts: list) -> Int4Codes:
    """Q|K|V or gate|up: the fused matrix is the row concatenation; the least faithful origin wins."""
    origin = max((p.origin for p in parts), key=ORIGINS.index)
    return Int4Codes(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                     np.concatenate([p.zeros for p in parts]), origin)


def permute_rows(codes: Int4Codes, permute: Callable[[np.ndarray], np.ndarray]) -> Int4Codes:
    """Apply a row permutation (`permute` maps [N, X] -> [N, X]) to codes, scales and zeros alike."""
    return Int4Codes(permute(codes.q), permute(codes.scales), permute(codes.zeros), codes.origin)


def codes_by_rtn(w: np.ndarray, group_size: int) -> Int4Codes:
    """float [N, K] (K a multiple of the group size) -> asymmetric round-to-nearest codes."""
    assert w.shape[1] % group_size == 0, "K must be a multiple of the group size"
    parts = quantize_int4(w, group_size, symmetric=False)
    q = np.empty((w.shape[0], w.shape[1]), dtype=np.uint8)
    q[:, 0::2], q[:, 1::2] = parts["qweight"] & 0x0F, parts["qweight"] >> 4
    return Int4Codes(q, parts["scales"], parts["zeros"], "requantized")


def codes_from_affine(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> Int4Codes:
    """Sources that dequantize as `scale * q + minimum` (Q4_1, Q4_K), scale/minimum float32 [N, K/G].

    The engine computes (q - z) * s with float16 s and z, so s = fp16(scale) and
    z = fp16(-minimum / s): exact only when both round-trip, which the origin records per matrix."""
    s16 = scale.astype(np.float16)
    safe = np.where(s16 == 0, np.float16(1), s16)
    z16 = (-minimum / safe.astype(np.float32)).astype(np.float16)
    if not (np.all(np.isfinite(s16)) and np.all(np.isfinite(z16))):
        raise BuildError(None, "a block's scale or minimum does not fit float16")
    codes = Int4Codes(q, safe, z16, "exact")
    g = codes.group_size
    source = np.repeat(scale, g, axis=1) * q.astype(np.float32) + np.repeat(minimum, g, axis=1)
    codes.origin = "exact" if np.array_equal(codes.dequantize(), source) else "mapped"
    return codes


def codes_from_float16(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> Int4Codes:
    """Sources that dequantize as (q - zero) * scale with integer zeros (AWQ, GPTQ,
    compressed-tensors); scales in any float dtype: exact when they are float16-representable."""
    scales = np.asarray(scales)
    s16 = scales.astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise BuildError(None, "a group's scale does not fit float16")
    exact = np.array_equal(s16.astype(np.float32), scales.astype(np.float32))
    return Int4Codes(q.astype(np.uint8), s16, zeros.astype(np.float16), "exact" if exact else "mapped")


@dataclass
class ImportedInt4:
    """The pre-quantized matrices of a source (see the module docstring)."""
    group_size: int
    loaders: Mapping[str, Callable[[], Int4Codes]] = field(default_factory=dict)   # canonical name -> codes
    notes: Mapping[str, str] = field(default_factory=dict)     # canonical name -> what the source held
    quantized: frozenset = frozenset()  # canonical names whose source encoding is quantized (with codes or not)

    def load(self, name: str) -> Int4Codes:
        codes = self.loaders[name]()
        if codes.group_size != self.group_size:
            raise BuildError(None, f"tensor {name!r} is quantized in groups of {codes.group_size}, "
                                   f"the rest of the model in groups of {self.group_size}")
        return codes
