"""Rotary position embeddings, rotate-half layout (Hugging Face's; see docs/ENGINE_FORMAT.md).

Within each head of width hd, dimension j < hd/2 pairs with j + hd/2 and the pair turns by
the angle `position * inv_freq[j]`. Frequencies are computed in float64 and the cos/sin
tables rounded to float32 once, so every backend can reproduce them exactly.

Variants are plain data on ModelConfig: `rope_theta` (per model), `rope_scaling`
(Llama 3's frequency-dependent scaling) or, from GGUF files, `rope_freq_factors` (the same
scaling as llama.cpp stores it: one divisor per frequency), never a family name.
"""

import math

import numpy as np

from ..core.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig, theta: float = None) -> np.ndarray:
    """-> float64 [hd/2], the angle per position of each rotating pair (base `theta`, default the model's)."""
    hd = config.head_dim
    assert hd % 2 == 0, f"RoPE needs an even head_dim, got {hd}"
    theta = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    if config.rope_scaling is not None:
        inv_freq = llama3_scale(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:           # llama.cpp's per-frequency factors (GGUF rope_freqs)
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    return inv_freq


def llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1: long wavelengths slow down by `factor`, short ones stay, the band between blends."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(wavelen < high_freq_wavelen, inv_freq,
                    np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, blended))


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple:
    """positions int [T] -> (cos, sin) float32 [T, hd/2]."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]   # [T, hd/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [T, H, hd], cos/sin: [T, hd/2] -> [T, H, hd] rotated (new array)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
