"""A thin typed wrapper over cuda-python's driver API: the only module that calls it.

Contract:
- `CudaDriver(device_index)` initialises the driver, retains the device's primary context and
  makes it current on the calling thread. Every method maps onto one driver call (or two),
  checks the result and raises `CudaError` naming the call and the error.
- Device pointers, streams, events, modules, functions and graphs are opaque handles to the
  caller; host pinned buffers come back as numpy uint8 views.
- Kernel arguments are converted once per launch by a `KernelSpec`'s parameter types
  (kernels/cuda/kernels.py) and cuLaunchKernelEx is called, both in one C call
  (kernels/cuda/_launch.c, when setup.py built it), else packed with one struct.pack_into
  (`ParamBuffer`) and called through ctypes (`NativeLaunch`).
- `kernels/cuda/fake.py` implements the same interface without a GPU for host-side tests.

cuda-python is imported lazily (`cuda.bindings.driver`, or `cuda.cuda` before 12.6), so a
CPU-only install never needs it.

Waiting without the GIL: `event_synchronize` calls libcuda's cuEventSynchronize through ctypes
(`NativeEventSync`), and ctypes releases the GIL around every foreign call, so the engine
thread's wait for a step never holds the GIL whichever cuda-python is installed. (cuda-python's
own wrappers release it only in releases carrying NVIDIA/cuda-python#914 (August 2025,
backported to 12.9.x in #922: "Python bindings in every module ... now have the GIL released before
calling the underlying C APIs"; older ones hold it for the whole wait.) CudaExecutor runs no Python
in a CUDA host callback: a Python callable behind cuLaunchHostFunc takes the GIL on the
driver's callback thread (cuda-python#517; ctypes callbacks do the same). `launch_host_func`
stays for kernels/trt, which still uses it.
"""

import ctypes
import logging
import os
import struct
import threading
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

try:                                # kernels/cuda/_launch.c: a launch in one C call (setup.py builds it)
    from . import _launch as C_LAUNCH
except ImportError:                 # not built: NativeLaunch packs with struct and calls through ctypes
    C_LAUNCH = None


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


class CudaUnavailable(CudaError):
    """cuda-python, the driver or a device is missing."""


def import_driver():
    """cuda-python's driver module, whichever layout is installed."""
    try:
        from cuda.bindings import driver
        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver   # cuda-python < 12.6
        return driver
    except ImportError:
        raise CudaUnavailable("the CUDA backend needs cuda-python: pip install 'tokenwire[cuda]'") from None


# C types of kernel parameters, by the one-letter codes of kernels/cuda/kernels.py
CTYPES = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "f": ctypes.c_float}
FORMATS = {code: ct._type_ for code, ct in CTYPES.items()}   # their struct codes ("@": C alignment)


class ParamBuffer:
    """One kernel signature's arguments as the kernel reads them (C layout, natural alignment) and
    the array of pointers to each that cuLaunchKernel takes, both made once per signature: a launch
    packs its values in with one struct.pack_into (a ctypes object per argument cost ~10 us a
    launch). The driver copies the arguments during the launch call, so launches share a buffer
    under `LAUNCH_LOCK`."""

    def __init__(self, param_types: str):
        codes = [FORMATS[t] for t in param_types]
        self.format = "@" + "".join(codes)
        self.buffer = ctypes.create_string_buffer(max(struct.calcsize(self.format), 1))
        base = ctypes.addressof(self.buffer)
        offsets = [struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize("@" + codes[i])
                   for i in range(len(codes))]
        self.pointers = (ctypes.c_void_p * len(codes))(*[base + o for o in offsets])
        self.address = ctypes.addressof(self.pointers)          # what cuLaunchKernel takes as kernelParams
        self._packer = struct.Struct(self.format)

    def pack(self, args: Sequence) -> None:
        try:
            self._packer.pack_into(self.buffer, 0, *args)
        except struct.error as exc:
            raise ValueError(f"kernel arguments {tuple(args)!r} do not fit the signature {self.format[1:]!r}: {exc}") \
                from None


PARAMS: dict = {}                  # param_types -> ParamBuffer
LAUNCH_LOCK = threading.Lock()
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
LIBCUDA = "libcuda.so.1"


def capture_graph(drv, stream, enqueue: Callable[[object], None]):
    """`enqueue(stream)` run once eagerly (warm-up: lazy loading, workspace sizing), waited for,
    then captured as a CUDA graph. -> the graph (drv.end_capture's). Works on any driver with
    the CudaDriver interface (the fake one included); once per graph, at start."""
    enqueue(stream)
    drv.stream_synchronize(stream)
    drv.begin_capture(stream)
    try:
        enqueue(stream)
    finally:
        graph = drv.end_capture(stream)
    return graph


class NativeEventSync:
    """cuEventSynchronize(handle) -> CUresult as an int, called through ctypes.CDLL: the GIL is
    released for the whole wait (ctypes drops it around foreign calls; PyDLL would not)."""

    def __init__(self, library: str = LIBCUDA):
        self._fn = ctypes.CDLL(library).cuEventSynchronize
        self._fn.argtypes = [ctypes.c_void_p]
        self._fn.restype = ctypes.c_int

    def __call__(self, handle: int) -> int:
        return self._fn(handle)


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (56 bytes on x86-64; tests/test_cuda_launch.py checks the offsets
    against the header with the C compiler)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8, a 64-byte value union whose first int is
    programmaticStreamSerializationAllowed (72 bytes)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class NativeLaunch:
    """cuLaunchKernelEx(config, f, params, NULL) through ctypes: cuda-python's wrapper builds a
    CUlaunchConfig and a CUlaunchAttribute object per launch, the larger part of an eager launch's
    host time (prefill and sampled steps launch eagerly; 150 to 400 launches a step). The driver
    copies the config and the parameters during the call, so nothing here outlives it.
    TOKENWIRE_CUDA_LAUNCH=python turns it off (cuda-python's path, the reference)."""

    # the config's bytes, packed in place: grid, block, smem, (pad), hStream, attrs, numAttrs
    CONFIG = struct.Struct("@7IQQI")

    def __init__(self, library: str = LIBCUDA, c_launch=C_LAUNCH):
        # with kernels/cuda/_launch.c built, CudaDriver.launch calls `c_launch.launch(entry, ...)`:
        # the arguments converted and the call made in C (~5 us a launch less on this VM)
        self.c_launch, self.entry = (c_launch, c_launch.bind(library)) if c_launch is not None else (None, 0)
        self._fn = ctypes.CDLL(library).cuLaunchKernelEx
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int
        self._pdl = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._pdl_address = ctypes.addressof(self._pdl)
        self._config = ctypes.create_string_buffer(ctypes.sizeof(_LaunchConfig))
        self._config_address = ctypes.addressof(self._config)
        assert self.CONFIG.size <= ctypes.sizeof(_LaunchConfig)

    def __call__(self, function: int, grid, block: int, smem: int, stream: int, params: int, pdl: bool) -> int:
        """`params`: the address of the array of argument pointers. One config buffer is reused:
        callers serialize (CudaDriver.launch holds LAUNCH_LOCK)."""
        self.CONFIG.pack_into(self._config, 0, grid[0], grid[1], grid[2], block, 1, 1, smem, stream,
                              self._pdl_address if pdl else 0, 1 if pdl else 0)
        return self._fn(self._config_address, function, params, None)


class NativeStreamOps:
    """A step's other driver calls through ctypes, as libcuda exports them (cuda.h maps the async
    copies to their _v2 symbols): event records, the stream wait, the pinned copies and the graph
    launch, about eight a decode step. Handles go in as integers (cuda-python's through int()).
    Off with TOKENWIRE_CUDA_LAUNCH=python, like NativeLaunch."""

    _P, _U64, _SIZE = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
    SIGNATURES = {"cuEventRecord": (_P, _P), "cuStreamWaitEvent": (_P, _P, ctypes.c_uint),
                  "cuMemcpyHtoDAsync_v2": (_U64, _P, _SIZE, _P), "cuMemcpyDtoHAsync_v2": (_P, _U64, _SIZE, _P),
                  "cuMemcpyDtoDAsync_v2": (_U64, _U64, _SIZE, _P), "cuGraphLaunch": (_P, _P)}

    def __init__(self, library: str = LIBCUDA):
        lib = ctypes.CDLL(library)
        for name, argtypes in self.SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            setattr(self, name.removesuffix("_v2"), fn)


class CudaDriver:
    native_launch = native_ops = None       # set in __init__ unless TOKENWIRE_CUDA_LAUNCH=python

    def __init__(self, device_index: int = 0):
        self.cu = cu = import_driver()
        try:
            self._check("cuInit", cu.cuInit(0))
        except CudaError:
            raise
        except Exception as exc:                  # cuda-python raises when libcuda.so is absent
            raise CudaUnavailable(f"no usable NVIDIA driver ({type(exc).__name__}: {exc})") from None
        count = self._check("cuDeviceGetCount", cu.cuDeviceGetCount())
        if device_index >= count:
            raise CudaUnavailable(f"CUDA device {device_index} requested, {count} present")
        self.device = self._check("cuDeviceGet", cu.cuDeviceGet(device_index))
        self.context = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.device))
        self.make_current()
        try:
            self._native_sync = NativeEventSync()
        except (OSError, AttributeError) as exc:  # cuInit worked, so libcuda is loaded: not expected
            log.warning("cuEventSynchronize through ctypes unavailable (%s): waits use cuda-python's wrapper", exc)
            self._native_sync = None
        self.native_launch = self.native_ops = None
        if os.environ.get("TOKENWIRE_CUDA_LAUNCH", "native") != "python":
            try:
                self.native_launch, self.native_ops = NativeLaunch(), NativeStreamOps()
            except (OSError, AttributeError) as exc:   # a driver older than CUDA 11.8
                log.warning("the driver through ctypes is unavailable (%s): every call goes through cuda-python", exc)
                self.native_launch = self.native_ops = None
        self._callbacks = {}                      # host-function key -> Python callable (kernels/trt only)
        self._next_key = 0
        self._host_fn_lock = threading.Lock()
        self._trampoline = HOST_FN(self._run_host_fn)

    # ------------------------------------------------------------ errors and device facts

    def _check(self, call: str, result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            _, name = self.cu.cuGetErrorName(err)
            _, text = self.cu.cuGetErrorString(err)
            raise CudaError(f"{call} failed: {name.decode() if name else err} ({text.decode() if text else ''})")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def make_current(self) -> None:
        """Bind the context to the calling thread (the engine thread calls this once)."""
        self._check("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(self.context))

    def attribute(self, name: str) -> int:
        attr = getattr(self.cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return self._check("cuDeviceGetAttribute", self.cu.cuDeviceGetAttribute(attr, self.device))

    @property
    def name(self) -> str:
        raw = self._check("cuDeviceGetName", self.cu.cuDeviceGetName(128, self.device))
        return raw.split(b"\0", 1)[0].decode()

    @property
    def compute_capability(self) -> tuple:
        return (self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR"))

    @property
    def num_sms(self) -> int:
        return self.attribute("MULTIPROCESSOR_COUNT")

    def mem_get_info(self) -> tuple:
        """(free, total) bytes on the device."""
        return self._check("cuMemGetInfo", self.cu.cuMemGetInfo())

    # ------------------------------------------------------------ memory

    def mem_alloc(self, nbytes: int) -> int:
        return int(self._check("cuMemAlloc", self.cu.cuMemAlloc(max(int(nbytes), 1))))

    def mem_free(self, ptr: int) -> None:
        self._check("cuMemFree", self.cu.cuMemFree(ptr))

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Pinned, portable host memory as a uint8 view (its address: `view.ctypes.data`)."""
        flags = self.cu.CU_MEMHOSTALLOC_PORTABLE
        ptr = int(self._check("cuMemHostAlloc", self.cu.cuMemHostAlloc(max(int(nbytes), 1), flags)))
        return np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(ptr))

    def host_free(self, view: np.ndarray) -> None:
        self._check("cuMemFreeHost", self.cu.cuMemFreeHost(view.ctypes.data))

    def memset_async(self, ptr: int, nbytes: int, stream) -> None:
        self._check("cuMemsetD8Async", self.cu.cuMemsetD8Async(ptr, 0, int(nbytes), stream))

    def _native_result(self, call: str, err: int) -> None:
        if err:
            self._check(call, (self.cu.CUresult(err),))

    def memcpy_htod_async(self, dst: int, src: np.ndarray, nbytes: int, stream) -> None:
        """`src` must stay alive (and unchanged) until the copy ran: pinned staging, or a
        pageable array followed by a stream synchronize."""
        if self.native_ops is not None:
            return self._native_result("cuMemcpyHtoDAsync", self.native_ops.cuMemcpyHtoDAsync(
                dst, src.ctypes.data, int(nbytes), int(stream)))
        self._check("cuMemcpyHtoDAsync", self.cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, int(nbytes), stream))

    def memcpy_dtoh_async(self, dst: np.ndarray, src: int, nbytes: int, stream) -> None:
        if self.native_ops is not None:
            return self._native_result("cuMemcpyDtoHAsync", self.native_ops.cuMemcpyDtoHAsync(
                dst.ctypes.data, src, int(nbytes), int(stream)))
        self._check("cuMemcpyDtoHAsync", self.cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, int(nbytes), stream))

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream) -> None:
        if self.native_ops is not None:
            return self._native_result("cuMemcpyDtoDAsync", self.native_ops.cuMemcpyDtoDAsync(
                dst, src, int(nbytes), int(stream)))
        self._check("cuMemcpyDtoDAsync", self.cu.cuMemcpyDtoDAsync(dst, src, int(nbytes), stream))

    # ------------------------------------------------------------ streams and events

    def stream_create(self):
        return self._check("cuStreamCreate", self.cu.cuStreamCreate(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def stream_destroy(self, stream) -> None:
        self._check("cuStreamDestroy", self.cu.cuStreamDestroy(stream))

    def stream_synchronize(self, stream) -> None:
        """Blocks the calling thread: setup, teardown and benchmarks only, never per step."""
        self._check("cuStreamSynchronize", self.cu.cuStreamSynchronize(stream))

    def stream_wait_event(self, stream, event) -> None:
        if self.native_ops is not None:
            return self._native_result("cuStreamWaitEvent",
                                       self.native_ops.cuStreamWaitEvent(int(stream), int(event), 0))
        self._check("cuStreamWaitEvent", self.cu.cuStreamWaitEvent(stream, event, 0))

    def event_create(self, timing: bool = False, blocking: bool = False):
        flags = 0 if timing else int(self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(self.cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        return self._check("cuEventCreate", self.cu.cuEventCreate(flags))

    def event_destroy(self, event) -> None:
        self._check("cuEventDestroy", self.cu.cuEventDestroy(event))

    def event_record(self, event, stream) -> None:
        if self.native_ops is not None:
            return self._native_result("cuEventRecord", self.native_ops.cuEventRecord(int(event), int(stream)))
        self._check("cuEventRecord", self.cu.cuEventRecord(event, stream))

    def event_query(self, event) -> bool:
        """True once the work before the event has finished; never blocks."""
        err, = self.cu.cuEventQuery(event)
        if err == self.cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        self._check("cuEventQuery", (err,))
        return True

    def event_synchronize(self, event) -> None:
        """Block the calling thread until the event completed, without holding the GIL: in the
        driver spinning (an event made without `blocking`) or asleep (with `blocking`)."""
        if self._native_sync is None:
            self._check("cuEventSynchronize", self.cu.cuEventSynchronize(event))
            return
        err = self._native_sync(int(event))
        if err:
            self._check("cuEventSynchronize", (self.cu.CUresult(err),))

    def event_elapsed_ms(self, start, end) -> float:
        return float(self._check("cuEventElapsedTime", self.cu.cuEventElapsedTime(start, end)))

    def launch_host_func(self, stream, fn: Callable[[], None]) -> None:
        """Run `fn` on a driver thread once the stream reaches this point. `fn` must not call
        CUDA; it should only hand off (e.g. loop.call_soon_threadsafe or an eventfd write).
        CudaExecutor never uses this (a Python callable here takes the GIL on the driver's
        thread); kernels/trt still does."""
        with self._host_fn_lock:
            self._next_key += 1
            key = self._next_key
            self._callbacks[key] = fn
        host_fn = self.cu.CUhostFn(ctypes.cast(self._trampoline, ctypes.c_void_p).value)
        self._check("cuLaunchHostFunc", self.cu.cuLaunchHostFunc(stream, host_fn, key))

    def _run_host_fn(self, user_data) -> None:
        """The one C callback for every host function (it lives as long as the driver)."""
        with self._host_fn_lock:
            fn = self._callbacks.pop(int(user_data or 0), None)
        if fn is not None:
            try:
                fn()
            except Exception:                     # never let an exception unwind into the driver
                log.exception("CUDA host callback failed")

    # ------------------------------------------------------------ modules and launches

    def module_load(self, image: bytes):
        return self._check("cuModuleLoadData", self.cu.cuModuleLoadData(image))

    def module_unload(self, module) -> None:
        self._check("cuModuleUnload", self.cu.cuModuleUnload(module))

    def module_function(self, module, name: str):
        return self._check(f"cuModuleGetFunction({name})", self.cu.cuModuleGetFunction(module, name.encode()))

    def function_set_max_dynamic_smem(self, function, nbytes: int) -> None:
        attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check("cuFuncSetAttribute", self.cu.cuFuncSetAttribute(function, attr, int(nbytes)))

    def launch(self, function, grid: Sequence[int], block: int, smem: int, stream,
               param_types: str, args: Sequence, pdl: bool = False) -> None:
        """One kernel launch. `param_types`: one code per parameter ("p" pointer, "i" int32,
        "f" float32), in the kernel's order. `pdl`: programmatic dependent launch (sm_90)."""
        native = self.native_launch
        if native is not None and native.c_launch is not None:
            err = native.c_launch.launch(native.entry, int(function), grid[0], grid[1], grid[2], block, smem,
                                         int(stream), pdl, param_types, args)
            if err:
                self._check("cuLaunchKernelEx", (self.cu.CUresult(err),))
            return
        buf = PARAMS.get(param_types) or PARAMS.setdefault(param_types, ParamBuffer(param_types))
        with LAUNCH_LOCK:
            buf.pack(args)
            if self.native_launch is not None:
                err = self.native_launch(int(function), grid, block, smem, int(stream), buf.address, pdl)
            else:
                err = self._launch_cuda_python(function, grid, block, smem, stream, buf.pointers, pdl)
        if err:
            self._check("cuLaunchKernelEx" if pdl or self.native_launch is not None else "cuLaunchKernel",
                        (self.cu.CUresult(err),))

    def _launch_cuda_python(self, function, grid, block: int, smem: int, stream, params, pdl: bool) -> int:
        """cuda-python's wrappers (TOKENWIRE_CUDA_LAUNCH=python): -> the CUresult as an int."""
        gx, gy, gz = grid
        if not pdl:
            err, = self.cu.cuLaunchKernel(function, gx, gy, gz, block, 1, 1, smem, stream, ctypes.addressof(params), 0)
            return int(err)
        config = self.cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes, config.hStream = smem, stream
        attr = self.cu.CUlaunchAttribute()
        attr.id = self.cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attr], 1
        err, = self.cu.cuLaunchKernelEx(config, function, ctypes.addressof(params), 0)
        return int(err)

    # ------------------------------------------------------------ graphs

    def begin_capture(self, stream) -> None:
        mode = self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._check("cuStreamBeginCapture", self.cu.cuStreamBeginCapture(stream, mode))

    def end_capture(self, stream):
        """-> an executable graph of everything launched on `stream` since begin_capture."""
        graph = self._check("cuStreamEndCapture", self.cu.cuStreamEndCapture(stream))
        try:
            return self._check("cuGraphInstantiate", self.cu.cuGraphInstantiate(graph, 0))
        finally:
            self._check("cuGraphDestroy", self.cu.cuGraphDestroy(graph))

    def graph_launch(self, graph_exec, stream) -> None:
        if self.native_ops is not None:
            return self._native_result("cuGraphLaunch", self.native_ops.cuGraphLaunch(int(graph_exec), int(stream)))
        self._check("cuGraphLaunch", self.cu.cuGraphLaunch(graph_exec, stream))

    def graph_destroy(self, graph_exec) -> None:
        self._check("cuGraphExecDestroy", self.cu.cuGraphExecDestroy(graph_exec))

    def close(self) -> None:
        self._check("cuDevicePrimaryCtxRelease", self.cu.cuDevicePrimaryCtxRelease(self.device))
