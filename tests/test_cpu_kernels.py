"""The C INT4 / dense / int8 products against kernels/reference.py, on every ISA this CPU
has (scalar always; AVX2 and AVX-512 where supported) and awkward shapes: batch 1 to 64,
N not a multiple of the 16-row tile, K on and off group boundaries, group sizes 32/64/128.

fp32 activations must agree with the exact (float64) product to within a float32
accumulation bound, as the numpy reference itself does; int8 activations within their
documented bound (kernels.cpu.int8_error_bound). Plus: thread count never changes a result
(tiles are split, not sums), the GIL is released during a call, bad input fails with a
message, and without the extension the numpy reference runs with one warning line."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tokenwire.kernels import cpu
from tokenwire.kernels.reference import dequantize_int4, int4_linear

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason=f"C kernels not built: {cpu.IMPORT_ERROR}")

ISAS = [name for name in cpu.ISAS if cpu.isa_supported(name)]
EPS32 = np.finfo(np.float32).eps


@pytest.fixture(params=ISAS)
def isa(request):
    before = cpu.isa()
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(before)


def random_int4(rng, n, k, group_size, integer_zeros=True):
    """Engine-format parts of a random [n, k] INT4 weight (padding nibbles random too: the
    reference trims them, the kernels must ignore them)."""
    kp = -(-k // group_size) * group_size
    qweight = rng.integers(0, 256, (n, kp // 2), dtype=np.uint8)
    scales = (rng.random((n, kp // group_size)) * 0.05 + 0.001).astype(np.float16)
    zeros = rng.integers(0, 16, (n, kp // group_size)) if integer_zeros else rng.random((n, kp // group_size)) * 15
    return qweight, scales, zeros.astype(np.float16)


def fp32_bound(x, qweight, scales, zeros, k):
    """A float32 accumulation-order bound for any summation order of the product's terms:
    (K + 4) * eps * sum_k |q| s |x| + |z| s |x| (the kernels sum q*x and z*sum(x) separately)."""
    from tokenwire.kernels.reference import unpack_int4
    q = unpack_int4(qweight)[:, :k].astype(np.float64)
    g = 2 * qweight.shape[1] // scales.shape[1]
    s = np.repeat(scales.astype(np.float64), g, axis=1)[:, :k]
    z = np.repeat(zeros.astype(np.float64), g, axis=1)[:, :k]
    return (k + 4) * EPS32 * (np.abs(x) @ ((q + np.abs(z)) * s).T)


SHAPES = [  # (M, N, K, G); M = 1 has its own kernels (decode): odd and even group counts, all group sizes
    (1, 1, 32, 32), (1, 16, 64, 32), (1, 17, 100, 32), (1, 40, 192, 64), (1, 33, 130, 64), (1, 16, 896, 64),
    (1, 20, 384, 128), (1, 31, 256, 128), (2, 33, 64, 64), (3, 5, 191, 64), (4, 48, 128, 128),
    (5, 16, 129, 128), (7, 31, 256, 64), (8, 16, 8, 32), (9, 47, 96, 32), (16, 64, 384, 128), (17, 3, 64, 64),
    (33, 20, 160, 32), (64, 40, 192, 64),
    (10, 19, 128, 32), (12, 33, 160, 32), (15, 20, 256, 128), (30, 17, 192, 64),  # 9-15 rows in one pass
]


@pytest.mark.parametrize("m,n,k,g", SHAPES)
def test_fp32_activations_match_the_reference_to_float32_rounding(isa, m, n, k, g):
    rng = np.random.default_rng(m * 1000 + n + k)
    parts = random_int4(rng, n, k, g, integer_zeros=(m % 2 == 0))
    x = rng.standard_normal((m, k)).astype(np.float32)
    exact = x.astype(np.float64) @ dequantize_int4(*parts, k).astype(np.float64).T
    bound = fp32_bound(x, *parts, k)
    got = cpu.Int4Linear(*parts, k)(x)
    ref = int4_linear(x, *parts, k)
    assert got.shape == (m, n) and got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)
    assert np.all(np.abs(ref - exact) <= bound)          # the reference meets the same bound


def test_fp32_precision_over_a_wide_dynamic_range(isa):
    """Groups mixing 1e-30 and 1e10, all-zero and subnormal-only groups: the exact path keeps
    every output within float32 resolution of the group's largest activation (AVX-512 carries
    activations as 23-bit integers per group) plus the accumulation bound."""
    rng = np.random.default_rng(11)
    m, n, k, g = 3, 40, 256, 64
    parts = random_int4(rng, n, k, g)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :64] *= np.float32(1e10)
    x[0, 1:64:2] = np.float32(1e-30)
    x[1, 64:128] = 0.0
    x[1, 128:192] = np.float32(1e-42)                                       # subnormal
    x[2] *= np.float32(1e-20)
    exact = x.astype(np.float64) @ dequantize_int4(*parts, k).astype(np.float64).T
    from tokenwire.kernels.reference import unpack_int4
    q = unpack_int4(parts[0]).astype(np.float64)
    per = (q + np.abs(np.repeat(parts[2].astype(np.float64), g, 1))) * np.repeat(parts[1].astype(np.float64), g, 1)
    group_max = np.abs(x.astype(np.float64)).reshape(m, -1, g).max(axis=2)                 # [M, ng]
    resolution = EPS32 * group_max @ per.reshape(n, -1, g).sum(axis=2).T                    # [M, N]
    w = cpu.Int4Linear(*parts, k)
    got = w(x)
    rows = np.concatenate([w(x[i:i + 1]) for i in range(m)])          # one row at a time: the decode kernels
    bound = fp32_bound(x, *parts, k) + resolution + 1e-37
    for result in (got, rows):
        assert np.all(np.isfinite(result))
        assert np.all(np.abs(result - exact) <= bound)


@pytest.mark.parametrize("m,n,k,g", SHAPES)
def test_int8_activations_stay_within_their_documented_bound(isa, m, n, k, g):
    rng = np.random.default_rng(m * 7 + n * 3 + k)
    parts = random_int4(rng, n, k, g)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, ::7] *= 10                                            # outliers widen some groups' steps
    w = dequantize_int4(*parts, k).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    bound = cpu.int8_error_bound(x, np.abs(w), g) + fp32_bound(x, *parts, k) * 2
    got = cpu.Int4Linear(*parts, k)(x, activations="int8")
    err = np.abs(got - exact)
    assert np.all(err <= bound), np.max(err / bound)
    # and it is a real approximation, not the fp32 path in disguise
    assert np.max(err) > np.max(np.abs(cpu.Int4Linear(*parts, k)(x) - exact))


@pytest.mark.parametrize("g", [32, 64, 128])
def test_a_rows_int8_product_does_not_depend_on_the_rows_beside_it(isa, g):
    """A row alone (the decode kernel) and the same row among 2-33 rows (the batch kernel's
    passes of 16 and the rest) give the same bits, so a greedy request's tokens do not depend
    on what shares its step: other streams, speculation's verify rows (test_speculative's
    16-request comparison failed on AVX-512 while the decode kernel rounded differently). The
    served activations only: the exact path's decode kernels sum in another order."""
    rng = np.random.default_rng(g)
    k = 4 * g
    parts = random_int4(rng, 40, k, g)
    x = rng.standard_normal((33, k)).astype(np.float32)
    w = cpu.Int4Linear(*parts, k)
    alone = np.concatenate([w(x[i:i + 1], activations="int8") for i in range(33)])
    for m in (2, 5, 8, 9, 12, 16, 17, 33):
        np.testing.assert_array_equal(w(x[:m], activations="int8"), alone[:m], err_msg=f"{m} rows")


def test_every_isa_computes_the_same_product():
    rng = np.random.default_rng(5)
    parts = random_int4(rng, 70, 300, 64)
    x = rng.standard_normal((11, 300)).astype(np.float32)
    before = cpu.isa()
    try:
        results = {}
        for name in ISAS:
            cpu.set_isa(name)
            w = cpu.Int4Linear(*parts, 300)
            results[name] = (w(x), w(x, activations="int8"))
    finally:
        cpu.set_isa(before)
    base = results["scalar"]
    for name, (f32, q8) in results.items():
        np.testing.assert_allclose(f32, base[0], rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(q8, base[1], rtol=1e-5, atol=1e-5, err_msg=name)


def test_thread_count_never_changes_a_result():
    rng = np.random.default_rng(6)
    parts = random_int4(rng, 200, 512, 128)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    w = cpu.Int4Linear(*parts, 512)
    before = cpu.num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            cpu.set_num_threads(threads)
            assert cpu.num_threads() == threads
            outs.append((w(x), w(x, activations="int8")))
    finally:
        cpu.set_num_threads(before)
    for f32, q8 in outs[1:]:
        assert np.array_equal(f32, outs[0][0]) and np.array_equal(q8, outs[0][1])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_dense_and_int8_rows(isa, dtype):
    rng = np.random.default_rng(7)
    # odd shapes (a 4-row block's remainder, a k tail); and enough rows for the prefetch ahead
    for n, k, m in [(37, 77, 1), (37, 77, 3), (37, 77, 6), (301, 64, 1), (301, 64, 2)]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        if dtype == np.int8:
            w = rng.integers(-127, 128, (n, k), dtype=np.int8)
            scales = (rng.random(n) * 0.01 + 1e-3).astype(np.float16)
            dense = w.astype(np.float64) * scales.astype(np.float64)[:, None]
        else:
            w, scales = rng.standard_normal((n, k)).astype(dtype), None
            dense = w.astype(np.float64)
        out = np.empty((m, n), np.float32)
        cpu._cpu.rows_linear(x, w, scales, out)
        exact = x.astype(np.float64) @ dense.T
        bound = (k + 2) * EPS32 * (np.abs(x) @ np.abs(dense).T)
        assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_int8_rows_under_int8_activations_stay_within_their_bound(isa, m):
    """The classifier's q8 path: x rounded per block of 32, exact integer block sums, so within
    int8_error_bound(x, |W|, 32) of the float64 product, for every int8 weight (-128 too);
    a K off the 32-value blocks keeps the float rows, bit for bit."""
    rng = np.random.default_rng(11)
    for n, k in [(37, 64), (301, 96), (5, 32)]:        # a 4-row block's remainder; rows for the prefetch ahead
        x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, k)))).astype(np.float32)
        w = rng.integers(-128, 128, (n, k), dtype=np.int8)
        w[n // 2] = -128
        scales = (rng.random(n) * 0.01 + 1e-3).astype(np.float16)
        dense = w.astype(np.float64) * scales.astype(np.float64)[:, None]
        q8, f32 = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
        cpu._cpu.rows_linear(x, w, scales, q8, "int8")
        cpu._cpu.rows_linear(x, w, scales, f32)
        err = np.abs(q8 - x.astype(np.float64) @ dense.T)
        bound = cpu.int8_error_bound(x, np.abs(dense), 32) + 2 * (k + 2) * EPS32 * (np.abs(x) @ np.abs(dense).T)
        assert np.all(err <= bound) and not np.array_equal(q8, f32)
    x, w = rng.standard_normal((m, 77)).astype(np.float32), rng.integers(-127, 128, (9, 77), dtype=np.int8)
    scales, q8, f32 = np.ones(9, np.float16), np.empty((m, 9), np.float32), np.empty((m, 9), np.float32)
    cpu._cpu.rows_linear(x, w, scales, q8, "int8")
    cpu._cpu.rows_linear(x, w, scales, f32)
    assert np.array_equal(q8, f32)


def test_sampling_exponentials_are_within_their_ulps_of_numpys(isa):
    """Temperature sampling's exponentials (kernels/sampling.py's `exponentials`): the
    reference's arguments x = l / T - max(l / T), exp within sampling.EXP_ULPS ulp of np.exp
    (1 measured on AVX2, 0 on scalar: libm), 0 below -708, NaN kept, block sums of them."""
    from tokenwire.kernels.sampling import EXP_ULPS
    rng = np.random.default_rng(12)
    sweep = np.concatenate([[0.0], -np.geomspace(1e-12, 707.9, 50_001), [-708.5, -1e4, -np.inf]])
    logits = np.stack([sweep, rng.standard_normal(sweep.size) * 40]).astype(np.float32)
    logits = np.concatenate([logits, logits[:, :1001]], axis=1)           # a ragged last block and a tail
    logits[1, 77] = np.nan
    for temperature in (1.0, 0.7, 3.0):
        temps = np.full(2, temperature)
        e, sums = cpu.sampling_exponentials(logits, temps, 512)
        x = logits.astype(np.float64) / temps[:, None]
        x -= x.max(axis=1, keepdims=True)
        want = np.exp(x)
        normal = x >= -708
        assert np.all(np.abs(e - want)[normal] <= EXP_ULPS * np.spacing(want[normal]))
        assert np.all(e[x < -708] == 0)
        assert np.isnan(e[1, 77]) and np.isnan(sums[1, 77 // 512]) and not np.isnan(e[0]).any()
        starts = np.arange(0, logits.shape[1], 512)
        got, exact = sums[0], np.add.reduceat(e[0], starts)
        assert np.all(np.abs(got - exact) <= 512 * 2.0 ** -52 * exact)
    with pytest.raises(ValueError, match="temperatures"):
        cpu.sampling_exponentials(logits, np.zeros(2), 512)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_gated_activations_match_the_reference_within_a_few_ulp(isa, gelu):
    from tokenwire.kernels.model import gelu_tanh, silu
    rng = np.random.default_rng(10)
    gate = np.concatenate([rng.standard_normal(997) * 4, np.linspace(-120, 120, 101), [0.0, -0.0, 1e-30, -88.7, 89.0]])
    gate = gate.astype(np.float32)
    up = rng.standard_normal(gate.size).astype(np.float32)
    out = np.empty_like(gate)
    cpu._cpu.gated(gate, up, out, gelu)
    g64 = gate.astype(np.float64)
    act = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) if gelu else g64 / (1 + np.exp(-g64))
    exact = act * up
    # a few ulp of the result, plus for GELU's negative tail the float32 cancellation in
    # (1 + tanh) that the reference formula has too: eps relative to |x * up| / 2
    bound = 8 * np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64) + 1e-37
    if gelu:
        bound += 4 * EPS32 * np.abs(0.5 * g64 * up)
    assert np.all(np.abs(out - exact) <= bound), np.max(np.abs(out - exact) / bound)
    with np.errstate(over="ignore"):                                          # exp(120) -> inf, as intended
        ref = ((gelu_tanh if gelu else silu)(gate) * up).astype(np.float64)   # numpy float32, kernels/model.py
    assert np.all(np.abs(ref - exact) <= bound)


def test_the_gil_is_released_for_the_whole_call():
    """While one long product runs in a thread, the main thread keeps executing Python."""
    rng = np.random.default_rng(8)
    w = cpu.Int4Linear(*random_int4(rng, 4096, 2048, 64), 2048)
    x = rng.standard_normal((64, 2048)).astype(np.float32)
    window = {}

    def run():
        window["start"] = time.perf_counter()
        w(x)
        window["end"] = time.perf_counter()

    thread = threading.Thread(target=run)
    stamps = []
    thread.start()
    while thread.is_alive():
        stamps.append(time.perf_counter())
    thread.join()
    inside = [t for t in stamps if window["start"] < t < window["end"]]
    assert window["end"] - window["start"] > 0.005
    assert len(inside) > 100, f"main thread ran {len(inside)} times during a {window['end'] - window['start']:.3f}s call"


def test_bad_input_is_named():
    rng = np.random.default_rng(9)
    parts = random_int4(rng, 16, 64, 32)
    w = cpu.Int4Linear(*parts, 64)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        w(np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError, match="activations must be one of"):
        w(np.zeros((2, 64), np.float32), activations="int4")
    with pytest.raises(ValueError, match="scales must be a 2-D float16"):
        cpu.Int4Linear(parts[0], parts[1].astype(np.float32), parts[2], 64)
    with pytest.raises(ValueError, match="INT4 parts disagree"):
        cpu.Int4Linear(parts[0][:8], parts[1], parts[2], 64)
    with pytest.raises(ValueError, match="in_features 65 does not fit"):
        cpu.Int4Linear(*parts, 65)
    with pytest.raises(ValueError, match="thread count"):
        cpu.set_num_threads(0)
    with pytest.raises(ValueError, match="unknown ISA"):
        cpu.set_isa("neon")


def test_machine_settings_and_bandwidth_probe():
    assert 1 <= cpu.physical_cores() <= (os.cpu_count() or 1)
    assert cpu.isa() in ISAS and cpu.isa() == ISAS[-1]           # the best supported is the default
    seconds = cpu.read_bandwidth(8 << 20, reps=3)
    assert len(seconds) == 3 and all(0 < s < 5 for s in seconds)


def run_python(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_environment_chooses_threads_and_isa():
    result = run_python("from tokenwire.kernels import cpu; print(cpu.num_threads(), cpu.isa())",
                        TOKENWIRE_NUM_THREADS="3", TOKENWIRE_CPU_ISA="scalar")
    assert result.stdout.split() == ["3", "scalar"], result.stderr
    result = run_python("from tokenwire.kernels import cpu", TOKENWIRE_NUM_THREADS="many")
    assert result.returncode != 0 and "TOKENWIRE_NUM_THREADS must be a positive integer" in result.stderr


def test_without_the_extension_the_reference_runs_with_one_warning_line():
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tokenwire.kernels.cpu._cpu":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
import numpy as np
from tokenwire.kernels import cpu
from tokenwire.core.config import ModelConfig
assert not cpu.AVAILABLE
cfg = ModelConfig("LlamaForCausalLM", 11, 8, 16, 1, 2, 1, 4, 32, 1e-5, 10000.0)
rng = np.random.default_rng(0)
from tokenwire.kernels.engine_format import linear_shapes, vector_shapes
t = {f"{n}.weight": rng.standard_normal(s).astype(np.float32) for n, s in linear_shapes(cfg).items()}
t.update({n: np.ones(s, np.float32) for n, s in vector_shapes(cfg).items()})
m1 = cpu.create_model(cfg, t, 4, 8)
m2 = cpu.create_model(cfg, t, 4, 8)
print(type(m1).__name__)
q = rng.integers(0, 256, (5, 16), dtype=np.uint8); s = np.ones((5, 1), np.float16); z = np.full((5, 1), 8, np.float16)
x = rng.standard_normal((2, 32)).astype(np.float32)
from tokenwire.kernels.reference import int4_linear
assert np.array_equal(cpu.Int4Linear(q, s, z, 32)(x), int4_linear(x, q, s, z, 32))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ReferenceModel"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "C kernels are not built" in lines[0], result.stderr
