"""`tokenwire bench spec`: speculative decoding against none, side by side in one run.

    tokenwire bench spec --model ../shared/models/stories260K/stories260K.bin [--rounds 5]
                         [--max-tokens 256] [--default-max-tokens 128] [--k 4] [--json FILE]

Engines are built the way `tokenwire serve` builds them (tokenwire/runtime.py) and driven by
`EngineCore.step()` on this thread: no network, concurrency 1 (one request at a time), greedy,
each of 8 story prompts to --max-tokens tokens (EOS ignored, so every arm generates the same
count). Each round runs every prompt once on every arm of a part, the arms alternating
request by request (their order flipping each time);
reported per arm: tokens/s (the round's tokens over its wall time, median over rounds), the
inter-token latency (mean, p50, p90 of the gaps between a request's tokens), tokens per engine
step, the acceptance rate (accepted / proposed), and the median of the per-round ratios
tokens/s against no speculation.

1. --model, n-gram (prompt lookup) against none; target: >= 1.5x. 1b: the same sampled at
   temperature 1 (seeded alike: both arms generate the same tokens), where proposals are made
   and often rejected: the cost of failing ones, held to the 3% of part 3.
2. --model as its own draft against none: a check of the machinery (every greedy proposal
   must be accepted), not a speed-up: the draft runs k forwards per step.
3. The embedded default model (random weights), n-gram against none, --default-max-tokens
   per request; target: <= 3% slower. Greedy, its output falls into loops, which n-gram
   proposals predict; sampled (3b, --default-temperature, seeded alike in both arms, so both
   generate the same tokens) proposals are made and mostly fail, and adaptive k must keep
   their cost within the target.
"""

import argparse
import json
import os
import statistics
import time

from ..core.options import EngineOptions
from ..core.outputs import Timeline
from ..core.sampling_params import SamplingParams
from ..runtime import build_engine
from .args import positive_int

PROMPTS = ("Once upon a time", "Lily", "The dog", "One day, a little boy named Tom went to the park with his mom.",
           "She was sad", "Tim and Sue", "The sun was", "A big red ball")
TARGET_NGRAM_SPEEDUP = 1.5
TARGET_DEFAULT_SLOWDOWN = 0.97


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="the model of parts 1-2 (stories260K: ../shared/models/stories260K/stories260K.bin); "
                             "without it only part 3 runs")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "reference"), help="executor (default: %(default)s)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="tokens per story (default: %(default)s)")
    parser.add_argument("--default-max-tokens", type=positive_int, default=128,
                        help="tokens per request on the default model (default: %(default)s)")
    parser.add_argument("--default-temperature", type=float, default=0.7,
                        help="part 3b's sampling temperature on the default model (default: %(default)s)")
    parser.add_argument("--k", type=positive_int, default=None,
                        help="--num-speculative-tokens (default: the server's default)")
    parser.add_argument("--skip-default", action="store_true", help="leave part 3 (the default model) out")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


class Arm:
    """One engine and what its rounds measured."""

    def __init__(self, name: str, options: EngineOptions):
        self.name = name
        self.engine = build_engine(options)
        self.rounds = []                # list[dict] per round
        self._round = None

    def start_round(self) -> None:
        self._round = {"seconds": 0.0, "tokens": 0, "steps": 0, "gaps": [], "proposed": 0, "accepted": 0}

    def run_prompt(self, i: int, max_tokens: int, temperature: float) -> None:
        """One request to its end (a sampled one seeded by its number, so both arms draw the
        same tokens: core/speculative.py rule 3)."""
        core, card = self.engine
        before, steps_before, timeline = core.stats(), core.num_steps, Timeline()
        params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        core.add_request(i, card.encode_prompt(PROMPTS[i]), params, timeline)
        while core.has_unfinished():
            core.step()
        r, after, stamps = self._round, core.stats(), timeline.step_done_ns
        r["seconds"] += time.perf_counter() - start
        r["tokens"] += len(stamps)
        r["steps"] += core.num_steps - steps_before
        r["gaps"] += [b - a for a, b in zip(stamps, stamps[1:])]
        r["proposed"] += after.num_spec_proposed - before.num_spec_proposed
        r["accepted"] += after.num_spec_accepted - before.num_spec_accepted

    def end_round(self) -> None:
        r, gaps = self._round, self._round["gaps"]
        self.rounds.append({"tokens_per_s": r["tokens"] / r["seconds"], "itl_mean_us": statistics.fmean(gaps) / 1000,
                            "itl_p50_us": percentile(gaps, 50) / 1000, "itl_p90_us": percentile(gaps, 90) / 1000,
                            "tokens_per_step": r["tokens"] / r["steps"], "proposed": r["proposed"],
                            "accepted": r["accepted"], "tokens": r["tokens"]})

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds)

    def acceptance(self) -> float:
        proposed = sum(r["proposed"] for r in self.rounds)
        return sum(r["accepted"] for r in self.rounds) / proposed if proposed else float("nan")


def percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


def compare(title: str, arms: list, rounds: int, max_tokens: int, temperature: float = 0.0) -> dict:
    """Warm every arm, then `rounds` rounds; within a round the arms alternate request by
    request (their order flipping each time), so a change in the machine's load hits both.
    -> the part's report"""
    for arm in arms:
        arm.rounds.clear()
        arm.start_round()
        arm.run_prompt(0, min(max_tokens, 16), temperature)
    for r in range(rounds):
        for arm in arms:
            arm.start_round()
        for i in range(len(PROMPTS)):
            for arm in (arms if (r + i) % 2 == 0 else arms[::-1]):
                arm.run_prompt(i, max_tokens, temperature)
        for arm in arms:
            arm.end_round()
    base = arms[0]
    print(f"\n{title}")
    print(f"  {'arm':<22}{'tok/s':>9}{'x off':>8}{'ITL mean':>10}{'p50':>9}{'p90':>9}{'tok/step':>10}{'accepted':>10}")
    report = {}
    for arm in arms:
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(arm.rounds, base.rounds)]
        row = {"tokens_per_s": arm.median("tokens_per_s"), "ratio": statistics.median(ratios),
               "ratios": ratios, "itl_mean_us": arm.median("itl_mean_us"), "itl_p50_us": arm.median("itl_p50_us"),
               "itl_p90_us": arm.median("itl_p90_us"), "tokens_per_step": arm.median("tokens_per_step"),
               "acceptance": arm.acceptance()}
        report[arm.name] = row
        accepted = "-" if row["acceptance"] != row["acceptance"] else f"{100 * row['acceptance']:.1f}%"
        print(f"  {arm.name:<22}{row['tokens_per_s']:>9.0f}{row['ratio']:>8.3f}{row['itl_mean_us']:>10.1f}"
              f"{row['itl_p50_us']:>9.1f}{row['itl_p90_us']:>9.1f}{row['tokens_per_step']:>10.2f}{accepted:>10}")
    return report


def options(args, model, **spec) -> EngineOptions:
    extra = {"num_speculative_tokens": args.k} if args.k else {}
    return EngineOptions(model=model, backend=args.backend, warm_up=False, **spec, **extra)


def run(args) -> int:
    load_start = os.getloadavg()[0]
    print(f"tokenwire bench spec: concurrency 1, greedy, {len(PROMPTS)} prompts, {args.rounds} alternating rounds, "
          f"backend {args.backend}; load average {load_start:.2f}")
    results, verdicts = {}, []
    if args.model:
        off = Arm("off", options(args, args.model))
        ngram = Arm("ngram", options(args, args.model, speculative="ngram"))
        results["ngram"] = compare(f"1. {args.model}: n-gram against none, {args.max_tokens} tokens per story",
                                   [off, ngram], args.rounds, args.max_tokens)
        verdicts.append(("n-gram speed-up", results["ngram"]["ngram"]["ratio"], f">= {TARGET_NGRAM_SPEEDUP}",
                         results["ngram"]["ngram"]["ratio"] >= TARGET_NGRAM_SPEEDUP))
        results["ngram_sampled"] = compare(f"1b. {args.model}, sampled (temperature 1, seeded: the same tokens in "
                                           f"both arms): n-gram against none", [off, ngram], args.rounds,
                                           args.max_tokens, 1.0)
        ratio = results["ngram_sampled"]["ngram"]["ratio"]
        verdicts.append(("n-gram sampled / off (low acceptance)", ratio, f">= {TARGET_DEFAULT_SLOWDOWN}",
                         ratio >= TARGET_DEFAULT_SLOWDOWN))
        draft = Arm("draft (itself)", options(args, args.model, speculative="draft", speculative_model=args.model))
        results["draft"] = compare(f"2. {args.model} as its own draft (a check: 100% accepted)", [off, draft],
                                   args.rounds, args.max_tokens)
        accepted = results["draft"]["draft (itself)"]["acceptance"]
        verdicts.append(("self-draft acceptance", accepted, "= 1", accepted == 1.0))
    if not args.skip_default:
        off = Arm("off", options(args, None))
        ngram = Arm("ngram", options(args, None, speculative="ngram"))
        results["default"] = compare(f"3. the default model (random weights): n-gram against none, "
                                     f"{args.default_max_tokens} tokens per request",
                                     [off, ngram], args.rounds, args.default_max_tokens)
        ratio = results["default"]["ngram"]["ratio"]
        verdicts.append(("default model greedy, n-gram / off", ratio, f">= {TARGET_DEFAULT_SLOWDOWN}",
                         ratio >= TARGET_DEFAULT_SLOWDOWN))
        results["default_sampled"] = compare(f"3b. the default model, sampled (temperature {args.default_temperature}, "
                                             f"seeded: the same tokens in both arms), {args.default_max_tokens} "
                                             f"tokens per request", [off, ngram], args.rounds, args.default_max_tokens,
                                             args.default_temperature)
        ratio = results["default_sampled"]["ngram"]["ratio"]
        verdicts.append(("default model sampled, n-gram / off", ratio, f">= {TARGET_DEFAULT_SLOWDOWN}",
                         ratio >= TARGET_DEFAULT_SLOWDOWN))
    print(f"\nload average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    for name, value, target, ok in verdicts:
        print(f"  {name}: {value:.3f} (target {target}): {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_average": [load_start, os.getloadavg()[0]]}, f, indent=2)
    return 0
