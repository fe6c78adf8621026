"""Engines for tests, built the way the server builds them: through tokenwire/runtime.py."""

import time

from tokenwire.core.options import EngineOptions
from tokenwire.core.step_driver import StepHost
from tokenwire.runtime import build_engine


def mock_engine_core(step_us: float = 0.0, *, on_step=None, **options):
    """An EngineCore (not started) over the mock backend; `options` are EngineOptions fields.
    `on_step(outputs)`: called on the engine thread with each step's list of RequestOutputs."""
    return attached(build_engine(EngineOptions(backend="mock", mock_step_us=step_us, **options)).core, on_step)


def engine_core(model, backend: str, *, on_step=None, **options):
    """An EngineCore (not started) over a loaded engine directory on `backend` ("cpu", "reference", ...)."""
    return attached(build_engine(EngineOptions(backend=backend, **options), model=model).core, on_step)


def attached(core, on_step=None):
    """`core`, its driver handing each step's rows to `on_step` (no columns: every output a row)."""
    if on_step is not None:
        core.driver.attach(StepHost(lambda step: on_step(step.rows)))
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


def engine_idle(server) -> bool:
    """A running server's engine holds no request and no KV block (its stats; an engine
    process's as of its last step that ended requests)."""
    stats = server.engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0
