"""A driver with CudaDriver's interface and no GPU: for host-side tests of the CUDA backend.

Contract:
- Device memory is numpy byte arrays behind fake addresses; copies and memsets move real
  bytes; every kernel of kernels/cuda/kernels.py runs as a numpy twin (`EMULATORS`) that
  reads its arguments by name, so the executor's pointers, strides and grids are exercised
  end to end and its results can be compared with kernels/model.py.
- Every call is logged in `calls` as (method, thread id); tests assert on the log (one
  allocation phase, graphs captured once and replayed, no synchronize while stepping...).
- Streams execute at once by default. With `deferred=True` work queues and runs only when an
  event is waited on or polled (one operation per poll) or `run_pending()` is called, so a
  test can see that `launch` returns before the work ran and that host staging is read when
  the copy executes, not when it is queued.
- Stream capture records the launches into a graph instead of running them; replaying the
  graph runs them again against the memory of that moment.
The emulators follow the kernels' rules (layouts, padding, split attention) rather than
their arithmetic order; numerics are checked on a real GPU by tests/test_cuda_kernels.py.
"""

import bisect
import threading
import time
from types import SimpleNamespace

import numpy as np

from .fake_kernels import EMULATORS
from .kernels import SPECS
from .layout import round_up

BASE_ADDRESS = 0x7F0000000000


class FakeError(RuntimeError):
    """A call the real driver would reject (bad address, capture misuse, ...)."""


class _Stream:
    def __init__(self, name):
        self.name = name
        self.capture = None          # list of ops while capturing


class _Event:
    def __init__(self, timing, blocking):
        self.timing, self.blocking = timing, blocking
        self.done = True             # never recorded: complete, as in CUDA
        self.time = 0.0


class FakeDriver:
    def __init__(self, compute_capability=(9, 0), total_memory=8 << 30, deferred=False, name="Fake GPU"):
        self.name = name
        self.compute_capability = tuple(compute_capability)
        self.num_sms = 132
        self.total_memory = total_memory
        self.deferred = deferred
        self.calls = []              # (method, thread id)
        self.launches = []           # kernel names, in execution order
        self._allocs = {}            # base -> bytearray view (np.uint8)
        self._bases = []
        self._next = BASE_ADDRESS
        self._pending = []           # (stream, op) in enqueue order (deferred mode)
        self._weights_cache = {}
        self.smem_limits = {}

    def _log(self, method):
        self.calls.append((method, threading.get_ident()))

    def count(self, method) -> int:
        return sum(1 for m, _ in self.calls if m == method)

    # ------------------------------------------------------------ memory

    def mem_alloc(self, nbytes):
        self._log("mem_alloc")
        nbytes = max(int(nbytes), 1)
        if self.used_memory + nbytes > self.total_memory:
            raise FakeError(f"out of fake device memory: {nbytes} more bytes")
        base = self._next
        self._next += round_up(nbytes, 1 << 16)
        self._allocs[base] = np.zeros(nbytes, dtype=np.uint8)
        bisect.insort(self._bases, base)
        return base

    @property
    def used_memory(self) -> int:
        return sum(a.nbytes for a in self._allocs.values())

    def mem_free(self, ptr):
        self._log("mem_free")
        if ptr not in self._allocs:
            raise FakeError(f"mem_free of {ptr:#x}, which is not an allocation")
        del self._allocs[ptr]
        self._bases.remove(ptr)

    def mem_get_info(self):
        self._log("mem_get_info")
        return self.total_memory - self.used_memory, self.total_memory

    def bytes(self, ptr, nbytes) -> np.ndarray:
        """The device bytes [ptr, ptr + nbytes) as a writable uint8 view."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            raise FakeError(f"address {ptr:#x} is not device memory")
        base = self._bases[i]
        buf = self._allocs[base]
        off = ptr - base
        if off + nbytes > buf.nbytes:
            raise FakeError(f"access [{ptr:#x}, +{nbytes}) runs past its allocation of {buf.nbytes} bytes")
        return buf[off:off + nbytes]

    def view(self, ptr, dtype, count) -> np.ndarray:
        dtype = np.dtype(dtype)
        if ptr % dtype.itemsize:
            raise FakeError(f"address {ptr:#x} is misaligned for {dtype}")
        return self.bytes(ptr, dtype.itemsize * int(count)).view(dtype)

    def host_alloc(self, nbytes):
        self._log("host_alloc")
        return np.zeros(int(nbytes), dtype=np.uint8)

    def host_free(self, view):
        self._log("host_free")

    def memset_async(self, ptr, nbytes, stream):
        self._log("memset_async")
        self._enqueue(stream, lambda: self.bytes(ptr, nbytes).fill(0))

    def memcpy_htod_async(self, dst, src, nbytes, stream):
        self._log("memcpy_htod_async")
        src_bytes = src.reshape(-1).view(np.uint8)
        self._enqueue(stream, lambda: self.bytes(dst, nbytes).__setitem__(slice(None), src_bytes[:nbytes]))

    def memcpy_dtoh_async(self, dst, src, nbytes, stream):
        self._log("memcpy_dtoh_async")
        dst_bytes = dst.reshape(-1).view(np.uint8)
        self._enqueue(stream, lambda: dst_bytes.__setitem__(slice(0, nbytes), self.bytes(src, nbytes)))

    def memcpy_dtod_async(self, dst, src, nbytes, stream):
        self._log("memcpy_dtod_async")
        self._enqueue(stream, lambda: self.bytes(dst, nbytes).__setitem__(slice(None), self.bytes(src, nbytes).copy()))

    # ------------------------------------------------------------ streams, events, ordering

    def stream_create(self):
        self._log("stream_create")
        return _Stream(f"stream{self.count('stream_create')}")

    def stream_destroy(self, stream):
        self._log("stream_destroy")

    def _enqueue(self, stream, op):
        if stream.capture is not None:
            stream.capture.append(op)
        elif self.deferred:
            self._pending.append(op)
        else:
            op()

    def run_pending(self, upto=None) -> None:
        """Execute queued work in enqueue order (deferred mode), through `upto` if given."""
        while self._pending:
            op = self._pending.pop(0)
            op()
            if upto is not None and op is upto:
                return

    def stream_synchronize(self, stream):
        self._log("stream_synchronize")
        if stream.capture is not None:
            raise FakeError("stream_synchronize on a capturing stream")
        self.run_pending()

    def stream_wait_event(self, stream, event):
        self._log("stream_wait_event")

    def event_create(self, timing=False, blocking=False):
        self._log("event_create")
        return _Event(timing, blocking)

    def event_destroy(self, event):
        self._log("event_destroy")

    def event_record(self, event, stream):
        self._log("event_record")
        event.done = False

        def op():
            event.done, event.time = True, time.perf_counter()
        event.op = op
        self._enqueue(stream, op)

    def event_query(self, event):
        """Deferred mode: each query lets the "GPU" run one queued operation, as time would."""
        self._log("event_query")
        if not event.done and self._pending:
            self._pending.pop(0)()
        return event.done

    def event_synchronize(self, event):
        self._log("event_synchronize")
        if not event.done:
            self.run_pending(upto=event.op)

    def event_elapsed_ms(self, start, end):
        self._log("event_elapsed_ms")
        if not (start.timing and end.timing):
            raise FakeError("event_elapsed_ms on events created without timing")
        return (end.time - start.time) * 1e3

    def launch_host_func(self, stream, fn):
        self._log("launch_host_func")
        self._enqueue(stream, fn)

    # ------------------------------------------------------------ kernels and graphs

    def module_load(self, image):
        self._log("module_load")
        return "module"

    def module_unload(self, module):
        self._log("module_unload")

    def module_function(self, module, name):
        self._log("module_function")
        if name not in SPECS:
            raise FakeError(f"no kernel named {name!r}")
        return name

    def function_set_max_dynamic_smem(self, function, nbytes):
        self._log("function_set_max_dynamic_smem")
        if nbytes > 227 * 1024:
            raise FakeError(f"{function}: {nbytes} bytes of shared memory exceed the 227 KB a block can have")
        self.smem_limits[function] = nbytes

    def launch(self, function, grid, block, smem, stream, param_types, args, pdl=False):
        self._log("launch")
        spec = SPECS[function]
        if param_types != spec.param_types or len(args) != len(spec.param_names):
            raise FakeError(f"{function}: launched with {param_types!r}, the kernel takes {spec.param_types!r}")
        if smem > 48 * 1024 and smem > self.smem_limits.get(function, 0):
            raise FakeError(f"{function}: {smem} bytes of dynamic shared memory without raising the limit")
        if min(grid) < 1 or block < 1 or block > 1024:
            raise FakeError(f"{function}: bad launch shape grid={grid} block={block}")
        kwargs = dict(zip(spec.param_names, args))
        emulate = EMULATORS[function]

        def op():
            self.launches.append(function)
            emulate(self, tuple(grid), **kwargs)
        self._enqueue(stream, op)

    def begin_capture(self, stream):
        self._log("begin_capture")
        if stream.capture is not None:
            raise FakeError("begin_capture on a stream already capturing")
        stream.capture = []

    def end_capture(self, stream):
        self._log("end_capture")
        ops, stream.capture = stream.capture, None
        return SimpleNamespace(ops=ops)

    def graph_launch(self, graph, stream):
        self._log("graph_launch")
        for op in graph.ops:
            self._enqueue(stream, op)

    def graph_destroy(self, graph):
        self._log("graph_destroy")

    def make_current(self):
        self._log("make_current")

    def close(self):
        self._log("close")
