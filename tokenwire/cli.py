"""tokenwire: a minimum-latency LLM inference server (OpenAI-compatible API and gRPC over HTTP/2 and HTTP/1.1), its engine builder and its benchmarks.

The `tokenwire` command line: one table of subcommands, each living beside the code it drives.

A command module provides `add_arguments(parser)` and `run(args) -> int`; it imports its
heavy dependencies inside `run`, so `tokenwire --help` stays fast.
"""

import argparse
import importlib
import os
import sys

from . import __version__

# command -> (module, one-line help)
COMMANDS = {
    "serve": ("tokenwire.serve", "serve a model over HTTP/2 (and HTTP/1.1)"),
    "build": ("tokenwire.engine_build.cli", "build an INT4 engine directory from a checkpoint"),
    "export-onnx": ("tokenwire.engine_build.onnx_cli", "export an engine's decode and prefill steps as ONNX (TensorRT)"),
    "engine-process": ("tokenwire.engine_process", "the engine of `serve --engine-process` (the server starts it)"),
}
# `tokenwire bench NAME`
BENCHES = {
    "engine": ("tokenwire.bench.engine", "decode/prefill tokens/s against the memory-bandwidth roofline"),
    "numerics": ("tokenwire.bench.numerics", "accuracy of int8 activations against the exact path (perplexity, greedy)"),
    "scheduler": ("tokenwire.bench.scheduler", "scheduler overhead per step with a zero-cost engine"),
    "overlap": ("tokenwire.bench.overlap", "overlapped engine steps against synchronous ones on the mock's step time"),
    "stages": ("tokenwire.bench.stages", "per-stage microbenchmarks of the request pipeline"),
    "hostcpu": ("tokenwire.bench.hostcpu", "the server's host CPU (or instructions) per token over whole requests, "
                                           "in one process"),
    "load": ("tokenwire.bench.load", "HTTP/2 load generator against a running server"),
    "timeline": ("tokenwire.bench.timeline", "an engine's steps one by one under load, and what the slowest held"),
    "peers": ("tokenwire.bench.peers.cli", "tokenwire against peer servers on the same mock engine"),
    "prefix": ("tokenwire.bench.prefix", "prefix cache on against off: shared system prompt TTFT, multi-turn prefill"),
    "spec": ("tokenwire.bench.spec", "speculative decoding (n-gram, a draft model) against none: tok/s, ITL, acceptance"),
    "response-cache": ("tokenwire.bench.response_cache", "TTFT of a response-cache answer against the mock engine's"),
    "cold-start": ("tokenwire.bench.cold_start", "the first request after /health 200 against the fifth, over fresh starts"),
    "deploy": ("tokenwire.bench.deploy", "the binary against the pip install; HAProxy against one replica"),
    "abuse": ("tokenwire.bench.abuse", "floods, slow clients and oversized requests against a server, "
                                       "a legitimate client beside them"),
    "soak": ("tokenwire.bench.soak", "10k cancelled requests and a 100k-request h2load run; the engine must end clean"),
    "grammar-engines": ("tokenwire.bench.grammar_engines", "llguidance, outlines-core, xgrammar: compile and mask times"),
}


def _add_table(subparsers, table, chosen):
    """Add every command's parser; only the chosen one's module is imported."""
    for name, (module_name, help_text) in table.items():
        parser = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(parser)
            parser.set_defaults(_run=module.run)


def build_parser(argv):
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    bench_name = words[1] if command == "bench" and len(words) > 1 else None
    parser = argparse.ArgumentParser(prog="tokenwire", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--version", action="version", version=f"tokenwire {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_table(subparsers, COMMANDS, command)
    bench = subparsers.add_parser("bench", help="benchmarks of each pipeline stage and of the whole server")
    _add_table(bench.add_subparsers(dest="bench", required=True, metavar="BENCH"), BENCHES, bench_name)
    return parser


def main(argv=None):
    # Before numpy loads: multi-threaded OpenBLAS makes the small per-step products of the
    # reference forward ~100x slower on a loaded 2-core machine, and the engine already
    # owns the cores it uses. An explicit setting in the environment wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return args._run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
