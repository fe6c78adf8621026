"""The tensor-core kernels' index arithmetic, replayed lane by lane in numpy (CPU only).

The INT4 kernels rely on agreements that a GPU run would only show as wrong numbers: the
host/device weight layout (layout.pack_tc, int4_repack_tc) against the lanes' A fragments,
the zero points folded into A with fp16 bit tricks, the staged activation columns (hi/lo
pairs, or fp16) against the C columns read back, and the K-split plans against the
workspace. These tests replay int4_mm_tc for every lane of a warp, with the PTX ISA's
mma.m16n8k16 fragment layout and real float16 rounding, and compare with kernels/reference.py.
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


def dequant_word(w: np.ndarray, z_g: np.ndarray, z_g8: np.ndarray) -> list:
    """int4_matmul.cu dequant_word_zero on uint32 [32] with the lanes' zero points folded in
    (zero_fold) -> 4 registers of (low, high) float16 [32]: the codes minus their zero point."""
    lo_c = (np.float32(1024) + z_g).astype(np.float16)            # half2(1024 + z), row g
    hi_c = (-(np.float32(64) + z_g8)).astype(np.float16)          # half2(-(64 + z)), row g + 8
    regs = []
    for shift, mask, high_nibble in ((0, 0x000F000F, False), (0, 0x00F000F0, True),
                                     (8, 0x000F000F, False), (8, 0x00F000F0, True)):
        v = ((w >> shift) & mask) | 0x64006400
        lo, hi = f16_bits(v & 0xFFFF), f16_bits(v >> 16)
        if high_nibble:   # fma(v, 1/16, -(64 + z)) in fp16
            regs.append(tuple((h.astype(np.float32) * np.float32(1 / 16) + hi_c.astype(np.float32)).astype(np.float16)
                              for h in (lo, hi)))
        else:
            regs.append(tuple((h.astype(np.float32) - lo_c.astype(np.float32)).astype(np.float16) for h in (lo, hi)))
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


def f16x2(x0, x1) -> tuple:
    return np.float16(x0), np.float16(x1)


def stage_unit(x: np.ndarray, u: int, nt: int, split: bool) -> np.ndarray:
    """int4_mm_tc's staging loop for unit u, every thread: -> frag [8 steps][nt][32 lanes][2 regs][2 halves]."""
    tokens = nt * (4 if split else 8)
    frag = np.zeros((8, nt, 32, 2, 2), dtype=np.float16)
    for i in range(tokens * 64):
        tok, k = i >> 6, 2 * (i & 63)
        v = x[tok, u * 128 + k:u * 128 + k + 2] if tok < x.shape[0] else np.zeros(2, np.float32)
        step, kk = k >> 4, k & 15
        ft, reg = (kk & 7) >> 1, kk >> 3
        if split:
            j, col = tok >> 2, 2 * (tok & 3)
            hi = f16x2(v[0], v[1])
            lo = f16x2(v[0] - np.float32(hi[0]), v[1] - np.float32(hi[1]))
            frag[step, j, col * 4 + ft, reg] = hi
            frag[step, j, (col + 1) * 4 + ft, reg] = lo
        else:
            j, col = tok >> 3, tok & 7
            frag[step, j, col * 4 + ft, reg] = f16x2(v[0], v[1])
    return frag


def mm_tile(qw: np.ndarray, sz: np.ndarray, shape, tile: int, x: np.ndarray, nt: int, split: bool) -> np.ndarray:
    """One warp of int4_mm_tc: 16 rows of `tile` for the block's tokens, all units. -> [tokens, 16]"""
    words = qw.reshape(shape.num_tiles, shape.num_chunks, 32, 4)[tile]        # [chunk, lane, step]
    pairs = sz.reshape(shape.num_tiles, shape.num_groups, 16)[tile]           # [group, row]
    nacc = 2 if split else 4
    acc = np.zeros((nt, nacc, 32), dtype=np.float32)
    part = np.zeros((nt, 4, 32), dtype=np.float32)
    spg = shape.group_size // 16
    for u in range(shape.num_units):
        frag = stage_unit(x, u, nt, split)
        unit_words = np.concatenate([words[2 * u], words[2 * u + 1]], axis=1)    # [lane, 8 steps]
        for s in range(8):
            if s % spg == 0:
                gi = (u * 128 + s * 16) // shape.group_size
                sz0, sz8 = pairs[gi, G_OF], pairs[gi, G_OF + 8]
                s_g, z_g = f16_bits(sz0 & 0xFFFF).astype(np.float32), f16_bits(sz0 >> 16).astype(np.float32)
                s_g8, z_g8 = f16_bits(sz8 & 0xFFFF).astype(np.float32), f16_bits(sz8 >> 16).astype(np.float32)
            a = dequant_word(unit_words[:, s].astype(np.uint32), z_g, z_g8)
            for j in range(nt):
                b = frag[s, j]                                                 # [lane, reg, half]
                mma(part[j], a, (b[:, 0, 0], b[:, 0, 1]), (b[:, 1, 0], b[:, 1, 1]))
            if (s + 1) % spg == 0:
                for j in range(nt):
                    if split:
                        acc[j, 0] += s_g * (part[j, 0] + part[j, 1])
                        acc[j, 1] += s_g8 * (part[j, 2] + part[j, 3])
                    else:
                        acc[j, 0] += s_g * part[j, 0]
                        acc[j, 1] += s_g * part[j, 1]
                        acc[j, 2] += s_g8 * part[j, 2]
                        acc[j, 3] += s_g8 * part[j, 3]
                    part[j] = 0
    y = np.zeros((nt * (4 if split else 8), 16), dtype=np.float32)
    for j in range(nt):                                   # the kernel's epilogue mapping
        for i in range(nacc):
            tok = 4 * j + T_OF if split else 8 * j + 2 * T_OF + (i & 1)
            row = G_OF + (8 if (i if split else i >> 1) else 0)
            y[tok, row] = acc[j, i]
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
@pytest.mark.parametrize("M,nt,split", [(1, 1, True), (3, 1, True), (6, 2, True), (13, 4, True),
                                        (1, 1, False), (11, 2, False)])
def test_tensor_core_lanes_reproduce_the_reference(G, M, nt, split):
    N, K = 20, 256
    p = random_int4(N, K, G, seed=G + M)
    qw, sz, shape = pack_tc(p["qweight"], p["scales"], p["zeros"], K)
    rng = np.random.default_rng(M)
    x = np.zeros((M, shape.Kp), dtype=np.float32)
    x[:, :K] = rng.standard_normal((M, K)) * 3
    xr = x if split else x.astype(np.float16).astype(np.float32)       # what the fp16 kernels multiply
    want = int4_linear(xr[:, :K], p["qweight"], p["scales"], p["zeros"], K)     # [M, N]
    got = np.concatenate([mm_tile(qw, sz, shape, tile, x, nt, split)[:M] for tile in range(shape.num_tiles)], axis=1)
    np.testing.assert_allclose(got[:, :N], want, rtol=2e-5, atol=2e-4)


def test_dequant_folds_every_zero_point_exactly():
    codes = np.arange(32) % 16
    w = np.zeros(32, dtype=np.uint32)
    for p in range(8):
        w |= ((codes + p) % 16).astype(np.uint32) << (4 * p)
    z_g, z_g8 = (np.arange(32) % 16).astype(np.float32), (np.arange(32)[::-1] % 16).astype(np.float32)
    regs = dequant_word(w, z_g, z_g8)
    for j in range(4):
        z = z_g if j % 2 == 0 else z_g8                    # registers 0, 2: row g; 1, 3: row g + 8
        np.testing.assert_array_equal(regs[j][0], (codes + j) % 16 - z)
        np.testing.assert_array_equal(regs[j][1], (codes + j + 4) % 16 - z)


def test_k_split_plans_cover_every_unit_and_fit_the_workspace():
    from tokenwire.kernels.cuda.forward import matmul_plan, matmul_workspace
    from tokenwire.kernels.cuda.weights import Linear
    lins = [Linear("w", "int4_tc", N, K, -(-K // 128) * 128, 0, 0, 0, 64) for N, K in
            [(4096, 4096), (6144, 4096), (4096, 14336), (128256, 4096), (5, 70), (2048, 8192)]]
    ws, counters = matmul_workspace(lins, 300, 132, "exact")
    for lin in lins:
        for M in (1, 4, 5, 16, 17, 64, 65, 300):
            plan = matmul_plan(lin, M, 132, "exact")
            rows, tiles, ksplit = plan.grid
            tokens = plan.tokens
            assert plan.kernel == (f"int4_mm_tc_x{tokens}g64" if tokens <= 16 else "int4_mm_tc_x64")  # by group size
            assert rows * 128 >= lin.N and tiles * tokens >= M
            units = lin.Kp // 128
            assert ksplit * plan.units_per_split >= units > (ksplit - 1) * plan.units_per_split
            assert plan.ws_floats <= ws and plan.counters <= counters
            if M <= 16 and lin.N <= 8192:
                assert rows * tiles * ksplit >= min(0.9 * 264, rows * tiles * units)        # the GPU is filled


def test_tc_shape_rejects_unsupported_group_sizes():
    with pytest.raises(ValueError, match="group sizes 32, 64 and 128"):
        tc_shape(16, 64, 16)


def test_decode_attention_splits_fill_the_gpu_at_batch_one_only():
    from tokenwire.core.config import ModelConfig
    from tokenwire.kernels.cuda.forward import decode_splits
    c = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0)
    splits = decode_splits(c, 1, 2048, 132)
    assert 8 * splits >= 0.9 * 264 and splits <= 2048 // 32
    assert decode_splits(c, 1, 40, 132) == 2             # no more than one split per 32 keys
    assert decode_splits(c, 128, 2048, 132) == 1


def test_one_wave_splits_k_to_the_most_blocks_a_wave_holds():
    """forward.MM_ONE_WAVE rounds the K split down (one wave of blocks_per_sm a SM) where the default
    rounds up (at least that many a SM): 8B shapes at batch 1 on 132 SMs, 3 blocks a SM (396)."""
    from tokenwire.kernels.cuda.forward import _matmul_plan
    for (N, K), up, down in [((28672, 4096), 448, 224), ((4096, 14336), 416, 384), ((6144, 4096), 384, 384)]:
        plans = [_matmul_plan(N, K, 64, 1, 132, "exact", 3, "", one_wave) for one_wave in (False, True)]
        assert [p.grid[0] * p.grid[2] for p in plans] == [up, down]
        assert plans[1].grid[2] * plans[1].units_per_split >= K // 128
