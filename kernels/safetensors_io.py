"""A safetensors reader over `mmap` (zero-copy numpy views) and a streaming writer.

Layout (https://huggingface.co/docs/safetensors): u64 little-endian header length N, N bytes
of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`,
then the data section; offsets are relative to its start, and tensors tile it without holes.

Why not `safetensors.safe_open(framework="numpy")`: it copies every tensor into a fresh
array, and it cannot return bfloat16 at all (numpy has no bf16). Here `read_raw` returns a
read-only view straight into the page cache and `read_float` upcasts bf16 by shifting the
raw uint16 bits into the high half of a float32 (exact). Every structural problem — short
file, bad header length, bad JSON, offsets past the end, a size that does not match the
shape — raises `BuildError` naming the file.
"""

import json
import mmap
import struct
from pathlib import Path
from typing import Mapping

import numpy as np

from ..core.errors import BuildError

# safetensors dtype tag -> numpy dtype (BF16 is read as its raw uint16 bits)
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
TAGS = {np.dtype(v): k for k, v in DTYPES.items() if k not in ("BF16",)}
MAX_HEADER_BYTES = 100 * 1024 * 1024   # the reference implementation's limit


class SafetensorsFile:
    """One memory-mapped .safetensors file. Arrays it returns keep the mapping alive."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < 8:
                    raise BuildError(self.path, f"truncated safetensors file: {size} bytes, no header length")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise BuildError(self.path, f"cannot read safetensors file: {exc.strerror or exc}") from None
        self.entries, self.metadata, self._data_start = _parse_header(self.path, self._mm)

    def keys(self):
        return self.entries.keys()

    def __contains__(self, name) -> bool:
        return name in self.entries

    def dtype_tag(self, name) -> str:
        return self._entry(name)[0]

    def shape(self, name) -> tuple:
        return self._entry(name)[1]

    def read_raw(self, name) -> np.ndarray:
        """Zero-copy read-only view in the stored dtype (bf16 as uint16 bits)."""
        tag, shape, begin, end = self._entry(name)
        if tag not in DTYPES:
            raise BuildError(self.path, f"tensor {name!r} has dtype {tag}, which tokenwire cannot read")
        dtype = DTYPES[tag]
        count = (end - begin) // dtype.itemsize
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._data_start + begin).reshape(shape)

    def read_float(self, name) -> np.ndarray:
        """float32 or float16 array (a view when the file already holds one; bf16 upcast exactly)."""
        tag = self.dtype_tag(name)
        if tag not in ("F32", "F16", "BF16", "F64"):
            raise BuildError(self.path, f"tensor {name!r} has dtype {tag}; expected a floating-point weight")
        raw = self.read_raw(name)
        if tag == "BF16":
            return bf16_bits_to_float32(raw)
        if tag == "F64":
            return raw.astype(np.float32)
        return raw

    def _entry(self, name):
        try:
            return self.entries[name]
        except KeyError:
            raise BuildError(self.path, f"tensor {name!r} is not in this file") from None


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact: bf16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _parse_header(path: Path, mm) -> tuple:
    """-> ({name: (dtype_tag, shape, begin, end)}, metadata, data_start). Validates everything."""
    size = len(mm)
    (header_len,) = struct.unpack("<Q", mm[:8])
    if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
        raise BuildError(path, f"corrupt safetensors header length {header_len}: the file has only {size - 8} bytes after it")
    try:
        header = json.loads(bytes(mm[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BuildError(path, f"corrupt safetensors header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BuildError(path, "corrupt safetensors header: expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - header_len
    entries = {name: _parse_entry(path, name, info, data_size) for name, info in header.items()}
    return entries, metadata, 8 + header_len


def _parse_entry(path: Path, name: str, info, data_size: int) -> tuple:
    try:
        tag, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise BuildError(path, f"corrupt safetensors header entry for {name!r}: {info!r}") from None
    if not 0 <= begin <= end:
        raise BuildError(path, f"tensor {name!r} has bad data offsets [{begin}, {end}]")
    if end > data_size:
        raise BuildError(path, f"tensor {name!r}: data offsets [{begin}, {end}] run beyond the end of the file "
                               f"(data section is {data_size} bytes; the file is truncated or corrupt)")
    if tag in DTYPES and (end - begin) != int(np.prod(shape, dtype=np.int64)) * DTYPES[tag].itemsize:
        raise BuildError(path, f"tensor {name!r}: {end - begin} bytes do not hold {tag} of shape {list(shape)}")
    return tag, shape, begin, end


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] = None) -> None:
    """Write `tensors` as one .safetensors file, streaming one tensor at a time.

    Tensors are laid out by decreasing item size (then name), so with the 8-byte-aligned
    header every tensor starts at a multiple of its own item size: aligned numpy views.
    """
    arrays = {name: np.asarray(a) for name, a in tensors.items()}
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in order:
        a = np.asarray(arrays[name], dtype=arrays[name].dtype.newbyteorder("<"))
        a = arrays[name] = a if a.flags.c_contiguous else a.copy()   # (ascontiguousarray makes 0-d 1-d)
        tag = TAGS.get(a.dtype)
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors tag")
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            f.write(arrays[name].reshape(-1).view(np.uint8).data)
