"""net/writer/_columns.c: the step writer's per-token loop in C takes the later SSE tokens,
`Dispatcher._write_columns`' Python body every other entry; what goes out is what the Python
body alone writes.

Two dispatchers, one with the C loop and one without (`Dispatcher.columns = None`), get the
same exchanges on their own HTTP/2 sessions (two connections, several streams each) and the
same steps: first tokens, later tokens, a cancelled request, an exchange whose encoder
splices its own chunks, texts that need JSON escapes, and streams that finish. Every
connection's bytes and flushes, the windows, the inter-token histogram and the exchanges left must match.
"""

import types

import orjson
import pytest

from tokenwire.core.outputs import RequestOutput, StepTokens, Timeline
from tokenwire.net.metrics import Metrics
from tokenwire.net.writer import dispatch, encoders
from tokenwire.net.writer.dispatch import Dispatcher, Exchange

from test_net_write_failures import COMPLETION, Conn, h2_pair

pytestmark = pytest.mark.skipif(dispatch.COLUMNS is None, reason="the C extension net/writer/_columns.c is not built")

SIDS = (1, 3, 5, 7, 9)
TEXTS = [" a", "b\"c", "\n", "é", "日本", "\\", "", " the", "\u2028", "x" * 40]


class SpliceEncoder:
    """An SSE encoder whose later chunks are `splice(text)` (no constant prefix and suffix)."""

    def __init__(self, inner):
        self._inner = inner
        self._prefix, self._suffix = inner.text_parts()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def text_parts(self):
        return None, None

    def splice(self, text):
        return self._prefix + orjson.dumps(text) + self._suffix


class Clock:
    """time.monotonic_ns for the dispatcher: the same readings in both runs."""

    def __init__(self):
        self.ns = 10**9

    def monotonic_ns(self):
        self.ns += 1000
        return self.ns


class FlushCounting(Conn):
    """A connection counting its flushes: each written step flushes it once."""

    num_flushes = 0

    def flush(self):
        self.num_flushes += 1
        super().flush()


class CountingColumns:
    def __init__(self, inner):
        self.inner, self.num_taken = inner, 0

    def write_columns(self, ids, texts, i, *args):
        out = self.inner.write_columns(ids, texts, i, *args)
        self.num_taken += out[0] - i
        return out


def run(native: bool, monkeypatch) -> tuple:
    monkeypatch.setattr(dispatch, "time", types.SimpleNamespace(monotonic_ns=Clock().monotonic_ns))
    d = Dispatcher(Metrics())
    d.engine = types.SimpleNamespace(cancel=lambda rid: None)
    d.columns = CountingColumns(d.columns) if native else None
    conns = []
    for n in range(2):
        _, s = h2_pair(SIDS)
        conn = FlushCounting(s)
        conns.append(conn)
        for sid in SIDS:
            rid = 100 * n + sid
            enc = encoders.CompletionSse(f"cmpl-{rid}", 0, "m", False, lambda i: "")
            if sid == 5:
                enc = SpliceEncoder(enc)
            d.add(Exchange(rid, conn, sid, COMPLETION, enc, True, Timeline(arrived_ns=0), f"cmpl-{rid}", 0, False))
    rids = sorted(d.exchanges)
    for k in range(12):
        step = StepTokens([], 5)
        for j, rid in enumerate(rids):
            if rid == 103 and k >= 4:
                continue                    # it finished at step 3
            if rid == 7 and k == 6:
                d.exchanges.pop(7)          # cancelled: its later tokens have no exchange
            if (rid + k) % 7 == 0 and k:
                continue                    # a stream without a token in this step (a new run after)
            step.request_ids.append(rid)
            step.token_ids.append(40 + j)
            step.texts.append(TEXTS[(j + k) % len(TEXTS)])
        if k == 3:
            i = step.request_ids.index(103)
            del step.request_ids[i], step.token_ids[i], step.texts[i]
            step.rows.append(RequestOutput(103, (9,), " end", None, "stop", 1, 4, 5))
        d.write_step(step)
    itl = d.metrics.itl
    return ([c.written for c in conns], [c.num_flushes for c in conns], [c.session.send_window for c in conns], itl.counts, itl.sum_ns, itl.count,
            sorted(d.exchanges), d.columns)


def test_the_c_loop_writes_what_the_python_body_writes(monkeypatch):
    *want, _ = run(False, monkeypatch)
    *got, columns = run(True, monkeypatch)
    assert got == want
    assert all(b'"b\\"c"' in written for written in want[0])
    later = sum(w.count(b"data: ") for w in want[0])
    assert columns.num_taken > later // 2, (columns.num_taken, later)
