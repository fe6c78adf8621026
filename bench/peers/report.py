"""The peers report: a side-by-side table, ratios against the best peer, and the issue's targets.

Figures are picked at fixed operating points — TTFT p50, the inter-token gap and CPU per
token of a lone stream at concurrency 1, TTFT p99 (the server's own and the client's) and
server CPU per token at concurrency 64, the best tokens/s over all levels (the server is
pinned to one core, so that is its one-core maximum). When a run did not include a point,
the nearest level is used and its concurrency is printed with the figure.
"""

import math
import statistics
from typing import Optional

from ..stats import fmt_steal, fmt_us, table
from .runner import CEILING, H2_MINIMAL

TTFT_LOW_CONCURRENCY = 1
LONE_CONCURRENCY = 1
LOADED_CONCURRENCY = 64
# the targets for tokenwire
TARGET_TTFT_P50_US = 150.0
TARGET_TTFT_P99_US = 1000.0
TARGET_CPU_US_PER_TOKEN = 2.0     # issue 19 (3.5 before it)
TARGET_CPU_RATIO = 5.0
TARGET_TTFT_RATIO = 1.5
TARGET_CLIENT_SERVER_TTFT_RATIO = 1.5   # client-side TTFT p99 @64 against the server's own, with the C client
TARGET_GRPC_CPU_RATIO = 3.0     # tokenwire-grpc against grpc.aio, CPU per token at concurrency 64 (issue 15)


def pick(rows: list, server: str, concurrency: int) -> Optional[dict]:
    """The server's row at `concurrency`, or at the nearest level it ran."""
    mine = [r for r in rows if r["server"] == server and r["num_errors"] < r["num_requests"]]
    if not mine:
        return None
    return min(mine, key=lambda r: (abs(math.log(r["concurrency"] / concurrency)), r["concurrency"]))


def summarize_servers(rows: list, servers: list) -> list:
    """One summary dict per server at the report's operating points."""
    out = []
    for server in servers:
        low, loaded = pick(rows, server, TTFT_LOW_CONCURRENCY), pick(rows, server, LOADED_CONCURRENCY)
        mine = [r for r in rows if r["server"] == server and r["num_errors"] < r["num_requests"]]
        best = max(mine, key=lambda r: r["tokens_per_s"]) if mine else None
        lone = pick(rows, server, LONE_CONCURRENCY)
        out.append({"server": server,
                    "lone_concurrency": lone and lone["concurrency"], "lone_itl_p50_us": lone and lone["itl_us_p50"],
                    "lone_e2e_p50_us": lone and lone["e2e_us_p50"],
                    "lone_cpu_us_per_token": lone and lone["cpu_us_per_token"],
                    "server_ttft_p99_us": loaded and _finite(loaded.get("server_ttft_us_p99")),
                    "client": loaded and loaded.get("client", "python"),
                    "ttft_p50_us": low and low["ttft_us_p50"], "ttft_p50_concurrency": low and low["concurrency"],
                    "ttft_p99_us": loaded and loaded["ttft_us_p99"],
                    "ttft_p99_concurrency": loaded and loaded["concurrency"],
                    "cpu_us_per_token": loaded and loaded["cpu_us_per_token"],
                    "cpu_concurrency": loaded and loaded["concurrency"],
                    "max_tokens_per_s": best and best["tokens_per_s"],
                    "max_tokens_per_s_concurrency": best and best["concurrency"],
                    "server_cpu_util_at_max": best and best["server_cpu_util"]})
    return out


def median_rows(rounds: list) -> list:
    """Rows of several alternating rounds (`--repeat`) -> one row per (server, client, concurrency),
    each number the median over the rounds that measured it (the stage timings key by key)."""
    groups = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r["server"], r.get("client", "python"), r["concurrency"]), []).append(r)
    return [_median_row(group) for group in groups.values()]


def _median_row(group: list) -> dict:
    out = dict(group[0])
    for key, value in group[0].items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            values = [r[key] for r in group if isinstance(r.get(key), (int, float)) and not _nan(r[key])]
            if values:              # counts and levels stay integers: the lower median, a value some round had
                out[key] = statistics.median_low(values) if isinstance(value, int) else statistics.median(values)
        elif isinstance(value, dict) and key.startswith("server_timings"):
            out[key] = {k: statistics.median([r[key][k] for r in group if k in (r.get(key) or {})]) for k in value}
    out["num_rounds"] = len(group)
    return out


# (heading, summary key) of the figures the repetitions table shows, per server
ROUND_FIGURES = [("lone itl p50", "lone_itl_p50_us"), ("lone CPU µs/token", "lone_cpu_us_per_token"),
                 ("TTFT p50 (low)", "ttft_p50_us"), ("srv TTFT p99 (loaded)", "server_ttft_p99_us"),
                 ("cli TTFT p99 (loaded)", "ttft_p99_us"), ("CPU µs/token (loaded)", "cpu_us_per_token")]


def rounds_table(round_summaries: list, ours: str = "tokenwire") -> str:
    """Median (min-max) of each figure over the rounds, per server; and, per round, tokenwire's
    lone stream against the minimal h2 server's measured in the same round (paired ratios)."""
    servers = list(dict.fromkeys(s["server"] for summary in round_summaries for s in summary))
    body = []
    for server in servers:
        mine = [s for summary in round_summaries for s in summary if s["server"] == server]
        body.append([server, len(mine), *(_spread([s[key] for s in mine]) for _, key in ROUND_FIGURES)])
    out = table(["server", "rounds", *(h for h, _ in ROUND_FIGURES)], body)
    pairs = []                      # per round where both ran: (itl p50 ratio, CPU/token ratio), None unmeasured
    for summary in round_summaries:
        a = next((s for s in summary if s["server"] == ours), None)
        b = next((s for s in summary if s["server"] == H2_MINIMAL), None)
        if a and b:
            pairs.append((_quotient(a["lone_itl_p50_us"], b["lone_itl_p50_us"]),
                          _quotient(a["lone_cpu_us_per_token"], b["lone_cpu_us_per_token"])))
    if pairs:
        out += (f"\n{ours} / {H2_MINIMAL}, lone stream, per round: itl p50 {_paired([p[0] for p in pairs])}; "
                f"CPU/token {_paired([p[1] for p in pairs])}")
    return out + "\n(µs: median (min-max) over the rounds; the report above is on each figure's median)"


def _quotient(a, b) -> Optional[float]:
    """a / b, or None when either was not measured (None, NaN) or b is 0: a few tokens of CPU
    can read 0 µs (the kernel's schedstat runtime advances at a tick), which says nothing."""
    if a is None or b is None or _nan(a) or _nan(b) or b <= 0:
        return None
    return a / b


def _paired(ratios: list) -> str:
    """Per-round ratios, "-" for a round that could not measure one, and their median."""
    measured = [r for r in ratios if r is not None]
    median = f"{statistics.median(measured):.2f}" if measured else "-"
    return ", ".join("-" if r is None else f"{r:.2f}" for r in ratios) + f" (median {median})"


def _spread(values: list) -> str:
    values = [v for v in values if v is not None and not _nan(v)]
    if not values:
        return "-"
    return f"{fmt_us(statistics.median(values))} ({fmt_us(min(values))}-{fmt_us(max(values))})"


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def levels_table(rows: list) -> str:
    headers = ["server", "client", "conc", "reqs", "err", "ttft p50", "ttft p99", "itl p50", "itl p99", "e2e p50",
               "tokens/s", "srv µs/tok", "srv util", "cli µs/tok", "cli util", "steal"]
    body = [[r["server"], r.get("client", "python"), r["concurrency"], r["num_requests"], r["num_errors"],
             fmt_us(r["ttft_us_p50"]),
             fmt_us(r["ttft_us_p99"]), fmt_us(r["itl_us_p50"]), fmt_us(r["itl_us_p99"]), fmt_us(r["e2e_us_p50"]),
             f"{r['tokens_per_s']:,.0f}", fmt_us(r["cpu_us_per_token"]), _pct(r["server_cpu_util"]),
             fmt_us(r["client_cpu_us_per_token"]), _pct(r["client_cpu_util"]), fmt_steal(r.get("host_steal"))]
            for r in rows]
    return table(headers, body)


def server_stages_table(rows: list) -> str:
    """The medians of the stage timings a server reported in its own streams, next to the client's TTFT."""
    mine = [r for r in rows if r.get("server_timings_us_p50")]
    if not mine:
        return ""
    keys = list(mine[0]["server_timings_us_p50"])
    body = [[r["server"], r["concurrency"], *(fmt_us(r["server_timings_us_p50"].get(k)) for k in keys),
             fmt_us(r["ttft_us_p50"])] for r in mine]
    headers = ["server", "conc", *(k.removesuffix("_us") for k in keys), "client ttft"]
    return (table(headers, body) + "\n(medians in µs as the server timed them, from request headers "
            "complete (its ttft) to the end; client ttft: from the request's write to the first token's read)")


def ttft_table(rows: list) -> str:
    """TTFT percentiles as the server timed them (request headers complete -> first token bytes
    handed to the socket) beside the client's (request written -> first token read)."""
    mine = [r for r in rows if not math.isnan(r.get("server_ttft_us_p50", math.nan))]
    if not mine:
        return ""
    body = [[r["server"], r.get("client", "python"), r["concurrency"],
             *(fmt_us(r[f"server_ttft_us_p{q}"]) for q in (50, 90, 99)),
             *(fmt_us(r[f"ttft_us_p{q}"]) for q in (50, 90, 99)),
             _ratio(r["ttft_us_p99"], r["server_ttft_us_p99"])] for r in mine]
    headers = ["server", "client", "conc", "srv ttft p50", "srv p90", "srv p99", "cli ttft p50", "cli p90", "cli p99",
               "p99 cli/srv"]
    return (table(headers, body, left=(0, 1)) + "\n(µs; server: request headers complete -> first token bytes "
            "handed to the socket, from each stream's last chunk; client: request written -> first token read)")


def lone_stream_table(rows: list) -> str:
    """Each server's lone stream (concurrency 1): the inter-token gap, the whole stream, CPU per token."""
    lone = [r for r in rows if r["concurrency"] == LONE_CONCURRENCY and r["num_errors"] < r["num_requests"]]
    if not lone:
        return ""
    floor = next((r for r in lone if r["server"] == H2_MINIMAL), None)
    body = [[r["server"], r.get("client", "python"), fmt_us(r["itl_us_p50"]), fmt_us(r["e2e_us_p50"]),
             fmt_us(r["cpu_us_per_token"]),
             _ratio(r["itl_us_p50"], floor["itl_us_p50"]) if floor else "-",
             _ratio(r["cpu_us_per_token"], floor["cpu_us_per_token"]) if floor else "-"] for r in lone]
    return (table(["server", "client", "itl p50", "e2e p50", "srv CPU µs/token", f"itl / {H2_MINIMAL}",
                   f"CPU / {H2_MINIMAL}"], body, left=(0, 1)) + "\n(µs; < 1 means below the minimal h2 server)")


def side_by_side(summary: list, floor_p50_us: float) -> str:
    headers = ["server", "TTFT p50", "TTFT p99", "CPU µs/token", "max tokens/s (1 core)", "TTFT p50 - floor",
               "TTFT p50 / floor"]
    body = [[s["server"], _at(s["ttft_p50_us"], s["ttft_p50_concurrency"]),
             _at(s["ttft_p99_us"], s["ttft_p99_concurrency"]), _at(s["cpu_us_per_token"], s["cpu_concurrency"]),
             _tput(s), fmt_us(s["ttft_p50_us"] - floor_p50_us) if s["ttft_p50_us"] else "-",
             f"{s['ttft_p50_us'] / floor_p50_us:.1f}x" if s["ttft_p50_us"] else "-"] for s in summary]
    return table(headers, body) + "\n(µs; @N: at concurrency N)"


def ratios(summary: list, ours: str = "tokenwire") -> str:
    """Each peer's figure divided by tokenwire's (for tokens/s: tokenwire's over the peer's): >1 favours tokenwire."""
    mine = next((s for s in summary if s["server"] == ours), None)
    peers = _peers(summary)
    if mine is None or not peers:
        return ""
    headers = ["peer", "TTFT p50 ratio", "TTFT p99 ratio", "CPU/token ratio", "tokens/s ratio"]
    body = [[p["server"], _ratio(p["ttft_p50_us"], mine["ttft_p50_us"]), _ratio(p["ttft_p99_us"], mine["ttft_p99_us"]),
             _ratio(p["cpu_us_per_token"], mine["cpu_us_per_token"]),
             _ratio(mine["max_tokens_per_s"], p["max_tokens_per_s"])] for p in peers]
    return table(headers, body) + f"\n(peer / {ours}, tokens/s: {ours} / peer; > 1 means {ours} is better)"


def targets(summary: list, floor_p50_us: float, ours: str = "tokenwire") -> list:
    """(description, measured, met) for each of the issue's targets; empty without tokenwire."""
    mine = next((s for s in summary if s["server"] == ours), None)
    peers = _peers(summary)
    if mine is None:
        return grpc_target(summary)
    out = [(f"TTFT p50 @{mine['ttft_p50_concurrency']} <= {TARGET_TTFT_P50_US:.0f} µs "
            f"(ping-pong floor p50 {floor_p50_us:.0f} µs)", _num(mine["ttft_p50_us"]),
            _le(mine["ttft_p50_us"], TARGET_TTFT_P50_US)),
           *ttft_p99_targets(mine),
           (f"server CPU @{mine['cpu_concurrency']} <= {TARGET_CPU_US_PER_TOKEN} µs/token",
            _num(mine["cpu_us_per_token"]), _le(mine["cpu_us_per_token"], TARGET_CPU_US_PER_TOKEN))]
    floor = next((s for s in summary if s["server"] == H2_MINIMAL), None)
    if floor is not None:
        out.append(lone_stream_target(mine, floor))
    best_cpu = _best(peers, "cpu_us_per_token")
    if best_cpu:
        ratio = best_cpu["cpu_us_per_token"] / mine["cpu_us_per_token"] if mine["cpu_us_per_token"] else math.nan
        out.append((f"CPU/token >= {TARGET_CPU_RATIO:g}x better than the best peer ({best_cpu['server']})",
                    f"{ratio:.2f}x", ratio >= TARGET_CPU_RATIO))
    best_ttft = _best(peers, "ttft_p50_us")
    if best_ttft:
        ratio = best_ttft["ttft_p50_us"] / mine["ttft_p50_us"] if mine["ttft_p50_us"] else math.nan
        out.append((f"TTFT p50 >= {TARGET_TTFT_RATIO:g}x better than the best peer ({best_ttft['server']})",
                    f"{ratio:.2f}x", ratio >= TARGET_TTFT_RATIO))
    return out + grpc_target(summary)


def ttft_p99_targets(mine: dict) -> list:
    """TTFT p99 under load judged on the server's own timing, and the client's distance from it."""
    server, client, at = mine["server_ttft_p99_us"], mine["ttft_p99_us"], mine["ttft_p99_concurrency"]
    ratio = client / server if server and client is not None else None
    measured = f"{_num(server)} (client-side {_num(client)}, {ratio:.2f}x)" if ratio else _num(server)
    return [(f"TTFT p99 @{at} server-side <= {TARGET_TTFT_P99_US:.0f} µs", measured, _le(server, TARGET_TTFT_P99_US)),
            (f"TTFT p99 @{at} client-side within {TARGET_CLIENT_SERVER_TTFT_RATIO:g}x of the server-side "
             f"(with the C client; this run: {mine['client']})", f"{ratio:.2f}x" if ratio else "-",
             ratio is not None and ratio <= TARGET_CLIENT_SERVER_TTFT_RATIO)]


def lone_stream_target(mine: dict, floor: dict) -> tuple:
    """A lone stream's inter-token gap and CPU per token against the minimal h2 server's."""
    keys = ("lone_itl_p50_us", "lone_cpu_us_per_token")
    measured = (f"itl p50 {_num(mine[keys[0]])} vs {_num(floor[keys[0]])}; "
                f"CPU {_num(mine[keys[1]])} vs {_num(floor[keys[1]])} µs/token")
    met = all(mine[k] is not None and floor[k] is not None and mine[k] <= floor[k] for k in keys)
    return (f"lone stream (c={mine['lone_concurrency']}): itl p50 and CPU/token <= the minimal h2 server's",
            measured, met)


def grpc_target(summary: list) -> list:
    """tokenwire's gRPC route against grpc.aio on CPU per token, when both ran."""
    ours = next((s for s in summary if s["server"] == "tokenwire-grpc"), None)
    peer = next((s for s in summary if s["server"] == "grpc"), None)
    if ours is None or peer is None or not ours["cpu_us_per_token"] or peer["cpu_us_per_token"] is None:
        return []
    ratio = peer["cpu_us_per_token"] / ours["cpu_us_per_token"]
    return [(f"tokenwire-grpc CPU/token @{ours['cpu_concurrency']} >= {TARGET_GRPC_CPU_RATIO:g}x lower than "
             f"grpc.aio's", f"{ratio:.2f}x", ratio >= TARGET_GRPC_CPU_RATIO)]


def targets_table(rows: list) -> str:
    return table(["target", "measured", "met"], [[d, m, "yes" if ok else "NO"] for d, m, ok in rows])


def _peers(summary: list) -> list:
    return [s for s in summary if not s["server"].startswith("tokenwire") and s["server"] != CEILING]


def _best(summaries: list, key: str) -> Optional[dict]:
    have = [s for s in summaries if s[key] is not None]
    return min(have, key=lambda s: s[key]) if have else None


def _at(value, concurrency) -> str:
    return f"{fmt_us(value)} @{concurrency}" if value is not None else "-"


def _tput(s: dict) -> str:
    if s["max_tokens_per_s"] is None:
        return "-"
    util = f", srv {_pct(s['server_cpu_util_at_max'])}" if s["server_cpu_util_at_max"] is not None else ""
    return f"{s['max_tokens_per_s']:,.0f} @{s['max_tokens_per_s_concurrency']}{util}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _num(value) -> str:
    return fmt_us(value) if value is not None else "-"


def _finite(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _le(value, limit) -> bool:
    return value is not None and value <= limit


def _pct(value) -> str:
    return f"{value:.0%}" if value is not None else "-"


# ------------------------------------------------------------------ API families (issue 29)

FAMILY_REFERENCE = "tokenwire-chat"
FAMILIES = ("tokenwire-responses", "tokenwire-messages")
TARGET_FAMILY_CPU_RATIO = 1.10      # a family's stream costs at most 10% more CPU per token than chat's


def family_ratios(rounds: list) -> list:
    """For each API family's stream and concurrency level: server CPU per token against
    /v1/chat/completions' in the same round. -> [(family, concurrency, chat µs/token median,
    family µs/token median, [per-round ratio or None])]"""
    out = []
    levels = sorted({r["concurrency"] for rows in rounds for r in rows if r["server"] == FAMILY_REFERENCE})
    for family in FAMILIES:
        for concurrency in levels:
            pairs = [(pick_exact(rows, FAMILY_REFERENCE, concurrency), pick_exact(rows, family, concurrency))
                     for rows in rounds]
            pairs = [(c, f) for c, f in pairs if c is not None and f is not None]
            if not pairs:
                continue
            chat = [c["cpu_us_per_token"] for c, _ in pairs]
            mine = [f["cpu_us_per_token"] for _, f in pairs]
            out.append((family, concurrency, _median(chat), _median(mine),
                        [_quotient(m, c) for c, m in zip(chat, mine)]))
    return out


def family_table(ratios: list) -> str:
    if not ratios:
        return ""
    body = []
    for family, concurrency, chat, mine, per_round in ratios:
        measured = [r for r in per_round if r is not None]
        median = statistics.median(measured) if measured else None
        body.append([family, concurrency, _num(chat), _num(mine), _paired(per_round),
                     "yes" if median is not None and median <= TARGET_FAMILY_CPU_RATIO else "no"])
    return (table(["stream", "conc", f"{FAMILY_REFERENCE} µs/token", "its µs/token", "ratio per round (median)",
                   f"<= {TARGET_FAMILY_CPU_RATIO:.2f}"], body, left=(0,))
            + f"\n(server CPU per token, medians over rounds; ratio: the family's / {FAMILY_REFERENCE}'s in the "
              "same round)")


def pick_exact(rows: list, server: str, concurrency: int) -> Optional[dict]:
    return next((r for r in rows if r["server"] == server and r["concurrency"] == concurrency
                 and r["num_errors"] < r["num_requests"]), None)


def _median(values: list):
    values = [v for v in values if v is not None and not _nan(v)]
    return statistics.median(values) if values else None
