"""CPU kernels: INT4 matrix products and a whole-step C forward, with the numpy reference
as the fallback when the C extension was not built.

Contract:
- `AVAILABLE` says whether `tokenwire.kernels.cpu._cpu` (kernels/cpu/src, built by setup.py)
  imported. Without it everything here still works through kernels/reference.py and
  kernels/model.py, and `create_model` logs one warning line saying so.
- `Int4Linear(qweight, scales, zeros, in_features)` prepares one engine-format INT4 weight
  (docs/ENGINE_FORMAT.md) once; calling it with x [M, K] float32 returns x @ W.T [M, N].
  `activations="fp32"` (default) agrees with the reference to float32 accumulation order;
  `"int8"` quantizes x per group to int8 first (VNNI path, faster for batches; error bound
  in `int8_error_bound`).
- `create_model(config, tensors, block_size, num_blocks, activations="fp32")`: the forward
  object the CPU executor drives (`forward(ForwardBatch) -> logits`), C when available
  (kernels/cpu/model.py); exact unless told otherwise. `create_executor` (the served engine)
  passes `EngineOptions.activations`, whose default is "int8" (core/options.py).
- Threads: a persistent pool, by default one thread per physical core; `TOKENWIRE_NUM_THREADS`
  or `set_num_threads(n)` changes it. ISA: the best of avx512 / avx2 / scalar the CPU
  supports, chosen at run time; `TOKENWIRE_CPU_ISA` or `set_isa(name)` forces one.
- `sampling_exponentials`: temperature sampling's exponentials and block sums in C, which the
  served runner hands to kernels/sampling.py (`sample(..., exponentials=)`).
- Every C call releases the GIL for its whole duration.

After changing C code, rebuild in place with:  pip install -e . --no-build-isolation --no-deps
"""

import logging
import os
from functools import partial
from typing import Optional

import numpy as np

from ...core.options import DEFAULTS, EngineOptions
from ..model import ReferenceModel
from ..model_runner import ModelRunner, create_runner
from ..reference import dequantize_int4
from .ext import AVAILABLE, IMPORT_ERROR, ISAS, PRECISIONS, _cpu, _require
from .model import CpuModel

log = logging.getLogger(__name__)

_warned = False


def warn_fallback() -> None:
    """One warning line, once per process, when a CPU model runs without the C kernels."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("tokenwire C kernels are not built (%s); using the slow numpy reference. "
                    "Rebuild with: pip install -e . --no-build-isolation --no-deps", IMPORT_ERROR)



# ------------------------------------------------------------------ machine settings

def physical_cores() -> int:
    return _cpu.physical_cores() if AVAILABLE else (os.cpu_count() or 1)


def num_threads() -> int:
    return _cpu.num_threads() if AVAILABLE else 1


def set_num_threads(n: int) -> None:
    """Threads every kernel call uses (the caller's thread included)."""
    _require()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"thread count must be a positive integer, got {n!r}")
    _cpu.set_num_threads(n)


def pool_state() -> tuple:
    """(threads the pool's tasks run on now, tasks judged contended so far): the pool runs on
    fewer threads while a descheduled worker keeps the others waiting (kernels/cpu/src/pool.c)."""
    return _cpu.pool_state() if AVAILABLE else (1, 0)


def set_adaptive(on: bool) -> None:
    """Whether the pool drops a thread while a core is taken (on by default)."""
    _require()
    _cpu.set_adaptive(bool(on))


def isa() -> str:
    return _cpu.isa() if AVAILABLE else "numpy"


def isa_supported(name: str) -> bool:
    return AVAILABLE and name in ISAS and _cpu.isa_supported(name)


def set_isa(name: str) -> None:
    _require()
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}: expected one of {ISAS}")
    _cpu.set_isa(name)


def read_bandwidth(nbytes: int, reps: int = 5) -> list:
    """Seconds per streaming read pass over a fresh `nbytes` buffer on the pool's threads."""
    _require()
    return _cpu.read_bandwidth(int(nbytes), int(reps))


def _apply_environment() -> None:
    threads, chosen_isa = os.environ.get("TOKENWIRE_NUM_THREADS"), os.environ.get("TOKENWIRE_CPU_ISA")
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise ValueError(f"TOKENWIRE_NUM_THREADS must be a positive integer, got {threads!r}")
        set_num_threads(int(threads))
    if chosen_isa:
        if chosen_isa not in ISAS:
            raise ValueError(f"TOKENWIRE_CPU_ISA must be one of {ISAS}, got {chosen_isa!r}")
        if not isa_supported(chosen_isa):
            raise ValueError(f"TOKENWIRE_CPU_ISA={chosen_isa}: this CPU does not support it")
        set_isa(chosen_isa)


if AVAILABLE:
    _apply_environment()


# ------------------------------------------------------------------ INT4 products

def _check_precision(activations: str) -> None:
    if activations not in PRECISIONS:
        raise ValueError(f"activations must be one of {PRECISIONS}, got {activations!r}")


class Int4Linear:
    """One engine-format INT4 weight [N, K], prepared once; `self(x)` is x @ W.T."""

    def __init__(self, qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray, in_features: int):
        self.out_features, self.in_features = int(qweight.shape[0]), int(in_features)
        if AVAILABLE:
            self._packed = _cpu.pack_int4(qweight, scales, zeros, self.in_features)
            self._dense = None
        else:
            self._packed = None
            self._dense = dequantize_int4(qweight, scales, zeros, self.in_features)    # float32 [N, K]

    def __call__(self, x: np.ndarray, out: Optional[np.ndarray] = None, activations: str = "fp32") -> np.ndarray:
        """x: float32 [M, K] -> [M, N]."""
        _check_precision(activations)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [M, {self.in_features}], got {list(x.shape)}")
        if out is None:
            out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        if self._packed is None:
            out[...] = x @ self._dense.T
        else:
            _cpu.int4_linear(x, self._packed, out, activations)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes one product reads (the tiled layout: the engine's bytes plus row padding to 16)."""
        return self._packed.nbytes if self._packed is not None else self._dense.nbytes


def int4_linear(x, qweight, scales, zeros, in_features: int, activations: str = "fp32") -> np.ndarray:
    """kernels/reference.int4_linear on the C kernels (prepares the weight every call: tests only)."""
    return Int4Linear(qweight, scales, zeros, in_features)(x, activations=activations)


def int8_error_bound(x: np.ndarray, w_abs: np.ndarray, group_size: int) -> np.ndarray:
    """Worst-case |int8-path result - exact| per output: the activations are rounded per group
    of G to a step d = max|x_g| / 127, an error of at most d / 2 each, so
    |err[m, n]| <= sum_g d[m, g] / 2 * sum_{k in g} |W[n, k]|   (plus float32 rounding).
    x: [M, K], w_abs: |W| [N, K] -> [M, N]."""
    m, k = x.shape
    kp = -(-k // group_size) * group_size
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    d = np.abs(xp.reshape(m, -1, group_size)).max(axis=2) / 127                # [M, ng]
    wp = np.zeros((w_abs.shape[0], kp), np.float32)
    wp[:, :k] = w_abs
    return (d / 2) @ wp.reshape(w_abs.shape[0], -1, group_size).sum(axis=2).T  # [M, N]


def sampling_exponentials(block: np.ndarray, temperatures: np.ndarray, block_size: int) -> tuple:
    """kernels/sampling.py's `exponentials` on the C kernels (hot path: temperature rows, once
    per step): float32 [k, V], float64 [k] -> e = exp(x / T - max) float64 [k, V] (the reference's
    arguments; a vector exp within 1 ulp of np.exp on AVX2, libm's on scalar) and the sums of
    each block_size run of e [k, ceil(V / block_size)]."""
    rows, vocab_size = block.shape
    e = np.empty((rows, vocab_size), dtype=np.float64)
    sums = np.empty((rows, -(-vocab_size // block_size)), dtype=np.float64)
    _cpu.exp_blocks(np.ascontiguousarray(block, dtype=np.float32), np.ascontiguousarray(temperatures, dtype=np.float64),
                    e, sums, block_size)
    return e, sums


def create_model(config, tensors, block_size: int = DEFAULTS.block_size, num_blocks: Optional[int] = None, *,
                 activations: str = "fp32"):
    """The CPU forward object: the C model, or the numpy reference (with a warning) without it."""
    if AVAILABLE:
        return CpuModel(config, tensors, block_size, num_blocks, activations=activations)
    warn_fallback()
    return ReferenceModel(config, tensors, block_size, num_blocks)


def create_executor(engine, options: EngineOptions, max_model_len: int) -> ModelRunner:
    """kernels.BACKENDS["cpu"]: the C forward with `options.activations` (the numpy reference, with
    a warning, when not built)."""
    return create_runner(engine, options, max_model_len, partial(create_model, activations=options.activations),
                         exponentials=sampling_exponentials if AVAILABLE else None)
