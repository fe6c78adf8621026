"""h2load (nghttp2-client) as a reference client: the same requests, for `bench load --h2load`.

h2load is C on nghttp2, far cheaper per frame than any Python client, so when it and the
lean client reach the same requests/s on the same server, the lean client is not what
limits the measurement. Only throughput is compared: h2load's "time to 1st byte" is per
connection, not per stream, so it is no TTFT.
"""

import os
import re
import shutil
import subprocess
import tempfile
from typing import NamedTuple, Optional

FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")
REQUESTS = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed"
                      r"(?:, (\d+) errored)?")
STATUS_CODES = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")


class H2loadResult(NamedTuple):
    num_requests: int
    num_succeeded: int
    wall_s: float
    requests_per_s: float
    num_failed: int = 0         # h2load's "failed": errored, timed out, or a status outside 2xx/3xx
    num_errored: int = 0        # reset or broken streams and connections
    num_2xx: int = 0
    num_5xx: int = 0


def available() -> bool:
    return shutil.which("h2load") is not None


def run_h2load(url: str, body: bytes, headers: tuple, num_requests: int, concurrency: int,
               num_connections: int = 1, timeout_s: float = 300) -> Optional[H2loadResult]:
    """Run h2load with `concurrency` streams over `num_connections` connections; None if it is missing."""
    if not available():
        return None
    with tempfile.NamedTemporaryFile(suffix=".body", delete=False) as f:
        f.write(body)
    try:
        cmd = h2load_command(url, f.name, headers, num_requests, concurrency, num_connections)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    finally:
        os.unlink(f.name)
    return parse_output(out.stdout + out.stderr)


def h2load_command(url: str, body_path: str, headers: tuple, num_requests: int, concurrency: int,
                   num_connections: int = 1) -> list:
    """h2load's argv: `concurrency` streams spread over `num_connections` connections."""
    streams_per_connection = max(1, -(-concurrency // num_connections))
    return (["h2load", "-n", str(num_requests), "-c", str(num_connections), "-m", str(streams_per_connection),
             "-d", body_path] + [a for name, value in headers for a in ("-H", f"{name}: {value}")] + [url])


def parse_output(text: str) -> H2loadResult:
    finished, requests = FINISHED.search(text), REQUESTS.search(text)
    if finished is None or requests is None:
        raise RuntimeError(f"could not read h2load's output:\n{text[-1500:]}")
    wall = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
    codes = STATUS_CODES.search(text)
    return H2loadResult(int(requests.group(1)), int(requests.group(4)), wall, float(finished.group(3)),
                        num_failed=int(requests.group(5)), num_errored=int(requests.group(6) or 0),
                        num_2xx=int(codes.group(1)) if codes else 0, num_5xx=int(codes.group(4)) if codes else 0)
