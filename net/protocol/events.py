"""Events the sans-IO sessions (http2.py, http1.py) hand to the server, and the limits
they enforce.

Both sessions speak the same small vocabulary, so the Protocol shell and the routes never
branch on the HTTP version: a complete request, a body over the limit, a stream the client
abandoned, an h2c upgrade offer (HTTP/1.1 only), and the end of the connection. HTTP/2 also
delivers a gRPC request as it arrives (`MessageRequest`, `RequestMessage`, `RequestEnd`):
its body is a stream of messages that may stay open for as long as the call.
"""

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Limits:
    """Per-connection limits; every one is a `tokenwire serve` flag (README: "Limits").

    A flood limit is a rate per second with one second's worth of burst (flood.RateBudget);
    going over it ends the connection with GOAWAY ENHANCE_YOUR_CALM."""
    http2_only: bool = False                    # speak HTTP/2 alone: bytes that are not the preface get GOAWAY
                                                # PROTOCOL_ERROR, not HTTP/1.1's 400; TLS offers ALPN h2 alone
    max_body_bytes: int = 4 * 1024 * 1024       # request bodies above this get 413
    max_concurrent_streams: int = 256           # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS
    max_header_list_size: int = 64 * 1024       # HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE; HTTP/1.1 header block bytes
    idle_timeout_s: float = 75.0                # no request in flight for this long (bytes do not count): closed
    handshake_timeout_s: float = 10.0           # connect to first complete request (preface included), else closed
    write_timeout_s: float = 30.0               # unsent output that makes no progress this long: stream reset /
                                                # connection closed, requests cancelled
    max_unsent_bytes: int = 8 * 1024 * 1024     # output waiting for the peer (windows + socket), per connection
    socket_send_buffer: int = 128 * 1024        # SO_SNDBUF of each TCP connection (Linux doubles it); 0: the OS's
                                                # autotuning, up to net.ipv4.tcp_wmem's 4 MiB, in kernel memory
                                                # no budget counts, and a peer that stops reading is seen later
    max_resets_per_s: float = 200.0             # streams the client resets before their response started, or
                                                # we reset for its errors: the rapid-reset budget
    max_settings_per_s: float = 100.0           # SETTINGS frames received
    max_pings_per_s: float = 100.0              # PING frames received
    max_window_updates_per_s: float = 10000.0   # WINDOW_UPDATE frames received
    max_empty_frames_per_s: float = 100.0       # frames that do nothing: empty DATA / HEADERS / CONTINUATION
                                                # that end nothing, PRIORITY, unknown types
    max_queued_control_frames: int = 10000      # control frames we owe a peer that does not read (ACKs, RST_STREAM)

    def __post_init__(self):
        for name in ("max_body_bytes", "max_concurrent_streams", "max_header_list_size", "max_unsent_bytes",
                     "max_queued_control_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.socket_send_buffer < 0:
            raise ValueError(f"socket_send_buffer must be >= 0, got {self.socket_send_buffer}")
        for name in ("idle_timeout_s", "handshake_timeout_s", "write_timeout_s", "max_resets_per_s",
                     "max_settings_per_s", "max_pings_per_s", "max_window_updates_per_s", "max_empty_frames_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


BUSY_POLL_US = 500.0        # default busy-poll window (dispatch.py): a client's turn-around at concurrency 1


class Request(NamedTuple):
    """A complete request: headers and the whole body."""
    stream_id: int
    method: str
    target: str                 # path with query, as sent
    headers: dict               # lower-case name -> value (str); repeated fields joined with ", "
    body: bytes
    arrived_ns: int             # time.monotonic_ns() when the bytes completing the header block were received


class MessageRequest(NamedTuple):
    """A request whose body is a stream of length-prefixed messages (gRPC, content-type
    application/grpc*; HTTP/2 only), delivered at its headers: its messages follow as
    `RequestMessage` events as each one is complete, then `RequestEnd`."""
    stream_id: int
    method: str
    target: str
    headers: dict
    arrived_ns: int


class RequestMessage(NamedTuple):
    """One complete message of a `MessageRequest`'s body (gRPC's Length-Prefixed-Message)."""
    stream_id: int
    compressed: bool            # the message's compressed flag (gRPC: grpc-encoding says how)
    message: bytes              # without its 5-byte prefix


class RequestEnd(NamedTuple):
    """The peer ended a `MessageRequest`'s body (END_STREAM): no more messages will come."""
    stream_id: int
    num_cut_bytes: int          # bytes of a message left incomplete at the end (0: it ended between messages)


class BodyTooLarge(NamedTuple):
    """The body passed `Limits.max_body_bytes` (a `MessageRequest`: one message did); the rest
    of it is discarded."""
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
    cause: str = "peer"         # the `reason` label of tokenwire_connections_closed_total (flood.CLOSE_CAUSES)
