"""`tokenwire bench timeline`: an engine's steps one by one under a closed loop of requests,
and what the steps behind the slowest inter-token intervals held (issue 31).

    tokenwire bench timeline [--model SPEC] [--concurrency 1,8] [--requests N] [--max-tokens 64]

In process and without the network: the engine a server loads (runtime.build_warm_engine with
the server's defaults: the measured prefill cap, prefix caching, a warm-up), `EngineCore.step()`
driven on this thread, `concurrency` requests in flight, their first arrivals spread over one
request's steps (staggered, as users' are), each finished one replaced at once with the same
prompt, as `bench load` sends. Per step it records its wall time and the executor's part of it
(the rest is the host: scheduling, batch building, detokenizing, stop checks), the rows and
prompt tokens it carried, the CPU pool's thread count and how often the pool judged a step
contended (kernels/cpu/src/pool.c), and the garbage collector's pauses inside it.

A decode token's interval is the step that made it, from the end of the step before, so the
intervals are the steps' times as each running request sees them. Printed per level: step and
inter-token percentiles, then the intervals above the inter-token p99, each with its step,
and their causes counted: `prefill` (the step carried prompt tokens), `pool` (it ran on fewer
threads than the pool has), `gc` (a collection ran in it), `host` (the host part was over a
third of the step), else `executor` (the executor alone was slow: on a shared VM another
process, the hypervisor, memory). What `bench load` measures against `tokenwire serve` on the
same model beyond these is the network and the loop.
"""

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from typing import NamedTuple

from ..core.options import DEFAULTS
from ..core.outputs import Timeline
from ..core.sampling_params import SamplingParams
from ..kernels import cpu
from ..runtime import build_warm_engine
from .args import positive_int
from .stats import percentile

SLOW_HOST_FRACTION = 1 / 3      # a step whose host part is over this share of it is called `host`
MAX_LISTED = 12                 # intervals listed per level (the causes count them all)


class Step(NamedTuple):
    start_ns: int
    end_ns: int
    executor_ns: int
    rows: int
    prompt_tokens: int          # prompt tokens computed in the step (prefill chunks)
    threads: int                # the CPU pool's threads after the step (0: not the CPU backend)
    contended: int              # steps the pool judged contended during this one
    gc_ns: int                  # garbage-collector pauses inside the step

    @property
    def ns(self) -> int:
        return self.end_ns - self.start_ns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model spec as `tokenwire serve --model` takes (default: "
                                                      "the embedded default model)")
    parser.add_argument("--backend", default=DEFAULTS.backend)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels (default 1,8)")
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="measured requests per level (default: max(30, 4 x concurrency))")
    parser.add_argument("--prompt-len", type=positive_int, default=24, help="prompt length in words (default 24)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per response (default 64)")
    parser.add_argument("--prefill-cap", type=int, default=DEFAULTS.prefill_cap,
                        help="as `tokenwire serve --prefill-cap` (default -1: measured)")
    parser.add_argument("--json", default=None, help="write every step and the summaries to this file")


class Recorder:
    """Wraps the engine's executor to count each step's prompt tokens (its time is the engine's
    `last_step_ns`); the C pool's state and the collector's pauses are read around it."""

    def __init__(self, executor):
        self._executor = executor
        self.last_prompt_tokens = 0
        self.gc_ns = 0
        self._gc_start = 0
        gc.callbacks.append(self._on_gc)

    def __getattr__(self, name):
        return getattr(self._executor, name)

    def launch(self, seqs):
        self.last_prompt_tokens = sum(len(s.token_ids) for s in seqs if len(s.token_ids) > 1)
        return self._executor.launch(seqs)

    def _on_gc(self, phase, info) -> None:
        if phase == "start":
            self._gc_start = time.monotonic_ns()
        elif self._gc_start:
            self.gc_ns += time.monotonic_ns() - self._gc_start

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def run_level(core, prompt: list, concurrency: int, num_requests: int, max_tokens: int, on_cpu: bool) -> tuple:
    """Drive `core` until `num_requests` requests issued after the first `concurrency` finish;
    `on_cpu`: the CPU backend runs it, so the pool's thread count means something.
    -> (steps, token step indices per measured request)"""
    recorder = Recorder(core.executor)
    core.executor = recorder
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gap = max(1, max_tokens // concurrency)         # steps between the first arrivals: spread over one request's life
    steps, tokens, next_id, done = [], {}, 0, 0
    total = concurrency + num_requests
    try:
        while done < total:
            index = len(steps)
            while next_id < total and (next_id < concurrency and index >= next_id * gap or
                                       next_id >= concurrency and next_id - done < concurrency):
                core.add_request(next_id, prompt, params, Timeline(arrived_ns=time.monotonic_ns()))
                tokens[next_id] = []
                next_id += 1
            before = cpu.pool_state()
            gc_before = recorder.gc_ns
            recorder.last_prompt_tokens = 0
            start = time.monotonic_ns()
            outputs = core.step().rows
            end = time.monotonic_ns()
            after = cpu.pool_state()
            steps.append(Step(start, end, core.last_step_ns, core.num_scheduled, recorder.last_prompt_tokens,
                              after[0] if on_cpu else 0, after[1] - before[1], recorder.gc_ns - gc_before))
            for out in outputs:
                tokens[out.request_id].extend([index] * len(out.token_ids))
                if out.finish_reason is not None:
                    done += 1
    finally:
        core.executor = recorder._executor
        recorder.close()
    return steps, [tokens[i] for i in range(concurrency, total)]


def cause(step: Step, max_threads: int) -> str:
    if step.prompt_tokens:
        return "prefill"
    if step.gc_ns:
        return "gc"
    if max_threads and step.threads < max_threads:
        return "pool"
    if step.ns - step.executor_ns > SLOW_HOST_FRACTION * step.ns:
        return "host"
    return "executor"


def summarize(concurrency: int, steps: list, token_steps: list) -> dict:
    """The level's figures, and the intervals above the inter-token p99 with their steps."""
    intervals = []                  # (µs, step index) per decode token: from the step before to its own
    for indices in token_steps:
        for prev, cur in zip(indices, indices[1:]):
            if cur != prev:         # a speculated run's later tokens come in the same step
                intervals.append(((steps[cur].end_ns - steps[prev].end_ns) / 1000, cur))
    first, last = min(i[0] for i in token_steps), max(i[-1] for i in token_steps)
    window = steps[first:last + 1]
    itl = sorted(us for us, _ in intervals)
    p50, p99 = percentile(itl, 50), percentile(itl, 99)
    max_threads = max(s.threads for s in window)
    slow = sorted({i for us, i in intervals if us > p99})
    causes = {}
    for i in slow:
        causes[cause(steps[i], max_threads)] = causes.get(cause(steps[i], max_threads), 0) + 1
    step_us = sorted(s.ns / 1000 for s in window)
    decode_us = sorted(s.ns / 1000 for s in window if not s.prompt_tokens)
    return {"concurrency": concurrency, "num_steps": len(window), "itl_us_p50": p50, "itl_us_p99": p99,
            "itl_p99_over_p50": p99 / p50, "step_us_p50": percentile(step_us, 50),
            "decode_step_us_p50": percentile(decode_us, 50), "decode_step_us_p99": percentile(decode_us, 99),
            "executor_share": sum(s.executor_ns for s in window) / sum(s.ns for s in window),
            "prefill_steps": sum(1 for s in window if s.prompt_tokens),
            "gc_pauses_us": sum(s.gc_ns for s in window) / 1000, "pool_threads": max_threads,
            "steps_below_max_threads": sum(1 for s in window if s.threads < max_threads),
            "contended_judgments": sum(s.contended for s in window),
            "slow_steps": [dict(step=i, cause=cause(steps[i], max_threads), **step_fields(steps[i])) for i in slow],
            "causes": causes}


def step_fields(s: Step) -> dict:
    return {"us": s.ns / 1000, "executor_us": s.executor_ns / 1000, "host_us": (s.ns - s.executor_ns) / 1000,
            "rows": s.rows, "prompt_tokens": s.prompt_tokens, "threads": s.threads, "gc_us": s.gc_ns / 1000}


def report(row: dict) -> str:
    lines = [f"\n== concurrency {row['concurrency']}: {row['num_steps']} steps, inter-token p50 "
             f"{row['itl_us_p50']:,.0f} µs, p99 {row['itl_us_p99']:,.0f} µs = {row['itl_p99_over_p50']:.2f}x p50 "
             f"(decode steps p50 {row['decode_step_us_p50']:,.0f}, p99 {row['decode_step_us_p99']:,.0f} µs; "
             f"executor {row['executor_share']:.0%} of step time)",
             f"   prefill-carrying steps {row['prefill_steps']}, GC pauses {row['gc_pauses_us']:,.0f} µs in all, "
             f"steps on fewer than {row['pool_threads']} pool threads {row['steps_below_max_threads']}, "
             f"contended judgments {row['contended_judgments']}",
             f"   steps above the inter-token p99 by cause: "
             + (", ".join(f"{k} {v}" for k, v in sorted(row["causes"].items(), key=lambda kv: -kv[1])) or "none")]
    slow = sorted(row["slow_steps"], key=lambda s: -s["us"])[:MAX_LISTED]
    if slow:
        lines.append(f"   {'step':>6} {'µs':>8} {'executor':>9} {'host':>7} {'rows':>5} {'prompt':>7} "
                     f"{'threads':>8} {'gc µs':>6}  cause")
        lines += [f"   {s['step']:>6} {s['us']:>8,.0f} {s['executor_us']:>9,.0f} {s['host_us']:>7,.0f} {s['rows']:>5} "
                  f"{s['prompt_tokens']:>7} {s['threads']:>8} {s['gc_us']:>6,.0f}  {s['cause']}" for s in slow]
    return "\n".join(lines)


def run(args) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1:
            raise ValueError
    except ValueError:
        print("tokenwire bench timeline: --concurrency takes integers >= 1, e.g. 1,8", file=sys.stderr)
        return 2
    options = replace(DEFAULTS, model=args.model, backend=args.backend, prefill_cap=args.prefill_cap)
    built = build_warm_engine(options)
    core, card = built.core, built.card
    prompt = card.encode_prompt(" ".join(["a"] * args.prompt_len))
    print(f"tokenwire bench timeline: {card.name} on {args.backend}, {len(prompt)}-token prompt, "
          f"{args.max_tokens} tokens per response")
    rows, raw = [], []
    for concurrency in levels:
        num_requests = args.requests or max(30, 4 * concurrency)
        steps, token_steps = run_level(core, prompt, concurrency, num_requests, args.max_tokens,
                                       args.backend == "cpu")
        row = summarize(concurrency, steps, token_steps)
        rows.append(row)
        raw.append([s._asdict() for s in steps])
        print(report(row), flush=True)
    core.executor.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": card.name, "levels": rows, "steps": raw}, f)
    return 0
