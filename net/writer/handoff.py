"""The engine -> loop hand-off: one step at a time, two doorbells; or steps run on the loop.

An engine in another process (tokenwire/engine_process.py) has no thread here: its driver
has a `steps_fd`, the loop watches it and `driver.pull()` hands each step that arrived to
the writer; `write_pending()` pulls too.

The engine thread calls `on_step_threadsafe(step)` once per step (StepHost.deliver): it
queues the step, rings a doorbell the loop watches (an eventfd; core/doorbell.py) and waits
on a second one until the loop has written the step, so the engine runs at most one step
ahead of the wire: a slow loop makes batches bigger instead of letting steps pile up. Both
rings release the GIL: on a shared core the woken thread runs at once instead of bouncing
off the GIL, two context switches per step instead of ~five.

Overlapped steps (core/step_driver.py rule 3): the engine waits for the last step's write
instead, just before it hands over the next, so the loop writes step n while the engine
collects and processes step n + 1, which the executor ran meanwhile: the wire, the host and
the executor each work on a different step. Still one step at most waits for the loop, and
a slow loop still makes batches bigger.

On the loop, `write_pending()` hands each queued step to the writer (net/writer/dispatch.py) and
`release_engine()` lets the engine thread go on. The app writes pending steps before a
read's new requests and releases the engine after them, so the engine's next step takes
those requests (App.on_events).

Inline steps: this is the host the engine's step driver lends its steps to
(core/step_driver.py, rule 4). When the executor's steps are shorter than the hand-off itself
(the zero-cost mock, a tiny model), the engine thread lends its steps:
`take_steps_threadsafe()`, then each step is one loop callback, `_step_inline`, that runs
`StepDriver.lent_step()`, writes its outputs and asks for the next one while work remains
(`StepDriver.keep_lent`); steps follow each other
in one callback for at most `inline_step_ns`, then reads and resets are handled before the
next; a step is written before the next one runs. No doorbell, no thread switch: a lone
stream's token costs its step and its frames. A longer executor step gives the steps back
to the engine thread.
"""

import time
from collections import deque
from typing import Callable

from ...core.doorbell import Doorbell
from ...core.step_driver import StepHost


class StepHandoff:
    def __init__(self, loop, write_step: Callable[[object], None], driver=None, step_times_ns: deque = None):
        """`driver`: the engine's core.step_driver.StepDriver, attached to here (None: steps are
        handed over by hand, as tests do); `step_times_ns`: where it appends each step's time."""
        self.loop = loop
        self.driver = driver
        self._write_step = write_step       # called on the loop with each step (a core.outputs.StepTokens)
        self._steps = deque()               # steps handed over by the engine thread, oldest first
        self._step_ready = Doorbell()       # the engine rang, a step waits (watched by the loop)
        self._step_taken = Doorbell()       # the loop wrote the step, the engine may go on
        self._engine_waits = False          # a step was taken from _steps and the engine waits for its ring
        # engine thread: it hands a step over and waits for the last one's write (overlapped steps),
        # and a step it handed over has not been waited for
        # an engine in another process (tokenwire/engine_process.py): the loop reads its steps
        # from the driver's socket and writes each as it is read, no thread in between
        self._pulled_fd = getattr(driver, "steps_fd", None)
        self._write_behind = driver is not None and self._pulled_fd is None and driver.overlap
        self._owed = False
        self._inline_scheduled = False      # an `_step_inline` callback is queued on the loop
        self.detached = False
        if self._pulled_fd is not None:
            loop.add_reader(self._pulled_fd, self._on_pulled)
            driver.attach(StepHost(write_step, step_times_ns=step_times_ns, columns=True))
            return
        loop.add_reader(self._step_ready.fileno(), self._on_ready)
        if driver is not None:
            driver.attach(StepHost(self.on_step_threadsafe, self.take_steps_threadsafe, self.steps_wanted,
                                   step_times_ns, columns=True))

    def on_step_threadsafe(self, step) -> None:
        """Engine thread, once per step: hand the step over, then wait until the loop wrote it."""
        if self.detached:
            return
        if self._write_behind:
            if self._owed:
                self._step_taken.wait()     # the last step's write: one ring at most is pending
            self._steps.append(step)
            self._step_ready.ring()
            self._owed = True
            return
        self._steps.append(step)
        self._step_ready.ring()
        self._step_taken.wait()

    def _on_ready(self) -> None:
        """Loop side: write the waiting step, then let the engine thread go on.

        The engine is let go last: it needs the GIL for its next step anyway, and its step
        then runs while this thread would only be returning to the event loop."""
        self._step_ready.wait()
        try:
            self.write_pending()
        finally:
            self.release_engine()

    def _on_pulled(self) -> None:
        """Loop side, an engine process: its steps arrived (hot path: once per read)."""
        if not self.driver.pull():          # the process has gone: its socket stays readable at EOF
            self.loop.remove_reader(self._pulled_fd)
            self._pulled_fd = None

    def write_pending(self) -> None:
        """Write the step the engine has handed over, if any. Call `release_engine` after
        this, also when it raised."""
        if self._pulled_fd is not None:
            self._on_pulled()
            return
        steps = self._steps
        while steps:
            self._engine_waits = True
            self._write_step(steps.popleft())

    def release_engine(self) -> None:
        if self._engine_waits:
            self._engine_waits = False
            self._step_taken.ring()

    # ------------------------------------------------------------ inline steps

    def take_steps_threadsafe(self) -> None:
        """Engine thread: it lends its steps to this loop from now on (it wrote its last one)."""
        if not self.detached:
            try:
                self.loop.call_soon_threadsafe(self._take_steps)
            except RuntimeError:            # the loop is closed: the thread sleeps until shutdown
                pass

    def _take_steps(self) -> None:
        self.write_pending()                # a step the engine handed over before it lent them goes first
        self.release_engine()
        if self.driver.lent and self.driver.core.has_work():
            self.steps_wanted()

    def steps_wanted(self) -> None:
        """Loop thread: work arrived for an inline engine; run a step at the next loop iteration."""
        if not self._inline_scheduled and not self.detached:
            self._inline_scheduled = True
            self.loop.call_soon(self._step_inline)

    def _step_inline(self) -> None:
        """Engine steps on the loop, each written at once (hot path: once per step). Steps
        follow each other in one callback for up to the driver's `inline_step_ns` (what one
        step may hold the loop anyway), then the loop polls its sockets before the next: a
        lone stream's tokens do not each pay a loop iteration and an epoll."""
        self._inline_scheduled = False
        driver = self.driver
        if self.detached or not driver.lent:
            return
        until_ns = time.monotonic_ns() + driver.inline_step_ns
        go_on = True                        # also when a write raised: the next callback goes on
        try:
            while True:
                step = driver.lent_step()
                wrote = bool(step.rows or step.request_ids)
                if wrote:
                    self._write_step(step)
                go_on = driver.keep_lent(wrote) and not self.detached
                if not go_on or time.monotonic_ns() >= until_ns:
                    break
        finally:
            if go_on:
                self._inline_scheduled = True
                self.loop.call_soon(self._step_inline)

    def detach(self) -> None:
        """The loop is stopping: never block the engine thread again, nor step it here (call
        on the loop's thread)."""
        if self.detached:
            return
        self.detached = True
        if self._pulled_fd is not None:
            self.loop.remove_reader(self._pulled_fd)
            self._pulled_fd = None
        self.loop.remove_reader(self._step_ready.fileno())
        self._step_taken.ring()

    def close(self) -> None:
        """Release the doorbells, once the engine thread has stopped."""
        self._step_ready.close()
        self._step_taken.close()
