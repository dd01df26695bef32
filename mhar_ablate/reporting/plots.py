"""The study's plots: validation loss against steps, training time and training FLOPs (one line per arm,
mean over seeds), with the target loss marked, the speed-up to target, and each arm's gap to the baseline
along the steps, or along the training time under the wall-clock budget (``gaps.py``: whether a difference
lasts).
"""

from __future__ import annotations

import io
import math
import statistics
from pathlib import Path
from typing import Any

from ..io import write_bytes
from .gaps import Gap, gap_along
from .table import measures, FLOPS_AXIS, StudyTable, interpolate


# --------------------------------------------------------------------------- plots


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "hours"
    if seconds >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def save_plots(table: StudyTable, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    longest = max((t.curve[-1][1] for ts in table.trials.values() for t in ts if t.usable), default=1.0)
    scale, unit = _time_unit(longest)
    by_arm = {r["arm"]: r for r in table.rows}
    # Trials that shared a GPU (--trials-per-gpu) trained slower than alone: their time says nothing of speed.
    shared = "; trials shared the GPU" if table.shared_device else ""
    axes = [(0, "loss_vs_steps.png", "optimiser step"), (1, "loss_vs_time.png", f"training time ({unit}{shared})")]
    if table.at_flops is not None:
        axes.append((FLOPS_AXIS, "loss_vs_flops.png", "training FLOPs"))
    for axis, fname, xlabel in axes:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm, ts in table.trials.items():
            ok = [t for t in ts if t.usable]
            if not ok:
                continue
            end = min(t.curve[-1][axis] for t in ok)
            xs = [end * i / 50 for i in range(51)]
            ys = [[interpolate(t.curve, axis, x) for x in xs] for t in ok]
            mean = [statistics.fmean(col) for col in zip(*ys)]
            px = [x / scale for x in xs] if axis == 1 else xs
            (line,) = ax.plot(px, mean, label=arm, lw=1.6, ls="--" if arm == table.baseline else "-")
            if len(ok) > 1:
                ax.fill_between(px, [min(c) for c in zip(*ys)], [max(c) for c in zip(*ys)], color=line.get_color(), alpha=0.15)
            _mark_target(ax, by_arm.get(arm, {}), axis, scale, line.get_color(), (table.target or {}).get("loss"))
        _target_line(ax, table)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        per = {0: "step", 1: "unit of training time", FLOPS_AXIS: "training FLOP"}[axis]
        ax.set_title(f"{table.name} ({table.budget} budget): loss per {per}")
        _zoom(ax, table)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, folder / fname))
        plt.close(fig)
    # Under the wall-clock budget the arms end at different steps and the question is per hour: along time.
    axis = 1 if table.budget == "wallclock" else 0
    gaps = [g for arm in table.trials if table.baseline and arm != table.baseline and table.baseline in table.trials
            if (g := gap_along(table.trials, arm, table.baseline, axis)) is not None]
    if gaps:
        per = "unit of training time" if axis else "step"
        fig = gap_figure(gaps, plt, f"{table.name} ({table.budget} budget): gap to {table.baseline} per {per}")
        written.append(_save(fig, folder / ("gap_vs_time.png" if axis else "gap_vs_steps.png")))
        plt.close(fig)
    speedups = _speedup_plot(table, plt)
    if speedups is not None:
        written.append(_save(speedups, folder / "speedup_to_target.png"))
        plt.close(speedups)
    points = {arm: v for arm, v in table.curve_values.items() if v is not None}
    if points:
        fig, ax = plt.subplots(figsize=(5.6, 4.0))
        rows = {r["arm"]: r for r in table.rows}
        for col, label in measures(table):
            if col == "loss_at_time" and shared:
                label += " (GPU shared)"
            arms = sorted((a for a in points if col in rows.get(a, {})), key=lambda a: points[a])
            if not arms:
                continue
            xs = [points[a] for a in arms]
            line = ax.errorbar(xs, [rows[a][col][0] for a in arms], yerr=[rows[a][col][1] for a in arms], marker="o",
                               capsize=3, label=label)
            base = rows.get(table.baseline or "", {})
            if col in base:
                ax.axhline(base[col][0], ls="--", lw=1, color=line[0].get_color(), alpha=0.7, label=f"baseline {label}")
        what = "routing heads H" if table.curve_key == "residual.heads" else str(table.curve_key)
        if all(isinstance(v, (int, float)) and v > 0 for v in points.values()):
            ax.set_xscale("log", base=2)
            ticks = sorted(set(points.values()))
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlabel(what)
        ax.set_ylabel("validation loss")
        ax.set_title(f"{table.name}: loss against {what}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, folder / f"{table.name}_curve.png"))
        plt.close(fig)
    return written


def gap_figure(gaps: list[Gap], plt, title: str):
    """Each gap's mean over seeds along its axis, its 95 % interval shaded (where there are two seeds or
    more), and the zero line: below zero, the first arm is ahead."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for g in gaps:
        xs, ms, hs = zip(*g.series())
        (line,) = ax.plot(xs, ms, marker="o", ms=3, lw=1.6, label=f"{g.a} − {g.b} ({len(g.seeds)} seeds)")
        if not any(math.isnan(h) for h in hs):
            ax.fill_between(xs, [m - h for m, h in zip(ms, hs)], [m + h for m, h in zip(ms, hs)],
                            color=line.get_color(), alpha=0.15, lw=0)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("optimiser step" if gaps[0].axis == 0 else "training time (seconds)")
    ax.set_ylabel("validation-loss gap (nats), 95 % interval")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def save_gap_plot(gaps: list[Gap], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = gap_figure(gaps, plt, title)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def _mark_target(ax, row: dict[str, Any], axis: int, scale: float, color, y: float | None) -> None:
    """A marker at an arm's mean steps (seconds) to the target, at the target's (mean) loss; only where
    every run of the arm reached it (a mean over the runs that did would sit off the arm's curve)."""
    if axis not in (0, 1) or not row.get("target_runs") or row.get("target_reached") != row.get("target_runs"):
        return
    x = row.get("steps_to_target" if axis == 0 else "seconds_to_target")
    if x is not None and y is not None:
        ax.plot([x / scale if axis == 1 else x], [y], marker="o", ms=5, color=color, mec="black", mew=0.6, zorder=5)


def _target_line(ax, table: StudyTable) -> None:
    loss = (table.target or {}).get("loss")
    if loss is not None:
        what = "target (baseline final, mean)" if table.target.get("kind") == "baseline" else "target"
        ax.axhline(loss, color="grey", ls=":", lw=1, label=what)


def _speedup_plot(table: StudyTable, plt):
    """Speed-up to the target (steps and training time) per arm with its interval; None when no arm has one."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    arms = [r for r in table.rows if r.get("speedup_steps") or r.get("speedup_time")]
    if not arms:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 0.5 * len(arms) + 1.8), sharey=True)
    for ax, key, what in ((axes[0], "speedup_steps", "steps"), (axes[1], "speedup_time", "training time")):
        for i, r in enumerate(arms):
            v = r.get(key)
            if v is None:
                continue
            m, lo, hi, _ = v
            err = [[m - lo], [hi - m]] if not math.isnan(lo) else None
            ax.errorbar([m], [i], xerr=err, fmt="o", capsize=3, color="C0")
        ax.axvline(1.0, color="grey", ls="--", lw=1)
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.2f}×"))
        ax.set_xlabel(f"speed-up in {what} to target (×)")
        ax.grid(alpha=0.3)
    def label(r):  # the seeds a speed-up is over, where not all of them reached the target
        n = max((v[3] for v in (r.get("speedup_steps"), r.get("speedup_time")) if v), default=0)
        return r["arm"] + (f" ({n}/{r['target_runs']} seeds)" if n < r.get("target_runs", 0) else "")

    axes[0].set_yticks(range(len(arms)), [label(r) for r in arms])
    axes[0].invert_yaxis()
    fig.suptitle(f"{table.name} ({table.budget} budget): speed-up over {table.baseline} to the target", fontsize=10)
    fig.tight_layout()
    return fig


def _zoom(ax, table: StudyTable) -> None:
    """Early losses dwarf the differences between arms: show the last 80 % of the range of final losses."""
    finals = [t.curve[-1][3] for ts in table.trials.values() for t in ts if t.usable]
    starts = [t.curve[min(1, len(t.curve) - 1)][3] for ts in table.trials.values() for t in ts if t.usable]
    if finals and starts:
        lo, hi = min(finals), max(starts)
        if hi > lo:
            ax.set_ylim(lo - 0.05 * (hi - lo), hi)


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_bytes(path, buf.getvalue())
    return path


