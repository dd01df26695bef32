"""lm-evaluation-harness tasks on a trained run, offline: find the tasks, run the harness through
``RunLM``, and write ``RUN/eval/<tasks>.json``.

The harness's own tasks read their data through Hugging Face ``datasets``; nothing is downloaded here
(``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), so a task runs where its dataset is in the datasets or
Hub cache, or where its YAML points at local files (``dataset_path: json`` with ``dataset_kwargs:
data_files: ...``; ``--include DIR`` adds a folder of such YAMLs). A task whose data are not on the
machine is one line naming what is missing.

Indexing the harness's ~15,000 built-in task configs takes seconds, so names that an ``--include``
folder defines as plain tasks are resolved without it; anything else builds the full index.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError

INSTALL_HINT = "pip install 'mhar-ablate[eval]'"
EVAL_DIR = "eval"


def require_lm_eval():
    """The ``lm_eval`` package (imported offline), or one line saying how to install it."""
    go_offline()
    try:
        import lm_eval
    except ImportError:
        raise UsageError(f"lm-evaluation-harness (the lm-eval package) is not installed: {INSTALL_HINT}") from None
    return lm_eval


def go_offline() -> None:
    """No dataset or model hub at run time, also where ``datasets`` was imported before."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants as hub

        hub.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config as dc

        dc.HF_HUB_OFFLINE = dc.HF_DATASETS_OFFLINE = True


def quiet_harness() -> None:
    """The harness logs every step at INFO and advice meant for Hugging Face models at WARNING."""
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


def task_manager(names: list[str], include: list[Path]):
    """A ``TaskManager`` that knows every name in ``names``; one line for a name it does not know."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    for folder in include:
        if not folder.is_dir():
            raise UsageError(f"--include {folder}: no such folder")
    for n in names:
        if n.endswith((".yaml", ".yml")):  # lm-eval reads a path in the task list in some releases only
            raise UsageError(f"--tasks takes task names, not files ({n}): give the YAML's folder with --include "
                             "and the name under its task: key")
    wanted = list(names)
    if include:
        local = TaskManager(include_path=[str(f) for f in include] or None, include_defaults=False)
        plain = set(local.all_subtasks)  # tasks, not groups or tags (which may name the harness's tasks)
        if all(n in plain for n in wanted):
            return _Offline(local)
    full = TaskManager(include_path=[str(f) for f in include] or None)
    known = set(full.all_tasks)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], full.all_tasks, n=3)
        raise UsageError(f"unknown task {unknown[0]!r}: not an lm-eval task, group or tag"
                         + (f" (did you mean {', '.join(close)}?)" if close else "")
                         + "; --include DIR adds a folder of task YAMLs")
    return _Offline(full)


class _Offline:
    """A task manager whose loading (``load``; ``load_task_or_group`` before lm-eval 0.4.10) turns data
    that are not on this machine into one line."""

    LOADERS = ("load", "load_task_or_group")

    def __init__(self, manager):
        self.manager = manager

    def __getattr__(self, name):
        attr = getattr(self.manager, name)
        if name not in self.LOADERS:
            return attr

        def load(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except (ConnectionError, FileNotFoundError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise UsageError(f"task data not on this machine: {first}; eval runs offline: put the dataset in the "
                                 "Hugging Face datasets cache (HF_DATASETS_CACHE) or point a task YAML at local files "
                                 "(--include DIR)") from None

        return load


def results_name(tasks: list[str]) -> str:
    """``RUN/eval/<this>.json``: the tasks as given, joined with ``+``, safe as a file name."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(tasks))[:200]


def results_path(run_dir: Path, tasks: list[str]) -> Path:
    return run_dir / EVAL_DIR / f"{results_name(tasks)}.json"


def settings_of(tasks: list[str], include: list[Path], limit: int | None, num_fewshot: int | None,
                batch_size: int, bootstrap_iters: int) -> dict[str, Any]:
    """What changes an evaluation's numbers besides the weights: a rerun with these and the same
    weights finds its results already written."""
    return {"tasks": list(tasks), "include": [str(f.resolve()) for f in include], "limit": limit,
            "num_fewshot": num_fewshot, "bootstrap_iters": bootstrap_iters}


def already_done(path: Path, settings: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The results written at ``path`` for these settings and this step of the run, if any."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("settings") == settings and data.get("model", {}).get("step") == step:
        return data
    return None


def evaluate_run(run, tasks: list[str], manager, *, limit: int | None = None, num_fewshot: int | None = None,
                 batch_size: int = 16, bootstrap_iters: int = 1000, progress: bool = True,
                 include: list[Path] | None = None) -> dict[str, Any]:
    """The harness on ``run`` (a ``TrainedRun``): its results dict with what produced it."""
    lm_eval = require_lm_eval()
    quiet_harness()
    from lm_eval.utils import handle_non_serializable

    from ..provenance import environment
    from ..training.run import autocast_for
    from .harness import RunLM

    if not progress:
        import datasets

        datasets.disable_progress_bars()  # "Generating test split" and the like, on every task's load
    lm = RunLM(run, batch_size=batch_size, autocast=autocast_for(run.cfg) if run.model.embed.weight.is_cuda else None,
               progress=progress)
    started = time.time()
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters, log_samples=False)
    harness = json.loads(json.dumps(out, default=handle_non_serializable))
    return {
        "settings": settings_of(tasks, include or [], limit, num_fewshot, batch_size, bootstrap_iters),
        "model": run.describe(),
        "evaluated_at": time.time(),
        "seconds": time.time() - started,
        "lm_eval_version": lm_eval.__version__,
        "environment": environment(),
        "task_versions": harness.get("versions", {}),
        "harness": harness,  # the harness's own results dict: results, configs, versions, n-shot, n-samples, ...
    }


def metric_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """(task, metric, value, stderr, n) for every numeric metric in an eval file's harness results."""
    harness = data.get("harness", {})
    samples = harness.get("n-samples", {})
    rows = []
    for task, metrics in (harness.get("results") or {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")
            # Metrics are "name,filter"; the harness's other keys (alias, sample_len) have no filter.
            if not comma or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            name = metric if filt in ("", "none") else f"{metric} ({filt})"
            n = (samples.get(task) or {}).get("effective")
            rows.append({"task": task, "metric": name, "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": n,
                         "higher_is_better": (harness.get("higher_is_better", {}).get(task) or {}).get(metric)})
    return rows


def render_rows(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"### {title}", "", "| task | metric | value | ± stderr | n |", "|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['stderr']:.4f}" if r["stderr"] is not None else "–"
        lines.append(f"| {r['task']} | {r['metric']} | {r['value']:.4f} | {err} | {r['n'] if r['n'] is not None else '–'} |")
    return "\n".join(lines) + "\n"
