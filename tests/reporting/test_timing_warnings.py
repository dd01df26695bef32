"""Timing warnings under exported tables, on synthetic tables; the warm-up kept off the clock."""

from __future__ import annotations

import json

from mhar_ablate.reporting.render import render
from mhar_ablate.reporting.table import StudyTable, TrialData, timing_warnings
from mhar_ablate.training.budget import TrainingClock


def _table(rows, trials) -> StudyTable:
    t = StudyTable("syn", "steps", "synthetic", "baseline", 10, 5.0, rows, [], trials)
    t.warnings = timing_warnings(rows, trials, "baseline")
    return t


def _row(arm, tvb, speed=None):
    r = {"arm": arm, "n": 1, "diverged": 0, "pruned": 0, "throughput_vs_baseline": tvb}
    if speed is not None:
        r["speedup_time"] = (speed, float("nan"), float("nan"), 1)
    return r


def _trial(arm, ratio=None):
    return TrialData(arm, 0, "completed", [(10, 5.0, 100, 3.0)], 100.0, None, 1, 0.0, "cpu", "reference",
                     early_ratio=ratio)


def test_an_implausible_throughput_ratio_is_warned_in_every_format():
    rows = [_row("baseline", 1.0), _row("a", 10.95, speed=11.45)]
    table = _table(rows, {"baseline": [_trial("baseline")], "a": [_trial("a")]})
    assert len(table.warnings) == 2 and "10.95×" in table.warnings[0] and "11.45×" in table.warnings[1]
    assert "Timing warning" in render(table, "md") and "Timing warning" in render(table, "latex")
    assert "10.95" in render(table, "csv").splitlines()[2]  # the arm's row, in its timing_warning field
    assert json.loads(render(table, "json"))["timing_warnings"] == table.warnings
    # Arms agreeing with each other: no warning, although they are far from 1.0 together... as long as
    # each stays within 3x of the others' median.
    rows = [_row("baseline", 1.0), _row("a", 0.9), _row("b", 0.8), _row("c", 0.95)]
    assert not _table(rows, {}).warnings
    rows = [_row("baseline", 1.0), _row("a", 0.9), _row("b", 0.8), _row("c", 4.0)]
    assert [w.split(":")[0] for w in _table(rows, {}).warnings] == ["c"]


def test_slow_first_steps_are_warned():
    rows = [_row("baseline", 1.0), _row("a", 1.0)]
    table = _table(rows, {"baseline": [_trial("baseline", ratio=11.0)], "a": [_trial("a", ratio=1.1)]})
    assert table.warnings == [w for w in table.warnings if w.startswith("baseline seed 0")] and table.warnings
    assert "11.0× its median step" in render(table, "md")


class FakeTimer:
    free_readout = True

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    def seconds(self, a, b):
        return b - a


def test_the_first_step_is_kept_off_the_clock():
    timer = FakeTimer()
    clock = TrainingClock(timer)
    for i, length in enumerate([5.0, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1]):
        warm = not clock.warm
        clock.begin_warmup() if warm else clock.begin_step()
        timer.now += length
        clock.end_warmup() if warm else clock.end_step()
        clock.read()
    t = clock.timing()
    assert t["warmup_steps"] == 1 and t["warmup_seconds"] == 5.0
    assert abs(clock.elapsed - 1.0) < 1e-9  # the 5 s warm-up is no arm's training time
    assert t["early_steps"] == 3 and abs(t["early_ratio"] - (0.7 / 3) / 0.1) < 1e-9
