"""Every CUDA kernel against its numpy reference, on the GPU (skipped without one).

Awkward shapes on purpose: M across every matmul kernel's boundary (4, 8, 16, 64), N and K off
the tile sizes, every group size, head sizes 8 to 256, GQA and MQA, sliding windows, prefill
chunks over a cached prefix, attention split along the sequence, vocabularies that send the
sampler down its slow path. The launches go through the same functions the executor uses.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tokenwire.kernels import sampling as ref_sampling
from tokenwire.core.config import ModelConfig
from tokenwire.core.executor import SeqStep
from tokenwire.kernels.model import gelu_tanh, paged_attention, rms_norm, silu
from tokenwire.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.engine_build.quantize import quantize_int4, quantize_int8
from tokenwire.kernels.cuda.device import attention_smem_bytes, sample_smem_bytes
from tokenwire.kernels.cuda import forward
from tokenwire.kernels.cuda.forward import launch_matmul
from tokenwire.kernels.cuda.kernels import MAX_TOP_LOGPROBS
from tokenwire.kernels.cuda.layout import pack_tc, round_up, tc_shape
from tokenwire.kernels.cuda.meta import _sampler_fields, _layout, fill_sampling
from tokenwire.kernels.cuda.weights import Linear
from tokenwire.kernels.reference import dequantize_int4, dequantize_int8, int4_linear

from conftest import gpu_driver_and_image

pytestmark = pytest.mark.gpu


class Gpu:
    """Device, allocations freed per test, blocking helpers (tests only)."""

    def __init__(self, dev):
        self.dev, self.drv, self.stream = dev, dev.drv, dev.compute_stream
        self.ptrs = []

    def zeros(self, nbytes) -> int:
        ptr = self.drv.mem_alloc(nbytes)
        self.ptrs.append(ptr)
        self.drv.memset_async(ptr, nbytes, self.stream)
        return ptr

    def upload(self, array) -> int:
        array = np.ascontiguousarray(array)
        ptr = self.zeros(array.nbytes)
        self.drv.memcpy_htod_async(ptr, array, array.nbytes, self.stream)
        self.sync()
        return ptr

    def download(self, ptr, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.drv.memcpy_dtoh_async(out, ptr, out.nbytes, self.stream)
        self.sync()
        return out

    def launch(self, name, grid, block, smem=0, **args):
        self.dev.launch(name, grid, block, self.stream, smem=smem, **args)

    def sync(self):
        self.drv.stream_synchronize(self.stream)

    def free(self):
        self.sync()
        for p in self.ptrs:
            self.drv.mem_free(p)
        self.ptrs = []


@pytest.fixture(scope="session")
def device():
    from tokenwire.kernels.cuda.device import Device
    return Device(*gpu_driver_and_image())


@pytest.fixture
def gpu(device):
    g = Gpu(device)
    yield g
    g.free()


def padded(x: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((x.shape[0], width), dtype=np.float32)
    out[:, :x.shape[1]] = x
    return out


def assert_close(got, want, rtol=1e-4, atol=None, fp16_steps=0):
    """|got - want| <= rtol * |want| + atol elementwise, atol rtol * max|want| unless given;
    fp16_steps adds that many fp16 rounding steps at each element's magnitude (for values stored
    as fp16 after an fp32 computation, where a last-bit difference before the rounding moves the
    result one step). Prints the worst errors as a `max-error` line: conftest.py tabulates them
    per test function at the end of the run."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(np.abs(want).max(initial=0)), 1e-6)
    allowed = rtol * np.abs(want) + (rtol * scale if atol is None else atol)
    if fp16_steps:
        larger = np.minimum(np.maximum(np.abs(got), np.abs(want)), 65504).astype(np.float16)
        allowed += fp16_steps * np.spacing(larger).astype(np.float64)
    with np.errstate(invalid="ignore"):                    # inf - inf: equal infinities are equal
        err = np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.abs(got - want))
    err[np.isnan(err)] = np.inf                             # NaN on one side only
    ratio = np.divide(err, allowed, out=np.where(err > 0, np.inf, 0.0), where=allowed > 0)
    worst = int(np.argmax(ratio)) if ratio.size else 0
    print(f"max-error abs={float(err.max(initial=0)):.3g} rel={float(err.max(initial=0)) / scale:.3g} "
          f"of-allowed={float(ratio.max(initial=0)):.3g}")
    assert not ratio.size or ratio.flat[worst] <= 1, (
        f"{int(np.sum(ratio > 1))} of {ratio.size} elements beyond the tolerance, worst "
        f"{float(ratio.flat[worst]):.3g}x at {np.unravel_index(worst, ratio.shape)}: got {got.flat[worst]!r}, "
        f"want {want.flat[worst]!r}")


# ------------------------------------------------------------------ INT4 matmuls

def upload_int4(gpu, parts, N, K, matmul, bias=None) -> Linear:
    qweight, scales, zeros = parts["qweight"], parts["scales"], parts["zeros"]
    G = qweight.shape[1] * 2 // scales.shape[1]
    bias_ptr = gpu.upload(bias.astype(np.float32)) if bias is not None else 0
    if matmul == "simt":
        return Linear("w", "int4_simt", N, K, qweight.shape[1] * 2, gpu.upload(qweight), gpu.upload(scales),
                      gpu.upload(zeros), G, bias_ptr)
    shape = tc_shape(N, K, G)
    qw, sz = gpu.zeros(shape.qw_words * 4), gpu.zeros(shape.sz_words * 4)
    gpu.launch("int4_repack_tc", (-(-(shape.qw_words + shape.sz_words) // 256),), 256,
               qweight=gpu.upload(qweight), scales=gpu.upload(scales), zeros=gpu.upload(zeros), N=N,
               Kb=qweight.shape[1], num_src_groups=scales.shape[1], qw=qw, sz=sz, num_tiles=shape.num_tiles,
               num_chunks=shape.num_chunks, num_groups=shape.num_groups)
    return Linear("w", "int4_tc", N, K, shape.Kp, qw, sz, 0, G, bias_ptr)


def test_repack_matches_the_numpy_layout(gpu):
    parts = quantize_int4(np.random.default_rng(0).standard_normal((45, 200)).astype(np.float32), 64, False)
    lin = upload_int4(gpu, parts, 45, 200, "tc")
    qw, sz, shape = pack_tc(parts["qweight"], parts["scales"], parts["zeros"], 200)
    np.testing.assert_array_equal(gpu.download(lin.w, np.uint32, qw.shape), qw)
    np.testing.assert_array_equal(gpu.download(lin.aux, np.uint32, sz.shape), sz)


MATMUL_CASES = [  # M, N, K, G
    (1, 1, 32, 32), (1, 17, 96, 32), (1, 300, 640, 128), (1, 16, 4096, 128), (3, 128, 200, 64),
    (4, 16, 128, 64), (5, 130, 256, 128), (8, 40, 64, 32), (9, 33, 384, 64), (3, 200, 2048, 64),
    (16, 256, 512, 128), (17, 19, 128, 32), (33, 129, 200, 64), (64, 128, 1024, 128), (100, 77, 96, 32),
    (257, 300, 256, 64), (6, 70, 256, 64), (12, 50, 128, 32),       # every decode tile at every group size
]


def matmul_acts(gpu, lin, M, mode):
    """The K-split workspace and counters launch_matmul takes from Activations, sized for this product,
    and the normalised activations (xn) a fused product of more than FUSED_NORM_TOKENS tokens reads."""
    from tokenwire.kernels.cuda.forward import matmul_plan
    plan = matmul_plan(lin, M, gpu.dev.num_sms, mode) if lin.kind == "int4_tc" else None
    ws = gpu.zeros(4 * max(plan.ws_floats if plan else 0, 1))
    counters = gpu.zeros(4 * max(plan.counters if plan else 0, 1))
    return SimpleNamespace(mm_ws=ws, mm_counters=counters, mm_mode=mode, xn=gpu.zeros(4 * M * lin.Kp), ld_xn=lin.Kp)


@pytest.fixture
def product_mode(monkeypatch):
    """'exact' | 'fp16' | 'variant-X' -> the activation mode launch_matmul takes; 'variant-X' is
    exact by experiment X's twins of the decode kernels (forward.MM_VARIANT, kernels.MM_VARIANTS)."""
    def resolve(mode: str) -> str:
        if mode.startswith("variant-"):
            monkeypatch.setattr(forward, "MM_VARIANT", mode.removeprefix("variant-"))
            return "exact"
        return mode
    return resolve


@pytest.mark.parametrize("matmul", ["exact", "fp16", "simt", "variant-r"])
@pytest.mark.parametrize("M,N,K,G", MATMUL_CASES)
def test_int4_matmul(gpu, matmul, M, N, K, G, product_mode):
    mode = product_mode(matmul)
    if matmul != "simt" and not gpu.dev.tensor_cores:
        pytest.skip("tensor-core kernels need sm_80+")
    rng = np.random.default_rng(M * 1000 + N + K)
    parts = quantize_int4(rng.standard_normal((N, K)).astype(np.float32), G, False)
    bias = rng.standard_normal(N).astype(np.float32)
    lin = upload_int4(gpu, parts, N, K, "simt" if matmul == "simt" else "tc", bias=bias)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    xr = x.astype(np.float16).astype(np.float32) if matmul == "fp16" else x      # what the fp16 kernels multiply
    width = round_up(K, 128)
    y0 = rng.standard_normal((M, N + 3)).astype(np.float32)
    xp, yp = gpu.upload(padded(x, width)), gpu.upload(y0)
    acts = matmul_acts(gpu, lin, M, "exact" if matmul == "simt" else mode)
    want = y0.copy()
    want[:, :N] += int4_linear(xr, parts["qweight"], parts["scales"], parts["zeros"], K) + bias
    for _ in range(2):                                    # twice: K-split counters must re-arm themselves
        gpu.drv.memcpy_htod_async(yp, y0, y0.nbytes, gpu.stream)
        launch_matmul(gpu.dev, lin, xp, width, M, yp, N + 3, True, acts, gpu.stream)
        assert_close(gpu.download(yp, np.float32, (M, N + 3)), want)


@pytest.mark.parametrize("kind", ["dense_f32", "dense_f16", "dense_i8"])
@pytest.mark.parametrize("M,N,K", [(1, 5, 8), (3, 97, 60), (20, 130, 264)])
def test_dense_matmul(gpu, kind, M, N, K):
    rng = np.random.default_rng(N + K)
    w = rng.standard_normal((N, K)).astype(np.float32)
    ldw = round_up(K, 8)
    if kind == "dense_i8":
        p = quantize_int8(w)
        ref_w, wp, aux = dequantize_int8(p["qweight"], p["scales"]), p["qweight"], gpu.upload(p["scales"])
    else:
        wp = w.astype(np.float32 if kind == "dense_f32" else np.float16)
        ref_w, aux = wp.astype(np.float32), 0
    rows = np.zeros((N, ldw), dtype=wp.dtype)
    rows[:, :K] = wp
    lin = Linear("w", kind, N, K, ldw, gpu.upload(rows), aux, 0, 0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xp, yp = gpu.upload(padded(x, 128 * math.ceil(K / 128))), gpu.zeros(M * N * 4)
    launch_matmul(gpu.dev, lin, xp, 128 * math.ceil(K / 128), M, yp, N, False, matmul_acts(gpu, lin, M, "exact"),
                  gpu.stream)
    assert_close(gpu.download(yp, np.float32, (M, N)), x @ ref_w.T)


# ------------------------------------------------------------------ embedding, norm, activation

@pytest.mark.parametrize("kind", ["f32", "f16", "i8", "i4"])
def test_embedding(gpu, kind):
    rng = np.random.default_rng(1)
    V, D, mult = 50, 72, 2.5
    w = rng.standard_normal((V, D)).astype(np.float32)
    scales = zeros = 0
    if kind == "i4":
        p = quantize_int4(w, 32, False)
        table, ldw, G = p["qweight"], p["qweight"].shape[1], 32
        scales, zeros = gpu.upload(p["scales"]), gpu.upload(p["zeros"])
        ref = dequantize_int4(p["qweight"], p["scales"], p["zeros"], D)
    elif kind == "i8":
        p = quantize_int8(w)
        table, ldw, G, scales = p["qweight"], D, 0, gpu.upload(p["scales"])
        ref = dequantize_int8(p["qweight"], p["scales"])
    else:
        table = w.astype(np.float32 if kind == "f32" else np.float16)
        ldw, G, ref = D, 0, table.astype(np.float32)
    ids = np.array([0, 49, 7, 7, 60, -1, 3], dtype=np.int32)           # 60 and -1: out of range -> zeros
    out = gpu.zeros(len(ids) * 128 * 4)
    gpu.launch(f"embed_{kind}", (len(ids),), 256, token_ids=gpu.upload(ids), table=gpu.upload(table), scales=scales,
               zeros=zeros, ldw=ldw, group_size=G, vocab_size=V, D=D, multiplier=mult, out=out, ldo=128)
    want = np.where(((ids >= 0) & (ids < V))[:, None], ref[np.clip(ids, 0, V - 1)] * np.float32(mult), 0)
    assert_close(gpu.download(out, np.float32, (len(ids), 128))[:, :D], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("D", [8, 64, 1000, 4096])
def test_rmsnorm_and_row_gather(gpu, D):
    rng = np.random.default_rng(D)
    x = (rng.standard_normal((6, D)) * 4).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    rows = np.array([5, 0, 3], dtype=np.int32)
    ld = round_up(D, 128)
    out = gpu.zeros(3 * ld * 4)
    gpu.launch("rmsnorm", (3,), 256, x=gpu.upload(padded(x, ld)), ldx=ld, rows=gpu.upload(rows), w=gpu.upload(w),
               out=out, ldo=ld, D=D, eps=1e-5, accumulate=0)
    assert_close(gpu.download(out, np.float32, (3, ld))[:, :D], rms_norm(x[rows], w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name,fn", [("glu_silu", silu), ("glu_gelu_tanh", gelu_tanh)])
def test_gated_activation(gpu, name, fn):
    rng = np.random.default_rng(2)
    T, I = 5, 300
    gu = (rng.standard_normal((T, 2 * I)) * 5).astype(np.float32)
    out = gpu.zeros(T * 384 * 4)
    gpu.launch(name, (-(-I // 256), T), 256, gate_up=gpu.upload(gu), ldg=2 * I, out=out, ldo=384, I=I)
    # the reference in float64: evaluated in float32, 0.5 x (1 + tanh(u)) loses every digit for
    # x < -5 (1 + tanh rounds to a few ulps of 1: 1.6e-7 where the function is 1.3e-8), which the
    # kernel's x / (1 + e^(-2u)) does not (H200, 2026-11-27)
    want = fn(gu[:, :I].astype(np.float64)) * gu[:, I:].astype(np.float64)
    assert_close(gpu.download(out, np.float32, (T, 384))[:, :I], want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ RoPE + KV append, attention

def config(Hq, Hkv, hd, window=None) -> ModelConfig:
    return ModelConfig(architecture="test", vocab_size=10, hidden_size=Hq * hd, intermediate_size=8, num_layers=1,
                       num_heads=Hq, num_kv_heads=Hkv, head_dim=hd, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       rope_theta=500000.0, sliding_window=window)


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("Hq,Hkv,hd", [(4, 2, 8), (8, 8, 64), (32, 8, 128), (8, 1, 256)])
def test_rope_and_kv_append(gpu, cache, Hq, Hkv, hd):
    c = config(Hq, Hkv, hd)
    rng = np.random.default_rng(hd)
    T, P, slots_total = 9, 4096, 64
    qkv = rng.standard_normal((T, (Hq + 2 * Hkv) * hd)).astype(np.float32)
    pos = rng.integers(0, P, T).astype(np.int32)
    slots = rng.permutation(slots_total)[:T].astype(np.int32)
    cos, sin = rope_cos_sin(rope_inv_freq(c), np.arange(P))
    dt = np.float32 if cache == "f32" else np.float16
    kc, vc, q = gpu.zeros(slots_total * Hkv * hd * 4), gpu.zeros(slots_total * Hkv * hd * 4), gpu.zeros(T * Hq * hd * 4)
    gpu.launch(f"rope_kv_append_{cache}", (T,), 128, qkv=gpu.upload(qkv), ldqkv=qkv.shape[1], positions=gpu.upload(pos),
               slot_mapping=gpu.upload(slots), cos_sin=gpu.upload(np.stack([cos, sin], -1)), max_positions=P, q_out=q,
               ldq=Hq * hd, k_cache=kc, v_cache=vc, num_heads=Hq, num_kv_heads=Hkv, head_dim=hd)
    cq, sq = cos[pos], sin[pos]
    want_q = apply_rope(qkv[:, :Hq * hd].reshape(T, Hq, hd), cq, sq).reshape(T, -1)
    want_k = apply_rope(qkv[:, Hq * hd:(Hq + Hkv) * hd].reshape(T, Hkv, hd), cq, sq).reshape(T, -1)
    np.testing.assert_array_equal(gpu.download(q, np.float32, (T, Hq * hd)), want_q)
    k = gpu.download(kc, dt, (slots_total, Hkv * hd))[slots]
    v = gpu.download(vc, dt, (slots_total, Hkv * hd))[slots]
    np.testing.assert_array_equal(k, want_k.astype(dt))
    np.testing.assert_array_equal(v, qkv[:, (Hq + Hkv) * hd:].astype(dt))


def one_sequence_attention(q, k_cache, v_cache, table, context_len, positions, window, scale, cap=None):
    """kernels/model.py's paged_attention for one sequence: q [n, Hq, hd] -> [n, Hq*hd]."""
    return paged_attention(q[None], k_cache, v_cache, table[None], np.array([context_len]), positions[None],
                           window, scale, cap)[0]


# split: keys per split, 0 unsplit, -Z: Z splits with split_size 0 (each item's keys spread over them)
ATTENTION_CASES = [  # Hq, Hkv, hd, block_size, window, split, chunk, soft cap (Gemma 2)
    (4, 2, 8, 16, None, 0, 1, None), (8, 8, 64, 16, None, 64, 1, None), (32, 8, 128, 16, None, 128, 1, None),
    (8, 1, 256, 32, None, 0, 5, None), (32, 1, 64, 16, None, 96, 1, None), (12, 4, 64, 8, 40, 0, 7, None),
    (8, 2, 128, 16, 100, 64, 1, None), (4, 4, 32, 16, None, 0, 33, None),
    (8, 4, 128, 16, 40, 0, 7, 2.0), (16, 8, 256, 16, None, 64, 1, 50.0),
    (32, 8, 128, 16, None, -5, 1, None), (8, 2, 128, 16, 100, -7, 1, None), (12, 4, 64, 8, 40, -3, 7, 2.0),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("Hq,Hkv,hd,bs,window,split,chunk,cap", ATTENTION_CASES)
def test_paged_attention(gpu, cache, Hq, Hkv, hd, bs, window, split, chunk, cap, fused):
    """fused: attention_paged_fused_* (the combine folded into the last split) against the same
    numpy reference; launched twice, since its split counters must re-arm themselves."""
    from tokenwire.kernels.cuda.forward import heads_per_block
    c = config(Hq, Hkv, hd, window)
    rng = np.random.default_rng(Hq + hd + bs + chunk)
    ctx = [1, 37, 300, 129]                                 # context after this step, per sequence
    num_blocks = 200
    dt = np.float32 if cache == "f32" else np.float16
    kc = rng.standard_normal((num_blocks, bs, Hkv, hd)).astype(dt)
    vc = rng.standard_normal((num_blocks, bs, Hkv, hd)).astype(dt)
    perm = rng.permutation(num_blocks)
    ld_bt = max(-(-n // bs) for n in ctx)
    tables = np.zeros((len(ctx), ld_bt), dtype=np.int32)
    owned = 0
    for s, n in enumerate(ctx):
        k = -(-n // bs)
        tables[s, :k] = perm[owned:owned + k]
        owned += k
    hpb = heads_per_block(c)
    qpi = 16 // hpb
    positions, items, want_rows, t = [], [], [], 0
    for s, n in enumerate(ctx):
        nq = min(chunk, n)
        p = np.arange(n - nq, n, dtype=np.int32)
        positions.extend(p)
        for q0 in range(0, nq, qpi):
            items.append((s, t + q0, min(qpi, nq - q0)))
        want_rows.append((t, nq, s, n, p))
        t += nq
    T = t
    q = rng.standard_normal((T, Hq, hd)).astype(np.float32)
    splits = 1 if not split else -split if split < 0 else max(-(-n // split) for n in ctx)
    out = gpu.zeros(T * Hq * hd * 4)
    ws_ml, ws_acc = gpu.zeros(T * Hq * splits * 8), gpu.zeros(T * Hq * splits * hd * 4)
    args = dict(q=gpu.upload(q), ldq=Hq * hd, k_cache=gpu.upload(kc), v_cache=gpu.upload(vc),
                block_tables=gpu.upload(tables), ld_bt=ld_bt, positions=gpu.upload(np.array(positions, np.int32)),
                items=gpu.upload(np.array(items, np.int32)), out=out, ldo=Hq * hd, ws_ml=ws_ml, ws_acc=ws_acc,
                max_splits=splits, num_heads=Hq, num_kv_heads=Hkv, head_dim=hd, block_size=bs, heads_per_block=hpb,
                sliding_window=window or 0, scale=float(np.float32(hd ** -0.5)), softcap=cap or 0.0,
                split_size=split if split > 0 else 0 if split < 0 else 1 << 30)
    grid = (len(items), Hkv * (Hq // Hkv // hpb), splits)
    counters = gpu.zeros(4 * grid[0] * grid[1])
    for _ in range(2 if fused else 1):
        gpu.drv.memset_async(out, T * Hq * hd * 4, gpu.stream)
        if fused:
            gpu.launch(f"attention_paged_fused_{cache}", grid, 128, smem=attention_smem_bytes(hd), counters=counters,
                       **args)
        else:
            gpu.launch(f"attention_paged_{cache}", grid, 128, smem=attention_smem_bytes(hd), **args)
            if splits > 1:
                gpu.launch("attention_combine", (T, Hq), 128, ws_ml=ws_ml, ws_acc=ws_acc, num_splits=splits,
                           max_splits=splits, out=out, ldo=Hq * hd, num_heads=Hq, head_dim=hd)
        got = gpu.download(out, np.float32, (T, Hq * hd))
        for t0, nq, s, n, p in want_rows:
            want = one_sequence_attention(q[t0:t0 + nq], kc.astype(np.float32), vc.astype(np.float32), tables[s], n,
                                          p, window, np.float32(hd ** -0.5), cap)
            assert_close(got[t0:t0 + nq], want, rtol=2e-5)
    assert not gpu.download(counters, np.int32, grid[0] * grid[1]).any(), "split counters not re-armed"


def test_rmsnorm_accumulates_into_the_residual(gpu):
    """Gemma 2/3's post norms: out += RMSNorm(x) * w."""
    D, ld = 200, 256
    rng = np.random.default_rng(5)
    x, h = rng.standard_normal((3, D)).astype(np.float32), rng.standard_normal((3, D)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    out = gpu.upload(padded(h, ld))
    gpu.launch("rmsnorm", (3,), 256, x=gpu.upload(padded(x, ld)), ldx=ld, rows=0, w=gpu.upload(w), out=out, ldo=ld,
               D=D, eps=1e-6, accumulate=1)
    assert_close(gpu.download(out, np.float32, (3, ld))[:, :D], h + rms_norm(x, w, 1e-6),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("hd", [16, 64, 128, 256])
def test_head_rmsnorm_on_q_and_k_heads(gpu, hd):
    """Qwen3 / Gemma 3: each Q and K head normed over hd with its own weights; V untouched."""
    Hq, Hkv, T = 4, 2, 5
    rng = np.random.default_rng(hd)
    width = (Hq + 2 * Hkv) * hd
    qkv = rng.standard_normal((T, width)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32), (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    buf = gpu.upload(qkv)
    gpu.launch("head_rmsnorm", (T, Hq + Hkv), 32, qkv=buf, ldqkv=width, q_norm=gpu.upload(qn), k_norm=gpu.upload(kn),
               num_heads=Hq, head_dim=hd, eps=1e-6)
    got = gpu.download(buf, np.float32, (T, width))
    heads = qkv[:, :(Hq + Hkv) * hd].reshape(T, Hq + Hkv, hd)
    want_q = rms_norm(heads[:, :Hq], qn, 1e-6).reshape(T, -1)
    want_k = rms_norm(heads[:, Hq:], kn, 1e-6).reshape(T, -1)
    assert_close(got[:, :(Hq + Hkv) * hd], np.concatenate([want_q, want_k], axis=1), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(got[:, (Hq + Hkv) * hd:], qkv[:, (Hq + Hkv) * hd:])


def test_logit_softcap(gpu):
    V, ld = 1000, 1024
    logits = (np.random.default_rng(0).standard_normal((3, V)) * 40).astype(np.float32)
    buf = gpu.upload(padded(logits, ld))
    gpu.launch("logit_softcap", (3,), 256, logits=buf, ldl=ld, vocab_size=V, cap=30.0)
    assert_close(gpu.download(buf, np.float32, (3, ld))[:, :V],
                               np.float32(30) * np.tanh(logits / np.float32(30)), rtol=2e-6, atol=2e-5)


# ------------------------------------------------------------------ sampling

def run_sampler(gpu, logits: np.ndarray, seqs) -> tuple:
    """Params through meta.fill_sampling (as the executor fills them), then the three kernels."""
    R, V = logits.shape
    layout = _layout([], _sampler_fields(R), 1 << 16)
    buf = np.zeros(layout.nbytes, dtype=np.uint8)
    fill_sampling(layout.views(buf), seqs, 1 << 16)
    meta = gpu.upload(buf)
    p = layout.ptrs(meta)
    lg, pl = gpu.upload(logits), gpu.zeros(logits.nbytes)
    tokens, tl = gpu.zeros(R * 4), gpu.zeros(R * 8)
    top_ids, top_lp = gpu.zeros(R * MAX_TOP_LOGPROBS * 4), gpu.zeros(R * MAX_TOP_LOGPROBS * 8)
    gpu.launch("apply_penalties", (R,), 256, logits=lg, plogits=pl, ldl=V, vocab_size=V, fparams=p["fparams"],
               iparams=p["iparams"], row_ptr=p["pen_row_ptr"], entries=p["pen_entries"])
    gpu.launch("sample_tokens", (R,), 1024, smem=sample_smem_bytes(), logits=lg, plogits=pl, ldl=V, vocab_size=V,
               dparams=p["dparams"], iparams=p["iparams"], rng=p["rng"], tokens=tokens)
    gpu.launch("compute_logprobs", (R,), 1024, logits=lg, ldl=V, vocab_size=V, iparams=p["iparams"], tokens=tokens,
               token_logprob=tl, top_ids=top_ids, top_logprobs=top_lp)
    return (gpu.download(tokens, np.int32, R), gpu.download(tl, np.float64, R),
            gpu.download(top_ids, np.int32, (R, MAX_TOP_LOGPROBS)), gpu.download(top_lp, np.float64, (R, MAX_TOP_LOGPROBS)))


def seq_with(params, seed, prompt=(), output=()):
    return SeqStep(0, [1], 0, [0], True, params, seed, list(prompt), list(output))


SAMPLING_PARAMS = [
    SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.9, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.3, top_p=0.5, top_k=10),
    SamplingParams(temperature=0.8, min_p=0.1), SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3, logprobs=5),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=0),
    SamplingParams(temperature=1.0, top_p=0.8, logprobs=20),
]


@pytest.mark.parametrize("V", [37, 1000, 32000])
def test_sampler_matches_core_sampling(gpu, V):
    rng = np.random.default_rng(V)
    seqs, rows = [], []
    for i in range(96):
        params = SAMPLING_PARAMS[i % len(SAMPLING_PARAMS)]
        prompt = rng.integers(0, V, 20)
        output = rng.integers(0, V, i % 7)
        seqs.append(seq_with(params, seed=int(rng.integers(0, 2 ** 63)) * 2 + 1, prompt=prompt, output=output))
        rows.append((rng.standard_normal(V) * rng.uniform(0.5, 6)).astype(np.float32))
    logits = np.stack(rows)
    logits[5, :3] = logits[5].max() + 1                              # ties: the lower index wins
    tokens, tl, top_ids, top_lp = run_sampler(gpu, logits, seqs)
    want = ref_sampling.sample(logits, seqs)
    np.testing.assert_array_equal(tokens, want.token_ids)
    for r, lp in enumerate(want.logprobs):
        if lp is None:
            continue
        n = len(lp.top_ids)
        assert top_ids[r, :n].tolist() == list(lp.top_ids)
        np.testing.assert_allclose([tl[r], *top_lp[r, :n]], [lp.token_logprob, *lp.top_logprobs], rtol=1e-9, atol=1e-9)


def test_flat_distributions_take_the_exact_slow_path(gpu):
    """Nucleus wider than the shared-memory candidates: the bisection path, same answers."""
    V = 128256
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((6, V)) * 0.05).astype(np.float32)
    params = [SamplingParams(temperature=2.0, top_p=0.99), SamplingParams(temperature=1.0, top_k=5000),
              SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=1.5, top_p=0.5, top_k=3000),
              SamplingParams(temperature=1.0, top_p=0.999, min_p=0.9), SamplingParams(temperature=1.0)]
    seqs = [seq_with(p, seed=1000 + i) for i, p in enumerate(params)]
    tokens = run_sampler(gpu, logits, seqs)[0]
    np.testing.assert_array_equal(tokens, ref_sampling.sample(logits, seqs).token_ids)


def test_argmax_rows_takes_the_first_maximum(gpu):
    logits = np.zeros((3, 5000), dtype=np.float32)
    logits[0, [7, 4000]] = 3.0
    logits[1, 4999] = 1.0
    logits[2] = np.linspace(-1, 1, 5000, dtype=np.float32)[::-1]
    tokens = gpu.zeros(12)
    gpu.launch("argmax_rows", (3,), 1024, logits=gpu.upload(logits), ldl=5000, vocab_size=5000, tokens=tokens)
    assert gpu.download(tokens, np.int32, 3).tolist() == [7, 4999, 0]
