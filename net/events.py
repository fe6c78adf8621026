"""Events the sans-IO sessions (http2.py, http1.py) hand to the server, and the limits
they enforce.

Both sessions speak the same small vocabulary, so the Protocol shell and the routes never
branch on the HTTP version: a complete request, a body over the limit, a stream the client
abandoned, an h2c upgrade offer (HTTP/1.1 only), and the end of the connection.
"""

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Limits:
    """Per-connection limits; every one is a `tokenwire serve` flag."""
    max_body_bytes: int = 4 * 1024 * 1024       # request bodies above this get 413
    max_concurrent_streams: int = 256           # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS
    max_header_list_size: int = 64 * 1024       # HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE; HTTP/1.1 header block bytes
    idle_timeout_s: float = 75.0                # a connection with no open stream for this long is closed

    def __post_init__(self):
        for name in ("max_body_bytes", "max_concurrent_streams", "max_header_list_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")


BUSY_POLL_US = 500.0        # default busy-poll window (dispatch.py): a client's turn-around at concurrency 1


class Request(NamedTuple):
    """A complete request: headers and the whole body."""
    stream_id: int
    method: str
    target: str                 # path with query, as sent
    headers: dict               # lower-case name -> value (str); repeated fields joined with ", "
    body: bytes
    arrived_ns: int             # time.monotonic_ns() when the bytes completing the header block were received


class BodyTooLarge(NamedTuple):
    """The body passed `Limits.max_body_bytes`; the rest of it is discarded."""
    stream_id: int
    method: str
    target: str
    headers: dict
    arrived_ns: int


class StreamReset(NamedTuple):
    """The client abandoned the stream (HTTP/2 RST_STREAM); its request is cancelled."""
    stream_id: int


class UpgradeRequested(NamedTuple):
    """An HTTP/1.1 request offering `Upgrade: h2c` (RFC 7540 section 3.2)."""
    request: Request
    settings: bytes             # the HTTP2-Settings header value (base64url SETTINGS payload)


class PriorityUpdate(NamedTuple):
    """An HTTP/2 PRIORITY_UPDATE frame (RFC 9218 7.1): a new priority for a request stream."""
    stream_id: int              # the prioritized stream
    value: str                  # the Priority field value, e.g. "u=0, i"


class ConnectionClosed(NamedTuple):
    """The peer ended the connection (GOAWAY, EOF) or broke the protocol; nothing more will come."""
    reason: str
