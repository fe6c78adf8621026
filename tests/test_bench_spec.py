"""`tokenwire bench spec`, small, on stories260K: it runs end to end, each part reports what it
measured beside no speculation, and the model as its own draft accepts every proposal."""

import json

from tokenwire.cli import main


def test_bench_spec_small(stories260k_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--model", str(stories260k_dir / "stories260K.bin"), "--rounds", "1",
               "--max-tokens", "24", "--skip-default", "--json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"ngram", "ngram_sampled", "draft"}
    for part in results.values():
        off = part["off"]
        assert off["tokens_per_s"] > 0 and off["tokens_per_step"] == 1.0 and off["ratio"] == 1.0
    assert results["draft"]["draft (itself)"]["acceptance"] == 1.0
    assert results["draft"]["draft (itself)"]["tokens_per_step"] > 2
    printed = capsys.readouterr().out
    assert "self-draft acceptance: 1.000 (target = 1): met" in printed and "n-gram speed-up" in printed
