"""The statistics behind the tables: Student's t quantiles, mean and spread over seeds, and paired
differences with their 95 % t-interval.
"""

from __future__ import annotations

import math
import statistics


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))

def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def mean_interval(diffs: list[float]) -> tuple[float, float, int]:
    """(mean, 95 % t-interval half-width, n) of paired differences; the half-width is nan for one."""
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return m, math.nan, 1
    return m, t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)

