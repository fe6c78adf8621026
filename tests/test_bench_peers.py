"""bench peers: every peer streams the mock engine's exact text, one message per token, and
`tokenwire bench peers` runs all four servers on tiny settings and writes the rows it promises."""

import asyncio
import json
import subprocess
import sys

import grpc
import httpx
import orjson
import pytest

from tokenwire.bench.peers import grpc_proto, report
from tokenwire.bench.peers.mock_source import MockTokens, token_sequence
from tokenwire.bench.peers.runner import HOST, ServerProcess, free_port, peer_specs, wait_until_streaming
from tokenwire.bench.load import make_target
from tokenwire.bench.loadgen import run_level, wait_with_progress
from tokenwire.kernels.mock import MOCK_TEXT

from peer_servers import start_peer

MAX_TOKENS = 12


def test_mock_source_is_the_mock_executors_story():
    ids, texts = token_sequence()
    assert "".join(texts) == MOCK_TEXT                      # one full cycle decodes to the story

    async def collect():
        return [t async for t in MockTokens(0).stream(len(ids) + 3)]
    tokens = asyncio.run(collect())
    assert [t.token_id for t in tokens] == ids + ids[:3]    # cycles like the executor does
    assert [t.finish_reason for t in tokens][-2:] == [None, "length"]


def _expected_text(n: int) -> str:
    ids, texts = token_sequence()
    return "".join(texts[i % len(texts)] for i in range(n))


def _sse_texts(body: bytes) -> list:
    events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: ") and e != b"data: [DONE]"]
    return [c["choices"][0]["text"] for c in map(orjson.loads, events) if c["choices"]]


@pytest.fixture
def started():
    servers = []

    def start(name):
        port, server = start_peer(name, MAX_TOKENS)
        servers.append(server)
        return port
    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("name,http2", [("tokenwire", True), ("hypercorn", True), ("uvicorn", False)])
def test_http_peers_stream_the_same_text(started, name, http2):
    port = started(name)
    with httpx.Client(http2=http2, http1=not http2) as client:
        r = client.post(f"http://{HOST}:{port}/v1/completions",
                        json={"prompt": "a a a", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True})
    assert r.status_code == 200 and r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert r.headers["content-type"].startswith("text/event-stream")
    texts = _sse_texts(r.content)
    assert "".join(texts) == _expected_text(MAX_TOKENS)
    assert len(texts) in (MAX_TOKENS, MAX_TOKENS + 1)     # one chunk per token (+ tokenwire's finish chunk)


def test_grpc_peer_streams_the_same_text(started):
    port = started("grpc")
    pb2, pb2_grpc = grpc_proto.load()

    async def call():
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
            stub = pb2_grpc.MockGeneratorStub(channel)
            return [m async for m in stub.Generate(pb2.GenerateRequest(prompt="a", max_tokens=MAX_TOKENS))]
    replies = asyncio.run(call())
    assert len(replies) == MAX_TOKENS                       # one message per token
    assert "".join(m.text for m in replies) == _expected_text(MAX_TOKENS)
    assert [m.index for m in replies] == list(range(MAX_TOKENS)) and replies[-1].finish_reason == "length"


def test_bench_peers_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tokenwire", "bench", "peers", "--concurrency", "1,2", "--requests", "8",
         "--max-tokens", "6", "--floor-round-trips", "200", "--json", str(tmp_path / "p.json"),
         "--plot", str(tmp_path / "p.png")], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ping-pong floor" in out.stdout and "side by side" in out.stdout and "targets (tokenwire)" in out.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    rows = doc["rows"]
    assert {(r["server"], r["concurrency"]) for r in rows} == {
        (s, c) for s in ("tokenwire", "h2-minimal", "hypercorn", "uvicorn", "tokenwire-grpc", "grpc", "ceiling")
        for c in (1, 2)}
    for r in rows:
        for key in ("server", "concurrency", "ttft_p50_us", "ttft_p99_us", "cpu_us_per_token", "tokens_per_s"):
            assert r[key] is not None, (r["server"], key)
        assert r["num_errors"] == 0 and r["num_tokens"] == 8 * 6, r
        assert r["cpu_us_per_token"] > 0 and r["ttft_p50_us"] <= r["ttft_p99_us"]
    assert doc["floor"]["p50_us"] > 0 and not doc["failures"]
    ratios = out.stdout.split("TTFT p50 ratio")[1].split("(peer /")[0]
    assert "uvicorn" in ratios and "ceiling" not in ratios            # the ceiling is no peer
    assert "tokenwire-grpc CPU/token" in out.stdout
    assert "TTFT as the server timed it" in out.stdout and "lone stream (c=1): itl p50 and CPU/token" in out.stdout
    assert "TTFT p99 @2 server-side <= 1000 µs" in out.stdout
    tokenwire = next(r for r in rows if r["server"] == "tokenwire" and r["concurrency"] == 2)
    assert 0 < tokenwire["server_ttft_us_p99"] and tokenwire["client"] == "python"
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_peers_repeat_reports_medians_of_alternating_rounds(tmp_path):
    """--repeat 3: the server list runs three times, alternating; the report is on each figure's
    median over the rounds, with a table of ranges and the lone stream's paired ratios."""
    out = subprocess.run(
        [sys.executable, "-m", "tokenwire", "bench", "peers", "--servers", "tokenwire,h2-minimal", "--concurrency",
         "1,2", "--requests", "6", "--max-tokens", "5", "--floor-round-trips", "100", "--repeat", "3",
         "--json", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rounds = out.stdout.split("-- round ")
    assert len(rounds) == 4 and all(r.index("tokenwire:") < r.index("h2-minimal:") for r in rounds[1:])
    doc = json.loads((tmp_path / "p.json").read_text())
    assert len(doc["rounds"]) == 3
    assert sorted((r["server"], r["concurrency"]) for r in doc["rows"]) == [
        ("h2-minimal", 1), ("h2-minimal", 2), ("tokenwire", 1), ("tokenwire", 2)]
    for r in doc["rows"]:
        per_round = sorted(x["cpu_us_per_token"] for rows in doc["rounds"] for x in rows
                           if (x["server"], x["concurrency"]) == (r["server"], r["concurrency"]))
        assert r["num_rounds"] == 3 and r["cpu_us_per_token"] == per_round[1]      # the median of the three
        assert type(r["concurrency"]) is int and r["num_tokens"] == 6 * 5
    table = out.stdout.split("over 3 alternating rounds")[1]
    assert "tokenwire        3" in table and "h2-minimal       3" in table
    assert "tokenwire / h2-minimal, lone stream, per round: itl p50" in table and "(median" in table


def _row(server, concurrency, itl, cpu, ttft_p99=900.0, timings=None):
    """One level's row as bench peers measures it (the fields the report reads)."""
    return {"server": server, "client": "python", "concurrency": concurrency, "num_requests": 6, "num_errors": 0,
            "num_tokens": 30, "tokens_per_s": 1000.0 * concurrency, "itl_us_p50": itl, "e2e_us_p50": 5 * itl,
            "cpu_us_per_token": cpu, "ttft_us_p50": 100.0, "ttft_us_p99": ttft_p99, "server_ttft_us_p99": ttft_p99,
            "server_cpu_util": 0.5, "server_timings_us_p50": timings or {"queue_us": 10.0}}


def test_repeat_report_arithmetic_on_synthetic_rounds():
    """The --repeat report on fixed rounds: medians per figure (a count stays an integer some
    round had), and the lone stream's paired ratios per round, where a figure read as 0 (a few
    tokens of CPU can read 0 µs: the kernel advances a thread's runtime at a tick) is shown as
    "-" and left out of the median instead of dropping the line. The live run below only checks
    what does not depend on the machine's load."""
    rounds = [[_row("tokenwire", 1, 20.0, 30.0, timings={"queue_us": 5.0}), _row("h2-minimal", 1, 10.0, 30.0),
               _row("tokenwire", 2, 25.0, 8.0, 700.0)],
              [_row("tokenwire", 1, 30.0, 12.0), _row("h2-minimal", 1, 20.0, 0.0),
               _row("tokenwire", 2, 26.0, 9.0, 800.0, timings={"queue_us": 7.0})],
              [_row("tokenwire", 1, 60.0, 40.0), _row("h2-minimal", 1, 20.0, 20.0),
               _row("tokenwire", 2, 27.0, 7.0, 600.0)]]
    rows = {(r["server"], r["concurrency"]): r for r in report.median_rows(rounds)}
    assert set(rows) == {("tokenwire", 1), ("h2-minimal", 1), ("tokenwire", 2)}
    assert rows["tokenwire", 1]["itl_us_p50"] == 30.0 and rows["tokenwire", 1]["cpu_us_per_token"] == 30.0
    assert rows["h2-minimal", 1]["cpu_us_per_token"] == 20.0 and rows["tokenwire", 2]["ttft_us_p99"] == 700.0
    assert rows["tokenwire", 2]["server_timings_us_p50"] == {"queue_us": 10.0}
    assert rows["tokenwire", 1]["server_timings_us_p50"] == {"queue_us": 10.0}
    assert all(r["num_rounds"] == 3 and type(r["concurrency"]) is int for r in rows.values())
    table = report.rounds_table([report.summarize_servers(r, ["tokenwire", "h2-minimal"]) for r in rounds])
    line = next(t for t in table.splitlines() if "per round" in t)
    assert line == ("tokenwire / h2-minimal, lone stream, per round: itl p50 2.00, 1.50, 3.00 (median 2.00); "
                    "CPU/token 1.00, -, 2.00 (median 1.50)"), line
    unmeasured = [[_row("tokenwire", 1, 20.0, 30.0), _row("h2-minimal", 1, 10.0, 0.0)]]
    line = next(t for t in report.rounds_table([report.summarize_servers(unmeasured[0], ["tokenwire", "h2-minimal"])])
                .splitlines() if "per round" in t)
    assert line.endswith("itl p50 2.00 (median 2.00); CPU/token - (median -)"), line


def test_bench_peers_rejects_unknown_server():
    out = subprocess.run([sys.executable, "-m", "tokenwire", "bench", "peers", "--servers", "tokenwire,nginx"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nginx" in out.stderr and "Traceback" not in out.stderr


def test_bench_peers_trace_writes_tokenwires_timelines(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tokenwire", "bench", "peers", "--servers", "tokenwire", "--concurrency", "1",
         "--requests", "3", "--warmup", "0", "--max-tokens", "4", "--floor-round-trips", "20",
         "--trace", str(tmp_path / "trace.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    events = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in events if e.get("ph") == "X"]
    assert {"tokenize", "queue", "prefill", "decode", "request"} <= {e["name"] for e in spans}
    assert len({e["tid"] for e in spans}) >= 4          # the readiness probe and 3 measured requests


def test_ceiling_server_hands_request_bodies_back():
    """1000 request bodies are more than the 65535-byte connection window: it must reopen."""
    port = free_port()
    spec = peer_specs(port, 0.0, max_tokens=1)["ceiling"]
    server = ServerProcess(spec, None)
    try:
        target = make_target(HOST, port, spec.path, spec.protocol, spec.framing, 16, 1)
        assert len(target.body) * 1000 > 65535
        asyncio.run(wait_until_streaming(server, target, timeout_s=60))
        row = asyncio.run(run_level(target, 32, 1000, num_warmup=0, expected_tokens=1))
    finally:
        server.stop()
    assert row["num_errors"] == 0 and row["num_tokens"] == 1000


def test_a_stalled_level_fails_with_a_reason():
    async def main():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError, match="no stream finished for 1 s"):
            await wait_with_progress(never, [], 5, stall_s=1.0)
    asyncio.run(main())
