"""The tensor-core kernels' index arithmetic, replayed lane by lane in numpy (CPU only).

The INT4 kernels rely on three agreements that a GPU run would only show as wrong numbers:
the host/device weight layout (layout.pack_tc, int4_repack_tc) against the lanes' A fragments,
the hi/lo activation columns fed as B against the C columns read back, and the per-group
scale / zero-point folding with the shuffled activation sums. These tests replay
int4_gemv_tc and the staging of int4_gemm_tc for every lane of a warp, with the PTX ISA's
mma.m16n8k16 fragment layout and the kernels' fp16 bit tricks done on real float16 bits,
and compare with kernels/reference.py.
"""

import numpy as np
import pytest

from tokenwire.engine_build.quantize import quantize_int4
from tokenwire.kernels.cuda.layout import dequantize_tc, pack_tc, tc_shape, unpack_tc
from tokenwire.kernels.reference import dequantize_int4, int4_linear

LANES = np.arange(32)
G_OF, T_OF = LANES // 4, LANES % 4


def f16_bits(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16)


def dequant_word(w: np.ndarray) -> list:
    """int4_matmul.cu dequant_word on uint32 [32] -> 4 registers of (low, high) float16 [32] each."""
    magic = np.float16(1024)
    regs = []
    for shift, mask, high_nibble in ((0, 0x000F000F, False), (0, 0x00F000F0, True),
                                     (8, 0x000F000F, False), (8, 0x00F000F0, True)):
        v = ((w >> shift) & mask) | 0x64006400
        lo, hi = f16_bits(v & 0xFFFF), f16_bits(v >> 16)
        if high_nibble:   # fma(v, 1/16, -64) in fp16
            lo = (lo * np.float16(1 / 16) + np.float16(-64)).astype(np.float16)
            hi = (hi * np.float16(1 / 16) + np.float16(-64)).astype(np.float16)
        else:
            lo, hi = (lo - magic).astype(np.float16), (hi - magic).astype(np.float16)
        regs.append((lo, hi))
    return regs


def mma(part: np.ndarray, a: list, b0: tuple, b1: tuple) -> None:
    """mma.m16n8k16.row.col f32 += f16 x f16, fragments per the PTX ISA. part: [4, 32] in place."""
    A = np.zeros((16, 16), dtype=np.float64)
    B = np.zeros((16, 8), dtype=np.float64)
    for lane in LANES:
        g, t = G_OF[lane], T_OF[lane]
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col], A[row, col + 1] = a[reg][0][lane], a[reg][1][lane]
        B[2 * t, g], B[2 * t + 1, g] = b0[0][lane], b0[1][lane]
        B[2 * t + 8, g], B[2 * t + 9, g] = b1[0][lane], b1[1][lane]
    D = A @ B
    part[0] += D[G_OF, 2 * T_OF]
    part[1] += D[G_OF, 2 * T_OF + 1]
    part[2] += D[G_OF + 8, 2 * T_OF]
    part[3] += D[G_OF + 8, 2 * T_OF + 1]


def split_pair(x0, x1, low_part):
    h0, h1 = x0.astype(np.float16), x1.astype(np.float16)
    if low_part is True:
        return (x0 - h0.astype(np.float32)).astype(np.float16), (x1 - h1.astype(np.float32)).astype(np.float16)
    lo0 = (x0 - h0.astype(np.float32)).astype(np.float16)
    lo1 = (x1 - h1.astype(np.float32)).astype(np.float16)
    return np.where(low_part, lo0, h0), np.where(low_part, lo1, h1)


def gemv_tile(qw: np.ndarray, sz: np.ndarray, shape, tile: int, x: np.ndarray, nt: int) -> np.ndarray:
    """int4_gemv_tc for one 16-row tile and tokens 0 .. 4nt-1, one warp doing every unit. -> [4nt, 16]"""
    words = qw.reshape(shape.num_tiles, shape.num_chunks, 32, 4)[tile]        # [chunk, lane, step]
    pairs = sz.reshape(shape.num_tiles, shape.num_groups, 16)[tile]           # [group, row]
    M = x.shape[0]
    acc = np.zeros((nt, 2, 32), dtype=np.float32)
    part = np.zeros((nt, 4, 32), dtype=np.float32)
    xs = np.zeros((nt, 32), dtype=np.float32)
    low_part = (G_OF & 1).astype(bool)
    spg_mask = shape.group_size // 16 - 1
    for u in range(shape.num_units):
        unit_words = np.concatenate([words[2 * u], words[2 * u + 1]], axis=1)    # [lane, 8 steps]
        for s in range(8):
            k0 = u * 128 + s * 16
            a = dequant_word(unit_words[:, s].astype(np.uint32))
            for j in range(nt):
                m = 4 * j + G_OF // 2
                valid = m < M
                row = np.where(valid[:, None], x[np.minimum(m, M - 1)], 0.0).astype(np.float32)
                v0 = row[LANES, k0 + 2 * T_OF], row[LANES, k0 + 2 * T_OF + 1]
                v1 = row[LANES, k0 + 2 * T_OF + 8], row[LANES, k0 + 2 * T_OF + 9]
                xs[j] += (v0[0] + v0[1]) + (v1[0] + v1[1])
                mma(part[j], a, split_pair(*v0, low_part), split_pair(*v1, low_part))
            if ((s + 1) & spg_mask) == 0:
                gi = k0 // shape.group_size
                sz0, sz1 = pairs[gi, G_OF], pairs[gi, G_OF + 8]
                s0, z0 = f16_bits(sz0 & 0xFFFF).astype(np.float32), f16_bits(sz0 >> 16).astype(np.float32)
                s1, z1 = f16_bits(sz1 & 0xFFFF).astype(np.float32), f16_bits(sz1 >> 16).astype(np.float32)
                for j in range(nt):
                    xsum = xs[j] + xs[j][LANES ^ 1]
                    xsum = xsum + xsum[LANES ^ 2]
                    xt = xsum[8 * T_OF]
                    acc[j, 0] += s0 * ((part[j, 0] + part[j, 1]) - z0 * xt)
                    acc[j, 1] += s1 * ((part[j, 2] + part[j, 3]) - z1 * xt)
                    part[j] = 0
                    xs[j] = 0
    y = np.zeros((4 * nt, 16), dtype=np.float32)
    for j in range(nt):
        y[4 * j + T_OF, G_OF] = acc[j, 0]
        y[4 * j + T_OF, G_OF + 8] = acc[j, 1]
    return y


def random_int4(N, K, G, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32)
    return quantize_int4(w, G, symmetric=False)


@pytest.mark.parametrize("N,K,G", [(16, 128, 32), (37, 200, 64), (20, 256, 128), (5, 70, 32)])
def test_pack_tc_round_trips_to_the_engine_weights(N, K, G):
    p = random_int4(N, K, G)
    qw, sz, shape = pack_tc(p["qweight"], p["scales"], p["zeros"], K)
    assert (len(qw), len(sz)) == (shape.qw_words, shape.sz_words)
    np.testing.assert_array_equal(dequantize_tc(qw, sz, shape), dequantize_int4(p["qweight"], p["scales"], p["zeros"], K))
    codes, scales, zeros = unpack_tc(qw, sz, shape)
    assert not codes[N:].any() and not scales[N:].any() and not codes[:, p["qweight"].shape[1] * 2:].any()


@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M,nt", [(1, 1), (3, 1), (6, 2), (13, 4)])
def test_gemv_lanes_reproduce_the_reference(G, M, nt):
    N, K = 20, 256
    p = random_int4(N, K, G, seed=G + M)
    qw, sz, shape = pack_tc(p["qweight"], p["scales"], p["zeros"], K)
    rng = np.random.default_rng(M)
    x = np.zeros((M, shape.Kp), dtype=np.float32)
    x[:, :K] = rng.standard_normal((M, K)) * 3
    want = int4_linear(x[:, :K], p["qweight"], p["scales"], p["zeros"], K)      # [M, N]
    got = np.concatenate([gemv_tile(qw, sz, shape, tile, x, nt)[:M] for tile in range(shape.num_tiles)], axis=1)[:, :N]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4)


def test_dequant_word_gives_every_code_exactly():
    codes = np.arange(32) % 16
    w = np.zeros(32, dtype=np.uint32)
    for p in range(8):
        w |= ((codes + p) % 16).astype(np.uint32) << (4 * p)
    regs = dequant_word(w)
    for j in range(4):
        np.testing.assert_array_equal(regs[j][0], (codes + j) % 16)
        np.testing.assert_array_equal(regs[j][1], (codes + j + 4) % 16)


def gemm_staging(x_tile: np.ndarray, group_size: int) -> tuple:
    """int4_gemm_tc's staging for one unit: threads 0..255 -> frag [8][16][32][2] words, xsum [64][4]."""
    frag = np.zeros((8, 16, 32, 2, 2), dtype=np.float16)      # [step][n8 tile][lane][reg][half]
    xsum = np.full((64, 4), np.nan, dtype=np.float32)
    sums = np.zeros(256, dtype=np.float32)
    for tid in range(256):
        st_tok, st_k = tid >> 2, (tid & 3) * 32
        for i in range(8):
            v = x_tile[st_tok, st_k + 4 * i:st_k + 4 * i + 4]
            sums[tid] += (v[0] + v[1]) + (v[2] + v[3])
            for h in range(2):
                k = st_k + 4 * i + 2 * h
                x0, x1 = v[2 * h], v[2 * h + 1]
                step, kk = k >> 4, k & 15
                col = 2 * st_tok
                j, fg, ft, reg = col >> 3, col & 7, (kk & 7) >> 1, kk >> 3
                frag[step, j, fg * 4 + ft, reg] = split_pair(np.float32(x0), np.float32(x1), False)
                frag[step, j, (fg + 1) * 4 + ft, reg] = split_pair(np.float32(x0), np.float32(x1), True)
    for tid in range(256):                                   # the shuffles and the writers
        s = sums[tid]
        if group_size >= 64:
            s += sums[tid ^ 1]
        if group_size >= 128:
            s = sums[tid] + sums[tid ^ 1] + sums[tid ^ 2] + sums[tid ^ 3]
        if ((tid & 3) & (group_size // 32 - 1)) == 0:
            xsum[tid >> 2, ((tid & 3) * 32) // group_size] = s
    return frag, xsum


@pytest.mark.parametrize("G", [32, 64, 128])
def test_gemm_staging_puts_each_activation_where_its_lane_reads_it(G):
    rng = np.random.default_rng(G)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    frag, xsum = gemm_staging(x, G)
    for step in range(8):
        for j in range(16):
            for lane in LANES:
                g, t = lane // 4, lane % 4
                tok, low = 4 * j + g // 2, bool(g & 1)
                for reg, kk in ((0, 2 * t), (1, 2 * t + 8)):
                    k = step * 16 + kk
                    want = split_pair(x[tok, k], x[tok, k + 1], low)
                    assert frag[step, j, lane, reg, 0] == want[0] and frag[step, j, lane, reg, 1] == want[1]
    for gi in range(128 // G):
        np.testing.assert_allclose(xsum[:, gi], x[:, gi * G:(gi + 1) * G].sum(axis=1), rtol=1e-5, atol=1e-5)


def test_tc_shape_rejects_unsupported_group_sizes():
    with pytest.raises(ValueError, match="group sizes 32, 64 and 128"):
        tc_shape(16, 64, 16)
