"""Shared fixtures. GPU tests carry `@pytest.mark.gpu` and skip, with the reason, when no
NVIDIA GPU with cuda-python is present. With TOKENWIRE_FAKE_GPU=1 they run on the numpy stand-in
(kernels/cuda/fake.py) instead: the launches, pointers and shapes are exercised and the
emulators' arithmetic is compared, not the kernels' (a GPU-free rehearsal of the GPU run)."""

import collections
import functools
import os
import re
from pathlib import Path

# Before numpy loads (see tokenwire/cli.py): single-threaded BLAS for the reference forward.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

FAKE_GPU = os.environ.get("TOKENWIRE_FAKE_GPU") == "1"
# TOKENWIRE_TEST_ENGINE_PROCESS=1: every tokenwire.Server a test builds from options runs its
# engine in a process of its own (tokenwire/engine_process.py), so any server suite can be run
# against that mode: `TOKENWIRE_TEST_ENGINE_PROCESS=1 pytest tests/test_net_server.py`
ENGINE_PROCESS = os.environ.get("TOKENWIRE_TEST_ENGINE_PROCESS") == "1"
REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = REPO.parent / "shared" / "models"
STORIES260K = SHARED_MODELS / "stories260K"


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason():
    """None when a CUDA device can be used, else why not."""
    if FAKE_GPU:
        return None
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


def gpu_driver_and_image(device: int = 0):
    """(driver, image_fn) for the GPU tests: the real driver and the cubin built from the
    sources, or with TOKENWIRE_FAKE_GPU=1 the numpy stand-in, which loads any image."""
    if FAKE_GPU:
        from tokenwire.kernels.cuda.fake import FakeDriver
        return FakeDriver(), lambda arch: b"fake cubin"
    from tokenwire.kernels.cuda.build import kernel_image
    from tokenwire.kernels.cuda.driver import CudaDriver
    return CudaDriver(device), kernel_image


@pytest.fixture(autouse=ENGINE_PROCESS)
def _servers_with_an_engine_process(monkeypatch):
    """Active under TOKENWIRE_TEST_ENGINE_PROCESS=1 (above)."""
    import tokenwire.server
    build = tokenwire.server.Server.__init__

    def with_engine_process(self, *args, **kwargs):
        if kwargs.get("engine") is None:
            kwargs.setdefault("engine_process", True)
        build(self, *args, **kwargs)

    monkeypatch.setattr(tokenwire.server.Server, "__init__", with_engine_process)


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


MAX_ERROR = re.compile(r"^max-error abs=(\S+) rel=(\S+) of-allowed=(\S+)$", re.M)


def pytest_terminal_summary(terminalreporter):
    """The worst error per kernel test function, from the `max-error` lines that
    test_cuda_kernels.assert_close prints (passed and failed cases alike): the figures a GPU
    run must bring back, beside pass/fail. of-allowed is error / tolerance (> 1 fails)."""
    worst = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, ""])     # cases, abs, rel, of-allowed, worst case
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for abs_err, rel, ratio in MAX_ERROR.findall(report.capstdout):
                row = worst[report.nodeid.split("[")[0].split("::")[-1]]
                row[0] += 1
                row[1], row[2] = max(row[1], float(abs_err)), max(row[2], float(rel))
                if float(ratio) >= row[3]:
                    row[3], row[4] = float(ratio), report.nodeid.partition("[")[2].rstrip("]")
    if worst:
        terminalreporter.write_sep("-", "max error per kernel test (abs, relative to max|reference|, of tolerance)")
        for name, (n, abs_err, rel, ratio, case) in sorted(worst.items()):
            terminalreporter.write_line(f"max-error {name}: {n} checks, abs {abs_err:.3g}, rel {rel:.3g}, "
                                        f"{ratio:.3g} of allowed (worst case [{case}])")
