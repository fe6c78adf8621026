"""`tokenwire serve` as a process: SIGTERM drains (in-flight streams finish, new ones are
refused, exit 0), bad flags fail with one clear line, and with no --model the embedded
default model is built and served.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from h2.errors import ErrorCodes

from clients.rawh2 import RawH2

SERVE = [sys.executable, "-m", "tokenwire", "serve"]


class Served:
    """`tokenwire serve ...` in a subprocess; `port` is read from its startup log line."""

    def __init__(self, *args, env=None, ready="serving ", timeout=120, new_session=False):
        self.proc = subprocess.Popen(SERVE + ["--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})}, start_new_session=new_session)
        self.log = []
        self.port = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("tokenwire serve exited early:\n" + "".join(self.log))
            self.log.append(line)
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match.group(1))
            if ready in line and self.port:
                return
        raise AssertionError("tokenwire serve did not become ready:\n" + "".join(self.log))

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout=30):
        rc = self.proc.wait(timeout)
        self.log.append(self.proc.stdout.read())
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigterm_drains_inflight_streams_refuses_new_ones_and_exits_0():
    served = Served("--backend", "mock", "--mock-step-us", "10000")
    try:
        c = RawH2("127.0.0.1", served.port)
        sid = c.post("/v1/completions", {"prompt": "hi", "max_tokens": 40, "stream": True})
        curl = subprocess.Popen(["curl", "-sSN", "--http2-prior-knowledge", "-H", "content-type: application/json",
                                 "-d", json.dumps({"prompt": "hi", "max_tokens": 40, "stream": True}),
                                 served.url + "/v1/completions"], stdout=subprocess.PIPE, text=True)
        curl_first = curl.stdout.readline()             # curl is streaming before the signal
        assert curl_first.startswith("data: ")
        h1_lines = []
        h1_client = httpx.Client(base_url=served.url, timeout=30)          # and an HTTP/1.1 stream
        h1_response = h1_client.send(h1_client.build_request(
            "POST", "/generate", json={"prompt": "hi", "max_tokens": 40}), stream=True)
        h1_iter = h1_response.iter_lines()
        h1_lines.append(next(h1_iter))
        c.read_until(lambda: c.data.get(sid, b"").count(b"data:") >= 3)
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        late = c.post("/v1/completions", {"prompt": "late", "max_tokens": 2})      # same connection: refused
        c.read_until(lambda: late in c.resets and sid in c.ended)
        assert c.resets[late] == ErrorCodes.REFUSED_STREAM
        events = [e for e in c.data[sid].decode().split("\n\n") if e.startswith("data: ")]
        assert len(events) == 42 and events[-1] == "data: [DONE]"                  # 40 tokens, finish, DONE
        with pytest.raises(OSError):                                               # new connections: refused
            socket.create_connection(("127.0.0.1", served.port), timeout=2).close()
        c.read_until(lambda: c.goaway is not None)
        assert c.goaway.error_code == 0
        c.close()
        curl_out, _ = curl.communicate(timeout=30)
        curl_out = curl_first + curl_out
        assert curl.returncode == 0 and curl_out.count("data: ") == 42 and curl_out.endswith("data: [DONE]\n\n")
        h1_lines.extend(h1_iter)
        h1_client.close()
        assert len(h1_lines) == 41 and json.loads(h1_lines[-1])["finish_reason"] == "length"
        assert served.wait() == 0
    finally:
        served.kill()


def test_sigterm_to_the_group_drains_an_engine_process_server_too():
    """A service manager signals every process of the group: the engine process ignores it,
    the front end drains its stream, then stops the engine process and exits 0."""
    served = Served("--backend", "mock", "--mock-step-us", "10000", "--engine-process", new_session=True)
    try:
        c = RawH2("127.0.0.1", served.port)
        sid = c.post("/v1/completions", {"prompt": "hi", "max_tokens": 40, "stream": True})
        c.read_until(lambda: c.data.get(sid, b"").count(b"data:") >= 3)
        os.killpg(served.proc.pid, signal.SIGTERM)
        c.read_until(lambda: sid in c.ended)
        events = [e for e in c.data[sid].decode().split("\n\n") if e.startswith("data: ")]
        assert len(events) == 42 and events[-1] == "data: [DONE]"                  # 40 tokens, finish, DONE
        c.close()
        assert served.wait() == 0
        assert subprocess.run(["pgrep", "-g", str(served.proc.pid)], capture_output=True).stdout == b""
    finally:
        served.kill()


def test_help_lists_the_flags():
    r = subprocess.run(SERVE + ["--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--model", "--backend", "--host", "--port", "--tls-cert", "--tls-key", "--api-key",
                 "--max-body-bytes", "--max-concurrent-streams", "--max-header-list-size", "--idle-timeout",
                 "--max-queued-requests", "--mock-step-us", "--trace", "--chat-template"):
        assert flag in r.stdout, flag


@pytest.mark.parametrize("args,message", [
    (["--backend", "mock", "--tls-cert", "x.pem"], "needs both a certificate"),
    (["--backend", "mock", "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"],
     "cannot load the TLS certificate"),
    (["--backend", "mock", "--max-body-bytes", "0"], "--max-body-bytes: invalid positive integer value: '0'"),
    (["--backend", "mock", "--idle-timeout", "0"], "idle_timeout_s must be > 0"),
    (["--backend", "mock", "--port", "70000"], "--port: invalid port (0-65535) value"),
])
def test_bad_flags_fail_with_a_clear_message(args, message):
    r = subprocess.run(SERVE + ["--port", "0", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_fails_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(SERVE + ["--backend", "mock", "--port", str(port)], capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 2 and "address already in use" in r.stderr.lower() and "Traceback" not in r.stderr


def test_missing_model_fails_clearly(tmp_path):
    r = subprocess.run(SERVE + ["--port", "0", "--model", str(tmp_path / "nope")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "the model failed to load" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.slow
def test_default_model_is_built_and_served(tmp_path):
    """No --model: the embedded default model, built into the (here: temporary) user cache."""
    served = Served("--backend", "cpu", env={"TOKENWIRE_CACHE_DIR": str(tmp_path)}, timeout=300)
    try:
        models = httpx.get(served.url + "/v1/models").json()["data"]
        assert models[0]["id"] == "tokenwire-default-random" and "random weights" in models[0]["description"]
        lines = httpx.post(served.url + "/generate", json={"prompt": "Hello", "max_tokens": 2}, timeout=120).text
        assert json.loads(lines.splitlines()[-1])["usage"]["completion_tokens"] == 2
        chat = httpx.post(served.url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()
        assert chat["usage"]["completion_tokens"] == 1
        served.proc.send_signal(signal.SIGTERM)
        assert served.wait() == 0
    finally:
        served.kill()
