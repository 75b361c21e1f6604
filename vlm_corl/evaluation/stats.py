"""Small, exact statistics for evaluations and experiments (no scipy in the environment): the mean with a 95% Student-t
interval over seeds, and Spearman's rank correlation."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Two-sided 95% Student-t critical values t_{0.975, df} for df = 1..30 (standard tables).
# fmt: off
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# fmt: on


def t975(df: int) -> float:
    """t_{0.975} with `df` degrees of freedom: the table up to 30, then the Cornish-Fisher expansion
    z + (z³ + z) / (4 df) + (5z⁵ + 16z³ + 3z) / (96 df²) (within 0.001 of the exact value from df 31 on)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1 (got {df})")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values: Sequence[float]) -> dict:
    """{"mean", "ci" (half-width of the 95% t-interval; 0.0 for one value), "std", "n"} of `values`."""
    if not values:
        raise ValueError("mean_ci of no values")
    n = len(values)
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    return {"mean": mean, "ci": t975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0, "std": std, "n": n}


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of `values`, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson's correlation; None when either side is constant or there are fewer than 2 pairs."""
    if len(x) != len(y):
        raise ValueError(f"pearson of sequences of different lengths: {len(x)} and {len(y)}")
    if len(x) < 2:
        return None
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on average ranks, so ties are handled); None when undefined."""
    return pearson(ranks(x), ranks(y))
