"""A run's Lightning logger (``train.logger``: tensorboard, csv or wandb), its hyperparameters and tag names.

Every scalar goes through Lightning's logger API (``Logger.log_metrics`` / ``log_hyperparams``), so any of
the three loggers receives the same series. Tags, grouped so that TensorBoard (which sorts sections and
the tags within them alphabetically) opens with the loss:

==============================  ===========================================================================
``loss/train``                  training loss of each step (x: optimiser step)
``loss/train_smoothed``         the same, exponentially smoothed (0.9 per step)
``loss/val``                    validation loss at each evaluation
``optim/lr``, ``optim/grad_norm``  the learning rate each step used; its gradient norm before clipping
``perf/tokens_per_s``, ``perf/step_ms``  throughput over training time (smoothed); ``perf/peak_mem_gb``
                                and ``perf/mfu`` on a GPU
``progress/tokens``, ``progress/gflops``  tokens trained and training GFLOPs (model/flops.py) at evaluations
``time/train_seconds``          seconds on the training clock (budget.py), in every call: the x-axis to
                                pick for loss against training time in W&B or in the CSV file
``result/*``                    the run's final numbers, once at its last step (the HPARAMS tab's metrics)
``routing/depth_weights``       image (TensorBoard only)
==============================  ===========================================================================

In TensorBoard, which cannot put a logged value on the horizontal axis, the x-axis choices mean:
**Step** = optimiser step; **Relative** = training time (every event's wall time is the run's origin plus
its training seconds, so evaluations and checkpoints, which are outside the clock, take no room). Three
series also carry another quantity as their step, for the equal-time and equal-FLOPs views:
``loss/val_vs_train_seconds`` and ``loss/train_smoothed_vs_train_seconds`` (step = whole training
seconds), ``loss/val_vs_tokens`` (step = tokens), ``loss/val_vs_gflops`` (step = whole GFLOPs).

A run logs into its own folder, so that TensorBoard names it by its path: a study's runs live in
``studies/<study>/<budget>/<arm>-s<seed>``, and ``mhar-ablate tensorboard NAME`` lists them as
``<budget>/<arm>-s<seed>`` (one budget's runs: ``--budget``; the budgets never mix on a chart unnoticed).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from ..config import RunConfig
from ..errors import UsageError

LOGGERS = ("tensorboard", "csv", "wandb")
TRAIN_SECONDS = "time/train_seconds"
TOKENS = "progress/tokens"
GFLOPS = "progress/gflops"
# Series TensorBoard also gets along another axis (its step): (tag, axis metric, suffix).
ALONG = (("loss/val", TRAIN_SECONDS, "train_seconds"), ("loss/val", TOKENS, "tokens"), ("loss/val", GFLOPS, "gflops"),
         ("loss/train_smoothed", TRAIN_SECONDS, "train_seconds"))
# The sections of a config that make up a run's hyperparameters (data.* is the same in every arm).
HPARAM_SECTIONS = ("residual", "model", "optim", "train")


class ClockTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, with every event's wall time set to ``origin`` + the training
    seconds last logged (``time/train_seconds``), so that TensorBoard's Relative axis is the training
    clock; and the ``ALONG`` series written with their axis quantity as the step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.origin: float | None = None  # set by the budget callback (it carries the origin over resumes)
        self.seconds = 0.0

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        if TRAIN_SECONDS in metrics:
            self.seconds = float(metrics[TRAIN_SECONDS])
        wall = (self.origin + self.seconds) if self.origin is not None else time.time()
        writer = self.experiment
        for k, v in metrics.items():
            writer.add_scalar(k, float(v), step, walltime=wall)
        for tag, axis, suffix in ALONG:
            if tag in metrics and axis in metrics:
                writer.add_scalar(f"{tag}_vs_{suffix}", float(metrics[tag]), int(round(float(metrics[axis]))), walltime=wall)

    def add_image(self, tag: str, image, step: int) -> None:
        wall = (self.origin + self.seconds) if self.origin is not None else None
        self.experiment.add_image(tag, image, step, dataformats="HWC", walltime=wall)


def display_name(run_dir: Path, cfg: RunConfig) -> tuple[str, str]:
    """(run name, group) for loggers that name runs themselves (W&B): a study's run is
    ``<study>/<budget>/<arm>-s<seed>`` in group ``<study>/<budget>``; a run on its own ``<budget>/<folder>``."""
    parts = run_dir.resolve().parts
    if len(parts) >= 4 and parts[-4] == "studies":
        return "/".join(parts[-3:]), "/".join(parts[-3:-1])
    return f"{cfg.train.budget}/{run_dir.name}", cfg.train.budget


def make_logger(cfg: RunConfig, run_dir: Path) -> Logger:
    """The run's logger, writing into the run folder itself (a folder that already holds ``tb/``, from
    before runs logged into their folder, goes on writing there, so a resumed run keeps one series)."""
    kind = cfg.train.logger
    if kind == "tensorboard":
        legacy = (run_dir / "tb").is_dir()
        root, name = (run_dir, "tb") if legacy else (run_dir.parent, run_dir.name)
        return ClockTensorBoardLogger(str(root), name=name, version="", default_hp_metric=False)
    if kind == "csv":
        return CSVLogger(str(run_dir.parent), name=run_dir.name, version="", flush_logs_every_n_steps=100)
    if kind == "wandb":
        try:
            import wandb  # noqa: F401  (only for this choice: the package does not need it otherwise)
        except ImportError:
            raise UsageError("train.logger=wandb needs wandb: pip install 'mhar-ablate[wandb]' "
                             "(WANDB_MODE=offline logs without an account)") from None
        from lightning.pytorch.loggers import WandbLogger

        name, group = display_name(run_dir, cfg)
        # A stable id: a resumed run continues its W&B run instead of starting another.
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        return WandbLogger(name=name, group=group, save_dir=str(run_dir), id=run_id, resume="allow",
                           project=os.environ.get("WANDB_PROJECT", "mhar-ablate"))
    raise UsageError(f"train.logger must be one of {', '.join(LOGGERS)}, got {kind!r}")


def run_hparams(cfg: RunConfig, arm: str) -> dict[str, Any]:
    """The hyperparameters a run is compared by: arm, budget and seed first, then every residual.*,
    model.*, optim.* and train.* setting, as scalars or strings (what every logger accepts)."""
    out: dict[str, Any] = {"arm": arm, "budget": cfg.train.budget, "seed": cfg.seed}
    for k, v in cfg.flat().items():
        if k.split(".", 1)[0] in HPARAM_SECTIONS:
            out[k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def final_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The run's final numbers, the metrics of TensorBoard's HPARAMS tab."""
    out = {"result/final_val_loss": float(result["final_val_loss"]), "result/tokens_per_s": float(result["tokens_per_s"] or 0.0),
           "result/train_seconds": float(result["seconds"]), TRAIN_SECONDS: float(result["seconds"])}
    if result.get("final_eval"):
        out["result/final_set_loss"] = float(result["final_eval"]["loss"])
    return out


def start_hparams(logger: Logger, cfg: RunConfig, arm: str) -> None:
    """Before training: the hyperparameters into the logger (hparams.yaml, W&B's config); TensorBoard's
    HPARAMS entry is written with the final metrics (``log_final``), once the run has them."""
    logger.log_hyperparams(run_hparams(cfg, arm))


def log_final(logger: Logger, cfg: RunConfig, arm: str, result: dict[str, Any]) -> None:
    """The final metrics at the run's last step, registered as TensorBoard's hparam metrics."""
    metrics, step = final_metrics(result), int(result["step"])
    if isinstance(logger, TensorBoardLogger):
        logger.log_hyperparams(run_hparams(cfg, arm), metrics, step=step)
    else:
        logger.log_hyperparams(run_hparams(cfg, arm))
        logger.log_metrics(metrics, step)
