"""`tokenwire bench engine --backend cuda`: CUDA decode and prefill against the GPU's bandwidth roofline.

Random-weight INT4 engines of real architectures' shapes, against the GPU's memory-bandwidth
roofline measured in the same run.

    python -m tokenwire.bench.engine_cuda --shape llama-3.1-8b --batch 1,8,32,128 [--json FILE]

Per shape:
1. A random-weight INT4 engine of that exact shape (bench/shapes.py's `random_engine`: random
   codes, scales and zero points; group 64; embedding and lm_head int4), loaded once into a
   CudaExecutor. Speed does not depend on the values; nothing is downloaded.
2. The roofline: a device-to-device copy of a large buffer (read + write bytes per second),
   timed with CUDA events before the executor takes the memory.
3. Per batch size B, decode steps of B one-token sequences at context --context, replayed from
   the bucket's CUDA graph: tokens/s from the median wall step (launch + wait); weight bytes
   read per step / step time = achieved bandwidth, and its fraction of the copy roofline;
   host time per step (the `launch` call alone: wall, and the engine thread's CPU time, which
   another process's time slices do not inflate); completion-to-ring: from the step's "done"
   event (sampling finished) to its ids in the pinned ring, on the GPU clock (event timing)
   and as the host sees it (spinning on both events).
4. Prefill tokens/s: one eager step of --prefill-tokens tokens (sequences of --prompt-len).
5. --profile: at the smallest and the largest batch, every distinct kernel launch of a decode
   step timed alone (captured 20 times into a graph and replayed): microseconds per launch and
   per step, each projection's achieved bandwidth, and the kernels' sum against the graph step
   (the rest is launch gaps), to show what a missed target blames.
6. --mm-probe: at batch 1, each INT4 product beside its weight-stream probes (the same grid and
   weight loads, nothing computed), each timed alone: whether a product's shortfall against the
   roofline lies in its load pipeline or in its arithmetic and barriers. --mm-variant runs every
   product by an experiment's twin kernels (kernels.py MM_VARIANTS).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..core.config import ModelConfig
from ..core.executor import SeqStep
from ..core.options import DEFAULTS
from ..core.sampling_params import SamplingParams
from ..kernels.cuda import forward
from ..kernels.cuda.driver import CudaDriver, CudaUnavailable, capture_graph
from ..kernels.cuda.executor import CudaExecutor, CudaOptions
from ..kernels.cuda.kernels import MM_PROBES, MM_PRODUCTS, MM_VARIANTS, SPECS
from ..kernels.cuda.weights import linear_bytes
from .shapes import all_shapes, random_engine

BLOCK_SIZE = DEFAULTS.block_size          # the served engine's KV block (core/options.py)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The standalone command: the options bench/engine.py shares, then the CUDA-only ones."""
    parser.add_argument("--shape", action="append", choices=sorted(all_shapes()),
                        help="architecture shape; repeat for several (default: llama-3.2-1b and llama-3.1-8b)")
    parser.add_argument("--batch", default="1,8,32,128", help="decode batch sizes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill tokens per sequence (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="(default: %(default)s)")
    parser.add_argument("--embedding", default="int4", choices=("fp16", "int8", "int4"),
                        help="embedding and lm_head encoding (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="time every kernel of a decode step alone, at the smallest and the largest batch")
    add_cuda_arguments(parser)


def add_cuda_arguments(parser: argparse.ArgumentParser) -> None:
    """Options only the CUDA backend reads (bench/engine.py adds these to its own parser)."""
    g = parser.add_argument_group("--backend cuda")
    g.add_argument("--context", type=int, default=128, help="tokens already in each sequence's cache (default: %(default)s)")
    g.add_argument("--prefill-tokens", type=int, default=2048, help="tokens in the timed prefill step (default: %(default)s)")
    g.add_argument("--kv-dtype", default="float32", choices=("float32", "float16"), help="(default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=2048, help="(default: %(default)s)")
    g.add_argument("--no-pdl", action="store_true",
                   help="no programmatic dependent launch between kernels (default: on where the GPU has it, sm_90+)")
    g.add_argument("--unfused", action="store_true",
                   help="the unfused reference kernels (10 per layer) instead of the fused decoder (5 per layer)")
    g.add_argument("--mm-blocks-per-sm", type=int, default=forward.MM_BLOCKS_PER_SM,
                   help="INT4 products split K to fill this many blocks per SM, every kernel family alike "
                        "(default: each family's own, kernels.py MM_BLOCKS_PER_SM)")
    g.add_argument("--mm-one-wave", action=argparse.BooleanOptionalAction, default=forward.MM_ONE_WAVE,
                   help="split K to the most blocks one wave of --mm-blocks-per-sm holds, not the fewest that fill "
                        "it (forward.py MM_ONE_WAVE; default: %(default)s)")
    g.add_argument("--mm-variant", default="", choices=("",) + tuple(MM_VARIANTS),
                   help="INT4 products by a variant's twin kernels (an experiment: kernels.py MM_VARIANTS; "
                        "r: x4 with its weights in registers, not streamed through shared memory)")
    g.add_argument("--mm-probe", action="store_true",
                   help="at batch 1, each decode product beside its weight-stream probes (the same grid and "
                        "weight loads, nothing computed: the ceiling of the product's load pipeline)")
    g.add_argument("--matmul", default="auto", choices=("auto", "tc", "simt"), help="(default: %(default)s)")
    g.add_argument("--int4-activations", default="exact", choices=("exact", "fp16"),
                   help="INT4 tensor-core activations: exact (hi/lo fp16 pair) or fp16 (default: %(default)s)")


# ------------------------------------------------------------------ measurements

def copy_bandwidth(drv, nbytes: int, reps: int = 10) -> float:
    """(read + write) bytes/s of a device-to-device copy, median of `reps` after a warm-up."""
    stream = drv.stream_create()
    src, dst = drv.mem_alloc(nbytes), drv.mem_alloc(nbytes)
    start, end = drv.event_create(timing=True), drv.event_create(timing=True)
    try:
        times = []
        for i in range(reps + 1):
            drv.event_record(start, stream)
            drv.memcpy_dtod_async(dst, src, nbytes, stream)
            drv.event_record(end, stream)
            drv.event_synchronize(end)
            if i:
                times.append(drv.event_elapsed_ms(start, end) / 1e3)
        return 2 * nbytes / statistics.median(times)
    finally:
        for e in (start, end):
            drv.event_destroy(e)
        drv.mem_free(src)
        drv.mem_free(dst)
        drv.stream_destroy(stream)


def weight_bytes_per_step(executor) -> int:
    w = executor.weights
    return sum(linear_bytes(lin) for layer in w.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)) \
        + linear_bytes(w.lm_head)


WARMUP_STEPS = 3


def blocks_per_seq(context: int, num_steps: int) -> int:
    return -(-(context + WARMUP_STEPS + num_steps + 1) // BLOCK_SIZE)


def decode_steps(batch: int, context: int, step: int, vocab_size: int, per_seq: int):
    """B one-token sequences at position context + step, each with its own `per_seq` blocks.
    The cache holds whatever it holds: speed does not depend on the values."""
    greedy = SamplingParams(temperature=0.0)
    blocks = -(-(context + step + 1) // BLOCK_SIZE)
    return [SeqStep(i, [(7 * i + step) % vocab_size], context + step, list(range(i * per_seq, i * per_seq + blocks)),
                    True, greedy, 0, [], []) for i in range(batch)]


def time_decode(executor, batch: int, context: int, num_steps: int) -> dict:
    """Median wall time per step, host launch time (wall, and the thread's CPU time: what the host
    did, without another process's time slices), and completion-to-ring (GPU and host views)."""
    drv, vocab = executor.drv, executor.config.vocab_size
    per_seq = blocks_per_seq(context, num_steps)
    for i in range(WARMUP_STEPS):                                    # warm-up (and graph capture)
        executor.step(decode_steps(batch, context, i, vocab, per_seq))
    wall, host, host_cpu, ring_gpu, ring_host = [], [], [], [], []
    for i in range(num_steps):
        seqs = decode_steps(batch, context, WARMUP_STEPS + i, vocab, per_seq)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        handle = executor.launch(seqs)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        slot = executor.ring[handle.slot]
        while not drv.event_query(slot.done):
            pass
        t2 = time.perf_counter_ns()
        while not drv.event_query(slot.ready):
            pass
        t3 = time.perf_counter_ns()
        executor.collect(handle)
        t4 = time.perf_counter_ns()
        wall.append((t4 - t0) / 1e9)
        host.append((t1 - t0) / 1e3)
        host_cpu.append((c1 - c0) / 1e3)
        ring_host.append((t3 - t2) / 1e3)
        ring_gpu.append(drv.event_elapsed_ms(slot.done, slot.ready) * 1e3)
    return {"step_s": statistics.median(wall), "host_us": statistics.median(host),
            "host_cpu_us": statistics.median(host_cpu),
            "ring_gpu_us": statistics.median(ring_gpu), "ring_host_us": statistics.median(ring_host),
            "graph": handle.graph}


# driver calls a decode step's launch makes, by the part of the host time they are counted in
HOST_PARTS = {"graph_launch": "graph launch", "memcpy_htod_async": "copies", "memcpy_dtoh_async": "copies",
              "memcpy_dtod_async": "copies", "event_record": "events", "stream_wait_event": "events"}


def host_breakdown(executor, batch: int, context: int, num_steps: int) -> dict:
    """The engine thread's CPU microseconds per decode step's `launch`, by part: each driver call
    of HOST_PARTS wrapped to count its thread time, the rest (metadata fill, Python) by difference.
    The wrappers add a little per call; this runs apart from the timed steps. -> {part: us}"""
    drv, vocab = executor.drv, executor.config.vocab_size
    per_seq = blocks_per_seq(context, num_steps)
    spent = dict.fromkeys(set(HOST_PARTS.values()), 0)
    originals = {name: getattr(drv, name) for name in HOST_PARTS}
    own = {name for name in HOST_PARTS if name in vars(drv)}         # instance attributes, put back as they were

    def counted(name, fn):
        def call(*args, **kwargs):
            c0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[HOST_PARTS[name]] += time.thread_time_ns() - c0
        return call
    total = 0
    try:
        for i in range(WARMUP_STEPS + num_steps):
            seqs = decode_steps(batch, context, i, vocab, per_seq)
            if i == WARMUP_STEPS:
                for name, fn in originals.items():
                    setattr(drv, name, counted(name, fn))
            c0 = time.thread_time_ns()
            handle = executor.launch(seqs)
            if i >= WARMUP_STEPS:
                total += time.thread_time_ns() - c0
            executor.collect(handle)
    finally:
        for name, fn in originals.items():
            if name in own:
                setattr(drv, name, fn)
            elif name in vars(drv):
                delattr(drv, name)
    parts = {k: v / num_steps / 1e3 for k, v in sorted(spent.items())}
    parts["the rest (metadata fill, Python)"] = total / num_steps / 1e3 - sum(parts.values())
    parts["total"] = total / num_steps / 1e3
    return parts


def time_prefill(executor, prompt_len: int, total_tokens: int, reps: int = 3) -> float:
    greedy = SamplingParams(temperature=0.0)
    n = max(1, total_tokens // prompt_len)
    per_seq = -(-prompt_len // BLOCK_SIZE)
    rng = np.random.default_rng(0)
    seqs = [SeqStep(i, list(rng.integers(0, executor.config.vocab_size, prompt_len)), 0,
                    list(range(i * per_seq, (i + 1) * per_seq)), True, greedy, 0, [], []) for i in range(n)]
    executor.step(seqs)                                              # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        executor.step(seqs)
        times.append(time.perf_counter() - t0)
    return n * prompt_len / statistics.median(times)


def step_launches(executor, batch: int, context: int) -> list:
    """The kernel launches of one eager decode step of `batch` sequences, in order, as launched:
    [(name, grid, block, smem, args)]."""
    dev, launches = executor.dev, []
    original = dev.launch

    def recording(name, grid, block, stream, smem=0, **args):
        launches.append((name, tuple(grid), block, smem, args))
        original(name, grid, block, stream, smem=smem, **args)
    per_seq = blocks_per_seq(context, 2)
    executor.graphs_enabled = False
    dev.launch = recording
    try:
        executor.step(decode_steps(batch, context, 0, executor.config.vocab_size, per_seq))
    finally:
        dev.launch = original
        executor.graphs_enabled = executor.options.use_graphs
    return launches


def launch_host_us(executor, batch: int, context: int, rounds: int = 5) -> dict:
    """Host microseconds per eager kernel launch (what prefill and sampled steps pay per kernel),
    by launch path: cuLaunchKernelEx from C (_launch.c) or through ctypes (NativeLaunch), and
    cuda-python's wrapper; the launches of one decode step replayed back to back, median of
    `rounds`. -> {path: us}"""
    drv, dev = executor.drv, executor.dev
    launches = step_launches(executor, batch, context)
    native, out = getattr(drv, "native_launch", None), {}
    try:
        which = "native C" if getattr(native, "c_launch", None) is not None else "native ctypes"
        for path, launcher in ((which, native), ("cuda-python", None)):
            if launcher is None and path != "cuda-python":
                continue
            drv.native_launch = launcher
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for name, grid, block, smem, args in launches:
                    dev.launch(name, grid, block, dev.compute_stream, smem=smem, **args)
                times.append((time.perf_counter() - t0) / len(launches))
                drv.stream_synchronize(dev.compute_stream)
            out[path] = statistics.median(times) * 1e6
    finally:
        drv.native_launch = native
    return out


def profile_kernels(executor, batch: int, context: int, repeats: int = 20, replays: int = 3) -> list:
    """Every distinct kernel launch of one decode step of `batch` sequences, timed alone: the launch
    captured `repeats` times into a CUDA graph and the graph replayed, so neither the host's launch
    gaps nor a neighbour count (events between the kernels of an eager step measure the host).
    Layers repeat: one row per distinct (kernel, grid, projection), with its launches per step.
    -> [(kernel, projection, grid, launches per step, us per launch, weight bytes per launch)]"""
    sizes, distinct = _weight_sizes(executor), {}
    for name, grid, block, smem, args in step_launches(executor, batch, context):
        wptr = args.get("qw") or args.get("w") or args.get("qweight") or 0
        proj = sizes.get(("name", wptr), "")
        key = (name, grid, block, smem, proj)
        if key in distinct:
            distinct[key][1] += 1
        else:
            distinct[key] = [(name, grid, block, smem, args, sizes.get(wptr, 0), proj), 1]
    return [(name, proj, grid, count, time_alone(executor, name, grid, block, smem, args, repeats, replays), nbytes)
            for (name, grid, block, smem, args, nbytes, proj), count in distinct.values()]


def time_alone(executor, name: str, grid: tuple, block: int, smem: int, args: dict, repeats: int = 20,
               replays: int = 3) -> float:
    """Microseconds of one kernel launch: captured `repeats` times into a CUDA graph, the graph
    replayed `replays` times after a warm-up."""
    drv, dev = executor.drv, executor.dev
    stream = dev.compute_stream

    def enqueue(s):
        for _ in range(repeats):
            dev.launch(name, grid, block, s, smem=smem, **args)
    start, end = drv.event_create(timing=True), drv.event_create(timing=True)
    graph = capture_graph(drv, stream, enqueue)
    try:
        drv.graph_launch(graph, stream)                                      # warm
        drv.event_record(start, stream)
        for _ in range(replays):
            drv.graph_launch(graph, stream)
        drv.event_record(end, stream)
        drv.event_synchronize(end)
        return drv.event_elapsed_ms(start, end) * 1e3 / (replays * repeats)
    finally:
        drv.graph_destroy(graph)
        drv.event_destroy(start)
        drv.event_destroy(end)


def probe_products(executor, context: int) -> list:
    """Each distinct INT4 product of a batch-1 decode step beside its weight-stream probes
    (kernels.py MM_PROBES: the same grid and weight loads, nothing computed), each timed alone: a
    probe near the copy roofline puts the product's shortfall in its arithmetic and barriers, a
    probe as slow as the product in the grid and load pipeline. -> [dict]"""
    sizes, seen, out = _weight_sizes(executor), set(), []
    for name, grid, block, smem, args in step_launches(executor, 1, context):
        family = MM_PRODUCTS[name].family if name in MM_PRODUCTS else None
        proj = sizes.get(("name", args.get("qw")), "")
        if family not in MM_PROBES or (grid, proj) in seen:
            continue
        seen.add((grid, proj))
        nbytes = sizes.get(args["qw"], 0)
        times = {name: time_alone(executor, name, grid, block, smem, args)}
        for probe in MM_PROBES[family]:                 # the plain product's parameters of the fused ones
            probe_args = {k: v for k, v in args.items() if k in SPECS[probe].name_set}
            times[probe] = time_alone(executor, probe, grid, block, smem, probe_args)
        out.append({"projection": proj, "grid": list(grid), "weight_bytes": nbytes, "us": times})
    return out


def print_probes(rows: list) -> None:
    print("   products at batch 1 beside their weight-stream probes (each alone; p: the loads only)")
    for r in rows:
        cells = "  ".join(f"{k} {us:7.2f} us {r['weight_bytes'] / (us / 1e6) / 1e12:5.2f} TB/s"
                          for k, us in r["us"].items())
        print(f"     {r['projection']:10} grid {'x'.join(map(str, r['grid'])):>10}  {cells}")


def _weight_sizes(executor) -> dict:
    w, sizes = executor.weights, {}
    for layer in w.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            sizes[lin.w] = linear_bytes(lin)
            sizes[("name", lin.w)] = lin.name.split(".")[-1]
    sizes[w.lm_head.w] = linear_bytes(w.lm_head)
    sizes[("name", w.lm_head.w)] = "lm_head"
    return sizes


def print_profile(rows: list, batch: int, step_ms: float) -> list:
    """The kernels of one decode step, slowest first; -> the rows as dicts (for --json)."""
    total_ms = sum(count * us for _, _, _, count, us, _ in rows) / 1e3
    print(f"   profile, decode step at batch {batch}, each kernel alone (captured 20x in a graph, replayed): "
          f"{total_ms:.3f} ms in kernels, the graph step {step_ms:.3f} ms "
          f"({step_ms - total_ms:+.3f} ms launch gaps, less PDL overlap)")
    out = []
    for name, proj, grid, count, us, nbytes in sorted(rows, key=lambda r: -r[3] * r[4]):
        key = f"{name} ({proj})" if proj else name
        bw = f"{nbytes / (us / 1e6) / 1e12:6.2f} TB/s" if nbytes else ""
        print(f"     {key:36} grid {'x'.join(map(str, grid)):>12} x{count:<4} {us:9.2f} us "
              f"{count * us / 1e3:8.3f} ms {100 * count * us / 1e3 / total_ms:5.1f}%  {bw}")
        out.append({"kernel": name, "projection": proj, "grid": list(grid), "launches_per_step": count,
                    "us_per_launch": us, "weight_bytes": nbytes})
    return out


# ------------------------------------------------------------------ one shape

def build_executor(shape: str, args, driver=None, image_fn=None):
    config = ModelConfig.from_dict(all_shapes()[shape])
    tensors = random_engine(config, args.group_size, args.embedding)
    batches = parse_batches(args.batch)
    per_seq = blocks_per_seq(args.context, args.steps)
    num_blocks = max(max(batches) * per_seq, -(-args.max_model_len // BLOCK_SIZE), args.prefill_tokens // BLOCK_SIZE + 64)
    # the timed prefill's sequences (of --prompt-len) fit too, however small the batches
    seqs = max(max(batches), max(1, args.prefill_tokens // min(args.prompt_len, args.prefill_tokens)))
    options = CudaOptions(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=seqs,
                          max_num_batched_tokens=args.prefill_tokens, max_model_len=args.max_model_len,
                          kv_dtype=args.kv_dtype, pdl=False if args.no_pdl else None, fused=not args.unfused,
                          matmul=args.matmul, activations=args.int4_activations, timing_events=True,
                          graph_batch_sizes=tuple(batches))
    kwargs = {"driver": driver} if driver is not None else {}
    if image_fn is not None:
        kwargs["image_fn"] = image_fn
    return config, CudaExecutor(config, tensors, options, **kwargs)


def run_shape(shape: str, args, drv, roofline: float, driver=None, image_fn=None) -> list:
    config, ex = build_executor(shape, args, driver or drv, image_fn)
    try:
        weights = weight_bytes_per_step(ex)
        c, dev = config, ex.dev
        print(f"\n== {shape}: {c.num_layers} layers, hidden {c.hidden_size}, intermediate {c.intermediate_size}, "
              f"heads {c.num_heads}/{c.num_kv_heads} x {c.head_dim}, vocab {c.vocab_size}; INT4 g{args.group_size}, "
              f"embedding/lm_head {args.embedding}, KV {args.kv_dtype}, matmul {ex.matmul} ({args.int4_activations} "
              f"activations), pdl {dev.pdl}, {'fused' if ex.options.fused else 'unfused'} kernels, "
              f"K split to {forward.MM_BLOCKS_PER_SM or 'the family'} blocks per SM"
              f"{' (one wave)' if forward.MM_ONE_WAVE else ''}"
              f"{f', product variant {forward.MM_VARIANT}' if forward.MM_VARIANT else ''}")
        print(f"   {dev.name}, {dev.arch}, {dev.num_sms} SMs; weights read per decode step {weights / 1e9:.3f} GB; "
              f"roofline (device-to-device copy, read+write) {roofline / 1e12:.2f} TB/s "
              f"= {weights / roofline * 1e3:.3f} ms per step")
        print(f"   {'batch':>5} {'decode tok/s':>13} {'step ms':>8} {'weights TB/s':>12} {'% roofline':>10} "
              f"{'host us/step':>12} {'host cpu us':>11} {'ring us gpu':>11} {'ring us host':>12} {'KV MB/step':>10}")
        prefill = time_prefill(ex, min(args.prompt_len, args.prefill_tokens), args.prefill_tokens)
        rows = []
        for batch in parse_batches(args.batch):
            t = time_decode(ex, batch, args.context, args.steps)
            kv = batch * (args.context + args.steps // 2) * 2 * c.num_layers * c.num_kv_heads * c.head_dim \
                * (4 if args.kv_dtype == "float32" else 2)
            row = {"shape": shape, "backend": "cuda", "batch": batch, "threads": None, "device": dev.name,
                   "decode_tokens_per_s": batch / t["step_s"], "decode_step_ms": t["step_s"] * 1e3,
                   "prefill_tokens_per_s": prefill, "weight_bytes_per_token": weights / batch,
                   "weight_bytes_per_step": weights, "read_bandwidth_bytes_per_s": roofline,
                   "achieved_bytes_per_s": weights / t["step_s"], "roofline_fraction": weights / roofline / t["step_s"],
                   "host_us_per_step": t["host_us"], "host_cpu_us_per_step": t["host_cpu_us"],
                   "ring_us_gpu": t["ring_gpu_us"], "ring_us_host": t["ring_host_us"],
                   "graph": t["graph"], "kv_bytes_per_step": kv, "context": args.context, "pdl": dev.pdl,
                   "fused": ex.options.fused,
                   "group_size": args.group_size, "embedding": args.embedding, "kv_dtype": args.kv_dtype,
                   "activations": args.int4_activations}
            print(f"   {batch:>5} {row['decode_tokens_per_s']:>13.1f} {row['decode_step_ms']:>8.3f} "
                  f"{row['achieved_bytes_per_s'] / 1e12:>12.2f} {100 * row['roofline_fraction']:>9.1f}% "
                  f"{row['host_us_per_step']:>12.1f} {row['host_cpu_us_per_step']:>11.1f} {row['ring_us_gpu']:>11.1f} "
                  f"{row['ring_us_host']:>12.1f} {kv / 1e6:>10.1f}")
            rows.append(row)
        print(f"   prefill: {prefill:.0f} tokens/s ({args.prefill_tokens} tokens per step, "
              f"sequences of {min(args.prompt_len, args.prefill_tokens)})")
        if args.profile:
            for row in (rows[0], rows[-1]) if len(rows) > 1 else rows:
                row["profile"] = print_profile(profile_kernels(ex, row["batch"], args.context), row["batch"],
                                               row["decode_step_ms"])
            rows[0]["launch_host_us"] = host = launch_host_us(ex, 1, args.context)
            print("   host time per eager launch: " + ", ".join(f"{k} {v:.1f} us" for k, v in host.items()))
            for row in (rows[0], rows[-1]) if len(rows) > 1 else rows:
                row["host_parts_us"] = parts = host_breakdown(ex, row["batch"], args.context, args.steps)
                print(f"   host CPU us per decode step's launch at batch {row['batch']}, by part: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        if getattr(args, "mm_probe", False):
            rows[0]["probes"] = probes = probe_products(ex, args.context)
            print_probes(probes)
        return rows
    finally:
        ex.close()


def parse_batches(text: str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) >= 1 for t in items):
        raise SystemExit(f"tokenwire bench engine: --batch must be positive integers, got {text!r}")
    return sorted({int(t) for t in items})


def run(args, driver=None, image_fn=None) -> int:
    """Entry point (also the hook bench/engine.py calls for --backend cuda)."""
    for name in ("context", "steps", "prompt_len", "prefill_tokens", "max_model_len", "mm_blocks_per_sm"):
        value = getattr(args, name, 1)
        if value is not None and value < 1:
            raise SystemExit(f"tokenwire bench engine: --{name.replace('_', '-')} must be >= 1")
    try:
        drv = driver if driver is not None else CudaDriver(0)
    except CudaUnavailable as exc:
        raise SystemExit(f"tokenwire bench engine --backend cuda: {exc}") from None
    free, _ = drv.mem_get_info()
    roofline = copy_bandwidth(drv, min(2 << 30, free // 8))
    rows, kept = [], (forward.MM_BLOCKS_PER_SM, forward.MM_VARIANT, forward.MM_ONE_WAVE)
    # the products' plan knobs are module constants read at executor build and every launch: set
    # for this run, restored after it
    forward.MM_BLOCKS_PER_SM = getattr(args, "mm_blocks_per_sm", None) or kept[0]
    forward.MM_VARIANT = getattr(args, "mm_variant", "") or ""
    forward.MM_ONE_WAVE = bool(getattr(args, "mm_one_wave", kept[2]))
    try:
        for shape in args.shape or ["llama-3.2-1b", "llama-3.1-8b"]:
            rows += run_shape(shape, args, drv, roofline, driver=drv, image_fn=image_fn)
    finally:
        forward.MM_BLOCKS_PER_SM, forward.MM_VARIANT, forward.MM_ONE_WAVE = kept
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"\nwrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenwire.bench.engine_cuda", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
