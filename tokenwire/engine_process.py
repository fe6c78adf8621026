"""The engine in its own process (`--engine-process`): the event loop and the engine each get
a GIL of their own.

Why: in one process the loop's work (intake, framing, writing) and the engine thread's
(schedule, batch, detokenize, stops) share one GIL, so a server streams at most about one
core's worth of host work per second, however short the executor's step (issue 27's
measurements: at 256 streams of the mock's 1 ms step, 86% of one core and 0.6 of the ideal
throughput on a 2-core machine, a core idle). Split, each half runs on its own core, as
vLLM's V1 engine core process does.

    front end (this process)                      engine process (tokenwire engine-process)
    net/ App ── EngineProcess ──── socketpair ───── EngineSide: EngineCore + its step driver
               submissions / cancel / priority / ACK ──>   (its engine thread steps, as in one process)
               <── STEP: StepTokens' columns and rows, each ended request's Timeline stamps,
                   the engine's stats now and then

Rules:
1. `EngineProcess` is the EngineCore surface net/ uses (add_request, add_choices, cancel,
   set_priority, wake, stats, is_alive, start, shutdown, eos_token_ids, detokenizer, driver),
   so net/ does not know which it serves. Submissions are checked here first, with the same
   checks (core/engine_core.check_prompt, the queue bound on requests not yet started, ids in
   use), and raise the same errors on the loop; submissions with `wake=False` travel together
   at the next `wake()`. `stats()` is the snapshot the last STEP carried (one is sent with
   every step that ended requests, else every STATS_EVERY_NS), no round trip.
2. Every message is one pickled tuple behind a 4-byte length (`Channel`). The engine process
   sends each step once it is made, at most `MAX_STEPS_AHEAD` before the front end has
   written them (ACKs return the credit): a slow loop makes batches bigger, as in one
   process. The loop reads the steps itself, no thread between the socket and the writer
   (net/writer/handoff.py, pull mode), and writes each as it is read.
3. A request's Timeline is stamped by the engine process's scheduler; the front end's copy
   gets those stamps with the request's last output (`TIMELINE_FIELDS`), before net/ reads them.
4. A grammar crosses as its `ConstraintSpec`: the engine process compiles it again (its own
   cache); the front end compiled it first, so a bad one is still the front end's 400.
5. The engine process ends when told (`STOP`: fail what is left, as `EngineCore.shutdown`) or
   when the front end goes away (end of file); it ignores SIGINT and SIGTERM, which a
   terminal or a service manager sends the whole group, so the front end drains first. If it dies, the front end fails every request
   in flight with finish reason "error" and `is_alive()` turns False (the server answers 503).
"""

import gc
import logging
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Optional

from .core.detokenizer import Detokenizer
from .core.engine_core import check_prompt
from .core.errors import InvalidRequest, QueueFull
from .core.options import EngineOptions
from .core.outputs import FINISH_ERROR, EngineStats, RequestOutput, StepTokens, Timeline
from .core.step_driver import StepHost
from .kernels import backend
from .runtime import BuiltEngine, build_card, build_warm_engine, context_length, load_backend_model, warm_up_grammars

log = logging.getLogger("tokenwire.engine_process")

MAX_STEPS_AHEAD = 4         # steps the engine process sends before the front end has taken the first
START_TIMEOUT_S = 600.0     # building and warming an engine (a checkpoint's build happens before, here)
STATS_EVERY_NS = 5_000_000  # a step's message carries the engine's stats when it ended requests, else this often
# message kinds (the first item of every message)
WAKE, CANCEL, PRIORITY, ACK, STOP = range(5)                # front end -> engine
ADD, CHOICES = range(10, 12)                                # a WAKE's submissions
READY, FAILED, STEP, REJECTED, BYE = range(100, 105)        # engine -> front end
# what the engine's scheduler stamps on a Timeline, sent with the request's last output
TIMELINE_FIELDS = ("queued_ns", "first_scheduled_ns", "step_done_ns", "finished_ns", "response_cached",
                   "mask_ns", "spec_proposed", "spec_accepted")
_HEADER = struct.Struct("<I")
READ_BYTES = 1 << 18
SOCKET_BUFFER_BYTES = 4 << 20


class Channel:
    """Length-prefixed pickles over a stream socket: `send` from any thread; `recv` (blocking)
    or `recv_ready` (what has arrived, never blocking) from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray()
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> Optional[tuple]:
        """-> the next message, waiting for it; None at end of file (the other side is gone)."""
        while True:
            message = self._next()
            if message is not None:
                return message
            try:
                data = self.sock.recv(READ_BYTES)
            except OSError:
                return None
            if not data:
                return None
            self._buffer += data

    def recv_ready(self) -> Optional[list]:
        """-> the messages that have arrived (maybe none), without waiting; None at end of file."""
        sock, buffer = self.sock, self._buffer
        while True:
            try:
                data = sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return None
            if not data:
                return None
            buffer += data
            if len(data) < READ_BYTES:
                break
        messages = []
        while (message := self._next()) is not None:
            messages.append(message)
        return messages

    def _next(self) -> Optional[tuple]:
        buffer = self._buffer
        if len(buffer) < _HEADER.size:
            return None
        size, = _HEADER.unpack_from(buffer)
        end = _HEADER.size + size
        if len(buffer) < end:
            return None
        message = pickle.loads(memoryview(buffer)[_HEADER.size:end])
        del buffer[:end]
        return message

    def drain(self, deadline: float) -> None:
        """Read and drop what arrives until end of file or `deadline` (time.monotonic())."""
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv(READ_BYTES):
                    return
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------- front end

def build_engine_process(options: EngineOptions) -> BuiltEngine:
    """What a server with `engine_process` loads: the model's card here (its tokenizer; the
    weights are mapped, not read), the engine, warmed up, in a child process."""
    row = backend(options.backend)
    model = load_backend_model(options, row)        # a checkpoint is built into the cache here, once
    max_model_len = context_length(options.max_model_len, model.config.max_position_embeddings)
    child_options = replace(options, engine_process=False,
                            model=str(model.path) if row.builtin_model is None else options.model)
    card = build_card(options, row, model, max_model_len, ())     # what fails here fails before a process starts
    if options.warm_up and card.grammars is not None:
        warm_up_grammars(card.grammars)             # this side's grammar engine compiles first (rule 4)
    engine = EngineProcess.spawn(child_options, model.tokenizer, model.eos_token_ids, max_model_len,
                                 model.config.vocab_size)
    return BuiltEngine(engine, card._replace(speculative_methods=engine.speculative_methods))


class _StepReader:
    """The driver net/ attaches to (`EngineProcess.driver`): the engine process's steps are
    read on the event loop (net/writer/handoff.py watches `steps_fd` and calls `pull`), with
    no thread between the socket and the writer."""

    def __init__(self, engine: "EngineProcess"):
        self.engine = engine
        self.host = StepHost(lambda step: None)
        self.steps_fd = engine.channel.sock.fileno()

    def attach(self, host: StepHost) -> None:
        self.host = host

    def pull(self) -> bool:
        """Loop: hand every step that arrived to the host, then ACK them (hot path: once per
        read). -> False once the engine process has gone (its requests failed); stop watching then."""
        engine = self.engine
        messages = engine.channel.recv_ready()
        if messages is None:
            engine.ended()
            self.host.deliver(engine.fail_in_flight())
            return False
        num_steps = 0
        for message in messages:
            step = engine.take(message)
            if step is not None:
                num_steps += 1
                try:
                    self.host.deliver(step)
                except Exception:       # as the step driver's deliver: the next steps and their credit go on
                    log.exception("writing an engine process's step raised; the engine goes on")
        if num_steps:
            engine.send((ACK, num_steps))
        return True


class EngineProcess:
    """The front end's handle on an engine process (rule 1). Built by `spawn`."""

    def __init__(self, channel: Channel, process: subprocess.Popen, tokenizer, eos_token_ids, max_model_len: int,
                 vocab_size: int, max_queued_requests: int, ready: tuple):
        self.channel = channel
        self.process = process
        self.detokenizer = Detokenizer(tokenizer)      # net/'s writer reads token texts from it
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_queued_requests = max_queued_requests
        _, self.speculative_methods, self._stats = ready
        self.driver = _StepReader(self)
        self._timelines = {}                # request id -> Timeline: submitted and not yet ended
        self._num_prompts = {}              # request id -> prompt tokens: for an error output if the process dies
        self._not_started = set()           # submitted, no output yet: the queue bound counts these
        self._pending = []                  # submissions that wait for `wake()` (rule 1)
        self._started = False
        self._dead = False

    @classmethod
    def spawn(cls, options: EngineOptions, tokenizer, eos_token_ids, max_model_len: int,
              vocab_size: int) -> "EngineProcess":
        """Start `tokenwire engine-process` on one end of a socketpair and wait until
        its engine is built and warmed up. Raises RuntimeError with the child's reason if it fails."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in (ours, theirs):     # room for MAX_STEPS_AHEAD large steps (logprobs) and a burst of prompts
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        # the command line's `engine-process`: also where a PyInstaller binary is its own Python
        command = [sys.executable] + ([] if getattr(sys, "frozen", False) else ["-m", "tokenwire"])
        process = subprocess.Popen(command + ["engine-process", str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        channel = Channel(ours)
        ours.settimeout(START_TIMEOUT_S)
        try:
            channel.send((options, logging.getLogger("tokenwire").getEffectiveLevel()))
            ready = channel.recv()
        except OSError:
            ready = None
        ours.settimeout(None)
        if ready is None or ready[0] != READY:
            process.kill()
            process.wait()
            channel.close()
            reason = (ready[1] if ready is not None and ready[0] == FAILED
                      else f"no answer within {START_TIMEOUT_S:.0f} s" if process.returncode == -signal.SIGKILL
                      else f"it exited with status {process.returncode}")
            raise RuntimeError(f"the engine process failed to start: {reason}")
        return cls(channel, process, tokenizer, eos_token_ids, max_model_len, vocab_size,
                   options.max_queued_requests, ready)

    # ------------------------------------------------------------ loop side

    def add_request(self, request_id: int, prompt_token_ids: list, params, timeline: Timeline,
                    priority: int = 0, wake: bool = True, constraint=None) -> None:
        """As EngineCore.add_request (rule 1)."""
        prompt = check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        self._book([request_id], [timeline], len(prompt))
        spec = constraint.spec if constraint is not None else None
        self._pending.append((ADD, request_id, prompt, params, _front_stamps(timeline), priority, spec))
        if wake:
            self.wake()

    def add_choices(self, request_ids, prompt_token_ids: list, params, timelines, priority: int = 0,
                    wake: bool = True) -> None:
        """As EngineCore.add_choices."""
        prompt = check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        self._book(list(request_ids), list(timelines), len(prompt))
        self._pending.append((CHOICES, list(request_ids), prompt, list(params),
                              [_front_stamps(t) for t in timelines], priority))
        if wake:
            self.wake()

    def _book(self, request_ids: list, timelines: list, num_prompt: int) -> None:
        num_queued = len(self._not_started)
        if num_queued + len(request_ids) > self.max_queued_requests:
            raise QueueFull(num_queued, self.max_queued_requests)
        for request_id in request_ids:
            if request_id in self._timelines:
                raise InvalidRequest(f"request id {request_id} is already in use")
        queued_ns = time.monotonic_ns()
        for request_id, timeline in zip(request_ids, timelines):
            timeline.queued_ns = queued_ns      # the engine process stamps its own; this until then
            self._timelines[request_id] = timeline
            self._num_prompts[request_id] = num_prompt
            self._not_started.add(request_id)

    def wake(self) -> None:
        """Send what was submitted since the last wake, in one message."""
        if self._pending:
            pending, self._pending = self._pending, []
            self.send((WAKE, pending))

    def cancel(self, request_id: int) -> None:
        if request_id in self._timelines:
            self.send((CANCEL, request_id))

    def set_priority(self, request_id: int, priority: int) -> None:
        self.send((PRIORITY, request_id, priority))

    def stats(self) -> EngineStats:
        """The engine process's EngineStats as of its last step that ended requests (or at
        most ~STATS_EVERY_NS older than its last step); `engine_alive` is this side's view."""
        return self._stats._replace(engine_alive=self.is_alive())

    def send(self, message: tuple) -> None:
        try:
            self.channel.send(message)
        except OSError:         # gone: the loop's read of its end of file fails what is in flight
            pass

    # ------------------------------------------------------------ loop side: steps (_StepReader)

    def take(self, message: tuple) -> Optional[StepTokens]:
        """One message from the engine process -> the step to write (None: nothing to write)."""
        kind = message[0]
        if kind == STEP:
            return self._step(message)
        if kind == REJECTED:
            return self._retire(StepTokens([self._error_output(rid, error) for rid, error in message[1]]), {})
        return None             # BYE: the end of file follows

    def _step(self, message: tuple) -> StepTokens:
        """A STEP message -> the StepTokens net/ writes (hot path: once per step)."""
        _, request_ids, token_ids, texts, rows, step_done_ns, step_times_ns, ended, stats = message
        step = StepTokens(rows, step_done_ns)
        step.request_ids, step.token_ids, step.texts = request_ids, token_ids, texts
        sink = self.driver.host.step_times_ns
        if sink is not None and step_times_ns:
            sink.extend(step_times_ns)
        if stats is not None:
            self._stats = stats
        not_started = self._not_started
        if not_started:
            not_started.difference_update(request_ids)
        return self._retire(step, ended)

    def _retire(self, step: StepTokens, ended: dict) -> StepTokens:
        """The books of the requests `step`'s rows end; their Timelines get the engine's stamps (rule 3)."""
        for out in step.rows:
            self._not_started.discard(out.request_id)
            if out.finish_reason is not None:
                timeline = self._timelines.pop(out.request_id, None)
                self._num_prompts.pop(out.request_id, None)
                stamps = ended.get(out.request_id)
                if timeline is not None and stamps is not None:
                    for name, value in zip(TIMELINE_FIELDS, stamps):
                        setattr(timeline, name, value)
        return step

    def fail_in_flight(self) -> StepTokens:
        """The process went away: every request in flight ends with an error."""
        if self._timelines:
            log.error("the engine process ended with %d requests in flight (exit status %s); failing them",
                      len(self._timelines), self.process.poll())
        error = "the engine process exited"
        return self._retire(StepTokens([self._error_output(rid, error) for rid in list(self._timelines)]), {})

    def _error_output(self, request_id: int, error: str) -> RequestOutput:
        return RequestOutput(request_id, (), "", None, FINISH_ERROR, self._num_prompts.get(request_id, 0), 0,
                             time.monotonic_ns(), error=error)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """The engine process steps from its READY on; this marks the server's start."""
        self._started = True

    def ended(self) -> None:
        self._dead = True

    def is_alive(self) -> bool:
        return self._started and not self._dead and self.process.poll() is None

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine process (after its current step; what is left fails) and wait for it,
        reading what it still sends (its last steps, BYE) so it never blocks on a full socket."""
        self.send((STOP, timeout))
        deadline = time.monotonic() + (timeout if timeout is not None else START_TIMEOUT_S)
        self.channel.drain(deadline)
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop within %s s; killing it", timeout)
            self.process.kill()
            self.process.wait()
        self._dead = True
        self.channel.close()


def _front_stamps(timeline: Timeline) -> tuple:
    """What the front end stamped before the engine saw the request."""
    return timeline.arrived_ns, timeline.tokenized_ns, timeline.grammar_compile_ns


# ---------------------------------------------------------------------- engine process

class EngineSide:
    """The engine process: an EngineCore stepping on its engine thread, as in one process,
    whose host sends the steps to the front end; this (main) thread takes the front end's messages."""

    def __init__(self, channel: Channel, built: BuiltEngine):
        self.channel = channel
        self.core = built.core
        self.grammars = built.card.grammars
        self.timelines = {}                 # request id -> Timeline, until its last output is sent
        self.credit = threading.Semaphore(MAX_STEPS_AHEAD)
        self.step_times_ns = deque()        # the driver appends each executor step's time
        self.closed = False                 # the front end is gone or stopping: send without waiting
        self.stats_sent_ns = 0
        self.core.driver.attach(StepHost(self.deliver, step_times_ns=self.step_times_ns, columns=True))

    def deliver(self, step: StepTokens) -> None:
        """Engine thread, once per step with outputs (hot path)."""
        ended = {}
        timelines = self.timelines
        for out in step.rows:
            if out.finish_reason is not None:
                timeline = timelines.pop(out.request_id, None)
                if timeline is not None:
                    ended[out.request_id] = tuple(getattr(timeline, name) for name in TIMELINE_FIELDS)
        step_times_ns = list(self.step_times_ns)    # appended on this thread only (the driver's step count)
        self.step_times_ns.clear()
        stats = None
        now_ns = time.monotonic_ns()
        if ended or now_ns - self.stats_sent_ns >= STATS_EVERY_NS:
            stats, self.stats_sent_ns = self.core.stats(), now_ns
        if not self.closed:
            self.credit.acquire()
        try:
            self.channel.send((STEP, step.request_ids, step.token_ids, step.texts, step.rows, step.step_done_ns,
                               step_times_ns, ended, stats))
        except OSError:
            self.closed = True

    def serve(self) -> None:
        """Take the front end's messages until STOP or its end of file, then stop the engine."""
        self.core.start()
        timeout = None
        while True:
            message = self.channel.recv()
            if message is None:
                break
            kind = message[0]
            if kind == WAKE:
                self.submit(message[1])
            elif kind == ACK:
                self.credit.release(message[1])
            elif kind == CANCEL:
                self.core.cancel(message[1])
            elif kind == PRIORITY:
                self.core.set_priority(message[1], message[2])
            elif kind == STOP:
                timeout = message[1]
                break
        self.closed = True
        self.credit.release(MAX_STEPS_AHEAD)        # a deliver waiting for an ACK goes on
        self.core.shutdown(timeout)
        self._reply((BYE,))

    def submit(self, submissions: list) -> None:
        """One WAKE's submissions, in order; one that the engine refuses is REJECTED (an error output)."""
        rejected = []
        for item in submissions:
            try:
                if item[0] == ADD:
                    self._add(*item[1:])
                else:
                    self._add_choices(*item[1:])
            except (QueueFull, InvalidRequest, ValueError) as exc:
                ids = item[1] if item[0] == CHOICES else [item[1]]
                rejected += [(rid, str(exc)) for rid in ids]
                for rid in ids:
                    self.timelines.pop(rid, None)
        if rejected:
            self._reply((REJECTED, rejected))
        self.core.wake()

    def _add(self, request_id, prompt, params, stamps, priority, spec) -> None:
        timeline = self._timeline(request_id, stamps)
        constraint = self.grammars.compile(spec).constraint() if spec is not None else None
        self.core.add_request(request_id, prompt, params, timeline, priority=priority, wake=False,
                              constraint=constraint)

    def _add_choices(self, request_ids, prompt, params, stamps, priority) -> None:
        timelines = [self._timeline(rid, s) for rid, s in zip(request_ids, stamps)]
        self.core.add_choices(request_ids, prompt, params, timelines, priority=priority, wake=False)

    def _timeline(self, request_id: int, stamps: tuple) -> Timeline:
        arrived_ns, tokenized_ns, grammar_compile_ns = stamps
        timeline = Timeline(arrived_ns=arrived_ns, tokenized_ns=tokenized_ns, grammar_compile_ns=grammar_compile_ns)
        self.timelines[request_id] = timeline
        return timeline

    def _reply(self, message: tuple) -> None:
        try:
            self.channel.send(message)
        except OSError:
            self.closed = True


def add_arguments(parser) -> None:
    parser.add_argument("fd", type=int, help="this end of the socketpair the front end made")


def run(args) -> int:
    """`tokenwire engine-process FD`: build the engine the front end's options name, say
    READY (or FAILED with the reason), serve until told to stop."""
    # a terminal's ^C, or a service manager's SIGTERM, reaches every process of the group: the
    # front end drains its streams first and then stops this one (STOP, or its end of file)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=args.fd))
    received = channel.recv()
    if received is None:
        return 1
    options, log_level = received
    logging.basicConfig(level=log_level, format="%(asctime)s engine-process %(name)s %(levelname)s %(message)s")
    try:
        built = build_warm_engine(options)
    except Exception as exc:            # the front end's load error: the server's 503 says it
        log.exception("the engine process could not build its engine")
        channel.send((FAILED, f"{type(exc).__name__}: {exc}"))
        return 1
    side = EngineSide(channel, built)
    gc.collect()
    gc.freeze()                         # what was loaded stays out of the collector's sight, as `serve` does
    channel.send((READY, built.card.speculative_methods, built.core.stats()))
    side.serve()
    return 0

