"""The asyncio Protocol shell: one per connection, thin on purpose.

It picks the session (TLS ALPN `h2` -> HTTP/2, `http/1.1` -> HTTP/1.1; otherwise the first
bytes: the HTTP/2 preface -> HTTP/2 with prior knowledge; anything else -> HTTP/1.1, which
may upgrade to h2c), moves bytes between the transport and the session, hands the
session's events to the app, and honours transport back-pressure: while the transport is
paused, output stays in the session and leaves on `resume_writing`. It runs unchanged on
uvloop and on asyncio.
"""

import asyncio
import binascii
import socket
import time

import h2.exceptions

from .events import Limits, UpgradeRequested
from .http1 import H1Session
from .http2 import H2Session
from .outbox import Outbox

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
LINGER_S = 2.0      # after our FIN, how long to keep reading what the peer still sends


class ServerProtocol(asyncio.Protocol):
    """Bytes <-> session <-> app for one connection."""

    def __init__(self, app, limits: Limits):
        self.app = app
        self.limits = limits
        self.transport = None
        self.session = None             # H2Session | H1Session once the protocol is known
        self.outbox = Outbox(self)      # the per-step writer's side of this connection (outbox.py)
        self.paused = False
        self.closing = False
        self.last_active = time.monotonic()
        self._sniffed = b""
        self._linger = None

    # -------------------------------------------------------- transport side

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:      # ALPN decides; a client that offered none is sniffed like plaintext
            alpn = ssl_object.selected_alpn_protocol()
            if alpn is not None:
                self.session = H2Session(self.limits) if alpn == "h2" else H1Session(self.limits)
                self.flush()
        self.app.connection_made(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return              # lingering after our FIN: read and drop (see close)
        self.last_active = time.monotonic()
        if self.session is None:
            data = self._sniff(data)
            if self.session is None:
                return
        events = self.session.receive_data(data)
        if events:
            self._dispatch(events)
        self.flush()

    def eof_received(self):
        return None     # close our side too; connection_lost cancels what was in flight

    def connection_lost(self, exc) -> None:
        self.closing = True
        if self._linger is not None:
            self._linger.cancel()
        self.app.connection_lost(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.flush()

    # ------------------------------------------------------------- app side

    def flush(self) -> None:
        """Write what the session produced in one transport write (hot path: once per step)."""
        if self.paused or self.closing:
            return
        session = self.session
        data = session.data_to_send()
        if data:
            self.transport.write(data)
        if session.wants_close:
            self.close()
        elif session.wants_poll:
            events = session.poll_events()
            if events:
                self._dispatch(events)
                self.flush()

    def close(self) -> None:
        """Close without losing the last bytes: FIN after the buffered output, then keep reading
        until the peer closes too. Closing a socket with unread input (a late WINDOW_UPDATE)
        would send a TCP RST, and the peer's kernel would drop the response it had not read yet."""
        if self.closing:
            return
        self.closing = True
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def begin_shutdown(self) -> None:
        """Graceful: GOAWAY / Connection: close; the connection closes once its streams finish."""
        if self.session is None:
            self.close()
            return
        self.session.begin_shutdown()
        self.flush()

    @property
    def is_idle(self) -> bool:
        return self.session is None or self.session.num_active_streams == 0

    # -------------------------------------------------------------- internal

    def _sniff(self, data: bytes) -> bytes:
        """Choose HTTP/2 (prior knowledge) or HTTP/1.1 from the first bytes."""
        buf = self._sniffed + data
        n = min(len(buf), len(PREFACE))
        if n < len(PREFACE) and buf[:n] == PREFACE[:n]:
            self._sniffed = buf
            return b""
        self._sniffed = b""
        self.session = H2Session(self.limits) if buf[:n] == PREFACE else H1Session(self.limits)
        return buf

    def _dispatch(self, events: list) -> None:
        if type(events[-1]) is UpgradeRequested:     # h11 pauses after an upgrade offer: always last
            events = events[:-1] + self._upgrade(events[-1])
        self.app.on_events(self, events)

    def _upgrade(self, offer: UpgradeRequested) -> list:
        """Switch to HTTP/2 (RFC 7540 3.2); a malformed HTTP2-Settings just declines the offer."""
        h1 = self.session
        try:
            h2_session = H2Session(self.limits, upgrade_settings=offer.settings)
        except (binascii.Error, ValueError, h2.exceptions.ProtocolError):
            return [offer.request]
        trailing = h1.accept_h2c_upgrade()
        self.transport.write(h1.data_to_send())
        self.session = h2_session
        return [h2_session.upgraded_request(offer.request)] + h2_session.receive_data(trailing)
