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


def test_along_prints_the_gap_at_every_point_and_how_it_moved(ca):
    trials = {"a": [trial("a", 0, [5, 3, 2], 1.9), trial("a", 1, [5, 3, 2.2], 2.0)],
              "b": [trial("b", 0, [5, 4, 2.5], 2.4), trial("b", 1, [5, 4, 2.6], 2.6)]}
    lines = ca.along(ca.gap_along(trials, "a", "b", 0), "a", "b", 0.5)
    assert lines[0] == "a - b along the steps, seeds 0, 1:"
    assert lines[2].split() == ["step", "10:", "-1.0000", "[-1.0000,", "-1.0000]"]
    assert "-0.4500 [-1.0853, +0.1853]" in lines[3]
    assert lines[4].startswith("  the gap moved by +0.5500 [-0.0853, +1.1853] from step 10 to step 20")
    assert ca.along(None, "a", "c", 0.2) == ["a - c: no seed finished in both"]
    seconds = ca.along(ca.gap_along(trials, "a", "b", 1), "a", "b", 0.5)
    assert seconds[0] == "a - b along the seconds, seeds 0, 1:" and "from 1.0 s to 2.0 s" in seconds[-1]


def test_falls_names_each_arm_and_its_runs_range(ca):
    trials = {"a": [trial("a", 0, [5, 3, 2], 1.9), trial("a", 1, [5, 3, 2.2], 2.0)]}
    (line,) = ca.falls(trials, 0.5)
    assert line == "a: fell 0.9000 (runs 0.8000 to 1.0000, n 2) over the last 50% of its steps, 90.0000 per 1,000 steps"


def test_bad_options_get_one_line_and_exit_2(ca, tmp_path, capsys):
    assert ca.main(["heads", "--budget", "steps", "--output", str(tmp_path), "--last", "0", "a@b"]) == 2
    assert "--last is a fraction between 0 and 1, got 0.0" in capsys.readouterr().err
    assert ca.main(["heads", "--budget", "steps", "--output", str(tmp_path), "--plot", "x.png", "a@b"]) == 2
    assert "--plot draws the gaps of --along" in capsys.readouterr().err
    assert ca.main(["heads", "--budget", "steps", "--output", str(tmp_path)]) == 2
    assert "at least one A@B pair or --falls" in capsys.readouterr().err
