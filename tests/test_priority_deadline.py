"""RFC 9218 priorities (the `priority` header and PRIORITY_UPDATE frames) mapped onto the
scheduler, and the HTTP per-request deadline (x-request-timeout-ms), against a real server."""

import asyncio
import json
import socket
import time

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

import tokenwire
from tokenwire.net.api.priority import urgency
from tokenwire.net.protocol.http2 import PRIORITY_UPDATE

from engines import engine_idle, wait_for

STEP_US = 2000


@pytest.fixture(scope="module")
def serial():
    """One running request at a time, so the order of admission is the order of completion."""
    s = tokenwire.Server(backend="mock", port=0, max_num_seqs=1, mock_step_us=STEP_US).start()
    yield s
    s.stop()


def test_urgency_parsing():
    assert urgency(None) == 3 and urgency("") == 3
    assert urgency("u=0") == 0 and urgency("u=7, i") == 7 and urgency("i, u=1") == 1
    assert urgency("u=1;x=2") == 1 and urgency("u=9") == 3 and urgency("u=a") == 3 and urgency("garbage") == 3


def test_urgent_request_admitted_ahead_of_background_queue(serial):
    finished = []

    async def one(client, name, priority, max_tokens):
        headers = {"priority": priority} if priority else {}
        r = await client.post("/generate", json={"prompt": "x", "max_tokens": max_tokens}, headers=headers)
        assert json.loads(r.text.splitlines()[-1])["finish_reason"] == "length"
        finished.append(name)

    async def main():
        async with httpx.AsyncClient(http1=False, http2=True, base_url=serial.url, timeout=30) as client:
            tasks = [asyncio.create_task(one(client, "running", "u=7", 20))]
            await asyncio.sleep(0.02)                   # it runs; the rest queue behind it
            for i in range(4):
                tasks.append(asyncio.create_task(one(client, f"background{i}", "u=7", 5)))
                await asyncio.sleep(0.002)
            tasks.append(asyncio.create_task(one(client, "default", None, 5)))
            await asyncio.sleep(0.002)
            tasks.append(asyncio.create_task(one(client, "urgent", "u=0, i", 5)))
            await asyncio.gather(*tasks)
    asyncio.run(main())
    assert finished[:3] == ["running", "urgent", "default"], finished
    assert finished[3:] == [f"background{i}" for i in range(4)], finished


def h2_request(conn, sid, path, body: bytes, headers=()):
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", path),
                            ("content-type", "application/json"), *headers])
    conn.send_data(sid, body, end_stream=True)



def priority_update(sid: int, value: bytes) -> bytes:
    """An RFC 9218 PRIORITY_UPDATE frame (type 0x10, on stream 0) for stream `sid`."""
    payload = sid.to_bytes(4, "big") + value
    return len(payload).to_bytes(3, "big") + bytes([PRIORITY_UPDATE, 0]) + (0).to_bytes(4, "big") + payload


def finishing_order(sock, conn, num_streams: int) -> list:
    """Read until `num_streams` streams ended (acknowledging their data) -> their ids in the order they ended."""
    order = []
    while len(order) < num_streams:
        data = sock.recv(65536)
        assert data
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.StreamEnded):
                order.append(ev.stream_id)
            elif isinstance(ev, h2.events.DataReceived):
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        sock.sendall(conn.data_to_send())
    return order


def test_priority_update_frame_moves_a_waiting_request_ahead(serial):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = json.dumps({"prompt": "x", "max_tokens": 5}).encode()
    with socket.create_connection(("127.0.0.1", serial.port)) as sock:
        h2_request(conn, 1, "/generate", json.dumps({"prompt": "x", "max_tokens": 100}).encode())
        sock.sendall(conn.data_to_send())
        while not any(isinstance(ev, h2.events.DataReceived) for ev in conn.receive_data(sock.recv(65536))):
            pass                                            # 1 runs (its first token came), not a timer's guess
        for sid in (3, 5, 7, 9):
            h2_request(conn, sid, "/generate", body)
        sock.sendall(conn.data_to_send())
        sock.sendall(priority_update(9, b"u=0"))           # stream 9, last to arrive, becomes urgent
        order = finishing_order(sock, conn, 5)
    assert order == [1, 9, 3, 5, 7], order


def test_priority_update_before_its_request_is_kept_and_applied(serial):
    """RFC 9218 7.1: a PRIORITY_UPDATE may come before its stream's HEADERS. Stream 9's
    (u=0) is sent before any of 3..9 opens, stream 7's (u=1) while its body still comes;
    both are applied when the requests arrive, so 9 then 7 are admitted before 3 and 5 (one
    request runs at a time; 1 is running, 100 steps, while the others queue)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = json.dumps({"prompt": "x", "max_tokens": 5}).encode()
    with socket.create_connection(("127.0.0.1", serial.port)) as sock:     # 1 runs while the rest arrive
        h2_request(conn, 1, "/generate", json.dumps({"prompt": "x", "max_tokens": 100}).encode())
        sock.sendall(conn.data_to_send() + priority_update(9, b"u=0"))
        while not any(isinstance(ev, h2.events.DataReceived) for ev in conn.receive_data(sock.recv(65536))):
            pass                                            # 1 runs: its first token came
        for sid in (3, 5):
            h2_request(conn, sid, "/generate", body)
        conn.send_headers(7, [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", "/generate"),
                              ("content-type", "application/json")])
        conn.send_data(7, body[:5])
        h2_request(conn, 9, "/generate", body)
        sock.sendall(conn.data_to_send() + priority_update(7, b"u=1"))
        conn.send_data(7, body[5:], end_stream=True)
        sock.sendall(conn.data_to_send())
        order = finishing_order(sock, conn, 5)
    assert order == [1, 9, 7, 3, 5], order


def test_priority_update_for_stream_zero_is_a_protocol_error(serial):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with socket.create_connection(("127.0.0.1", serial.port)) as sock:
        sock.sendall(conn.data_to_send() + priority_update(0, b"u=0"))
        events = []
        while not any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
            data = sock.recv(65536)
            if not data:
                break
            events += conn.receive_data(data)
    terminated = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert terminated and terminated[0].error_code == 1       # PROTOCOL_ERROR


# ------------------------------------------------------------------ deadlines

@pytest.fixture(scope="module")
def slow():
    s = tokenwire.Server(backend="mock", port=0, mock_step_us=STEP_US).start()
    yield s
    s.stop()


def wait_idle(server):
    assert wait_for(lambda: engine_idle(server), timeout=5), server.engine.stats()


def test_deadline_ends_a_stream_with_finish_reason_deadline(slow):
    with httpx.Client(http1=False, http2=True, base_url=slow.url, timeout=10) as client:
        start = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True},
                        headers={"x-request-timeout-ms": "60"})
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        assert r.status_code == 200 and time.monotonic() - start < 1.0
        assert chunks[-1]["choices"][0]["finish_reason"] == "deadline" and len(chunks) > 2
        assert r.text.endswith("data: [DONE]\n\n")
    wait_idle(slow)


def test_deadline_before_anything_was_sent_is_a_504(slow):
    with httpx.Client(http1=False, http2=True, base_url=slow.url, timeout=10) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200},
                        headers={"x-request-timeout-ms": "30"})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        bad = client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-timeout-ms": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout-ms"
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3},
                         headers={"x-request-timeout-ms": "5000"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(slow)
