"""`tokenwire bench engine`: decode and prefill tokens/s of a real architecture's shape,
against the memory-bandwidth roofline measured in the same run.

    tokenwire bench engine --shape qwen2.5-0.5b [--batch 1,4,16] [--threads N] [--json FILE]

What it does, per shape:
1. Builds a random-weight INT4 engine of that architecture's exact shape in memory (engine
   format of docs/ENGINE_FORMAT.md: random 4-bit codes, scales and zero points; group size
   64 as `tokenwire build`'s default; embedding and lm_head int4 unless --embedding says
   otherwise). Speed does not depend on the values, and nothing is downloaded.
2. For each batch size B (and --repeat times): measures the machine's read bandwidth with the
   backend's probe on the same threads — a streaming read (each thread its own contiguous
   slice, front to back, the kernels' loads and prefetch) of a fresh buffer of exactly the
   bytes one decode step reads, --probe-reps passes after a warm-up — right before timing one
   prefill step of B prompts of --prompt-len tokens (prefill tokens/s) and --steps decode
   steps of B tokens after one warm-up. A row reports the medians over its repeats, so the
   bandwidth and the step it is compared with come from the same minutes of a shared machine.
   Once per shape, a 1 GiB buffer (larger than any L3 this runs on) is probed for context.

The roofline: a decode step must read every weight once, so it cannot take less than
weight bytes / read bandwidth. `roofline_fraction` = that time / the measured step time,
with the bandwidth of the same-size buffer (what the step itself sees, cache effects
included, e.g. a model that partly fits a large L3). KV-cache reads are printed but not
credited: the fraction is the conservative one.

Backends plug in through BACKENDS: an object with `name`, `describe()`, `build(config,
tensors, block_size, num_blocks, activations)` -> forward object (`forward(ForwardBatch)`)
and `read_bandwidth(nbytes, reps)` -> seconds per pass.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


from ..kernels import cpu
from ..kernels.cpu.model import CpuModel
from . import engine_cuda, engine_trt, vs_llama
from .engine_cuda import add_cuda_arguments
from .forward_timing import BLOCK_SIZE, time_batch
from .shapes import all_shapes, random_engine, shape_config

LARGE_PROBE_BYTES = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", action="append", choices=sorted(all_shapes()),
                        help="architecture shape; repeat for several (default: qwen2.5-0.5b on cpu, "
                             "llama-3.2-1b and llama-3.1-8b on cuda)")
    parser.add_argument("--batch", help="comma-separated batch sizes (default: 1,4,16 on cpu, 1,8,32,128 on cuda)")
    parser.add_argument("--threads", type=int, help="kernel threads (default: physical cores)")
    parser.add_argument("--backend", default="cpu", choices=sorted(BACKENDS) + ["cuda", "trt"],
                        help="(default: %(default)s)")
    parser.add_argument("--activations", default="fp32,int8",
                        help="INT4 product activations, comma-separated: fp32 (exact), int8 (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="(default: %(default)s)")
    parser.add_argument("--embedding", default="int4", choices=("fp16", "int8", "int4"),
                        help="embedding and lm_head encoding (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, help="prefill tokens per sequence (default: 64 on cpu, 512 on cuda)")
    parser.add_argument("--steps", type=int, help="timed decode steps per batch size (default: 10 on cpu, 50 on cuda)")
    parser.add_argument("--probe-reps", type=int, default=5, help="timed bandwidth passes per probe (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per row; medians reported (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="also print where a decode step's time goes (cpu: thread 0 by stage; cuda: every kernel of one eager step)")
    parser.add_argument("--vs", choices=("llama.cpp",), default=None,
                        help="cpu: tokenwire against llama.cpp on one Q4_0 GGUF of the shape (default shape: "
                             "default): prefill and batch 1 / 16 decode tokens/s, alternating runs "
                             "(needs llama-cpp-python: the `llama` extra)")
    parser.add_argument("--contend", action="store_true",
                        help="cpu: decode tokens/s quiet vs with a busy loop pinned to one core, alternating in the same run")
    parser.add_argument("--no-adaptive-pool", action="store_true",
                        help="cpu: the pool keeps every thread even while a core is taken (the pre-issue-19 behaviour)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    add_cuda_arguments(parser)


# ------------------------------------------------------------------ backends

class CpuBackend:
    name = "cpu"

    def __init__(self, threads, adaptive=True):
        if not cpu.AVAILABLE:
            raise SystemExit(f"tokenwire bench engine: the C kernels are not built ({cpu.IMPORT_ERROR})")
        if threads is not None:
            cpu.set_num_threads(threads)
        cpu.set_adaptive(adaptive)
        self.adaptive = adaptive
        self.cpu = cpu
        self.threads = cpu.num_threads()

    def reset_pool(self) -> None:
        """Forget what the pool learnt about a taken core: the full thread count, no holds."""
        self.cpu.set_adaptive(self.adaptive)

    def describe(self) -> str:
        return f"backend cpu, {self.cpu.isa()} kernels, {self.threads} threads ({self.cpu.physical_cores()} physical cores)"

    def build(self, config, tensors, block_size, num_blocks, activations):
        return CpuModel(config, tensors, block_size, num_blocks, activations=activations)

    def read_bandwidth(self, nbytes: int, reps: int) -> list:
        return self.cpu.read_bandwidth(nbytes, reps)


BACKENDS = {"cpu": CpuBackend}


# ------------------------------------------------------------------ measuring

def bandwidth_samples(backend, nbytes: int, reps: int) -> list:
    """bytes/s of each of `reps` streaming-read passes over a fresh `nbytes` buffer."""
    return [nbytes / s for s in backend.read_bandwidth(nbytes, reps)]


def kv_bytes_per_step(config, batch: int, context: int) -> int:
    return batch * context * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4


# ------------------------------------------------------------------ reporting

def l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError):
        return 0


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def print_header(shape, config, args, backend, weight_bytes, bw_large):
    c = config
    print(f"\n== {shape}: {c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}, intermediate "
          f"{c.intermediate_size}, heads {c.num_heads}/{c.num_kv_heads} x {c.head_dim}, vocab {c.vocab_size}"
          f"{', tied' if c.tie_word_embeddings else ''}")
    print(f"   random-weight engine: INT4 group {args.group_size}, embedding/lm_head {args.embedding}; {backend.describe()}")
    print(f"   weights read per decode step: {mb(weight_bytes)} (every layer's products + lm_head)")
    l3 = l3_bytes()
    print(f"   read bandwidth: streaming read on {backend.threads} threads (the kernels' loads and prefetch), "
          f"{args.probe_reps} passes after a warm-up,")
    print(f"     of a {mb(weight_bytes)} buffer (= weights per step) just before each row's timing: the row's roofline")
    print(f"     of a {mb(LARGE_PROBE_BYTES)} buffer (> L3 {mb(l3) if l3 else 'unknown'}), for context: "
          f"{bw_large / 1e9:.2f} GB/s")
    print(f"   roofline step time = {mb(weight_bytes)} / read bandwidth; % roofline = roofline step / measured step "
          f"(medians of {args.repeat} repeats)")
    print(f"   {'act':5} {'batch':>5} {'decode tok/s':>13} {'step ms':>8} {'weights GB/s':>13} {'read GB/s':>10} "
          f"{'% roofline':>11} {'KV MB/step':>11} {'prefill tok/s':>14}")


def print_row(row):
    print(f"   {row['activations']:5} {row['batch']:>5} {row['decode_tokens_per_s']:>13.1f} {row['decode_step_ms']:>8.2f} "
          f"{row['weight_bytes_per_step'] / row['decode_step_ms'] / 1e6:>13.2f} "
          f"{row['read_bandwidth_bytes_per_s'] / 1e9:>10.2f} {100 * row['roofline_fraction']:>10.1f}% "
          f"{row['kv_bytes_per_step'] / 1e6:>11.1f} {row['prefill_tokens_per_s']:>14.1f}")


def measure_row(model, backend, config, batch: int, weight_bytes: int, args) -> dict:
    """--repeat times: a bandwidth probe, then the prefill and decode timing; medians."""
    bw, steps, prefill = [], [], []
    for _ in range(args.repeat):
        bw += bandwidth_samples(backend, weight_bytes, args.probe_reps)
        timing = time_batch(model, config, batch, args.prompt_len, args.steps, args.profile)
        steps.append(statistics.median(timing["step_s"]))
        prefill.append(timing["prefill_tokens_per_s"])
    return {"bandwidth": statistics.median(bw), "step_s": statistics.median(steps),
            "prefill_tokens_per_s": statistics.median(prefill)}


def print_profile(profile: dict) -> None:
    """Thread 0's decode-step time by stage (the last repeat's decode steps)."""
    steps, total = profile.pop("steps"), profile.pop("step_ns")
    parts = sorted(profile.items(), key=lambda kv: -kv[1])
    print("      profile: " + ", ".join(f"{name} {100 * ns / total:.1f}%" for name, ns in parts if ns)
          + f"  (step {total / steps / 1e6:.2f} ms in C)")


def run_shape(shape: str, args, backend, batches, precisions) -> list:
    config = shape_config(shape)
    tensors = random_engine(config, args.group_size, args.embedding)
    num_blocks = max(batches) * -(-(args.prompt_len + args.steps + 1) // BLOCK_SIZE)
    models = {p: backend.build(config, tensors, BLOCK_SIZE, num_blocks, p) for p in precisions}
    del tensors
    weight_bytes = next(iter(models.values())).weight_bytes_per_token
    bw_large = statistics.median(bandwidth_samples(backend, LARGE_PROBE_BYTES, args.probe_reps))
    print_header(shape, config, args, backend, weight_bytes, bw_large)
    rows = []
    for precision, model in models.items():
        for batch in batches:
            m = measure_row(model, backend, config, batch, weight_bytes, args)
            step = m["step_s"]
            row = {"shape": shape, "backend": backend.name, "activations": precision, "batch": batch,
                   "threads": backend.threads, "decode_tokens_per_s": batch / step, "decode_step_ms": step * 1e3,
                   "prefill_tokens_per_s": m["prefill_tokens_per_s"],
                   "weight_bytes_per_token": weight_bytes / batch, "weight_bytes_per_step": weight_bytes,
                   "read_bandwidth_bytes_per_s": m["bandwidth"], "read_bandwidth_large_bytes_per_s": bw_large,
                   "roofline_fraction": weight_bytes / m["bandwidth"] / step,
                   "kv_bytes_per_step": kv_bytes_per_step(config, batch, args.prompt_len + args.steps // 2),
                   "group_size": args.group_size, "embedding": args.embedding, "prompt_len": args.prompt_len,
                   "decode_steps": args.steps, "repeat": args.repeat}
            print_row(row)
            if args.profile:
                print_profile(model.profile(reset=True))
            rows.append(row)
        base = next(r for r in rows if r["activations"] == precision and r["batch"] == min(batches))
        for r in rows:
            if r["activations"] == precision and r["batch"] != base["batch"]:
                print(f"   {precision}: batch {r['batch']} decodes {r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.1f}x "
                      f"the tokens/s of batch {base['batch']}")
    return rows


# ------------------------------------------------------------------ --contend

class BusyLoop:
    """A process spinning on one CPU (the last one this process may run on), started once and
    paused / resumed with SIGSTOP / SIGCONT, so quiet and contended timings can alternate."""

    def __init__(self):
        self.cpu = max(os.sched_getaffinity(0))
        code = (f"import os\nos.sched_setaffinity(0, {{{self.cpu}}})\nparent = os.getppid()\n"
                "while os.getppid() == parent:\n    for _ in range(100000): pass\n")   # never outlives the bench
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        self.pause()

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)                    # it is running (and pinned) before the timing starts

    def close(self):
        self.proc.kill()
        self.proc.wait()


def run_contend_shape(shape: str, args, backend, batches, precisions) -> list:
    """Decode tokens/s quiet and with a busy loop on one core: --repeat pairs, alternating
    (quiet, contended, quiet, ...); the ratio of the medians, and the range of the pairs' ratios."""
    config = shape_config(shape)
    tensors = random_engine(config, args.group_size, args.embedding)
    num_blocks = max(batches) * -(-(args.prompt_len + args.steps + 1) // BLOCK_SIZE)
    models = {p: backend.build(config, tensors, BLOCK_SIZE, num_blocks, p) for p in precisions}
    del tensors
    print(f"\n== {shape}: decode tokens/s quiet vs contended; {backend.describe()}")
    busy = BusyLoop()
    print(f"   contended: a busy loop (another process) pinned to CPU {busy.cpu} while the step runs; "
          f"{args.repeat} alternating pairs of {args.steps} decode steps, medians (range)")
    print(f"   {'act':5} {'batch':>5} {'quiet tok/s':>22} {'contended tok/s':>22} {'ratio':>19}")
    rows = []
    try:
        for precision, model in models.items():
            for batch in batches:
                quiet, loaded = [], []
                for _ in range(args.repeat):
                    # a quiet run starts from a fresh pool: one still holding a lowered thread count
                    # from the contended run before would understate the quiet figure (and the
                    # contended run then meets a full pool, as a newly taken core does)
                    backend.reset_pool()
                    quiet.append(batch / statistics.median(
                        time_batch(model, config, batch, args.prompt_len, args.steps)["step_s"]))
                    busy.resume()
                    try:
                        loaded.append(batch / statistics.median(
                            time_batch(model, config, batch, args.prompt_len, args.steps)["step_s"]))
                    finally:
                        busy.pause()
                ratios = [c / q for q, c in zip(quiet, loaded)]
                demotions = backend.cpu.pool_state()[1]
                row = {"shape": shape, "backend": backend.name, "activations": precision, "batch": batch,
                       "threads": backend.threads, "quiet_tokens_per_s": quiet, "contended_tokens_per_s": loaded,
                       "ratio": statistics.median(loaded) / statistics.median(quiet), "busy_cpu": busy.cpu,
                       "pool_demotions_so_far": demotions}
                print(f"   {precision:5} {batch:>5} {statistics.median(quiet):>9.1f} ({min(quiet):.0f}-{max(quiet):.0f})"
                      f" {statistics.median(loaded):>9.1f} ({min(loaded):.0f}-{max(loaded):.0f})"
                      f" {row['ratio']:>8.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                      f"   pool: {demotions} contended tasks so far")
                rows.append(row)
    finally:
        busy.close()
    return rows


def parse_list(text: str, what: str, allowed=None) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise SystemExit(f"tokenwire bench engine: {what} must be from {allowed}, got {text!r}")
        return items
    if not items or not all(t.isdigit() and int(t) >= 1 for t in items):
        raise SystemExit(f"tokenwire bench engine: {what} must be positive integers, got {text!r}")
    return sorted({int(t) for t in items})


def _fill_defaults(args, **defaults) -> None:
    """Options whose default depends on the backend."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args) -> int:
    if args.backend == "cuda":
        _fill_defaults(args, batch="1,8,32,128", prompt_len=512, steps=50)
        return engine_cuda.run(args)
    if args.backend == "trt":
        _fill_defaults(args, batch="1,8,32", prompt_len=512, steps=50)
        return engine_trt.run(args)
    if args.vs:
        _fill_defaults(args, prompt_len=128, steps=20)
        return vs_llama.run(args)
    _fill_defaults(args, batch="1,4,16", prompt_len=64, steps=10)
    batches = parse_list(args.batch, "--batch")
    precisions = parse_list(args.activations, "--activations", ("fp32", "int8"))
    if args.threads is not None and args.threads < 1:
        raise SystemExit("tokenwire bench engine: --threads must be >= 1")
    if min(args.prompt_len, args.steps, args.probe_reps, args.repeat) < 1:
        raise SystemExit("tokenwire bench engine: --prompt-len, --steps, --probe-reps and --repeat must be >= 1")
    backend = BACKENDS[args.backend](args.threads, not args.no_adaptive_pool)
    rows = []
    if args.contend and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("tokenwire bench engine: --contend needs at least 2 CPUs (one is taken by the busy loop)")
    for shape in args.shape or ["qwen2.5-0.5b"]:
        rows += (run_contend_shape if args.contend else run_shape)(shape, args, backend, batches, precisions)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"\nwrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0
