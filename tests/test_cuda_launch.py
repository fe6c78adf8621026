"""Kernel launches through ctypes (kernels/cuda/driver.py NativeLaunch), CPU only.

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

import pytest

from tokenwire.kernels.cuda.driver import CTYPES, CudaDriver, CudaError, NativeLaunch, ParamBuffer
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


def params(*values) -> ctypes.Array:
    boxed = [ctypes.c_uint64(values[0]), ctypes.c_int32(values[1]), ctypes.c_float(values[2])]
    array = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in boxed])
    array._keep = boxed
    return array


@pytest.mark.parametrize("pdl", [True, False])
def test_the_header_reads_what_ctypes_wrote(libcuda_stub, pdl):
    launch = NativeLaunch(libcuda_stub)
    assert launch(0x77, (7, 5, 3), 256, 48 * 1024, 0xABC0, params(0xDEADBEEF00, -12, 2.5), pdl) == 0
    s = seen(libcuda_stub)
    assert s[:8] == [7, 5, 3, 256, 1, 1, 48 * 1024, 0xABC0]
    assert s[8:11] == ([1, 6, 1] if pdl else [0, 99, 99])   # 6: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert s[11:] == [0x77, 0xDEADBEEF00, (-12) % 2**64, 2500, 0]


def test_the_driver_launches_through_ctypes_and_names_errors(libcuda_stub):
    """CudaDriver.launch packs the parameters by the kernel's type codes, goes to the ctypes call
    (never cuda-python's wrapper) and turns an error code into a CudaError naming the call."""
    class Handle:                                     # cuda-python handles give their address through int()
        def __init__(self, address):
            self.address = address

        def __int__(self):
            return self.address

    def wrapper_not_used(*args):
        raise AssertionError("cuda-python's cuLaunchKernelEx was called")
    drv = CudaDriver.__new__(CudaDriver)
    drv.cu = SimpleNamespace(cuLaunchKernelEx=wrapper_not_used, cuLaunchKernel=wrapper_not_used,
                             CUresult=lambda code: code,
                             cuGetErrorName=lambda err: (0, b"CUDA_ERROR_INVALID_HANDLE"),
                             cuGetErrorString=lambda err: (0, b"invalid resource handle"))
    drv.native_launch = NativeLaunch(libcuda_stub)
    drv.launch(Handle(0x77), (2, 1, 1), 128, 0, Handle(0x5000), "pif", (0x1000, 3, 0.125), pdl=True)
    assert seen(libcuda_stub)[:14] == [2, 1, 1, 128, 1, 1, 0, 0x5000, 1, 6, 1, 0x77, 0x1000, 3]
    with pytest.raises(CudaError, match="cuLaunchKernelEx failed: CUDA_ERROR_INVALID_HANDLE"):
        drv.launch(Handle(0x78), (1, 1, 1), 32, 0, Handle(0x5000), "pif", (0, 0, 0.0))
    with pytest.raises(ValueError):                   # a parameter list of the wrong length never launches
        drv.launch(Handle(0x77), (1, 1, 1), 32, 0, Handle(0x5000), "pif", (0, 0))


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
