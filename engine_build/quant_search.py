"""The error-reducing searches the quantizer offers over round-to-nearest (see quantize.py's
docstring for when each runs): per-group range clipping against calibration activations,
AWQ's per-input-channel scales, and GPTQ's error feedback. Each is a pure function of a
weight and its calibration inputs.
"""

from typing import Optional

import numpy as np

from .int4 import dequantize, get_group_qparams, pack, pad_k, quantize, quantize_int4

CLIP_RATIOS = np.linspace(1.0, 0.5, 11)                # range kept: 100%, 95%, ..., 50%
AWQ_ALPHAS = np.linspace(0.0, 1.0, 11)                 # alpha = 0 is plain RTN: the search never loses on its data


def group_gram(x: Optional[np.ndarray], k: int, group_size: int) -> np.ndarray:
    """Activations x: [T, K] (None: identity) -> float32 [Kp/G, G, G], each group's X^T X / T."""
    kp = -(-k // group_size) * group_size
    if x is None:
        return np.broadcast_to(np.eye(group_size, dtype=np.float32), (kp // group_size, group_size, group_size))
    xg = pad_k(x, group_size).reshape(len(x), kp // group_size, group_size)     # [T, ng, G]
    return np.einsum("tgi,tgj->gij", xg, xg) / len(x)


def search_clip(w: np.ndarray, gram: np.ndarray, group_size: int, symmetric: bool) -> np.ndarray:
    """Per group, the CLIP_RATIOS entry with the least output error d^T C d. -> float32 [N, Kp/G]"""
    wp = pad_k(w, group_size)
    n, kp = wp.shape
    best_err = np.full((n, kp // group_size), np.inf)
    best = np.ones((n, kp // group_size), dtype=np.float32)
    for ratio in CLIP_RATIOS:
        scales, zeros = get_group_qparams(wp, group_size, symmetric, ratio)
        q = quantize(wp, scales, zeros, group_size).astype(np.float32)
        w_hat = (q - np.repeat(zeros.astype(np.float32), group_size, 1)) * np.repeat(scales.astype(np.float32), group_size, 1)
        d = (wp - w_hat).reshape(n, kp // group_size, group_size)                  # [N, ng, G]
        err = np.einsum("ngi,gij,ngj->ng", d, gram, d)
        better = err < best_err
        best_err, best = np.where(better, err, best_err), np.where(better, ratio, best)
    return best


def awq_input_scales(w: np.ndarray, x: np.ndarray, group_size: int, symmetric: bool,
                     tie: Optional[tuple] = None) -> np.ndarray:
    """Search alpha for s = mean|x|^alpha minimising ||x w^T - (x/s) Q(w s)^T||. -> float32 [K]

    `tie` = (num_kv_heads, group, head_dim) for o_proj: the `group` query heads of one KV
    head read the same V rows, so they must share one scale; mean|x| is averaged over them.
    """
    mean_abs = np.mean(np.abs(x), axis=0) + 1e-8                          # [K]
    if tie is not None:
        mean_abs = _tie_mean(mean_abs, tie)
    y = x @ w.T
    best_err, best = np.inf, np.ones_like(mean_abs, dtype=np.float32)
    for alpha in AWQ_ALPHAS:
        s = mean_abs ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        w_hat = dequantize(quantize_int4(w * s, group_size, symmetric), w.shape[1]) / s
        err = float(np.sum((x @ w_hat.T - y) ** 2))
        if err < best_err:
            best_err, best = err, s
    return best


def _tie_mean(mean_abs: np.ndarray, tie: tuple) -> np.ndarray:
    """mean_abs [Hq*hd] -> [Hq*hd] where the `group` query heads of one KV head share their mean."""
    num_kv_heads, group, hd = tie
    m = mean_abs.reshape(num_kv_heads, group, hd).mean(axis=1, keepdims=True)
    return np.broadcast_to(m, (num_kv_heads, group, hd)).reshape(-1)


def gptq_int4(w: np.ndarray, x: np.ndarray, group_size: int, symmetric: bool, damp: float = 0.01) -> dict:
    """GPTQ: quantize columns left to right, pushing each column's error onto the columns not
    yet quantized, weighted by the inverse Hessian of ||x w^T - x w_hat^T||^2 (H = x^T x / T).
    Each group's scale/zero come from its weights as updated so far, clip-searched against
    H's diagonal block (that group's X^T X). w: [N, K], x: [T, K] -> the int4 parts."""
    wp = pad_k(w, group_size).astype(np.float64)                          # [N, Kp]
    n, kp = wp.shape
    xp = pad_k(x, group_size).astype(np.float64)
    h = xp.T @ xp / len(xp)                                               # [Kp, Kp]
    dead = np.diag(h) == 0                                                # padding and never-active inputs
    h[dead, dead] = 1.0
    wp[:, dead] = 0.0
    h += damp * np.mean(np.diag(h)) * np.eye(kp)
    h_inv = np.linalg.cholesky(np.linalg.inv(h)).T                        # upper Cholesky factor of H^-1
    scales = np.empty((n, kp // group_size), dtype=np.float16)
    zeros = np.empty((n, kp // group_size), dtype=np.float16)
    q = np.empty((n, kp), dtype=np.uint8)
    for g, k0 in enumerate(range(0, kp, group_size)):
        k1 = k0 + group_size
        block = wp[:, k0:k1]                                              # [N, G], updated in place
        gram = h[None, k0:k1, k0:k1].astype(np.float32)
        clip = search_clip(block.astype(np.float32), gram, group_size, symmetric)
        scales[:, g:g + 1], zeros[:, g:g + 1] = get_group_qparams(block.astype(np.float32), group_size, symmetric, clip)
        s, z = scales[:, g].astype(np.float64), zeros[:, g].astype(np.float64)
        err = np.empty((n, group_size))                                   # [N, G] scaled errors
        for j in range(group_size):
            q[:, k0 + j] = np.clip(np.round(block[:, j] / s) + z, 0, 15)
            err[:, j] = (block[:, j] - (q[:, k0 + j] - z) * s) / h_inv[k0 + j, k0 + j]
            block[:, j + 1:] -= np.outer(err[:, j], h_inv[k0 + j, k0 + j + 1:k1])
        wp[:, k1:] -= err @ h_inv[k0:k1, k1:]                             # the rest of the row, in one GEMM
    return {"qweight": pack(q), "scales": scales, "zeros": zeros}
