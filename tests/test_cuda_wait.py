"""The CUDA backend's step wait releases the GIL (CPU only: a stand-in libcuda built here).

kernels/cuda/driver.py waits for a step with cuEventSynchronize called through ctypes.CDLL,
which drops the GIL around the foreign call. The stand-in library's cuEventSynchronize
blocks in C for a while; a Python thread must keep running meanwhile. The same call through
ctypes.PyDLL (which keeps the GIL) is the control: there the Python thread stalls, so the
test can tell the two apart.
"""

import ctypes
import shutil
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from tokenwire.kernels.cuda.driver import CudaDriver, CudaError, NativeEventSync

STUB = r"""
#include <time.h>
int cuEventSynchronize(void *event) {
    struct timespec t = {0, 200 * 1000 * 1000};     /* 200 ms "on the GPU" */
    while (nanosleep(&t, &t)) {}
    return event == (void *)0x1234 ? 0 : 400;       /* 400: CUDA_ERROR_INVALID_HANDLE */
}
"""


@pytest.fixture(scope="module")
def libcuda_stub(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    tmp = tmp_path_factory.mktemp("libcuda")
    (tmp / "stub.c").write_text(STUB)
    lib = tmp / "libcuda_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(tmp / "stub.c")], check=True, timeout=60)
    return str(lib)


def ticks_during(wait) -> int:
    """How many times a Python thread loops while `wait()` runs on this one."""
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)
    worker = threading.Thread(target=spin)
    worker.start()
    time.sleep(0.02)                     # the worker is running
    start = count[0]
    wait()
    ticks = count[0] - start
    stop.set()
    worker.join()
    return ticks


def test_event_synchronize_releases_the_gil(libcuda_stub):
    sync = NativeEventSync(libcuda_stub)
    result = []
    free = ticks_during(lambda: result.append(sync(0x1234)))
    assert result == [0]
    held_fn = ctypes.PyDLL(libcuda_stub).cuEventSynchronize      # the control: the GIL stays held
    held_fn.argtypes, held_fn.restype = [ctypes.c_void_p], ctypes.c_int
    held = ticks_during(lambda: held_fn(0x1234))
    # 200 ms without the GIL: hundreds to thousands of iterations, fewer on a busy machine (934
    # in one CI run); with it held: the one or two before the call
    assert free > 100 and free > 50 * max(held, 1), (free, held)


def test_an_error_code_comes_back(libcuda_stub):
    assert NativeEventSync(libcuda_stub)(0x99) == 400


def test_the_driver_waits_through_ctypes_and_names_errors(libcuda_stub):
    """CudaDriver.event_synchronize goes to the ctypes call (never cuda-python's wrapper, which
    holds the GIL in older releases) and turns an error code into a CudaError naming the call."""
    def wrapper_not_used(event):
        raise AssertionError("cuda-python's cuEventSynchronize was called")

    class Event:                                    # cuda-python handles give their address through int()
        def __init__(self, address):
            self.address = address

        def __int__(self):
            return self.address
    drv = CudaDriver.__new__(CudaDriver)
    drv.cu = SimpleNamespace(cuEventSynchronize=wrapper_not_used, CUresult=lambda code: code,
                             cuGetErrorName=lambda err: (0, b"CUDA_ERROR_INVALID_HANDLE"),
                             cuGetErrorString=lambda err: (0, b"invalid resource handle"))
    drv._native_sync = NativeEventSync(libcuda_stub)
    drv.event_synchronize(Event(0x1234))
    with pytest.raises(CudaError, match="cuEventSynchronize failed: CUDA_ERROR_INVALID_HANDLE"):
        drv.event_synchronize(Event(0x99))
