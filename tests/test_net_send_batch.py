"""The per-step batched token path against the general one.

`H2Session.send_batch` must leave exactly the bytes and window state that one `send_data`
per item leaves, also when windows or the frame size force chunks onto the queue; the SSE
chunk the dispatcher splices from `text_parts()` must be the bytes `token()` makes.
"""

import h2.events
import h2.settings
import orjson
import pytest

from tokenwire.core.outputs import RequestOutput
from tokenwire.net.protocol.events import Limits
from tokenwire.net.protocol.http1 import H1Session
from tokenwire.net.protocol.http2 import H2Session
from tokenwire.net.writer import encoders

from test_net_session import client, data_by_stream, frames, handshake

SIDS = (1, 3, 5, 7)


def opened(window, conn_extra=0, settings=None, sids=SIDS):
    c = client(window)
    if settings:
        c.update_settings(settings)
    s = H2Session(Limits())
    handshake(c, s, sids)
    if conn_extra:
        c.increment_flow_control_window(conn_extra)
        s.receive_data(c.data_to_send())
    s.data_to_send()
    for sid in sids:
        s.start_response(sid, 200, ((b"content-type", b"text/event-stream"),))
    return c, s


def state(s):
    return s.send_window, {sid: (st.send_window, bytes(st.pending)) for sid, st in s.streams.items()}


@pytest.mark.parametrize("window,conn_extra,settings,sizes", [
    (65535, 10**6, {}, [40, 41, 42, 43] * 3),               # everything fits: one frame per chunk
    (50, 10**6, {}, [30, 30, 10, 60, 5, 5, 5, 5]),          # stream windows run out mid-step
    (30000, 0, {}, [12000] * 8),                           # the connection window runs out mid-step
    (65535, 10**6, {h2.settings.SettingCodes.MAX_FRAME_SIZE: 16384}, [16385, 10, 16384, 10]),   # over the peer's max frame size
])
def test_send_batch_matches_send_data_per_item(window, conn_extra, settings, sizes):
    _, one = opened(window, conn_extra, settings)
    _, batch = opened(window, conn_extra, settings)
    # stream 1 already has a queue: its chunks must wait behind it in both
    one.send_data(1, b"x" * (window + 7))
    batch.send_data(1, b"x" * (window + 7))
    assert one.data_to_send() == batch.data_to_send()
    items = [(SIDS[i % 4], bytes([65 + i]) * n) for i, n in enumerate(sizes)]
    for sid, payload in items:
        one.send_data(sid, payload)
    batch.send_batch([(batch.data_key(sid), payload) for sid, payload in items])
    got = batch.data_to_send()
    assert got == one.data_to_send()
    assert state(batch) == state(one)
    assert got and all(ftype == 0 for ftype, *_ in frames(got))
    assert state(one)[1][1][1]          # stream 1 still waits for window


def test_send_batch_drains_like_send_data_once_windows_open():
    c1, one = opened(20)
    c2, batch = opened(20)
    items = [(sid, b"%d:" % sid + b"y" * 30) for sid in SIDS]
    for sid, payload in items:
        one.send_data(sid, payload)
        one.end_response(sid, [(b"server-timing", b"total;dur=1")])
    batch.send_batch([(batch.data_key(sid), payload) for sid, payload in items])
    for sid in SIDS:
        batch.end_response(sid, [(b"server-timing", b"total;dur=1")])
    ev1, ev2 = pump_granting(c1, one), pump_granting(c2, batch)
    assert [type(e).__name__ for e in ev1] == [type(e).__name__ for e in ev2]
    assert data_by_stream(ev2) == data_by_stream(ev1) == dict(items)
    assert sum(isinstance(e, h2.events.StreamEnded) for e in ev2) == len(SIDS)


def pump_granting(c, s):
    """Exchange bytes until quiet, the client handing back every byte's window at once."""
    got = []
    for _ in range(1000):
        out = s.data_to_send()
        if not out:
            return got
        for ev in c.receive_data(out):
            got.append(ev)
            if isinstance(ev, h2.events.DataReceived) and ev.flow_controlled_length:
                c.increment_flow_control_window(ev.flow_controlled_length)
                if ev.stream_id in s.streams:
                    c.increment_flow_control_window(ev.flow_controlled_length, stream_id=ev.stream_id)
        back = c.data_to_send()
        if back:
            s.receive_data(back)
    raise AssertionError("the session never went quiet")


def test_h1_send_batch_is_send_data():
    s = H1Session(Limits())
    s.receive_data(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    s.start_response(1, 200, [(b"content-type", b"text/event-stream")])
    s.data_to_send()
    s.send_batch([(s.data_key(1), b"abc"), (s.data_key(1), b"de")])
    assert s.data_to_send() == b"3\r\nabc\r\n2\r\nde\r\n"


@pytest.mark.parametrize("cls", [encoders.CompletionSse, encoders.ChatSse])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", ["", " hello", 'quote " back \\ slash', "tab\tnl\n", "ünï €", "\x00\x1f"])
def test_spliced_sse_chunk_is_the_token_chunk(cls, include_usage, text):
    enc = cls("cmpl-1", 1700000000, "m", include_usage, str)
    out = RequestOutput(7, (5,), text, None, None, 3, 2, 0)
    enc.first_token(out)
    prefix, suffix = enc.text_parts()
    assert prefix + orjson.dumps(text) + suffix == enc.token(out)
    chunk = orjson.loads(enc.token(out)[len(b"data: "):])
    assert chunk["id"] == "cmpl-1"
