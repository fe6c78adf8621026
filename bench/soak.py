"""`tokenwire bench soak`: many requests, many cancelled, then the server must be clean.

    tokenwire bench soak                       # 10k-request cancel soak, then a 100k-request h2load soak
    tokenwire bench soak --cancel 2000 --h2load 0

A server (`tokenwire serve --backend mock`) runs in its own process. The cancel soak sends
streaming requests from several threads, each on its own HTTP/2 connection, 16 streams at a
time, and abandons every one of them: most are reset after their first token, every 8th
batch is reset before any answer (within the rapid-reset budget), every 32nd connection is
dropped mid-stream instead. The h2load soak (nghttp2's h2load, when installed) sends
completed requests. After each: KV blocks used, requests running and waiting (all must
be 0), requests by outcome, and connections closed by reason, read from /metrics.
"""

import threading
import time

import h2.config
import h2.connection
import h2.events

from . import abuses
from .abuse import Served
from .h2load import run_h2load

BODY = b'{"prompt": "Once upon a time", "max_tokens": 200, "stream": true, "ignore_eos": true}'


def cancel_worker(port: int, num_requests: int, errors: list) -> None:
    """Abandon `num_requests` streaming requests (see the module docstring)."""
    try:
        _cancel_requests(port, num_requests, errors)
    except Exception as exc:        # the soak's own failure is an error too, never a silent short run
        errors.append(f"client thread failed: {type(exc).__name__}: {exc}")


def _cancel_requests(port: int, num_requests: int, errors: list) -> None:
    done, batch = 0, 0
    sock = conn = None
    while done < num_requests:
        if sock is None:
            sock, conn = _connect(port)
        n = min(16, num_requests - done)
        sids = [_post(conn) for _ in range(n)]
        sock.sendall(conn.data_to_send())
        batch += 1
        if batch % 8 == 0:                  # reset before any answer
            pass
        elif batch % 32 == 31:              # drop the connection mid-stream
            _read_until(sock, conn, sids, errors)
            sock.close()
            sock = conn = None
            done += n
            continue
        else:
            _read_until(sock, conn, sids, errors)
        for sid in sids:
            if sid in conn.streams and not conn.streams[sid].closed:      # it may have finished already
                conn.reset_stream(sid)
        sock.sendall(conn.data_to_send())
        done += n
    if sock is not None:
        sock.close()


def _connect(port: int):
    sock = abuses.connect(port, b"")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.settimeout(30)
    return sock, conn


def _post(conn) -> int:
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                            (":authority", abuses.HOST), ("content-type", "application/json")])
    conn.send_data(sid, BODY, end_stream=True)
    return sid


def _read_until(sock, conn, sids: list, errors: list) -> None:
    """Until every stream has data (its first token), or failed."""
    waiting = set(sids)
    while waiting:
        data = sock.recv(1 << 16)
        if not data:
            errors.append("connection closed by the server")
            return
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                waiting.discard(ev.stream_id)
            elif isinstance(ev, h2.events.ResponseReceived) and dict(ev.headers)[b":status"] != b"200":
                errors.append(f"status {dict(ev.headers)[b':status']}")
                waiting.discard(ev.stream_id)
            elif isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                errors.append(f"server ended stream {getattr(ev, 'stream_id', 0)}: {ev}")
                waiting.discard(getattr(ev, "stream_id", 0))
                if isinstance(ev, h2.events.ConnectionTerminated):
                    return
        out = conn.data_to_send()
        if out:
            sock.sendall(out)


def settle(served: Served, timeout_s: float = 30.0) -> dict:
    """/metrics once the engine holds nothing, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = served.metrics()
        clean = (m["tokenwire_kv_blocks_used"] == 0 and m["tokenwire_requests_running"] == 0
                 and m["tokenwire_requests_waiting"] == 0)
        if clean or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def report(name: str, m: dict, errors: list, wall_s: float) -> str:
    outcomes = {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("tokenwire_requests_total")}
    closed = {k.split('"')[1]: int(v) for k, v in m.items()
              if k.startswith("tokenwire_connections_closed_total") and v}
    return (f"{name}: {wall_s:.1f} s; kv_blocks_used {m['tokenwire_kv_blocks_used']:g}, running "
            f"{m['tokenwire_requests_running']:g}, waiting {m['tokenwire_requests_waiting']:g}; "
            f"client errors {len(errors)}{' ' + repr(errors[:3]) if errors else ''}; requests {outcomes}; "
            f"connections closed {closed}")


def add_arguments(parser) -> None:
    parser.add_argument("--cancel", type=int, default=10_000, help="requests in the cancel soak (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=8, help="cancel soak connections at once (default: %(default)s)")
    parser.add_argument("--h2load", type=int, default=100_000, help="requests in the h2load soak (default: %(default)s)")
    parser.add_argument("--mock-step-us", type=float, default=200.0, help="mock step time (default: %(default)s)")


def run(args) -> int:
    served = Served(mock_step_us=args.mock_step_us)
    failed = False
    try:
        if args.cancel:
            errors: list = []
            t0 = time.monotonic()
            share = -(-args.cancel // args.threads)
            threads = [threading.Thread(target=cancel_worker, args=(served.port, share, errors))
                       for _ in range(args.threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            m = settle(served)
            print(report(f"cancel soak, {share * args.threads} requests", m, errors, time.monotonic() - t0))
            failed |= bool(errors) or m["tokenwire_kv_blocks_used"] != 0 or m["tokenwire_requests_running"] != 0
        if args.h2load:
            body = b'{"prompt": "Once upon a time", "max_tokens": 8}'
            t0 = time.monotonic()
            result = run_h2load(f"http://{abuses.HOST}:{served.port}/v1/completions", body,
                                (("content-type", "application/json"),), args.h2load, concurrency=64,
                                num_connections=4, timeout_s=1800)
            m = settle(served)
            if result is None:
                print("h2load soak: h2load is not installed (Debian nghttp2-client)")
            else:
                errs = [] if result.num_succeeded == result.num_requests else [
                    f"{result.num_requests - result.num_succeeded} h2load requests failed"]
                print(report(f"h2load soak, {result.num_requests} requests ({result.requests_per_s:.0f} req/s)",
                             m, errs, time.monotonic() - t0))
                failed |= bool(errs) or m["tokenwire_kv_blocks_used"] != 0
        errors = [line for line in served.log if "Traceback" in line or "ERROR" in line or "Fatal" in line]
        print(f"server log: {len(served.log)} lines, {len(errors)} errors" + "".join("\n  " + e for e in errors[:10]))
        failed |= bool(errors)
    finally:
        served.stop()
    return 1 if failed else 0
