"""Engines for tests, built the way the server builds them: through tokenwire/runtime.py."""

import time

from tokenwire.core.options import EngineOptions
from tokenwire.runtime import build_engine


def mock_engine_core(step_us: float = 0.0, *, on_step=None, **options):
    """An EngineCore (not started) over the mock backend; `options` are EngineOptions fields."""
    core = build_engine(EngineOptions(backend="mock", mock_step_us=step_us, **options)).core
    core.on_step = on_step
    return core


def engine_core(model, backend: str, *, on_step=None, **options):
    """An EngineCore (not started) over a loaded engine directory on `backend` ("cpu", "reference", ...)."""
    core = build_engine(EngineOptions(backend=backend, **options), model=model).core
    core.on_step = on_step
    return core


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Poll `predicate` every millisecond until it holds (-> True) or `timeout` s pass (-> False):
    for what an engine thread or an event loop does on its own time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return False
