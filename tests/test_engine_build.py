"""`tokenwire build` end to end (every family, stories260K with both tokenizer formats), the
engine loader (zero-copy views, format/version checks), model resolution with its cache, and
the embedded default model."""

import json
import mmap
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from tokenwire.cli import main
from tokenwire.kernels.engine_format import FORMAT_NAME, FORMAT_VERSION, EngineFormatError, load_engine
from tokenwire.core.errors import BuildError

pytest.importorskip("torch")
pytest.importorskip("transformers")
from test_importers_hf import expected_canonical, make_tiny_hf  # noqa: E402


def build(src, out, *extra):
    return main(["build", str(src), "-o", str(out), "--quiet", *extra])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    make_tiny_hf(path, "llama", chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return path


@pytest.fixture(scope="module")
def stories_engine(tmp_path_factory, stories260k_dir):
    out = tmp_path_factory.mktemp("eng") / "stories"
    assert build(stories260k_dir / "stories260K.bin", out, "--algorithm", "rtn", "--eval") == 0
    return out


# ---- tokenwire build, per family ----------------------------------------------------------

@pytest.mark.parametrize("family,tie", [("llama", False), ("mistral", False), ("qwen2", True), ("gemma", None),
                                        ("qwen3", False), ("gemma2", None), ("gemma3", None)])
def test_build_each_family(tmp_path, family, tie):
    make_tiny_hf(tmp_path / "src", family, tie=tie)
    assert build(tmp_path / "src", tmp_path / "out", "--algorithm", "rtn", "--group-size", "32") == 0
    engine = load_engine(tmp_path / "out")
    m = engine.manifest
    assert (m["format"], m["version"]) == (FORMAT_NAME, FORMAT_VERSION)
    from tokenwire.engine_build.hf import import_hf
    assert engine.config == import_hf(tmp_path / "src").config
    assert m["quantization"] == {"method": "int4", "group_size": 32, "symmetric": False, "algorithm": "rtn",
                                 "embedding": "fp16", "lm_head": "fp16"}
    assert m["tensors"]["layers.1.qkv_proj"]["kind"] == "int4" and m["tensors"]["embed"]["kind"] == "dense"
    assert engine.tensors["layers.1.qkv_proj.qweight"].dtype == np.uint8
    assert engine.tensors["embed.weight"].dtype == np.float16
    assert ("lm_head" in m["tensors"]) == (not engine.config.tie_word_embeddings)
    assert m["source"]["kind"] == "hf" and len(m["source"]["sha256"]) == 64
    assert set(m["report"]["tensors"]) >= {"layers.0.qkv_proj", "layers.1.down_proj"}
    assert engine.encode_prompt("the quick fox")[0] == engine.bos_token_id == 1       # tokenizer post-processor adds <s>
    assert engine.tokenizer.decode(engine.encode_prompt("the quick fox"), skip_special_tokens=True) == "the quick fox"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "weights.safetensors"):
        assert (tmp_path / "out" / name).is_file()


def test_build_with_default_awq_and_chat_template(tmp_path, tiny_llama, capsys):
    """The default algorithm (awq) calibrates on the shipped text; the report is printed."""
    assert main(["build", str(tiny_llama), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "layers.0.qkv_proj" in err and "mean INT4 weight rel err" in err
    engine = load_engine(tmp_path / "out")
    assert engine.manifest["quantization"]["algorithm"] == "awq"
    assert engine.manifest["report"]["num_calibration_tokens"] > 100
    assert engine.chat_template.startswith("{{ bos_token }}")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"] == engine.chat_template
    assert engine.encode_chat("<s>hello") == engine.tokenizer.encode("<s>hello", add_special_tokens=False).ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quant_none_keeps_source_weights_exactly(tmp_path, dtype):
    model = make_tiny_hf(tmp_path / "src", "qwen2", dtype=dtype, tie=False)
    assert build(tmp_path / "src", tmp_path / "out", "--quant", "none") == 0
    engine = load_engine(tmp_path / "out")
    assert engine.manifest["quantization"]["method"] == "none"
    for name, want in expected_canonical(model, "qwen2").items():
        stored = engine.tensors[name if want.ndim == 1 else f"{name}.weight"]
        np.testing.assert_array_equal(stored.astype(np.float32), want, err_msg=name)


def test_stories260k_both_tokenizer_formats(tmp_path, stories260k_dir, stories_engine):
    assert build(stories260k_dir / "stories260K.bin", tmp_path / "spm", "--algorithm", "rtn",
                 "--tokenizer", str(stories260k_dir / "tok512.model")) == 0
    a, b = load_engine(stories_engine), load_engine(tmp_path / "spm")
    assert (stories_engine / "tokenizer.json").read_bytes() == (tmp_path / "spm" / "tokenizer.json").read_bytes()
    for engine in (a, b):
        assert engine.encode_prompt("Once upon a time") == [1, 403, 407, 261, 378]
        assert engine.add_bos and engine.manifest["tokenizer"]["add_bos"] is True
        assert engine.tokenizer.decode([13]) == "\n"
        assert engine.config.vocab_size == 512 and engine.config.num_layers == 5
        assert engine.manifest["source"]["kind"] == "llama2c"
    from tokenwire.engine_build.source import sha256_files
    assert a.manifest["source"]["sha256"] == sha256_files([stories260k_dir / "stories260K.bin", stories260k_dir / "tok512.bin"])
    assert a.manifest["source"]["sha256"] != b.manifest["source"]["sha256"]   # different tokenizer file read


def test_build_report_with_perplexity(stories_engine):
    """--eval: the quant report's float-vs-INT4 perplexity on held-out text lands in engine.json."""
    report = load_engine(stories_engine).manifest["report"]
    ev = report["evaluation"]
    assert ev["num_eval_tokens"] > 500 and 1.0 < ev["fp_perplexity"] < 50.0
    assert ev["quant_perplexity"] >= ev["fp_perplexity"] * 0.9 and ev["perplexity_change"] == pytest.approx(
        ev["quant_perplexity"] / ev["fp_perplexity"] - 1)
    from tokenwire.engine_build.build import format_report
    assert "perplexity on" in format_report(report) and "layers.4.down_proj" in format_report(report)


# ---- the loader -------------------------------------------------------------------------

def test_tensors_are_zero_copy_views_of_the_weights_file(stories_engine):
    engine = load_engine(stories_engine)
    for name, array in engine.tensors.items():
        assert not array.flags.writeable and not array.flags.owndata, name
        base = array
        while isinstance(base, (np.ndarray, memoryview)):
            base = base.obj if isinstance(base, memoryview) else base.base
        assert isinstance(base, mmap.mmap), name
        assert array.ctypes.data % array.dtype.itemsize == 0, name     # aligned for the kernels


def test_loader_rejects_unknown_version(tmp_path, stories_engine):
    shutil.copytree(stories_engine, tmp_path / "e")
    manifest = json.loads((tmp_path / "e" / "engine.json").read_text())
    (tmp_path / "e" / "engine.json").write_text(json.dumps(dict(manifest, version=99)))
    with pytest.raises(EngineFormatError) as info:
        load_engine(tmp_path / "e")
    msg = str(info.value)
    assert "engine.json" in msg and "version 99" in msg and "reads version 1" in msg


def test_loader_rejects_unknown_format(tmp_path, stories_engine):
    shutil.copytree(stories_engine, tmp_path / "e")
    manifest = json.loads((tmp_path / "e" / "engine.json").read_text())
    (tmp_path / "e" / "engine.json").write_text(json.dumps(dict(manifest, format="gguf")))
    with pytest.raises(EngineFormatError, match=r"engine\.json: format 'gguf' is not 'tokenwire-engine'"):
        load_engine(tmp_path / "e")


def test_loader_rejects_missing_manifest(tmp_path):
    with pytest.raises(EngineFormatError, match="not an engine directory: engine.json is missing"):
        load_engine(tmp_path)


def test_loader_rejects_a_tensor_table_that_disagrees(tmp_path, stories_engine):
    shutil.copytree(stories_engine, tmp_path / "e")
    manifest = json.loads((tmp_path / "e" / "engine.json").read_text())

    def load_with_o_proj_shape(shape):
        manifest["tensors"]["layers.0.o_proj"]["shape"] = shape
        (tmp_path / "e" / "engine.json").write_text(json.dumps(manifest))
        load_engine(tmp_path / "e")
    with pytest.raises(EngineFormatError, match=r"'layers\.0\.o_proj\.qweight' is stored as uint8 \[64, 32\], .*\[32, 32\]"):
        load_with_o_proj_shape([32, 64])
    with pytest.raises(EngineFormatError, match=r"tensor table does not match the model config .*'layers\.0\.o_proj'"):
        load_with_o_proj_shape([64, 40])          # same stored sizes (K padded to the group), wrong for the config


def test_loader_rejects_truncated_weights(tmp_path, stories_engine):
    shutil.copytree(stories_engine, tmp_path / "e")
    weights = tmp_path / "e" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(BuildError, match=r"weights\.safetensors: tensor .* beyond the end of the file"):
        load_engine(tmp_path / "e")


# ---- CLI errors ---------------------------------------------------------------------------

def test_cli_missing_source(tmp_path, capsys):
    assert build(tmp_path / "nothing-here", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nothing-here" in err and "no such file or directory" in err


def test_cli_output_exists(tmp_path, stories260k_dir, stories_engine, capsys):
    assert build(stories260k_dir / "stories260K.bin", stories_engine, "--algorithm", "rtn") == 2
    assert "already exists (use --force" in capsys.readouterr().err
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    assert build(stories260k_dir / "stories260K.bin", tmp_path / "precious", "--algorithm", "rtn", "--force") == 2
    assert "not an engine directory; refusing to replace it" in capsys.readouterr().err
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_cli_force_replaces_an_engine(tmp_path, stories260k_dir, stories_engine):
    shutil.copytree(stories_engine, tmp_path / "e")
    assert build(stories260k_dir / "stories260K.bin", tmp_path / "e", "--quant", "none", "--force") == 0
    assert load_engine(tmp_path / "e").manifest["quantization"]["method"] == "none"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]          # no temp or old directories left


def test_cli_hub_name_offline_is_a_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-m", "tokenwire", "build", "no-such-org/no-such-model", "-o",
                           str(tmp_path / "out"), "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert ("no-such-org/no-such-model: no such file or directory here; as a Hugging Face hub name: "
            "cannot download from the Hugging Face hub") in proc.stderr      # a mistyped path reads as such first
    assert "Traceback" not in proc.stderr


def test_cli_wrong_kind_of_source(tmp_path, tiny_llama, stories260k_dir, capsys):
    assert build(tiny_llama / "model.safetensors", tmp_path / "out") == 2
    assert "model.safetensors: not a llama2.c checkpoint: pass the Hugging Face model directory" in capsys.readouterr().err
    assert build(tiny_llama, tmp_path / "out", "--tokenizer", str(stories260k_dir / "tok512.bin")) == 2
    assert "--tokenizer applies to llama2.c checkpoints only" in capsys.readouterr().err


def test_cli_bad_llama2c_file(tmp_path, capsys):
    (tmp_path / "m.bin").write_bytes(b"\x00" * 40)
    assert build(tmp_path / "m.bin", tmp_path / "out") == 2
    assert "m.bin: bad llama2.c header" in capsys.readouterr().err


# ---- resolve_model and the cache ------------------------------------------------------------

def test_resolve_engine_directory_is_used_as_is(stories_engine, tmp_path):
    from tokenwire.engine_build.resolve import resolve_model
    assert resolve_model(str(stories_engine), cache_dir=tmp_path) == stories_engine
    assert not (tmp_path / "engines").exists()


def test_resolve_builds_once_and_reuses(tmp_path, tiny_llama):
    from tokenwire.engine_build.build import BuildOptions
    from tokenwire.engine_build.quantize import QuantOptions
    from tokenwire.engine_build.resolve import resolve_model
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    options = BuildOptions(QuantOptions(algorithm="rtn"))
    first = resolve_model(str(src), cache_dir=tmp_path / "cache", options=options)
    assert first.parent == tmp_path / "cache" / "engines" and first.name.startswith("src-")
    built_ns = (first / "engine.json").stat().st_mtime_ns
    assert resolve_model(str(src), cache_dir=tmp_path / "cache", options=options) == first
    os.utime(src / "model.safetensors")                     # touched, same bytes: checksum still matches
    assert resolve_model(str(src), cache_dir=tmp_path / "cache", options=options) == first
    assert (first / "engine.json").stat().st_mtime_ns == built_ns
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))   # changed: rebuild
    again = resolve_model(str(src), cache_dir=tmp_path / "cache", options=options)
    assert again == first and load_engine(again).config.eos_token_ids == (2, 5)
    other = resolve_model(str(src), cache_dir=tmp_path / "cache", options=BuildOptions(QuantOptions(method="none")))
    assert other != first                                   # other options, other cache entry


def test_resolve_races_end_with_one_engine(tmp_path, tiny_llama):
    from tokenwire.engine_build.build import BuildOptions
    from tokenwire.engine_build.quantize import QuantOptions
    from tokenwire.engine_build.resolve import resolve_model
    results, errors = [], []

    def worker():
        try:
            results.append(resolve_model(str(tiny_llama), cache_dir=tmp_path, options=BuildOptions(QuantOptions(algorithm="rtn"))))
        except Exception as exc:  # surfaced below
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "engines").iterdir()] == [results[0].name]
    load_engine(results[0])


def test_resolve_rejects_an_engine_of_another_version(tmp_path, stories_engine):
    from tokenwire.engine_build.resolve import resolve_model
    shutil.copytree(stories_engine, tmp_path / "e")
    manifest = json.loads((tmp_path / "e" / "engine.json").read_text())
    (tmp_path / "e" / "engine.json").write_text(json.dumps(dict(manifest, version=2)))
    with pytest.raises(EngineFormatError, match="version 2 is not supported"):
        resolve_model(str(tmp_path / "e"), cache_dir=tmp_path / "cache")


def test_cache_root_environment(monkeypatch, tmp_path):
    from tokenwire.engine_build.cache import cache_root
    monkeypatch.delenv("TOKENWIRE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "tokenwire"
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "tw"))
    assert cache_root() == tmp_path / "tw"
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"


# ---- the embedded default model -----------------------------------------------------------

@pytest.fixture(scope="module")
def default_engine(tmp_path_factory):
    from tokenwire.engine_build.default_model import default_engine_path
    cache = tmp_path_factory.mktemp("twcache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENWIRE_CACHE_DIR", str(cache))
    try:
        yield default_engine_path(), cache
    finally:
        mp.undo()


def test_default_model_is_built_into_the_cache_and_named_honestly(default_engine):
    path, cache = default_engine
    assert path.parent == cache / "engines" and path.name.startswith("default-")
    engine = load_engine(path)
    assert engine.name == "tokenwire-default-random"
    assert "random weights" in engine.description and "SmolLM2-135M" in engine.description
    c = engine.config
    assert (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (576, 1536, 9, 3, 64)
    assert c.vocab_size == engine.tokenizer.get_vocab_size() and c.tie_word_embeddings
    assert engine.manifest["quantization"]["method"] == "int4"
    assert engine.manifest["source"]["kind"] == "default"


def test_default_model_tokenizer_and_chat_template(default_engine):
    engine = load_engine(default_engine[0])
    text = "The keeper lit the lamp at 6:15, café ☕."
    assert engine.tokenizer.decode(engine.encode_prompt(text)) == text
    assert not engine.add_bos
    from jinja2 import Template
    rendered = Template(engine.chat_template).render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.encode_chat(rendered)
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    assert im_end in ids and im_end == engine.eos_token_ids[0]


def test_default_model_is_idempotent_and_deterministic(default_engine):
    from tokenwire.engine_build.default_model import default_engine_path, default_source
    path, _ = default_engine
    built_ns = (path / "engine.json").stat().st_mtime_ns
    assert default_engine_path() == path and (path / "engine.json").stat().st_mtime_ns == built_ns
    a, b = default_source(), default_source()
    assert a.tokenizer.files["tokenizer.json"] == b.tokenizer.files["tokenizer.json"]
    np.testing.assert_array_equal(a.tensors["layers.3.o_proj"], b.tensors["layers.3.o_proj"])
    assert np.std(a.tensors["layers.3.o_proj"]) == pytest.approx(0.02, rel=0.02)


def test_resolve_none_is_the_default_model(default_engine):
    from tokenwire.engine_build.resolve import resolve_model
    assert resolve_model(None) == default_engine[0]
