"""Load clients faster than Python, run as a child process: `--client c` and `--client node`.

At concurrency 64 a client's TTFT is mostly its own work on every token in flight: the lean
Python client (h2client.py) spends ~1.5 µs of its core per token, so it cannot resolve 1 ms
there. Two other clients run the same closed loop (the same request bytes, streams over
connections, SSE counting) and report per request:

  c     bench/cclient/h2_client.c: hand-written HTTP/2 framing over raw sockets, tens of ns per
        token; compiled here on first use with the system's C compiler into the cache directory
  node  bench/node/h2_client.mjs: Node's http2 module (nghttp2 in C, but a JavaScript stream
        object and event per DATA frame: ~7 µs per token measured, slower than Python at load)

`run_level` has loadgen.run_level's signature and returns the same row (closed loop; the C
client also staggered; with client="c"/"node"), so `tokenwire bench load --client` and `tokenwire bench peers --client` feed
the same reports. The child inherits this process's core pinning.

Stdio protocol (each program's header says it in full): the child warms up and prints
`{"warm": true}`; the server's CPU is read and a line sent; the child prints `{"done": ...}`
when the measured window closes (the server's CPU is read again), then one JSON line per
measured request, which becomes a `wire.StreamRecord` for `loadgen.summarize_level`.
"""

import asyncio
import base64
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import orjson

from .h2client import RequestTemplate
from .loadgen import Target, summarize_level
from .proc import cpu_delta_ns, read_cpu, read_host_ticks, steal_fraction
from .wire import SSE_DONE, StreamRecord, non_token_events

HERE = Path(__file__).resolve().parent
C_SOURCE = HERE / "cclient" / "h2_client.c"
NODE_SCRIPT = HERE / "node" / "h2_client.mjs"
CLIENTS = ("python", "c", "node")
FRAMINGS = {"c": ("sse",), "node": ("sse", "ndjson")}
CLIENT_MODES = {"c": ("closed", "staggered"), "node": ("closed",)}
TIMEOUT_S = 120.0           # a phase of the child (warm-up, measured window) that takes longer fails


def check(client: str, target: Target, mode: str = "closed") -> None:
    """ValueError naming what the client cannot do with this target."""
    if client == "python":
        return
    if target.protocol != "h2" or target.framing not in FRAMINGS[client]:
        raise ValueError(f"--client {client} speaks HTTP/2 with {' or '.join(FRAMINGS[client])} framing, "
                         f"not {target.protocol} with {target.framing}")
    if mode not in CLIENT_MODES[client]:
        raise ValueError(f"--client {client} runs {' and '.join(CLIENT_MODES[client])} levels only")
    check_available(client)


def check_available(client: str) -> None:
    """ValueError when the client cannot run here; builds the C client."""
    if client == "node" and shutil.which("node") is None:
        raise ValueError("--client node needs Node.js on PATH (apt install nodejs)")
    if client == "c":
        c_client_path()


def c_client_path() -> Path:
    """The compiled C client, built once per source version into the cache directory."""
    source = C_SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenwire" / "bench"
    binary = cache / f"h2_client-{hashlib.sha256(source).hexdigest()[:12]}"
    if binary.exists():
        return binary
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ValueError("--client c needs a C compiler (cc) to build bench/cclient/h2_client.c")
    cache.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(f".{os.getpid()}.tmp")
    built = subprocess.run([compiler, "-O2", "-o", str(partial), str(C_SOURCE)], capture_output=True, text=True)
    if built.returncode != 0:
        raise ValueError(f"building the C client failed: {built.stderr.strip()[-2000:]}")
    partial.replace(binary)
    return binary


def argv(client: str, target: Target, concurrency: int, num_requests: int, num_warmup: int,
         num_connections: int, spread_s: Optional[float] = None) -> list:
    """`spread_s`: the C client's staggered mode (None: closed loop)."""
    headers = [("content-type", target.content_type), *target.headers]
    if client == "c":
        template = RequestTemplate(f"{target.host}:{target.port}", target.path, target.body, headers)
        spread = [str(max(1, round(spread_s * 1e6)))] if spread_s is not None else []
        return [str(c_client_path()), target.host, str(target.port), str(num_connections), str(concurrency),
                str(num_warmup), str(num_requests), template.frames(1).hex(), *spread]
    config = {"url": f"http://{target.host}:{target.port}", "path": target.path,
              "body_b64": base64.b64encode(target.body).decode(), "headers": [list(h) for h in headers],
              "framing": target.framing, "concurrency": concurrency, "connections": num_connections,
              "requests": num_requests, "warmup": num_warmup}
    return [shutil.which("node"), str(NODE_SCRIPT), orjson.dumps(config).decode()]


async def run_level(target: Target, concurrency: int, num_requests: int, *, num_warmup: int, client: str,
                    num_connections: int = 1, mode: str = "closed", rate: Optional[float] = None,
                    server_pid: Optional[int] = None, expected_tokens: Optional[int] = None,
                    spread_s: float = 1.0) -> dict:
    """One level through the C or Node client: loadgen.run_level's row, with `client` set.
    Staggered (the C client): its throughput is every stream's tokens inside the window."""
    check(client, target, mode)
    staggered = mode == "staggered"
    child = await asyncio.create_subprocess_exec(
        *argv(client, target, concurrency, num_requests, num_warmup, num_connections,
              spread_s if staggered else None),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=2**24)
    try:
        await _expect(child, client, "warm")
        server_before, host_before = read_cpu(server_pid) if server_pid else None, read_host_ticks()
        child.stdin.write(b"go\n")
        child.stdin.close()
        done = (await _expect(child, client, "done"))["done"]
        server_after, host_after = read_cpu(server_pid) if server_pid else None, read_host_ticks()
        lines = (await asyncio.wait_for(child.stdout.read(), TIMEOUT_S)).splitlines()
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
    docs = [orjson.loads(line) for line in lines if line.strip()]
    every = [to_record(doc) for doc in docs]
    records = [rec for rec, doc in zip(every, docs) if doc.get("measured", 1)]
    server_ns = cpu_delta_ns(server_before, server_after) if server_before and server_after else None
    window = (tuple(done["window_ns"]), every) if staggered else None
    row = summarize_level(records, done["wall_ns"], done["cpu_ns"], server_ns, expected_tokens, window)
    row.update(concurrency=concurrency, mode=mode, rate=rate, protocol=target.protocol,
               num_connections=done["num_connections"], num_queued=0, client=client,
               host_steal=steal_fraction(host_before, host_after))
    if staggered:
        row["spread_s"] = spread_s
    return row


async def _expect(child, client: str, key: str) -> dict:
    """The child's next line, which must carry `key`; its fatal message or stderr otherwise."""
    line = await asyncio.wait_for(child.stdout.readline(), TIMEOUT_S)
    message = orjson.loads(line) if line.strip() else {}
    if key in message:
        return message
    if "fatal" in message:
        raise ConnectionError(f"{client} client: {message['fatal']}")
    await child.wait()
    why = (await child.stderr.read()).decode(errors="replace").strip().splitlines()[-5:]
    raise ConnectionError(f"{client} client exited with status {child.returncode}: {' | '.join(why) or line!r}")


def to_record(doc: dict) -> StreamRecord:
    """One request line of the child as the record the Python clients fill."""
    rec = StreamRecord(doc["start_ns"])
    rec.token_ns = doc["token_ns"]
    rec.end_ns = doc["end_ns"]
    rec.status = doc["status"]
    rec.error = doc["error"]
    rec.timings = doc.get("timings")
    if "tail_hex" in doc:
        drop_closing_events(rec, bytes.fromhex(doc["tail_hex"]))
    return rec


def drop_closing_events(rec: StreamRecord, tail: bytes) -> None:
    """The C client stamps every SSE event; take off the last ones that are not tokens ([DONE], a
    finish chunk with no text, a usage chunk: bench/wire.py's rule) and keep the server's timings."""
    if tail.endswith(b"data: " + SSE_DONE):
        closing = 1 + non_token_events(rec, tail)
        del rec.token_ns[len(rec.token_ns) - min(closing, len(rec.token_ns)):]
