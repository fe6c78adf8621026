"""`tokenwire bench hostcpu`: whole requests through the server's code in one process, every
token accounted for, the CPU split by part; and, where valgrind is installed, the same loop's
instructions counted by callgrind."""

import json
import shutil
import subprocess
import sys

import pytest

from tokenwire.bench import hostcpu


@pytest.mark.parametrize("concurrency", [1, 5, 24])
def test_every_request_streams_all_its_tokens_and_the_parts_add_up(concurrency):
    total, num_tokens, num_steps, parts = hostcpu.measure(concurrency, 3 * concurrency + 2, 9)
    assert num_tokens == (3 * concurrency + 2) * 9     # measure raises on a request short of tokens
    assert set(parts) == set(hostcpu.PARTS) and all(v > 0 for v in parts.values())
    assert sum(parts.values()) <= total
    # a closed loop: each of the `concurrency` slots serves three requests or more one after
    # another, 9 tokens each (the first few start a step apart)
    assert num_steps >= 9 * 3


def test_the_command_prints_a_row_per_level_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "tokenwire", "bench", "hostcpu", "--concurrency", "1,8",
                           "--requests", "12", "--max-tokens", "6", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("concurrency ")]
    assert [ln.split(":")[0] for ln in lines] == ["concurrency 1", "concurrency 8"]
    assert all("µs per token" in ln and "by part" in ln for ln in lines)
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert all(r["us_per_token_min"] <= r["us_per_token_median"] for r in rows)


def test_bad_arguments_exit_2_with_a_reason():
    done = subprocess.run([sys.executable, "-m", "tokenwire", "bench", "hostcpu", "--concurrency", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be >= 1" in done.stderr


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt install valgrind)")
def test_callgrind_counts_the_timed_loop_only():
    """Start-up and the workload's construction are outside `operator.call`: a run twice as long
    counts about twice the instructions, not twice plus a constant the size of the imports."""
    counts = []
    for num_requests in (8, 16):
        r = hostcpu.count_instructions(4, num_requests, 8)
        assert r["steps"] > 8
        counts.append(r["instructions_per_request"])
    assert 0.6 < counts[1] / counts[0] < 1.4, counts
