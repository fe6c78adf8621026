"""`--model SPEC` -> an engine directory, building into the user cache when needed.

SPEC is one of: a built engine directory (used as is); a Hugging Face model directory; a hub
name `org/name`; a llama2.c checkpoint .bin; or None for the embedded default model.

Builds land in `<cache>/engines/<name>-<key>`, where `key` hashes the source's identity (kind
and absolute path or hub name), the build options and the engine format version. A cached
engine is reused while its source is unchanged: the file sizes and mtimes recorded in its
manifest still match, or, when they do not, the sha256 over the source files still equals the
manifest's `source.sha256`. Otherwise it is rebuilt and replaced atomically.

The cache root is cache.py's: `$TOKENWIRE_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenwire`,
else `~/.cache/tokenwire`; `cache_dir=` overrides all three.
"""

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from ..kernels.engine_format import FORMAT_VERSION, MANIFEST, read_manifest
from .build import BuildOptions, build_engine, open_source
from .cache import engines_dir
from .default_model import default_engine_path
from .source import file_stamp, sha256_files


def resolve_model(spec=None, cache_dir=None, options=None, progress: bool = False,
                  log: Callable[[str], None] = lambda line: None) -> Path:
    """-> path of a loadable engine directory for `spec` (see the module docstring)."""
    if spec is None:
        return default_engine_path(cache_dir, progress=progress, log=log)
    path = Path(spec)
    if path.is_dir() and (path / MANIFEST).exists():
        read_manifest(path)                 # a wrong format or version fails here, with its message
        return path
    options = options or BuildOptions()
    source = open_source(spec, tokenizer=options.tokenizer)
    target = engines_dir(cache_dir) / f"{_slug(source.name)}-{cache_key(source, options)}"
    if (target / MANIFEST).exists() and source_unchanged(read_manifest(target), source.files):
        return target
    log(f"building an engine for {spec} into {target} (first use or changed source)")
    exists = "replace" if target.exists() else "keep"
    return build_engine(source, target, options, progress=progress, log=log, exists=exists)


def cache_key(source, options) -> str:
    identity = {"kind": source.kind, "path": _identity_path(source), "options": options.cache_key(),
                "format_version": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def source_unchanged(manifest: dict, files) -> bool:
    """Stamps (path, size, mtime) still match, or the content checksum still does."""
    recorded = manifest.get("source") or {}
    if [file_stamp(p) for p in files] == recorded.get("files"):
        return True
    return recorded.get("sha256") == sha256_files(files)


def _identity_path(source) -> str:
    return source.path if source.kind == "hub" else str(Path(source.path).resolve())


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
