"""bench/: the C and Node load clients against a real `tokenwire serve --backend mock`, the
server-side TTFT read from the streams' own timings, and the minimal h2 peer (h2-minimal):
the same chunks as the FastAPI peers, and a small flow-control window from a real h2 client."""

import asyncio
import functools
import shutil
import socket

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import orjson
import pytest

from tokenwire.bench import fast_client, loadgen
from tokenwire.bench.load import make_target
from tokenwire.bench.peers.mock_source import token_sequence
from tokenwire.bench.peers.runner import HOST, free_port
from tokenwire.bench.wire import StreamRecord, count_sse

from peer_servers import start_peer

MAX_TOKENS = 7


@pytest.fixture(scope="module")
def servers():
    """name -> port for peers started on demand (each its own process), stopped at the end."""
    started, ports = [], {}

    def start(name):
        if name not in ports:
            port, server = start_peer(name, MAX_TOKENS)
            started.append(server)
            ports[name] = (port, server.pid)
        return ports[name]
    yield start
    for server in started:
        server.stop()


# ---------------------------------------------------------------- server-side TTFT from the chunks

def _tokenwire_stream(texts, ttft_us):
    """SSE bytes shaped like tokenwire's: token chunks, a finish chunk with no text and the timings, [DONE]."""
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    events = [dict(head, choices=[{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]) for t in texts]
    events.append(dict(head, choices=[{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
                       timings={"tokenize_us": 5.0, "ttft_us": ttft_us, "total_us": ttft_us + 100}))
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_server_ttft_distribution_from_the_last_chunk():
    records = []
    for i, ttft in enumerate([100.0, 200.0, 300.0, 400.0, 500.0]):
        rec = StreamRecord(0)
        body = _tokenwire_stream(["a", " b", " c"], ttft)
        cut = len(body) - 40 - i                         # the finish chunk split across two DATA frames
        for piece in (body[:cut], body[cut:]):
            rec.token_ns.extend([1000 * (len(rec.token_ns) + 1)] * count_sse(rec, piece, 0, len(piece)))
        rec.end_ns = 10_000
        records.append(rec)
    assert [len(r.token_ns) for r in records] == [3] * 5     # the finish chunk and [DONE] are no tokens
    assert loadgen.server_ttft_us(records) == [100.0, 200.0, 300.0, 400.0, 500.0]
    row = loadgen.summarize_level(records, 10**6, 10**5, None, 3)
    assert row["server_ttft_us_p50"] == 300.0 and row["server_ttft_us_p90"] == pytest.approx(460.0)
    assert row["server_ttft_us_p99"] == pytest.approx(496.0) and row["ttft_us_p50"] == 1.0


def test_server_ttft_is_absent_without_timings():
    rec = StreamRecord(0)
    rec.token_ns, rec.end_ns = [5, 6], 9
    row = loadgen.summarize_level([rec], 10**6, 10**5, None, 2)
    assert loadgen.server_ttft_us([rec]) == [] and row["server_ttft_us_p50"] != row["server_ttft_us_p50"]  # NaN


def test_c_client_tail_takes_off_closing_events():
    rec = StreamRecord(0)
    body = _tokenwire_stream(["x", "y"], 42.0)
    rec.token_ns = [1, 2, 3, 4]                             # the C client stamps every event: 2 + finish + [DONE]
    fast_client.drop_closing_events(rec, body[-4096:])
    assert rec.token_ns == [1, 2] and rec.timings["ttft_us"] == 42.0


# ---------------------------------------------------------------- the fast clients, real server

def _clients():
    return ["c", pytest.param("node", marks=pytest.mark.skipif(
        shutil.which("node") is None, reason="Node.js is not installed (scripts/test.sh installs nodejs)"))]


@pytest.mark.parametrize("client", _clients())
def test_fast_client_against_tokenwire(servers, client):
    port, pid = servers("tokenwire")
    target = make_target(HOST, port, "/v1/completions", "h2", "sse", 4, MAX_TOKENS)
    row = asyncio.run(fast_client.run_level(target, 3, 12, num_warmup=2, client=client, server_pid=pid,
                                            expected_tokens=MAX_TOKENS))
    assert row["num_errors"] == 0, row["first_error"]
    assert row["num_tokens"] == 12 * MAX_TOKENS and row["num_count_mismatches"] == 0
    assert row["client"] == client and row["cpu_us_per_token"] > 0 and row["client_cpu_us_per_token"] > 0
    assert row["server_timings_us_p50"]["ttft_us"] > 0
    # the server's TTFT lies inside the client's: headers complete -> first bytes written
    assert 0 < row["server_ttft_us_p50"] < row["ttft_us_p50"] <= row["e2e_us_p50"]


@pytest.mark.parametrize("client", _clients())
def test_fast_client_counts_a_peer_without_timings(servers, client):
    port, _ = servers("h2-minimal")                         # the last token carries finish_reason "length"
    target = make_target(HOST, port, "/v1/completions", "h2", "sse", 4, MAX_TOKENS)
    row = asyncio.run(fast_client.run_level(target, 2, 6, num_warmup=1, client=client, expected_tokens=MAX_TOKENS))
    assert row["num_errors"] == 0 and row["num_tokens"] == 6 * MAX_TOKENS and row["num_count_mismatches"] == 0
    assert row["server_timings_us_p50"] is None


def test_fast_client_reports_a_refused_connection():
    target = make_target(HOST, free_port(), "/v1/completions", "h2", "sse", 4, 2)
    with pytest.raises(ConnectionError, match="c client: cannot connect"):
        asyncio.run(fast_client.run_level(target, 1, 1, num_warmup=0, client="c"))


def test_fast_client_refuses_what_it_cannot_speak():
    with pytest.raises(ValueError, match="HTTP/2 with sse"):
        fast_client.check("c", make_target(HOST, 1, "/v1/completions", "h1", "sse", 1, 1))
    with pytest.raises(ValueError, match="closed and staggered levels only"):
        fast_client.check("c", make_target(HOST, 1, "/v1/completions", "h2", "sse", 1, 1), mode="open")


# ---------------------------------------------------------------- the minimal h2 peer

def _chunks(body: bytes) -> list:
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    for event, chunk in zip(events, chunks):
        assert event == b"data: " + orjson.dumps(chunk)     # compact JSON, as tokenwire writes it
    return [dict(c, id=None, created=None) for c in chunks]


def test_h2_minimal_streams_the_fastapi_peers_chunks(servers):
    bodies = {}
    for name in ("h2-minimal", "hypercorn"):
        port, _ = servers(name)
        with httpx.Client(http2=True, http1=False) as client:
            r = client.post(f"http://{HOST}:{port}/v1/completions",
                            json={"prompt": "a a a", "max_tokens": MAX_TOKENS, "stream": True})
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        assert r.headers["content-type"].startswith("text/event-stream")
        bodies[name] = r.content
    mine = _chunks(bodies["h2-minimal"])
    theirs = [dict(orjson.loads(e[6:]), id=None, created=None)
              for e in bodies["hypercorn"].split(b"\n\n") if e.startswith(b"data: {")]
    assert mine == theirs and len(mine) == MAX_TOKENS       # one chunk per token, the same fields and texts
    _, texts = token_sequence()
    assert [c["choices"][0]["text"] for c in mine] == texts[:MAX_TOKENS]


def test_h2_minimal_rejects_bad_requests(servers):
    port, _ = servers("h2-minimal")
    with httpx.Client(http2=True, http1=False) as client:
        bad = client.post(f"http://{HOST}:{port}/v1/completions", content=b"{not json")
        missing = client.get(f"http://{HOST}:{port}/nowhere")
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_h2_minimal_waits_for_a_small_window(servers):
    """A real h2 client opens a 10-byte stream window: h2 itself would raise on any DATA past it."""
    port, _ = servers("h2-minimal")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    body = orjson.dumps({"prompt": "a", "max_tokens": 3, "stream": True})
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        acked = False
        while not acked:                                    # our 10-byte window applies once the server ACKs it
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            acked = any(isinstance(e, h2.events.SettingsAcknowledged) for e in conn.receive_data(data))
        conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                              (":path", "/v1/completions"), ("content-type", "application/json")])
        conn.send_data(1, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        received, frame_sizes, ended = b"", [], False
        while not ended:
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += event.data
                    frame_sizes.append(len(event.data))
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                ended |= isinstance(event, h2.events.StreamEnded)
            sock.sendall(conn.data_to_send())
    assert max(frame_sizes) <= 10 and len(frame_sizes) > 3 * 10
    assert [c["choices"][0]["text"] for c in _chunks(received)] == token_sequence()[1][:3]


def test_c_client_staggered_starts_streams_apart_and_reports_every_request(servers):
    """--mode staggered in C: the first streams start spread / concurrency apart, each starts
    again as it ends, the window opens at request WARMUP and closes when the last measured one
    ends; every request comes back (the drain too), the measured ones flagged."""
    port, _ = servers("tokenwire")
    target = make_target(HOST, port, "/v1/completions", "h2", "sse", 4, MAX_TOKENS)
    concurrency, warmup, requests, spread_s = 4, 4, 12, 0.2
    argv = fast_client.argv("c", target, concurrency, requests, warmup, 1, spread_s)

    async def run():
        child = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(child.communicate(b""), 60)   # staggered: stdin is not read
        return [orjson.loads(line) for line in out.splitlines()]
    lines = asyncio.run(run())
    assert lines[0] == {"warm": True}
    done, docs = lines[1]["done"], lines[2:]
    assert len(docs) >= warmup + requests and all(d["error"] is None and d["status"] == 200 for d in docs)
    assert [i for i, d in enumerate(docs) if d["measured"]] == list(range(warmup, warmup + requests))
    gap_ns = spread_s / concurrency * 1e9                # times are from the staggered phase's start
    assert all(d["start_ns"] >= i * gap_ns for i, d in enumerate(docs[:concurrency]))  # none before it is due
    opened, closed = done["window_ns"]
    assert docs[warmup]["start_ns"] >= opened and closed == max(d["end_ns"] for d in docs if d["measured"])
    assert done["wall_ns"] == closed - opened
    assert all(len(d["token_ns"]) > MAX_TOKENS for d in docs)                     # closing events still stamped


@pytest.mark.parametrize("client", ["c", "python"])
def test_staggered_throughput_counts_every_stream_in_the_window(servers, client):
    port, pid = servers("tokenwire")
    target = make_target(HOST, port, "/v1/completions", "h2", "sse", 4, MAX_TOKENS)
    run = loadgen.run_level if client == "python" else functools.partial(fast_client.run_level, client="c")
    row = asyncio.run(run(target, 4, 12, num_warmup=4, mode="staggered", spread_s=0.002, server_pid=pid,
                          expected_tokens=MAX_TOKENS))
    assert row["num_errors"] == 0 and row["num_tokens"] == 12 * MAX_TOKENS and row["num_count_mismatches"] == 0
    # every measured token lies in the window, and so may other streams' (how many: timing's business;
    # the count itself is test_tokens_within_counts_stamps_inside_the_bounds')
    assert row["tokens_per_s"] >= row["num_tokens"] / row["wall_s"] * (1 - 1e-9) and row["mode"] == "staggered"


def test_tokens_within_counts_stamps_inside_the_bounds():
    recs = []
    for stamps in ([1, 5, 10], [10, 11, 30], []):
        rec = StreamRecord(0)
        rec.token_ns = stamps
        recs.append(rec)
    assert loadgen.tokens_within((5, 11), recs) == 4 and loadgen.tokens_within((31, 40), recs) == 0
    row = loadgen.summarize_level(recs[:1], 10, 0, 20, 3, ((5, 11), recs))
    assert row["num_tokens"] == 3 and row["tokens_per_s"] == pytest.approx(4 / 10e-9)
    assert row["cpu_us_per_token"] == pytest.approx(20 / 1000 / 4)
