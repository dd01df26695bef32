"""Steps and training time to a target loss, and the speed-up over the baseline arm they give: the
direct answer to "is it worth it per hour?".

Each run's (step, seconds, validation loss) curve is read for the first point where the loss reaches the
target, linearly between the two evaluations around it (on steps and on training seconds alike). A run
whose curve never gets there is *not reached*: nothing is extrapolated past its last evaluation.

The target is, by default, **the baseline's final validation loss of the same seed** (arms are paired by
seed, as the table's Δ columns are: same data order, same initial sublayers), so the baseline's own time
to target is its budget and every arm answers "how long until it is as good as the baseline ended?". One
mean over the baseline's seeds would not do: the baseline seeds that end above their mean never reach it.
A loss the user names (``export --target-loss``) is one target for every run.

Speed-up of an arm = baseline's steps (seconds) to target / the arm's, per seed where both reached it;
over seeds, their geometric mean with a 95 % Student-t interval on the logarithms (ratios multiply: a
2× speed-up and a 2× slow-down average to 1×, which an arithmetic mean of ratios would not give).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def crossing(curve: Sequence[Sequence[float]], target: float) -> tuple[float, float] | None:
    """(steps, training seconds) where ``curve`` (rows of step, seconds, tokens, loss) first reaches
    ``target``, interpolated linearly between evaluations; None when it never does."""
    previous = None
    for point in curve:
        step, seconds, loss = float(point[0]), float(point[1]), float(point[3])
        if math.isfinite(loss) and loss <= target:
            if previous is None:
                return step, seconds
            s0, t0, l0 = previous
            f = (l0 - target) / (l0 - loss) if l0 != loss else 1.0
            return s0 + f * (step - s0), t0 + f * (seconds - t0)
        previous = (step, seconds, loss) if math.isfinite(loss) else previous
    return None


def speedup(ratios: Sequence[float], t95) -> tuple[float, float, float, int] | None:
    """(geometric mean, lower, upper, n) of per-seed speed-ups; the bounds are nan for one seed."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    if not logs:
        return None
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), math.nan, math.nan, 1
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half), len(logs)


def to_target(trials: dict[str, list[Any]], baseline: str | None, target: float | None, t95) -> tuple[dict[str, dict], dict]:
    """Per arm: ``target_runs`` (runs that have a target), ``target_reached``, ``steps_to_target`` and
    ``seconds_to_target`` (means over the runs that reached it; None when none did), and
    ``speedup_steps`` / ``speedup_time`` (``speedup``'s tuples, or None). Also a description of the
    target: ``{"kind": "baseline" | "loss", "loss": the mean target, "per_seed": {seed: loss}}``.

    ``trials`` maps each arm to its usable runs (``seed`` and ``curve`` attributes); ``target`` None:
    each seed's baseline final loss, which needs a baseline arm (without one, nothing is computed)."""
    base_runs = {t.seed: t for t in trials.get(baseline or "", [])} if baseline else {}
    if target is None:
        per_seed = {s: float(t.curve[-1][3]) for s, t in base_runs.items()}
        about = {"kind": "baseline", "loss": statistics.fmean(per_seed.values()) if per_seed else None,
                 "per_seed": per_seed}
    else:
        per_seed = None
        about = {"kind": "loss", "loss": float(target), "per_seed": {}}
    if target is None and not per_seed:
        return {}, about

    def goal(seed: int) -> float | None:
        return per_seed.get(seed) if per_seed is not None else float(target)

    base_hits = {s: crossing(t.curve, goal(s)) for s, t in base_runs.items() if goal(s) is not None}
    out: dict[str, dict] = {}
    for arm, runs in trials.items():
        hits = {t.seed: crossing(t.curve, goal(t.seed)) for t in runs if goal(t.seed) is not None}
        reached = [h for h in hits.values() if h is not None]
        row: dict[str, Any] = {"target_runs": len(hits), "target_reached": len(reached),
                               "steps_to_target": statistics.fmean(h[0] for h in reached) if reached else None,
                               "seconds_to_target": statistics.fmean(h[1] for h in reached) if reached else None,
                               "speedup_steps": None, "speedup_time": None}
        if baseline and arm != baseline:
            pairs = [(base_hits[s], h) for s, h in hits.items() if h is not None and base_hits.get(s) is not None]
            for key, axis in (("speedup_steps", 0), ("speedup_time", 1)):
                ratios = [b[axis] / a[axis] for b, a in pairs if a[axis] > 0 and b[axis] > 0]
                row[key] = speedup(ratios, t95)
        out[arm] = row
    return out, about
