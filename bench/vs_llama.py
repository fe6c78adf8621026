"""`tokenwire bench engine --vs llama.cpp`: tokenwire's C kernels and llama.cpp on one GGUF file.

    tokenwire bench engine --vs llama.cpp [--shape default] [--prompt-len 128] [--repeat 3]

1. A Q4_0 GGUF of the shape's random weights is written with the `gguf` package
   (bench/gguf_random.py: every matrix Q4_0, the embedding included; norms F32; an
   SPM vocabulary of the shape's size). Both engines load that one file: llama.cpp reads
   it directly, tokenwire imports it with its GGUF importer (engine_build/gguf_import.py),
   which keeps Q4_0's 4-bit codes and fp16 scales as they are (group size 32), so both
   read the same weight bytes.
2. Three figures each, in alternating runs (tokenwire, llama.cpp, tokenwire, ...) on the
   same threads: prefill of --prompt-len tokens of one sequence (tokens/s of that one
   step), and decode tokens/s at batch 1 and batch 16 (16 sequences, one token each per
   step) after every sequence holds --prompt-len tokens: --steps timed steps after one
   warm-up, the median step. Neither side samples: both compute the logits of the rows
   that need them (llama.cpp's logits flags, tokenwire's forward).
3. Numerics: tokenwire with --activations (default: the served default, int8
   activations); llama.cpp's Q4_0 products quantize activations to 8 bits (q8_0) too.

llama.cpp comes from llama-cpp-python (the `llama` extra, built from source by pip; never in
CI): its low-level API (llama_decode on a llama_batch). LLAMA_CPP_LIB_PATH may point at a
llama.cpp build's library folder, as llama-cpp-python itself allows.
"""

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..core.options import DEFAULTS
from ..engine_build.build import BuildOptions, build_engine, open_source
from ..kernels import cpu
from ..kernels.cpu.model import CpuModel
from ..kernels.engine_format import load_engine
from .forward_timing import BLOCK_SIZE, bench_prompt, time_batch
from .gguf_random import write_gguf
from .shapes import shape_config

try:
    import llama_cpp
except ImportError as exc:      # the optional `llama` extra
    llama_cpp = None
    LLAMA_IMPORT_ERROR = str(exc)

if llama_cpp is not None:
    _QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)   # kept alive: C holds it

BATCHES = (1, 16)
TARGET = 1.3                    # issue 19: >= 1.3x llama.cpp on each figure, with the default numerics


def gguf_shape(config) -> dict:
    """bench/gguf_random.py's shape keys for a ModelConfig."""
    return dict(vocab=config.vocab_size, dim=config.hidden_size, hidden=config.intermediate_size,
                layers=config.num_layers, heads=config.num_heads, kv_heads=config.num_kv_heads,
                context=config.max_position_embeddings)


class LlamaCpp:
    """One llama.cpp context over the GGUF, with room for BATCHES' largest batch of sequences."""

    def __init__(self, path: Path, threads: int, context: int, max_batch: int):
        llama_cpp.llama_log_set(_QUIET, None)       # its load log would bury the table
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"tokenwire bench engine: llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        self.max_tokens = max(512, max_batch * context)
        params.n_ctx = max_batch * context
        params.n_batch = params.n_ubatch = self.max_tokens
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("tokenwire bench engine: llama.cpp could not make a context")
        self.batch = llama_cpp.llama_batch_init(self.max_tokens, 0, max_batch)

    def _decode(self, rows: list) -> float:
        """rows: (token, position, sequence, wants logits) -> seconds the decode took."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self.ctx, b)
        llama_cpp.llama_synchronize(self.ctx)
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"tokenwire bench engine: llama_decode returned {rc}")
        return elapsed

    def time_batch(self, batch: int, prompt: list, num_steps: int) -> dict:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        n = len(prompt)
        prefill_s = self._decode([(t, j, s, j == n - 1) for s in range(batch) for j, t in enumerate(prompt)])
        step_s = [self._decode([(prompt[i % n], n + i, s, True) for s in range(batch)]) for i in range(num_steps + 1)]
        return {"prefill_tokens_per_s": batch * n / prefill_s, "step_s": step_s[1:]}

    def greedy(self, prompt: list, num_tokens: int) -> tuple:
        """llama.cpp's own greedy continuation of one `prompt`. -> (the token ids, float32
        [num_tokens, vocab] logits each was the argmax of)"""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self._decode([(t, j, 0, j == len(prompt) - 1) for j, t in enumerate(prompt)])
        tokens, logits = [], []
        for i in range(num_tokens):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(vocab,)).copy()
            tokens.append(int(np.argmax(row)))
            logits.append(row)
            if i < num_tokens - 1:
                self._decode([(tokens[-1], len(prompt) + i, 0, True)])
        return tokens, np.stack(logits)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


class Tokenwire:
    """The C forward on the engine tokenwire's GGUF importer built from the same file."""

    def __init__(self, engine_dir: Path, activations: str, context: int, max_batch: int):
        engine = load_engine(engine_dir)
        self.config = engine.config
        blocks_per_seq = -(-context // BLOCK_SIZE)
        self.model = CpuModel(engine.config, engine.tensors, BLOCK_SIZE, max_batch * blocks_per_seq,
                              activations=activations)

    def time_batch(self, batch: int, prompt: list, num_steps: int) -> dict:
        return time_batch(self.model, self.config, batch, len(prompt), num_steps)   # the same prompt (bench_prompt)


def build_pair(config, name: str, workdir: Path, log) -> tuple:
    """The Q4_0 GGUF of random weights of `config`'s shape, and the engine tokenwire builds
    from it. -> (gguf path, engine dir)"""
    path = workdir / f"{name}-q4_0.gguf"
    write_gguf(path, arch="llama", types="Q4_0", tied=config.tie_word_embeddings, shape=gguf_shape(config))
    engine_dir = build_engine(open_source(path), workdir / "engine", BuildOptions(), log=log)
    return path, engine_dir


def run_shape(shape: str, args, activations: str, threads: int) -> list:
    context = args.prompt_len + args.steps + 2
    with tempfile.TemporaryDirectory(prefix="tokenwire-vs-llama-") as tmp:
        t0 = time.perf_counter()
        path, engine_dir = build_pair(shape_config(shape), shape, Path(tmp), log=lambda line: None)
        print(f"\n== {shape}: tokenwire ({activations} activations) vs llama.cpp on one Q4_0 GGUF "
              f"({path.stat().st_size / 1e6:.1f} MB, written and imported in {time.perf_counter() - t0:.1f} s); "
              f"{threads} threads each")
        engines = {"tokenwire": Tokenwire(engine_dir, activations, context, max(BATCHES)),
                   "llama.cpp": LlamaCpp(path, threads, context, max(BATCHES))}
        config = engines["tokenwire"].config
        try:
            figures = measure(engines, config, args)
        finally:
            engines["llama.cpp"].close()
    return report(shape, figures, activations, args)


def measure(engines: dict, config, args) -> dict:
    """{figure: {engine: [per-repeat values]}}, engines alternating within each repeat."""
    figures = {"prefill": {}, **{f"decode b{b}": {} for b in BATCHES}}
    for _ in range(args.repeat):
        for name, engine in engines.items():
            prompt = bench_prompt(config, 1, args.prompt_len)
            r = engine.time_batch(1, prompt, args.steps)
            figures["prefill"].setdefault(name, []).append(r["prefill_tokens_per_s"])
            figures["decode b1"].setdefault(name, []).append(1 / statistics.median(r["step_s"]))
            for b in BATCHES[1:]:
                r = engine.time_batch(b, bench_prompt(config, b, args.prompt_len), args.steps)
                figures[f"decode b{b}"].setdefault(name, []).append(b / statistics.median(r["step_s"]))
    return figures


def report(shape: str, figures: dict, activations: str, args) -> list:
    print(f"   tokens/s, medians of {args.repeat} alternating runs (range); prefill: one sequence of "
          f"{args.prompt_len} tokens; decode: {args.steps} steps after {args.prompt_len} tokens")
    print(f"   {'figure':12} {'tokenwire':>22} {'llama.cpp':>22} {'ratio':>8}  target >= {TARGET}x")
    rows = []
    for figure, by_engine in figures.items():
        tw, ll = by_engine["tokenwire"], by_engine["llama.cpp"]
        ratio = statistics.median(tw) / statistics.median(ll)
        print(f"   {figure:12} {statistics.median(tw):>10.1f} ({min(tw):.0f}-{max(tw):.0f})"
              f" {statistics.median(ll):>10.1f} ({min(ll):.0f}-{max(ll):.0f}) {ratio:>7.2f}x  "
              f"{'met' if ratio >= TARGET else 'NOT met'}")
        rows.append({"shape": shape, "figure": figure, "activations": activations, "tokenwire": tw, "llama_cpp": ll,
                     "ratio": ratio, "target": TARGET})
    return rows


def run(args) -> int:
    if llama_cpp is None:
        raise SystemExit("tokenwire bench engine --vs llama.cpp needs llama-cpp-python "
                         f"(pip install 'tokenwire[llama]', a source build): {LLAMA_IMPORT_ERROR}")
    if not cpu.AVAILABLE:
        raise SystemExit(f"tokenwire bench engine: the C kernels are not built ({cpu.IMPORT_ERROR})")
    activations = args.activations if args.activations in ("fp32", "int8") else DEFAULTS.activations
    threads = cpu.num_threads() if args.threads is None else args.threads
    cpu.set_num_threads(threads)
    rows = []
    for shape in args.shape or ["default"]:
        rows += run_shape(shape, args, activations, threads)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
