"""`tokenwire export-onnx ENGINE -o DIR`: an engine directory -> its decode and prefill steps as ONNX.

Writes decode.onnx, prefill.onnx, weights.bin and export.json (kernels/trt/onnx_export.py, the
graphs the TensorRT backend builds from). Bad input prints one `error: ...` line and exits 2.
"""

import shutil
import sys
from pathlib import Path

from ..core.errors import BuildError
from ..kernels.engine_format import load_engine
from ..kernels.trt.onnx_export import MATMUL_DTYPES, ZERO_POINT_MODES, OnnxExportOptions, export_engine


def add_arguments(parser) -> None:
    parser.add_argument("engine", metavar="ENGINE", help="engine directory (tokenwire build's output)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write")
    parser.add_argument("--max-len", type=int, default=None, metavar="N",
                        help="KV cache capacity per sequence (default: the model's positions, at most 4096)")
    parser.add_argument("--zero-points", choices=ZERO_POINT_MODES, default="offset",
                        help="asymmetric INT4: offset (TensorRT's form, the default) or onnx (uint4 with a zero "
                             "point input; onnxruntime runs it, TensorRT refuses it)")
    parser.add_argument("--matmul-dtype", choices=sorted(MATMUL_DTYPES), default="float32",
                        help="inputs of the weight products: float32 (matches the reference forward, the default) "
                             "or float16 (TensorRT's INT4 GEMMs take float16 activations)")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists")


def run(args) -> int:
    out = Path(args.output)
    try:
        if out.exists() and not args.force:
            raise BuildError(out, "already exists (use --force to replace it)")
        manifest = export(args.engine, out, args.max_len, args.zero_points, args.matmul_dtype)
    except (BuildError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = ", ".join(manifest["files"])
    print(f"wrote {out}: {names} (max_len {manifest['max_len']}, sha256 {manifest['sha256'][:12]})", file=sys.stderr)
    return 0


def export(engine_dir, out: Path, max_len=None, zero_points="offset", matmul_dtype="float32") -> dict:
    """Load the engine and export it; a replaced DIR is removed first."""
    engine = load_engine(engine_dir)
    options = OnnxExportOptions(max_len=max_len, zero_points=zero_points, matmul_dtype=matmul_dtype)
    if out.exists():
        shutil.rmtree(out)
    return export_engine(engine, out, options)
