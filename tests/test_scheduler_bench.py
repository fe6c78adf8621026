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


def test_bench_sampling_compares_the_fast_path_with_the_reference(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    assert main(["bench", "scheduler", "--sampling", "--vocab-sizes", "300", "--batches", "1,3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reference" in text and "speedup" in text
    rows = json.loads(out.read_text())["sampling"]
    assert {(r["batch"], r["mode"]) for r in rows} == {(b, m) for b in (1, 3)
                                                       for m in ("greedy", "temperature", "top_p", "top_k", "min_p")}
    assert all(r["fast_us"] > 0 and r["reference_us"] > 0 for r in rows)


def test_bench_forward_batch_compares_with_the_reference(tmp_path, capsys):
    out = tmp_path / "fb.json"
    assert main(["bench", "scheduler", "--forward-batch", "--batches", "1,4", "--json", str(out)]) == 0
    assert "reference" in capsys.readouterr().out
    rows = json.loads(out.read_text())["forward_batch"]
    assert [r["step"] for r in rows] == ["decode, batch 1", "decode, batch 4", "prefill 512", "60 decodes + prefill 1500"]
    assert all(r["reference_us"] > 0 and r["fresh_us"] > 0 and r["kept_tables_us"] > 0 for r in rows)
