"""`tokenwire bench grammar-engines`: the candidate grammar engines side by side.

For each engine (llguidance, outlines-core, xgrammar — those installed) and each tokenizer
(the default model's, and a ~150k-token byte-level BPE trained here on the Python standard
library's sources, cached under ~/.cache/tokenwire/bench; nothing downloads), it measures:
- compile: JSON schema -> a matcher with its first token mask ready (nothing cached);
- mask: the per-step token-mask fill, median over a walk that samples, seeded, one allowed
  token per step until the grammar ends (or `--steps`);
- then tokenwire's own `mask_logits` (fill + -inf, as sampling calls it) with every row's
  matcher advancing, at batch 1 and 64, for each tokenizer.
llguidance is a dependency; outlines-core and xgrammar are imported only when timed (not
installed: skipped). xgrammar imports torch (it needs torch and triton at install), so it
is timed here only, never in the serving path. Figures on a shared machine are noisy: medians of repetitions.
"""

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

import llguidance
import llguidance.numpy as lnp
import numpy as np
import tokenizers

from ..kernels.grammar import GrammarCompiler
from ..net.api.structured import schema_spec
from ..runtime import load_model
from .grammar_stages import SCHEMA, ConstraintWalk, _masker
from .stats import table

CACHE = Path.home() / ".cache" / "tokenwire" / "bench"
BIG_VOCAB = 150_000


def big_tokenizer(vocab_size: int = BIG_VOCAB) -> tokenizers.Tokenizer:
    """A byte-level BPE of ~`vocab_size` tokens trained on the stdlib's .py files (cached)."""
    path = CACHE / f"bpe{vocab_size}.json"
    if path.exists():
        return tokenizers.Tokenizer.from_file(str(path))
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="ignore") for f in files), trainer)
    CACHE.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


_PRINTABLE = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))


def byte_table(tok: tokenizers.Tokenizer) -> list:
    """Each id's bytes: GPT-2's byte alphabet (printable bytes as themselves, the rest from
    U+0100 on) mapped back."""
    inverse = {}
    n = 0
    for b in range(256):
        if b in _PRINTABLE:
            inverse[chr(b)] = b
        else:
            inverse[chr(256 + n)] = b
            n += 1
    out = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i) or ""
        out.append(bytes(inverse[c] for c in piece) if all(c in inverse for c in piece) else piece.encode())
    return out


def walk(first_mask, advance, vocab_size: int, steps: int, seed: int):
    """Sample one allowed token per step from the bitmask; -> per-step times (ns) of the
    engine advancing by the token and filling the next mask."""
    rng = np.random.default_rng(seed)
    mask = first_mask()
    times = []
    for _ in range(steps):
        ids = np.flatnonzero(bits(mask)[:vocab_size])
        if len(ids) == 0:
            break
        t0 = time.perf_counter_ns()
        mask = advance(int(rng.choice(ids)))               # the engine's advance + mask fill only
        if mask is None:
            break
        times.append(time.perf_counter_ns() - t0)
    return times


def bits(bitmask: np.ndarray) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little").astype(bool)


def run_llguidance(tok, eos: int, steps: int, seed: int):
    t0 = time.perf_counter_ns()
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)
    tokenizer_ns = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    matcher = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    mask = lnp.allocate_token_bitmask(1, lt.vocab_size)
    lnp.fill_next_token_bitmask(matcher, mask, 0)
    compile_ns = time.perf_counter_ns() - t0

    def advance(token):
        matcher.consume_token(token)
        if matcher.is_stopped():
            return None
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        return mask
    return tokenizer_ns, compile_ns, walk(lambda: mask, advance, tok.get_vocab_size(), steps, seed)


def run_outlines(tok, eos: int, steps: int, seed: int):
    import outlines_core
    t0 = time.perf_counter_ns()
    pieces = {}
    for i, b in enumerate(byte_table(tok)):
        if i != eos:
            pieces.setdefault(b, []).append(i)
    vocab = outlines_core.Vocabulary(eos, pieces)
    tokenizer_ns = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    guide = outlines_core.Guide(outlines_core.Index(regex, vocab))
    mask = np.zeros((tok.get_vocab_size() + 31) // 32, dtype=np.int32)
    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
    compile_ns = time.perf_counter_ns() - t0

    def advance(token):
        guide.advance(token, return_tokens=False)
        if guide.is_finished():
            return None
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        return mask
    return tokenizer_ns, compile_ns, walk(lambda: mask, advance, tok.get_vocab_size(), steps, seed)


def run_xgrammar(tok, eos: int, steps: int, seed: int):
    import xgrammar                                  # imports torch: benchmarks only
    t0 = time.perf_counter_ns()
    info = xgrammar.TokenizerInfo(byte_table(tok), vocab_type=xgrammar.VocabType.RAW,
                                  vocab_size=tok.get_vocab_size(), stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    tokenizer_ns = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    mask = xgrammar.allocate_token_bitmask(1, tok.get_vocab_size())
    matcher.fill_next_token_bitmask(mask)
    compile_ns = time.perf_counter_ns() - t0

    def advance(token):
        matcher.accept_token(token)
        if matcher.is_terminated():
            return None
        matcher.fill_next_token_bitmask(mask)
        return mask.numpy()
    return tokenizer_ns, compile_ns, walk(lambda: mask.numpy(), advance, tok.get_vocab_size(), steps, seed)


ENGINES = {"llguidance": run_llguidance, "outlines-core": run_outlines, "xgrammar": run_xgrammar}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default=",".join(ENGINES), help="engines to time (default all installed)")
    parser.add_argument("--repeats", type=int, default=3, help="walks per engine and tokenizer (default 3)")
    parser.add_argument("--steps", type=int, default=200, help="tokens per walk at most (default 200)")
    parser.add_argument("--json", default=None, help="also write the results here")


def run(args) -> int:
    model = load_model(None)
    tokenizers_ = {f"default ({model.config.vocab_size})": (model.tokenizer, model.eos_token_ids[0])}
    big = big_tokenizer()
    tokenizers_[f"bpe ({big.get_vocab_size()})"] = (big, big.token_to_id("<|endoftext|>"))
    rows, results = [], []
    for tok_name, (tok, eos) in tokenizers_.items():
        for engine in args.engines.split(","):
            try:
                runs = [ENGINES[engine](tok, eos, args.steps, seed) for seed in range(args.repeats)]
            except ImportError as exc:
                print(f"{engine}: not installed ({exc})")
                continue
            compile_us = statistics.median(r[1] for r in runs) / 1e3
            per_token = [statistics.median(r[2]) / 1e3 for r in runs if r[2]]
            mask_us = statistics.median(per_token)
            tokenizer_ms = statistics.median(r[0] for r in runs) / 1e6
            num_tokens = sum(len(r[2]) for r in runs)
            results.append({"tokenizer": tok_name, "engine": engine, "tokenizer_setup_ms": tokenizer_ms,
                            "compile_us": compile_us, "mask_us_per_token": mask_us, "num_tokens": num_tokens})
            rows.append([tok_name, engine, f"{tokenizer_ms:.1f}", f"{compile_us:.0f}", f"{mask_us:.1f}",
                         str(num_tokens)])
    print(table(["tokenizer", "engine", "tokenizer setup ms", "compile us", "mask us/token (median)", "tokens"], rows))
    batch_rows = []
    for tok_name, (tok, eos) in tokenizers_.items():
        for batch in (1, 64):
            us = batch_mask_us(tok, eos, batch, args.steps)
            results.append({"tokenizer": tok_name, "engine": "tokenwire mask_logits", "batch": batch,
                            "mask_us_per_token": us / batch})
            batch_rows.append([tok_name, str(batch), f"{us:.0f}", f"{us / batch:.1f}"])
    print(table(["tokenizer", "batch", "mask_logits + advance us (median)", "per token us"], batch_rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def batch_mask_us(tok, eos: int, batch: int, steps: int) -> float:
    """kernels/grammar.mask_logits in place (fill + apply, as sampling calls it) plus every row's
    matcher advancing, `batch` rows of the JSON schema: median us per call over `steps` calls."""
    compiled = GrammarCompiler(tok, tok.get_vocab_size(), [eos]).compile(schema_spec(SCHEMA))
    logits = np.random.default_rng(0).standard_normal((batch, tok.get_vocab_size()), dtype=np.float32)
    fn = _masker(logits, ConstraintWalk(compiled, batch))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3
