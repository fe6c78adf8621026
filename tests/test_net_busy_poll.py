"""Busy polling after the last exchange ends (net/dispatch.py): it polls, it stops."""

import asyncio
import time

import pytest

from tokenwire.net.dispatch import Dispatcher
from tokenwire.net.metrics import Metrics
from tokenwire.net.server import Server, new_event_loop


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_polls_for_its_window_then_stops(kind):
    loop = new_event_loop(kind)
    d = Dispatcher(Metrics())
    d.loop, d.busy_poll_ns = loop, 20_000_000
    passes = []
    poll = d._poll
    d._poll = lambda: (passes.append(time.monotonic_ns()), poll())

    async def main():
        start = time.monotonic_ns()
        d._start_polling(start)
        assert d._polling
        d._start_polling(time.monotonic_ns())       # a second end while polling: one poller, a later deadline
        await asyncio.sleep(0.06)
        return start

    try:
        start = loop.run_until_complete(main())
    finally:
        loop.close()
    assert not d._polling
    assert len(passes) > 10                         # the loop went round without blocking
    assert 0.015 <= (passes[-1] - start) / 1e9 < 0.05   # and stopped once the window was over


def test_stops_when_a_request_is_in_flight():
    loop = new_event_loop("asyncio")
    d = Dispatcher(Metrics())
    d.loop, d.busy_poll_ns = loop, 10**9

    async def main():
        d._start_polling(time.monotonic_ns())
        await asyncio.sleep(0.005)
        d.exchanges[1] = object()                   # a request came in
        await asyncio.sleep(0.005)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert not d._polling


def test_server_option():
    assert Server(backend="mock", port=0, busy_poll_us=0).app.dispatcher.busy_poll_ns == 0
    assert Server(backend="mock", port=0, busy_poll_us=250).app.dispatcher.busy_poll_ns == 250_000
    with pytest.raises(ValueError, match="busy_poll_us"):
        Server(backend="mock", port=0, busy_poll_us=-1)
