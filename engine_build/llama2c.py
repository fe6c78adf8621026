"""llama2.c importer: a legacy ("version 0") checkpoint .bin -> `SourceModel`.

File layout (little-endian): 7 x int32 header (dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size, seq_len), then float32 arrays in nn.Linear (out, in) layout:
token_embedding [V, D], rms_att [L, D], wq [L, D, D], wk [L, kv, D], wv [L, kv, D],
wo [L, D, D], rms_ffn [L, D], w1 [L, H, D], w2 [L, D, H], w3 [L, H, D], rms_final [D],
freq_cis_real and freq_cis_imag [seq_len, head_size/2] (unused), and `wcls` [V, D] only when
vocab_size is negative (an untied classifier). The file size must match exactly.

Semantics (run.c): RMSNorm eps 1e-5, RoPE theta 10000 on *adjacent* pairs (2i, 2i+1) of each
head. tokenwire's layout is rotate-half (pairs i, i + hd/2), so wq and wk rows are permuted
within each head here. Generation in run.c stops when the model samples BOS (id 1, the
sequence delimiter it was trained with); the engine's stop ids are BOS and EOS.

Tokenizer: `tokenizer` if given, else the one `tok*.bin` or `tokenizer.model` beside the
checkpoint whose size matches the vocabulary. run.c itself defaults to `tokenizer.bin` in the
working directory (llama2.c's Llama 2 vocabulary, 32000 tokens); tokenwire never guesses
that: with no tokenizer next to the checkpoint the build asks for `--tokenizer`.
"""

import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from ..core.config import ModelConfig
from ..core.errors import BuildError
from .source import LazyTensors, SourceModel, make_tokenizer_files
from ..kernels.engine_format import canonical_shapes
from .tokenizer_convert import read_any_vocab, tokenizer_config, vocab_to_tokenizer

HEADER = struct.Struct("<7i")
VERSIONED_MAGIC = 0x616B3432            # "ak42": llama2.c's newer export versions (1, 2), not legacy
NORM_EPS = 1e-5
ROPE_THETA = 10000.0


def import_llama2c(path, tokenizer: Optional[str] = None, name: Optional[str] = None) -> SourceModel:
    path = Path(path)
    config, untied = read_header(path)
    arrays = _weight_arrays(path, config, untied)
    tok_path = Path(tokenizer) if tokenizer else find_tokenizer(path, config.vocab_size)
    vocab = read_any_vocab(tok_path)
    if len(vocab.pieces) != config.vocab_size:
        raise BuildError(tok_path, f"tokenizer has {len(vocab.pieces)} tokens, the checkpoint {path.name} "
                                   f"has vocab_size {config.vocab_size}")
    tok_json = vocab_to_tokenizer(vocab).to_str().encode()
    tok_config = tokenizer_config(vocab, config.max_position_embeddings)
    generation = {"bos_token_id": vocab.bos_id, "eos_token_id": [vocab.eos_id, vocab.bos_id]}
    files = make_tokenizer_files(tok_json, tok_config, tok_path,
                                 extra_files={"generation_config.json": json.dumps(generation, indent=2).encode()})
    config = replace(config, bos_token_id=vocab.bos_id, eos_token_ids=(vocab.bos_id, vocab.eos_id))
    tensors = LazyTensors(canonical_shapes(config), _loaders(arrays, config), path)
    return SourceModel(kind="llama2c", path=str(path), name=name or path.stem, config=config,
                       tensors=tensors, tokenizer=files, files=[path, tok_path])


def read_header(path: Path) -> tuple:
    """-> (ModelConfig, untied classifier?), after checking the header and the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
    except OSError as exc:
        raise BuildError(path, f"cannot read llama2.c checkpoint: {exc.strerror or exc}") from None
    if len(head) < HEADER.size:
        raise BuildError(path, f"truncated llama2.c checkpoint: {size} bytes, the header alone is {HEADER.size}")
    if struct.unpack_from("<I", head)[0] == VERSIONED_MAGIC:
        version = struct.unpack_from("<i", head, 4)[0]
        raise BuildError(path, f"llama2.c export version {version} (magic 'ak42') is not supported; "
                               "export the legacy version 0 format (export.py --version 0)")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = HEADER.unpack(head)
    if min(dim, hidden, layers, heads, kv_heads, seq_len, abs(vocab)) <= 0 or dim % heads or heads % kv_heads \
            or (dim // heads) % 2:
        raise BuildError(path, f"bad llama2.c header (dim={dim}, hidden_dim={hidden}, n_layers={layers}, "
                               f"n_heads={heads}, n_kv_heads={kv_heads}, vocab_size={vocab}, seq_len={seq_len})")
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=abs(vocab), hidden_size=dim,
                         intermediate_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=dim // heads, max_position_embeddings=seq_len, rms_norm_eps=NORM_EPS,
                         rope_theta=ROPE_THETA, tie_word_embeddings=vocab > 0)
    expected = HEADER.size + 4 * sum(int(np.prod(s)) for _, s in _layout(config, vocab < 0))
    if size != expected:
        raise BuildError(path, f"size mismatch: the header (dim={dim}, n_layers={layers}, vocab_size={vocab}, ...) "
                               f"implies {expected} bytes, the file has {size}")
    return config, vocab < 0


def _layout(config: ModelConfig, untied: bool) -> list:
    """[(array name, shape)] in file order."""
    D, H, L, V = config.hidden_size, config.intermediate_size, config.num_layers, config.vocab_size
    kv, half = config.kv_size, config.head_dim // 2
    layout = [("embed", (V, D)), ("rms_att", (L, D)), ("wq", (L, D, D)), ("wk", (L, kv, D)), ("wv", (L, kv, D)),
              ("wo", (L, D, D)), ("rms_ffn", (L, D)), ("w1", (L, H, D)), ("w2", (L, D, H)), ("w3", (L, H, D)),
              ("rms_final", (D,)), ("freq_cis_real", (config.max_position_embeddings, half)),
              ("freq_cis_imag", (config.max_position_embeddings, half))]
    return layout + ([("wcls", (V, D))] if untied else [])


def _weight_arrays(path: Path, config: ModelConfig, untied: bool) -> dict:
    """Zero-copy float32 views over the memory-mapped file, by llama2.c array name."""
    mm = np.memmap(path, dtype="<f4", mode="r", offset=HEADER.size)
    arrays, pos = {}, 0
    for name, shape in _layout(config, untied):
        n = int(np.prod(shape))
        arrays[name] = mm[pos:pos + n].reshape(shape)
        pos += n
    return arrays


def interleaved_to_rotate_half(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of wq/wk [H*hd, D]: per head, row 2i+c (llama2.c) -> row c*hd/2 + i (rotate-half)."""
    rows, cols = w.shape
    hd = rows // num_heads
    return w.reshape(num_heads, hd // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _loaders(a: dict, config: ModelConfig) -> dict:
    f32 = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    loaders = {"embed": lambda: a["embed"], "norm": lambda: f32(a["rms_final"])}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        loaders[p + "attn_norm"] = lambda i=i: f32(a["rms_att"][i])
        loaders[p + "qkv_proj"] = lambda i=i: np.concatenate([
            interleaved_to_rotate_half(a["wq"][i], config.num_heads),
            interleaved_to_rotate_half(a["wk"][i], config.num_kv_heads), a["wv"][i]])
        loaders[p + "o_proj"] = lambda i=i: a["wo"][i]
        loaders[p + "mlp_norm"] = lambda i=i: f32(a["rms_ffn"][i])
        loaders[p + "gate_up_proj"] = lambda i=i: np.concatenate([a["w1"][i], a["w3"][i]])
        loaders[p + "down_proj"] = lambda i=i: a["w2"][i]
    if not config.tie_word_embeddings:
        loaders["lm_head"] = lambda: a["wcls"]
    return loaders


def find_tokenizer(checkpoint: Path, vocab_size: int) -> Path:
    """The one tokenizer beside the checkpoint (tok*.bin or tokenizer.model) with `vocab_size` entries."""
    folder = checkpoint.parent
    candidates = sorted(p for p in folder.glob("tok*.bin") if p != checkpoint)
    candidates += [folder / "tokenizer.model"] if (folder / "tokenizer.model").exists() else []
    if not candidates:
        raise BuildError(checkpoint, "no tokenizer beside the checkpoint (looked for tok*.bin and tokenizer.model); "
                                     "run.c would use llama2.c's tokenizer.bin (Llama 2, 32000 tokens): "
                                     "pass the vocabulary with --tokenizer PATH")
    if len(candidates) == 1:
        return candidates[0]
    matching = [p for p in candidates if _vocab_entries(p) == vocab_size]
    if len(matching) != 1:
        names = ", ".join(p.name for p in candidates)
        raise BuildError(checkpoint, f"ambiguous tokenizer: {names} are all beside the checkpoint and "
                                     f"{len(matching)} of them have {vocab_size} tokens; choose one with --tokenizer PATH")
    return matching[0]


def _vocab_entries(path: Path) -> int:
    try:
        return len(read_any_vocab(path).pieces)
    except BuildError:
        return -1
