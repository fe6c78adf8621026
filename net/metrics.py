"""Prometheus metrics in the text exposition format (version 0.0.4), `tokenwire_` names.

Observations happen on the event loop, per token for some histograms, so a histogram is
a list of integer bucket counts over nanosecond bounds and `observe_ns` is one bisect and
three additions (no locks: only the loop thread writes or reads them). Engine-side numbers
(running/waiting requests, KV blocks, preemptions, cancellations, generated tokens) are
read from `EngineCore.stats()` when /metrics is scraped.
"""

from bisect import bisect_left

from ..core.outputs import EngineStats

from .protocol.flood import CLOSE_CAUSES

# Sub-millisecond resolution at the low end: per-token latencies on this path are microseconds.
BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
             100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

OUTCOMES = ("stop", "length", "cancelled", "error", "rejected")


class Histogram:
    __slots__ = ("name", "help", "bounds_ns", "counts", "sum_ns", "count")

    def __init__(self, name: str, help_text: str, buckets_s=BUCKETS_S):
        self.name = name
        self.help = help_text
        self.bounds_ns = [round(b * 1e9) for b in buckets_s]
        self.counts = [0] * (len(buckets_s) + 1)    # last slot: above every bound (+Inf only)
        self.sum_ns = 0
        self.count = 0

    def observe_ns(self, value_ns: int) -> None:
        """Record one duration (hot path: per token for the inter-token histogram)."""
        self.counts[bisect_left(self.bounds_ns, value_ns)] += 1
        self.sum_ns += value_ns
        self.count += 1

    def observe_many_ns(self, value_ns: int, n: int) -> None:
        """Record the same duration `n` times (one step's tokens share their engine-to-wire time)."""
        self.counts[bisect_left(self.bounds_ns, value_ns)] += n
        self.sum_ns += value_ns * n
        self.count += n

    def observe_drained_ns(self, values_ns) -> None:
        """Record every duration in the deque `values_ns`, emptying it (another thread may
        append meanwhile: each value is taken once)."""
        counts, bounds = self.counts, self.bounds_ns
        total = num = 0
        while values_ns:
            value_ns = values_ns.popleft()
            counts[bisect_left(bounds, value_ns)] += 1
            total += value_ns
            num += 1
        self.sum_ns += total
        self.count += num

    def render(self, lines: list) -> None:
        lines.append(f"# HELP {self.name} {self.help}")
        lines.append(f"# TYPE {self.name} histogram")
        cumulative = 0
        for bound_ns, n in zip(self.bounds_ns, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound_ns / 1e9)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_fmt(self.sum_ns / 1e9)}")
        lines.append(f"{self.name}_count {self.count}")


def _fmt(x: float) -> str:
    return repr(float(x))


class Metrics:
    """Every metric the server exports; the app calls the observe methods."""

    def __init__(self):
        h = Histogram
        self.ttft = h("tokenwire_time_to_first_token_seconds",
                      "Request arrival (headers complete) to its first token written to the transport.")
        self.itl = h("tokenwire_inter_token_latency_seconds",
                     "Time between consecutive tokens of one stream reaching the transport.")
        self.queue = h("tokenwire_queue_time_seconds",
                       "Accepted by the scheduler to first included in an engine step.")
        self.step = h("tokenwire_engine_step_seconds",
                      "Duration of one engine step (scheduler and model), as the engine thread measured it.")
        self.engine_to_wire = h("tokenwire_engine_to_wire_seconds",
                                "Per token: engine step finished to the token's frame written to the transport.")
        self.e2e = h("tokenwire_e2e_request_latency_seconds",
                     "Request arrival to the end of its response.")
        self.tokenize = h("tokenwire_tokenize_seconds",
                          "Request arrival to prompt token ids ready (parse, validate, template, tokenize).")
        self.requests = {outcome: 0 for outcome in OUTCOMES}
        self.connections_closed = {cause: 0 for cause in CLOSE_CAUSES}
        self.streamed_tokens = 0
        self.num_given_back = 0             # memory.GiveBack runs

    def count_request(self, outcome: str) -> None:
        self.requests[outcome] += 1

    def count_given_back(self) -> None:
        self.num_given_back += 1

    def count_closed(self, cause: str) -> None:
        self.connections_closed[cause] += 1

    def render(self, stats: EngineStats | None, budget=None) -> bytes:
        """The exposition text; `budget`: the app's budgets.ServerBudget (its totals and limits)."""
        lines: list[str] = []
        for hist in (self.ttft, self.itl, self.queue, self.step, self.engine_to_wire, self.e2e, self.tokenize):
            hist.render(lines)
        _family(lines, "tokenwire_requests_total", "counter", "Finished requests by outcome.",
                [(f'{{outcome="{o}"}}', n) for o, n in self.requests.items()])
        _family(lines, "tokenwire_connections_closed_total", "counter",
                "Connections ended, by why: the peer, a deadline, a limit (GOAWAY ENHANCE_YOUR_CALM), an error.",
                [(f'{{reason="{c}"}}', n) for c, n in self.connections_closed.items()])
        _family(lines, "tokenwire_streamed_tokens_total", "counter",
                "Tokens written to clients.", [("", self.streamed_tokens)])
        _family(lines, "tokenwire_memory_given_back_total", "counter",
                "Times freed memory was given back to the OS after a burst (a full collection, malloc_trim).",
                [("", self.num_given_back)])
        if budget is not None:
            _budget_gauges(lines, budget)
        s = stats or EngineStats(0, 0, 0, 0, 0, 0, 0, 0, False)
        for name, kind, help_text, value in (
            ("tokenwire_requests_running", "gauge", "Requests in the running batch.", s.num_running),
            ("tokenwire_requests_waiting", "gauge", "Requests waiting for admission.", s.num_waiting),
            ("tokenwire_kv_blocks_used", "gauge", "KV-cache blocks in use.", s.num_kv_blocks_used),
            ("tokenwire_kv_blocks_total", "gauge", "KV-cache blocks allocated by the executor.", s.num_kv_blocks_total),
            ("tokenwire_engine_alive", "gauge", "1 while the engine thread runs.", int(s.engine_alive)),
            ("tokenwire_generated_tokens_total", "counter", "Tokens sampled by the engine.", s.num_tokens_generated),
            ("tokenwire_preemptions_total", "counter", "Requests preempted (recomputed later).", s.num_preemptions),
            ("tokenwire_cancellations_total", "counter", "Requests cancelled.", s.num_cancellations),
            ("tokenwire_engine_steps_total", "counter", "Engine steps run.", s.num_steps),
            ("tokenwire_prefix_cache_queries_total", "counter",
             "Prompt tokens looked up in the prefix cache at admission.", s.num_prefix_cache_queries),
            ("tokenwire_prefix_cache_hits_total", "counter",
             "Prompt tokens found in the prefix cache (not computed again).", s.num_prefix_cache_hits),
            ("tokenwire_prefix_cache_blocks", "gauge",
             "KV blocks holding cached prefix content (in use or evictable).", s.num_prefix_cached_blocks),
            ("tokenwire_response_cache_hits_total", "counter",
             "Requests answered from the exact-match response cache.", s.num_response_cache_hits),
            ("tokenwire_spec_proposed_tokens_total", "counter",
             "Tokens proposed by speculative decoding and verified by the model.", s.num_spec_proposed),
            ("tokenwire_spec_accepted_tokens_total", "counter",
             "Proposed tokens the model accepted (each one a step saved).", s.num_spec_accepted),
            ("tokenwire_spec_verify_steps_total", "counter",
             "Request-steps that verified proposed tokens.", s.num_spec_steps),
        ):
            _family(lines, name, kind, help_text, [("", value)])
        lines.append("")
        return "\n".join(lines).encode()


def _budget_gauges(lines: list, budget) -> None:
    """The server-wide totals beside their budgets (net/budgets.py)."""
    limits = budget.limits
    for name, help_text, value in (
        ("tokenwire_connections_open", "Open connections.", len(budget.connections)),
        ("tokenwire_connections_limit", "--max-connections: more are refused at accept.", limits.max_connections),
        ("tokenwire_unsent_bytes", "Response bytes waiting for peers that do not read them, all connections.",
         budget.num_unsent_bytes),
        ("tokenwire_unsent_bytes_limit", "--max-total-unsent-bytes: over it the largest holders are ended.",
         limits.max_total_unsent_bytes),
        ("tokenwire_body_bytes", "Request-body bytes buffered for requests not yet complete, all connections.",
         budget.num_body_bytes),
        ("tokenwire_body_bytes_limit", "--max-total-body-bytes: over it the largest holders are ended.",
         limits.max_total_body_bytes),
    ):
        _family(lines, name, "gauge", help_text, [("", value)])


def _family(lines: list, name: str, kind: str, help_text: str, samples) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{labels} {value}")
