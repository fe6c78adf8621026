"""net/protocol/frames.py: the C `frame_data` (net/protocol/_frames.c) against its Python
twin `frame_data_py`, byte for byte and window for window, and both through a real
H2Session's `send_batch` against one `send_data` per chunk.

Cases: everything fits; stream and connection windows that run out mid-step; a payload over
the peer's max frame size; a stream that has a queue; a stream whose response ended or was
reset; 256 streams; keys whose fields are slots and keys whose fields are not, in one
batch; pieces the C code hands back (a str subclass, a lone surrogate, a
bytearray); an iterator that raises midway; repeated calls that must not leak.
"""

import gc
import subprocess
import sys
import tracemalloc

import h2.settings
import orjson
import pytest

from tokenwire.net.protocol import frames, http2
from tokenwire.net.protocol.http2 import HALF_CLOSED_LOCAL, HALF_CLOSED_REMOTE

from test_net_send_batch import opened, state

try:
    from tokenwire.net.protocol import _frames
except ImportError:
    _frames = None

native = pytest.mark.skipif(not frames.NATIVE, reason="the C extension is not built")
IMPLEMENTATIONS = [pytest.param(frames.frame_data, id="c", marks=native),
                   pytest.param(frames.frame_data_py, id="python")]
PREFIX, SUFFIX = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":', b',"finish_reason":null}]}\n\n'
TEXTS = ["", " the", 'say "hi" \\ back', "tab\tnl\ncr\rbs\bff\f", "\x00\x01\x1f\x7f", "ünï € 😀 \u2028",
         "/</script>"]


class Stream:
    """The four fields of http2._Stream that framing reads."""
    __slots__ = ("id", "state", "pending", "send_window")

    def __init__(self, sid, send_window=65535, state=HALF_CLOSED_REMOTE, pending=b""):
        self.id, self.state, self.pending, self.send_window = sid, state, bytearray(pending), send_window


class DictStream:
    """The same fields in an instance dict: read and written through getattr / setattr."""

    def __init__(self, sid, send_window=65535, state=HALF_CLOSED_REMOTE, pending=b""):
        self.id, self.state, self.pending, self.send_window = sid, state, bytearray(pending), send_window


class Session:
    def __init__(self, send_window=10**6, max_frame_size=16384):
        self.send_window, self.max_frame_size = send_window, max_frame_size


def run(frame_data, make):
    """Frame `make()`'s (session, items) the way send_batch does, with a stand-in for its
    general path (a marker and the payload, or a marker where building the payload raises).
    -> (bytes, connection window, stream windows, items handed back)"""
    session, items = make()
    out, back = [], []
    it = iter(items)
    while True:
        try:
            item = frame_data(session, it, out, HALF_CLOSED_LOCAL)
            if item is None:
                break
            back.append(item)
            out.append(b"<general>" + frames.payload(item))
        except TypeError:
            out.append(b"<raised>")
    keys = {id(item[0]): item[0] for item in items}
    return b"".join(out), session.send_window, sorted((st.id, st.send_window) for st in keys.values()), back


def sse_items(streams, texts):
    return [(streams[i % len(streams)], PREFIX, text, SUFFIX) for i, text in enumerate(texts)]


CASES = {
    "fits": lambda: (Session(), sse_items([Stream(1), Stream(3)], TEXTS * 3)),
    "stream window": lambda: (Session(), sse_items([Stream(1, 250), Stream(3, 90)], TEXTS * 2)),
    "connection window": lambda: (Session(700), sse_items([Stream(1), Stream(3)], TEXTS * 3)),
    "max frame size": lambda: (Session(max_frame_size=16384),
                               [(Stream(1), b"a" * 16384), (Stream(3), b"b" * 16385), (Stream(5), b"c")]),
    "queued stream": lambda: (Session(), sse_items([Stream(1, pending=b"x"), Stream(3)], TEXTS)),
    "ended stream": lambda: (Session(), sse_items([Stream(1, state=HALF_CLOSED_LOCAL), Stream(3)], TEXTS)),
    "mixed key types": lambda: (Session(), sse_items([Stream(1, 300), DictStream(3, 300), Stream(5), DictStream(7)],
                                                     TEXTS * 3)),
    "256 streams": lambda: (Session(), sse_items([Stream(2 * i + 1) for i in range(256)], TEXTS * 37)),
    "bytes and empty": lambda: (Session(), [(Stream(1), b""), (Stream(1), b"abc", b"def"), (Stream(3), "t\n")]),
    "handed back": lambda: (Session(), [(Stream(1), PREFIX, type("S", (str,), {})("sub"), SUFFIX),
                                        (Stream(3), PREFIX, "\ud800", SUFFIX), (Stream(5), bytearray(b"ba")),
                                        (Stream(7), PREFIX, " ok", SUFFIX)]),
}


@native
@pytest.mark.parametrize("case", CASES)
def test_c_frames_what_python_frames(case):
    """Same bytes and windows; C hands back a piece it cannot encode where Python raises
    building it, and the general path raises the same for it."""
    c_bytes, c_window, c_streams, _ = run(frames.frame_data, CASES[case])
    py_bytes, py_window, py_streams, _ = run(frames.frame_data_py, CASES[case])
    assert (c_bytes, c_window, c_streams) == (py_bytes, py_window, py_streams)


@pytest.mark.parametrize("frame_data", IMPLEMENTATIONS)
def test_frames_are_data_frames_of_the_payloads(frame_data):
    streams = [Stream(1), Stream(3)]
    got, window, _, back = run(frame_data, lambda: (Session(), sse_items(streams, TEXTS)))
    assert back == [] and b"<" not in got[:9]
    want = b"".join(frames.FRAME_HEADER.pack(len(p) >> 16, len(p) & 0xFFFF, 0, 0, sid) + p
                    for sid, p in ((2 * (i % 2) + 1, PREFIX + orjson.dumps(t) + SUFFIX) for i, t in enumerate(TEXTS)))
    assert got == want and window == 10**6 - (len(want) - 9 * len(TEXTS))


@native
def test_json_string_is_orjsons_for_every_code_point():
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for i in range(0, len(chars), 4096):
        text = "".join(chars[i:i + 4096])
        assert _frames.json_string(text) == orjson.dumps(text)
    for text in TEXTS + ["\\" * 7, '"' * 3, "\x00"]:
        assert _frames.json_string(text) == orjson.dumps(text)
    with pytest.raises(ValueError):
        _frames.json_string("\ud800")


@pytest.mark.parametrize("frame_data", IMPLEMENTATIONS)
def test_an_iterator_that_raises_leaves_the_frames_made_and_the_windows_exact(frame_data):
    session, st = Session(1000), Stream(1, 500)

    def items():
        yield st, b"x" * 10
        yield st, PREFIX, " a", SUFFIX
        raise RuntimeError("midway")
    out = []
    with pytest.raises(RuntimeError):
        frame_data(session, items(), out, HALF_CLOSED_LOCAL)
    n = 10 + len(PREFIX) + 4 + len(SUFFIX)
    assert len(b"".join(out)) == n + 18 and session.send_window == 1000 - n and st.send_window == 500 - n


@native
def test_repeated_calls_keep_references_and_memory():
    session, streams = Session(2**31 - 1), [Stream(2 * i + 1, 2**31 - 1) for i in range(64)]
    texts = [" the", "ü", 'q"']
    items = sse_items(streams, texts * 22) + [(streams[0], PREFIX, "\ud800", SUFFIX)]
    refs = [sys.getrefcount(o) for o in (PREFIX, SUFFIX, *texts, streams[0], items[-1])]

    def step():
        out = []
        it = iter(items)
        while frames.frame_data(session, it, out, HALF_CLOSED_LOCAL) is not None:
            pass
        return out
    for _ in range(200):
        step()
    gc.collect()
    # what this file's frames allocated, not the whole process: in the full suite, threads
    # other tests left (servers, engines) allocate meanwhile and once counted 233 KiB here
    mine = [tracemalloc.Filter(True, __file__)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(mine)
    for _ in range(5000):
        step()
    gc.collect()
    after = tracemalloc.take_snapshot().filter_traces(mine)
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 64 * 1024
    assert [sys.getrefcount(o) for o in (PREFIX, SUFFIX, *texts, streams[0], items[-1])] == refs


# ------------------------------------------------- through H2Session.send_batch

@pytest.mark.parametrize("frame_data", IMPLEMENTATIONS)
@pytest.mark.parametrize("window,conn_extra,settings,num_streams,reps", [
    (65535, 10**6, {}, 4, 3),                   # everything fits
    (300, 10**6, {}, 4, 3),                     # stream windows run out mid-step
    (65535, 0, {}, 256, 2),                     # 256 streams; the connection window runs out
    (65535, 10**6, {h2.settings.SettingCodes.MAX_FRAME_SIZE: 16384}, 4, 1),    # chunks over the frame size
])
def test_send_batch_of_pieces_is_send_data_of_their_bytes(monkeypatch, frame_data, window, conn_extra, settings,
                                                          num_streams, reps):
    sids = [2 * i + 1 for i in range(num_streams)]
    (_, one), (_, batch) = (opened(window, conn_extra, settings, sids) for _ in range(2))
    for s in (one, batch):
        s.send_data(sids[0], b"q" * min(window + 7, 1000))     # in a tight window, a stream with a queue
    big = b"B" * 16385 if settings else b"b"
    chunks = [(sid, (PREFIX, TEXTS[(i + r) % len(TEXTS)], SUFFIX) if (i + r) % 3 else (big,))
              for r in range(reps) for i, sid in enumerate(sids)]
    for sid, pieces in chunks:
        one.send_data(sid, frames.payload((None, *pieces)))
    monkeypatch.setattr(http2, "frame_data", frame_data)
    batch.send_batch([(batch.data_key(sid), *pieces) for sid, pieces in chunks])
    assert batch.data_to_send() == one.data_to_send()
    assert state(batch) == state(one)


def test_without_the_extension_the_python_twin_is_chosen_at_import():
    code = ("import sys; sys.modules['tokenwire.net.protocol._frames'] = None\n"
            "from tokenwire.net.protocol import frames, http2\n"
            "assert not frames.NATIVE and frames.frame_data is frames.frame_data_py is http2.frame_data\n")
    subprocess.run([sys.executable, "-c", code], check=True)
