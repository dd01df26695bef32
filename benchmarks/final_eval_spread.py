"""How large must the final evaluation set be? Trains two arms of one seed at a preset, evaluates each on
every window of a large held-out part, and prints the standard error of one run's loss and of the
difference between the two runs at several set sizes, with the evaluation's time.

The default corpus's 1 % held-out part holds only 614 windows at ``small`` (seq_len 512): here the held
out part is ``--val-fraction`` (default 0.2: 6.3M tokens of the stdlib corpus, 12k windows), which is
enough to measure the per-sequence spread; the arms train on the rest.

Standard errors (training/final_eval.py): "iid" treats sequences as independent (what result.json
records); "blocked K" takes means of K neighbouring sequences as the unit, which also counts the
correlation between neighbours of one document (at n = all windows, neighbours are adjacent; a smaller
set spread evenly over the part has its sequences further apart).

Usage (the package on PYTHONPATH):
    python benchmarks/final_eval_spread.py --out $OUT                       # small, 60 s a run (GPU: ~4 min)
    python benchmarks/final_eval_spread.py --out /tmp/x --preset tiny --time 20   # a CPU check
The table is printed last; everything is also in $OUT/final_eval_spread.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

ARMS = {"baseline": ["residual.kind=baseline"], "mhar-h4": ["residual.kind=mhar", "residual.heads=4"]}


def blocked_se(values: list[float], k: int) -> float:
    m = len(values) // k
    if m < 2:
        return math.nan
    means = [statistics.fmean(values[i * k:(i + 1) * k]) for i in range(m)]
    return statistics.stdev(means) / math.sqrt(m)


def evenly(values: list[float], n: int) -> list[float]:
    """``n`` of the values spread evenly, as the final set picks windows (data/sampling.py)."""
    if n >= len(values):
        return values
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--time", type=float, default=60.0, help="training seconds per arm")
    ap.add_argument("--val-fraction", type=float, default=0.2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from mhar_ablate.config import build_config, parse_overrides
    from mhar_ablate.training.run import quiet_lightning, train_run

    quiet_lightning()
    losses, info = {}, {}
    for arm, over in ARMS.items():
        cfg = build_config(overrides=parse_overrides([
            f"model.preset={args.preset}", *over, "train.budget=wallclock", f"train.time={args.time}",
            f"data.val_fraction={args.val_fraction}", "data.final_sequences=1000000000", "seed=0"]))
        t0 = time.perf_counter()
        result = train_run(cfg, out / "runs" / arm, out / "cache", log=print, title=f"{arm}: ")
        fe = result["final_eval"]
        losses[arm] = fe["sequence_losses"]
        info[arm] = {"steps": result["step"], "train_seconds": result["seconds"], "final_val_loss": result["final_val_loss"],
                     "eval_seconds": fe["seconds"], "sequences": fe["sequences"], "tokens": fe["tokens"],
                     "eval_tokens_per_s": fe["tokens"] / fe["seconds"], "wall": time.perf_counter() - t0,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    a, b = losses["mhar-h4"], losses["baseline"]
    diff = [x - y for x, y in zip(a, b)]
    rows = []
    total = len(b)
    for n in sorted({64, 512, 2048, 4096, 8192, 16384, total}):
        if n > total:
            continue
        sb, sd = evenly(b, n), evenly(diff, n)
        rows.append({"n": n, "tokens": n * int(info["baseline"]["tokens"] / total),
                     "se_run_iid": statistics.stdev(sb) / math.sqrt(n), "se_run_blocked16": blocked_se(sb, 16),
                     "se_diff_iid": statistics.stdev(sd) / math.sqrt(n), "se_diff_blocked16": blocked_se(sd, 16),
                     "eval_seconds_baseline": info["baseline"]["eval_seconds"] * n / total})
    summary = {"preset": args.preset, "arms": info, "per_sequence_std_baseline": statistics.stdev(b),
               "per_sequence_std_diff": statistics.stdev(diff), "mean_diff": statistics.fmean(diff), "rows": rows}
    (out / "final_eval_spread.json").write_text(json.dumps(summary, indent=2))
    print()
    for arm, i in info.items():
        print(f"{arm}: {i['steps']} steps in {i['train_seconds']:.1f} s, final-set loss on {i['sequences']:,} sequences "
              f"in {i['eval_seconds']:.1f} s ({i['eval_tokens_per_s']:,.0f} tokens/s) on {i['device']}")
    print(f"per-sequence std: baseline {summary['per_sequence_std_baseline']:.4f}, mhar-h4 - baseline "
          f"{summary['per_sequence_std_diff']:.4f} (mean difference {summary['mean_diff']:+.4f})")
    print()
    print("| sequences | tokens | SE run (iid) | SE run (blocked 16) | SE Δ (iid) | SE Δ (blocked 16) | eval s (baseline) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']:,} | {r['tokens']:,} | {r['se_run_iid']:.4f} | {r['se_run_blocked16']:.4f} | "
              f"{r['se_diff_iid']:.4f} | {r['se_diff_blocked16']:.4f} | {r['eval_seconds_baseline']:.1f} |")


if __name__ == "__main__":
    main()
