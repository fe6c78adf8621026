"""bench stages: the timing machinery on self-timed stages, and `tokenwire bench stages` end to end
on the real stories260K checkpoint with tiny settings (every stage real, none skipped)."""

import json
import math
import os
import subprocess
import sys

import pytest

from tokenwire.bench.stage_fns import Stage
from tokenwire.bench.stages import time_stage

STAGE_PREFIXES = ["parse + validate /v1/completions", "parse + validate /v1/chat/completions", "chat template",
                  "tokenize prompt", "scheduler step, mock executor", "engine prefill [reference: ",
                  "engine decode step [reference: ", "sampling greedy", "sampling T=0.8", "detokenize",
                  "intake: HTTP/2 request to the engine's inbox", "engine -> loop hand-off",
                  "encode SSE chunk (completions)", "encode SSE chunk (chat)",
                  "encode NDJSON line", "encode binary token", "HTTP/2 DATA frames via H2Session",
                  "Dispatcher.write_step, SSE", "Dispatcher.write_step, NDJSON",
                  "loopback socket send", "grammar compile", "grammar mask + advance (batch 1)",
                  "grammar mask + advance (batch 4)"]


def test_time_stage_reports_per_call_and_per_token():
    durations = iter([3000, 5000, 4000] * 100)
    r = time_stage(Stage("self-timed", "wire", lambda: next(durations), num_tokens=4), 30, 5.0)
    assert r.num_samples == 30 and r.calls_per_sample >= 1
    assert 3.0 <= r.min_us <= r.median_us <= r.p99_us <= 5.0
    assert r.per_token_us == pytest.approx(r.median_us / 4)


def test_time_stage_keeps_skipped_stages_visible():
    r = time_stage(Stage("decode (batch 64)", "engine", None, note="skipped: does not fit"), 10, 1.0)
    assert r.num_samples == 0 and math.isnan(r.median_us) and r.note.startswith("skipped")


def _bench_stages(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tokenwire", "bench", "stages", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_bench_stages_command(stories260k_dir, tmp_path):
    env = dict(os.environ, TOKENWIRE_CACHE_DIR=str(tmp_path / "cache"))
    out = _bench_stages("--model", str(stories260k_dir / "stories260K.bin"), "--samples", "15",
                        "--max-seconds", "0.2", "--prompt-len", "12", "--batch", "1,4", "--engine-batch", "1,2",
                        "--json", str(tmp_path / "s.json"), env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "median µs" in out.stdout and "per token µs" in out.stdout
    doc = json.loads((tmp_path / "s.json").read_text())
    names = [s["name"] for s in doc["stages"]]
    for prefix in STAGE_PREFIXES:
        assert any(n.startswith(prefix) for n in names), (prefix, names)
    for s in doc["stages"]:
        assert s["num_samples"] >= 3 and 0 < s["median_us"] <= s["p99_us"], s
        assert s["num_tokens"] == 0 or s["per_token_us"] == pytest.approx(s["median_us"] / s["num_tokens"])
    assert any(b.startswith("reference: ") for b in doc["backends"])
    stages = {s["name"]: s for s in doc["stages"]}
    assert "tokenize prompt (12 tokens), tokenizers" in stages
    # stories260K's tokenizer is SentencePiece-shaped: the server's encoder is tokenizers itself
    assert "no piece cache" in stages["tokenize prompt (12 tokens), server"]["note"]


def test_bench_stages_bad_model_is_a_clear_error(tmp_path):
    out = _bench_stages("--model", str(tmp_path / "no-such-model"), "--samples", "1")
    assert out.returncode == 2 and "no-such-model" in out.stderr and "Traceback" not in out.stderr
