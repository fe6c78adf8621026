"""PNG plots of load results: latency and throughput against concurrency, one line per server,
and each level's inter-token histogram (where the rows carry one: `bench load`)."""

import argparse
import math
import os
from typing import Sequence

# what matplotlib's Agg canvas writes, by the file's suffix
FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff")


def plot_path(text: str) -> str:
    """argparse type of --plot: a path whose suffix names a format matplotlib writes and whose
    folder exists, refused before a benchmark runs rather than after it."""
    suffix = os.path.splitext(text)[1].lstrip(".").lower()
    if suffix not in FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: the file's suffix names its format, one of "
                                         f"{', '.join('.' + f for f in FORMATS)}")
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: no folder {folder!r}")
    return text


def plot_levels(rows: Sequence[dict], path: str, title: str) -> None:
    """Three panels (TTFT, inter-token latency, tokens/s) against the level's x value, and a
    fourth with each level's inter-token histogram when the rows have one ("itl_us_hist").

    Rows are grouped by their "server" key (one line each); x is the concurrency in a
    closed loop and the offered rate in an open one.
    """
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    with_hist = any(r.get("itl_us_hist") for r in rows)
    fig, axes = plt.subplots(1, 4 if with_hist else 3, figsize=(20 if with_hist else 15, 4.5))
    ttft, itl, tput = axes[:3]
    if with_hist:
        _histograms(axes[3], rows, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (server, group) in enumerate(_by_server(rows).items()):
        xs = [_x(r) for r in group]
        color = colors[i % len(colors)]
        for ax, key in ((ttft, "ttft_us"), (itl, "itl_us")):
            ax.plot(xs, [r[f"{key}_p50"] for r in group], "o-", color=color, label=f"{server} p50")
            ax.plot(xs, [r[f"{key}_p99"] for r in group], "x--", color=color, label=f"{server} p99")
        tput.plot(xs, [r["tokens_per_s"] for r in group], "o-", color=color, label=server)
    xlabel = "offered rate (requests/s)" if rows and rows[0].get("mode") == "open" else "concurrent streams"
    for ax, ylabel, name in ((ttft, "µs", "time to first token"), (itl, "µs", "inter-token latency"),
                             (tput, "tokens/s", "throughput")):
        ax.set_xscale("log", base=2 if xlabel.startswith("concurrent") else 10)
        if ylabel == "µs":
            ax.set_yscale("symlog", linthresh=10)  # ITL is 0 where tokens arrive in one read
            ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _histograms(ax, rows, colors) -> None:
    """Each level's inter-token times as a step line over log-spaced bins, as a share of its
    intervals, so a tail (prefill steps among decodes, host pauses) shows as a second hump."""
    for i, row in enumerate(r for r in rows if r.get("itl_us_hist")):
        edges, counts = zip(*row["itl_us_hist"])
        total = sum(counts)
        label = f"{row.get('server', '')} c={row['concurrency']}".strip()
        ax.step(edges, [c / total for c in counts], where="post", color=colors[i % len(colors)], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token time (µs)")
    ax.set_ylabel("share of intervals")
    ax.set_title("inter-token histogram")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _by_server(rows):
    groups = {}
    for row in rows:
        if row.get("num_errors") == row.get("num_requests"):
            continue  # nothing measured
        groups.setdefault(row.get("server", "server"), []).append(row)
    for group in groups.values():
        group.sort(key=_x)
    return groups


def _x(row) -> float:
    x = row["rate"] if row.get("mode") == "open" else row["concurrency"]
    return x if x and not math.isnan(x) else 1
