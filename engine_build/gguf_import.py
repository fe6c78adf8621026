"""GGUF importer (llama.cpp's file format): one `.gguf` file -> `SourceModel`.

Read with the `gguf` package (GGUFReader memory-maps the file). Architectures: `llama`
(Llama, Mistral), `qwen2` and `qwen3` (per-head q/k norms `attn_q_norm` / `attn_k_norm`).
Gemma 2/3 GGUFs are refused: llama.cpp derives their softmax scale and window pattern from
the model size rather than from the file, so they are built from the Hugging Face checkpoint. Hyperparameters come from `{arch}.*` metadata, the tokenizer
and chat template from `tokenizer.*` (gguf_tokenizer.py).

Layout: GGUF dimensions are innermost first, so a tensor with ne = [K, N] is numpy [N, K], the
nn.Linear (out x in) layout the engine wants: no transpose. llama.cpp's converter permutes the
Q and K rows of `llama` models from Hugging Face's rotate-half RoPE layout to adjacent pairs;
that is undone here (a row permutation, so quantized codes move with their rows untouched).
`qwen2` and `qwen3` are stored rotate-half (llama.cpp's NEOX RoPE) and are taken as is.

Encodings (per tensor, see imported.py for the origins):
- Q4_0 (groups of 32, fp16 d, q in 0..15, w = d * (q - 8)): codes taken, zero point 8: exact.
- Q4_1 (w = d * q + m) and Q4_K (256-blocks of eight 32-groups with 6-bit scales and minimums
  under fp16 super-scales: w = (d * sc) * q - dmin * m): codes taken at group size 32. The engine
  stores fp16 s and z with w = (q - z) * s; d * sc needs up to 17 significant bits and
  z = m / d is rarely a float16, so these are "mapped": same codes, scales rounded to float16,
  with the error in the report (exact for the matrices where every rounding is exact).
- F32, F16, BF16: float, quantized by the build's algorithm like any float checkpoint.
- Everything else the gguf package can dequantize (Q8_0, Q5_*, Q6_K, Q2_K, IQ*, ...):
  dequantized, then requantized by the build, marked "requantized" in the report. Where such a
  tensor is fused with 4-bit ones (llama.cpp's Q4_K_M keeps some V and down projections in
  Q6_K), its rows are rounded to nearest at group size 32 beside the others' codes.
A model with any Q4_0/Q4_1/Q4_K matrix builds at group size 32.
"""

from pathlib import Path
from typing import Optional

import numpy as np
try:
    from gguf import GGUFReader
    from gguf import dequantize as gguf_dequantize
    from gguf.quants import Q4_K
except ImportError as exc:              # optional where it is missing (the GPU image has none): only
    GGUFReader = None                   # a GGUF file then fails to build, saying why
    MISSING = f"reading GGUF files needs the gguf package (pip install gguf): {exc}"
else:
    MISSING = None

from ..core.config import ModelConfig
from ..core.errors import BuildError
from ..kernels.engine_format import canonical_shapes
from .gguf_tokenizer import read_gguf_tokenizer
from .imported import ImportedInt4, Int4Codes, codes_by_rtn, codes_from_affine, concat_rows, permute_rows
from .llama2c import interleaved_to_rotate_half
from .source import LazyTensors, SourceModel

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_QK = {"llama"}                 # llama.cpp's converter interleaves these models' Q/K rows
FLOAT_TYPES = ("F32", "F16", "BF16")
GROUP_SIZE = 32                         # Q4_0, Q4_1 and Q4_K sub-blocks
MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def import_gguf(path, name: Optional[str] = None) -> SourceModel:
    path = Path(path)
    reader = open_reader(path)
    meta = Metadata(path, reader)
    tensors = {t.name: t for t in reader.tensors}
    check_tensor_bounds(path, reader)
    config = read_config(meta, tensors)
    tokenizer, config = read_gguf_tokenizer(path, meta, config)
    gguf = GgufTensors(path, tensors, config, meta.arch)
    loaders, codes, notes = gguf.canonical()
    imported = ImportedInt4(GROUP_SIZE, codes, notes, frozenset(n for n in notes if not _float_note(notes[n])))
    return SourceModel(kind="gguf", path=str(path), name=name or path.stem, config=config,
                       tensors=LazyTensors(canonical_shapes(config), loaders, path), tokenizer=tokenizer,
                       files=[path], imported=imported,
                       description=_describe(path, config, notes))


def open_reader(path: Path):
    if MISSING:
        raise BuildError(path, MISSING)
    try:
        return GGUFReader(path)
    except ValueError as exc:
        text = str(exc)
        if "GGMLQuantizationType" in text:
            raise BuildError(path, f"unknown GGUF tensor type ({text}); this gguf package cannot read it") from None
        if "cannot reshape" in text:        # the reader maps each tensor as it parses: a short file fails here
            raise BuildError(path, f"truncated GGUF file ({path.stat().st_size} bytes): a tensor's data runs past "
                                   f"the end ({text})") from None
        raise BuildError(path, f"not a readable GGUF file: {text}") from None
    except (KeyError, IndexError, TypeError, OverflowError, OSError) as exc:
        raise BuildError(path, f"not a readable GGUF file (truncated or corrupt header): {type(exc).__name__}: {exc}") from None


def check_tensor_bounds(path: Path, reader) -> None:
    """GGUFReader maps lazily: a truncated file shows as a tensor whose bytes run past the end."""
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise BuildError(path, f"truncated GGUF file: tensor {t.name!r} needs bytes {t.data_offset}.."
                                   f"{t.data_offset + t.n_bytes}, the file has {size}")


class Metadata:
    """key -> value over GGUFReader's fields, with `{arch}.` keys by their short name."""

    def __init__(self, path: Path, reader):
        self.path = path
        self.fields = reader.fields
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise BuildError(path, "GGUF metadata has no general.architecture")

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def model(self, key: str, default=None, required: bool = False):
        value = self.get(f"{self.arch}.{key}", default)
        if value is None and required:
            raise BuildError(self.path, f"GGUF metadata is missing {self.arch}.{key}")
        return value


def read_config(meta: Metadata, tensors: dict) -> ModelConfig:
    path, arch = meta.path, meta.arch
    if arch in ("gemma", "gemma2", "gemma3"):
        raise BuildError(path, f"GGUF architecture {arch!r} is not supported: its files do not state the softmax "
                               "scale and window pattern (llama.cpp derives them from the model size); build from "
                               "the Hugging Face checkpoint instead")
    if arch not in ARCHITECTURES:
        raise BuildError(path, f"GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    scaling = meta.model("rope.scaling.type")
    if scaling not in (None, "none"):
        raise BuildError(path, f"RoPE scaling {scaling!r} is not supported")
    D = int(meta.model("embedding_length", required=True))
    heads = int(meta.model("attention.head_count", required=True))
    kv_heads = int(meta.model("attention.head_count_kv", heads))
    head_dim = int(meta.model("attention.key_length", D // heads))
    if int(meta.model("rope.dimension_count", head_dim)) != head_dim:
        raise BuildError(path, f"partial RoPE ({arch}.rope.dimension_count {meta.model('rope.dimension_count')} "
                               f"of head size {head_dim}) is not supported")
    vocab = tensors.get("token_embd.weight")
    if vocab is None:
        raise BuildError(path, "GGUF has no token_embd.weight tensor")
    window = meta.model("attention.sliding_window")
    try:
        return ModelConfig(architecture=ARCHITECTURES[arch], vocab_size=int(vocab.shape[1]), hidden_size=D,
                           intermediate_size=int(meta.model("feed_forward_length", required=True)),
                           num_layers=int(meta.model("block_count", required=True)), num_heads=heads,
                           num_kv_heads=kv_heads, head_dim=head_dim,
                           max_position_embeddings=int(meta.model("context_length", required=True)),
                           rms_norm_eps=_decimal(meta.model("attention.layer_norm_rms_epsilon", 1e-5)),
                           rope_theta=_decimal(meta.model("rope.freq_base", 10000.0)),
                           qkv_bias="blk.0.attn_q.bias" in tensors,
                           qk_norm="blk.0.attn_q_norm.weight" in tensors,
                           tie_word_embeddings="output.weight" not in tensors,
                           sliding_window=int(window) if window else None,
                           rope_freq_factors=_rope_factors(path, tensors.get("rope_freqs.weight"), head_dim))
    except ValueError as exc:
        raise BuildError(path, f"inconsistent GGUF metadata: {exc}") from None


def _rope_factors(path: Path, tensor, head_dim: int):
    """Llama 3.1's RoPE scaling as llama.cpp stores it: rope_freqs.weight, F32 [hd/2] divisors."""
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32" or tuple(int(d) for d in tensor.shape.tolist()) != (head_dim // 2,):
        raise BuildError(path, f"rope_freqs.weight must be F32 [{head_dim // 2}], got {tensor.tensor_type.name} "
                               f"{[int(d) for d in tensor.shape.tolist()]}")
    factors = np.asarray(tensor.data, dtype=np.float64)
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise BuildError(path, "rope_freqs.weight holds a factor that is not a positive number")
    return tuple(float(f) for f in factors)


def _decimal(value) -> float:
    """GGUF stores float32: 1e-6 reads back as 9.99999997e-07; keep the decimal it was written as."""
    return float(f"{float(value):.7g}")


class GgufTensors:
    """Canonical loaders over the GGUF tensors: float (the source's dequantization) and INT4 codes."""

    def __init__(self, path: Path, tensors: dict, config: ModelConfig, arch: str):
        self.path, self.tensors, self.config = path, tensors, config
        self.permute_qk = arch in PERMUTED_QK

    def canonical(self) -> tuple:
        """-> (float loaders, INT4 code loaders, notes), all by canonical name."""
        c = self.config
        parts = {"embed": ["token_embd.weight"]}
        for i in range(c.num_layers):
            b, p = f"blk.{i}.", f"layers.{i}."
            parts[p + "qkv_proj"] = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
            parts[p + "o_proj"] = [b + "attn_output.weight"]
            parts[p + "gate_up_proj"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
            parts[p + "down_proj"] = [b + "ffn_down.weight"]
        if not c.tie_word_embeddings:
            parts["lm_head"] = ["output.weight"]
        shapes = canonical_shapes(c)
        loaders = {name: (lambda names=names: np.concatenate([self.read_float(n) for n in names]))
                   for name, names in parts.items()}
        loaders.update(self.vectors())
        codes = {name: (lambda names=names: concat_rows([self.read_codes(n) for n in names]))
                 for name, names in parts.items() if any(self.has_codes(n) for n in names)}
        notes = {name: "gguf " + "+".join(sorted({self.type_name(n) for n in names})) for name, names in parts.items()}
        assert loaders.keys() == shapes.keys()
        return loaders, codes, notes

    def vectors(self) -> dict:
        c, out = self.config, {"norm": lambda: self.read_float("output_norm.weight")}
        for i in range(c.num_layers):
            b, p = f"blk.{i}.", f"layers.{i}."
            out[p + "attn_norm"] = lambda b=b: self.read_float(b + "attn_norm.weight")
            out[p + "mlp_norm"] = lambda b=b: self.read_float(b + "ffn_norm.weight")
            if c.qkv_bias:
                out[p + "qkv_bias"] = lambda b=b: np.concatenate(
                    [self.read_float(b + f"attn_{x}.bias") for x in ("q", "k", "v")])
            if c.qk_norm:
                out[p + "q_norm"] = lambda b=b: self.read_float(b + "attn_q_norm.weight")
                out[p + "k_norm"] = lambda b=b: self.read_float(b + "attn_k_norm.weight")
        return out

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise BuildError(self.path, f"GGUF tensor {name!r} is missing")
        expected = self.expected_shape(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected:
            raise BuildError(self.path, f"GGUF tensor {name!r} has shape {list(shape)}, the metadata implies "
                                        f"{list(expected)}")
        return t

    def expected_shape(self, name: str) -> tuple:
        c = self.config
        D, I, V, q, kv = c.hidden_size, c.intermediate_size, c.vocab_size, c.q_size, c.kv_size
        kind = name.split(".", 2)[-1] if name.startswith("blk.") else name
        return {"token_embd.weight": (V, D), "output.weight": (V, D), "output_norm.weight": (D,),
                "attn_norm.weight": (D,), "ffn_norm.weight": (D,), "attn_q.weight": (q, D), "attn_k.weight": (kv, D),
                "attn_v.weight": (kv, D), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                "attn_output.weight": (D, q), "ffn_gate.weight": (I, D), "ffn_up.weight": (I, D),
                "ffn_down.weight": (D, I), "attn_q_norm.weight": (c.head_dim,),
                "attn_k_norm.weight": (c.head_dim,)}[kind]

    def type_name(self, name: str) -> str:
        return self.tensor(name).tensor_type.name

    def has_codes(self, name: str) -> bool:
        return self.type_name(name) in CODE_READERS

    def read_float(self, name: str) -> np.ndarray:
        """The source's own dequantization (the gguf package's), float32 in nn.Linear layout."""
        t = self.tensor(name)
        try:
            w = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise BuildError(self.path, f"GGUF tensor {name!r} has type {t.tensor_type.name}, which the gguf "
                                        "package cannot dequantize") from None
        w = w.reshape(self.expected_shape(name))
        return self._unpermute(name, w)

    def read_codes(self, name: str) -> Int4Codes:
        """The tensor's 4-bit codes; a tensor of another type beside them (a Q6_K V next to Q4_K
        Q and K) is rounded to nearest at the same group size."""
        t = self.tensor(name)
        if not self.has_codes(name):
            return codes_by_rtn(self.read_float(name), GROUP_SIZE)
        n, k = self.expected_shape(name)
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(n, -1)
        try:
            codes = CODE_READERS[t.tensor_type.name](blocks, n, k)
        except BuildError as exc:
            raise BuildError(self.path, f"GGUF tensor {name!r}: {exc.problem}") from None
        return self._unpermute(name, codes)

    def _unpermute(self, name: str, w):
        """llama: Q/K rows from adjacent RoPE pairs back to rotate-half."""
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if not self.permute_qk or kind not in ("attn_q", "attn_k"):
            return w
        heads = self.config.num_heads if kind == "attn_q" else self.config.num_kv_heads
        if isinstance(w, Int4Codes):
            return permute_rows(w, lambda a: interleaved_to_rotate_half(a, heads))
        return interleaved_to_rotate_half(w, heads) if w.ndim == 2 else w


# ---- block layouts (ggml-common.h) ------------------------------------------------------------

def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: element j in the low nibble of byte j, j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q4_0_codes(blocks: np.ndarray, n: int, k: int) -> Int4Codes:
    """18-byte blocks: fp16 d, 16 bytes of codes. w = d * (q - 8)."""
    b = blocks.reshape(n, k // 32, 18)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]                       # [N, K/32]
    q = _nibbles_split(b[..., 2:]).reshape(n, k)
    if not np.all(np.isfinite(d)):
        raise BuildError(None, "a Q4_0 block scale is not finite")
    return Int4Codes(q, d, np.full(d.shape, 8, dtype=np.float16), "exact")


def q4_1_codes(blocks: np.ndarray, n: int, k: int) -> Int4Codes:
    """20-byte blocks: fp16 d, fp16 m, 16 bytes of codes. w = d * q + m."""
    b = blocks.reshape(n, k // 32, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return codes_from_affine(_nibbles_split(b[..., 4:]).reshape(n, k), d, m)


def q4_k_codes(blocks: np.ndarray, n: int, k: int) -> Int4Codes:
    """144-byte blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for eight
    sub-blocks of 32, 128 bytes of codes: sub-block 2c in the low nibbles of bytes 32c..32c+31,
    2c + 1 in their high nibbles. w = (d * sc) * q - dmin * m."""
    b = blocks.reshape(n * (k // 256), 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)              # [B, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(b[:, 4:16])                              # [B, 8] each, 0..63
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, k)
    scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
    minimum = -(dmin * mins.astype(np.float32)).reshape(n, k // 32)
    return codes_from_affine(q, scale, minimum)


CODE_READERS = {"Q4_0": q4_0_codes, "Q4_1": q4_1_codes, "Q4_K": q4_k_codes}


def _float_note(note: str) -> bool:
    return all(t in FLOAT_TYPES for t in note.removeprefix("gguf ").split("+"))


def _describe(path: Path, config: ModelConfig, notes: dict) -> str:
    types = sorted({t for note in notes.values() for t in note.removeprefix("gguf ").split("+")})
    return (f"{config.architecture} ({config.num_layers} layers, hidden {config.hidden_size}, vocab "
            f"{config.vocab_size}) from GGUF {path.name} ({', '.join(types)})")
