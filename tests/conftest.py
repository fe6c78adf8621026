"""Shared fixtures. GPU tests carry `@pytest.mark.gpu` and skip, with the reason, when no
NVIDIA GPU with cuda-python is present."""

import functools
import os
from pathlib import Path

# Before numpy loads (see tokenwire/cli.py): single-threaded BLAS for the reference forward.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = REPO.parent / "shared" / "models"
STORIES260K = SHARED_MODELS / "stories260K"


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason():
    """None when a CUDA device can be used, else why not."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6 layout
        except ImportError:
            return "cuda-python is not installed"
    try:  # cuda-python raises (rather than returning an error) when libcuda.so is absent
        err, = driver.cuInit(0)[:1]
    except Exception as exc:
        return f"no usable NVIDIA driver ({type(exc).__name__}: {exc})"
    if int(err) != 0:
        return f"no usable NVIDIA driver (cuInit returned {err})"
    err, count = driver.cuDeviceGetCount()
    if int(err) != 0 or count == 0:
        return "no CUDA device present"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or gpu_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.fixture(scope="session")
def stories260k_dir():
    """The small real checkpoint the golden tests share: llama2.c's stories260K (Karpathy's
    260K-parameter model trained on TinyStories, with its 512-token tokenizer), kept in
    ../shared/models/stories260K beside this repository with its SOURCE.md. A checkout
    without that folder skips these tests, saying so."""
    if not (STORIES260K / "stories260K.bin").exists():
        pytest.skip(f"needs llama2.c's stories260K checkpoint (stories260K.bin, tok512.bin, tok512.model and "
                    f"reference_greedy.json from the llama2.c project) at {STORIES260K}; it is not there")
    return STORIES260K
