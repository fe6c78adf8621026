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
REQUESTS = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed")


class H2loadResult(NamedTuple):
    num_requests: int
    num_succeeded: int
    wall_s: float
    requests_per_s: float


def available() -> bool:
    return shutil.which("h2load") is not None


def run_h2load(url: str, body: bytes, headers: tuple, num_requests: int, concurrency: int,
               num_connections: int = 1, timeout_s: float = 300) -> Optional[H2loadResult]:
    """Run h2load with `concurrency` streams over `num_connections` connections; None if it is missing."""
    if not available():
        return None
    streams_per_connection = max(1, -(-concurrency // num_connections))
    with tempfile.NamedTemporaryFile(suffix=".body", delete=False) as f:
        f.write(body)
    try:
        cmd = ["h2load", "-n", str(num_requests), "-c", str(num_connections), "-m", str(streams_per_connection),
               "-d", f.name] + [a for name, value in headers for a in ("-H", f"{name}: {value}")] + [url]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    finally:
        os.unlink(f.name)
    return parse_output(out.stdout + out.stderr)


def parse_output(text: str) -> H2loadResult:
    finished, requests = FINISHED.search(text), REQUESTS.search(text)
    if finished is None or requests is None:
        raise RuntimeError(f"could not read h2load's output:\n{text[-1500:]}")
    wall = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
    return H2loadResult(int(requests.group(1)), int(requests.group(4)), wall, float(finished.group(3)))
