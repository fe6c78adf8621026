"""Hugging Face importer: tiny random-weight models of each family, saved by transformers,
imported, and compared tensor by tensor with transformers' own state_dict (after fusion and
Gemma's norm fold). Also every bad input the importer must name clearly.

`make_tiny_hf` and `write_tiny_tokenizer` are reused by test_engine_build.py.
"""

import json
import math
import shutil
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenwire.core.errors import BuildError  # noqa: E402
from tokenwire.engine_build.hf import import_hf  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8)),
}
GEMMAS = ("gemma", "gemma2", "gemma3")
CORPUS = ["once upon a time there was a tiny model", "the quick brown fox jumps over the lazy dog"] * 8


def write_tiny_tokenizer(path, vocab_limit=SHAPE["vocab_size"], chat_template=None):
    """A real (BPE) tokenizer small enough for the tiny vocab, with <s>/</s> and a BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_limit, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def make_tiny_hf(path, family, dtype="float32", tie=None, shard=False, seed=0, chat_template=None, **overrides):
    """Save a random-weight transformers model of `family` (plus a tokenizer) into `path`. -> the model."""
    config_name, model_name, extra = FAMILIES[family]
    kwargs = dict(SHAPE, **extra)
    if tie is not None:
        kwargs["tie_word_embeddings"] = tie
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():                   # Gemma inits norms to 0 and o/down to small values: spread them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size="20KB" if shard else "10GB")
    write_tiny_tokenizer(path, chat_template=chat_template)
    return model


def expected_canonical(model, family):
    """The canonical tensors, computed from transformers' state_dict with torch."""
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    fold = (lambda w: w + 1.0) if family in GEMMAS else (lambda w: w)
    out = {"embed": sd["model.embed_tokens.weight"], "norm": fold(sd["model.norm.weight"])}
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"layers.{i}.attn_norm"] = fold(sd[f"model.layers.{i}.input_layernorm.weight"])
        if family in ("gemma2", "gemma3"):      # sandwich norms: post_attention_layernorm is the output's
            out[f"layers.{i}.post_attn_norm"] = fold(sd[f"model.layers.{i}.post_attention_layernorm.weight"])
            out[f"layers.{i}.mlp_norm"] = fold(sd[f"model.layers.{i}.pre_feedforward_layernorm.weight"])
            out[f"layers.{i}.post_mlp_norm"] = fold(sd[f"model.layers.{i}.post_feedforward_layernorm.weight"])
        else:
            out[f"layers.{i}.mlp_norm"] = fold(sd[f"model.layers.{i}.post_attention_layernorm.weight"])
        if family in ("qwen3", "gemma3"):
            out[f"layers.{i}.q_norm"] = fold(sd[a + "q_norm.weight"])
            out[f"layers.{i}.k_norm"] = fold(sd[a + "k_norm.weight"])
        out[f"layers.{i}.qkv_proj"] = np.concatenate([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        if family == "qwen2":
            out[f"layers.{i}.qkv_bias"] = np.concatenate([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        out[f"layers.{i}.o_proj"] = sd[a + "o_proj.weight"]
        out[f"layers.{i}.gate_up_proj"] = np.concatenate([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        out[f"layers.{i}.down_proj"] = sd[m + "down_proj.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"]
    return out


CASES = [("llama", "float32", False, False), ("llama", "bfloat16", True, False), ("llama", "float32", False, True),
         ("mistral", "float32", False, False), ("mistral", "bfloat16", None, False),
         ("qwen2", "float32", True, False), ("qwen2", "bfloat16", False, True), ("qwen2", "float16", True, False),
         ("gemma", "float32", None, False), ("gemma", "bfloat16", False, False),
         ("qwen3", "bfloat16", False, True), ("gemma2", "float32", None, False), ("gemma3", "bfloat16", None, False)]


@pytest.mark.parametrize("family,dtype,tie,shard", CASES)
def test_canonical_tensors_equal_transformers(tmp_path, family, dtype, tie, shard):
    model = make_tiny_hf(tmp_path, family, dtype, tie, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    src = import_hf(tmp_path)
    expected = expected_canonical(model, family)
    assert set(src.tensors) == set(expected)
    for name, want in expected.items():
        got = src.tensors[name]
        assert got.dtype == (np.float16 if dtype == "float16" and not name.endswith(("norm", "bias")) else np.float32), name
        np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_config_per_family(tmp_path, family):
    model = make_tiny_hf(tmp_path, family)
    c = import_hf(tmp_path).config
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (32, 64, 2, 4, 2)
    assert c.architecture == type(model).__name__
    assert c.head_dim == (16 if family in GEMMAS else 8)
    assert c.qkv_bias == (family == "qwen2")
    assert c.activation == ("gelu_tanh" if family in GEMMAS else "silu")
    assert c.embedding_multiplier == (pytest.approx(math.sqrt(32)) if family in GEMMAS else 1.0)
    assert c.sliding_window == {"mistral": 16, "gemma2": 8, "gemma3": 8}.get(family)
    assert c.sliding_layers == {"gemma2": (True, False)}.get(family)      # gemma3: both layers slide (None: all)
    assert c.qk_norm == (family in ("qwen3", "gemma3")) and c.post_norms == (family in ("gemma2", "gemma3"))
    assert (c.attn_logit_softcap, c.final_logit_softcap) == ((50.0, 30.0) if family == "gemma2" else (None, None))
    assert c.attn_scale == (256 ** -0.5 if family in ("gemma2", "gemma3") else None)
    assert c.rope_local_theta == (10000.0 if family == "gemma3" else None)
    assert c.tie_word_embeddings == model.config.tie_word_embeddings
    if family == "llama":
        assert c.rope_theta == 500000.0
        assert c.rope_scaling.factor == 8.0 and c.rope_scaling.original_max_position_embeddings == 64
    else:
        assert c.rope_scaling is None and c.rope_theta == (1e6 if family == "gemma3" else 10000.0)


def test_old_rope_spelling_gives_same_config(tmp_path):
    """transformers < 5 wrote rope_theta + rope_scaling {"type": "llama3"}; 5.x writes rope_parameters."""
    make_tiny_hf(tmp_path, "llama")
    new = import_hf(tmp_path).config
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert import_hf(tmp_path).config == new


def test_eos_and_chat_template_sources(tmp_path):
    make_tiny_hf(tmp_path, "qwen2")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2], "bos_token_id": 1}))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    src = import_hf(tmp_path)
    assert src.config.eos_token_ids == (7, 2)
    assert src.tokenizer.chat_template.startswith("{% for m in messages %}")
    assert src.tokenizer.add_bos is True      # tokenizer.json's post-processor adds <s>
    assert json.loads(src.tokenizer.files["tokenizer_config.json"])["chat_template"] == src.tokenizer.chat_template
    assert "generation_config.json" in src.tokenizer.files


def test_add_bos_token_false_in_tokenizer_config_wins(tmp_path):
    make_tiny_hf(tmp_path, "llama")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, add_bos_token=False)))
    assert import_hf(tmp_path).tokenizer.add_bos is False


# ---- bad input: one test per problem, each checking the message ------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_hf(path, "llama")
    return path


@pytest.fixture
def broken(tmp_path, llama_dir):
    """A fresh copy of the tiny llama directory to break."""
    shutil.copytree(llama_dir, tmp_path / "m")
    return tmp_path / "m"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def expect_error(path, *fragments):
    with pytest.raises(BuildError) as info:
        import_hf(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_unsupported_architecture(broken):
    edit_config(broken, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    expect_error(broken, "config.json", "unsupported architecture GPT2LMHeadModel", "LlamaForCausalLM")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    expect_error(broken, "config.json", "missing file")


def test_not_a_directory(tmp_path):
    expect_error(tmp_path / "nope", "nope", "not a directory")


def test_missing_weights(broken):
    (broken / "model.safetensors").unlink()
    expect_error(broken, "model.safetensors", "missing file")


def test_missing_shard_listed_in_index(tmp_path):
    make_tiny_hf(tmp_path, "llama", shard=True)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    expect_error(tmp_path, shard.name, "missing file", "model.safetensors.index.json")


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    expect_error(broken, "tokenizer.json", "missing file")


def test_tokenizer_larger_than_vocab(broken):
    edit_config(broken, vocab_size=20)
    expect_error(broken, "tokenizer", "vocab_size is 20")


def test_shape_mismatch(broken):
    edit_config(broken, intermediate_size=48)
    src = import_hf(broken)            # shapes are checked when a tensor is read
    with pytest.raises(BuildError) as info:
        src.tensors["layers.0.gate_up_proj"]
    msg = str(info.value)
    assert "model.safetensors" in msg and "gate_proj" in msg and "[64, 32]" in msg and "[48, 32]" in msg


def test_missing_tensor(broken):
    edit_config(broken, tie_word_embeddings=False)
    cfg = json.loads((broken / "config.json").read_text())
    assert not cfg["tie_word_embeddings"]
    from tokenwire.kernels.safetensors_io import SafetensorsFile, write_safetensors
    st = SafetensorsFile(broken / "model.safetensors")
    kept = {k: np.array(st.read_raw(k)) for k in st.keys() if k != "lm_head.weight"}
    del st
    write_safetensors(broken / "model.safetensors", kept)
    src = import_hf(broken)
    with pytest.raises(BuildError, match="'lm_head.weight' is missing"):
        src.tensors["lm_head"]


def rewrite_header(path, header_len=None, header=None, truncate_to=None):
    data = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    body = data[8 + n:]
    head = data[8:8 + n] if header is None else header
    out = struct.pack("<Q", len(head) if header_len is None else header_len) + head + body
    (path / "model.safetensors").write_bytes(out[:truncate_to])


def test_safetensors_bad_header_length(broken):
    rewrite_header(broken, header_len=1 << 40)
    expect_error(broken, "model.safetensors", "corrupt safetensors header length")


def test_safetensors_bad_json(broken):
    rewrite_header(broken, header=b"{not json at all}       ")
    expect_error(broken, "model.safetensors", "not valid JSON")


def test_safetensors_truncated_data(broken):
    size = (broken / "model.safetensors").stat().st_size
    rewrite_header(broken, truncate_to=size - 100)
    expect_error(broken, "model.safetensors", "beyond the end of the file", "truncated")


def test_safetensors_too_short_for_header(broken):
    (broken / "model.safetensors").write_bytes(b"\x01\x02")
    expect_error(broken, "model.safetensors", "truncated safetensors file")


def test_unsupported_rope_type(broken):
    edit_config(broken, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    expect_error(broken, "config.json", "RoPE scaling type 'yarn'")


def test_exact_gelu_is_refused(broken):
    edit_config(broken, hidden_act="gelu")
    expect_error(broken, "config.json", "activation 'gelu'")


def test_bad_config_json(broken):
    (broken / "config.json").write_text("{ oops")
    expect_error(broken, "config.json", "not valid JSON")


def test_missing_config_field(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    expect_error(broken, "config.json", "'hidden_size' is missing")


def test_sentencepiece_tokenizer_model_without_tokenizer_json(tmp_path, stories260k_dir):
    """Older Llama directories ship only tokenizer.model: it is converted like a llama2.c vocabulary."""
    make_tiny_hf(tmp_path, "llama", vocab_size=512)
    (tmp_path / "tokenizer.json").unlink()
    shutil.copy(stories260k_dir / "tok512.model", tmp_path / "tokenizer.model")
    src = import_hf(tmp_path)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(src.tokenizer.files["tokenizer.json"].decode())
    assert tok.encode("Once upon a time", add_special_tokens=False).ids == [403, 407, 261, 378]
    assert src.tokenizer.add_bos and src.config.bos_token_id == 1
    names = [p.name for p in src.files]
    assert "tokenizer.model" in names and "tokenizer.json" not in names       # the checksum covers what was read


def test_named_chat_templates_pick_default(tmp_path):
    make_tiny_hf(tmp_path, "llama")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert import_hf(tmp_path).tokenizer.chat_template == "PLAIN"
