"""Arm against arm in a finished study, seed by seed, and how many seeds would decide it: the figures
docs/results/README.md quotes beside the export's tables (which compare every arm with the baseline only).

    python benchmarks/compare_arms.py heads --budget wallclock --output STUDY_DIR mhar-h8@attnres mhar-h4@baseline

For each ``A@B`` (arm labels as the export shows them): the per-seed differences A - B, their mean and 95 %
t-interval at the study's equal-steps and equal-time points (the export's: the fewest steps and seconds any
run reached) and in final-set loss, and n* two ways: the fewest seeds at which an interval with this mean and
standard deviation would exclude zero, and the fewest at which a paired t-test would find a true difference
of this size with 80 % power. ``--reruns NAME=DIR ...`` instead lists, per seed, the final-set
loss of ``--arm`` in each of several studies (the same arm and seed trained again) and their spread:

    python benchmarks/compare_arms.py --budget steps --reruns heads=DIR1 budget=DIR2 baselines=DIR3

Whether a gap lasts, and whether the curves have flattened: ``--along steps`` (or ``seconds``) gives each pair's
gap at every evaluation point with its interval, and how it moved over the last ``--last`` fraction of the run
(default 0.2), paired by seed; ``--plot FILE.png`` draws those gaps. ``--falls`` gives each arm's loss fall
over that last fraction (its seeds' mean and range, and per 1,000 steps):

    python benchmarks/compare_arms.py heads --budget steps --output STUDY_DIR --along steps --plot gaps.png mhar-h4@baseline
    python benchmarks/compare_arms.py heads --budget steps --output STUDY_DIR --falls

(How to read them, and their limits under an annealing schedule: ``mhar_ablate/reporting/gaps.py``.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mhar_ablate.errors import UsageError
from mhar_ablate.reporting.gaps import AXES, Gap, gap_along, loss_falls, paired_runs
from mhar_ablate.reporting.plots import save_gap_plot
from mhar_ablate.reporting.statistics import mean_interval, seeds_for_power, seeds_to_exclude_zero
from mhar_ablate.reporting.table import build_table, collect, interpolate
from mhar_ablate.sweep.catalog import load_studies


def _bounds(m: float, h: float, n: int) -> str:
    return f"[{m - h:+.4f}, {m + h:+.4f}]" if n > 1 else "(one seed)"


def _interval(diffs: list[float]) -> str:
    m, h, n = mean_interval(diffs)
    return f"{m:+.4f} {_bounds(m, h, n)}"


def compare(trials: dict, a: str, b: str, at_step: float, at_seconds: float) -> list[str]:
    pairs = paired_runs(trials, a, b)
    if not pairs:
        return [f"{a} - {b}: no seed finished in both"]
    measures = {f"{at_step:.0f} steps": [interpolate(x.curve, 0, at_step) - interpolate(y.curve, 0, at_step) for x, y in pairs],
                f"{at_seconds:.1f} s": [interpolate(x.curve, 1, at_seconds) - interpolate(y.curve, 1, at_seconds)
                                        for x, y in pairs]}
    if all(x.final_loss is not None and y.final_loss is not None for x, y in pairs):
        measures["final-set"] = [x.final_loss - y.final_loss for x, y in pairs]
    lines = [f"{a} - {b}, seeds {', '.join(str(x.seed) for x, _ in pairs)}:"]
    for name, diffs in measures.items():
        m, h, n = mean_interval(diffs)
        ci = _bounds(m, h, n)
        if n < 2 or m == 0:  # no spread to scale by, or no effect to find: n* does not exist
            seeds = "n* unknown (one seed: no spread yet)" if n < 2 else "n* none (mean difference 0)"
        else:
            need, power = seeds_to_exclude_zero(diffs), seeds_for_power(diffs)
            seeds = f"n* {need or '>1000'} (interval), {power or '>1000'} (80 % power)"
        lines.append(f"  {name:>12}: per seed {', '.join(f'{d:+.4f}' for d in diffs)}; mean {m:+.4f} {ci}; {seeds}")
    return lines


def along(gap: Gap | None, a: str, b: str, last: float) -> list[str]:
    """Lines of the gap A - B at every evaluation point, and of how it moved over the ``last`` fraction."""
    if gap is None:
        return [f"{a} - {b}: no seed finished in both"]
    steps = gap.axis == 0
    where = (lambda x: f"step {x:.0f}") if steps else (lambda x: f"{x:.1f} s")
    lines = [f"{a} - {b} along the {'steps' if steps else 'seconds'}, seeds {', '.join(map(str, gap.seeds))}:"]
    lines += [f"  {where(x):>12}: {_interval(d)}" for x, d in gap.points]
    end = gap.points[-1][0]
    lines.append(f"  the gap moved by {_interval(gap.moved(last))} from {where(end * (1 - last))} to {where(end)} "
                 f"(positive: {a} fell less)")
    return lines


def falls(trials: dict, last: float) -> list[str]:
    return [f"{f.arm}: fell {f.mean:.4f} (runs {min(f.drops):.4f} to {max(f.drops):.4f}, n {len(f.drops)}) over the last "
            f"{last:.0%} of its steps, {f.per_1000_steps:.4f} per 1,000 steps" for f in loss_falls(trials, last)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", help="the study (studies/NAME.yaml)")
    p.add_argument("--budget", required=True)
    p.add_argument("--output", type=Path, help="the folder the study trained into")
    p.add_argument("pairs", nargs="*", metavar="A@B")
    p.add_argument("--reruns", nargs="+", metavar="NAME=DIR", help="studies (name and folder) holding the same arm")
    p.add_argument("--arm", default="baseline", help="with --reruns: the arm to compare (default baseline)")
    p.add_argument("--along", choices=sorted(AXES), help="each pair's gap at every evaluation point instead")
    p.add_argument("--falls", action="store_true", help="each arm's loss fall over the last fraction of its steps")
    p.add_argument("--last", type=float, default=0.2, help="the fraction --along and --falls look back over (default 0.2)")
    p.add_argument("--plot", type=Path, help="with --along: draw the gaps into this PNG")
    args = p.parse_intermixed_args(argv)
    try:
        if args.reruns:
            finals: dict[int, list[float]] = {}
            for spec in args.reruns:
                name, sep, folder = spec.partition("=")
                if not sep:
                    raise UsageError(f"--reruns takes NAME=DIR, got {spec!r}")
                (study,) = load_studies(Path(folder), name, args.budget, None)
                for t in collect(study)[0].get(args.arm, []):
                    if t.usable and t.final_loss is not None:
                        finals.setdefault(t.seed, []).append(t.final_loss)
            for seed, losses in sorted(finals.items()):
                print(f"{args.arm} s{seed}: final-set loss {', '.join(f'{v:.4f}' for v in losses)}; "
                      f"spread {max(losses) - min(losses):.4f}")
            return 0
        if not 0.0 < args.last < 1.0:
            raise UsageError(f"--last is a fraction between 0 and 1, got {args.last}")
        if args.plot is not None and args.along is None:
            raise UsageError("--plot draws the gaps of --along: give --along steps or --along seconds")
        if args.name is None or args.output is None or not (args.pairs or args.falls):
            raise UsageError("give NAME, --output and at least one A@B pair or --falls (or --reruns NAME=DIR ...)")
        pairs = []
        for pair in args.pairs:
            a, sep, b = pair.partition("@")
            if not sep or not a or not b:
                raise UsageError(f"pairs are A@B (arm labels), got {pair!r}")
            pairs.append((a, b))
        (study,) = load_studies(args.output, args.name, args.budget, None)
        table = build_table(study)  # its trials and equal points, exactly as the export has them
        if args.falls:
            print("\n".join(falls(table.trials, args.last)))
        gaps = []
        for a, b in pairs:
            if args.along:
                gap = gap_along(table.trials, a, b, AXES[args.along])
                gaps += [gap] if gap else []
                print("\n".join(along(gap, a, b, args.last)))
            else:
                print("\n".join(compare(table.trials, a, b, table.at_step, table.at_seconds)))
        if args.plot is not None:
            if not gaps:
                raise UsageError("no pair has a seed finished in both arms: nothing to draw")
            path = save_gap_plot(gaps, args.plot, f"{args.name} ({args.budget} budget): gaps along the {args.along}")
            print(f"gaps drawn into {path}")
    except UsageError as e:
        print(f"compare_arms: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
