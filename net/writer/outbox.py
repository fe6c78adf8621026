"""`Outbox`: one connection's side of the per-step write, owned by its ServerProtocol.

While the dispatcher writes a step, a later SSE token is not framed at once: its chunk
waits in `sends` as (data key, *pieces) (net/protocol/frames.py: the encoder's prefix, the
token's text, the suffix), and at the end of the step `write_step()` turns all of them into
DATA frames in one `session.send_batch` pass (same frames and windows as one `send_data`
each) and writes the connection once. `pending` says the step writer has
listed this outbox for the end of the step (it sets it when it first writes to the
connection in a step, instead of keeping a set: a flag test per token is ~50 ns cheaper
than a set insert); `write_step` clears it. `streams` maps this connection's stream ids to
the engine request ids of their exchanges (cancellation on RST_STREAM or a lost
connection).

A chunk whose framing raises fails its stream alone: the batch goes on from the next
chunk, one `send_batch` call per chunk (the slow path, only after a fault), the faulty
stream's later chunks are dropped, and (data key, exception) is left in `failed` for the
dispatcher, which ends that stream and cancels its request (net/writer/dispatch.py).
"""


class Outbox:
    __slots__ = ("sends", "pending", "streams", "failed", "proto")

    def __init__(self, proto):
        self.sends = []                     # this step's (data_key, *pieces) chunks: session.send_batch
        self.pending = False                # listed for write_step at the end of this step
        self.streams = {}                   # stream id -> engine request id
        self.failed = []                    # (data_key, exception) of chunks whose framing raised
        self.proto = proto                  # the connection's ServerProtocol

    def send_queued(self) -> None:
        """Frame the queued chunks now (before a chunk written directly must follow them)."""
        sends = self.sends
        batch = iter(sends)                 # where a fault stopped the batch
        try:
            self.proto.session.send_batch(batch)
        except Exception as exc:
            self._send_rest(batch, exc)
        sends.clear()

    def write_step(self) -> None:
        """End of a step (hot path: once per step per connection written)."""
        self.pending = False
        sends = self.sends
        if sends:
            batch = iter(sends)
            try:
                self.proto.session.send_batch(batch)
            except Exception as exc:
                self._send_rest(batch, exc)
            sends.clear()
        self.proto.flush()

    def _send_rest(self, batch, exc: Exception) -> None:
        """`send_batch` raised on the chunk `batch` gave it last (its stream fails) or before
        taking any: the rest go one at a time, and each that raises fails its stream too."""
        sends, rest = self.sends, list(batch)
        bad = set()
        if len(rest) < len(sends):
            key = sends[len(sends) - len(rest) - 1][0]
            bad.add(key)
            self.failed.append((key, exc))
        send_batch = self.proto.session.send_batch
        for item in rest:
            if item[0] in bad:
                continue
            try:
                send_batch((item,))
            except Exception as item_exc:
                bad.add(item[0])
                self.failed.append((item[0], item_exc))
