"""GGUF files written with the `gguf` package, from random weights in Hugging Face layout: tiny
ones for the GGUF importer's tests (tests/test_importers_gguf.py), full-size ones of a real
shape for `tokenwire bench engine --vs llama.cpp` (bench/vs_llama.py), the one file both
engines then load.

`write_gguf(path, arch, types)` quantizes each tensor with the gguf package (Q4_0, Q4_1, Q5_0,
Q8_0, F16, F32) or, for Q4_K (which the package only reads), with `q4_k_blocks` below, written
from ggml's block layout. llama models get llama.cpp's Q/K row permutation (rotate-half ->
adjacent RoPE pairs) before quantizing, as its converter does. Returns the float weights the
file's own dequantization gives back, in Hugging Face layout, by GGUF tensor name.
"""

import numpy as np
from tokenizers.pre_tokenizers import ByteLevel

try:
    import gguf
except ImportError as exc:      # optional where it is missing (the GPU image has none): `bench engine`
    gguf = None                 # still runs; only writing a GGUF (--vs llama.cpp) says why it cannot
    MISSING = f"writing GGUF files needs the gguf package (pip install gguf): {exc}"
else:
    MISSING = None

SHAPE = dict(vocab=300, dim=64, hidden=96, layers=2, heads=4, kv_heads=2, context=128)
SPM_PIECES = ["\u2581the", "\u2581a", "he", "th", "in", "er", "an", "\u2581t", "\u2581o", "on", "at", "en"]


def spm_vocab(size: int) -> tuple:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte pieces, ▁ and letters, some merges."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    rest = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + SPM_PIECES + ["<|im_start|>"]
    rest += [f"\u2581w{i}" for i in range(size)]          # filler pieces up to the vocabulary size
    tokens += rest[:size - len(tokens)]
    types += [4 if t == "<|im_start|>" else 1 for t in tokens[len(types):]]      # a user-defined chat marker
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def byte_level_vocab(size: int) -> tuple:
    """GPT-2 style: the 256 byte symbols, a few merges, and <|endoftext|> / <|im_start|> / <|im_end|>."""
    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = alphabet + ["Ġt", "he", "Ġthe", "in", "Ġa"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = tokens + specials
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    assert len(tokens) <= size
    return tokens, types, merges


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: rows of each head from rotate-half to adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_k_blocks(w: np.ndarray, rng) -> np.ndarray:
    """float [N, K] (K % 256 == 0) -> Q4_K bytes [N, K/256*144]: a simple per-sub-block fit, packed
    as ggml lays it out (d, dmin, 12 bytes of 6-bit scales/minimums, 128 bytes of nibbles)."""
    n, k = w.shape
    sub = w.reshape(-1, 8, 32).astype(np.float32)                    # [B, 8, 32]
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    scale, minimum = (hi - lo) / 15, -lo                               # w ~ scale * q - minimum
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 1e-8), np.maximum(dmin.astype(np.float32), 1e-8)
    sc = np.clip(np.round(scale / d32[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(minimum / dmin32[:, None]), 0, 63).astype(np.uint8)
    eff_s = d.astype(np.float32)[:, None] * sc
    eff_m = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((sub + eff_m[..., None]) / eff_s[..., None]), 0, 15).astype(np.uint8)   # [B, 8, 32]
    packed_scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    packed_scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    qs = q.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0, :] | (qs[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                             packed_scales, qs], axis=1)
    return blocks.reshape(n, k // 256 * 144)


def encode(w: np.ndarray, qtype: str, rng) -> np.ndarray:
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32)
    if qtype == "Q4_K":
        return q4_k_blocks(w, rng)
    return gguf.quants.quantize(w.astype(np.float32), t)


def hf_weights(shape: dict, rng, qkv_bias: bool, tied: bool, qk_norm: bool = False) -> dict:
    """Random weights in Hugging Face layout, by GGUF name."""
    D, I, V, L = shape["dim"], shape["hidden"], shape["vocab"], shape["layers"]
    hd = D // shape["heads"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    w = {"token_embd.weight": rng.normal(0, 1, (V, D)), "output_norm.weight": 1 + 0.1 * rng.normal(size=D)}
    if not tied:
        w["output.weight"] = rng.normal(0, 0.2, (V, D))
    for i in range(L):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": 1 + 0.1 * rng.normal(size=D), b + "ffn_norm.weight": 1 + 0.1 * rng.normal(size=D),
                  b + "attn_q.weight": rng.normal(0, 0.2, (q, D)), b + "attn_k.weight": rng.normal(0, 0.2, (kv, D)),
                  b + "attn_v.weight": rng.normal(0, 0.2, (kv, D)), b + "attn_output.weight": rng.normal(0, 0.2, (D, q)),
                  b + "ffn_gate.weight": rng.normal(0, 0.2, (I, D)), b + "ffn_up.weight": rng.normal(0, 0.2, (I, D)),
                  b + "ffn_down.weight": rng.normal(0, 0.2, (D, I))})
        if qk_norm:
            w.update({b + "attn_q_norm.weight": 1 + 0.1 * rng.normal(size=hd),
                      b + "attn_k_norm.weight": 1 + 0.1 * rng.normal(size=hd)})
        if qkv_bias:
            w.update({b + "attn_q.bias": 0.1 * rng.normal(size=q), b + "attn_k.bias": 0.1 * rng.normal(size=kv),
                      b + "attn_v.bias": 0.1 * rng.normal(size=kv)})
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_gguf(path, arch="llama", types="Q4_0", tied=False, seed=0, shape=None, chat_template=None,
               tokenizer=None, skip=(), shapes=None, meta_overrides=None, rope_freqs=None) -> dict:
    """Write a tiny model. `types`: one GGUF type for every matrix, or {name suffix: type}
    (e.g. {"attn_q": "Q4_1", "*": "Q4_0"}); `skip`: tensors left out; `shapes`: {name: shape}
    written with random weights of a wrong shape; `meta_overrides`: SHAPE keys the metadata states
    differently from the tensors; `rope_freqs`: llama.cpp's per-frequency RoPE divisors. -> {GGUF name: float32 weights as the file dequantizes them,
    Hugging Face layout (Q/K unpermuted)}."""
    if MISSING:
        raise RuntimeError(MISSING)
    shape = dict(SHAPE, **(shape or {}))
    rng = np.random.default_rng(seed)
    weights = hf_weights(shape, rng, qkv_bias=arch == "qwen2", tied=tied, qk_norm=arch == "qwen3")
    tokenizer = tokenizer or ("llama" if arch == "llama" else "gpt2")
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, dict(shape, **(meta_overrides or {})), tokenizer, chat_template)
    out = {}
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, w in weights.items():
        if name in skip:
            continue
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        stored = w
        if arch == "llama" and kind in ("attn_q", "attn_k") and name.endswith("weight"):
            stored = llama_permute(w, shape["heads"] if kind == "attn_q" else shape["kv_heads"])
        qtype = "F32" if w.ndim == 1 else (types if isinstance(types, str) else types.get(kind, types["*"]))
        if shapes and name in shapes:
            stored = rng.normal(0, 0.2, shapes[name]).astype(np.float32)
        data = encode(stored, qtype, rng)
        raw = None if qtype == "F32" else gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, data, raw_dtype=raw)
        back = np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]), dtype=np.float32)
        back = back.reshape(stored.shape)
        if arch == "llama" and kind in ("attn_q", "attn_k") and name.endswith("weight"):
            back = llama_unpermute(back, shape["heads"] if kind == "attn_q" else shape["kv_heads"])
        out[name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _metadata(writer, arch, shape, tokenizer, chat_template) -> None:
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["dim"])
    writer.add_feed_forward_length(shape["hidden"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    if tokenizer == "llama":
        tokens, scores, types = spm_vocab(shape["vocab"])
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        if "add_space_prefix" in shape:
            writer.add_add_space_prefix(shape["add_space_prefix"])
    else:
        tokens, types, merges = byte_level_vocab(shape["vocab"])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
