"""The thin wrapper over TensorRT's Python API: the only module of tokenwire that calls it.

Contract:
- `import_tensorrt()` -> the `tensorrt` module, else `tensorrt_rtx` (TensorRT for RTX, same
  Python API), else `TrtUnavailable` naming both.
- `engine_plan(export_dir, graph, profile, device, cache_dir)` -> a serialized engine for one
  graph of an ONNX export (kernels/trt/onnx_export.py), built once and cached on disk under
  a key of the export's sha256, the graph, the shape profile, the TensorRT flavour and
  version, and the GPU (name and compute capability). Built with the ONNX parser into a
  strongly typed network (the export's float32 and int4 types are what TensorRT runs;
  TensorRT-RTX builds only such networks), one optimization profile from `profile`.
- `TrtEngine(plan)` deserializes it; `context()` -> `TrtContext`, which is driven by hand:
  `set_shape(name, dims)`, `bind(name, device_ptr)` (`set_tensor_address`: tokenwire owns
  every buffer) and `enqueue(stream)` (`execute_async_v3` on tokenwire's stream; nothing
  synchronizes).

API names follow the TensorRT 10 Python reference (name-based I/O: `num_io_tensors`,
`get_tensor_name`, `set_input_shape`, `set_tensor_address`, `execute_async_v3(stream_handle)`;
`Builder.create_network(flags)`, `OnnxParser.parse_from_file`, `create_optimization_profile`,
`IOptimizationProfile.set_shape(name, min, opt, max)`, `build_serialized_network`,
`Runtime.deserialize_cuda_engine`). Not run on a GPU in this project yet: see README.
"""

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, Tuple

log = logging.getLogger(__name__)

FLAVOURS = ("tensorrt", "tensorrt_rtx")


class TrtUnavailable(RuntimeError):
    """Neither TensorRT nor TensorRT-RTX can be imported (or built for this GPU)."""


class TrtError(RuntimeError):
    """A TensorRT call failed; the message names the call and TensorRT's errors."""


def import_tensorrt():
    errors = []
    for name in FLAVOURS:
        try:
            return __import__(name)
        except ImportError as exc:          # includes a wheel whose libraries are missing
            errors.append(f"{name}: {exc}")
    raise TrtUnavailable("the trt backend needs TensorRT's Python API (pip install tensorrt-cu12, or "
                         "tensorrt-rtx-cu12): " + "; ".join(errors))


def plan_key(manifest: dict, graph: str, profile: Dict[str, Tuple], trt, device: dict) -> str:
    """What makes a cached plan valid: the export, the graph, the shapes, TensorRT and the GPU."""
    shapes = {k: list(map(list, v)) for k, v in profile.items()}
    what = {"export": manifest["sha256"], "graph": graph, "profile": shapes,
            "tensorrt": [trt.__name__, trt.__version__], "gpu": device}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def engine_plan(export_dir, manifest: dict, graph: str, profile: Dict[str, Tuple], device: dict, cache_dir,
                workspace_bytes: int = 1 << 30) -> bytes:
    """Serialized engine of `graph` ("decode" or "prefill"), from the cache or built now (seconds
    to minutes) and cached. profile: input name -> (min, opt, max) dims."""
    trt = import_tensorrt()
    path = Path(cache_dir) / f"{plan_key(manifest, graph, profile, trt, device)}.plan"
    if path.is_file():
        return path.read_bytes()
    plan = build_plan(trt, Path(export_dir) / manifest["graphs"][graph], profile, workspace_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(plan)
    tmp.replace(path)                       # atomic: a racing build leaves one complete plan
    log.info("TensorRT %s plan for %s cached at %s", trt.__version__, graph, path)
    return plan


def build_plan(trt, onnx_path: Path, profile: Dict[str, Tuple], workspace_bytes: int) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):      # reads weights.bin beside it (external data)
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtError(f"TensorRT's ONNX parser refused {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    shapes = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        shapes.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(shapes)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TrtError(f"TensorRT could not build {onnx_path.name} (its log above says why)")
    return bytes(plan)


class TrtEngine:
    """A deserialized engine; one `TrtContext` per shape it is driven at."""

    def __init__(self, plan: bytes):
        trt = import_tensorrt()
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise TrtError("deserialize_cuda_engine failed: the plan was built by another TensorRT or for another GPU")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def context(self) -> "TrtContext":
        context = self.engine.create_execution_context()
        if context is None:
            raise TrtError("create_execution_context failed (out of device memory?)")
        return TrtContext(context)


class TrtContext:
    def __init__(self, context):
        self.context = context

    def set_shape(self, name: str, dims) -> None:
        if not self.context.set_input_shape(name, tuple(int(d) for d in dims)):
            raise TrtError(f"set_input_shape({name}, {tuple(dims)}) refused: outside the engine's profile")

    def bind(self, name: str, ptr: int) -> None:
        if not self.context.set_tensor_address(name, int(ptr)):
            raise TrtError(f"set_tensor_address({name}) refused")

    def enqueue(self, stream) -> None:
        """Hot path: the engine's kernels on `stream` (a cuda-python CUstream); returns at once."""
        if not self.context.execute_async_v3(int(stream)):
            raise TrtError("execute_async_v3 failed (TensorRT's log says why)")
