"""`tokenwire bench overlap`'s table: medians per (S, concurrency, mode), against the ideal
concurrency / S, the targets beside the overlapped modes only (bench/overlap.py)."""

from unittest import mock

from tokenwire.bench import overlap
from tokenwire.bench.overlap import MODES, format_rows


def _row(mode: str, tokens_per_s: float, itl_us: float, cpu: float) -> dict:
    return {"step_us": 1000.0, "concurrency": 256, "overlap": mode, "round": 0, "tokens_per_s": tokens_per_s,
            "itl_us_p50": itl_us, "cpu_us_per_token": cpu, "num_errors": 0}


def test_each_mode_is_a_line_of_medians_against_the_ideal_and_the_targets_go_beside_the_overlapped_ones():
    rows = [_row("on", 160_000, 1300, 5.9), _row("on", 128_000, 1200, 6.1), _row("on", 180_000, 1250, 6.0),
            _row("off", 96_000, 1800, 6.8), _row("process", 204_800, 850, 8.0)]
    lines = format_rows(rows, 3).splitlines()
    on, off, process = (next(x for x in lines if f"  {mode} " in x) for mode in ("on", "off", "process"))
    assert lines.index(on) < lines.index(off) < lines.index(process)       # MODES' order
    assert "0.625 [0.500-0.703] (≥ 0.95)" in on and "1.250" in on
    assert "0.375" in off and "≥" not in off
    assert "0.800 [0.800-0.800] (≥ 0.95)" in process and "0.850" in process and "8.0" in process
    assert list(MODES) == ["on", "off", "process"] and MODES["process"] == ["--engine-process"]


def test_the_host_ceiling_is_what_the_cpu_per_token_allows_on_one_core_or_two_for_an_engine_process():
    """1 core / 6.0 µs per token = 166,667 tok/s = 0.65 of 256 streams at 1 ms; an engine
    process has two interpreters: 2 / 8.0 µs = 250,000 = 0.98; one core on a one-core machine."""
    rows = [_row("on", 160_000, 1300, 5.9), _row("on", 128_000, 1200, 6.1), _row("on", 180_000, 1250, 6.0),
            _row("off", 96_000, 1800, 10.0), _row("process", 204_800, 850, 8.0)]
    with mock.patch.object(overlap.os, "cpu_count", return_value=2):
        lines = format_rows(rows, 3).splitlines()
    assert "host ceiling ÷ ideal" in lines[0]
    on, off, process = (next(x for x in lines if f"  {mode} " in x).split() for mode in ("on", "off", "process"))
    assert on[-3] == "0.65" and off[-3] == "0.39" and process[-3] == "0.98"
    with mock.patch.object(overlap.os, "cpu_count", return_value=1):
        process = next(x for x in format_rows(rows, 3).splitlines() if "  process " in x).split()
    assert process[-3] == "0.49"
