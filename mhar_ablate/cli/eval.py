"""``mhar-ablate eval``: lm-evaluation-harness tasks on one run folder, or on every finished run of a
study, each run's results written to ``RUN/eval/<tasks>.json``.

Everything that can be checked is checked before the first forward: lm-eval installed, the run or
study there, every task known, every run's weights present. A run already evaluated with the same
settings at the same step is not evaluated again (``force`` re-evaluates), so an interrupted study
evaluation continues where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError
from ..evaluation.tasks import already_done, evaluate_run, metric_rows, render_rows, require_lm_eval, results_path, settings_of, task_manager


@dataclass
class EvalOptions:
    tasks: list[str]
    include: list[Path] = field(default_factory=list)
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    bootstrap_iters: int = 1000
    device: str | None = None
    force: bool = False
    progress: bool = True

    def check(self) -> None:
        if not self.tasks:
            raise UsageError("--tasks names no task (give a comma-separated list, e.g. --tasks arc_easy,hellaswag)")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be at least 1, got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UsageError(f"--num-fewshot must be at least 0, got {self.num_fewshot}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")

    @property
    def settings(self) -> dict[str, Any]:
        return settings_of(self.tasks, self.include, self.limit, self.num_fewshot, self.batch_size, self.bootstrap_iters)


def parse_tasks(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def pick_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is visible")
    try:
        torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    return device


def _prepare(opts: EvalOptions):
    opts.check()
    require_lm_eval()
    return task_manager(opts.tasks, opts.include), pick_device(opts.device)


def eval_one(run_dir: Path, output: Path, opts: EvalOptions, manager, device: str,
             log: Callable[[str], None]) -> tuple[dict[str, Any], Path, bool]:
    """(eval data, its file, whether it was computed now) for one run folder."""
    from ..io import write_json
    from ..evaluation.trained import load_trained

    run = load_trained(run_dir, output / "cache", device)
    path = results_path(run_dir, opts.tasks)
    done = None if opts.force else already_done(path, opts.settings, run.step)
    if done is not None:
        log(f"{run_dir}: already evaluated at step {run.step} ({path.name}); --force evaluates again")
        return done, path, False
    if run.status != "completed":
        log(f"note: {run_dir} is {run.status}; evaluating its last checkpoint (step {run.step})")
    data = evaluate_run(run, opts.tasks, manager, limit=opts.limit, num_fewshot=opts.num_fewshot,
                        batch_size=opts.batch_size, bootstrap_iters=opts.bootstrap_iters, progress=opts.progress,
                        include=opts.include)
    write_json(path, data)
    return data, path, True


def eval_run_command(name: str, output: Path, opts: EvalOptions, log: Callable[[str], None] = print) -> int:
    from ..training.run import find_run

    from ..evaluation.trained import require_weights

    run_dir = find_run(output, name)
    require_weights(run_dir)
    manager, device = _prepare(opts)
    data, path, _ = eval_one(run_dir, output, opts, manager, device, _stderr)
    m = data["model"]
    log(render_rows(metric_rows(data), f"{m['arm']} seed {m['seed']}, step {m['step']}: {', '.join(opts.tasks)}"))
    _stderr(f"written: {path}")
    return 0


def eval_study_command(name: str, output: Path, opts: EvalOptions, budget: str | None, storage: str | None,
                       log: Callable[[str], None] = print) -> int:
    from ..reporting.table import build_table
    from ..reporting.render import render
    from ..sweep.catalog import load_studies, study_folder
    from ..training.checkpoint import CHECKPOINT, FINAL_WEIGHTS
    from ..reporting.eval_columns import add_eval_columns, run_dir_of

    studies = load_studies(output, Path(name).stem, budget, storage)
    plans = []
    for study in studies:
        table = build_table(study)
        folder = study_folder(output, study, name)
        runs = [run_dir_of(folder, arm, t.seed) for arm, ts in table.trials.items() for t in ts if t.usable]
        plans.append((study, table, folder, runs))
    runs = [r for _, _, _, rs in plans for r in rs]
    bare = [r for r in runs if not (r / CHECKPOINT).is_file() and not (r / FINAL_WEIGHTS).is_file()]
    if bare:
        raise UsageError(f"{len(bare)} of the {len(runs)} finished runs of study {Path(name).stem!r} have no weights to "
                         f"evaluate (e.g. {bare[0]}): studies run before this version kept no weights of finished "
                         "trials unless run with --keep-checkpoints, so train it again into a new --output folder")
    manager, device = _prepare(opts)
    for i, run_dir in enumerate(runs, 1):
        _stderr(f"[{i}/{len(runs)}] {run_dir.relative_to(output) if run_dir.is_relative_to(output) else run_dir}")
        eval_one(run_dir, output, opts, manager, device, _stderr)
    for study, table, folder, _ in plans:
        add_eval_columns(table, folder)
        log(render(table, "md"))
    _stderr(f"each run's results: RUN/eval/{results_path(Path('.'), opts.tasks).name}; "
            f"the export shows them too: mhar-ablate export {Path(name).stem}")
    return 0


def _stderr(msg: str) -> None:
    # Above a harness progress bar, never onto it; nothing under --quiet (the tables are the result).
    from ..console import note

    note(msg)
