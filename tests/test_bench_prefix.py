"""`tokenwire bench prefix` and `tokenwire bench response-cache`, small, on stories260K with
the numpy reference: they run end to end and report what they measured."""

import json

import pytest

from tokenwire.cli import main

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}Story:{% endif %}")


@pytest.fixture(scope="module")
def engine_dir(stories260k_dir, tmp_path_factory):
    from tokenwire.engine_build.build import BuildOptions, build_engine, open_source
    from tokenwire.engine_build.quantize import QuantOptions
    root = tmp_path_factory.mktemp("stories")
    (root / "template.jinja").write_text(TEMPLATE)
    return build_engine(open_source(str(stories260k_dir / "stories260K.bin")), root / "engine",
                        BuildOptions(QuantOptions(method="none")))


def test_bench_prefix_small(engine_dir, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--model", str(engine_dir), "--backend", "reference", "--chat-template",
               str(engine_dir.parent / "template.jinja"), "--system-tokens", "80", "--turns", "3",
               "--replay-turns", "2", "--replay-max-tokens", "8", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    shared, replay = result["shared_system_prompt"], result["replay"]
    assert shared["cached_tokens_p50"] >= 64 and shared["ttft_p50_ms_cache_on"] > 0
    assert replay["prefill_tokens_cache_on"] < replay["prefill_tokens_cache_off"] == replay["prompt_tokens_sent"]
    assert "TTFT p50 cache on" in capsys.readouterr().out


def test_bench_response_cache_small(engine_dir, tmp_path, capsys):
    out = tmp_path / "rc.json"
    rc = main(["bench", "response-cache", "--model", str(engine_dir), "--backend", "reference", "--rounds", "1",
               "--requests", "10", "--max-tokens", "4", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["hits"] == 30 and result["cached"] > 0 and result["mock"] > 0
    assert "mock engine" in capsys.readouterr().out
