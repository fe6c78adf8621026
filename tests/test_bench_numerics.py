"""`tokenwire bench numerics` end to end on short windows: both models' rows, and int8
activations stay close to the exact path (the figures the README quotes come from the full run)."""

import json

import pytest

from tokenwire.cli import main
from tokenwire.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason=f"C kernels not built: {cpu.IMPORT_ERROR}")


def test_numerics_rows_compare_int8_with_the_exact_path(stories260k_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "numerics", "--stories", str(stories260k_dir), "--max-len", "64", "--greedy", "8",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stories260K" in text and "embedded default model" in text and "perplexity: exact" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and "float" in rows[0]["perplexity"] and "float" not in rows[1]["perplexity"]
    for r in rows:
        ppl = r["perplexity"]
        assert ppl["exact"] > 1 and abs(ppl["int8"] / ppl["exact"] - 1) < 0.01
        assert r["top1_agreement"] > 0.9 and r["tokens"] > 500
        assert r["greedy_tokens"] == 8 and 0 <= r["greedy_identical_prefix"] <= 8
