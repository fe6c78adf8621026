"""Device weight layouts: the engine's INT4 packing rearranged for the tensor-core kernels.

The "tc" layout (described in kernels/cuda/int4_matmul.cu) gives each lane of a warp, with
one 16-byte load, exactly the A fragments of four mma.m16n8k16 steps, and each (16-row tile,
group) its scales and zero points as half2 pairs. The device builds it at load time with the
`int4_repack_tc` kernel; `pack_tc` here is its readable numpy twin (tests, the fake driver),
and `unpack_tc` the inverse.
"""

from typing import NamedTuple

import numpy as np

from ..reference import unpack_int4

TILE_ROWS = 16          # rows per mma tile
UNIT_K = 128            # K is padded to a multiple of this (two 64-wide chunks per load batch)
PAD_ROWS = 128          # rows are padded to a multiple of the GEMM block tile


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class TcShape(NamedTuple):
    N: int              # logical rows
    K: int              # logical columns
    group_size: int     # G
    Np: int             # rows, padded
    Kp: int             # columns, padded to UNIT_K
    num_tiles: int      # Np / 16
    num_chunks: int     # Kp / 64
    num_groups: int     # Kp / G
    num_units: int      # Kp / 128

    @property
    def qw_words(self) -> int:
        return self.num_tiles * self.num_chunks * 128

    @property
    def sz_words(self) -> int:
        return self.num_tiles * self.num_groups * 16


def tc_shape(N: int, K: int, group_size: int) -> TcShape:
    if group_size not in (32, 64, 128):
        raise ValueError(f"the CUDA INT4 kernels support group sizes 32, 64 and 128, got {group_size}")
    Np, Kp = round_up(N, PAD_ROWS), round_up(K, UNIT_K)
    return TcShape(N, K, group_size, Np, Kp, Np // TILE_ROWS, Kp // 64, Kp // group_size, Kp // UNIT_K)


def fragment_positions() -> tuple:
    """For lane l and nibble p of a step's word: (row in tile, k in step). -> two int [32, 8]."""
    lane = np.arange(32)[:, None]
    p = np.arange(8)[None, :]
    g, t, j = lane // 4, lane % 4, p % 4
    rows = g + 8 * (j % 2)
    ks = 2 * t + 8 * (j // 2) + p // 4
    return rows, ks


def pack_tc(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray, K: int) -> tuple:
    """Engine int4 parts -> (qw uint32 [qw_words], sz uint32 [sz_words], TcShape)."""
    codes = unpack_int4(qweight)                                  # [N, Kp_engine] uint8
    N, group_size = codes.shape[0], codes.shape[1] // scales.shape[1]
    shape = tc_shape(N, K, group_size)
    q = np.zeros((shape.Np, shape.Kp), dtype=np.uint32)
    q[:N, :codes.shape[1]] = codes
    rows, ks = fragment_positions()
    # [tile, row, chunk, step, k] -> [tile, chunk, step, lane, nibble]
    q = q.reshape(shape.num_tiles, TILE_ROWS, shape.num_chunks, 4, 16).transpose(0, 2, 3, 1, 4)
    nibbles = q[:, :, :, rows, ks]                                # [tile, chunk, step, 32, 8]
    words = (nibbles << (4 * np.arange(8, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    qw = np.ascontiguousarray(words.transpose(0, 1, 3, 2)).reshape(-1)   # [tile, chunk, lane, step]
    s = np.zeros((shape.Np, shape.num_groups), dtype=np.float16)
    z = np.zeros_like(s)
    s[:N, :scales.shape[1]] = scales
    z[:N, :zeros.shape[1]] = zeros
    sz = s.view(np.uint16).astype(np.uint32) | (z.view(np.uint16).astype(np.uint32) << 16)
    sz = sz.reshape(shape.num_tiles, TILE_ROWS, shape.num_groups).transpose(0, 2, 1)
    return qw, np.ascontiguousarray(sz).reshape(-1), shape


def unpack_tc(qw: np.ndarray, sz: np.ndarray, shape: TcShape) -> tuple:
    """Inverse of pack_tc: -> (codes uint8 [Np, Kp], scales fp16 [Np, G'], zeros fp16 [Np, G'])."""
    words = qw.reshape(shape.num_tiles, shape.num_chunks, 32, 4).transpose(0, 1, 3, 2)   # [tile, chunk, step, lane]
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF             # [.., lane, nibble]
    rows, ks = fragment_positions()
    q = np.zeros((shape.num_tiles, shape.num_chunks, 4, TILE_ROWS, 16), dtype=np.uint8)
    q[:, :, :, rows, ks] = nibbles
    codes = q.transpose(0, 3, 1, 2, 4).reshape(shape.Np, shape.Kp)
    pairs = sz.reshape(shape.num_tiles, shape.num_groups, TILE_ROWS).transpose(0, 2, 1).reshape(shape.Np, -1)
    scales = (pairs & 0xFFFF).astype(np.uint16).view(np.float16)
    zeros = (pairs >> 16).astype(np.uint16).view(np.float16)
    return codes, scales, zeros


def dequantize_tc(qw: np.ndarray, sz: np.ndarray, shape: TcShape) -> np.ndarray:
    """-> float32 [N, K]: what the tensor-core kernels multiply by."""
    codes, scales, zeros = unpack_tc(qw, sz, shape)
    G = shape.group_size
    w = (codes.astype(np.float32) - np.repeat(zeros.astype(np.float32), G, axis=1)) \
        * np.repeat(scales.astype(np.float32), G, axis=1)
    return w[:shape.N, :shape.K]


# ------------------------------------------------------------------ row orders of the fused kernels

def rope_row_order(num_heads: int, head_dim: int) -> np.ndarray:
    """Logical qkv row of each device row for the fused RoPE epilogue (int4_matmul.cu): within
    each head, blocks of 16 rows [j0..j0+7, j0+half..j0+half+7], so the two rows a rotation
    pairs sit 8 apart in one tensor-core tile. `num_heads` counts Q, K and V heads."""
    if head_dim % 16:
        raise ValueError(f"the fused RoPE epilogue needs head_dim % 16 == 0, got {head_dim}")
    half = head_dim // 2
    within = np.concatenate([np.r_[b * 8:b * 8 + 8, half + b * 8:half + b * 8 + 8] for b in range(half // 8)])
    return (np.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def glu_row_order(intermediate_size: int) -> np.ndarray:
    """Logical gate_up row of each device row for the fused GLU epilogue: [gate 8t..8t+7,
    up 8t..8t+7] per 16-row tile, so a lane holds gate[i] and up[i] together."""
    I = intermediate_size
    if I % 8:
        raise ValueError(f"the fused GLU epilogue needs intermediate_size % 8 == 0, got {I}")
    return np.concatenate([np.r_[8 * t:8 * t + 8, I + 8 * t:I + 8 * t + 8] for t in range(I // 8)])
