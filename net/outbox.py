"""`Outbox`: one connection's side of the per-step write, owned by its ServerProtocol.

While the dispatcher writes a step, a later SSE token is not framed at once: its chunk
waits in `sends` as (data key, payload), and at the end of the step `write_step()` turns
all of them into DATA frames in one `session.send_batch` pass (same frames and windows as
one `send_data` each) and writes the connection once. `pending` says the step writer has
listed this outbox for the end of the step (it sets it when it first writes to the
connection in a step, instead of keeping a set: a flag test per token is ~50 ns cheaper
than a set insert); `write_step` clears it. `streams` maps this connection's stream ids to
the engine request ids of their exchanges (cancellation on RST_STREAM or a lost
connection).
"""


class Outbox:
    __slots__ = ("sends", "pending", "streams", "_proto")

    def __init__(self, proto):
        self.sends = []                     # this step's (data_key, payload) chunks: session.send_batch
        self.pending = False                # listed for write_step at the end of this step
        self.streams = {}                   # stream id -> engine request id
        self._proto = proto

    def send_queued(self) -> None:
        """Frame the queued chunks now (before a chunk written directly must follow them)."""
        self._proto.session.send_batch(self.sends)
        self.sends.clear()

    def write_step(self) -> None:
        """End of a step (hot path: once per step per connection written)."""
        self.pending = False
        sends = self.sends
        if sends:
            self._proto.session.send_batch(sends)
            sends.clear()
        self._proto.flush()
