"""Compile tokenwire's CUDA kernels into one cubin per architecture, cached on disk.

Contract:
- `kernel_image(arch)` returns the cubin (bytes) of every kernel for `arch` ("sm_90"):
  from the cache when present, else compiled with NVRTC (cuda-python's `cuda.bindings.nvrtc`,
  at first use) or, without NVRTC, with nvcc; the result is written to the cache.
- The cache key is the SHA-256 of the sources, the architecture and the compile flags, so an
  edited kernel can never load a stale binary, and a cubin built ahead of time with nvcc
  (`python -m tokenwire.kernels.cuda.build --arch sm_90`) is found by the runtime.
- Cache directory: $TOKENWIRE_CUDA_CACHE, else $XDG_CACHE_HOME/tokenwire/cuda, else
  ~/.cache/tokenwire/cuda. Writes are atomic (temporary file + rename).
- Always machine code (cubin), never PTX left for the driver to JIT: a cubin from a newer
  13.x toolkit still loads on an older 13.x driver, PTX would not.

The translation unit is every .cu file of this folder included in a fixed order
(kernels.SOURCE_FILES); the sources include no CUDA header, so NVRTC needs no include path.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from .kernels import SOURCE_FILES

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ("-std=c++17",)                                # shared by NVRTC and nvcc
NVCC_EXTRA = ("-O3",)


class KernelBuildError(RuntimeError):
    """The kernels did not compile; the message carries the compiler's log."""


def read_sources() -> dict:
    """file name -> source text, in SOURCE_FILES order."""
    missing = [f for f in SOURCE_FILES if not (SOURCE_DIR / f).is_file()]
    if missing:
        raise KernelBuildError(f"CUDA sources missing from {SOURCE_DIR}: {missing}")
    return {name: (SOURCE_DIR / name).read_text() for name in SOURCE_FILES}


def bundle_source() -> str:
    """The one translation unit: every kernel file, in order."""
    return "".join(f'#include "{name}"\n' for name in SOURCE_FILES if name.endswith(".cu"))


def check_arch(arch: str) -> str:
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"CUDA architecture must look like 'sm_90', got {arch!r}")
    return arch


def cache_key(arch: str, sources: Optional[dict] = None) -> str:
    h = hashlib.sha256()
    for name, text in (sources or read_sources()).items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(check_arch(arch).encode() + b"\0" + " ".join(FLAGS).encode())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    if os.environ.get("TOKENWIRE_CUDA_CACHE"):
        return Path(os.environ["TOKENWIRE_CUDA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenwire" / "cuda"


def cached_path(arch: str, directory: Optional[Path] = None) -> Path:
    return Path(directory or cache_dir()) / f"kernels-{arch}-{cache_key(arch)}.cubin"


# ------------------------------------------------------------------ compilers

def nvrtc_available() -> bool:
    try:
        _import_nvrtc()
        return True
    except ImportError:
        return False


def _import_nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        from cuda import nvrtc      # cuda-python < 12.6; raises ImportError when absent
    return nvrtc


def compile_nvrtc(arch: str, sources: Optional[dict] = None, ptx: bool = False) -> bytes:
    """-> cubin for `arch` (or PTX for the matching compute_XX when `ptx`)."""
    nvrtc = _import_nvrtc()
    sources = sources or read_sources()
    names = [n.encode() for n in sources]
    texts = [t.encode() for t in sources.values()]
    err, prog = nvrtc.nvrtcCreateProgram(bundle_source().encode(), b"tokenwire_kernels.cu", len(names), texts, names)
    _nvrtc_check(nvrtc, err, "nvrtcCreateProgram")
    try:
        target = ("compute_" if ptx else "sm_") + check_arch(arch)[3:]
        opts = [f"--gpu-architecture={target}".encode()] + [f.encode() for f in FLAGS]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            raise KernelBuildError(f"NVRTC could not compile the kernels for {arch}:\n{_nvrtc_log(nvrtc, prog)}")
        if ptx:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            _nvrtc_check(nvrtc, err, "nvrtcGetPTXSize")
            out = b" " * size
            _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTX(prog, out)[0], "nvrtcGetPTX")
            return out.rstrip(b"\0")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _nvrtc_check(nvrtc, err, "nvrtcGetCUBINSize")
        out = b" " * size
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, out)[0], "nvrtcGetCUBIN")
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_check(nvrtc, err, call: str) -> None:
    if int(err) != 0:
        raise KernelBuildError(f"{call} failed: {err}")


def _nvrtc_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.decode(errors="replace").rstrip("\0 ")


def nvcc_path() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else None


def compile_nvcc(arch: str, out_kind: str = "cubin", source: Optional[Path] = None, timeout: float = 600) -> bytes:
    """-> the nvcc output ("cubin" or "ptx") of the bundle (or of one file) for `arch`."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise KernelBuildError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    with tempfile.TemporaryDirectory(prefix="tokenwire-nvcc-") as tmp:
        src = source or Path(tmp) / "tokenwire_kernels.cu"
        if source is None:
            src.write_text(bundle_source())
        out = Path(tmp) / f"out.{out_kind}"
        target = f"-arch={check_arch(arch)}" if out_kind == "cubin" else f"-arch=compute_{arch[3:]}"
        cmd = [nvcc, f"-{out_kind}", target, *FLAGS, *NVCC_EXTRA, "-I", str(SOURCE_DIR), "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise KernelBuildError(f"nvcc could not compile {src.name} for {arch}:\n{proc.stderr.strip()}")
        return out.read_bytes()


# ------------------------------------------------------------------ the cache

def kernel_image(arch: str, directory: Optional[Path] = None, compiler: str = "auto") -> bytes:
    """The cubin of every kernel for `arch`: cached, else compiled (NVRTC first) and cached."""
    path = cached_path(arch, directory)
    if path.is_file():
        return path.read_bytes()
    image, used = compile_image(arch, compiler)
    store(path, image, {"arch": arch, "compiler": used, "sources": list(SOURCE_FILES)})
    return image


def compile_image(arch: str, compiler: str = "auto") -> tuple:
    """-> (cubin, compiler used). compiler: "auto" (NVRTC, else nvcc), "nvrtc" or "nvcc"."""
    if compiler not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"compiler must be auto, nvrtc or nvcc, got {compiler!r}")
    if compiler == "nvrtc" or (compiler == "auto" and nvrtc_available()):
        return compile_nvrtc(arch), "nvrtc"
    if compiler == "nvcc" or nvcc_path():
        return compile_nvcc(arch), "nvcc"
    raise KernelBuildError("neither NVRTC (pip install cuda-python) nor nvcc is available to build the CUDA kernels")


def store(path: Path, image: bytes, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(image)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None) -> int:
    """Build ahead of time: `python -m tokenwire.kernels.cuda.build --arch sm_90 [--arch sm_80]`."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--arch", action="append", default=None, help="target, e.g. sm_90 (repeatable; default sm_90)")
    p.add_argument("--compiler", choices=("auto", "nvrtc", "nvcc"), default="nvcc")
    p.add_argument("--cache-dir", type=Path, default=None)
    args = p.parse_args(argv)
    for arch in args.arch or ["sm_90"]:
        path = cached_path(arch, args.cache_dir)
        image, used = compile_image(arch, args.compiler)
        store(path, image, {"arch": arch, "compiler": used, "sources": list(SOURCE_FILES)})
        print(f"{arch}: {len(image)} bytes with {used} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
