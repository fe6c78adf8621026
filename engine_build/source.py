"""What every importer hands the build: one `SourceModel` in tokenwire's canonical layout.

Importers (hf.py, llama2c.py, default_model.py) turn a checkpoint into:
- `config`: core.config.ModelConfig;
- `tensors`: canonical logical names of docs/ENGINE_FORMAT.md (`embed`, `layers.{i}.qkv_proj`,
  `layers.{i}.qkv_bias`, `layers.{i}.o_proj`, `layers.{i}.attn_norm`, `layers.{i}.mlp_norm`,
  `layers.{i}.gate_up_proj`, `layers.{i}.down_proj`, `norm`, `lm_head`) -> numpy arrays, computed
  on access (one fused matrix at a time, so a large checkpoint never sits in memory whole).
  Matrices are float32 (bf16 and fp32 sources) or float16 (fp16 sources); norms and biases are
  always float32, with Gemma's `1 + w` already folded in;
- `tokenizer`: the files the engine directory will carry, and the prompt-encoding rule;
- `files`: every source file the build read, in a fixed order, for the source checksum;
- `imported` (GGUF, AWQ, GPTQ, compressed-tensors): the matrices that arrive as 4-bit codes,
  stored as they are (imported.py); `tensors` then holds the source's own dequantization.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import numpy as np
from tokenizers import Tokenizer

from ..core.config import ModelConfig
from ..core.errors import BuildError
from .imported import ImportedInt4


class LazyTensors(Mapping):
    """name -> array, each produced by its loader on every access (nothing is cached)."""

    def __init__(self, shapes: Mapping[str, tuple], loaders: Mapping[str, Callable[[], np.ndarray]], origin):
        self.shapes = dict(shapes)
        self._loaders = dict(loaders)
        self._origin = origin
        assert self.shapes.keys() == self._loaders.keys()

    def __getitem__(self, name) -> np.ndarray:
        array = self._loaders[name]()
        if tuple(array.shape) != tuple(self.shapes[name]):
            raise BuildError(self._origin, f"tensor {name!r} has shape {list(array.shape)}, "
                                           f"the config implies {list(self.shapes[name])}")
        return array

    def __contains__(self, name) -> bool:       # Mapping's default would load the tensor to find out
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@dataclass
class TokenizerFiles:
    """The tokenizer an engine carries, and how a prompt becomes ids.

    Prompt rule (what `Engine.encode_prompt` does): encode the text with
    `add_special_tokens=False`, then put `bos_token_id` in front when `add_bos`. A chat prompt
    is the rendered `chat_template` encoded the same way but with no BOS added, because
    templates that want one write `{{ bos_token }}` themselves (as Hugging Face does).
    """
    files: dict                         # engine-relative file name -> bytes (tokenizer.json, ...)
    chat_template: Optional[str]
    bos_token: Optional[str]
    eos_token: Optional[str]
    bos_token_id: Optional[int]
    eos_token_id: Optional[int]
    add_bos: bool
    vocab_size: int                     # the tokenizer's size, including added tokens


@dataclass
class SourceModel:
    kind: str                           # "hf" | "hub" | "llama2c" | "gguf" | "default"
    path: str                           # directory, file or hub name it came from
    name: str                           # display name (the manifest's "name")
    config: ModelConfig
    tensors: LazyTensors                # canonical name -> array (see module docstring)
    tokenizer: TokenizerFiles
    files: list = field(default_factory=list)   # source files read, for the checksum
    description: str = ""               # one line for /v1/models
    checksum: Optional[str] = None      # the source sha256 when there are no files to hash (default model)
    imported: Optional[ImportedInt4] = None     # pre-quantized matrices taken without requantizing


def file_stamp(path) -> dict:
    """What the manifest records per source file, so a cache can skip re-hashing an unchanged source."""
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sha256_files(paths) -> str:
    """sha256 over (file name, size, bytes) of each file in order: the manifest's source checksum."""
    h = hashlib.sha256()
    for path in paths:
        path = Path(path)
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def make_tokenizer_files(tokenizer_json: bytes, tokenizer_config: dict, origin, *,
                         chat_template: Optional[str] = None, extra_files: Optional[dict] = None,
                         bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None) -> TokenizerFiles:
    """Validate a tokenizer.json and decide the prompt rule from it and tokenizer_config.

    `bos_token_id` / `eos_token_id` (from the model config) name the special tokens when
    tokenizer_config does not."""
    try:
        tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise BuildError(origin, f"tokenizer.json cannot be loaded: {exc}") from None
    bos, eos = _token_text(tokenizer_config.get("bos_token")), _token_text(tokenizer_config.get("eos_token"))
    if bos is None and bos_token_id is not None:
        bos = tok.id_to_token(bos_token_id)
    if eos is None and eos_token_id is not None:
        eos = tok.id_to_token(eos_token_id)
    chat_template = chat_template if chat_template is not None else _chat_template(tokenizer_config)
    config = dict(tokenizer_config, chat_template=chat_template)
    config = {k: v for k, v in config.items() if v is not None or k == "chat_template"}
    files = {"tokenizer.json": tokenizer_json,
             "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode()}
    files.update(extra_files or {})
    return TokenizerFiles(files=files, chat_template=chat_template, bos_token=bos, eos_token=eos,
                          bos_token_id=tok.token_to_id(bos) if bos else None,
                          eos_token_id=tok.token_to_id(eos) if eos else None,
                          add_bos=_adds_bos(tok, bos, tokenizer_config), vocab_size=tok.get_vocab_size(True))


def _token_text(token) -> Optional[str]:
    """tokenizer_config spells special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(tokenizer_config: dict) -> Optional[str]:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):      # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _adds_bos(tok, bos: Optional[str], tokenizer_config: dict) -> bool:
    """tokenizer_config's `add_bos_token` when it says; else whether tokenizer.json's post-processor adds BOS."""
    bos_id = tok.token_to_id(bos) if bos else None
    if bos_id is None:
        return False
    if isinstance(tokenizer_config.get("add_bos_token"), bool):
        return tokenizer_config["add_bos_token"]
    with_special = tok.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos_id and tok.encode("a", add_special_tokens=False).ids[:1] != [bos_id]
