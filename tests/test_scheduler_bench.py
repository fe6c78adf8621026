"""`tokenwire bench scheduler` runs end to end on tiny settings and reports what it measured
(no figure is checked against a threshold: timings belong to the benchmark, not to tests)."""

import json

from tokenwire.cli import main


def test_bench_scheduler_prints_and_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert main(["bench", "scheduler", "--batches", "1,64", "--steps", "30", "--rounds", "2",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "included:" in text and "target: <= 50 us/step at batch 64" in text
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["steps"]] == [1, 64]
    for row in data["steps"]:
        assert 0 < row["best_round_median_us"] <= row["p99_us"] and row["record_floor_us"] > 0
    assert data["detok_us_per_token"]["byte_table"] > 0 and data["detok_us_per_token"]["generic"] > 0
