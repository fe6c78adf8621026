"""tokenwire bench timeline: the steps of an engine under a closed loop, and the causes it
names for the steps behind the slowest inter-token intervals."""

import json

from tokenwire.bench import timeline
from tokenwire.cli import main


def step(start_us, us, *, executor=None, prompt=0, threads=2, gc_us=0, rows=1):
    start, end = int(start_us * 1000), int((start_us + us) * 1000)
    executor_ns = int((us if executor is None else executor) * 1000)
    return timeline.Step(start, end, executor_ns, rows, prompt, threads, 0, int(gc_us * 1000))


def test_each_slow_step_gets_its_cause():
    """Two requests over 1,000 steps of 1 ms; five slow steps (under 1%), one of each cause."""
    slow = {40: dict(prompt=20), 80: dict(gc_us=3000), 120: dict(threads=1), 160: dict(executor=1.0),
            200: dict()}
    steps, t = [], 0.0
    for i in range(1000):
        us = 4000.0 if i in slow else 1000.0
        fields = dict(slow.get(i, {}))
        if fields.get("executor") == 1.0:
            fields["executor"] = 1000.0         # 3 ms of the 4 on the host
        steps.append(step(t, us, **fields))
        t += us
    row = timeline.summarize(1, steps, [list(range(0, 500)), list(range(500, 1000))])
    assert row["itl_us_p50"] == 1000.0
    assert {s["step"]: s["cause"] for s in row["slow_steps"]} == {
        40: "prefill", 80: "gc", 120: "pool", 160: "host", 200: "executor"}
    assert row["causes"] == {"prefill": 1, "gc": 1, "pool": 1, "host": 1, "executor": 1}
    assert row["prefill_steps"] == 1 and row["steps_below_max_threads"] == 1
    assert "above the inter-token p99 by cause" in timeline.report(row)


def test_bench_timeline_on_the_mock_engine(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "timeline", "--backend", "mock", "--concurrency", "1,3", "--requests", "4",
                 "--max-tokens", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== concurrency 1:" in text and "== concurrency 3:" in text
    result = json.loads(out.read_text())
    for level, steps in zip(result["levels"], result["steps"]):
        assert level["num_steps"] > 0 and level["itl_us_p50"] > 0
        assert level["prefill_steps"] >= 1            # each request's prompt is computed in some step
        # 1 + 4 (c=1) and 3 + 4 (c=3) requests of 6 tokens, one token per running request a step
        assert sum(s["rows"] for s in steps) >= (5 if level["concurrency"] == 1 else 7) * 6
