"""``reporting/gaps.py``: the paired gap along a run and the loss's fall at its end, on hand-made trials."""

from __future__ import annotations

import math

import pytest

from mhar_ablate.errors import UsageError
from mhar_ablate.reporting.gaps import gap_along, loss_falls, paired_runs
from mhar_ablate.reporting.plots import save_gap_plot, save_plots
from mhar_ablate.reporting.table import StudyTable, TrialData


def trial(arm, seed, losses, every=10.0, status="completed"):
    # (step, seconds, tokens, val_loss): an evaluation every ``every`` steps, one second per 10 steps
    curve = [(every * i, every * i / 10, 100.0 * i, v) for i, v in enumerate(losses)]
    return TrialData(arm, seed, status, curve, 1.0, 1.0, 1, 0.0, "cpu", "reference")


def test_the_gap_is_paired_by_seed_at_every_point_and_stops_where_a_pair_ends():
    trials = {"a": [trial("a", 0, [5, 3, 2, 1.5]), trial("a", 1, [5, 3.2, 2.2, 1.7]), trial("a", 2, [5, 1, 1, 1])],
              "b": [trial("b", 1, [5, 4.2, 2.6]), trial("b", 0, [5, 4, 2.5, 2.0]), trial("b", 3, [5, 4, 3, 2])]}
    gap = gap_along(trials, "a", "b", 0)
    assert gap.seeds == [0, 1]  # seed 2 has no partner, seed 3 no run of a
    assert [x for x, _ in gap.points] == [0, 10, 20]  # b's seed 1 ends at step 20: nothing is extrapolated
    assert gap.points[1][1] == pytest.approx([-1.0, -1.0])
    assert gap.points[2][1] == pytest.approx([-0.5, -0.4])
    x, m, h = gap.series()[2]
    assert (x, m) == (20, pytest.approx(-0.45)) and h == pytest.approx(12.706 * (0.1 / math.sqrt(2)) / math.sqrt(2), rel=1e-3)
    # over the last half (steps 10 to 20) the gap closed by 0.5 and 0.6: a fell less
    assert gap.moved(0.5) == pytest.approx([0.5, 0.6])
    # between evaluations the gap at the stretch's start is interpolated (step 15: -0.75, -0.7)
    assert gap.moved(0.25) == pytest.approx([0.25, 0.3])


def test_the_gap_along_seconds_and_its_errors():
    trials = {"a": [trial("a", 0, [4, 2, 1])], "b": [trial("b", 0, [4, 3, 2], every=20.0)]}
    gap = gap_along(trials, "a", "b", 1)  # b's evaluations at 0, 2 and 4 s; a's run ends at 2 s
    assert [x for x, _ in gap.points] == [0, 2]
    assert gap.points[-1][1] == pytest.approx([1.0 - 3.0])
    assert math.isnan(gap.series()[-1][2])  # one seed: no interval
    assert gap_along({"a": [trial("a", 0, [4, 2], status="diverged")], "b": trials["b"]}, "a", "b", 0) is None
    with pytest.raises(UsageError, match="no arm 'c'"):
        paired_runs(trials, "c", "b")


def test_the_fall_over_the_last_fraction_of_each_run():
    trials = {"flat": [trial("flat", 0, [5, 2, 2, 2, 2, 2])],
              "falling": [trial("falling", 0, [5, 4, 3, 2, 1, 0]), trial("falling", 1, [5, 4, 3, 2, 1.5, 1])],
              "none": [trial("none", 0, [5, 1], status="diverged")]}
    falls = {f.arm: f for f in loss_falls(trials, 0.2)}
    assert set(falls) == {"flat", "falling"}
    assert falls["flat"].drops == [0.0]
    assert falls["falling"].drops == pytest.approx([1.0, 0.5])  # from step 40 to step 50
    assert falls["falling"].mean == pytest.approx(0.75)
    assert falls["falling"].per_1000_steps == pytest.approx(75.0)


def test_the_gap_plot_is_a_png(tmp_path):
    trials = {"a": [trial("a", s, [5, 3, 2 + s / 10]) for s in range(2)],
              "b": [trial("b", s, [5, 4, 2.5]) for s in range(2)]}
    path = save_gap_plot([gap_along(trials, "a", "b", 0)], tmp_path / "gaps" / "g.png", "a against b")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("budget, drawn, not_drawn", [("steps", "gap_vs_steps.png", "gap_vs_time.png"),
                                                      ("wallclock", "gap_vs_time.png", "gap_vs_steps.png")])
def test_the_export_draws_the_gap_along_the_budgets_own_axis(tmp_path, budget, drawn, not_drawn):
    trials = {"b": [trial("b", s, [5, 4, 2.5]) for s in range(2)], "a": [trial("a", s, [5, 3, 2 + s / 10]) for s in range(2)]}
    table = StudyTable("pair", budget, "", "b", 20.0, 2.0, [{"arm": "b"}, {"arm": "a"}], [], trials)
    names = {p.name for p in save_plots(table, tmp_path)}
    assert drawn in names and not_drawn not in names
    assert (tmp_path / drawn).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
