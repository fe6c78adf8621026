"""A small blocking HTTP/2 client on h2 and a plain socket, for tests that need control a
library client does not give: reset a stream mid-response, drop the TCP connection,
advertise a tiny window, open streams after a GOAWAY.
"""

import json
import socket

import h2.config
import h2.connection
import h2.events
import h2.settings


class RawH2:
    def __init__(self, host: str, port: int, window: int | None = None, timeout: float = 10.0,
                 rcvbuf: int | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:          # before connect, so the TCP window is small from the start
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.host = f"{host}:{port}"
        self.flush()
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.status: dict[int, bytes] = {}
        self.headers: dict[int, list] = {}
        self.trailers: dict[int, list] = {}
        self.goaway = None

    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)

    def post(self, path: str, body: dict, headers: list | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        raw = json.dumps(body).encode()
        self.conn.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                     (":authority", self.host), ("content-type", "application/json")]
                               + (headers or []))
        self.conn.send_data(sid, raw, end_stream=True)
        self.flush()
        return sid

    def get(self, path: str) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "GET"), (":path", path), (":scheme", "http"),
                                     (":authority", self.host)], end_stream=True)
        self.flush()
        return sid

    def read_once(self, ack: bool = True) -> list:
        """One recv; processes the frames; acknowledges DATA unless `ack` is False."""
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        events = self.conn.receive_data(chunk)
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self.data[ev.stream_id] = self.data.get(ev.stream_id, b"") + ev.data
                if ack:
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.ResponseReceived):
                self.status[ev.stream_id] = dict(ev.headers)[b":status"]
                self.headers[ev.stream_id] = ev.headers
            elif isinstance(ev, h2.events.TrailersReceived):
                self.trailers[ev.stream_id] = ev.headers
            elif isinstance(ev, h2.events.StreamEnded):
                self.ended.add(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                self.resets[ev.stream_id] = ev.error_code
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.goaway = ev
        self.flush()
        return events

    def read_until(self, predicate, ack: bool = True, max_reads: int = 100000) -> None:
        for _ in range(max_reads):
            if predicate():
                return
            self.read_once(ack)
        raise AssertionError("condition not reached")

    def reset(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id)
        self.flush()

    def close(self) -> None:
        self.sock.close()
