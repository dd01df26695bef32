"""The statistics behind the tables: Student's t quantiles, mean and spread over seeds, paired differences
with their 95 % t-interval, and how many seeds a difference would need to be decided.

Two answers to "how many seeds?" for paired differences with mean m and standard deviation s over seeds:
``seeds_to_exclude_zero`` is the fewest n at which a 95 % t-interval with exactly this m and s would exclude
zero (what the observed figures would show with more seeds, if they held); ``seeds_for_power`` is the fewest
n at which a two-sided paired t-test at the 5 % level detects a true difference of m with probability 0.8,
given the spread s (the planning figure: with n* seeds, four studies in five would decide it). The second
is larger, since an observed mean is as likely to come out below the true one as above.
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


def _moments(diffs: list[float]) -> tuple[float, float] | None:
    """(|mean|, standard deviation) of differences that more seeds could decide: None for one seed or a
    mean of zero."""
    if len(diffs) < 2 or statistics.fmean(diffs) == 0:
        return None
    return abs(statistics.fmean(diffs)), statistics.stdev(diffs)


def seeds_to_exclude_zero(diffs: list[float], most: int = 1000) -> int | None:
    """The fewest seeds n for which t95(n - 1) * sd / sqrt(n) < |mean| (None: one seed, no effect, or more
    than ``most``)."""
    if (ms := _moments(diffs)) is None:
        return None
    m, sd = ms
    if sd == 0:
        return 2
    return next((n for n in range(2, most + 1) if t95(n - 1) * sd / math.sqrt(n) < m), None)


def power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """The probability that a two-sided paired t-test at level ``alpha`` over ``n`` seeds rejects zero when
    the true mean difference is ``effect`` and its standard deviation over seeds ``sd`` (noncentral t)."""
    from scipy.stats import nct, norm, t

    df = n - 1
    crit = float(t.ppf(1 - alpha / 2, df))
    nc = abs(effect) / sd * math.sqrt(n)
    p = float(nct.sf(crit, df, nc) + nct.cdf(-crit, df, nc))
    if not math.isfinite(p):  # scipy's noncentral t gives nan far in its tail: the normal limit is exact there
        p = float(norm.sf(crit - nc) + norm.cdf(-crit - nc))
    return p


def seeds_for_power(diffs: list[float], target: float = 0.8, alpha: float = 0.05, most: int = 1000) -> int | None:
    """The fewest seeds at which the paired t-test has power ``target`` for the mean difference these seeds
    show, at their spread (None: one seed, no effect, or more than ``most``)."""
    if (ms := _moments(diffs)) is None:
        return None
    m, sd = ms
    if sd == 0:
        return 2
    if power(m, sd, most, alpha) < target:
        return None
    lo, hi = 2, most  # power grows with n: bisect for the first n that reaches the target
    while lo < hi:
        mid = (lo + hi) // 2
        if power(m, sd, mid, alpha) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
