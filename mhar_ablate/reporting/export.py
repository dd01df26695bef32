"""``mhar-ablate export``: a study's table and plots written beside its runs, and the rankings across the
budgets a study was run with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io import write_text
from .plots import save_plots
from .render import EXT, render
from .table import measures, BUDGET_MEASURE, StudyTable, build_table


def export(study, fmt: str, folder: Path, target_loss: float | None = None) -> tuple[str, list[Path]]:
    """Render ``study`` as ``fmt``; write the table and the plots into ``folder``; return (text, files).
    ``target_loss``: the time-to-target columns' target (default: each seed's baseline final loss)."""
    from .eval_columns import add_eval_columns

    table = build_table(study, target_loss)
    add_eval_columns(table, folder)
    text = render(table, fmt)
    path = folder / f"table.{EXT[fmt]}"
    write_text(path, text)
    return text, [path, *save_plots(table, folder)]


def _ranked(table: StudyTable, col: str) -> list[dict[str, Any]]:
    return sorted((r for r in table.rows if col in r and not r.get("start")), key=lambda r: r[col][0])


def verdicts(tables: list[StudyTable]) -> str:
    """When a study ran under several budgets: the arms ranked by each measure of each, one line each."""
    lines = []
    for t in tables:
        for col, what in measures(t):
            ranked = _ranked(t, col)
            if ranked:
                lines.append(f"{t.budget} budget, {what}: " + " < ".join(r["arm"] for r in ranked))
    return "\n".join(lines)


def rankings(tables: list[StudyTable]) -> str:
    """The ranking under each budget, side by side (markdown): one column per budget, judged at its own
    equal point (steps at equal steps, wallclock at equal time, flops at equal FLOPs), best first, with
    the mean loss and, for the other arms, the paired Δ to the baseline."""
    columns = []
    for t in tables:
        col = BUDGET_MEASURE.get(t.budget)
        label = dict(measures(t)).get(col)
        if label is None:
            continue
        cells = []
        for r in _ranked(t, col):
            d = r.get(col.replace("loss_", "delta_"))
            cells.append(f"{r['arm']} {r[col][0]:.4f}" + (f" (Δ {d[0]:+.4f})" if d else ""))
        columns.append((f"{t.budget} budget, {label}", cells))
    if not columns:
        return ""
    depth = max(len(c) for _, c in columns)
    head = ["rank", *(h for h, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for i in range(depth):
        lines.append("| " + " | ".join([str(i + 1), *(c[i] if i < len(c) else "" for _, c in columns)]) + " |")
    return "\n".join(lines) + "\n"
