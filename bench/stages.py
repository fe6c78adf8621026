"""`tokenwire bench stages`: each stage of the request pipeline timed on its own, no network.

parse + validate -> chat template -> tokenize -> scheduler step -> engine prefill / decode
(per backend) -> sampling -> detokenize -> chunk encode (SSE / NDJSON / binary) -> HTTP/2
DATA frames through the session object -> loopback socket send -> engine-to-loop hand-off.
The stages are the real modules (bench/stage_fns.py); this file loads the model, times
them, prints a table (median, p99, per token where that applies) and writes JSON.

Timing: calls are batched so that one sample lasts at least `MIN_SAMPLE_NS` (the clock
costs ~50-100 ns a read); median and p99 are over samples, per call. For batched samples
the p99 is of a mean over the batch, which the "calls/sample" column shows.
"""

import argparse
import gc
import sys
import time
from typing import NamedTuple

import orjson

from ..core.errors import BuildError
from ..core.options import EngineOptions
from ..core.outputs import RequestOutput
from ..net.writer.encoders import CompletionSse
from ..runtime import build_engine, load_model
from .grammar_stages import GRAMMAR_STEP_BATCH, grammar_stages, step_overhead
from .proc import pin_to_core
from .stage_fns import BUILDERS, Setup
from .stats import fmt_us, percentile, table

MIN_SAMPLE_NS = 20_000
MIN_SAMPLES = 3
DEFAULT_BATCH = "1,64"
DEFAULT_ENGINE_BATCH = "1,8"


class StageResult(NamedTuple):
    name: str
    group: str
    num_samples: int
    calls_per_sample: int
    median_us: float
    p99_us: float
    min_us: float
    per_token_us: float         # median / tokens per call; NaN for per-request stages
    num_tokens: int
    note: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="engine directory, HF directory, hub name or llama2.c .bin (default: the embedded model)")
    parser.add_argument("--backends", default="reference,cpu",
                        help="engine backends to time, those available (default reference,cpu)")
    parser.add_argument("--samples", type=int, default=400, help="samples per stage (default 400)")
    parser.add_argument("--max-seconds", type=float, default=2.0,
                        help="time budget per stage; slow stages take fewer samples (at least 3; default 2)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens for tokenize/prefill (default 128)")
    parser.add_argument("--batch", default=DEFAULT_BATCH,
                        help=f"streams per step for scheduler, sampling and HTTP/2 stages (default {DEFAULT_BATCH})")
    parser.add_argument("--engine-batch", default=DEFAULT_ENGINE_BATCH,
                        help=f"sequences per engine decode step (default {DEFAULT_ENGINE_BATCH})")
    parser.add_argument("--core", type=int, default=None, help="pin this process to one CPU core")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")


def run(args) -> int:
    try:
        batch, engine_batch = _ints(args.batch, "--batch"), _ints(args.engine_batch, "--engine-batch")
        if args.samples < 1 or args.prompt_len < 1 or args.max_seconds <= 0:
            raise ValueError("--samples and --prompt-len must be >= 1, --max-seconds > 0")
        setup, skipped = build_setup(args.model, args.backends.split(","), args.prompt_len, batch, engine_batch)
    except ValueError as exc:
        print(f"tokenwire bench stages: {exc}", file=sys.stderr)
        return 2
    if args.core is not None and not pin_to_core(args.core):
        print(f"tokenwire bench stages: cannot pin to core {args.core}", file=sys.stderr)
        return 2
    results = []
    for builder in BUILDERS + (grammar_stages,):
        for stage in builder(setup):
            results.append(time_stage(stage, args.samples, args.max_seconds))
            print(f"  {stage.name}: median {_fmt(results[-1].median_us)}", file=sys.stderr, flush=True)
    print(format_table(results))
    overhead = step_overhead(setup)
    for o in overhead:
        print(f"constrained decoding [{o['backend']}] at batch {o['batch']}: step {o['constrained_ms']:.2f} ms vs "
              f"{o['unconstrained_ms']:.2f} ms unconstrained, median ratio {o['ratio']:.3f} "
              f"({o['pairs']} alternating pairs, same run)")
    for backend, why in skipped.items():
        print(f"backend {backend}: not timed ({why})")
    if args.json:
        write_json(args, setup, results, skipped, overhead)
    return 0


def _ints(text: str, flag: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. 1,64") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} values must be >= 1")
    return values


# ------------------------------------------------------------------ setup

def build_setup(model, backends, prompt_len: int, batch: tuple, engine_batch: tuple):
    """Load the engine, build one executor per available backend, make the prompt. -> (Setup, skipped)"""
    engine = load_engine_for(model)
    prompt_ids, prompt_text = make_prompt(engine, prompt_len)
    executors, skipped = {}, {}
    context = min(len(prompt_ids) + 2, engine.config.max_position_embeddings)
    for backend in [b.strip() for b in backends if b.strip()]:
        try:
            executor = make_executor(engine, backend, context, max(*engine_batch, GRAMMAR_STEP_BATCH))
        except (ValueError, RuntimeError, ImportError, OSError) as exc:
            skipped[backend] = str(exc)
            continue
        same = [b for b, e in executors.items() if forward_name(e) == forward_name(executor)]
        if same:
            skipped[backend] = f"it runs the same forward ({forward_name(executor)}) as {same[0]}"
            continue
        executors[f"{backend}: {forward_name(executor)}"] = executor
    payload = _sse_payload()
    return Setup(engine, executors, prompt_text, prompt_ids, batch, engine_batch, payload), skipped


def load_engine_for(model):
    """The engine directory the server would load for `model` (None: the embedded default)."""
    try:
        return load_model(model)
    except BuildError as exc:
        raise ValueError(str(exc)) from None


def make_prompt(engine, prompt_len: int) -> tuple:
    """(ids, text): a prompt of exactly `prompt_len` tokens (fewer if the model's context is shorter)."""
    prompt_len = min(prompt_len, engine.config.max_position_embeddings - 2)
    words = "the quick brown fox jumps over a lazy dog while the story goes on and on".split()
    text, ids = "", []
    i = 0
    while len(ids) < prompt_len:
        text += (" " if text else "") + words[i % len(words)]
        ids = engine.encode_prompt(text)
        i += 1
    ids = ids[:prompt_len]
    return ids, engine.tokenizer.decode(ids, skip_special_tokens=True)


def make_executor(engine, backend: str, context: int, max_batch: int):
    """One backend's Executor over `engine`, built the way `tokenwire serve` builds it
    (tokenwire/runtime.py), with KV room for `max_batch` contexts of `context` tokens."""
    options = EngineOptions(backend=backend, max_model_len=context, max_num_seqs=max_batch)
    return build_engine(options, model=engine).core.executor


def forward_name(executor) -> str:
    """The forward object behind an executor (ModelRunner.model), for labels."""
    model = getattr(executor, "model", None)
    return type(model if model is not None else executor).__name__


def _sse_payload() -> bytes:
    out = RequestOutput(7, [1234], " the", None, None, 16, 3, 0)
    return CompletionSse("cmpl-7", 1700000000, "model", False, lambda i: " the").token(out)


# ------------------------------------------------------------------ timing

def time_stage(stage, num_samples: int, max_seconds: float) -> StageResult:
    """Median/p99 of one stage's calls; see the module docstring for how calls are batched."""
    if stage.fn is None:
        return StageResult(stage.name, stage.group, 0, 0, float("nan"), float("nan"), float("nan"),
                           float("nan"), stage.num_tokens, stage.note)
    fn, clock = stage.fn, time.perf_counter_ns
    calls = _calibrate(fn)
    samples = []
    deadline = time.monotonic() + max_seconds
    gc_was_enabled = gc.isenabled()
    gc.disable()                                        # collections land in whichever stage runs them
    try:
        while len(samples) < num_samples and (len(samples) < MIN_SAMPLES or time.monotonic() < deadline):
            samples.append(_sample(fn, calls, clock))
    finally:
        if gc_was_enabled:
            gc.enable()
    per_call = sorted(ns / calls / 1000 for ns in samples)
    median = percentile(per_call, 50)
    per_token = median / stage.num_tokens if stage.num_tokens else float("nan")
    return StageResult(stage.name, stage.group, len(samples), calls, median, percentile(per_call, 99), per_call[0],
                       per_token, stage.num_tokens, stage.note)


def _sample(fn, calls: int, clock) -> int:
    t0 = clock()
    own = 0
    for _ in range(calls):
        r = fn()
        if type(r) is int:
            own += r
    return own if own else clock() - t0


def _calibrate(fn) -> int:
    """Calls per sample so that a sample lasts MIN_SAMPLE_NS (one warm-up call first)."""
    fn()
    t0 = time.perf_counter_ns()
    r = fn()
    one = r if type(r) is int else time.perf_counter_ns() - t0
    return max(1, min(10_000, MIN_SAMPLE_NS // max(one, 1)))


# ------------------------------------------------------------------ report

def _fmt(us: float) -> str:
    return fmt_us(us)


def format_table(results: list) -> str:
    rows = [[r.group, r.name, _fmt(r.median_us), _fmt(r.p99_us), _fmt(r.per_token_us),
             r.calls_per_sample or "-", r.note] for r in results]
    return table(["group", "stage", "median µs", "p99 µs", "per token µs", "calls/sample", "note"], rows,
                 left=(0, 1, 6))


def write_json(args, setup, results: list, skipped: dict, overhead: list = ()) -> None:
    doc = {"command": "stages", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "model": {"name": setup.engine.name, "path": str(setup.engine.path),
                     "architecture": setup.engine.config.architecture},
           "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
           "backends": sorted(setup.executors), "skipped_backends": skipped,
           "stages": [r._asdict() for r in results], "constrained_step_overhead": list(overhead)}
    with open(args.json, "wb") as f:
        f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.json}")
