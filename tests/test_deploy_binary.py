"""The single-file binary (scripts/build_binary.sh) as a user runs it: built once per run from
this checkout (or taken from $TOKENWIRE_BINARY), started with a scrubbed environment (`env -i`,
a PATH with no Python on it, HOME in a fresh directory so the default model is built on first
use), from a directory that is not the repository. It streams a completion over h2c and over
HTTP/1.1 (curl) and a constrained one (`guided_choice` at temperature 0, which goes through
llguidance), builds an engine and runs two benchmarks with its own `build` and `bench`, and
stops on SIGTERM with exit 0 after the stream in flight finishes.

Part of the default run (CI): a deployment artifact nobody starts breaks silently (structured
output once made it die at import for want of llguidance's package metadata). The build takes
about 2 minutes here (its venv, build/binary-venv, is made on the first build of a clone and
reused after); a build that fails fails the tests, it never skips them.
`TOKENWIRE_BINARY=dist/tokenwire` tests a built binary instead, and `-m "not binary"` leaves
these tests out. `tokenwire bench deploy` measures size, cold start and TTFT against the Python
install.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.binary, pytest.mark.slow, pytest.mark.timeout(900)]

ENV = shutil.which("env") or "/usr/bin/env"
CURL = shutil.which("curl") or "/usr/bin/curl"


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    prebuilt = os.environ.get("TOKENWIRE_BINARY")
    if prebuilt:
        assert Path(prebuilt).is_file(), f"TOKENWIRE_BINARY={prebuilt} is not a file"
        return Path(prebuilt).resolve()
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(["bash", str(REPO / "scripts" / "build_binary.sh"), str(out)], capture_output=True, text=True,
                       timeout=840)
    assert r.returncode == 0, "the binary did not build:\n" + r.stdout[-3000:] + r.stderr[-3000:]
    return out / "tokenwire"


def scrubbed(binary, tmp_path, *args):
    """argv running the binary under `env -i` with only HOME and an empty PATH."""
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir(exist_ok=True)
    return [ENV, "-i", f"HOME={tmp_path / 'home'}", f"PATH={empty_bin}", str(binary), *args]


def start(binary, tmp_path, *args):
    """The binary's `serve`, from another directory; -> (Popen, port, log lines so far)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    proc = subprocess.Popen(scrubbed(binary, tmp_path, "serve", "--port", "0", *args), cwd=elsewhere,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, port = [], None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the binary exited early:\n" + "".join(log))
        log.append(line)
        port = port or next(iter(re.findall(r"listening on http://127\.0\.0\.1:(\d+)", line)), None)
        if "serving " in line and port:
            return proc, int(port), log
    kill(proc)
    raise AssertionError("the binary did not become ready:\n" + "".join(log))


def kill(proc):
    """SIGKILL the binary's whole process group: the one-file bootloader runs the server as its
    child, which outlives a SIGKILL of the bootloader alone (a failed test left servers behind)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def curl_stream(port, http, body):
    """A streamed completion with curl -> (HTTP version curl used, SSE events)."""
    r = subprocess.run([CURL, "-sS", "-N", http, "-w", "\n%{http_version}", "-H", "content-type: application/json",
                        "-d", json.dumps({"prompt": "Once upon a time", "stream": True, **body}),
                        f"http://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text, version = r.stdout.rsplit("\n", 1)
    return version, [e for e in text.split("\n\n") if e.startswith("data: ")]


def test_binary_streams_plain_and_constrained_from_a_scrubbed_environment_and_drains_on_sigterm(binary, tmp_path):
    proc, port, log = start(binary, tmp_path)
    try:
        assert os.path.realpath(f"/proc/{proc.pid}/exe") == str(binary)         # env exec'd the binary itself
        assert any("building the default model" in line for line in log)       # first use, in the fresh HOME
        assert (tmp_path / "home" / ".cache" / "tokenwire" / "engines").is_dir()
        for http, version in (("--http2-prior-knowledge", "2"), ("--http1.1", "1.1")):
            used, events = curl_stream(port, http, {"max_tokens": 8, "ignore_eos": True})
            assert used == version
            assert len(events) == 10 and events[-1] == "data: [DONE]"          # 8 tokens, the finish, DONE
            assert json.loads(events[0][6:])["model"] == "tokenwire-default-random"

        # llguidance in the binary: its grammar masks the logits, greedy picks within the mask
        _, events = curl_stream(port, "--http2-prior-knowledge",
                                {"max_tokens": 30, "temperature": 0, "guided_choice": ["happy", "sad"]})
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert events[-1] == "data: [DONE]", events
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop", chunks[-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) in ("happy", "sad")

        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 64, "stream": True, "ignore_eos": True})
        curl = subprocess.Popen([CURL, "-sS", "-N", "--http2-prior-knowledge", "-H", "content-type: application/json",
                                 "-d", body, f"http://127.0.0.1:{port}/v1/completions"], stdout=subprocess.PIPE, text=True)
        first = curl.stdout.readline()
        assert first.startswith("data: ")                                      # streaming when the signal comes
        proc.send_signal(signal.SIGTERM)
        rest, _ = curl.communicate(timeout=120)
        assert curl.returncode == 0 and (first + rest).count("data: ") == 66 and rest.endswith("data: [DONE]\n\n")
        assert proc.wait(60) == 0
    finally:
        kill(proc)


def test_binary_serves_with_its_engine_in_a_process_of_its_own(binary, tmp_path):
    """`--engine-process`: the binary starts itself again as the engine (`engine-process`;
    a frozen binary has no `python -m`), and stops both on SIGTERM."""
    proc, port, log = start(binary, tmp_path, "--backend", "mock", "--engine-process")
    try:
        _, events = curl_stream(port, "--http2-prior-knowledge", {"max_tokens": 8, "ignore_eos": True})
        assert len(events) == 10 and events[-1] == "data: [DONE]", events
        engines = subprocess.run(["pgrep", "-f", f"{binary} engine-process"], capture_output=True, text=True)
        assert engines.stdout.split(), "no engine process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.5)
        assert not subprocess.run(["pgrep", "-f", f"{binary} engine-process"], capture_output=True).stdout
    finally:
        kill(proc)


def test_binary_builds_an_engine_and_runs_benchmarks(binary, tmp_path, stories260k_dir):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    engine = tmp_path / "stories260K-engine"
    r = subprocess.run(scrubbed(binary, tmp_path, "build", str(stories260k_dir / "stories260K.bin"), "-o", str(engine)),
                       cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (engine / "engine.json").exists() and "perplexity" in r.stdout + r.stderr

    r = subprocess.run(scrubbed(binary, tmp_path, "bench", "scheduler", "--batches", "1,16", "--steps", "50",
                                "--rounds", "1"), cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "16" in r.stdout

    proc, port, _ = start(binary, tmp_path, "--model", str(engine))
    try:
        report = tmp_path / "load.json"
        r = subprocess.run(scrubbed(binary, tmp_path, "bench", "load", "--url", f"http://127.0.0.1:{port}/v1/completions",
                                    "--concurrency", "1,4", "--requests", "8", "--max-tokens", "8",
                                    "--json", str(report)), cwd=elsewhere, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        levels = json.loads(report.read_text())["levels"]
        assert [row["num_errors"] for row in levels] == [0, 0] and all(row["ttft_us_p50"] > 0 for row in levels)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        kill(proc)
