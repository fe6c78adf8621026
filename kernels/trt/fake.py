"""A stand-in for kernels/trt/engine.py without TensorRT or a GPU: for host-side tests of the executor.

The engine is the same exported ONNX graph run by onnxruntime (CPU); its context keeps the
shapes and addresses it is given and, when enqueued on a stream of kernels/cuda/fake.py's
FakeDriver, reads its inputs from that fake device memory and writes its outputs there,
present K/V over past K/V as TensorRT's in-place KV update does. So the executor's buffers,
offsets, rows, ring and graphs are exercised end to end, and two of TensorRT's rules are
enforced (256-byte aligned addresses; present K/V bound to the past K/V's memory). TensorRT
itself is not exercised (see
tests/test_trt_executor.py for the tests that need it).
"""

from pathlib import Path

import numpy as np

from .onnx_export import read_export

OUTPUT_TYPES = {"logits": np.float32, "next_token": np.int32}
ALIGNMENT = 256              # bytes: what kernels/trt/executor.py promises for every bound address


class FakeTrtEngine:
    def __init__(self, export_dir, graph: str, drv):
        import onnxruntime as ort
        manifest = read_export(export_dir)
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
        opts.log_severity_level = 3
        path = Path(export_dir) / manifest["graphs"][graph]
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.drv = drv
        self.num_enqueued = 0

    def context(self) -> "FakeTrtContext":
        return FakeTrtContext(self)


class FakeTrtContext:
    def __init__(self, engine: FakeTrtEngine):
        self.engine = engine
        self.shapes, self.addresses = {}, {}

    def set_shape(self, name: str, dims) -> None:
        if name not in self.engine.inputs:
            raise KeyError(f"no input {name!r}")
        self.shapes[name] = tuple(int(d) for d in dims)

    def bind(self, name: str, ptr: int) -> None:
        if name not in self.engine.inputs and name not in self.engine.outputs:
            raise KeyError(f"no tensor {name!r}")
        if int(ptr) % ALIGNMENT:
            raise ValueError(f"{name} bound at {int(ptr):#x}, not {ALIGNMENT}-byte aligned")
        self.addresses[name] = int(ptr)

    def enqueue(self, stream) -> None:
        missing = [n for n in self.engine.inputs + self.engine.outputs if n not in self.addresses]
        if missing or set(self.shapes) != set(self.engine.inputs):
            raise RuntimeError(f"enqueue with unbound tensors {missing} or unset shapes")
        for name in self.engine.outputs:        # TensorRT's KVCacheUpdate: the output is the input's memory
            past = name.replace("present_", "past_")
            if name.startswith("present_") and self.addresses[name] != self.addresses[past]:
                raise RuntimeError(f"{name} is not bound to its past tensor's address (in-place KV update)")
        shapes, addresses = dict(self.shapes), dict(self.addresses)     # as bound now (graphs replay these)
        self.engine.drv._enqueue(stream, lambda: self._run(shapes, addresses))

    def _run(self, shapes: dict, addresses: dict) -> None:
        drv, e = self.engine.drv, self.engine
        feeds = {}
        for name, shape in shapes.items():
            dtype = np.float32 if name.startswith("past_") else np.int64
            feeds[name] = drv.view(addresses[name], dtype, int(np.prod(shape))).reshape(shape).copy()
        results = e.session.run(None, feeds)
        e.num_enqueued += 1
        for name, value in zip(e.outputs, results):
            dtype = OUTPUT_TYPES.get(name, np.float32)
            drv.view(addresses[name], dtype, value.size)[:] = value.astype(dtype).reshape(-1)
