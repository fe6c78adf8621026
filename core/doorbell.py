"""`Doorbell`: the wake-up between the engine thread and the event loop.

Used twice: the engine thread sleeps on one while it has no work (core/engine_core.py), and
the engine -> loop step hand-off rings a pair (net/writer/handoff.py).
"""

import os
import select
from typing import Optional

_RING = (1).to_bytes(8, "little")      # an eventfd takes 8-byte counts


class Doorbell:
    """A wake-up from one thread to another that releases the GIL on both sides.

    `ring()` and `wait()` are a write to and a blocking read from an eventfd (a pipe where
    there is none); CPython releases the GIL around both syscalls. That is the point: waking
    a thread with a `threading.Lock` or `Condition` keeps the GIL, so on a busy core the woken
    thread preempts the waker only to block on the GIL and switch back (three context
    switches per hand-off instead of one; ~9 -> ~4 µs per engine step in a two-thread
    ping-pong on one core). A ring before the wait is not lost; several rings may end one
    wait, and a wait may end with no new work: waiters re-check. `fileno()` can be watched
    by an event loop (add_reader), which then calls `wait()` to consume the ring."""

    def __init__(self):
        if hasattr(os, "eventfd"):
            self._r = self._w = os.eventfd(0, os.EFD_CLOEXEC)
        else:
            self._r, self._w = os.pipe()
        self.closed = False

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        if not self.closed:             # closed: nobody is left to wake (and the descriptor may be reused)
            os.write(self._w, _RING)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until rung (or `timeout` seconds), consuming the ring."""
        if timeout is not None and not select.select([self._r], [], [], timeout)[0]:
            return
        os.read(self._r, 8)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._r)
            if self._w != self._r:
                os.close(self._w)

    def __del__(self):          # an engine never started or shut down still gives its descriptor back
        if not getattr(self, "closed", True):
            self.close()
