"""The engine directory of docs/ENGINE_FORMAT.md: `write_engine` and `load_engine`.

    engine = load_engine("out/stories260K")
    engine.config                   # ModelConfig
    engine.tensors["layers.0.qkv_proj.qweight"]   # read-only view into the mmap'd weights file
    engine.encode_prompt("Once upon a time")      # ids, BOS added by the engine's rule

Writing goes to a temporary sibling directory that is renamed into place at the end, so a
reader never sees half an engine. Loading memory-maps weights.safetensors and hands out
numpy views into the mapping (no copy, no read until a page is touched); it rejects an
unknown `format` or `version` naming the file and both versions, and checks that the tensor
table, the stored tensors and the config agree before anything runs.
"""

import json
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ..core.config import ModelConfig
from .errors import BuildError
from .safetensors_io import SafetensorsFile, write_safetensors
from .source import TokenizerFiles

FORMAT_NAME = "tokenwire-engine"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "engine.json"
WEIGHTS = "weights.safetensors"
# tensor kind -> stored parts (docs/ENGINE_FORMAT.md "Weight encodings"); vectors are stored bare
PARTS = {"dense": ("weight",), "int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}


class EngineFormatError(BuildError):
    """An engine directory that cannot be loaded (wrong format, unknown version, inconsistent)."""


def write_engine(out_dir, *, name: str, description: str, config: ModelConfig, quantization: dict,
                 tokenizer: TokenizerFiles, source: dict, tensors: Mapping[str, np.ndarray],
                 tensor_meta: Mapping[str, dict], report: Optional[dict] = None, exists: str = "error") -> Path:
    """Write a complete engine directory at `out_dir`. -> out_dir

    `exists` says what to do when `out_dir` is already there (checked before and after writing):
    "error"; "replace" (only an engine directory or an empty one; the new engine is complete
    before the old one moves away); "keep" (another process built the same engine first:
    keep theirs, drop ours)."""
    out_dir = Path(out_dir)
    manifest = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "name": name, "description": description,
        "model": config.to_dict(), "quantization": dict(quantization),
        "tokenizer": {"file": "tokenizer.json", "chat_template": tokenizer.chat_template,
                      "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "add_bos": tokenizer.add_bos},
        "source": dict(source), "weights": WEIGHTS, "tensors": {k: dict(v) for k, v in tensor_meta.items()},
        "report": report or {},
    }
    _check_tensors(out_dir, manifest["tensors"], {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
                   quantization.get("group_size"), config)
    _check_replaceable(out_dir, exists)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    os.chmod(tmp, 0o755)                # mkdtemp makes it private; an engine is ordinary shared data
    try:
        write_safetensors(tmp / WEIGHTS, tensors, {"format": FORMAT_NAME, "version": str(FORMAT_VERSION)})
        for file_name, data in tokenizer.files.items():
            (tmp / file_name).write_bytes(data)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        move_into_place(tmp, out_dir, exists)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_replaceable(out_dir: Path, exists: str) -> None:
    assert exists in ("error", "replace", "keep"), exists
    if not out_dir.exists() or exists == "keep":
        return
    if exists == "error":
        raise BuildError(out_dir, "already exists")
    if not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file()):
        raise BuildError(out_dir, "exists and is not an engine directory; refusing to replace it")


def move_into_place(tmp: Path, out_dir: Path, exists: str) -> None:
    """rename(tmp, out_dir), atomic. "replace" moves the old directory aside first, then deletes it;
    "keep" drops `tmp` when `out_dir` appeared meanwhile (rename onto a non-empty directory fails)."""
    old = None
    if exists == "replace" and out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if old is not None:
            os.rename(old, out_dir)
        if exists == "keep" and (out_dir / MANIFEST).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
        from tokenizers import Tokenizer
        file = self.path / self.manifest["tokenizer"].get("file", "tokenizer.json")
        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise EngineFormatError(file, f"cannot load the tokenizer: {exc}") from None

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
    _check_tensors(path / MANIFEST, manifest["tensors"], {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
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


def _check_tensors(where, table: Mapping[str, dict], stored: Mapping[str, tuple], group_size,
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
    from .source import canonical_shapes
    want = canonical_shapes(config)
    got = {name: tuple(meta["shape"]) for name, meta in table.items()}
    if got != want:
        diff = sorted(set(want.items()) ^ set(got.items()))[:4]
        raise EngineFormatError(where, f"tensor table does not match the model config (first differences: {diff})")
