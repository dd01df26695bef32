"""``benchmarks/compare_arms.py``: the arm-against-arm figures that docs/results/README.md quotes, on
hand-made trials (the study loading it shares with the export is tested there)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script

from mhar_ablate.errors import UsageError
from mhar_ablate.reporting.table import TrialData


@pytest.fixture(scope="module")
def ca():
    return load_script("compare_arms")


def trial(arm, seed, losses, final):
    # (step, seconds, tokens, val_loss) at steps 0, 10, 20 and seconds 0, 1, 2
    curve = [(10.0 * i, float(i), 100.0 * i, v) for i, v in enumerate(losses)]
    return TrialData(arm, seed, "completed", curve, 1.0, 1.0, 1, 0.0, "cpu", "reference", final_loss=final)


def test_pairs_by_seed_at_equal_steps_time_and_final(ca):
    trials = {"a": [trial("a", 0, [5, 3, 2], 1.9), trial("a", 1, [5, 3, 2.2], 2.0), trial("a", 2, [5, 3, 1], None)],
              "b": [trial("b", 0, [5, 4, 2.5], 2.4), trial("b", 1, [5, 4, 2.6], 2.6)]}
    lines = ca.compare(trials, "a", "b", at_step=15, at_seconds=2)
    assert lines[0] == "a - b, seeds 0, 1:"  # seed 2 has no partner
    assert "per seed -0.7500, -0.7000" in lines[1]  # at step 15, halfway between evaluations
    assert "per seed -0.5000, -0.4000" in lines[2] and "[-1.0853, +0.1853]" in lines[2]
    assert "final-set: per seed -0.5000, -0.6000" in lines[3]
    with pytest.raises(UsageError, match="no arm 'c'"):
        ca.compare(trials, "c", "b", 15, 2)


def test_one_seed_says_that_its_spread_is_unknown(ca):
    trials = {"a": [trial("a", 0, [5, 3, 2], 1.9), trial("a", 1, [5, 3, 2.2], None)],
              "b": [trial("b", 0, [5, 4, 2.5], 2.4)]}
    lines = ca.compare(trials, "a", "b", at_step=20, at_seconds=2)
    assert lines[0] == "a - b, seeds 0:"
    assert all("(one seed)" in line and "n* unknown (one seed: no spread yet)" in line for line in lines[1:])
    assert not any(">1000" in line for line in lines)
