"""A study's downstream results as export columns: for every task metric that the study's runs were
evaluated on (``RUN/eval/*.json``, written by ``mhar-ablate eval``), the mean ± std over the seeds of
each arm. Reads JSON only: exporting needs neither lm-eval nor the weights.

One column per (task, metric, shots, limit): results under other few-shot counts or example limits are
other measures and are not averaged together. Where a run holds several results for one column, the
latest evaluation counts.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from .table import ExtraColumn, StudyTable
from ..evaluation.tasks import EVAL_DIR, metric_rows


def run_dir_of(folder: Path, arm: str, seed: int) -> Path:
    """A grid point's run folder inside a study's budget folder (``StudyRun.run_dir``)."""
    return folder / f"{arm.replace(':', '')}-s{seed}"


def read_eval_files(run_dir: Path) -> list[dict[str, Any]]:
    """Every readable eval file of a run, oldest evaluation first (an unreadable one is skipped)."""
    found = []
    for path in sorted((run_dir / EVAL_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("harness"), dict):
            found.append(data)
    return sorted(found, key=lambda d: float(d.get("evaluated_at") or 0.0))


def run_metrics(run_dir: Path) -> dict[tuple[str, str, int, Any], tuple[float, bool | None]]:
    """(task, metric, shots, limit) -> (value, higher is better) for one run, latest evaluation winning."""
    out: dict[tuple[str, str, int, Any], tuple[float, bool | None]] = {}
    for data in read_eval_files(run_dir):
        shots = data["harness"].get("n-shot") or {}
        limit = (data.get("settings") or {}).get("limit")
        for r in metric_rows(data):
            out[(r["task"], r["metric"], int(shots.get(r["task"]) or 0), limit)] = (r["value"], r["higher_is_better"])
    return out


def _header(task: str, metric: str, shots: int, limit: Any) -> str:
    return f"{task} {metric}" + (f" {shots}-shot" if shots else "") + (f" (limit {limit})" if limit is not None else "")


def add_eval_columns(table: StudyTable, folder: Path) -> StudyTable:
    """Append one column per evaluated task metric to ``table`` (whose runs live under ``folder``)."""
    per_arm: dict[tuple, dict[str, list[float]]] = {}
    direction: dict[tuple, bool | None] = {}
    for arm, trials in table.trials.items():
        for t in trials:
            if not t.usable:
                continue
            for key, (value, hib) in run_metrics(run_dir_of(folder, arm, t.seed)).items():
                per_arm.setdefault(key, {}).setdefault(arm, []).append(value)
                direction[key] = hib
    for key in sorted(per_arm, key=lambda k: (k[0], k[1], k[2], str(k[3]))):
        values = {arm: (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs))
                  for arm, xs in per_arm[key].items()}
        header = _header(*key)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", header).strip("_").lower()
        table.extra.append(ExtraColumn(header, f"eval_{slug}", values, direction[key]))
    return table
