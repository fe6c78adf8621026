"""The asyncio Protocol shell: one per connection, thin on purpose.

It picks the session (TLS ALPN `h2` -> HTTP/2, `http/1.1` -> HTTP/1.1; otherwise the first
bytes: `PRI ` -> HTTP/2 with prior knowledge, whose session answers a preface that is not
exactly right with GOAWAY PROTOCOL_ERROR; anything else -> HTTP/1.1, which may upgrade to
h2c, or with `Limits.http2_only` HTTP/2 too, so those bytes get the GOAWAY), moves bytes
between the transport and the session, hands the session's events to the app, and honours
transport back-pressure: while the transport is paused, output is held here and leaves on
`resume_writing`.

It also keeps the connection's deadlines and memory caps (`Limits`), checked by the app's
periodic sweep (`check_deadlines`) and on every flush:
- handshake: connect to the first complete request within `handshake_timeout_s`;
- idle: no request in flight for `idle_timeout_s`; only events (a request, a reset) count
  as activity, never bytes, so a trickle of bytes refreshes neither deadline;
- write: a paused transport, or a stream's queued response, that makes no progress for
  `write_timeout_s` ends the connection, or resets that stream (its request is cancelled);
- unsent output (held here + queued in the session's streams) above `max_unsent_bytes`,
  or more than `max_queued_control_frames` control frames owed while the peer does not
  read, end the connection with GOAWAY ENHANCE_YOUR_CALM.
Why the connection ended is `close_cause`, counted by the app when it is lost.

Server-wide (budgets.py): what the connection holds (unsent output, after each flush; body
bytes of incomplete requests, after each read) is reported to the app's `ServerBudget`,
which may end it for a budget. A connection over `max_connections` gets no session: it is
answered in the protocol its first bytes name (`PRI ` -> HTTP/2 SETTINGS + GOAWAY NO_ERROR
with last stream 0, so nothing was processed and a client may retry; anything else ->
HTTP/1.1 503 with Retry-After; at once where TLS ALPN or `http2_only` decides) and closed.
One that sends nothing within REFUSAL_WAIT_S, or any while MAX_WAITING_REFUSALS already
wait, is closed without an answer.
A connection's first bytes may wait, reading paused, for a later iteration of the loop
when many new connections arrive at once (budgets.py: `may_set_up`).
It runs unchanged on uvloop and on asyncio.
"""

import asyncio
import binascii
import socket
import struct
import time

import h2.exceptions

from ..api.errors import ApiError
from ..budgets import Holding
from ..writer.outbox import Outbox
from .events import BodyTooLarge, ConnectionClosed, Limits, MessageRequest, Request, UpgradeRequested
from .http1 import H1Session
from .http2 import H2Session

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PRI = b"PRI "       # how the HTTP/2 preface starts: no HTTP/1.1 method is spelled so
LINGER_S = 2.0      # after our FIN, how long to keep reading what the peer still sends
HELD_CHUNK = 64 * 1024      # output held while the transport is paused is kept in chunks of this size
REFUSAL_WAIT_S = 1.0        # a refused connection's first bytes, which name its protocol, are awaited this long
REFUSAL = b"the server is at its connection limit; retry later"
# over max_connections, HTTP/2: our (empty) SETTINGS, then GOAWAY(last stream 0, NO_ERROR, why)
REFUSED_H2 = (struct.pack(">HBBBI", 0, 0, 4, 0, 0)
              + struct.pack(">HBBBIII", 0, 8 + len(REFUSAL), 7, 0, 0, 0, 0) + REFUSAL)
# HTTP/1.1: 503 with Retry-After and an OpenAI error body
_REFUSED_BODY = ApiError(503, REFUSAL.decode(), code="too_many_connections").body()
REFUSED_H1 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
              b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


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
        self.connected_at = self.last_active = time.monotonic()
        self.served_any = False         # a complete request arrived: the handshake deadline is met
        self.paused_at = 0.0            # monotonic s when the transport paused
        self.close_cause = None         # why we end it (flood.CLOSE_CAUSES); None: the peer did
        self.num_held_bytes = 0         # output held while the transport is paused
        self._held: list[bytearray] = []    # chunks of up to HELD_CHUNK, not an object per write (~50 bytes
                                            # each beside its payload); one size, so freed ones are reused
        self._control_at_pause = 0      # session.num_control_frames when the transport paused
        self._shutdown_at = 0.0         # when the idle deadline began a graceful close
        self._sniffed = b""
        self._linger = None
        self.budget = app.budget        # the server-wide totals (budgets.py)
        self.holding = Holding(self)    # what this connection holds, as the budget counted it
        self.refused = False            # over max_connections: answered and closed, never served
        self._refusal_wait = None       # the timer of a refused connection waiting for its first bytes
        self._waiting = None            # first bytes waiting for their turn to set up a session (budgets.py)

    # -------------------------------------------------------- transport side

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.budget.admits():
            self._refuse()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.limits.socket_send_buffer:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.socket_send_buffer)
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
        if self.session is None:
            if self.refused:
                self._answer_refused(data)
                return
            if not self.budget.may_set_up(self):
                self._waiting = data            # a burst of new connections: its turn comes in a later
                self.transport.pause_reading()  # iteration of the loop (budgets.py); the kernel keeps the rest
                return
            data = self._sniff(data)
            if self.session is None:
                return
        events = self.session.receive_data(data)
        if events:
            self.last_active = time.monotonic()     # events, not bytes, are activity
            self._dispatch(events)
        if not self.closing:            # (after the app: it may keep a gRPC message, http2.py `keep_message`)
            num_body_bytes = self.session.num_body_bytes
            if num_body_bytes != self.holding.body.bytes:
                self.budget.body.hold(self.holding.body, num_body_bytes)
        self.flush()

    def eof_received(self):
        return None     # close our side too; connection_lost cancels what was in flight

    def connection_lost(self, exc) -> None:
        self.closing = True
        if self._linger is not None:
            self._linger.cancel()
        self._held.clear()              # now, not when the collector finds this connection's cycles
        self.num_held_bytes = 0
        if self._refusal_wait is not None:
            self._end_refusal_wait()
        self.budget.closed(self.holding)
        self.app.connection_lost(self)
        self._break_cycles()

    def _break_cycles(self) -> None:
        """Once nothing can reach this connection any more (the app dropped its streams), undo
        the reference cycles it is made of, so that reference counting frees it now, a little
        at each close, instead of the collector all at once: after 2,000 connections closed,
        the full collection that found them held the loop 130-325 ms (about 70 objects each).
        The cycles: the outbox's and the budget's holding's back-references to this protocol,
        and h2's H2Connection, which refers to itself through the bound methods of its frame
        dispatch table (its attributes are dropped: nothing calls it after its connection is
        lost, every later path checks `closing` first)."""
        self.outbox.proto = None
        self.holding.forget_conn()
        conn = getattr(self.session, "conn", None)
        if conn is not None:
            vars(conn).clear()

    def pause_writing(self) -> None:
        self.paused = True
        self.paused_at = time.monotonic()
        if self.session is not None:
            self._control_at_pause = self.session.num_control_frames

    def resume_writing(self) -> None:
        self.paused = False
        if self._held and not self.closing:
            data = b"".join(self._held)
            self._held.clear()
            self.num_held_bytes = 0
            self.transport.write(data)
        self.flush()

    # ------------------------------------------------------------- app side

    def flush(self) -> None:
        """Write what the session produced in one transport write (hot path: once per step)."""
        if self.closing:
            return
        session = self.session
        data = session.data_to_send()
        if self.paused:
            if data:
                held = self._held
                if held and len(held[-1]) + len(data) <= HELD_CHUNK:
                    held[-1] += data
                else:
                    held.append(bytearray(data))
                self.num_held_bytes += len(data)
            self._check_backlog()
            return
        if data:
            self.transport.write(data)
        num_pending = session.num_pending_bytes        # not paused: nothing is held here
        if num_pending != self.holding.unsent.bytes:
            self.budget.unsent.hold(self.holding.unsent, num_pending)
        if num_pending > self.limits.max_unsent_bytes:
            self._check_backlog()
        elif session.wants_close:
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
        self.budget.release(self.holding)       # nothing more leaves after our FIN
        self._close_transport()

    def _close_transport(self) -> None:
        transport = self.transport
        if self.paused:         # the peer does not read: nothing more can reach it, drop what it owes
            transport.abort()
            return
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self._end_linger)
        else:
            transport.close()

    def _end_linger(self) -> None:
        if self.paused:
            self.transport.abort()      # still not reading: what it owes is dropped
        else:
            self.transport.close()

    def end(self, cause: str, message: str, calm: bool = True) -> None:
        """End the connection for one of its limits: HTTP/2 GOAWAY (ENHANCE_YOUR_CALM for an
        abuse, else NO_ERROR), every request on it cancelled, then close."""
        if self.closing:
            return
        self.close_cause = cause
        self.closing = True             # nothing more is written or read from here on
        session = self.session
        if session is not None:
            events = session.end_connection(cause, message, calm)
            data = session.data_to_send()
            if data and not self.paused:
                self.transport.write(data)
            if events:
                self.app.connection_ended(self)
        self._held.clear()
        self.num_held_bytes = 0
        self.budget.release(self.holding)
        self._close_transport()

    def check_deadlines(self, now: float) -> list:
        """The sweep (app.sweep, a few times per shortest deadline): end or reset what is past
        its deadline; -> stream ids reset for the write timeout (the app cancels them)."""
        if self.closing:
            return []
        limits = self.limits
        if not self.served_any and now - self.connected_at > limits.handshake_timeout_s:
            self.end("handshake_timeout", f"no complete request within {limits.handshake_timeout_s:g} s", calm=False)
            return []
        if self.paused and now - self.paused_at > limits.write_timeout_s:
            self.end("write_timeout", f"the peer read nothing for {limits.write_timeout_s:g} s")
            return []
        expired = []
        if self.session is not None and self.session.num_pending_bytes:
            expired = self.session.expire_stalled(time.monotonic_ns() - int(limits.write_timeout_s * 1e9))
            if expired:
                self.flush()
        if self.outbox.streams:
            self.last_active = now
        elif now - self.last_active > limits.idle_timeout_s:
            self._close_idle(now)
        return expired

    def _close_idle(self, now: float) -> None:
        """Idle: GOAWAY and close once the streams are done; one handshake deadline later
        (a stream whose request never completes), closed anyway."""
        if not self._shutdown_at:
            self._shutdown_at = now
            self.close_cause = self.close_cause or "idle"
            self.begin_shutdown()
        elif now - self._shutdown_at > self.limits.handshake_timeout_s:
            self.end("idle", f"idle for {self.limits.idle_timeout_s:g} s", calm=False)

    def _check_backlog(self) -> None:
        """Unsent output and owed control frames within their caps, else the connection ends."""
        session, limits = self.session, self.limits
        unsent = self.num_held_bytes + session.num_pending_bytes
        if unsent > limits.max_unsent_bytes:
            self.end("unsent_bytes", f"{unsent} bytes unsent, over the limit of {limits.max_unsent_bytes}")
        elif self.paused and session.num_control_frames - self._control_at_pause > limits.max_queued_control_frames:
            self.end("control_frame_backlog", f"more than {limits.max_queued_control_frames} control frames "
                     "queued for a peer that does not read")
        elif unsent != self.holding.unsent.bytes:
            self.budget.unsent.hold(self.holding.unsent, unsent)

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
        """Choose HTTP/2 (prior knowledge) or HTTP/1.1 from the first bytes. A session is made
        only once the bytes decide (the whole preface, or where they leave it), so a client
        trickling the preface costs a buffer of at most 23 bytes, no session. Bytes that start
        `PRI ` and then leave the preface go to HTTP/2 too: its session answers them with
        GOAWAY PROTOCOL_ERROR; with `http2_only`, so do all other bytes (RFC 9113 3.4)."""
        buf = self._sniffed + data
        n = min(len(buf), len(PREFACE))
        if n < len(PREFACE) and buf[:n] == PREFACE[:n]:
            self._sniffed = buf
            return b""
        self._sniffed = b""
        http2 = self.limits.http2_only or buf[:len(PRI)] == PRI
        self.session = H2Session(self.limits) if http2 else H1Session(self.limits)
        return buf

    def set_up_now(self) -> None:
        """Its turn came (budgets.py): the first bytes that waited go in, and reading resumes."""
        data, self._waiting = self._waiting, None
        if not self.closing:
            self.transport.resume_reading()
            self.data_received(data)

    def _refuse(self) -> None:
        """Over max_connections: no session; answered in its protocol (see the module's
        docstring) once known: at once with TLS ALPN or http2_only, else when the first bytes come."""
        self.refused = True
        self.close_cause = "max_connections"
        ssl_object = self.transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        if self.limits.http2_only or alpn == "h2":
            self._answer_refused(PRI)
        elif alpn is not None:
            self._answer_refused(b"HTTP/1.1")
        elif self.budget.begin_refusal():
            self._refusal_wait = asyncio.get_running_loop().call_later(REFUSAL_WAIT_S, self._give_up_refusal)
        else:
            self.closing = True
            self.transport.abort()

    def _answer_refused(self, data: bytes) -> None:
        buf = self._sniffed + data
        if len(buf) < len(PRI) and PRI.startswith(buf):
            self._sniffed = buf         # may still become `PRI `
            return
        if self._refusal_wait is not None:
            self._end_refusal_wait()
        self.transport.write(REFUSED_H2 if buf.startswith(PRI) else REFUSED_H1)
        self.close()

    def _give_up_refusal(self) -> None:
        """A refused connection said nothing that names its protocol: closed without an answer."""
        self._end_refusal_wait()
        self.closing = True
        self.transport.close()

    def _end_refusal_wait(self) -> None:
        self._refusal_wait.cancel()
        self._refusal_wait = None
        self.budget.end_refusal()

    def _dispatch(self, events: list) -> None:
        last = type(events[-1])
        if last is UpgradeRequested:     # h11 pauses after an upgrade offer: always last
            events = events[:-1] + self._upgrade(events[-1])
        elif last is ConnectionClosed and self.close_cause is None:
            self.close_cause = events[-1].cause
        if not self.served_any:
            self.served_any = any(type(ev) in (Request, MessageRequest, BodyTooLarge) for ev in events)
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
