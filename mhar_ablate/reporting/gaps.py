"""Whether a difference lasts: the paired gap between two arms at every evaluation point of their runs, how
it moved over the end of the runs, and how far each arm's loss still falls there.

A gap at one point (the table's equal steps) cannot say whether it is closing. Along the run it can: the
gap of arm A over arm B at each evaluation point, paired by seed, with its 95 % t-interval, and the change
of each seed's gap over the last fraction of the run. Under a cosine or WSD schedule that last fraction is
where the learning rate anneals, so a fall there is partly the anneal's, and the gap at step k of an N-step
run is not the gap a k-step run would end with: only runs of several lengths show where a final loss stops
improving.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..errors import UsageError
from .statistics import mean_interval
from .table import TrialData, interpolate

AXES = {"steps": 0, "seconds": 1}


def paired_runs(trials: dict[str, list[TrialData]], a: str, b: str) -> list[tuple[TrialData, TrialData]]:
    """(A's run, B's run) for every seed that finished in both arms, in A's order."""
    for arm in (a, b):
        if arm not in trials:
            raise UsageError(f"no arm {arm!r} in this study (arms: {', '.join(trials)})")
    base = {t.seed: t for t in trials[b] if t.usable}
    return [(t, base[t.seed]) for t in trials[a] if t.usable and t.seed in base]


@dataclass
class Gap:
    """A - B along one axis (0 = steps, 1 = seconds): per point, the per-seed gaps."""

    a: str
    b: str
    axis: int
    seeds: list[int]
    points: list[tuple[float, list[float]]]

    def series(self) -> list[tuple[float, float, float]]:
        """(x, mean, 95 % half-width; nan for one seed) per point."""
        return [(x, *mean_interval(d)[:2]) for x, d in self.points]

    def moved(self, last: float) -> list[float]:
        """Per seed, the gap at the end less the gap ``last`` of the range before it (positive: A fell less)."""
        end = self.points[-1][0]
        start = end * (1.0 - last)
        at = {x: d for x, d in self.points}
        if start not in at:
            at[start] = self._at(start)
        return [e - s for e, s in zip(at[end], at[start])]

    def _at(self, x: float) -> list[float]:
        xs = [p[0] for p in self.points]
        hi = next(i for i, v in enumerate(xs) if v >= x)
        if hi == 0 or xs[hi] == x:
            return list(self.points[hi][1])
        lo, f = hi - 1, (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1])
        return [u + (v - u) * f for u, v in zip(self.points[lo][1], self.points[hi][1])]


def gap_along(trials: dict[str, list[TrialData]], a: str, b: str, axis: int) -> Gap | None:
    """The gap A - B at every evaluation point of B's first paired run, up to the last point that every
    paired run reached (nothing extrapolated); None when no seed finished in both arms."""
    pairs = paired_runs(trials, a, b)
    if not pairs:
        return None
    end = min(min(x.curve[-1][axis], y.curve[-1][axis]) for x, y in pairs)
    xs = [p[axis] for p in pairs[0][1].curve if p[axis] <= end]
    if xs[-1] < end:
        xs.append(end)
    points = [(v, [interpolate(x.curve, axis, v) - interpolate(y.curve, axis, v) for x, y in pairs]) for v in xs]
    return Gap(a, b, axis, [x.seed for x, _ in pairs], points)


@dataclass
class Fall:
    """How far one arm's validation loss fell over the last fraction of its runs' steps."""

    arm: str
    drops: list[float]  # per run, in nats
    per_1000_steps: float  # the runs' mean fall over that stretch, per 1,000 steps

    @property
    def mean(self) -> float:
        return statistics.fmean(self.drops)


def loss_falls(trials: dict[str, list[TrialData]], last: float) -> list[Fall]:
    """Per arm with a finished run, its fall over the last ``last`` fraction of each run's steps."""
    out = []
    for arm, ts in trials.items():
        runs = [t for t in ts if t.usable and t.curve[-1][0] > 0]
        if not runs:
            continue
        drops, rates = [], []
        for t in runs:
            end = t.curve[-1][0]
            drop = interpolate(t.curve, 0, end * (1.0 - last)) - interpolate(t.curve, 0, end)
            drops.append(drop)
            rates.append(drop / (end * last) * 1000.0)
        out.append(Fall(arm, drops, statistics.fmean(rates)))
    return out
