"""Reading the engine directory of docs/ENGINE_FORMAT.md: `load_engine`, and the tensor
names and shapes an engine of a given config holds.

    engine = load_engine("out/stories260K")
    engine.config                   # ModelConfig
    engine.tensors["layers.0.qkv_proj.qweight"]   # read-only view into the mmap'd weights file
    engine.encode_prompt("Once upon a time")      # ids, BOS added by the engine's rule

The one reader, shared by the server (through tokenwire/runtime.py) and the builder
(engine_build/, which writes engines with engine_writer.py and reads them back here).
Loading memory-maps weights.safetensors and hands out numpy views into the mapping (no
copy, no read until a page is touched); it rejects an unknown `format` or `version` naming
the file and both versions, and checks that the tensor table, the stored tensors and the
config agree before anything runs.
"""

import json
from functools import cached_property
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
from tokenizers import Tokenizer

from ..core.config import ModelConfig
from ..core.errors import BuildError
from .safetensors_io import SafetensorsFile

FORMAT_NAME = "tokenwire-engine"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "engine.json"
WEIGHTS = "weights.safetensors"
# tensor kind -> stored parts (docs/ENGINE_FORMAT.md "Weight encodings"); vectors are stored bare
PARTS = {"dense": ("weight",), "int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}


def linear_shapes(config: ModelConfig) -> dict:
    """Logical [N, K] (out x in) of every matrix weight an engine holds, by tensor name."""
    c = config
    shapes = {"embed": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        shapes[f"layers.{i}.qkv_proj"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
        shapes[f"layers.{i}.o_proj"] = (c.hidden_size, c.q_size)
        shapes[f"layers.{i}.gate_up_proj"] = (2 * c.intermediate_size, c.hidden_size)
        shapes[f"layers.{i}.down_proj"] = (c.hidden_size, c.intermediate_size)
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    return shapes


def vector_shapes(config: ModelConfig) -> dict:
    """Shape of every float32 vector (norm weights, biases) an engine holds, by tensor name."""
    c = config
    shapes = {"norm": (c.hidden_size,)}
    for i in range(c.num_layers):
        shapes[f"layers.{i}.attn_norm"] = (c.hidden_size,)
        shapes[f"layers.{i}.mlp_norm"] = (c.hidden_size,)
        if c.qkv_bias:
            shapes[f"layers.{i}.qkv_bias"] = (c.q_size + 2 * c.kv_size,)
        if c.qk_norm:
            shapes[f"layers.{i}.q_norm"] = (c.head_dim,)
            shapes[f"layers.{i}.k_norm"] = (c.head_dim,)
        if c.post_norms:
            shapes[f"layers.{i}.post_attn_norm"] = (c.hidden_size,)
            shapes[f"layers.{i}.post_mlp_norm"] = (c.hidden_size,)
    return shapes


def canonical_shapes(config: ModelConfig) -> dict:
    """{canonical name: logical shape} of every tensor an engine of `config` holds (matrices, then vectors)."""
    return {**linear_shapes(config), **vector_shapes(config)}


class EngineFormatError(BuildError):
    """An engine directory that cannot be loaded (wrong format, unknown version, inconsistent)."""


class Engine:
    """A loaded engine directory. Tensors are zero-copy, read-only views of the weights file."""

    def __init__(self, path: Path, manifest: dict, config: ModelConfig, tensors: dict):
        self.path = path
        self.manifest = manifest
        self.config = config
        self.tensors: Mapping[str, np.ndarray] = tensors   # stored name -> array view
        tok = manifest["tokenizer"]
        self.name: str = manifest.get("name") or path.name
        self.description: str = manifest.get("description") or ""
        self.chat_template: Optional[str] = tok.get("chat_template")
        self.add_bos: bool = bool(tok.get("add_bos"))
        self.bos_token_id: Optional[int] = config.bos_token_id
        self.eos_token_ids: tuple = config.eos_token_ids

    @cached_property
    def tokenizer(self):
        """tokenizers.Tokenizer from the engine's tokenizer.json (loaded on first use)."""
        file = self.path / self.manifest["tokenizer"].get("file", "tokenizer.json")
        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise EngineFormatError(file, f"cannot load the tokenizer: {exc}") from None

    @cached_property
    def special_tokens(self) -> dict:
        """bos/eos (and the other *_token entries of tokenizer_config.json) as a chat template sees them."""
        tokens = {}
        config_file = self.path / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            tokens = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
        tok = self.manifest.get("tokenizer", {})
        for key in ("bos_token", "eos_token"):
            if tok.get(key):
                tokens[key] = tok[key]
        return tokens

    def encode_prompt(self, text: str) -> list:
        """Completion prompt -> ids: encoded without special tokens, BOS in front when `add_bos`."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if self.add_bos and self.bos_token_id is not None else ids

    def encode_chat(self, rendered: str) -> list:
        """A rendered chat template -> ids, adding nothing: templates write their own BOS."""
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    @property
    def tensor_kinds(self) -> dict:
        """logical name -> {"kind", "shape"} (the manifest's tensor table)."""
        return self.manifest["tensors"]

    def __repr__(self):
        q = self.manifest.get("quantization", {})
        return f"Engine({self.name!r}, {self.config.architecture}, {q.get('method')}, {str(self.path)!r})"


def load_engine(path) -> Engine:
    path = Path(path)
    manifest = read_manifest(path)
    try:
        config = ModelConfig.from_dict(manifest["model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineFormatError(path / MANIFEST, f"bad \"model\" section: {exc}") from None
    weights = SafetensorsFile(path / manifest.get("weights", WEIGHTS))
    tensors = {name: weights.read_raw(name) for name in weights.keys()}
    check_tensors(path / MANIFEST, manifest["tensors"], {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
                   manifest["quantization"].get("group_size"), config)
    return Engine(path, manifest, config, tensors)


def read_manifest(path) -> dict:
    """engine.json, after checking `format` and `version`."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise EngineFormatError(path, f"not an engine directory: {MANIFEST} is missing")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineFormatError(file, f"not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise EngineFormatError(file, f"format {found!r} is not {FORMAT_NAME!r}")
    if manifest.get("version") not in SUPPORTED_VERSIONS:
        raise EngineFormatError(file, f"engine format version {manifest.get('version')!r} is not supported: "
                                      f"this tokenwire reads version {', '.join(map(str, SUPPORTED_VERSIONS))} "
                                      f"(rebuild the engine with `tokenwire build`)")
    for key in ("model", "quantization", "tokenizer", "tensors"):
        if not isinstance(manifest.get(key), dict):
            raise EngineFormatError(file, f"the {key!r} section is missing")
    return manifest


def check_tensors(where, table: Mapping[str, dict], stored: Mapping[str, tuple], group_size,
                   config: ModelConfig = None) -> None:
    """Every table entry has exactly its parts, with the shapes and dtypes its kind implies; nothing left over."""
    expected = {}
    for name, meta in table.items():
        kind, shape = meta.get("kind"), tuple(meta.get("shape") or ())
        if kind not in PARTS or len(shape) not in (1, 2) or (len(shape) == 1 and kind != "dense"):
            raise EngineFormatError(where, f"tensor {name!r} has a bad table entry {meta!r}")
        expected.update(_part_shapes(where, name, kind, shape, group_size))
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    if missing or extra:
        raise EngineFormatError(where, f"tensor table and {WEIGHTS} disagree: missing {missing[:5]}, unlisted {extra[:5]}")
    for key, (shape, dtypes) in expected.items():
        if stored[key][0] != shape or stored[key][1] not in dtypes:
            raise EngineFormatError(where, f"tensor {key!r} is stored as {stored[key][1]} {list(stored[key][0])}, "
                                           f"the tensor table implies {'/'.join(map(str, dtypes))} {list(shape)}")
    if config is not None:
        _check_against_config(where, table, config)


F32, F16, U8, I8 = (np.dtype(t) for t in ("float32", "float16", "uint8", "int8"))


def _part_shapes(where, name: str, kind: str, shape: tuple, group_size) -> dict:
    """Stored name -> (shape, allowed dtypes), per docs/ENGINE_FORMAT.md."""
    if kind == "dense":
        return {name: (shape, (F32,))} if len(shape) == 1 else {f"{name}.weight": (shape, (F32, F16))}
    n, k = shape
    if kind == "int8":
        return {f"{name}.qweight": (shape, (I8,)), f"{name}.scales": ((n,), (F16,))}
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise EngineFormatError(where, f"int4 tensor {name!r} needs a positive even quantization group_size, got {group_size!r}")
    num_groups = -(-k // group_size)
    return {f"{name}.qweight": ((n, num_groups * group_size // 2), (U8,)),
            f"{name}.scales": ((n, num_groups), (F16,)), f"{name}.zeros": ((n, num_groups), (F16,))}


def _check_against_config(where, table: Mapping[str, dict], config: ModelConfig) -> None:
    want = canonical_shapes(config)
    got = {name: tuple(meta["shape"]) for name, meta in table.items()}
    if got != want:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise EngineFormatError(where, f"tensor table does not match the model config (first differences: {diff})")
