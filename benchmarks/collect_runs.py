"""Per-run figures of a study folder as JSON on stdout, with each arm's throughput spread over its seeds:
the numbers docs/benchmarks.md quotes beside a study's table.
usage: python benchmarks/collect_runs.py OUTPUT/studies/NAME/BUDGET"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = ("arm", "seed", "status", "step", "seconds", "tokens_per_s", "peak_mem_gb", "reserved_gb", "cuda_graph", "compiled",
        "prepare_seconds", "eval_seconds", "checkpoint_seconds", "final_val_loss", "device", "wall_seconds")


def main(folder: str) -> None:
    runs = []
    for path in sorted(Path(folder).glob("*/result.json")):
        r = json.loads(path.read_text())
        runs.append({k: r.get(k) for k in KEYS})
    arms: dict[str, list[float]] = {}
    for r in runs:
        if r["tokens_per_s"]:
            arms.setdefault(r["arm"], []).append(r["tokens_per_s"])
    spread = {arm: {"min": min(v), "max": max(v), "spread_pct": 100 * (max(v) - min(v)) / min(v)}
              for arm, v in arms.items()}
    print(json.dumps({"runs": runs, "throughput_spread": spread}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
