"""Busy polling after the last request in flight ends.

When the last exchange ends, the loop keeps polling its sockets without blocking (one
`call_soon` per pass, so each pass is a zero-timeout epoll) for `window_ns`, then blocks as
usual. A request arriving in that window is read at once: a core that blocked goes idle,
and waking an idle core (in a VM: the vCPU was descheduled) costs ~50-100 µs of TTFT at
concurrency 1 in this VM. It never polls while a request is in flight (the engine thread
shares the core), and costs at most `window_ns` of CPU per burst of traffic; 0 turns it
off (`tokenwire serve --busy-poll-us`).
"""

import time


class BusyPoller:
    def __init__(self, in_flight: dict, window_ns: int = 0):
        self.in_flight = in_flight          # exchanges by request id: polling stops when one exists
        self.window_ns = window_ns
        self.loop = None                    # set when the app attaches to a loop
        self.stopped = False
        self._until_ns = 0
        self._polling = False

    def start(self, now_ns: int) -> None:
        """The last request in flight just ended: poll until `now_ns + window_ns`."""
        if not self.window_ns or self.loop is None:
            return
        self._until_ns = now_ns + self.window_ns
        if not self._polling:
            self._polling = True
            self.loop.call_soon(self._poll)

    def stop(self) -> None:
        self.stopped = True

    def _poll(self) -> None:
        """One pass: scheduled again until a request is in flight or the window is over."""
        if self.in_flight or self.stopped or time.monotonic_ns() >= self._until_ns:
            self._polling = False
            return
        self.loop.call_soon(self._poll)
