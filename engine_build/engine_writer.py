"""Writing the engine directory of docs/ENGINE_FORMAT.md (kernels/engine_format.py reads it).

Writing goes to a temporary sibling directory that is renamed into place at the end, so a
reader never sees half an engine; the tensor table is checked against the stored tensors
and the config with the reader's own rules before anything is written.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ..core.config import ModelConfig
from ..core.errors import BuildError
from ..kernels.engine_format import FORMAT_NAME, FORMAT_VERSION, MANIFEST, WEIGHTS, check_tensors
from ..kernels.safetensors_io import write_safetensors
from .source import TokenizerFiles


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
    check_tensors(out_dir, manifest["tensors"], {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
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
