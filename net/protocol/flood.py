"""Flood budgets: how much of each kind of frame one connection may send per second.

A `RateBudget` is a token bucket: `rate` events per second on average and at most one
second's worth at once; the clock is the session's own per-read timestamp, so a frame costs
one multiply-add and no clock read. A connection over a budget ends with GOAWAY
ENHANCE_YOUR_CALM (RFC 9113 5.4.1, 11.2) and is counted under its cause in
`tokenwire_connections_closed_total{reason}` (metrics.py).

Why each budget exists (the attack each one ends):
    resets          rapid reset (CVE-2023-44487): HEADERS + RST_STREAM before the response
                    started, the stream's work done for nothing; our own RST_STREAM for the
                    client's stream errors counts too ("made you reset"). A client that
                    cancels a stream it is already reading spends nothing.
    settings, ping  every one costs an ACK we must queue (CVE-2019-9515, CVE-2019-9512)
    window_update   each is a dict lookup and maybe a drain pass, for no data
    empty           frames that carry nothing (CVE-2019-9518), PRIORITY (CVE-2019-9513)
"""

# every cause a connection can end with; the metric renders each, 0 included. The last three
# are server-wide budgets (budgets.py): a connection refused at accept counts as max_connections
CLOSE_CAUSES = ("peer", "shutdown", "idle", "handshake_timeout", "write_timeout", "unsent_bytes",
                "rapid_reset", "settings_flood", "ping_flood", "window_update_flood", "empty_frame_flood",
                "control_frame_backlog", "protocol_error", "total_unsent_bytes", "total_body_bytes",
                "max_connections")


class RateBudget:
    """`take(now_ns)` -> False once more than `rate` events per second arrived (burst: 1 s of them)."""
    __slots__ = ("per_ns", "capacity", "tokens", "last_ns")

    def __init__(self, rate_per_s: float):
        self.per_ns = rate_per_s / 1e9
        self.capacity = max(rate_per_s, 1.0)
        self.tokens = self.capacity
        self.last_ns = 0

    def take(self, now_ns: int) -> bool:
        tokens = self.tokens + (now_ns - self.last_ns) * self.per_ns
        if tokens > self.capacity:
            tokens = self.capacity
        self.last_ns = now_ns
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True
