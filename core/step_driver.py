"""The step driver: who runs the engine's steps, when, and on which thread. One per EngineCore.

Rules:
1. The driver's mode is the table `TRANSITIONS`; `_to` is the only way to change it, and a
   transition that is not in the table raises `IllegalTransition`.

       RUNNING ──> OVERLAPPING ──> RUNNING       the engine thread steps; a step in flight
          │ ^                                    while the last one is processed
          │ └──── SLEEPING <──┘ (no work)        waits on its doorbell; a submission rings it
          ├─────> LENT ──> RUNNING               the host's thread runs the (short) steps
          └─────> STOPPING                       (also from SLEEPING): fail what is left, end

   Modes another thread reads (SLEEPING, LENT) change under the lock the engine's inbox is
   kept under, so a submission either sees the thread asleep and wakes it, or is seen by it.
2. RUNNING: one step at a time, `EngineCore.step_or_fail()`, then `host.deliver(step)`.
3. OVERLAPPING (executors with `overlaps`, unless `--no-overlap`): the next step is launched
   before the last one's ids are processed, so the host's work (inbox, schedule, batch, then
   the last step's append, detokenize, stops, hand-off) runs while the executor works:

       executor  | step n ······| step n+1 ·····| step n+2 ···
       engine    | launch n+1, collect n, update n, deliver n | launch n+2, collect n+1, ...

   The token sampled at step n feeds step n+1 without the host reading it (SeqStep.num_pending;
   core/scheduler.py, "Overlapped steps"). A step goes back to RUNNING (the one in flight
   processed first) when a running request is `sync_only` (a grammar, penalties or
   proposals: its next row depends on the token just sampled), when nothing is left to
   launch, after an executor step of at most `inline_step_ns` (steps that short gain
   nothing from overlap; they count towards lending), or to stop.
4. LENT: after LEND_AFTER_SHORT_STEPS executor steps in a row of at most `inline_step_ns`,
   the thread lends its steps (`host.lend()`) and sleeps: a hand-off costs two context
   switches and four eventfd syscalls (~10-15 µs on a shared core), more than a zero-cost
   mock step or a tiny model's whole step. The host then calls `lent_step()` and, after
   writing its outputs, `keep_lent(wrote)`, which gives the steps back after one longer
   executor step. While lent, a submission calls `host.steps_wanted()` instead of ringing.
   Scheduler state is touched by one thread at a time; the host writes a step before it
   runs the next.
5. net/ hands the driver one `StepHost` when it attaches; the driver writes no host field and
   the host writes none of the driver's or the engine's.
"""

import enum
import logging
import threading
import time
from typing import Callable, NamedTuple, Optional

from .doorbell import Doorbell
from .errors import IllegalTransition
from .outputs import StepTokens

log = logging.getLogger("tokenwire.core.engine_core")
# consecutive executor steps of at most inline_step_ns before the engine thread lends its steps
# to the host: one short step (a prefill chunk of a fast model) does not move them
LEND_AFTER_SHORT_STEPS = 4


class Mode(enum.Enum):
    __hash__ = object.__hash__          # identity hash, in C (core/request.py says why)

    RUNNING = "running"
    OVERLAPPING = "overlapping"
    SLEEPING = "sleeping"
    LENT = "lent"
    STOPPING = "stopping"


M = Mode
TRANSITIONS = {
    M.RUNNING: frozenset({M.OVERLAPPING, M.SLEEPING, M.LENT, M.STOPPING}),
    M.OVERLAPPING: frozenset({M.RUNNING}),
    M.SLEEPING: frozenset({M.RUNNING, M.STOPPING}),
    M.LENT: frozenset({M.RUNNING}),
    M.STOPPING: frozenset(),
}
del M


class StepHost(NamedTuple):
    """What the one serving the steps (net/'s hand-off) gives the driver when it attaches."""
    # engine thread, once per step with outputs: hand the step over (may return once it is written)
    deliver: Callable[[StepTokens], None]
    # engine thread: from now on run the steps on your thread (lent_step / keep_lent); None: never lend
    lend: Optional[Callable[[], None]] = None
    steps_wanted: Optional[Callable[[], None]] = None   # host thread, while lent: work arrived
    step_times_ns: Optional[object] = None  # a deque: each executor step's duration (ns) is appended
    columns: bool = False                   # steps carry their common outputs as columns (StepTokens)


def _drop(step: StepTokens) -> None:
    """The host of an engine no one attached to: steps go nowhere."""


class StepDriver:
    def __init__(self, core, lock: threading.Lock, *, overlap: bool, inline_step_ns: int):
        self.core = core                    # core.engine_core.EngineCore
        self.overlap = overlap and core.executor.overlaps
        self.inline_step_ns = inline_step_ns    # executor steps at most this long may be lent (0: never)
        self.host = StepHost(_drop)
        self.mode = Mode.RUNNING
        self._lock = lock                   # the engine's inbox lock: rule 1
        self._doorbell = Doorbell()         # rung to wake the engine thread when it sleeps or is lent
        self._thread: Optional[threading.Thread] = None
        self._stop = False                  # set under _lock by stop()
        self._close_on_exit = False         # stop() came from the engine thread itself
        self._num_short_steps = 0           # consecutive executor steps of at most inline_step_ns

    def _to(self, mode: Mode) -> None:
        if mode not in TRANSITIONS[self.mode]:
            raise IllegalTransition(f"step driver: {self.mode.value} -> {mode.value} is not a legal transition")
        self.mode = mode

    def attach(self, host: StepHost) -> None:
        """Serve the steps to `host` from now on (before `start()`)."""
        if self._thread is not None:
            raise RuntimeError("attach the host before the engine thread starts")
        self.host = host

    @property
    def lent(self) -> bool:
        return self.mode is Mode.LENT

    # ------------------------------------------------------------------ any thread

    def wake_locked(self) -> Optional[Callable[[], None]]:
        """Work arrived (called with the engine's lock held). -> what to call once it is released
        for a step to run: the doorbell's ring (the thread sleeps), the host's steps_wanted
        (the steps are lent), or None (a step will come anyway)."""
        mode = self.mode
        if mode is Mode.SLEEPING:
            self._to(Mode.RUNNING)
            return self._doorbell.ring
        if mode is Mode.LENT:
            return self.host.steps_wanted
        return None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._thread = threading.Thread(target=self._run, name="tokenwire-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the thread (after its current step), fail what is left, close the executor."""
        with self._lock:
            self._stop = True
            if self.mode is Mode.LENT:      # the host's thread calls this: it runs no step any more
                self._to(Mode.RUNNING)
        self._doorbell.ring()
        if self._thread is threading.current_thread():
            self._close_on_exit = True      # called from deliver: the thread ends after this step
            return
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %s s; the executor stays open", timeout)
                return
        else:
            self.core.fail_everything("the engine shut down")
        self._close()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _close(self) -> None:
        self.core.executor.close()
        self._doorbell.close()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        idle = False
        while self._wait_for_work(idle):
            if self._num_short_steps >= LEND_AFTER_SHORT_STEPS and self.host.lend is not None:
                self._lend()
                idle = False
            elif self.overlap:
                idle = self._overlap_steps()
            else:
                idle = self._step()
        self._deliver(self.core.fail_everything("the engine shut down"))
        if self._close_on_exit:
            self._close()

    def _step(self) -> bool:
        """RUNNING: one step, delivered. -> whether it did nothing (the thread then waits 1 ms
        rather than spin: it should not happen, a lone request always fits)."""
        step = self.core.step_or_fail(self.host.columns)
        self._count_step()
        return not self._deliver(step) and not self.core.num_scheduled

    def _overlap_steps(self) -> bool:
        """OVERLAPPING (rule 3), from the first launch until a step must wait for the last one's
        ids. -> whether the first step did nothing."""
        core = self.core
        in_flight = self._begin()
        if in_flight.plan is None:          # nothing to launch: cancellations or replays only
            return not self._finish(in_flight) and not core.num_scheduled
        self._to(Mode.OVERLAPPING)
        while not self._stop and not self._num_short_steps and core.can_overlap():
            launched = self._begin()
            self._finish(in_flight, launched)
            in_flight = launched
            if launched.plan is None:       # nothing launched (or its launch failed)
                break
        self._finish(in_flight)
        self._to(Mode.RUNNING)
        return False

    def _begin(self):
        """Launch the next step (EngineCore.begin_step), a core bug failing every request."""
        try:
            return self.core.begin_step(self.host.columns)
        except Exception as e:
            return self.core.failed_step(self._bug(e))

    def _finish(self, in_flight, launched=None) -> bool:
        """Process a launched step and deliver it, with the outputs the start of `launched` made
        (cancellations, replays: their requests have no token in this step). -> whether it
        delivered anything."""
        try:
            step = self.core.finish_step(in_flight)
        except Exception as e:
            step = self.core.fail_everything(self._bug(e))
        if launched is not None and launched.step.rows:
            step.rows += launched.step.rows
            launched.step.rows.clear()
        self._count_step()
        return self._deliver(step)

    @staticmethod
    def _bug(e: Exception) -> str:
        log.exception("engine step raised; failing every request")
        return f"internal engine error: {type(e).__name__}: {e}"

    def _count_step(self) -> None:
        """The last executor step's time to the host's sink, and the short-step count (rule 4)."""
        step_ns = self.core.last_step_ns
        if not step_ns:
            return
        if self.host.step_times_ns is not None:
            self.host.step_times_ns.append(step_ns)
        self._num_short_steps = self._num_short_steps + 1 if step_ns <= self.inline_step_ns else 0

    def _deliver(self, step: StepTokens) -> bool:
        """Hand one step to the host (engine thread only: the host writes lent steps itself).
        -> whether it had outputs"""
        if not (step.rows or step.request_ids):     # no len(): a Python call, once per step
            return False
        try:
            self.host.deliver(step)
        except Exception:
            log.exception("the host's deliver raised; the engine goes on")
        return True

    def _wait_for_work(self, idle: bool) -> bool:
        """Block until there is something to do (SLEEPING meanwhile). -> False when stopping.
        `idle`: the last step did nothing: wait 1 ms first rather than spin."""
        if idle:
            self._doorbell.wait(0.001)
        while True:
            with self._lock:
                if self._stop:
                    self._to(Mode.STOPPING)
                    return False
                if self.core.has_work():
                    if self.mode is Mode.SLEEPING:
                        self._to(Mode.RUNNING)
                    return True
                if self.mode is Mode.RUNNING:
                    self._to(Mode.SLEEPING)     # a submission rings it now: once per sleep
            self._doorbell.wait()

    def _lend(self) -> None:
        """LENT (rule 4): sleep until the steps are given back (`keep_lent`) or stop."""
        with self._lock:
            if self._stop:
                return
            self._to(Mode.LENT)
        self.host.lend()
        while True:
            self._doorbell.wait()
            with self._lock:
                if self.mode is not Mode.LENT:
                    return

    # ------------------------------------------------------------------ host thread, while lent

    def lent_step(self) -> StepTokens:
        """One step on the host's thread (hot path: once per step)."""
        step = self.core.step_or_fail(self.host.columns)
        self._count_step()
        return step

    def keep_lent(self, wrote: bool) -> bool:
        """After a `lent_step()` and the writing of its outputs, if any (`wrote`) (hot path: once
        per step). -> whether the host should run another step now: True while work remains.
        False when none is left (a submission or a cancel asks again), and False after a step
        that gives the steps back to the engine thread: its executor step was longer than
        `inline_step_ns`, or it did nothing while work waits (the thread waits 1 ms after such
        a step rather than spin)."""
        core = self.core
        if core.num_scheduled:
            if self._num_short_steps:
                return core.has_work()
        elif wrote or not core.has_work():
            return core.has_work()          # cancellations or replayed answers only; or idle
        with self._lock:
            if self.mode is Mode.LENT:
                self._to(Mode.RUNNING)
        self._num_short_steps = 0           # the thread lends them again after as many short steps
        self._doorbell.ring()
        return False
