"""`tokenwire bench prefix`: what the prefix cache saves, measured with it on and off in one run.

    tokenwire bench prefix [--model PATH] [--backend cpu] [--system-tokens 1000] [--turns 32]
                           [--replay-turns 6] [--json FILE]

Two engines over the same model are built the way `tokenwire serve` builds them
(tokenwire/runtime.py), one with the prefix cache and one with `--no-prefix-cache`; prompts
go through the model's chat template and prompt encoder as a chat request's would.

1. Shared system prompt: a system message of about --system-tokens tokens (text from
   engine_build/data, cut to that many tokens) followed by --turns distinct user turns, one
   request at a time (concurrency 1, max_tokens 1), each turn sent to the cached engine and
   then to the uncached one, so both see the same minutes of a shared machine. TTFT here is
   engine-side: `add_request` to the step that produced the first token returning (no
   network; the engine is driven by `step()` on this thread). Reported: p50 per engine and
   the ratio, against the target of >= 5x. The cached engine's first turn computes the system
   prompt (a miss) and is in its p50.
2. Multi-turn replay: one conversation of --replay-turns turns where each request resends
   the whole history (system, then user / assistant pairs; the assistant messages are the
   engine's own greedy replies; its system prompt differs from part 1's from the first token,
   so nothing of part 1 is reused). Reported: prompt tokens sent, and prefill tokens computed
   with and without the cache (prompt tokens minus `cached_tokens`); both engines' replies
   must be identical (greedy), which the run checks.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ..core.options import EngineOptions
from ..core.outputs import Timeline
from ..core.sampling_params import SamplingParams
from ..net.api.model_info import model_info
from ..runtime import build_engine
from .args import positive_int

TARGET_TTFT_RATIO = 5.0
TEXT = Path(__file__).resolve().parent.parent / "engine_build" / "data"
USER_TURNS = ("What is the main idea of the passage?", "Summarize the second paragraph.",
              "Which word appears most often?", "Write a title for it.", "Who is the narrator?",
              "List three facts from the text.", "Is the tone happy or sad?", "Translate the first line.",
              "What happens at the end?", "Give one question a teacher might ask.")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="engine or model (default: the embedded default model)")
    parser.add_argument("--chat-template", default=None, metavar="FILE", help="a chat template overriding the model's")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "reference", "cuda"),
                        help="executor (default: %(default)s)")
    parser.add_argument("--system-tokens", type=positive_int, default=1000,
                        help="length of the shared system prompt (default: %(default)s)")
    parser.add_argument("--turns", type=positive_int, default=32, help="distinct user turns (default: %(default)s)")
    parser.add_argument("--replay-turns", type=positive_int, default=6,
                        help="turns of the multi-turn replay (default: %(default)s)")
    parser.add_argument("--replay-max-tokens", type=positive_int, default=24,
                        help="reply length in the replay (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


class Chat:
    """One loaded engine, driven on this thread: chat messages in, (ids, text, TTFT, cached) out."""

    def __init__(self, engine, info):
        self.engine, self.info, self.next_id = engine, info, 0

    def prompt_ids(self, messages: list) -> list:
        return self.info.encode(self.info.chat_template.render(messages, add_generation_prompt=True))

    def ask(self, messages: list, max_tokens: int) -> dict:
        prompt, rid = self.prompt_ids(messages), self.next_id
        self.next_id += 1
        t0 = time.perf_counter_ns()
        self.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), Timeline())
        ttft_ns, ids, text, cached = None, [], "", 0
        while self.engine.has_unfinished():
            for out in self.engine.step().rows:
                if ttft_ns is None and out.token_ids:
                    ttft_ns = time.perf_counter_ns() - t0
                ids += out.token_ids
                text += out.text
                if out.finish_reason is not None:
                    cached = out.num_cached_tokens
        return {"prompt_tokens": len(prompt), "cached_tokens": cached, "ttft_ms": ttft_ns / 1e6, "text": text}


def system_text(tokenizer, num_tokens: int) -> str:
    """About `num_tokens` tokens of the shipped English text (repeated if it is short)."""
    text = "\n".join((TEXT / name).read_text(encoding="utf-8") for name in ("eval.txt", "calibration.txt"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    while len(ids) < num_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:num_tokens])


def load(args, on: bool) -> Chat:
    engine, card = build_engine(EngineOptions(model=args.model, backend=args.backend, chat_template=args.chat_template,
                                              enable_prefix_caching=on))
    info = model_info(card)
    if info.chat_template is None:
        raise ValueError("the model has no chat template; this benchmark sends chat requests")
    return Chat(engine, info)


def shared_system_prompt(cached: Chat, plain: Chat, system: str, turns: int) -> dict:
    rows = {"cache_on": [], "cache_off": []}
    for i in range(turns):
        user = f"{USER_TURNS[i % len(USER_TURNS)]} (question {i + 1})"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        rows["cache_on"].append(cached.ask(messages, 1))
        rows["cache_off"].append(plain.ask(messages, 1))
    p50 = {k: statistics.median(r["ttft_ms"] for r in v) for k, v in rows.items()}
    return {"turns": turns, "prompt_tokens_p50": statistics.median(r["prompt_tokens"] for r in rows["cache_on"]),
            "ttft_p50_ms_cache_on": p50["cache_on"], "ttft_p50_ms_cache_off": p50["cache_off"],
            "ttft_ratio": p50["cache_off"] / p50["cache_on"],
            "cached_tokens_p50": statistics.median(r["cached_tokens"] for r in rows["cache_on"])}


def replay(cached: Chat, plain: Chat, system: str, turns: int, max_tokens: int) -> dict:
    # its own system prompt: nothing of part 1 is cached for it, so the savings are the replay's own
    history = [{"role": "system", "content": "You answer questions about this text.\n" + system}]
    sent = computed_on = computed_off = 0
    for i in range(turns):
        history.append({"role": "user", "content": USER_TURNS[i % len(USER_TURNS)]})
        on, off = cached.ask(history, max_tokens), plain.ask(history, max_tokens)
        if on["text"] != off["text"]:
            raise AssertionError(f"turn {i + 1}: greedy replies differ with and without the prefix cache")
        sent += on["prompt_tokens"]
        computed_on += on["prompt_tokens"] - on["cached_tokens"]
        computed_off += off["prompt_tokens"] - off["cached_tokens"]
        history.append({"role": "assistant", "content": on["text"]})
    return {"turns": turns, "prompt_tokens_sent": sent, "prefill_tokens_cache_on": computed_on,
            "prefill_tokens_cache_off": computed_off, "prefill_ratio": computed_off / max(computed_on, 1)}


def run(args) -> int:
    try:
        cached, plain = load(args, True), load(args, False)
    except (ValueError, OSError, ImportError) as exc:
        print(f"tokenwire bench prefix: {exc}", file=sys.stderr)
        return 2
    system = system_text(cached.info.tokenizer, args.system_tokens)
    warm = [{"role": "user", "content": "warm-up"}]
    cached.ask(warm, 1), plain.ask(warm, 1)
    shared = shared_system_prompt(cached, plain, system, args.turns)
    multi = replay(cached, plain, system, args.replay_turns, args.replay_max_tokens)
    print(f"shared system prompt ({args.backend}, {args.turns} turns of ~{shared['prompt_tokens_p50']:.0f} "
          f"prompt tokens, concurrency 1, engine-side TTFT):")
    print(f"  TTFT p50 cache on  {shared['ttft_p50_ms_cache_on']:9.2f} ms  "
          f"(cached tokens p50 {shared['cached_tokens_p50']:.0f})")
    print(f"  TTFT p50 cache off {shared['ttft_p50_ms_cache_off']:9.2f} ms")
    verdict = "met" if shared["ttft_ratio"] >= TARGET_TTFT_RATIO else "NOT met"
    print(f"  ratio off/on {shared['ttft_ratio']:.1f}x  (target >= {TARGET_TTFT_RATIO:g}x: {verdict})")
    print(f"multi-turn replay ({multi['turns']} turns, each resending the history): "
          f"{multi['prompt_tokens_sent']} prompt tokens sent; prefill computed: cache on "
          f"{multi['prefill_tokens_cache_on']}, cache off {multi['prefill_tokens_cache_off']} "
          f"({multi['prefill_ratio']:.1f}x fewer); greedy replies identical")
    if args.json:
        Path(args.json).write_text(json.dumps({"shared_system_prompt": shared, "replay": multi}, indent=2))
    for chat in (cached, plain):
        chat.engine.shutdown()
    return 0 if multi["prefill_tokens_cache_on"] < multi["prefill_tokens_cache_off"] else 1
