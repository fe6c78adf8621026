"""Two tokenwire replicas behind HAProxy on deploy/haproxy.cfg, all on 127.0.0.1, under h2load.

What is checked, with real processes only: thousands of streams through HAProxy with zero
errors, HTTP/2 (not HTTP/1.1) from HAProxy to the replicas with streams multiplexed over a
few connections; one conversation id always lands on one replica; killing a replica under
load cuts only the streams it was serving (HAProxy's per-server `srv_abrt` counts them; every
other request succeeds, retried onto the other replica when needed); SIGTERM on a replica
under load loses nothing (GOAWAY to HAProxy, its in-flight streams finish, it exits 0).

HAProxy 2.6 ends a client stream whose replica died mid-response with END_STREAM, not
RST_STREAM, so h2load counts such a stream as a success: the cut streams are counted on
HAProxy's side. A client tells them apart by the missing final event (`data: [DONE]`).
"""

import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tokenwire.bench.cluster import (haproxy_stats, server_counter, start_haproxy, start_tokenwire,
                                     wait_until_servers)
from tokenwire.bench.h2load import h2load_command, parse_output

from conftest import REPO

CONFIG = REPO / "deploy" / "haproxy.cfg"
PYTHON_TOKENWIRE = [sys.executable, "-m", "tokenwire"]
# 16 tokens at 2 ms a step: ~35 ms a stream, so a kill always finds streams in flight
REPLICA_ARGS = ["--backend", "mock", "--mock-step-us", "2000"]
BODY = b'{"prompt": "Once upon a time", "max_tokens": 16, "stream": true}'
CONCURRENCY = 64                    # streams in flight: 4 connections x 16
NUM_REQUESTS = 4000


def require_tools():
    missing = [tool for tool in ("haproxy", "h2load") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed (bash scripts/test.sh installs them from Debian)")


@pytest.fixture
def cluster(tmp_path):
    """Two mock replicas and HAProxy; -> (replicas, lb, stats_port, start_replica)."""
    require_tools()
    started = []

    def start_replica(index, port=None):
        replica = start_tokenwire(PYTHON_TOKENWIRE, REPLICA_ARGS, tmp_path / f"replica{index}-{len(started)}.log",
                                  name=f"replica{index}", port=port, timeout_s=120)
        started.append(replica)
        return replica

    replicas = [start_replica(1), start_replica(2)]
    lb, stats_port = start_haproxy(CONFIG, [r.port for r in replicas], tmp_path / "haproxy.log")
    started.append(lb)
    try:
        yield replicas, lb, stats_port, start_replica
    finally:
        for process in started:
            process.stop()


def h2load(url, tmp_path, num_requests=NUM_REQUESTS, headers=(("content-type", "application/json"),)):
    """h2load in the background; -> the Popen (stdout: its report)."""
    body = tmp_path / "body.json"
    body.write_bytes(BODY)
    cmd = h2load_command(url + "/v1/completions", str(body), headers, num_requests, CONCURRENCY, num_connections=4)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(run, timeout_s=120):
    out, _ = run.communicate(timeout=timeout_s)
    print(out)
    return parse_output(out)


def wait_for_progress(stats_port, server, min_responses, timeout_s=60):
    """Until HAProxy has seen `min_responses` answers from `server` and it has streams in flight."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = haproxy_stats(stats_port)
        if server_counter(stats, server, "hrsp_2xx") >= min_responses and server_counter(stats, server, "scur") > 0:
            return stats
        time.sleep(0.01)
    raise TimeoutError(f"{server} got no load")


@pytest.mark.slow
def test_h2load_through_haproxy_zero_errors_over_multiplexed_http2(cluster, tmp_path):
    replicas, lb, stats_port, _ = cluster
    result = finish(h2load(lb.url, tmp_path))
    assert result.num_requests == NUM_REQUESTS and result.num_succeeded == NUM_REQUESTS
    assert result.num_failed == 0 and result.num_errored == 0 and result.num_2xx == NUM_REQUESTS
    stats = haproxy_stats(stats_port)
    served = [server_counter(stats, f"replica{i}", "hrsp_2xx") for i in (1, 2)]
    assert sum(served) == NUM_REQUESTS and min(served) > NUM_REQUESTS // 10, served     # leastconn spreads
    backend = stats[("least_streams", "BACKEND")]
    assert int(backend["h2_backend_total_streams"]) >= NUM_REQUESTS              # HTTP/2 to the replicas ...
    assert int(backend["h1_total_streams"] or 0) == 0                            # ... never HTTP/1.1
    connections = sum(server_counter(stats, f"replica{i}", "connect") for i in (1, 2))
    assert connections <= NUM_REQUESTS // 20, connections                        # streams share connections
    for i, replica in enumerate(replicas, 1):
        assert replica.proc.poll() is None


@pytest.mark.slow
def test_a_conversation_id_keeps_one_replica(cluster, tmp_path):
    _, lb, stats_port, _ = cluster
    for conversation in ("conversation-1", "conversation-2", "conversation-3"):
        before = haproxy_stats(stats_port)
        result = finish(h2load(lb.url, tmp_path, num_requests=200,
                               headers=(("content-type", "application/json"), ("x-conversation-id", conversation))))
        assert result.num_succeeded == 200
        after = haproxy_stats(stats_port)
        per_replica = sorted(int(after[("by_conversation", f"replica{i}")]["hrsp_2xx"])
                             - int(before[("by_conversation", f"replica{i}")]["hrsp_2xx"]) for i in (1, 2))
        assert per_replica == [0, 200], (conversation, per_replica)


@pytest.mark.slow
def test_kill_one_replica_under_load_loses_only_its_streams_then_drain_the_other(cluster, tmp_path):
    (replica1, replica2), lb, stats_port, start_replica = cluster

    # 1. SIGKILL replica1 under load: only the streams it was serving are cut
    run = h2load(lb.url, tmp_path)
    before = wait_for_progress(stats_port, "replica1", min_responses=500)
    in_flight = server_counter(before, "replica1", "scur")
    replica1.signal(signal.SIGKILL)
    result = finish(run)
    after = haproxy_stats(stats_port)
    cut = server_counter(after, "replica1", "srv_abrt") - server_counter(before, "replica1", "srv_abrt")
    print(f"kill: {in_flight} streams in flight on replica1 a moment before SIGKILL, {cut} cut, "
          f"{result.num_requests - cut} of {result.num_requests} complete; redispatched from replica1 to replica2: "
          f"{server_counter(after, 'replica1', 'wredis')}")
    assert 1 <= cut <= CONCURRENCY
    assert server_counter(after, "replica2", "srv_abrt") == server_counter(before, "replica2", "srv_abrt")
    assert result.num_failed == 0 and result.num_errored == 0 and result.num_5xx == 0
    assert result.num_2xx == NUM_REQUESTS               # every request got its answer, the cut ones a truncated one
    assert server_counter(after, "replica2", "hrsp_2xx") > server_counter(before, "replica2", "hrsp_2xx")

    # 2. bring replica1 back on its port; HAProxy's health checks return it to the rotation
    replica1 = start_replica(1, port=replica1.port)
    wait_until_servers(stats_port, {"replica1": "UP"}, timeout_s=30)

    # 3. SIGTERM replica2 under load: GOAWAY, its in-flight streams finish, nothing is lost, exit 0
    run = h2load(lb.url, tmp_path)
    before = wait_for_progress(stats_port, "replica2", min_responses=500)
    goaways = int(before[("least_streams", "BACKEND")]["h2_goaway_rcvd"] or 0)
    replica2.signal(signal.SIGTERM)
    result = finish(run)
    assert replica2.wait(timeout_s=60) == 0
    after = haproxy_stats(stats_port)
    log_text = replica2.log_tail(num_chars=1 << 24)         # the whole log: access lines fill any tail
    drained = re.findall(r"shutting down: waiting for (\d+) requests in flight", log_text)
    print(f"drain: {drained}")
    assert drained and int(drained[0]) >= 1, log_text[-3000:]                     # it had streams to finish
    assert int(after[("least_streams", "BACKEND")]["h2_goaway_rcvd"] or 0) > goaways
    assert server_counter(after, "replica2", "srv_abrt") == server_counter(before, "replica2", "srv_abrt")
    assert result.num_succeeded == NUM_REQUESTS and result.num_failed == 0 and result.num_errored == 0
    assert replica1.proc.poll() is None


@pytest.mark.slow
def test_bench_deploy_prints_haproxy_beside_one_replica():
    require_tools()
    r = subprocess.run([*PYTHON_TOKENWIRE, "bench", "deploy", "--haproxy", str(CONFIG), "--rounds", "1",
                        "--h2load-requests", "300", "--requests", "10"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split("  ")[0]: line.split() for line in r.stdout.splitlines()
            if line.startswith(("haproxy -> 2 replicas", "one replica directly"))}
    assert len(rows) == 2, r.stdout
    for cells in rows.values():
        rps, errors = float(cells[-4]), int(cells[-3])
        assert rps > 0 and errors == 0, r.stdout
