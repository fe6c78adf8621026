"""`tokenwire bench hostcpu`: the server's host CPU per streamed token over whole requests.

What issue 27's overlap runs into once the step is hidden: the loop and the engine thread
share one GIL, so the server streams at most about one core's worth of host work per second.
This counts that work in one process, on one thread, without sockets or thread hand-offs,
so it can be compared from one commit to the next without a load client on the machine:

- C streams in a closed loop on one HTTP/2 connection, each a streamed /v1/completions of
  `--max-tokens` tokens with a 16-word prompt; the first C start `ceil(C / max_tokens)` a
  step apart, so requests end and arrive a few per step, as the staggered load client has it;
- intake: the request's bytes through `H2Session.receive_data` and `App.on_events` (route,
  parse, tokenize, the engine's Request, the writer's Exchange), as the loop takes them in;
- begin / finish: `EngineCore.begin_step` (inbox, schedule, launch) and `finish_step`
  (collect, append, detokenize, stops, free) over the zero-cost mock, overlapped as the step
  driver runs them (the next step begun before the last one is finished);
- write: `Dispatcher.write_step` of every step into the session, and each connection's flush
  (the session's bytes taken; no socket).
Everything built before the loop is frozen out of the garbage collector's sight first, as
`tokenwire serve` freezes what it loaded.

Printed per concurrency: thread CPU µs per token (the least and the median over `--rounds`;
the least is the one to compare on a shared machine), per request, and by part.

`--callgrind` runs one round under valgrind's callgrind instead and prints the instructions
the timed loop executed, per token and per request: a count that does not move with the
machine's load (within ~0.3% from run to run, with string hashing fixed; the clock still
moves the request seeds and the measured prefill cap), for comparing two versions of the
code: run it at each (what they import changes the garbage collector's work too). The loop
runs inside `operator.call`, and callgrind counts only inside `_operator_call`, so start-up
and the workload's construction are left out. Needs valgrind (Debian: `apt install valgrind`).
"""

import argparse
import asyncio
import gc
import json
import math
import operator
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import h2.config
import h2.connection
import h2.settings
import orjson

from ..core.options import EngineOptions
from ..net.api.model_info import model_info
from ..net.app import App
from ..net.metrics import Metrics
from ..net.protocol.events import Limits
from ..net.protocol.http2 import H2Session
from ..runtime import build_engine
from .stage_fns import SocketlessConnection

PARTS = ("intake", "begin", "finish", "write")
PROMPT = " ".join(f"word{i % 7}" for i in range(16))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1,64,256", help="comma-separated streams in flight (default 1,64,256)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per level (default: max(200, 12 x concurrency))")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per response (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per level; the least CPU is reported (default 5)")
    parser.add_argument("--callgrind", action="store_true",
                        help="count the timed loop's instructions under valgrind's callgrind (one round)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)    # the run under callgrind


def run(args) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1 or args.max_tokens < 1 or args.rounds < 1:
            raise ValueError("--concurrency, --max-tokens and --rounds must be >= 1")
        if args.requests is not None and args.requests < 1:
            raise ValueError("--requests must be >= 1")
        if args.callgrind and not args.inner and shutil.which("valgrind") is None:
            raise ValueError("--callgrind needs valgrind on the PATH (Debian: apt install valgrind)")
    except ValueError as exc:
        print(f"tokenwire bench hostcpu: {exc}", file=sys.stderr)
        return 2
    results = []
    for c in levels:
        num_requests = args.requests or max(200, 12 * c)
        if args.inner:
            total, num_tokens, num_steps, parts = measure(c, num_requests, args.max_tokens, operator.call)
            print(json.dumps({"tokens": num_tokens, "steps": num_steps}))
            return 0
        if args.callgrind:
            results.append(count_instructions(c, num_requests, args.max_tokens))
        else:
            results.append(time_rounds(c, num_requests, args.max_tokens, args.rounds))
        print(format_row(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def time_rounds(concurrency: int, num_requests: int, max_tokens: int, rounds: int) -> dict:
    runs = [measure(concurrency, num_requests, max_tokens) for _ in range(rounds)]
    per_token = [total / num_tokens / 1e3 for total, num_tokens, _, _ in runs]
    total, num_tokens, num_steps, parts = runs[per_token.index(min(per_token))]
    return {"concurrency": concurrency, "requests": num_requests, "max_tokens": max_tokens, "steps": num_steps,
            "us_per_token_min": min(per_token), "us_per_token_median": statistics.median(per_token),
            "us_per_request": total / num_requests / 1e3,
            "parts_us_per_token": {k: v / num_tokens / 1e3 for k, v in parts.items()}}


def count_instructions(concurrency: int, num_requests: int, max_tokens: int) -> dict:
    """One round of `measure` under callgrind, counting inside `operator.call` only."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--toggle-collect=_operator_call", f"--callgrind-out-file={out_file}",
               sys.executable, "-m", "tokenwire", "bench", "hostcpu", "--inner", "--concurrency", str(concurrency),
               "--requests", str(num_requests), "--max-tokens", str(max_tokens)]
        # a fixed string hash: dict and set layouts, and so the count, the same from run to run
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        if done.returncode != 0:
            raise RuntimeError(f"callgrind run failed ({done.returncode}): {done.stderr[-2000:]}")
        inner = json.loads(done.stdout.strip().splitlines()[-1])
        with open(out_file) as f:
            totals = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
    if totals is None:
        raise RuntimeError("callgrind wrote no instruction total")
    instructions = int(totals.group(1))
    return {"concurrency": concurrency, "requests": num_requests, "max_tokens": max_tokens, "steps": inner["steps"],
            "instructions_per_token": instructions / inner["tokens"],
            "instructions_per_request": instructions / num_requests}


def format_row(r: dict) -> str:
    head = f"concurrency {r['concurrency']}: {r['requests']} requests x {r['max_tokens']} tokens in {r['steps']} steps"
    if "instructions_per_token" in r:
        return (f"{head}: {r['instructions_per_token']:,.0f} instructions per token, "
                f"{r['instructions_per_request']:,.0f} per request (callgrind, the timed loop only)")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_us_per_token"].items())
    return (f"{head}: host CPU {r['us_per_token_min']:.2f} µs per token (least of the rounds; median "
            f"{r['us_per_token_median']:.2f}), {r['us_per_request']:.0f} µs per request; by part, µs per token: {parts}")


def measure(concurrency: int, num_requests: int, max_tokens: int, call=None) -> tuple:
    """Build a server in this process and run the workload (module docstring) through it.
    `call`: runs the timed loop (operator.call under callgrind). -> (thread CPU ns, tokens,
    steps, {part: thread CPU ns})"""
    built = build_engine(EngineOptions(backend="mock", max_queued_requests=num_requests,
                                       max_num_seqs=max(concurrency, 8)))
    core = built.core
    core.is_alive = lambda: True        # the routes ask it; no engine thread runs: this one steps
    app = App(metrics=Metrics())
    info = model_info(built.card)
    app.attach(core, info, asyncio.new_event_loop())
    body = orjson.dumps({"model": info.name, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                         "ignore_eos": True})
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "bench"), (":path", "/v1/completions"),
               ("content-type", "application/json"), ("content-length", str(len(body)))]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.increment_flow_control_window(2**31 - 1 - 65535)
    preface = client.data_to_send()
    requests = []                       # each request's bytes, made up front: the client is not timed
    for i in range(num_requests):
        client.send_headers(2 * i + 1, headers)
        client.outbound_flow_control_window = 2**31 - 1     # the server opens it as it reads, in order
        client.send_data(2 * i + 1, body, end_stream=True)
        requests.append(client.data_to_send())
    session = H2Session(Limits(max_concurrent_streams=concurrency + 8))
    conn = SocketlessConnection(session)
    session.receive_data(preface)
    session.data_to_send()
    loop = _Workload(core, app, conn, requests, concurrency, max_tokens)
    gc.collect()
    gc.freeze()             # as `tokenwire serve` does once the model is loaded (net/server.py)
    try:
        total = (call or operator.call)(loop.run)
    finally:
        gc.unfreeze()       # the next round's build is collected as usual
    return total, loop.num_tokens, loop.num_steps, loop.parts


class _Workload:
    """The closed loop of the module docstring, timed by part with the thread's CPU clock."""

    def __init__(self, core, app, conn, requests: list, concurrency: int, max_tokens: int):
        self.core, self.app, self.conn, self.requests = core, app, conn, requests
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.parts = dict.fromkeys(PARTS, 0)
        self.num_sent = self.num_tokens = self.num_steps = 0

    def intake(self, n: int) -> None:
        t = time.thread_time_ns()
        session, on_events = self.conn.session, self.app.on_events
        for _ in range(min(n, len(self.requests) - self.num_sent)):
            on_events(self.conn, session.receive_data(self.requests[self.num_sent]))
            self.num_sent += 1
        self.parts["intake"] += time.thread_time_ns() - t

    def run(self) -> int:
        """-> thread CPU ns of the whole loop"""
        clock, parts, core, write_step = time.thread_time_ns, self.parts, self.core, self.app.dispatcher.write_step
        exchanges = self.app.dispatcher.exchanges
        ramp = math.ceil(self.concurrency / self.max_tokens)
        start = clock()
        self.intake(1)
        t = clock()
        in_flight = core.begin_step(True)
        parts["begin"] += clock() - t
        num_done = 0
        while num_done < len(self.requests):
            t = clock()
            launched = core.begin_step(True)
            t1 = clock()
            step = core.finish_step(in_flight)
            step.rows += launched.step.rows         # as the step driver hands over a launch's own outputs
            launched.step.rows.clear()
            t2 = clock()
            # counted before the writer, which moves the columns it leaves into the rows
            ended = sum(1 for out in step.rows if out.finish_reason is not None)
            self.num_tokens += len(step.request_ids) + sum(len(out.token_ids) for out in step.rows)
            t3 = clock()
            write_step(step)
            parts["begin"] += t1 - t
            parts["finish"] += t2 - t1
            parts["write"] += clock() - t3
            in_flight = launched
            self.num_steps += 1
            num_done += ended
            room = self.concurrency - len(exchanges)
            self.intake(min(room, ramp if self.num_sent < self.concurrency else ended))
            if in_flight.plan is None and not exchanges and self.num_sent == len(self.requests):
                break
        if num_done != len(self.requests) or self.num_tokens != len(self.requests) * self.max_tokens:
            raise RuntimeError(f"hostcpu: {num_done} of {len(self.requests)} requests ended with "
                               f"{self.num_tokens} tokens; expected {len(self.requests) * self.max_tokens}")
        return clock() - start
