"""`tokenwire bench engine --backend trt`: TensorRT decode and prefill against the GPU's bandwidth roofline.

The same measurement as bench/engine_cuda.py, through kernels/trt/: per shape, a random-weight
INT4 engine of that exact shape (bench/engine.py's `random_engine`) is exported to ONNX
(kernels/trt/onnx_export.py, into a temporary directory), built into TensorRT engines (plans
cached as kernels/trt/engine.py says), and driven by TrtExecutor. Printed per batch size:
decode tokens/s (median wall step, launch + wait), weight bytes read per step / step time and
its fraction of the device-to-device copy roofline measured in the same run, host time per
launch; and prefill tokens/s for one chunk of --prompt-len tokens. Run it beside
`--backend cuda` on the same GPU to compare the two backends.
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..core.config import ModelConfig
from ..core.executor import SeqStep
from ..core.sampling_params import SamplingParams
from ..kernels.cuda.driver import CudaDriver, CudaUnavailable
from ..kernels.trt import cache_dir
from ..kernels.trt.engine import TrtEngine, TrtUnavailable, engine_plan, import_tensorrt
from ..kernels.trt.executor import TrtExecutor, TrtOptions
from ..kernels.trt.onnx_export import OnnxExportOptions, export_onnx, read_export
from .engine_cuda import copy_bandwidth, parse_batches
from .shapes import all_shapes, random_engine

WARMUP_STEPS = 3


def weight_bytes(tensors: dict) -> int:
    """Bytes of every matrix a decode step reads (the embedding table is gathered, not read)."""
    return sum(a.nbytes for name, a in tensors.items() if not name.startswith("embed.") and a.ndim == 2)


def decode_steps(batch: int, context: int, step: int, vocab_size: int):
    greedy = SamplingParams(temperature=0.0)
    return [SeqStep(i, [(7 * i + step) % vocab_size], context + step, [i], True, greedy, 0, [], [])
            for i in range(batch)]


def time_decode(ex, batch: int, context: int, num_steps: int) -> dict:
    vocab = ex.config.vocab_size
    for i in range(WARMUP_STEPS):                                    # warm-up (and graph capture)
        ex.step(decode_steps(batch, context, i, vocab))
    wall, host = [], []
    for i in range(num_steps):
        seqs = decode_steps(batch, context, WARMUP_STEPS + i, vocab)
        t0 = time.perf_counter_ns()
        handle = ex.launch(seqs)
        t1 = time.perf_counter_ns()
        ex.collect(handle)
        wall.append((time.perf_counter_ns() - t0) / 1e9)
        host.append((t1 - t0) / 1e3)
    return {"step_s": statistics.median(wall), "host_us": statistics.median(host),
            "graph": ex.decode_contexts[ex._bucket(batch)][1] is not None}


def time_prefill(ex, prompt_len: int, reps: int = 3) -> float:
    ids = list(np.random.default_rng(0).integers(0, ex.config.vocab_size, prompt_len))
    seqs = [SeqStep(0, ids, 0, [0], True, SamplingParams(temperature=0.0), 0, [], [])]
    ex.step(seqs)                                                    # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ex.step(seqs)
        times.append(time.perf_counter() - t0)
    return prompt_len / statistics.median(times)


def build_executor(shape: str, args, export_dir, driver=None, engine_factory=None):
    config = ModelConfig.from_dict(all_shapes()[shape])
    tensors = random_engine(config, args.group_size, args.embedding)
    max_len = -(-(args.context + WARMUP_STEPS + args.steps + max(args.prompt_len, 1) + 1) // 64) * 64
    export_onnx(config, tensors, export_dir, OnnxExportOptions(max_len=max_len))
    manifest = read_export(export_dir)
    if engine_factory is not None:                  # tests: kernels/trt/fake.py's engine over the export
        engine_fn = engine_factory(export_dir)
    else:
        def engine_fn(graph, profile, device):
            return TrtEngine(engine_plan(export_dir, manifest, graph, profile, device, cache_dir() / "plans"))
    options = TrtOptions(max_batch=max(parse_batches(args.batch)), max_num_tokens=max(args.prompt_len, 1))
    return config, weight_bytes(tensors), TrtExecutor(config, options, manifest=manifest,
                                                      engine_fn=engine_fn, driver=driver)


def run_shape(shape: str, args, drv, roofline: float, engine_factory=None) -> list:
    with tempfile.TemporaryDirectory(prefix="tokenwire-trt-bench-") as export_dir:
        config, weights, ex = build_executor(shape, args, export_dir, drv, engine_factory)
        try:
            c = config
            print(f"\n== {shape} on TensorRT: {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}; "
                  f"INT4 g{args.group_size}, embedding/lm_head {args.embedding}; {ex.gpu['name']}")
            print(f"   weights read per decode step {weights / 1e9:.3f} GB; roofline (device-to-device copy, "
                  f"read+write) {roofline / 1e12:.2f} TB/s = {weights / roofline * 1e3:.3f} ms per step")
            print(f"   {'batch':>5} {'decode tok/s':>13} {'step ms':>8} {'weights TB/s':>12} {'% roofline':>10} "
                  f"{'host us/step':>12} {'graph':>5}")
            prefill = time_prefill(ex, args.prompt_len)
            rows = []
            for batch in parse_batches(args.batch):
                t = time_decode(ex, batch, args.context, args.steps)
                row = {"shape": shape, "backend": "trt", "batch": batch, "device": ex.gpu["name"],
                       "decode_tokens_per_s": batch / t["step_s"], "decode_step_ms": t["step_s"] * 1e3,
                       "prefill_tokens_per_s": prefill, "weight_bytes_per_step": weights,
                       "read_bandwidth_bytes_per_s": roofline, "achieved_bytes_per_s": weights / t["step_s"],
                       "roofline_fraction": weights / roofline / t["step_s"], "host_us_per_step": t["host_us"],
                       "graph": t["graph"], "context": args.context, "group_size": args.group_size}
                print(f"   {batch:>5} {row['decode_tokens_per_s']:>13.1f} {row['decode_step_ms']:>8.3f} "
                      f"{row['achieved_bytes_per_s'] / 1e12:>12.2f} {100 * row['roofline_fraction']:>9.1f}% "
                      f"{row['host_us_per_step']:>12.1f} {str(row['graph']):>5}")
                rows.append(row)
            print(f"   prefill: {prefill:.0f} tokens/s (one chunk of {args.prompt_len} tokens)")
            return rows
        finally:
            ex.close()


def run(args, driver=None, engine_factory=None) -> int:
    """Entry point (the hook bench/engine.py calls for --backend trt)."""

    for name in ("context", "steps", "prompt_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"tokenwire bench engine: --{name.replace('_', '-')} must be >= 1")
    try:
        drv = driver if driver is not None else CudaDriver(0)
        if engine_factory is None:
            import_tensorrt()
    except (CudaUnavailable, TrtUnavailable) as exc:
        raise SystemExit(f"tokenwire bench engine --backend trt: {exc}") from None
    free, _ = drv.mem_get_info()
    roofline = copy_bandwidth(drv, min(2 << 30, free // 8))
    rows = []
    for shape in args.shape or ["llama-3.2-1b", "llama-3.1-8b"]:
        rows += run_shape(shape, args, drv, roofline, engine_factory)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"\nwrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0
