"""Percentiles and the summary of a set of stream records, shared by every bench command."""

import math
from typing import Optional, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (NaN when empty)."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(values: Sequence[float], prefix: str) -> dict:
    """{prefix_p50, prefix_p90, prefix_p99, prefix_mean} of unsorted values."""
    ordered = sorted(values)
    mean = sum(ordered) / len(ordered) if ordered else math.nan
    return {f"{prefix}_p50": percentile(ordered, 50), f"{prefix}_p90": percentile(ordered, 90),
            f"{prefix}_p99": percentile(ordered, 99), f"{prefix}_mean": mean}


def fmt_us(value: float) -> str:
    """A microsecond figure for a table: 3 significant digits, 'ms' past 10 ms, '-' for NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value >= 1_000_000:
        return f"{value / 1e6:.2f} s"
    if value >= 10_000:
        return f"{value / 1000:.1f} ms"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def fmt_steal(fraction: Optional[float]) -> str:
    """A level's host steal (bench/proc.steal_fraction), "-" where it was not read."""
    return "-" if fraction is None else f"{fraction:.1%}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> str:
    """A plain fixed-width text table; columns in `left` are left-aligned, the rest right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
