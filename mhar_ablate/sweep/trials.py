"""What a finished trial leaves behind: its result as trial attributes (so any Optuna storage carries what
the export needs), its pruning reports, and its checkpoints removed once the result is recorded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from ..config import RunConfig
from ..errors import UsageError
from .definition import StudyRun
from .points import arm_seed


DONE_STATES = ("COMPLETE", "PRUNED")

# What training writes into a run folder through io's atomic writes (training/run.py): only the process
# training the run writes them.
TRAINED_FILES = ("result.json", "config.yaml", "routing.png")


def drop_checkpoints(run_dir: Path) -> None:
    """A finished run's checkpoints: its result is recorded, and only resuming needs them. Its trained
    weights stay, as ``weights.safetensors`` (``training/checkpoint.py``), for `eval` and later analyses."""
    from ..training.checkpoint import FINAL_WEIGHTS, save_final_weights

    if not (run_dir / FINAL_WEIGHTS).is_file():
        try:
            save_final_weights(run_dir)
        except UsageError:  # an unreadable checkpoint has no weights to keep; the result is recorded already
            pass
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def drop_finished_checkpoints(sr: StudyRun, study) -> None:
    """Checkpoints of finished trials that a kill left behind (between the result and their removal);
    a trial run with ``keep_checkpoints`` keeps its own."""
    for t in study.get_trials(deepcopy=False):
        point = arm_seed(t)
        if t.state.name in DONE_STATES and t.user_attrs.get("keep_checkpoints") is False and point:
            drop_checkpoints(sr.run_dir(*point))


def record_result(trial, result: dict[str, Any]) -> None:
    """Everything the export needs, as trial attributes (so any Optuna storage carries it)."""
    curve = [[p["step"], p["seconds"], p["tokens"], p["val_loss"]] for p in result["curve"]]
    attrs = {
        "status": result["status"], "reason": result["reason"],
        "final_val_loss": result["final_val_loss"], "final_step": result["step"], "final_seconds": result["seconds"],
        "curve": curve, "tokens_per_s": result["tokens_per_s"], "peak_mem_gb": result["peak_mem_gb"],
        "params": result["params"], "baseline_params": result["baseline_params"],
        "flops_per_token": result.get("flops_per_token"),
        "param_overhead_pct": result["param_overhead_pct"], "device": result["device"],
        "routing_backend": result["routing_backend"], "environment": result.get("environment"),
        # The warm-up kept off the clock, and the early steps against the median one (the export warns
        # when a run's first steps were far slower: its time columns are then suspect).
        "warmup_seconds": result.get("warmup_seconds"),
        **{f"timing_{k}": v for k, v in (result.get("step_timing") or {}).items()},
    }
    attrs.update(_final_eval_attrs(result.get("final_eval")))
    for k, v in attrs.items():
        trial.set_user_attr(k, _finite_or_str(v))


def _final_eval_attrs(final: dict[str, Any] | None) -> dict[str, Any]:
    """The final evaluation's numbers as trial attributes (``final_eval_*``); its per-sequence losses too,
    so that the export can take the evaluation's noise out of paired differences between arms."""
    if not final:
        return {}
    out = {f"final_eval_{k}": final.get(k) for k in ("loss", "se", "sequences", "tokens", "seconds", "asked")}
    out["final_eval_losses"] = final.get("sequence_losses")
    return out


def _finite_or_str(v: Any) -> Any:
    """JSON (and so Optuna's storage) has no NaN or infinity: keep them as strings."""
    import math

    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_finite_or_str(x) for x in v]
    return v


def pruning_reporter(trial, budget: str, cfg: RunConfig | None = None) -> Callable[[int, float, float], bool]:
    """Report at the global step (step budgets), at whole training seconds (wall-clock budgets) or, under
    a FLOPs budget (where arms train different step counts), at the nominal point of the evaluation in
    per mille of the budget: the k-th of ``train.eval_every`` evaluations is at 1000·k/eval_every for every
    arm (``cfg``: the run's config, its ``train.steps`` resolved). Optuna's stock Lightning callback
    reports per epoch, which means nothing here."""
    seen: set[int] = set()

    def at_point(step: int, seconds: float) -> int:
        if budget == "flops":
            every = cfg.train.eval_every
            return 1000 * min(step * every // cfg.train.steps, every) // every
        return step if budget == "steps" else int(seconds)

    def report(step: int, seconds: float, loss: float) -> bool:
        at = at_point(step, seconds)
        if at in seen or at == 0:
            return False
        seen.add(at)
        trial.report(loss, at)
        return trial.should_prune()

    return report

