"""`tokenwire build SRC -o OUT`: checkpoint (HF directory, hub name, GGUF file, llama2.c .bin) -> engine directory.

Prints a progress bar while quantizing and the per-tensor error report at the end. Bad
input prints one `error: ...` line naming the file and the problem, and exits 2.
"""

import argparse
import sys
import time
from pathlib import Path

from ..core.errors import BuildError
from ..kernels.engine_format import read_manifest
from .build import BuildOptions, build_engine, format_report, open_source
from .onnx_cli import export as export_onnx
from .quantize import (
    ALGORITHMS,
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES,
    METHODS,
    PRECISIONS,
    QuantOptions,
)


def add_arguments(parser) -> None:
    parser.add_argument("source", metavar="SRC", help="Hugging Face model directory or hub name (org/name; float, "
                                                      "AWQ, GPTQ or compressed-tensors), GGUF file, or llama2.c "
                                                      "checkpoint .bin")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="engine directory to write")
    parser.add_argument("--quant", choices=METHODS, default="int4", help="int4 weights, or none (source precision)")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP_SIZE,
                        help=f"INT4 group size along K (default {DEFAULT_GROUP_SIZE}; a pre-quantized source "
                             "keeps its own)")
    parser.add_argument("--sym", action="store_true", help="symmetric INT4 (zero point 8)")
    default = QuantOptions().algorithm
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=default,
                        help=f"INT4 rounding: {', '.join(ALGORITHMS)} (see engine_build/quantize.py; default {default})")
    parser.add_argument("--embedding", choices=PRECISIONS, default=None,
                        help="token embedding encoding (default fp16 with int4, fp32 with none)")
    parser.add_argument("--lm-head", choices=PRECISIONS, default=None, help="untied classifier encoding (same default)")
    parser.add_argument("--tokenizer", metavar="PATH", help="llama2.c vocabulary (tok*.bin or SentencePiece .model); "
                                                            "default: the one beside the checkpoint")
    parser.add_argument("--calibration", metavar="FILE", help="calibration text (default: the shipped sample)")
    parser.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the float-vs-INT4 perplexity change on the shipped held-out text "
                             "(numpy reference forward; --no-eval skips it for large models; default on)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--export-onnx", metavar="DIR", help="also write the engine's ONNX export to DIR "
                                                             "(as `tokenwire export-onnx OUT -o DIR`)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no report")


def run(args) -> int:
    try:
        return _build(args)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _build(args) -> int:


    out = Path(args.output)
    if out.exists() and not args.force:
        raise BuildError(out, "already exists (use --force to replace an engine directory)")
    options = BuildOptions(QuantOptions(method=args.quant, group_size=args.group_size, symmetric=args.sym,
                                        algorithm=args.algorithm, embedding=args.embedding, lm_head=args.lm_head),
                           tokenizer=args.tokenizer, calibration=args.calibration, evaluate=args.eval)
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    t0 = time.perf_counter()
    source = open_source(args.source, tokenizer=args.tokenizer)
    c = source.config
    say(f"source: {source.kind} {source.path}: {c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}, "
        f"vocab {c.vocab_size}")
    build_engine(source, out, options, progress=not args.quiet, log=say, exists="replace" if args.force else "error")
    manifest = read_manifest(out)
    say(format_report(manifest["report"]))
    if args.export_onnx:
        export_onnx(out, Path(args.export_onnx))
        say(f"wrote the ONNX export to {args.export_onnx}")
    say(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0
