"""The CUDA path imports on the GPU image (issue 26): the serving path, the CUDA benchmarks and
the GPU test modules import in a child process whose import hook refuses every top-level module
that is neither the standard library, nor a distribution on the image
(kernels/cuda/gpu_image_packages.txt), nor a wheel `verify_on_gpu.sh prepare` carries. A module
that only some routes need (llguidance, gguf) must be optional: imported where it is present, a
clear error where it is used."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "kernels" / "cuda" / "gpu_image_packages.txt"
CARRIED = {"h2", "hpack", "hyperframe", "orjson"}        # verify_on_gpu.sh prepare's wheels
ALSO_INSTALLED = {"py"}                                  # a second top-level module of a listed one (pytest's)
# distributions whose import name is not their name
IMPORT_NAMES = {"cuda-bindings": "cuda", "cuda-core": "cuda", "cuda-pathfinder": "cuda", "cuda-toolkit": "cuda",
                "pyyaml": "yaml", "protobuf": "google", "grpcio": "grpc", "pillow": "PIL",
                "opencv-python-headless": "cv2", "scikit-learn": "sklearn", "scikit-image": "skimage",
                "python-dateutil": "dateutil", "nvidia-ml-py": "pynvml", "cupy-cuda13x": "cupy",
                "py-cpuinfo": "cpuinfo", "prometheus-client": "prometheus_client"}
MODULES = ["tokenwire.serve", "tokenwire.cli", "tokenwire.runtime", "tokenwire.kernels.cuda.executor",
           "tokenwire.kernels.cuda.build", "tokenwire.bench.engine", "tokenwire.bench.engine_cuda",
           "tokenwire.bench.load", "tokenwire.bench.overlap", "conftest", "test_cuda_kernels", "test_cuda_fused",
           "test_cuda_golden", "test_cuda_executor_fake", "test_cuda_wait", "test_cuda_bench", "test_overlap"]

CHILD = r"""
import importlib, json, sys
from importlib.abc import MetaPathFinder
allowed = set(json.loads(sys.argv[1])) | set(sys.stdlib_module_names) | {"tokenwire", "__main__"}
refused = []

def importer() -> str:    # the module whose import statement runs: the first frame outside importlib
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith("<frozen"):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "")


# judges the project's own imports (tokenwire, the tests); an installed package's imports of its
# own dependencies are the image's business, whose versions differ from this machine's
class Image(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top, by = name.split(".")[0], importer().split(".")[0]
        ours = by in ("tokenwire", "conftest", "__main__") or by.startswith("test_")
        if ours and top not in allowed and not top.startswith("_") and not top.startswith("test_") \
                and top != "conftest":
            refused.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} on the GPU image", name=name)

sys.meta_path.insert(0, Image())
failed = {}
for module in json.loads(sys.argv[2]):
    try:
        importlib.import_module(module)
    except Exception as exc:
        failed[module] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"failed": failed, "refused": sorted(set(refused))}))
"""


def image_modules() -> set:
    names = [line.strip() for line in IMAGE_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")]
    test_helpers = {p.stem for p in (REPO / "tests").glob("*.py")}       # engines.py & co. travel with the tree
    return {IMPORT_NAMES.get(n.lower(), n.lower().replace("-", "_")) for n in names} | CARRIED | ALSO_INSTALLED \
        | test_helpers


def test_the_cuda_path_imports_with_only_the_gpu_images_packages():
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(sorted(image_modules())), json.dumps(MODULES)],
                         capture_output=True, text=True, timeout=120, cwd=REPO / "tests",
                         env={"PYTHONPATH": str(REPO / "tests"), "PYTHONSAFEPATH": "1",
                              **{k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH",)}})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, result
    # the hook is not a no-op: the optional parts were asked for and refused
    assert {"llguidance", "gguf"} <= {name.split(".")[0] for name in result["refused"]}


def test_the_optional_parts_say_what_is_missing():
    out = subprocess.run([sys.executable, "-c", CHILD.replace("failed = {}", """failed = {}
sys.argv[2] = '[]'
from tokenwire.kernels import grammar
from tokenwire.engine_build import gguf_import
from tokenwire.bench import gguf_random
print(json.dumps([grammar.MISSING, gguf_import.MISSING, gguf_random.MISSING]))
raise SystemExit(0)"""), json.dumps(sorted(image_modules())), "[]"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grammar, gguf_reader, gguf_writer = json.loads(out.stdout.strip().splitlines()[-1])
    assert "pip install llguidance" in grammar
    assert "pip install gguf" in gguf_reader and "pip install gguf" in gguf_writer


def test_without_llguidance_a_server_has_no_constrained_decoding_and_says_why(monkeypatch, caplog):
    from dataclasses import replace

    from tokenwire import runtime
    from tokenwire.core.options import DEFAULTS
    monkeypatch.setattr(runtime, "GRAMMARS_MISSING", "structured output needs llguidance (pip install llguidance)")
    built = runtime.build_engine(replace(DEFAULTS, warm_up=False, max_model_len=256))
    try:
        assert built.card.grammars is None          # net/ answers a constrained request with a 400
        assert "pip install llguidance" in caplog.text
    finally:
        built.core.executor.close()


def test_without_gguf_a_gguf_file_fails_to_build_saying_why(monkeypatch, tmp_path):
    import pytest

    from tokenwire.core.errors import BuildError
    from tokenwire.engine_build import gguf_import
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setattr(gguf_import, "MISSING", "reading GGUF files needs the gguf package (pip install gguf)")
    with pytest.raises(BuildError, match="pip install gguf"):
        gguf_import.import_gguf(path)
