"""The fused decoder kernels against the unfused kernels they replace, on the GPU (skipped without one).

Each fused product (int4_matmul.cu "fused kernels") runs beside its unfused reference sequence
on the same random INT4 weights, uploaded twice: in logical row order for the reference, in
the fused epilogue's row order (kernels/cuda/layout.py) for the fused kernel.
- rope_f32 / rope_f16: rmsnorm -> qkv -> rope_kv_append   (q and both caches)
- silu / gelu:         rmsnorm -> gate_up -> glu_*        (the activation)
- argmax:              rmsnorm -> lm_head -> argmax_rows  (logits and greedy ids)
Shapes cross every tensor-core tile (M = 1 .. 64), K splits (few rows, long K) and the exact and
fp16 activation modes, and the experiments' twins of the decode kernels (forward.MM_VARIANT);
each fused launch runs twice, since its counters must re-arm themselves.
The RMSNorm prologue keeps rmsnorm.cu's order of operations, so results agree to rounding.
The fused attention (combine folded into the last split) is tested in test_cuda_kernels.py.
"""

import numpy as np
import pytest

from tokenwire.core.config import ModelConfig
from tokenwire.kernels.rope import rope_cos_sin, rope_inv_freq
from tokenwire.engine_build.quantize import quantize_int4
from tokenwire.kernels.cuda.forward import launch_matmul, launch_matmul_fused, launch_rmsnorm
from tokenwire.kernels.cuda.layout import glu_row_order, round_up, rope_row_order

from test_cuda_kernels import Gpu, assert_close, device, gpu, matmul_acts, padded, product_mode, upload_int4   # noqa: F401

pytestmark = pytest.mark.gpu


def model(D, Hq=4, Hkv=2, hd=64, I=128, V=100) -> ModelConfig:
    return ModelConfig(architecture="test", vocab_size=V, hidden_size=D, intermediate_size=I, num_layers=1,
                       num_heads=Hq, num_kv_heads=Hkv, head_dim=hd, max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_theta=10000.0)


def acts_for(gpu, lin, M, mode, rows=64):
    a = matmul_acts(gpu, lin, M, mode)
    a.am_keys, a.am_counters = gpu.zeros(8 * rows), gpu.zeros(4 * rows)
    return a


def weights(gpu, rng, N, K, G, order=None, bias=None):
    """(logical-order Linear, fused-order Linear) of one random INT4 matrix."""
    parts = quantize_int4(rng.standard_normal((N, K)).astype(np.float32), G, False)
    plain = upload_int4(gpu, parts, N, K, "tc", bias=bias)
    if order is None:
        return plain, plain
    fused = upload_int4(gpu, {k: v[order] for k, v in parts.items()}, N, K, "tc",
                        bias=None if bias is None else bias[order])
    return plain, fused


def normed_input(gpu, c, rng, M):
    D = c.hidden_size
    h = padded((rng.standard_normal((M, D)) * 2).astype(np.float32), round_up(D, 128))
    norm_w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    hp, nw = gpu.upload(h), gpu.upload(norm_w)
    xn = gpu.zeros(h.nbytes)
    launch_rmsnorm(gpu.dev, c, hp, h.shape[1], nw, xn, h.shape[1], 0, M, gpu.stream)
    return hp, nw, xn, h.shape[1]


CASES = [  # M, D, G: every tile size, and K splits (one row block, long K)
    (1, 256, 64), (3, 512, 128), (4, 128, 32), (8, 1024, 64), (13, 384, 128), (16, 2048, 128), (40, 256, 64),
    (64, 512, 128), (6, 256, 32), (7, 384, 128), (10, 512, 32), (12, 256, 64),   # every decode tile and group
]


@pytest.fixture(autouse=True)
def tensor_cores(gpu):
    if not gpu.dev.tensor_cores:
        pytest.skip("the fused kernels are tensor-core kernels (sm_80+)")


@pytest.mark.parametrize("mode", ["exact", "fp16", "variant-r"])
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("M,D,G", CASES)
@pytest.mark.parametrize("hd,bias", [(64, False), (128, True), (16, False)])
def test_fused_qkv_rope_matches_rmsnorm_qkv_rope(gpu, M, D, G, cache, mode, product_mode, hd, bias):
    mode = product_mode(mode)
    c = model(D, hd=hd)
    rng = np.random.default_rng(M + D + hd)
    heads = c.num_heads + 2 * c.num_kv_heads
    N = heads * hd
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    plain, fused = weights(gpu, rng, N, D, G, rope_row_order(heads, hd), b)
    hp, nw, xn, ld = normed_input(gpu, c, rng, M)
    cos, sin = rope_cos_sin(rope_inv_freq(c), np.arange(c.max_position_embeddings))
    cos_sin = gpu.upload(np.ascontiguousarray(np.stack([cos, sin], axis=-1)).astype(np.float32))
    positions = gpu.upload(rng.integers(0, c.max_position_embeddings, M).astype(np.int32))
    slots = gpu.upload(rng.permutation(4 * M)[:M].astype(np.int32))
    dt, isz = (np.float32, 4) if cache == "f32" else (np.float16, 2)
    cache_shape = (4 * M, c.num_kv_heads * hd)
    outs = {}
    for name in ("plain", "fused"):
        q = gpu.zeros(M * c.q_size * 4)
        kc, vc = gpu.zeros(4 * M * c.kv_size * isz), gpu.zeros(4 * M * c.kv_size * isz)
        rope = dict(positions=positions, slot_mapping=slots, cos_sin=cos_sin, max_positions=c.max_position_embeddings,
                    q_out=q, ldq=c.q_size, k_cache=kc, v_cache=vc, num_heads=c.num_heads,
                    num_kv_heads=c.num_kv_heads, head_dim=hd)
        acts = acts_for(gpu, plain, M, mode)
        for _ in range(2):
            if name == "plain":
                qkv = gpu.zeros(M * round_up(N, 128) * 4)
                launch_matmul(gpu.dev, plain, xn, ld, M, qkv, round_up(N, 128), False, acts, gpu.stream)
                gpu.launch(f"rope_kv_append_{cache}", (M,), 128, qkv=qkv, ldqkv=round_up(N, 128), **rope)
            else:
                launch_matmul_fused(gpu.dev, c, fused, f"rope_{cache}", hp, ld, M, 0, 0, nw, acts, gpu.stream, **rope)
        outs[name] = (gpu.download(q, np.float32, (M, c.q_size)), gpu.download(kc, dt, cache_shape),
                      gpu.download(vc, dt, cache_shape))
    for got, want in zip(outs["fused"], outs["plain"]):
        # an fp16 cache holds the fp32 result rounded once: where the two fp32 results differ in
        # their last bits next to a rounding boundary, the stored values differ by one fp16 step
        assert_close(got, want, rtol=1e-5, fp16_steps=1 if got.dtype == np.float16 else 0)


@pytest.mark.parametrize("mode", ["exact", "fp16", "variant-r"])
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("M,D,G", CASES)
@pytest.mark.parametrize("I", [8, 200, 1024])
def test_fused_gate_up_matches_rmsnorm_gate_up_glu(gpu, M, D, G, act, mode, product_mode, I):
    mode = product_mode(mode)
    c = model(D, I=I)
    rng = np.random.default_rng(M + D + I)
    plain, fused = weights(gpu, rng, 2 * I, D, G, glu_row_order(I))
    hp, nw, xn, ld = normed_input(gpu, c, rng, M)
    ldo = round_up(I, 128)
    outs = {}
    for name in ("plain", "fused"):
        out = gpu.zeros(M * ldo * 4)
        acts = acts_for(gpu, plain, M, mode)
        for _ in range(2):
            if name == "plain":
                gu = gpu.zeros(M * round_up(2 * I, 128) * 4)
                launch_matmul(gpu.dev, plain, xn, ld, M, gu, round_up(2 * I, 128), False, acts, gpu.stream)
                gpu.launch("glu_silu" if act == "silu" else "glu_gelu_tanh", (-(-I // 256), M), 256, gate_up=gu,
                           ldg=round_up(2 * I, 128), out=out, ldo=ldo, I=I)
            else:
                launch_matmul_fused(gpu.dev, c, fused, act, hp, ld, M, out, ldo, nw, acts, gpu.stream)
        outs[name] = gpu.download(out, np.float32, (M, ldo))
    assert_close(outs["fused"], outs["plain"], rtol=1e-5)


@pytest.mark.parametrize("mode", ["exact", "fp16", "variant-r"])
@pytest.mark.parametrize("M,D,G", CASES)
@pytest.mark.parametrize("V", [97, 1000, 32000])
def test_fused_lm_head_argmax_matches_rmsnorm_lm_head_argmax(gpu, M, D, G, mode, product_mode, V):
    mode = product_mode(mode)
    c = model(D, V=V)
    rng = np.random.default_rng(M + D + V)
    lin, _ = weights(gpu, rng, V, D, G)
    hp, nw, xn, ld = normed_input(gpu, c, rng, M)
    ldl = round_up(V, 128)
    acts = acts_for(gpu, lin, M, mode)
    logits, tokens = gpu.zeros(M * ldl * 4), gpu.zeros(M * 4)
    launch_matmul(gpu.dev, lin, xn, ld, M, logits, ldl, False, acts, gpu.stream)
    gpu.launch("argmax_rows", (M,), 1024, logits=logits, ldl=ldl, vocab_size=V, tokens=tokens)
    want_logits, want = gpu.download(logits, np.float32, (M, ldl)), gpu.download(tokens, np.int32, M)
    for _ in range(2):
        gpu.drv.memset_async(tokens, M * 4, gpu.stream)
        launch_matmul_fused(gpu.dev, c, lin, "argmax", hp, ld, M, logits, ldl, nw, acts, gpu.stream,
                            argmax_keys=acts.am_keys, argmax_counters=acts.am_counters, tokens=tokens)
        got_logits = gpu.download(logits, np.float32, (M, ldl))
        assert_close(got_logits[:, :V], want_logits[:, :V], rtol=1e-5)
        got = gpu.download(tokens, np.int32, M)
        # the fused argmax is exact on its own logits (first maximum); the reference's logits may
        # differ in the last bit, so a near-tie may pick the other token
        np.testing.assert_array_equal(got, np.argmax(got_logits[:, :V], axis=1))
        close = np.abs(got_logits[np.arange(M), got] - got_logits[np.arange(M), want]) <= 1e-5 * np.abs(got_logits).max()
        assert np.all((got == want) | close)
        assert not gpu.download(acts.am_keys, np.uint64, M).any() and not gpu.download(acts.am_counters, np.int32, M).any()
