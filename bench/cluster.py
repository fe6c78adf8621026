"""Local tokenwire replicas and HAProxy on 127.0.0.1: what `tokenwire bench deploy` and the
deploy tests start, stop, kill and read.

Rules:
- Every process gets a port chosen before it starts (so the time to `/health` 200 can be
  measured from the moment of launch) and a log file (so a full pipe never stalls it).
- A server counts as started when `GET /health` answers 200; a process that exits first is
  an error quoting the end of its log.
- HAProxy is started on deploy/haproxy.cfg exactly as shipped; only the environment
  variables that file documents (addresses of the listener, the stats page, the replicas)
  differ.
"""

import csv
import http.client
import io
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HEALTH_POLL_S = 0.005


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(port: int, timeout_s: float = 1.0) -> Optional[int]:
    """GET /health over HTTP/1.1 -> the status code, or None when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@dataclass
class Process:
    """A started server: its process, port and log."""
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    started_s: float = 0.0          # launch to /health 200 (0 until it is up)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        """Kill it if it still runs (cleanup; graceful stops use signal() and wait())."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_tokenwire(command: list, serve_args: list, log_path: Path, name: str = "tokenwire",
                    port: Optional[int] = None, env: Optional[dict] = None, cwd=None,
                    timeout_s: float = 300) -> Process:
    """`<command> serve --port P <serve_args>` (command: the binary, or python -m tokenwire);
    returns once /health answers 200, with the launch-to-200 time in `started_s`."""
    port = port or free_port()
    with open(log_path, "wb") as log:
        launched = time.monotonic()
        proc = subprocess.Popen([*command, "serve", "--port", str(port), *serve_args], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd)
    served = Process(name, proc, port, Path(log_path))
    try:
        deadline = launched + timeout_s
        while health_status(port) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{served.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy after {timeout_s:g} s:\n{served.log_tail()}")
            time.sleep(HEALTH_POLL_S)
        served.started_s = time.monotonic() - launched
    except BaseException:
        served.stop()
        raise
    return served


def start_haproxy(config: Path, replica_ports: list, log_path: Path, timeout_s: float = 30) -> tuple:
    """HAProxy on `config` in the foreground, fronting two replicas -> (Process, stats_port).
    Returns once every replica is UP in its health checks."""
    assert len(replica_ports) == 2, "deploy/haproxy.cfg names two replicas"
    port, stats_port = free_port(), free_port()
    env = {**os.environ, "TOKENWIRE_LB_BIND": f"127.0.0.1:{port}", "TOKENWIRE_LB_STATS": f"127.0.0.1:{stats_port}",
           "TOKENWIRE_REPLICA_1": f"127.0.0.1:{replica_ports[0]}",
           "TOKENWIRE_REPLICA_2": f"127.0.0.1:{replica_ports[1]}"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT, env=env)
    lb = Process("haproxy", proc, port, Path(log_path))
    try:
        wait_until_servers(stats_port, {"replica1": "UP", "replica2": "UP"}, timeout_s, lb)
    except BaseException:
        lb.stop()
        raise
    return lb, stats_port


def haproxy_stats(stats_port: int) -> dict:
    """The stats page as {(proxy, server): {field: value}} (HAProxy's CSV, fields as named there)."""
    conn = http.client.HTTPConnection("127.0.0.1", stats_port, timeout=5)
    try:
        conn.request("GET", "/stats;csv")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {(row["pxname"], row["svname"]): row for row in rows}


def server_counter(stats: dict, server: str, field: str) -> int:
    """One counter of one replica, summed over the backends that list it."""
    return sum(int(row[field] or 0) for (proxy, name), row in stats.items() if name == server)


def wait_until_servers(stats_port: int, wanted: dict, timeout_s: float, lb: Optional[Process] = None) -> None:
    """Until every replica in `wanted` ({server: "UP"|"DOWN"}) has that status in every backend."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        if lb is not None and lb.proc.poll() is not None:
            raise RuntimeError(f"haproxy exited with {lb.proc.returncode}:\n{lb.log_tail()}")
        try:
            stats = haproxy_stats(stats_port)
            seen = {name: row["status"] for (proxy, name), row in stats.items() if name in wanted}
            if all(all(row["status"] == wanted[name] for (proxy, name), row in stats.items() if name == n)
                   and n in seen for n in wanted):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"haproxy: replicas not {wanted} after {timeout_s:g} s (last seen {seen})")
