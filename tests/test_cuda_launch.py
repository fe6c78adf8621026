"""Kernel launches and a step's other driver calls through ctypes (kernels/cuda/driver.py
NativeLaunch, NativeStreamOps), CPU only.

A stand-in libcuda compiled here against the real cuda.h records what its cuLaunchKernelEx
was given, read through the header's own CUlaunchConfig and CUlaunchAttribute: so the
ctypes mirrors of those structs are checked against the header by the C compiler, not by
hand, and the parameters arrive as the kernel would read them.
"""

import ctypes
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tokenwire.kernels.cuda.driver import (C_LAUNCH, CTYPES, CudaDriver, CudaError, NativeLaunch, NativeStreamOps,
                                            ParamBuffer)
from tokenwire.kernels.cuda.kernels import SPECS

STUB = r"""
#include <cuda.h>
unsigned long long seen[16];
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    seen[0] = c->gridDimX; seen[1] = c->gridDimY; seen[2] = c->gridDimZ;
    seen[3] = c->blockDimX; seen[4] = c->blockDimY; seen[5] = c->blockDimZ;
    seen[6] = c->sharedMemBytes; seen[7] = (unsigned long long)c->hStream; seen[8] = c->numAttrs;
    seen[9] = c->numAttrs ? (unsigned long long)c->attrs[0].id : 99;
    seen[10] = c->numAttrs ? (unsigned long long)c->attrs[0].value.programmaticStreamSerializationAllowed : 99;
    seen[11] = (unsigned long long)f;
    seen[12] = *(unsigned long long *)params[0];            /* "p" */
    seen[13] = (unsigned long long)(long long)*(int *)params[1];   /* "i" */
    float v = *(float *)params[2];                           /* "f" */
    seen[14] = (unsigned long long)(v * 1000.0f);
    seen[15] = (unsigned long long)extra;
    return f == (CUfunction)0x77 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* the step's other calls (NativeStreamOps): each records its arguments, in order, into `ops` */
unsigned long long ops[8];
static CUresult record(unsigned long long a, unsigned long long b, unsigned long long c, unsigned long long d) {
    ops[0] = a; ops[1] = b; ops[2] = c; ops[3] = d;
    return a == 0x99 ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) { return record((unsigned long long)e, (unsigned long long)s, 0, 0); }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) {
    return record((unsigned long long)s, (unsigned long long)e, flags, 0);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    return record(dst, (unsigned long long)src, n, (unsigned long long)s);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return record((unsigned long long)dst, src, n, (unsigned long long)s);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return record(dst, src, n, (unsigned long long)s);
}
CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { return record((unsigned long long)g, (unsigned long long)s, 0, 0); }
"""


def cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    for root in ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]:
        if (root / "include" / "cuda.h").is_file():
            return root / "include"
    return None


@pytest.fixture(scope="module")
def libcuda_stub(tmp_path_factory):
    cc, include = shutil.which("cc") or shutil.which("gcc"), cuda_include()
    if cc is None or include is None:
        pytest.skip(f"needs a C compiler and cuda.h (compiler {cc}, CUDA include folder {include})")
    tmp = tmp_path_factory.mktemp("libcuda")
    (tmp / "stub.c").write_text(STUB)
    lib = tmp / "libcuda_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-I", str(include), "-o", str(lib), str(tmp / "stub.c")],
                   check=True, timeout=60)
    return str(lib)


def seen(lib: str) -> list:
    return list((ctypes.c_ulonglong * 16).in_dll(ctypes.CDLL(lib), "seen"))


class Handle:                                         # cuda-python handles give their address through int()
    def __init__(self, address):
        self.address = address

    def __int__(self):
        return self.address


def driver_without_wrappers(*names) -> CudaDriver:
    """A CudaDriver whose cuda-python wrappers `names` fail the test if called; errors named as the
    real one names them."""
    def wrapper_not_used(*args):
        raise AssertionError("a cuda-python wrapper was called")
    drv = CudaDriver.__new__(CudaDriver)
    drv.cu = SimpleNamespace(**{n: wrapper_not_used for n in names}, CUresult=lambda code: code,
                             cuGetErrorName=lambda err: (0, b"CUDA_ERROR_INVALID_HANDLE"),
                             cuGetErrorString=lambda err: (0, b"invalid resource handle"))
    return drv


def params(*values) -> ctypes.Array:
    boxed = [ctypes.c_uint64(values[0]), ctypes.c_int32(values[1]), ctypes.c_float(values[2])]
    array = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in boxed])
    array._keep = boxed
    return array


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("path", ["ctypes", "c"])
def test_the_header_reads_what_ctypes_wrote(libcuda_stub, pdl, path):
    """Both launch paths: NativeLaunch's ctypes call, and kernels/cuda/_launch.c's (setup.py builds it)."""
    launch = NativeLaunch(libcuda_stub)
    if path == "c":
        assert C_LAUNCH is not None, "kernels/cuda/_launch.c was not built (setup.py)"
        assert C_LAUNCH.launch(launch.entry, 0x77, 7, 5, 3, 256, 48 * 1024, 0xABC0, pdl, "pif",
                               (0xDEADBEEF00, -12, 2.5)) == 0
    else:
        assert launch(0x77, (7, 5, 3), 256, 48 * 1024, 0xABC0, params(0xDEADBEEF00, -12, 2.5), pdl) == 0
    s = seen(libcuda_stub)
    assert s[:8] == [7, 5, 3, 256, 1, 1, 48 * 1024, 0xABC0]
    assert s[8:11] == ([1, 6, 1] if pdl else [0, 99, 99])   # 6: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert s[11:] == [0x77, 0xDEADBEEF00, (-12) % 2**64, 2500, 0]


@pytest.mark.parametrize("c_launch", [C_LAUNCH, None], ids=["c", "ctypes"])
def test_the_driver_launches_natively_and_names_errors(libcuda_stub, c_launch):
    """CudaDriver.launch converts the parameters by the kernel's type codes, calls libcuda in C
    (_launch.c) or through ctypes (never cuda-python's wrapper) and turns an error code into a
    CudaError naming the call."""
    drv = driver_without_wrappers("cuLaunchKernelEx", "cuLaunchKernel")
    drv.native_launch = NativeLaunch(libcuda_stub, c_launch=c_launch)
    assert (drv.native_launch.c_launch is None) == (c_launch is None)
    drv.launch(Handle(0x77), (2, 1, 1), 128, 0, Handle(0x5000), "pif", (0x1000, 3, 0.125), pdl=True)
    assert seen(libcuda_stub)[:14] == [2, 1, 1, 128, 1, 1, 0, 0x5000, 1, 6, 1, 0x77, 0x1000, 3]
    with pytest.raises(CudaError, match="cuLaunchKernelEx failed: CUDA_ERROR_INVALID_HANDLE"):
        drv.launch(Handle(0x78), (1, 1, 1), 32, 0, Handle(0x5000), "pif", (0, 0, 0.0))
    (ctypes.c_ulonglong * 16).in_dll(ctypes.CDLL(libcuda_stub), "seen")[0] = 12345      # no launch leaves it
    with pytest.raises(ValueError):                   # a parameter list of the wrong length never launches
        drv.launch(Handle(0x77), (1, 1, 1), 32, 0, Handle(0x5000), "pif", (0, 0))
    for bad in ((0, 2.5, 0.0), (0, 2**31, 0.0), (-1, 0, 0.0), ("x", 0, 0.0)):   # none converts: nothing launches
        with pytest.raises((TypeError, OverflowError, ValueError)):
            drv.launch(Handle(0x77), (1, 1, 1), 32, 0, Handle(0x5000), "pif", bad)
    assert seen(libcuda_stub)[0] == 12345


def test_the_c_launch_refuses_what_it_cannot_convert(libcuda_stub):
    assert C_LAUNCH is not None, "kernels/cuda/_launch.c was not built (setup.py)"
    with pytest.raises(OSError, match="dlopen"):
        C_LAUNCH.bind("/nonexistent/libcuda.so.1")
    entry = C_LAUNCH.bind(libcuda_stub)                  # a call that got through would reach the stub
    (ctypes.c_ulonglong * 16).in_dll(ctypes.CDLL(libcuda_stub), "seen")[0] = 12345
    with pytest.raises(ValueError, match="unknown type code 'q'"):
        C_LAUNCH.launch(entry, 0x77, 1, 1, 1, 32, 0, 0, False, "q", (1,))
    with pytest.raises(TypeError, match="11 arguments"):
        C_LAUNCH.launch(entry, 2)
    with pytest.raises(OverflowError):                    # a negative grid dimension
        C_LAUNCH.launch(entry, 0x77, -1, 1, 1, 32, 0, 0, False, "p", (1,))
    with pytest.raises(OverflowError):                    # a grid dimension past 32 bits
        C_LAUNCH.launch(entry, 0x77, 2**32, 1, 1, 32, 0, 0, False, "p", (1,))
    assert seen(libcuda_stub)[0] == 12345


def test_every_signature_packs_in_the_c_layout():
    """ParamBuffer's argument offsets are a C struct's (ctypes lays Structures out by the platform
    ABI, as nvcc lays out a kernel's parameters), and a value packed reads back at its offset."""
    for name, spec in SPECS.items():
        fields = [(f"a{i}", CTYPES[t]) for i, t in enumerate(spec.param_types)]
        layout = type("Layout", (ctypes.Structure,), {"_fields_": fields})
        buf = ParamBuffer(spec.param_types)
        base = ctypes.addressof(buf.buffer)
        assert [p - base for p in buf.pointers] == [getattr(layout, f).offset for f, _ in fields], name
        values = [7 + i if t != "f" else 0.5 + i for i, t in enumerate(spec.param_types)]
        buf.pack(values)
        back = layout.from_buffer_copy(buf.buffer.raw.ljust(ctypes.sizeof(layout), b"\0"))   # + tail padding
        assert [getattr(back, f) for f, _ in fields] == values, name
    with pytest.raises(ValueError, match="do not fit the signature"):
        ParamBuffer("pi").pack((1, 2.5))                 # a float where the kernel takes an int


def test_the_step_s_other_calls_reach_the_driver_as_the_header_declares_them(libcuda_stub):
    """CudaDriver's event, wait, copy and graph calls go through NativeStreamOps (never
    cuda-python's wrappers) with their arguments in the header's order, and an error code comes
    back as a CudaError naming the call."""
    drv = driver_without_wrappers("cuEventRecord", "cuStreamWaitEvent", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync",
                                  "cuMemcpyDtoDAsync", "cuGraphLaunch")
    drv.native_ops = NativeStreamOps(libcuda_stub)
    ops = (ctypes.c_ulonglong * 8).in_dll(ctypes.CDLL(libcuda_stub), "ops")
    host = np.zeros(64, np.uint8)
    stream, event = Handle(0x5000), Handle(0x6000)
    calls = [(lambda: drv.event_record(event, stream), [0x6000, 0x5000, 0, 0]),
             (lambda: drv.stream_wait_event(stream, event), [0x5000, 0x6000, 0, 0]),
             (lambda: drv.memcpy_htod_async(0x7000, host, 48, stream), [0x7000, host.ctypes.data, 48, 0x5000]),
             (lambda: drv.memcpy_dtoh_async(host, 0x7000, 40, stream), [host.ctypes.data, 0x7000, 40, 0x5000]),
             (lambda: drv.memcpy_dtod_async(0x7000, 0x8000, 32, stream), [0x7000, 0x8000, 32, 0x5000]),
             (lambda: drv.graph_launch(Handle(0x9000), stream), [0x9000, 0x5000, 0, 0])]
    for call, want in calls:
        call()
        assert list(ops[:4]) == want
    with pytest.raises(CudaError, match="cuGraphLaunch failed: CUDA_ERROR_INVALID_HANDLE"):
        drv.graph_launch(Handle(0x99), stream)
