"""INT4 / INT8 encodings of docs/ENGINE_FORMAT.md as a chain of small pure steps (gpt-fast
style): `pad_k` -> `get_group_qparams` -> `quantize` -> `pack`, shapes asserted on the way.
kernels/reference.py is the exact inverse (`dequantize_int4`, `dequantize_int8`), and the
tests round-trip through it. The searches (quant_search.py) pick the `clip` ratios these
steps take, or (GPTQ) round column by column against the scales these steps choose.
"""

import numpy as np

from ..kernels.reference import dequantize_int4, dequantize_int8
from ..core.errors import BuildError


def pad_k(w: np.ndarray, group_size: int) -> np.ndarray:
    """w: [N, K] -> float32 [N, Kp], K padded with zeros to a multiple of the group size."""
    n, k = w.shape
    kp = -(-k // group_size) * group_size
    out = np.zeros((n, kp), dtype=np.float32)
    out[:, :k] = w
    return out


def get_group_qparams(w: np.ndarray, group_size: int, symmetric: bool, clip=1.0):
    """w: [N, Kp] -> (scales float16 [N, Kp/G], zeros float16 [N, Kp/G]).

    `clip` (scalar or [N, Kp/G]) shrinks each group's range. Asymmetric: the range always
    holds 0 and the zero point is an integer, so 0 (the K padding) is exact. Symmetric:
    scale = max|w| / 7 and zero point 8. Scales are rounded to float16 here, once, so
    `quantize` rounds against exactly the scale the kernels will multiply by.
    """
    n, kp = w.shape
    assert kp % group_size == 0, f"K={kp} is not padded to a multiple of {group_size}"
    g = w.reshape(n, kp // group_size, group_size)
    if symmetric:
        scales = np.max(np.abs(g), axis=-1) * clip / 7
    else:
        lo, hi = np.minimum(g.min(axis=-1), 0) * clip, np.maximum(g.max(axis=-1), 0) * clip
        scales = (hi - lo) / 15
    scales = _to_float16_scale(scales)
    if symmetric:
        zeros = np.full(scales.shape, 8, dtype=np.float16)
    else:
        zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 0, 15).astype(np.float16)
    return scales, zeros


def _to_float16_scale(scales: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(scales)) or np.max(scales, initial=0) > 65504:
        raise BuildError(None, "a weight group's range does not fit float16 scales (non-finite or huge weights)")
    s16 = scales.astype(np.float16)
    return np.where(s16 == 0, np.float16(1), s16)     # all-zero (or sub-fp16) group: every q is the zero point


def quantize(w: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int) -> np.ndarray:
    """w: [N, Kp] -> uint8 q [N, Kp] in 0..15, q = clamp(round(w / s) + z)."""
    assert scales.shape == zeros.shape == (w.shape[0], w.shape[1] // group_size)
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)
    z = np.repeat(zeros.astype(np.float32), group_size, axis=1)
    return np.clip(np.round(w / s) + z, 0, 15).astype(np.uint8)


def pack(q: np.ndarray) -> np.ndarray:
    """uint8 [N, Kp] (values 0..15) -> uint8 [N, Kp/2]: even k in the low nibble, odd k in the high."""
    assert q.dtype == np.uint8 and q.shape[1] % 2 == 0 and q.max(initial=0) <= 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def quantize_int4(w: np.ndarray, group_size: int, symmetric: bool, clip=1.0) -> dict:
    """float [N, K] -> {"qweight": uint8 [N, Kp/2], "scales": f16 [N, Kp/G], "zeros": f16 [N, Kp/G]}."""
    wp = pad_k(w, group_size)
    scales, zeros = get_group_qparams(wp, group_size, symmetric, clip)
    return {"qweight": pack(quantize(wp, scales, zeros, group_size)), "scales": scales, "zeros": zeros}


def quantize_int8(w: np.ndarray) -> dict:
    """float [N, K] -> {"qweight": int8 [N, K], "scales": f16 [N]}, per-row absmax / 127."""
    scales = _to_float16_scale(np.max(np.abs(w), axis=1) / 127)
    q = np.clip(np.round(w / scales.astype(np.float32)[:, None]), -127, 127).astype(np.int8)
    return {"qweight": q, "scales": scales}


def dequantize(parts: dict, in_features: int) -> np.ndarray:
    """The inverse, through kernels/reference.py. -> float32 [N, K]"""
    if "zeros" in parts:
        return dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], in_features)
    return dequantize_int8(parts["qweight"], parts["scales"])
