"""Busy polling after the last exchange ends (net/writer/busy_poll.py): it polls, it stops."""

import asyncio
import time

import pytest

from tokenwire import Server
from tokenwire.net.server import new_event_loop
from tokenwire.net.writer.busy_poll import BusyPoller


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_polls_for_its_window_then_stops(kind):
    loop = new_event_loop(kind)
    p = BusyPoller({}, window_ns=20_000_000)
    p.loop = loop
    passes = []
    poll = p._poll
    p._poll = lambda: (passes.append(time.monotonic_ns()), poll())

    async def main():
        start = time.monotonic_ns()
        p.start(start)
        assert p._polling
        p.start(time.monotonic_ns())                # a second end while polling: one poller, a later deadline
        await asyncio.sleep(0.06)
        return start

    try:
        start = loop.run_until_complete(main())
    finally:
        loop.close()
    assert not p._polling
    assert len(passes) > 10                         # the loop went round without blocking
    assert 0.015 <= (passes[-1] - start) / 1e9 < 0.05   # and stopped once the window was over


def test_stops_when_a_request_is_in_flight():
    loop = new_event_loop("asyncio")
    in_flight = {}
    p = BusyPoller(in_flight, window_ns=10**9)
    p.loop = loop

    async def main():
        p.start(time.monotonic_ns())
        await asyncio.sleep(0.005)
        in_flight[1] = object()                     # a request came in
        await asyncio.sleep(0.005)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert not p._polling


def test_server_option():
    assert Server(backend="mock", port=0, busy_poll_us=0).app.dispatcher.busy_poll.window_ns == 0
    assert Server(backend="mock", port=0, busy_poll_us=250).app.dispatcher.busy_poll.window_ns == 250_000
    with pytest.raises(ValueError, match="busy_poll_us"):
        Server(backend="mock", port=0, busy_poll_us=-1)
