"""`tokenwire bench scheduler`: what one engine step costs outside the model.

Runs `EngineCore.step()` over the zero-cost mock executor with B requests decoding
(B = 1, 16, 64, 256 by default) and subtracts the time spent inside `executor.step`.

Included in the figure: taking the inbox and cancellations (lock), scheduling (decode
slots, block accounting with a new block every `block_size` tokens, one SeqStep per
request: its DecodeStep, updated in place), and output processing (appending the token, EOS / stop-id / length checks,
detokenization through the byte-table fast path, one RequestOutput per request, the
per-token timeline stamp). Excluded: the executor (the mock's own work). Stop strings
are off here; detokenization is also timed on its own, per token, for both decoders.

`--sampling` times kernels/sampling.py's `sample()` instead (V = 32000 and 151936, batch 1 and
64, greedy / temperature / top_p / top_k / min_p) against `sample_reference()` in the same run.
`--forward-batch` times kernels/forward_batch.py's `build_forward_batch` (decode steps, a prefill,
a mixed step) against `build_forward_batch_reference` in the same run.

Reference, measured in the same run: the bare cost of what the record contracts ask per
decoding request, in a Python loop — updating its `DecodeStep` in place (core/executor.py:
the scheduler keeps one per decoding request) and allocating one `RequestOutput`, the
record that crosses to the event loop. NamedTuple construction dominates at large batch.
(Before DecodeStep, the floor was a fresh SeqStep + RequestOutput per request: about twice this.)
"""

import argparse
import gc
import json
import statistics
import time

import numpy as np

from ..core.detokenizer import Detokenizer, IncrementalDecoder
from ..core.executor import DecodeStep, SeqStep
from ..core.options import EngineOptions
from ..core.outputs import RequestOutput, Timeline
from ..core.sampling_params import SamplingParams
from ..kernels.forward_batch import (
    BlockTables,
    build_forward_batch,
    build_forward_batch_reference,
)
from ..kernels.mock import MOCK_TEXT, build_mock_tokenizer
from ..kernels.sampling import sample, sample_reference
from ..runtime import build_engine
from .args import positive_int

TARGET_US_AT_64 = 50.0



def batch_list(text: str) -> list:
    return [positive_int(part) for part in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=batch_list, default=None,
                        help="comma-separated batch sizes (default: 1,16,64,256; with --sampling 1,64)")
    parser.add_argument("--steps", type=positive_int, default=1000, help="timed steps per round (default: %(default)s)")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="rounds per batch size, fresh engine each (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--sampling", action="store_true",
                        help="instead: kernels/sampling.py's sample() per step, fast path against the reference")
    parser.add_argument("--vocab-sizes", type=batch_list, default=[32000, 151936],
                        help="with --sampling: comma-separated vocabulary sizes (default: 32000,151936)")
    parser.add_argument("--forward-batch", action="store_true",
                        help="instead: kernels/forward_batch.py's build_forward_batch per step, against its reference")


def make_engine(batch: int, max_tokens: int):
    """An EngineCore over the zero-cost mock with `batch` requests of `max_tokens` each; its
    executor's step time (EngineCore.last_step_ns) is subtracted from each step."""
    options = EngineOptions(backend="mock", max_model_len=max_tokens + 64, max_num_seqs=max(batch, 1),
                            max_num_batched_tokens=max(2048, batch),
                            num_kv_blocks=batch * (max_tokens // 16 + 4) + 64)
    engine = build_engine(options).core
    prompt = engine.executor.text_token_ids[:16]
    for i in range(batch):
        engine.add_request(i, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), Timeline())
    return engine


def time_steps(batch: int, num_steps: int) -> list:
    """Per-step overhead in µs (step() minus executor) for one fresh engine."""
    warmup = 20
    engine = make_engine(batch, num_steps + warmup + 8)
    for _ in range(warmup):
        engine.step()
    samples = []
    for _ in range(num_steps):
        t0 = time.perf_counter_ns()
        outputs = engine.step().rows
        samples.append((time.perf_counter_ns() - t0 - engine.last_step_ns) / 1e3)
        assert len(outputs) == batch, "every request must produce a token each step"
    return samples


def record_floor_us(batch: int, repeats: int = 200) -> float:
    """Median µs to update `batch` DecodeSteps and build `batch` RequestOutputs in a bare loop."""
    new, params, ids = tuple.__new__, SamplingParams(), [1, 2, 3]
    steps = [DecodeStep(i, (3,), 2, ids, True, params, 7, ids, ids) for i in range(batch)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        seqs, outs = [], []
        for i, step in enumerate(steps):
            step.start_pos = i
            step.token_ids = token_ids = (i,)
            seqs.append(step)
            outs.append(new(RequestOutput, (i, token_ids, "x", None, None, 3, 1, t0, None)))
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def detok_us_per_token(num_tokens: int = 20000) -> dict:
    """Detokenization alone: both decoders over the mock story, µs per token."""
    tokenizer = build_mock_tokenizer()
    story = tokenizer.encode(MOCK_TEXT, add_special_tokens=False).ids
    ids = (story * (num_tokens // len(story) + 1))[:num_tokens]
    detok = Detokenizer(tokenizer)
    out = {}
    for name, decoder in (("byte_table", detok.decoder(story[:4])),
                          ("generic", IncrementalDecoder(tokenizer, story[:4], True, detok.special_ids))):
        n = num_tokens if name == "byte_table" else num_tokens // 10
        t0 = time.perf_counter_ns()
        text = "".join(decoder.push(i) for i in ids[:n]) + decoder.finish()
        out[name] = (time.perf_counter_ns() - t0) / 1e3 / n
        assert text == tokenizer.decode(ids[:n]), f"{name} decoder text differs from tokenizer.decode"
    return out


def percentile(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


SAMPLING_MODES = {                      # name -> SamplingParams keyword arguments
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k": {"temperature": 0.8, "top_k": 50},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
}


def time_call_us(fn, min_repeats: int, budget_s: float) -> tuple:
    """-> (median µs of one call, its result): at least `min_repeats` calls, more while the budget lasts."""
    times, result, start = [], None, time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter_ns()
        result = fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times), result


def sampling_rows(vocab_sizes: list, batches: list) -> list:
    """sample() against sample_reference() on the same float32 logits (standard normal x 2.5)
    and seeds; each cell checks that both pick the same tokens."""
    rows = []
    for vocab_size in vocab_sizes:
        for batch in batches:
            logits = (np.random.default_rng(vocab_size + batch).standard_normal((batch, vocab_size)) * 2.5
                      ).astype(np.float32)
            for mode, kwargs in SAMPLING_MODES.items():
                params = SamplingParams(**kwargs)
                seqs = [SeqStep(i, (1,), 8, [0], True, params, 1000 + i, [1, 2, 3], [4] * (i % 7)) for i in range(batch)]
                fast_us, fast = time_call_us(lambda: sample(logits, seqs), 5, 0.5)
                ref_us, ref = time_call_us(lambda: sample_reference(logits, seqs), 2, 0.5)
                assert fast.token_ids == ref.token_ids, f"{mode} V={vocab_size} B={batch}: fast path differs"
                rows.append({"vocab_size": vocab_size, "batch": batch, "mode": mode, "fast_us": fast_us,
                             "reference_us": ref_us, "fast_us_per_token": fast_us / batch})
                print(f"{vocab_size:>7} {batch:>6} {mode:>12} {fast_us:>12.0f} {fast_us / batch:>10.1f} "
                      f"{ref_us:>15.0f} {ref_us / fast_us:>8.1f}x", flush=True)
    return rows


def run_sampling(args) -> int:
    batches = args.batches or [1, 64]
    print("tokenwire bench scheduler --sampling: core/sampling.sample() per step (penalties and logprobs off)")
    print("reference, same run: sample_reference() (whole-batch float64, argsort per filtered row); "
          "both pick the same tokens (checked)\n")
    print(f"{'vocab':>7} {'batch':>6} {'mode':>12} {'fast us':>12} {'us/token':>10} {'reference us':>15} {'speedup':>9}")
    rows = sampling_rows(args.vocab_sizes, batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sampling": rows}, f, indent=2)
    return 0


def forward_batch_steps(batches: list) -> dict:
    """name -> SeqSteps: decode steps (contexts 200..1000, tables of 16-token blocks), a
    512-token prefill, and 60 decodes beside a 1500-token prefill chunk."""
    rng, params, first_free = np.random.default_rng(0), SamplingParams(), [0]

    def table(num_tokens: int) -> list:
        n = -(-num_tokens // 16)
        first_free[0] += n
        return list(range(first_free[0] - n, first_free[0]))

    def decodes(batch: int) -> list:
        ctx = rng.integers(200, 1001, batch).tolist()
        return [DecodeStep(i, (int(rng.integers(0, 32000)),), c, table(c + 1), True, params, 0, [1], [])
                for i, c in enumerate(ctx)]

    def prefill(n: int) -> SeqStep:
        return SeqStep(999, rng.integers(0, 32000, n).tolist(), 0, table(n), True, params, 0, [], [])
    steps = {f"decode, batch {b}": decodes(b) for b in batches}
    steps["prefill 512"] = [prefill(512)]
    steps["60 decodes + prefill 1500"] = decodes(60) + [prefill(1500)]
    return steps


def run_forward_batch(args) -> int:
    print("tokenwire bench scheduler --forward-batch: build_forward_batch per step, block size 16")
    print("reference, same run: build_forward_batch_reference (sequence by sequence); 'fresh' builds every "
          "array anew, 'kept tables' reuses the executor's BlockTables (steady state: no table changed)\n")
    print(f"{'step':>28} {'reference us':>13} {'fresh us':>10} {'kept tables us':>15}")
    rows = []
    for name, seqs in forward_batch_steps(args.batches or [1, 16, 64]).items():
        tables = BlockTables()
        ref_us = time_call_us(lambda: build_forward_batch_reference(seqs, 16), 50, 0.3)[0]
        fresh_us = time_call_us(lambda: build_forward_batch(seqs, 16), 50, 0.3)[0]
        kept_us = time_call_us(lambda: build_forward_batch(seqs, 16, tables), 50, 0.3)[0]
        rows.append({"step": name, "reference_us": ref_us, "fresh_us": fresh_us, "kept_tables_us": kept_us})
        print(f"{name:>28} {ref_us:>13.1f} {fresh_us:>10.1f} {kept_us:>15.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"forward_batch": rows}, f, indent=2)
    return 0


def run(args) -> int:
    if args.sampling:
        return run_sampling(args)
    if args.forward_batch:
        return run_forward_batch(args)
    batches = args.batches or [1, 16, 64, 256]
    print("tokenwire bench scheduler: EngineCore.step() minus executor time, zero-cost mock engine")
    print("included: inbox/cancels, scheduling + SeqSteps, token append, stop/length checks, "
          "detokenization (byte table), RequestOutputs; excluded: the executor")
    print(f"gc enabled: {gc.isenabled()}; {args.rounds} rounds x {args.steps} steps per batch size\n")
    print(f"{'batch':>6} {'median us/step':>15} {'p99 us/step':>12} {'best round':>11} "
          f"{'us/request':>11} {'record floor us':>16}")
    results = []
    for batch in batches:
        rounds = [time_steps(batch, args.steps) for _ in range(args.rounds)]
        pooled = [x for r in rounds for x in r]
        row = {"batch": batch, "median_us": statistics.median(pooled), "p99_us": percentile(pooled, 0.99),
               "best_round_median_us": min(statistics.median(r) for r in rounds),
               "record_floor_us": record_floor_us(batch)}
        row["us_per_request"] = row["median_us"] / batch
        results.append(row)
        print(f"{batch:>6} {row['median_us']:>15.1f} {row['p99_us']:>12.1f} {row['best_round_median_us']:>11.1f} "
              f"{row['us_per_request']:>11.2f} {row['record_floor_us']:>16.1f}")
    detok = detok_us_per_token()
    print(f"\ndetokenization alone, us/token: byte table {detok['byte_table']:.3f}, "
          f"generic prefix/read-offset decoder {detok['generic']:.2f}")
    at64 = next((r for r in results if r["batch"] == 64), None)
    if at64 is not None:
        verdict = "meets" if at64["median_us"] <= TARGET_US_AT_64 else "misses"
        print(f"target: <= {TARGET_US_AT_64:.0f} us/step at batch 64 -> measured {at64['median_us']:.1f} us "
              f"(best round {at64['best_round_median_us']:.1f}): {verdict} the target; "
              f"the bare record floor at 64 is {at64['record_floor_us']:.1f} us on this machine")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": results, "detok_us_per_token": detok, "target_us_at_64": TARGET_US_AT_64}, f, indent=2)
    return 0
