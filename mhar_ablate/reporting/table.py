"""A study's ablation table as data: one row per arm.

Validation loss at equal steps (the largest step every arm reached), at equal training time (the largest
training time every arm reached) and at equal training FLOPs (the most FLOPs every arm spent, by
model/flops.py's count), mean ± std over seeds with n; the paired difference to the baseline arm with a
95 % t-interval over seeds; throughput relative to the baseline; peak memory; parameter overhead.
Diverged trials are counted but left out of the equal points (their curves end early).

Beside it, the final evaluation on the large fixed held-out set (training/final_eval.py) with its standard
errors, and steps and time to a target loss with the speed-up over the baseline (``to_target.py``); runs
recorded before the final evaluation show –.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..config import format_flops
from ..errors import UsageError
from ..sweep.points import arm_seed
from .statistics import mean_interval, mean_std, t95

START_ROW = "start (source checkpoint)"



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
    # The run's first timed steps' mean length over its median step's (training/budget.py); None: not recorded.
    early_ratio: float | None = None

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
    # Timing a reader should not trust (``timing_warnings``): one sentence each, printed under the table.
    warnings: list[str] = field(default_factory=list)


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
        key = arm_seed(t)
        if key is None:
            continue
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
                                         per_token, **_final_fields(u), early_ratio=_num(u.get("timing_early_ratio"))))
    return by_arm, missing


FLOPS_AXIS = 4  # a curve point's training FLOPs


def _final_fields(u: dict[str, Any]) -> dict[str, Any]:
    """A trial's final evaluation (``final_eval_*`` attributes, sweep/trials.py); empty for an older trial."""
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


def _paired(arm: list[TrialData], base: list[TrialData], axis: int, x: float) -> tuple[float, float, int] | None:
    """Mean paired difference (arm - baseline) over shared seeds, with the 95 % CI half-width."""
    b = {t.seed: t for t in base if t.usable}
    diffs = [interpolate(t.curve, axis, x) - interpolate(b[t.seed].curve, axis, x) for t in arm if t.usable and t.seed in b]
    return mean_interval(diffs) if diffs else None


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
            row["loss_at_steps"] = mean_std([interpolate(t.curve, 0, at_step) for t in ok])
            row["loss_at_time"] = mean_std([interpolate(t.curve, 1, at_seconds) for t in ok])
            if at_flops is not None:
                row["loss_at_flops"] = mean_std([interpolate(t.curve, FLOPS_AXIS, at_flops) for t in ok])
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
        start = mean_std([float(v) for v in source.values()])
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
                      attrs.get("curve"), ", ".join(devices), note, shared, at_flops, target=target,
                      warnings=timing_warnings(rows, trials, base_name))


# An arm's speed relative to the baseline this many times away from the other arms' (or, alone, from the
# baseline's own 1.0) is more likely a measurement fault (a loaded machine, a one-time cost) than the arm.
RATIO_APART = 3.0
# A run whose first timed steps averaged this many median steps: its clock holds a one-time cost.
EARLY_RATIO = 3.0
SPEED_MEASURES = (("throughput_vs_baseline", "throughput vs baseline"), ("speedup_time", "speed-up (time)"))


def timing_warnings(rows: list[dict[str, Any]], trials: dict[str, list[TrialData]], base_name: str | None) -> list[str]:
    """Sentences about timing that looks implausible, also set on each row concerned (``timing_warning``):
    an arm whose throughput ratio or time speed-up is more than ``RATIO_APART`` times away from the median
    of the arms' (its own with two others or more; the other arm's with one; 1.0, the baseline's own, alone), and a run whose first timed
    steps took more than ``EARLY_RATIO`` times its median step."""
    out: list[str] = []
    by_arm: dict[str, list[str]] = {}
    contestants = [r for r in rows if not r.get("start") and r["arm"] != base_name]
    for key, label in SPEED_MEASURES:
        values = {r["arm"]: _ratio(r.get(key)) for r in contestants}
        values = {a: v for a, v in values.items() if v}
        for arm, v in values.items():
            others = [x for a, x in values.items() if a != arm]
            # With two others or more the arm's own value joins them, so that one outlier among three arms
            # cannot drag the median away from the two that agree; alone, it is held against 1.0.
            ref = statistics.median(others + [v] if len(others) >= 2 else others or [1.0])
            apart = max(v / ref, ref / v)
            if apart > RATIO_APART:
                text = (f"{arm}: {label} {v:.2f}× is {apart:.1f}× away from the other arms' "
                        f"{'median ' if others else ''}{ref:.2f}×; check the runs' timing (a loaded machine, a one-time cost)")
                out.append(text)
                by_arm.setdefault(arm, []).append(text)
    for arm, ts in trials.items():
        for t in ts:
            if t.usable and t.early_ratio is not None and t.early_ratio > EARLY_RATIO:
                text = (f"{arm} seed {t.seed}: its first timed steps took {t.early_ratio:.1f}× its median step, so its "
                        "training time holds a one-time cost")
                out.append(text)
                by_arm.setdefault(arm, []).append(text)
    for r in rows:
        if r["arm"] in by_arm:
            r["timing_warning"] = "; ".join(by_arm[r["arm"]])
    return out


def _ratio(v: Any) -> float | None:
    """A speed measure's value: a float, or the mean of a (mean, lo, hi, n) tuple."""
    if isinstance(v, (tuple, list)):
        v = v[0] if v else None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _add_final_and_target(rows: list[dict[str, Any]], trials: dict[str, list[TrialData]], base_name: str | None,
                          target_loss: float | None) -> dict[str, Any]:
    """Each arm's final-set loss (mean ± std over seeds, ``final_loss``), its evaluation's standard error
    (root mean square of the runs' own, ``final_se``), the paired Δ to the baseline over seeds with its
    95 % t-interval (``delta_final``) and the evaluation's share of that Δ's noise (``delta_final_se``:
    per seed, the standard error of the per-sequence differences, root mean square over seeds); then the
    time-to-target columns (``to_target``). Returns the target's description."""
    from .to_target import to_target
    from ..training.final_eval import paired_se

    usable = {arm: [t for t in ts if t.usable] for arm, ts in trials.items()}
    base = {t.seed: t for t in usable.get(base_name or "", []) if t.final_loss is not None}
    rms = lambda xs: math.sqrt(statistics.fmean(x * x for x in xs)) if xs else None
    by_target, about = to_target(usable, base_name, target_loss, t95)
    for row in rows:
        ok = [t for t in usable.get(row["arm"], []) if t.final_loss is not None]
        if ok:
            row["final_n"] = len(ok)
            row["final_loss"] = mean_std([t.final_loss for t in ok])
            row["final_se"] = rms([t.final_se for t in ok if t.final_se is not None and math.isfinite(t.final_se)])
            row["final_sequences"] = min(t.final_sequences or 0 for t in ok)
            pairs = [(t, base[t.seed]) for t in ok if t.seed in base]
            if base_name and row["arm"] != base_name and pairs:
                row["delta_final"] = mean_interval([a.final_loss - b.final_loss for a, b in pairs])
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


def fmt_time(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else (f"{s / 60:.1f}min" if s < 7200 else f"{s / 3600:.2f}h")


def measures(table: StudyTable) -> list[tuple[str, str]]:
    """(loss column, what it is) for each equal point the table has."""
    out = [("loss_at_steps", f"at {int(table.at_step)} steps"), ("loss_at_time", f"at {fmt_time(table.at_seconds)}")]
    if table.at_flops is not None:
        out.append(("loss_at_flops", f"at {format_flops(table.at_flops)}"))
    return out

