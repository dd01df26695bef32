"""How many seeds a paired difference needs: the two answers of reporting/statistics.py."""

import math

import pytest

from mhar_ablate.reporting.statistics import mean_interval, power, seeds_for_power, seeds_to_exclude_zero


def test_power_matches_the_paired_t_test_tables():
    # Cohen's d = 0.5, two-sided paired t-test at 5 %: 34 pairs give power 0.80 (G*Power's table value),
    # 33 fall short.
    assert power(0.5, 1.0, 34) == pytest.approx(0.808, abs=0.002)
    assert power(0.5, 1.0, 33) < 0.8
    assert seeds_for_power([0.5 + x for x in _unit_spread(40)]) == 34


def _unit_spread(n):
    """n values with mean 0 and sample standard deviation 1."""
    xs = [i - (n - 1) / 2 for i in range(n)]
    sd = math.sqrt(sum(x * x for x in xs) / (n - 1))
    return [x / sd for x in xs]


def test_power_far_in_the_tail_is_one_not_nan():
    assert power(0.0533, 0.0252, 100) == 1.0


def test_seeds_to_exclude_zero_is_where_the_interval_clears_zero():
    diffs = [-0.05, -0.08, -0.03]
    n = seeds_to_exclude_zero(diffs)
    m, sd = abs(sum(diffs) / 3), 0.025166114784235836
    from mhar_ablate.reporting.statistics import t95

    assert t95(n - 1) * sd / math.sqrt(n) < m <= t95(n - 2) * sd / math.sqrt(n - 1)
    # planning for power 0.8 needs more seeds than the observed interval would
    assert seeds_for_power(diffs) > n


def test_no_answer_for_one_seed_or_no_effect():
    for f in (seeds_for_power, seeds_to_exclude_zero):
        assert f([0.1]) is None
        assert f([0.01, -0.01]) is None
    assert seeds_for_power([0.001, -0.0012, 0.0004], most=50) is None
    m, h, n = mean_interval([0.1])
    assert n == 1 and math.isnan(h)
