"""llama2.c importer on the real stories260K checkpoint and on small synthetic files:
header and layout, the interleaved -> rotate-half RoPE permutation (checked against RoPE
itself, not against the code's own formula), the untied classifier, tokenizer discovery,
and a clear error for every bad file."""

import shutil
import struct

import numpy as np
import pytest

from tokenwire.core.errors import BuildError
from tokenwire.engine_build.llama2c import import_llama2c

HEADER = struct.Struct("<7i")


def write_llama2c(path, dim=16, hidden=24, layers=2, heads=4, kv_heads=2, vocab=512, seq_len=32,
                  untied=False, seed=0):
    """A random-weight legacy llama2.c checkpoint. -> {array name: float32 array} as written."""
    rng = np.random.default_rng(seed)
    hd, kv = dim // heads, dim // heads * kv_heads
    shapes = [("embed", (vocab, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
              ("wk", (layers, kv, dim)), ("wv", (layers, kv, dim)), ("wo", (layers, dim, dim)),
              ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
              ("w3", (layers, hidden, dim)), ("rms_final", (dim,)), ("freq_real", (seq_len, hd // 2)),
              ("freq_imag", (seq_len, hd // 2))] + ([("wcls", (vocab, dim))] if untied else [])
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes}
    with open(path, "wb") as f:
        f.write(HEADER.pack(dim, hidden, layers, heads, kv_heads, -vocab if untied else vocab, seq_len))
        for a in arrays.values():
            f.write(a.tobytes())
    return arrays


@pytest.fixture
def tiny(tmp_path, stories260k_dir):
    """A synthetic checkpoint beside a copy of the real 512-token vocabulary."""
    arrays = write_llama2c(tmp_path / "tiny.bin")
    shutil.copy(stories260k_dir / "tok512.bin", tmp_path / "tok512.bin")
    return tmp_path / "tiny.bin", arrays


def test_stories260k_config(stories260k_dir):
    src = import_llama2c(stories260k_dir / "stories260K.bin")
    c = src.config
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size,
            c.max_position_embeddings, c.head_dim) == (64, 172, 5, 8, 4, 512, 512, 8)
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5 and c.rope_theta == 10000.0 and c.activation == "silu"
    assert c.bos_token_id == 1 and set(c.eos_token_ids) == {1, 2}      # run.c stops on BOS
    assert src.tokenizer.add_bos and src.tokenizer.bos_token == "<s>"
    assert [p.name for p in src.files] == ["stories260K.bin", "tok512.bin"]
    assert "lm_head" not in src.tensors
    emb = np.fromfile(stories260k_dir / "stories260K.bin", dtype="<f4", count=512 * 64, offset=28).reshape(512, 64)
    np.testing.assert_array_equal(src.tensors["embed"], emb)


def interleaved_rope(x, pos, theta=10000.0):
    """llama2.c run.c: rotate adjacent pairs (2i, 2i+1) of each head. x: [H, hd]."""
    hd = x.shape[-1]
    freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    out = x.copy()
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def rotate_half_rope(x, pos, theta=10000.0):
    """Hugging Face: pairs (i, i + hd/2). x: [H, hd]."""
    hd = x.shape[-1]
    freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def test_rope_permutation_preserves_attention_scores(tiny):
    """q.k after interleaved RoPE on the file's weights == q.k after rotate-half RoPE on the imported ones."""
    path, arrays = tiny
    src = import_llama2c(path)
    c = src.config
    qkv = src.tensors["layers.1.qkv_proj"]
    wq, wk, wv = np.split(qkv, [c.q_size, c.q_size + c.kv_size])
    np.testing.assert_array_equal(wv, arrays["wv"][1])
    x1, x2 = np.random.default_rng(1).standard_normal((2, c.hidden_size))
    for p1, p2 in [(0, 0), (3, 7), (11, 2)]:
        def scores(q_w, k_w, rope):
            q = rope((q_w @ x1).reshape(c.num_heads, c.head_dim), p1)
            k = rope((k_w @ x2).reshape(c.num_kv_heads, c.head_dim), p2)
            return q.reshape(c.num_kv_heads, -1, c.head_dim) @ k[:, :, None]   # [kv, group, 1]
        want = scores(arrays["wq"][1].astype(np.float64), arrays["wk"][1].astype(np.float64), interleaved_rope)
        got = scores(wq.astype(np.float64), wk.astype(np.float64), rotate_half_rope)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert not np.array_equal(wq, arrays["wq"][1])          # the permutation did something


def test_layout_of_the_other_tensors(tiny):
    path, arrays = tiny
    t = import_llama2c(path).tensors
    np.testing.assert_array_equal(t["layers.0.gate_up_proj"], np.concatenate([arrays["w1"][0], arrays["w3"][0]]))
    np.testing.assert_array_equal(t["layers.0.down_proj"], arrays["w2"][0])
    np.testing.assert_array_equal(t["layers.1.o_proj"], arrays["wo"][1])
    np.testing.assert_array_equal(t["layers.1.attn_norm"], arrays["rms_att"][1])
    np.testing.assert_array_equal(t["layers.1.mlp_norm"], arrays["rms_ffn"][1])
    np.testing.assert_array_equal(t["norm"], arrays["rms_final"])


def test_untied_classifier_after_freq_cis(tmp_path, stories260k_dir):
    arrays = write_llama2c(tmp_path / "m.bin", untied=True)
    src = import_llama2c(tmp_path / "m.bin", tokenizer=str(stories260k_dir / "tok512.model"))
    assert not src.config.tie_word_embeddings
    np.testing.assert_array_equal(src.tensors["lm_head"], arrays["wcls"])


# ---- tokenizer discovery ------------------------------------------------------------------

def test_tokenizer_beside_checkpoint_is_found(tiny):
    path, _ = tiny
    assert import_llama2c(path).files[1].name == "tok512.bin"


def test_no_tokenizer_beside_checkpoint(tmp_path):
    write_llama2c(tmp_path / "m.bin")
    with pytest.raises(BuildError, match=r"m\.bin: no tokenizer beside the checkpoint.*--tokenizer PATH"):
        import_llama2c(tmp_path / "m.bin")


def test_several_tokenizers_choose_by_vocab_size(tiny, stories260k_dir):
    path, _ = tiny
    shutil.copy(stories260k_dir / "tok512.model", path.parent / "tokenizer.model")
    (path.parent / "tok4.bin").write_bytes(struct.pack("<i", 1) + struct.pack("<fi", 0.0, 1) * 4 + b"")
    with pytest.raises(BuildError, match=r"ambiguous tokenizer: tok4\.bin, tok512\.bin, tokenizer\.model"):
        import_llama2c(path)           # two of the three have 512 tokens
    (path.parent / "tokenizer.model").unlink()
    assert import_llama2c(path).files[1].name == "tok512.bin"


def test_tokenizer_of_the_wrong_size(tmp_path, stories260k_dir):
    write_llama2c(tmp_path / "m.bin", vocab=300)
    with pytest.raises(BuildError, match=r"tok512\.bin: tokenizer has 512 tokens, the checkpoint m\.bin has vocab_size 300"):
        import_llama2c(tmp_path / "m.bin", tokenizer=str(stories260k_dir / "tok512.bin"))


# ---- bad checkpoints ----------------------------------------------------------------------

def test_truncated_header(tmp_path):
    (tmp_path / "m.bin").write_bytes(b"\x40\x00\x00\x00" * 3)
    with pytest.raises(BuildError, match=r"m\.bin: truncated llama2\.c checkpoint: 12 bytes"):
        import_llama2c(tmp_path / "m.bin")


def test_bad_header_values(tmp_path):
    (tmp_path / "m.bin").write_bytes(HEADER.pack(64, 172, 5, 0, 4, 512, 512) + bytes(64))
    with pytest.raises(BuildError, match=r"m\.bin: bad llama2\.c header \(dim=64, .*n_heads=0"):
        import_llama2c(tmp_path / "m.bin")


def test_size_mismatch(tmp_path, stories260k_dir):
    data = (stories260k_dir / "stories260K.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(data[:-4])
    with pytest.raises(BuildError, match=r"m\.bin: size mismatch: .* implies 1056540 bytes, the file has 1056536"):
        import_llama2c(tmp_path / "m.bin")


def test_header_of_another_model(tmp_path, stories260k_dir):
    """A checkpoint whose header was edited no longer matches its size: caught before any read."""
    data = bytearray((stories260k_dir / "stories260K.bin").read_bytes())
    data[4:8] = struct.pack("<i", 256)                  # hidden_dim 172 -> 256
    (tmp_path / "m.bin").write_bytes(bytes(data))
    with pytest.raises(BuildError, match="size mismatch"):
        import_llama2c(tmp_path / "m.bin")


def test_versioned_export_is_refused(tmp_path):
    (tmp_path / "m.bin").write_bytes(struct.pack("<Ii", 0x616B3432, 2) + bytes(248))
    with pytest.raises(BuildError, match=r"m\.bin: llama2\.c export version 2 \(magic 'ak42'\) is not supported"):
        import_llama2c(tmp_path / "m.bin")
