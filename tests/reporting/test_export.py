"""Export details that need no training: LaTeX escaping, the t quantile of the paired interval."""

from __future__ import annotations

import math
import statistics

import pytest

from mhar_ablate.reporting.table import StudyTable, TrialData, _paired
from mhar_ablate.reporting.render import latex_escape, render

SPECIAL = "a&b%c$d#e_f{g}h~i^j\\k"
ESCAPED = r"a\&b\%c\$d\#e\_f\{g\}h\textasciitilde{}i\textasciicircum{}j\textbackslash{}k"


def test_latex_escapes_every_special_character():
    assert latex_escape(SPECIAL) == ESCAPED
    assert latex_escape("0.5 ± 0.1, 2×, Δ, –") == r"0.5 $\pm$ 0.1, 2$\times$, $\Delta$, --"


def test_latex_table_escapes_arm_names_bold_cells_and_the_caption():
    row = {"arm": SPECIAL, "n": 2, "diverged": 0, "pruned": 0, "loss_at_steps": (2.5, 0.1),
           "best_loss_at_steps": True}
    table = StudyTable(name="my_study#1", budget="steps", description="", baseline=None, at_step=10,
                       at_seconds=3.0, rows=[row], missing=[])
    tex = render(table, "latex")
    line = next(l for l in tex.splitlines() if l.startswith("a\\&"))
    assert line.startswith(ESCAPED + " & 2 & ")
    assert r"\textbf{2.5000 $\pm$ 0.1000}" in line
    assert r"\caption{my\_study\#1, steps budget." in tex
    md = render(table, "md")
    assert f"| {SPECIAL} | 2 | **2.5000 ± 0.1000** |" in md


def _trials(diffs: list[float]) -> tuple[list[TrialData], list[TrialData]]:
    def trial(arm, seed, loss):
        return TrialData(arm, seed, "completed", [(10.0, 1.0, 100.0, loss)], None, None, None, None, "cpu", "")

    base = [trial("b", s, 3.0) for s in range(len(diffs))]
    return [trial("a", s, 3.0 + d) for s, d in enumerate(diffs)], base


@pytest.mark.parametrize("n", [2, 5, 40])
def test_paired_interval_uses_students_t(n):
    """The old table stopped at 30 degrees of freedom and reused its last value beyond."""
    from scipy.stats import t

    diffs = [0.01 * ((7 * i) % 11 - 5) for i in range(n)]
    arm, base = _trials(diffs)
    mean, half, count = _paired(arm, base, 0, 10.0)
    assert count == n and mean == pytest.approx(statistics.fmean(diffs))
    expected = t.ppf(0.975, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    assert half == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("budget", ["steps", "wallclock", "flops"])
def test_equal_steps_column_is_qualified_where_schedules_differ(budget):
    # Under a time or FLOPs budget a faster arm is mid-schedule at the step count a slower one ends on.
    row = {"arm": "a", "n": 1, "diverged": 0, "pruned": 0, "loss_at_steps": (2.5, 0.0)}
    table = StudyTable(name="s", budget=budget, description="", baseline=None, at_step=574, at_seconds=15.0,
                       rows=[row], missing=[])
    for fmt in ("md", "latex"):
        text = render(table, fmt)
        assert ("schedule spans its own budget" in text) == (budget != "steps"), fmt
        assert budget == "steps" or "at 574 steps" in text
