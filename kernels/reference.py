"""Readable numpy reference for the weight encodings of docs/ENGINE_FORMAT.md.

Every fast kernel (kernels/cpu C, kernels/cuda) is tested against these functions, and
the reference forward (kernels/model.py) uses them directly. Clarity over speed.
"""

import numpy as np


def unpack_int4(qweight: np.ndarray) -> np.ndarray:
    """uint8 [N, Kp/2] -> uint8 [N, Kp], q[2j] from the low nibble of byte j, q[2j+1] from the high."""
    assert qweight.dtype == np.uint8 and qweight.ndim == 2
    q = np.empty((qweight.shape[0], qweight.shape[1] * 2), dtype=np.uint8)
    q[:, 0::2] = qweight & 0x0F
    q[:, 1::2] = qweight >> 4
    return q


def dequantize_int4(qweight, scales, zeros, in_features: int) -> np.ndarray:
    """W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G], trimmed to the logical K. -> float32 [N, K]"""
    q = unpack_int4(qweight).astype(np.float32)          # [N, Kp]
    num_groups = scales.shape[1]
    group_size = q.shape[1] // num_groups
    assert q.shape[1] == num_groups * group_size and zeros.shape == scales.shape
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)
    z = np.repeat(zeros.astype(np.float32), group_size, axis=1)
    return ((q - z) * s)[:, :in_features]


def dequantize_int8(qweight, scales) -> np.ndarray:
    """W[n, k] = qweight[n, k] * scales[n]. -> float32 [N, K]"""
    return qweight.astype(np.float32) * scales.astype(np.float32)[:, None]


def int4_linear(x: np.ndarray, qweight, scales, zeros, in_features: int) -> np.ndarray:
    """y = x @ W.T for an INT4 weight. x: [M, K] float32 -> [M, N] float32."""
    return x.astype(np.float32) @ dequantize_int4(qweight, scales, zeros, in_features).T
