"""Ablation tables and plots from a finished (or unfinished) study.

One row per arm: validation loss at equal steps (the largest step every arm reached), at equal
training time (the largest training time every arm reached) and at equal training FLOPs (the most FLOPs
every arm spent, by model/flops.py's count), mean ± std over seeds with n; the paired
difference to the baseline arm with a 95 % t-interval over seeds; throughput relative to the baseline;
peak memory; parameter overhead. The lowest loss in each loss column is marked. Diverged trials are
counted but left out of the equal points (their curves end early).

A second table per study: the final evaluation on the large fixed held-out set (training/final_eval.py)
with its standard errors beside the spread over seeds, and steps and time to a target loss with the
speed-up over the baseline (reporting/to_target.py); runs recorded before the final evaluation show –.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import format_flops
from .errors import UsageError
from .io import write_bytes, write_text

FORMATS = ("md", "latex", "csv", "json")
EXT = {"md": "md", "latex": "tex", "csv": "csv", "json": "json"}


def t95(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


@dataclass
class TrialData:
    arm: str
    seed: int
    status: str
    # (step, seconds, tokens, val_loss), and training FLOPs (tokens x flops_per_token) where that is known
    curve: list[tuple[float, ...]]
    tokens_per_s: float | None
    peak_mem_gb: float | None
    params: int | None
    overhead_pct: float | None
    device: str
    backend: str
    flops_per_token: float | None = None  # model/flops.py's count (None: a trial from before it was recorded)
    # The final evaluation on the large fixed held-out set (training/final_eval.py); None for runs
    # recorded before it existed, and for runs that did not complete.
    final_loss: float | None = None
    final_se: float | None = None
    final_sequences: int | None = None
    final_losses: list[float] | None = field(default=None, repr=False)

    @property
    def usable(self) -> bool:
        return self.status == "completed" and len(self.curve) > 0


@dataclass
class ExtraColumn:
    """A column that a later stage adds to the table after the loss columns (downstream evaluation:
    ``evaluation/columns.py``): per arm, the mean, std and count over seeds of one measure."""

    header: str
    key: str  # its name in csv and json
    values: dict[str, tuple[float, float, int]]  # arm -> (mean, std, seeds)
    higher_is_better: bool | None = None  # which end is bold; None: no bold


@dataclass
class StudyTable:
    name: str
    budget: str
    description: str
    baseline: str | None
    at_step: float
    at_seconds: float
    rows: list[dict[str, Any]]
    missing: list[str]
    trials: dict[str, list[TrialData]] = field(repr=False, default_factory=dict)
    curve_values: dict[str, Any] = field(default_factory=dict)
    curve_key: str | None = None
    device: str = ""
    backend_note: str = ""
    shared_device: bool = False  # some trials shared a GPU (--trials-per-gpu): time and throughput are not clean
    at_flops: float | None = None  # the equal-FLOPs point; None when a trial did not record its FLOPs per token
    extra: list[ExtraColumn] = field(default_factory=list)
    # What the time-to-target columns aim at (reporting/to_target.py): kind ("baseline": each seed's baseline
    # final loss; "loss": one named loss), loss (the mean target), per_seed.
    target: dict[str, Any] = field(default_factory=dict)


def _num(v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def collect(study) -> tuple[dict[str, list[TrialData]], list[str]]:
    """Finished trials per arm (latest per grid point) and a description of every missing point."""
    attrs = study.user_attrs
    arms, seeds = list(attrs.get("arms", [])), int(attrs.get("seeds", 0))
    latest: dict[tuple[str, int], Any] = {}
    for t in study.get_trials(deepcopy=False):
        if "arm" not in t.params:
            continue
        key = (t.params["arm"], t.params["seed"])
        prev = latest.get(key)
        finished = t.state.name in ("COMPLETE", "PRUNED")
        if prev is None or finished or prev.state.name not in ("COMPLETE", "PRUNED"):
            latest[key] = t
    by_arm: dict[str, list[TrialData]] = {a: [] for a in arms}
    missing: list[str] = []
    for arm in arms:
        for seed in range(seeds):
            t = latest.get((arm, seed))
            if t is None or t.state.name not in ("COMPLETE", "PRUNED"):
                why = "not started" if t is None else {"RUNNING": "running", "FAIL": "crashed or interrupted",
                                                       "WAITING": "waiting"}.get(t.state.name, t.state.name.lower())
                missing.append(f"{arm} seed {seed} ({why})")
                continue
            u = t.user_attrs
            per_token = _num(u.get("flops_per_token"))
            curve = [tuple(float(x) for x in p) for p in u.get("curve", [])]
            if per_token:
                curve = [(*p[:4], p[2] * per_token) for p in curve]  # training FLOPs at index FLOPS_AXIS
            by_arm[arm].append(TrialData(arm, seed, u.get("status", "pruned" if t.state.name == "PRUNED" else "completed"),
                                         curve, _num(u.get("tokens_per_s")), _num(u.get("peak_mem_gb")), u.get("params"),
                                         _num(u.get("param_overhead_pct")), u.get("device", ""), u.get("routing_backend", ""),
                                         per_token, **_final_fields(u)))
    return by_arm, missing


FLOPS_AXIS = 4  # a curve point's training FLOPs


def _final_fields(u: dict[str, Any]) -> dict[str, Any]:
    """A trial's final evaluation (``final_eval_*`` attributes, study.py); empty for an older trial."""
    loss = _num(u.get("final_eval_loss"))
    if loss is None or not math.isfinite(loss):
        return {}
    losses = u.get("final_eval_losses")
    return {"final_loss": loss, "final_se": _num(u.get("final_eval_se")), "final_sequences": u.get("final_eval_sequences"),
            "final_losses": [float(v) for v in losses] if isinstance(losses, list) else None}


def interpolate(curve: list[tuple[float, ...]], axis: int, x: float) -> float:
    """Validation loss at ``x`` along the curve's ``axis`` (0 = steps, 1 = seconds, 4 = FLOPs), linear
    between evaluations."""
    pts = [(p[axis], p[3]) for p in curve]
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _paired(arm: list[TrialData], base: list[TrialData], axis: int, x: float) -> tuple[float, float, int] | None:
    """Mean paired difference (arm - baseline) over shared seeds, with the 95 % CI half-width."""
    b = {t.seed: t for t in base if t.usable}
    diffs = [interpolate(t.curve, axis, x) - interpolate(b[t.seed].curve, axis, x) for t in arm if t.usable and t.seed in b]
    return _mean_interval(diffs) if diffs else None


def _mean_interval(diffs: list[float]) -> tuple[float, float, int]:
    """(mean, 95 % t-interval half-width, n) of paired differences; the half-width is nan for one."""
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return m, math.nan, 1
    return m, t95(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)


def build_table(study, target_loss: float | None = None) -> StudyTable:
    """The study's table; ``target_loss``: the loss the time-to-target columns aim at (default: each
    seed's baseline final loss, reporting/to_target.py)."""
    attrs = study.user_attrs
    trials, missing = collect(study)
    usable = [t for ts in trials.values() for t in ts if t.usable]
    if not usable:
        raise UsageError(f"study {study.study_name} has no finished trials yet" +
                         (f"; missing: {', '.join(missing)}" if missing else ""))
    at_step = min(t.curve[-1][0] for t in usable)
    at_seconds = min(t.curve[-1][1] for t in usable)
    # Equal FLOPs: the most every arm spent, when every trial recorded its count.
    at_flops = min(t.curve[-1][FLOPS_AXIS] for t in usable) if all(t.flops_per_token for t in usable) else None
    base_name = attrs.get("baseline")
    base = trials.get(base_name, []) if base_name else []
    base_tps = [t.tokens_per_s for t in base if t.usable and t.tokens_per_s]
    rows = []
    for arm, ts in trials.items():
        ok = [t for t in ts if t.usable]
        row: dict[str, Any] = {"arm": arm, "n": len(ok), "diverged": sum(t.status == "diverged" for t in ts),
                               "pruned": sum(t.status == "pruned" for t in ts)}
        if ok:
            row["loss_at_steps"] = _mean_std([interpolate(t.curve, 0, at_step) for t in ok])
            row["loss_at_time"] = _mean_std([interpolate(t.curve, 1, at_seconds) for t in ok])
            if at_flops is not None:
                row["loss_at_flops"] = _mean_std([interpolate(t.curve, FLOPS_AXIS, at_flops) for t in ok])
            tps = [t.tokens_per_s for t in ok if t.tokens_per_s]
            row["tokens_per_s"] = statistics.fmean(tps) if tps else None
            row["throughput_vs_baseline"] = (row["tokens_per_s"] / statistics.fmean(base_tps)) if tps and base_tps else None
            mem = [t.peak_mem_gb for t in ok if t.peak_mem_gb]
            row["peak_mem_gb"] = max(mem) if mem else None
            row["param_overhead_pct"] = ok[0].overhead_pct
            row["params"] = ok[0].params
            if base_name and arm != base_name:
                row["delta_at_steps"] = _paired(ok, base, 0, at_step)
                row["delta_at_time"] = _paired(ok, base, 1, at_seconds)
                if at_flops is not None:
                    row["delta_at_flops"] = _paired(ok, base, FLOPS_AXIS, at_flops)
        rows.append(row)
    for col in LOSS_COLUMNS:
        vals = [r[col][0] for r in rows if col in r]
        if vals:
            best = min(vals)
            for r in rows:
                r[f"best_{col}"] = col in r and r[col][0] == best
    source = attrs.get("source_losses") or {}
    if source:
        # The source checkpoint's own loss (continued pretraining): where both continuations started.
        # Not a contestant: no bold, no difference; the arms' Δ is against the baseline (plain) arm.
        start = _mean_std([float(v) for v in source.values()])
        rows.append({"arm": START_ROW, "n": len(source), "diverged": 0, "pruned": 0, "start": True,
                     "loss_at_steps": start, "loss_at_time": start,
                     **({"loss_at_flops": start} if at_flops is not None else {})})
    target = _add_final_and_target(rows, trials, base_name, target_loss)
    devices = sorted({t.device for t in usable if t.device})
    # The routers that have a fused GPU kernel (plain-PyTorch variants, "pytorch", have nothing faster).
    backends = sorted({t.backend for t in usable if t.backend not in ("", "none", "pytorch")})
    note = ""
    if devices == ["cpu"] and backends:
        note = (f"Timed on the CPU with the {'/'.join(backends)} router: wall-clock comparisons measure PyTorch on the "
                "CPU, not the fused GPU kernel.")
    shared = bool(attrs.get("shared_device")) or any(t.user_attrs.get("shared_device") for t in study.get_trials(deepcopy=False)
                                                     if t.state.name == "COMPLETE")
    if shared:
        note = (note + " " if note else "") + SHARED_NOTE
    return StudyTable(attrs.get("study", study.study_name), attrs.get("budget", ""), attrs.get("description", ""),
                      base_name, at_step, at_seconds, rows, missing, trials, attrs.get("curve_values", {}),
                      attrs.get("curve"), ", ".join(devices), note, shared, at_flops, target=target)


def _add_final_and_target(rows: list[dict[str, Any]], trials: dict[str, list[TrialData]], base_name: str | None,
                          target_loss: float | None) -> dict[str, Any]:
    """Each arm's final-set loss (mean ± std over seeds, ``final_loss``), its evaluation's standard error
    (root mean square of the runs' own, ``final_se``), the paired Δ to the baseline over seeds with its
    95 % t-interval (``delta_final``) and the evaluation's share of that Δ's noise (``delta_final_se``:
    per seed, the standard error of the per-sequence differences, root mean square over seeds); then the
    time-to-target columns (``to_target``). Returns the target's description."""
    from .reporting.to_target import to_target
    from .training.final_eval import paired_se

    usable = {arm: [t for t in ts if t.usable] for arm, ts in trials.items()}
    base = {t.seed: t for t in usable.get(base_name or "", []) if t.final_loss is not None}
    rms = lambda xs: math.sqrt(statistics.fmean(x * x for x in xs)) if xs else None
    by_target, about = to_target(usable, base_name, target_loss, t95)
    for row in rows:
        ok = [t for t in usable.get(row["arm"], []) if t.final_loss is not None]
        if ok:
            row["final_n"] = len(ok)
            row["final_loss"] = _mean_std([t.final_loss for t in ok])
            row["final_se"] = rms([t.final_se for t in ok if t.final_se is not None and math.isfinite(t.final_se)])
            row["final_sequences"] = min(t.final_sequences or 0 for t in ok)
            pairs = [(t, base[t.seed]) for t in ok if t.seed in base]
            if base_name and row["arm"] != base_name and pairs:
                row["delta_final"] = _mean_interval([a.final_loss - b.final_loss for a, b in pairs])
                ses = [paired_se(a.final_losses or [], b.final_losses or []) for a, b in pairs]
                row["delta_final_se"] = rms([x for x in ses if math.isfinite(x)])
        row.update(by_target.get(row["arm"], {}))
    finals = [r["final_loss"][0] for r in rows if "final_loss" in r]
    for r in rows:
        r["best_final_loss"] = bool(finals) and "final_loss" in r and r["final_loss"][0] == min(finals)
    return about


SHARED_NOTE = ("† Measured on a shared device: trials ran several at a time on one GPU (--trials-per-gpu), so the "
               "equal-time and throughput columns measure the sharing too; the equal-step and equal-FLOPs columns "
               "are unaffected.")
SHARED_COLUMNS = (4, 5, 8)  # val loss @ T, its Δ, throughput: the columns that depend on speed
LOSS_COLUMNS = ("loss_at_steps", "loss_at_time", "loss_at_flops")
# The measure each budget is judged by: its own equal point.
BUDGET_MEASURE = {"steps": "loss_at_steps", "wallclock": "loss_at_time", "flops": "loss_at_flops"}


# --------------------------------------------------------------------------- rendering

START_ROW = "start (source checkpoint)"
HEADERS = ["arm", "n", "val loss @ {steps} steps", "Δ vs baseline", "val loss @ {time}", "Δ vs baseline",
           "val loss @ {flops}", "Δ vs baseline", "throughput vs baseline", "peak mem (GB)", "params Δ"]


def _fmt_time(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else (f"{s / 60:.1f}min" if s < 7200 else f"{s / 3600:.2f}h")


def _cells(table: StudyTable, row: dict[str, Any], bold) -> list[str]:
    def loss(col):
        if col not in row:
            return "–"
        m, s = row[col]
        text = f"{m:.4f} ± {s:.4f}"
        return bold(text) if row.get(f"best_{col}") else text

    def delta(col):
        d = row.get(col)
        if d is None:
            if row.get("start"):
                return "(start)"
            return "–" if row["arm"] != table.baseline else "(baseline)"
        m, half, n = d
        return f"{m:+.4f}" + (f" [{m - half:+.4f}, {m + half:+.4f}]" if not math.isnan(half) else " (n=1)")

    tvb = row.get("throughput_vs_baseline")
    mem = row.get("peak_mem_gb")
    pct = row.get("param_overhead_pct")
    n = f"{row['n']}" + (f" (+{row['diverged']} diverged)" if row["diverged"] else "") + (
        f" (+{row['pruned']} pruned)" if row["pruned"] else "")
    return [row["arm"], n, loss("loss_at_steps"), delta("delta_at_steps"), loss("loss_at_time"), delta("delta_at_time"),
            loss("loss_at_flops"), delta("delta_at_flops"), f"{tvb:.2f}×" if tvb else "–", f"{mem:.1f}" if mem else "–",
            f"{pct:+.3f} %" if pct is not None else "–"]


FINAL_HEADERS = ["arm", "n", "final-set loss", "eval SE", "Δ vs baseline", "eval SE of Δ", "steps to target",
                 "time to target", "speed-up (steps)", "speed-up (time)"]


def _final_cells(table: StudyTable, row: dict[str, Any], bold) -> list[str]:
    """The cells of the final-evaluation and time-to-target table (``FINAL_HEADERS``); – where a run
    has no final evaluation (recorded before it existed) or an arm has no such value."""
    baseline = row["arm"] == table.baseline

    def loss():
        if "final_loss" not in row:
            return "–"
        m, s = row["final_loss"]
        text = f"{m:.4f} ± {s:.4f}"
        return bold(text) if row.get("best_final_loss") else text

    def se(key):
        v = row.get(key)
        if v is not None:
            return f"{v:.4f}"
        return "(baseline)" if baseline and key == "delta_final_se" and "final_loss" in row else "–"

    def delta():
        d = row.get("delta_final")
        if d is None:
            return "(baseline)" if baseline and "final_loss" in row else "–"
        m, half, _ = d
        return f"{m:+.4f}" + (f" [{m - half:+.4f}, {m + half:+.4f}]" if not math.isnan(half) else " (n=1)")

    def reached(value, fmt):
        runs, hit = row.get("target_runs", 0), row.get("target_reached", 0)
        if not runs:
            return "–"
        if not hit:
            return "not reached"
        return fmt(value) + (f" ({hit}/{runs} reached)" if hit < runs else "")

    def speed(key):
        v = row.get(key)
        if v is None:
            return "(baseline)" if baseline and row.get("target_runs") else "–"
        m, lo, hi, _ = v
        return f"{m:.2f}×" + (f" [{lo:.2f}, {hi:.2f}]" if not math.isnan(lo) else " (n=1)")

    n = row.get("final_n", 0)
    return [row["arm"], f"{n}" if n else "–", loss(), se("final_se"), delta(), se("delta_final_se"),
            reached(row.get("steps_to_target"), lambda v: f"{v:.0f}"),
            reached(row.get("seconds_to_target"), _fmt_time), speed("speedup_steps"), speed("speedup_time")]


def target_text(table: StudyTable) -> str:
    """What the time-to-target columns aim at, in words."""
    t = table.target
    if not t or t.get("loss") is None:
        return "Time to target: no baseline arm to take a target from (name one with --target-loss)."
    if t["kind"] == "loss":
        return f"Target: validation loss {t['loss']:.4f} (--target-loss), for every run."
    return (f"Target: each seed's baseline final validation loss (mean {t['loss']:.4f}), so the baseline's own time to "
            "target is its budget.")


FINAL_NOTE = ("Final-set loss: one evaluation at each run's end on {sequences} held-out sequences, the same for every "
              "arm and seed; mean ± std over seeds. eval SE: a run's standard error from its per-sequence losses "
              "(root mean square over seeds), to set beside the std over seeds; eval SE of Δ: the same for the "
              "per-sequence differences to the baseline run of the seed (the evaluation's share of Δ's noise). "
              "Steps and time to target: first reached on the validation curve, linear between evaluations, mean "
              "over the runs that reached it (never extrapolated). Speed-up: baseline's steps (time) to target / "
              "the arm's, paired by seed; geometric mean with a 95 % t-interval on the logarithms.")


def _final_note(table: StudyTable) -> str:
    counts = sorted({r["final_sequences"] for r in table.rows if r.get("final_sequences")})
    what = "/".join(f"{c:,}" for c in counts) if counts else "the"
    return FINAL_NOTE.format(sequences=what)


class _Bold(str):
    """A cell to set in bold; each format escapes it first and then marks it."""


def _extra_cells(table: StudyTable, row: dict[str, Any], bold) -> list[str]:
    cells = []
    for col in table.extra:
        v = col.values.get(row["arm"])
        if v is None:
            cells.append("–")
            continue
        text = f"{v[0]:.4f} ± {v[1]:.4f}" + (f" (n={v[2]})" if v[2] != row["n"] else "")
        means = [m for m, _, _ in col.values.values()]
        best = None if col.higher_is_better is None or len(means) < 2 else (max if col.higher_is_better else min)(means)
        cells.append(bold(text) if best is not None and v[0] == best else text)
    return cells


# LaTeX's special characters, and the table's non-ASCII symbols in their math forms, in one pass.
_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
          "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "×": r"$\times$",
          "Δ": r"$\Delta$", "–": "--", "†": r"$^\dagger$"}
_LATEX_RE = re.compile("|".join(re.escape(c) for c in _LATEX))


def latex_escape(text: str) -> str:
    return _LATEX_RE.sub(lambda m: _LATEX[m.group(0)], text)


def _flops_label(table: StudyTable) -> str:
    return format_flops(table.at_flops) if table.at_flops is not None else "equal FLOPs"


def _headers(table: StudyTable) -> list[str]:
    heads = [h.format(steps=int(table.at_step), time=_fmt_time(table.at_seconds), flops=_flops_label(table))
             for h in HEADERS]
    heads = [h + " †" if table.shared_device and i in SHARED_COLUMNS else h for i, h in enumerate(heads)]
    return heads + [c.header for c in table.extra]


def schedule_note(table: StudyTable) -> str | None:
    """Under a time or FLOPs budget every run's learning-rate schedule spans its own budget, so at equal
    steps the arms are at different points of their schedules: say so beside the equal-steps column."""
    if table.budget == "steps":
        return None
    columns = "equal-steps column favours" if table.budget == "flops" else "equal-steps and equal-FLOPs columns favour"
    return (f"Equal steps under the {table.budget} budget: every run's learning-rate schedule spans its own "
            f"budget, so at {int(table.at_step)} steps an arm that trains more steps in the budget is earlier in "
            f"its schedule (its learning rate not yet annealed) than one that trains fewer; the {columns} the "
            "slower arms. The same study under --budget steps compares arms at equal steps on equal schedules.")


def render(table: StudyTable, fmt: str) -> str:
    if fmt == "md":
        head = _headers(table)
        lines = [f"### {table.name} ({table.budget} budget)", "", table.description, "",
                 "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        md = lambda c: (f"**{c}**" if isinstance(c, _Bold) else c).replace("|", r"\|")
        lines += ["| " + " | ".join(md(c) for c in _cells(table, r, _Bold) + _extra_cells(table, r, _Bold)) + " |"
                  for r in table.rows]
        lines += ["", "Mean ± std over seeds; Δ is the paired difference to the baseline arm with its 95 % "
                  "t-interval over seeds; bold marks the lowest loss in a column."]
        note = schedule_note(table)
        if note:
            lines.append(note)
        if table.at_flops is not None:
            lines.append("FLOPs are the theoretical training count per token (matrix multiplies, attention and the "
                         "routing's own term; README, \"Training FLOPs\") times the tokens trained.")
        if any(r.get("start") for r in table.rows):
            lines.append(f"Continued pretraining: Δ is the gain over plain continued training (the {table.baseline} arm: "
                         "same start, data order, schedule and batches), not over the start; the start row is the "
                         "source checkpoint's validation loss before either continuation.")
        if table.extra:
            lines.append("Task columns (`mhar-ablate eval`): mean ± std over each arm's evaluated seeds (n= where fewer "
                         "seeds have results); bold marks the better end.")
        if table.backend_note:
            lines.append(table.backend_note)
        if table.missing:
            lines.append(f"Missing trials: {', '.join(table.missing)}.")
        lines += ["", "#### Final evaluation and time to target", "", target_text(table), "",
                  "| " + " | ".join(FINAL_HEADERS) + " |", "|" + "|".join("---" for _ in FINAL_HEADERS) + "|"]
        lines += ["| " + " | ".join(md(c) for c in _final_cells(table, r, _Bold)) + " |" for r in table.rows
                  if not r.get("start")]
        lines += ["", _final_note(table)]
        return "\n".join(lines) + "\n"
    if fmt == "latex":
        esc = latex_escape
        cell = lambda c: r"\textbf{" + esc(c) + "}" if isinstance(c, _Bold) else esc(c)
        head = [esc(h) for h in _headers(table)]
        lines = [r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}",
                 r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
        lines += [" & ".join(cell(c) for c in _cells(table, r, _Bold) + _extra_cells(table, r, _Bold)) + r" \\"
                  for r in table.rows]
        lines += [r"\bottomrule", r"\end{tabular}",
                  r"\caption{" + esc(f"{table.name}, {table.budget} budget. Mean ± std over seeds; Δ: paired difference "
                                     "to the baseline with a 95 % t-interval; bold: lowest loss. "
                                     + (schedule_note(table) or "")).rstrip() + "}", r"\end{table}"]
        fhead = [esc(h) for h in FINAL_HEADERS]
        lines += ["", r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{l" + "r" * (len(fhead) - 1) + "}",
                  r"\toprule", " & ".join(fhead) + r" \\", r"\midrule"]
        lines += [" & ".join(cell(c) for c in _final_cells(table, r, _Bold)) + r" \\" for r in table.rows
                  if not r.get("start")]
        lines += [r"\bottomrule", r"\end{tabular}",
                  r"\caption{" + esc(f"{table.name}, {table.budget} budget: final evaluation and time to target. "
                                     f"{target_text(table)} {_final_note(table)}") + "}", r"\end{table}"]
        return "\n".join(lines) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["arm", "n", "diverged", "loss_at_steps_mean", "loss_at_steps_std", "delta_at_steps", "delta_at_steps_ci95",
                    "loss_at_time_mean", "loss_at_time_std", "delta_at_time", "delta_at_time_ci95", "throughput_vs_baseline",
                    "tokens_per_s", "peak_mem_gb", "param_overhead_pct", "best_at_steps", "best_at_time", "at_step", "at_seconds",
                    "shared_device", "loss_at_flops_mean", "loss_at_flops_std", "delta_at_flops", "delta_at_flops_ci95",
                    "best_at_flops", "at_flops", *(f"{c.key}_{part}" for c in table.extra for part in ("mean", "std", "n")),
                    *FINAL_CSV])
        for r in table.rows:
            ls, lt = r.get("loss_at_steps", (None, None)), r.get("loss_at_time", (None, None))
            ds, dt = r.get("delta_at_steps") or (None, None, 0), r.get("delta_at_time") or (None, None, 0)
            lf, df = r.get("loss_at_flops", (None, None)), r.get("delta_at_flops") or (None, None, 0)
            w.writerow([r["arm"], r["n"], r["diverged"], *ls, ds[0], ds[1], *lt, dt[0], dt[1], r.get("throughput_vs_baseline"),
                        r.get("tokens_per_s"), r.get("peak_mem_gb"), r.get("param_overhead_pct"),
                        r.get("best_loss_at_steps", False), r.get("best_loss_at_time", False), table.at_step, table.at_seconds,
                        table.shared_device, *lf, df[0], df[1], r.get("best_loss_at_flops", False), table.at_flops,
                        *(x for c in table.extra for x in c.values.get(r["arm"], (None, None, 0))), *_final_csv(table, r)])
        return buf.getvalue()
    if fmt == "json":
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return v
        return json.dumps({"study": table.name, "budget": table.budget, "description": table.description,
                           "baseline": table.baseline, "at_step": table.at_step, "at_seconds": table.at_seconds,
                           "at_flops": table.at_flops,
                           "missing": table.missing, "note": table.backend_note, "shared_device": table.shared_device,
                           "extra_columns": [{"header": c.header, "key": c.key, "higher_is_better": c.higher_is_better}
                                             for c in table.extra],
                           "target": {k: clean(v) if not isinstance(v, dict) else {str(s): x for s, x in v.items()}
                                      for k, v in table.target.items()},
                           "rows": [{**{k: clean(v) for k, v in r.items()},
                                     **{c.key: clean(c.values.get(r["arm"])) for c in table.extra}}
                                    for r in table.rows]}, indent=2) + "\n"
    raise UsageError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")


FINAL_CSV = ["final_n", "final_loss_mean", "final_loss_std", "final_se", "final_sequences", "delta_final",
             "delta_final_ci95", "delta_final_se", "target_loss", "target_runs", "target_reached", "steps_to_target",
             "seconds_to_target", "speedup_steps", "speedup_steps_lo", "speedup_steps_hi", "speedup_time",
             "speedup_time_lo", "speedup_time_hi"]


def _final_csv(table: StudyTable, r: dict[str, Any]) -> list[Any]:
    """The ``FINAL_CSV`` columns of a row (empty where there is no value)."""
    fl = r.get("final_loss", (None, None))
    df = r.get("delta_final") or (None, None, 0)
    ss, st = r.get("speedup_steps") or (None,) * 4, r.get("speedup_time") or (None,) * 4
    return [r.get("final_n"), *fl, r.get("final_se"), r.get("final_sequences"), df[0], df[1], r.get("delta_final_se"),
            (table.target or {}).get("loss"), r.get("target_runs"), r.get("target_reached"), r.get("steps_to_target"),
            r.get("seconds_to_target"), *ss[:3], *st[:3]]


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
    axes = [(0, "loss_vs_steps.png", "optimiser step"), (1, "loss_vs_time.png", f"training time ({unit})")]
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
    speedups = _speedup_plot(table, plt)
    if speedups is not None:
        written.append(_save(speedups, folder / "speedup_to_target.png"))
        plt.close(speedups)
    points = {arm: v for arm, v in table.curve_values.items() if v is not None}
    if points:
        fig, ax = plt.subplots(figsize=(5.6, 4.0))
        rows = {r["arm"]: r for r in table.rows}
        for col, label in _measures(table):
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


def export(study, fmt: str, folder: Path, target_loss: float | None = None) -> tuple[str, list[Path]]:
    """Render ``study`` as ``fmt``; write the table and the plots into ``folder``; return (text, files).
    ``target_loss``: the time-to-target columns' target (default: each seed's baseline final loss)."""
    from .evaluation.columns import add_eval_columns

    table = build_table(study, target_loss)
    add_eval_columns(table, folder)
    text = render(table, fmt)
    path = folder / f"table.{EXT[fmt]}"
    write_text(path, text)
    return text, [path, *save_plots(table, folder)]


def _measures(table: StudyTable) -> list[tuple[str, str]]:
    """(loss column, what it is) for each equal point the table has."""
    out = [("loss_at_steps", f"at {int(table.at_step)} steps"), ("loss_at_time", f"at {_fmt_time(table.at_seconds)}")]
    if table.at_flops is not None:
        out.append(("loss_at_flops", f"at {format_flops(table.at_flops)}"))
    return out


def _ranked(table: StudyTable, col: str) -> list[dict[str, Any]]:
    return sorted((r for r in table.rows if col in r and not r.get("start")), key=lambda r: r[col][0])


def verdicts(tables: list[StudyTable]) -> str:
    """When a study ran under several budgets: the arms ranked by each measure of each, one line each."""
    lines = []
    for t in tables:
        for col, what in _measures(t):
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
        label = dict(_measures(t)).get(col)
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
