"""The TensorRT backend: the engine's ONNX export built into TensorRT engines and driven by hand.

Folder map:
  onnx_graph.py   a small ONNX graph builder and the weights file two graphs share
  onnx_export.py  an engine's decode and prefill steps as ONNX (blocked int4 DequantizeLinear into
                  MatMul, the KV cache updated in place by TensorScatter); `tokenwire export-onnx`
  onnx_check.py   TensorRT's operator set and restrictions; onnxruntime as the CPU oracle (tests)
  engine.py       the only module calling TensorRT's Python API (tensorrt, else tensorrt_rtx): build
                  from ONNX with one shape profile, cache plans on disk, contexts bound to our buffers
  executor.py     TrtExecutor: the Executor of core/executor.py, on the CUDA backend's driver,
                  streams and pinned ring (kernels/cuda/driver.py, ring.py)
  fake.py         the engine interface on onnxruntime over kernels/cuda/fake.py's memory (host tests)

`create_executor(engine, options, max_model_len)` is the "trt" row of kernels.BACKENDS: it
exports the engine to ONNX once (cached), then builds or loads the plans for this GPU.
onnx, TensorRT and cuda-python are optional: each is imported only then.
"""

import os
from pathlib import Path
from typing import Optional

from ...core.options import EngineOptions
from ..cuda.driver import CudaDriver, CudaError
from .engine import TrtEngine, TrtError, TrtUnavailable, engine_plan, import_tensorrt
from .executor import TrtExecutor, TrtOptions
from .onnx_export import OnnxExportOptions, export_engine, read_export

DEFAULT_MAX_LEN = 4096          # a context when neither the model nor the options bound it lower


def cache_dir() -> Path:
    """Exports and plans: `$TOKENWIRE_TRT_CACHE`, else `$TOKENWIRE_CACHE_DIR/trt`, else the XDG cache."""
    if os.environ.get("TOKENWIRE_TRT_CACHE"):
        return Path(os.environ["TOKENWIRE_TRT_CACHE"])
    if os.environ.get("TOKENWIRE_CACHE_DIR"):
        return Path(os.environ["TOKENWIRE_CACHE_DIR"]) / "trt"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenwire" / "trt"


def export_for(engine, max_len: int, root: Path, matmul_dtype: str = "float32") -> Path:
    """The engine's ONNX export with KV capacity max_len, made once per engine source, capacity and dtype."""
    key = (engine.manifest.get("source", {}).get("sha256") or "unknown")[:16]
    out = root / "onnx" / f"{engine.name.replace('/', '_')}-{key}-{max_len}-{matmul_dtype}"
    try:
        read_export(out)
        return out
    except ValueError:
        pass
    tmp = out.with_name(out.name + ".tmp")
    export_engine(engine, tmp, OnnxExportOptions(max_len=max_len, matmul_dtype=matmul_dtype))
    try:
        tmp.replace(out)
    except OSError:                     # another process placed it first
        read_export(out)
    return out


def kv_rows(driver, engine, max_len: int, max_num_seqs: int, memory_fraction: float = 0.8) -> int:
    """KV rows (sequences at once) that fit: each row holds a whole context of max_len positions, so
    the count is what `memory_fraction` of the free memory, less twice the weights (the plans hold
    them; TensorRT's scratch), allows, capped at max_num_seqs. Too little for one row raises."""
    c = engine.config
    per_row = 2 * c.num_layers * c.num_kv_heads * max_len * c.head_dim * 4
    weights = sum(t.nbytes for t in engine.tensors.values())
    free, _ = driver.mem_get_info()
    rows = min(max_num_seqs, int(free * memory_fraction - 2 * weights) // per_row)
    if rows < 1:
        raise ValueError(f"one sequence of {max_len} positions needs {per_row / 2**20:.0f} MiB of KV cache and "
                         f"{free / 2**20:.0f} MiB are free beside the weights: lower --max-model-len")
    return rows


def create_executor(engine, options: EngineOptions, max_model_len: Optional[int] = None, *,
                    matmul_dtype: str = "float32", export_dir=None, driver=None, engine_fn=None, **trt_options):
    """kernels.BACKENDS["trt"]: a loaded engine directory -> TrtExecutor.

    `matmul_dtype`: the export's weight products, float32 (the reference's arithmetic) or float16
    (TensorRT's W4A16 INT4 GEMMs; not yet measured on a GPU). `trt_options` are TrtOptions fields;
    `driver` and `engine_fn` replace the GPU and TensorRT (tests pass kernels/cuda/fake.py and
    kernels/trt/fake.py). One KV row per sequence (see executor.py), so `options.block_size` and
    `num_kv_blocks` do not apply. Raises ValueError when the backend cannot run here."""
    try:
        if driver is None:              # the GPU and TensorRT first: their absence is told before any export
            driver = CudaDriver(trt_options.get("device", 0))
        if engine_fn is None:
            import_tensorrt()
        # + the scratch position, rounded up to 64 positions so every KV row starts 256-byte aligned
        max_len = -(-((max_model_len or min(engine.config.max_position_embeddings, DEFAULT_MAX_LEN)) + 1) // 64) * 64
        rows = kv_rows(driver, engine, max_len, options.max_num_seqs)
        opts = TrtOptions(max_batch=rows, max_num_tokens=options.max_num_batched_tokens, **trt_options)
        root = Path(opts.cache_dir) if opts.cache_dir else cache_dir()
        export_dir = Path(export_dir) if export_dir else export_for(engine, max_len, root, matmul_dtype)
        manifest = read_export(export_dir)
        if engine_fn is None:
            def engine_fn(graph, profile, device):
                return TrtEngine(engine_plan(export_dir, manifest, graph, profile, device, root / "plans"))
        return TrtExecutor(engine.config, opts, manifest=manifest, engine_fn=engine_fn, driver=driver)
    except (CudaError, TrtUnavailable, TrtError) as exc:
        raise ValueError(f"the trt backend is not available: {exc}") from None
