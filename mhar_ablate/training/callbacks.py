"""Callbacks that make a run a measurement: the budget (clock, schedule progress, evaluations, stopping,
checkpoints), the series that a study compares (through the trainer's Lightning loggers; the tags, and
which x-axis to pick in TensorBoard, are in loggers.py), and a progress bar.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import lightning as L
import torch
from tqdm.auto import tqdm

from ..config import format_flops
from ..console import bars_enabled, log_line
from ..io import commit, raise_if_no_space
from . import distributed
from .budget import Budget, format_seconds
from .loggers import GFLOPS, TOKENS, TRAIN_SECONDS
from .module import LMModule
from .stop import StopRequest

EMA = 0.9  # smoothing of loss/train_smoothed


# Near a time budget's end the clock is read after every step, so that a run stops at the first step past
# its budget. "Near": within NEAR_END_STEPS estimated steps, plus a margin for the extrapolation's error
# that grows with the steps not yet read (ESTIMATE_ERROR of their estimated time).
NEAR_END_STEPS = 3
ESTIMATE_ERROR = 0.5
_SAID: set[str] = set()  # one-line notes already printed by this process


class BudgetCallback(L.Callback):
    """Owns a run's budget: when to read the device (the steps' losses and the clock), evaluate, stop and
    checkpoint. Reading the device makes the host wait for it, so it happens only every ``log_every``
    steps, at evaluations and stops, and after every step near a time budget's end; on a CPU, where
    reading costs nothing, after every step."""

    def __init__(self, budget: Budget, eval_every: int, heatmap_every: int, val_batches: Callable[[], Iterable],
                 checkpoint: Path, tokens_per_step: int, flops_per_token: float,
                 on_eval: Callable[[int, float, float], bool] | None = None, stop: StopRequest | None = None,
                 log: Callable[[str], None] | None = log_line, title: str = "", checkpoint_every: float = 0.0,
                 log_every: int = 20, final_batches: Callable[[], Iterable] | None = None, seq_len: int = 0):
        self.budget, self.eval_every, self.heatmap_every = budget, eval_every, heatmap_every
        self.val_batches, self.checkpoint = val_batches, checkpoint
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.on_eval, self.stop, self.emit, self.title = on_eval, stop if stop is not None else StopRequest(), log, title
        self.checkpoint_every, self.log_every = checkpoint_every, log_every
        # The final evaluation set (final_eval.py), evaluated once when the run completes; None: none.
        self.final_batches, self.seq_len = final_batches, seq_len
        self.final_eval: dict[str, Any] | None = None
        self._last_save = time.monotonic()
        self._last_read = 0  # global step of the last read-out
        self._prepared = False
        self.curve: list[dict[str, float]] = []
        self.next_eval = 0
        self.ema: float | None = None
        self.origin = time.time()
        self.status = "running"
        self.reason = ""
        self.throughput: float | None = None  # tokens per training second, smoothed
        self.peak_mem_gb: float | None = None
        # Seconds spent evaluating and checkpointing, outside the clock: what a run costs beyond its budget.
        self.eval_seconds = 0.0
        self.save_seconds = 0.0

    # ------------------------------------------------------------------ state carried by checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"curve": self.curve, "next_eval": self.next_eval, "ema": self.ema, "origin": self.origin,
                "throughput": self.throughput, "final_eval": self.final_eval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.curve = list(state["curve"])
        self.next_eval, self.ema, self.origin = state["next_eval"], state["ema"], state["origin"]
        self.throughput = state.get("throughput")
        self.final_eval = state.get("final_eval")

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, module: LMModule) -> None:
        self._last_read = trainer.global_step
        for logger in trainer.loggers:  # the origin of the events' wall times (restored on a resume by now)
            if hasattr(logger, "origin"):
                logger.origin = self.origin
        if self.curve and self.budget.exhausted(trainer.global_step, module.clock.elapsed):
            # Killed after the last checkpoint of a finished run: nothing is left to train.
            self._finish(trainer, module, "completed", "")
            return
        if self.next_eval == 0:
            self._evaluate(trainer, module)

    def on_train_batch_start(self, trainer: L.Trainer, module: LMModule, batch, batch_idx) -> None:
        if not self._prepared:  # on the first batch: its shapes are the ones a captured step replays
            module.prepare_step(batch, log=self._say_once)
            self._prepared = True

    def on_train_batch_end(self, trainer: L.Trainer, module: LMModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        # Under DDP every rank takes the same decisions (distributed.py): a read-out when any rank wants one
        # (each rank's clock estimate is its own), a stop asked on any rank (rank 0 has the signal handler),
        # a checkpoint due on any rank (saving is collective). On one process: the local values.
        save_due = self._mark_due()
        _, (read, stopped, save_due) = distributed.agree(0.0, self._read_due(step, module), bool(self.stop), save_due)
        if not read:
            return
        self._read_out(trainer, module)
        if self.status != "running":
            return
        seconds = module.clock.elapsed
        due = self.budget.progress(step, seconds) >= self.next_eval / self.eval_every
        exhausted = self.budget.exhausted(step, seconds)
        if due or exhausted:
            self._evaluate(trainer, module)
            if self.status != "running":
                return
        if exhausted:
            self._finish(trainer, module, "completed", "")
        elif stopped:
            self._finish(trainer, module, "interrupted", f"stopped by {self.stop.signal or 'rank 0'}")
        elif due or save_due:
            self._save(trainer)  # at every evaluation, and between them every checkpoint_every seconds

    def on_train_end(self, trainer: L.Trainer, module: LMModule) -> None:
        if self.status == "running":  # Lightning stopped first (max_steps): same end as our own check
            self._read_out(trainer, module)
            if self.status == "running" and (not self.curve or self.curve[-1]["step"] != trainer.global_step):
                self._evaluate(trainer, module)
            if self.status == "running":
                self._finish(trainer, module, "completed", "")

    # ------------------------------------------------------------------ pieces
    def _read_due(self, step: int, module: LMModule) -> bool:
        """Whether to read the device after this step: decided on the host, from the clock's estimate."""
        clock = module.clock
        if (clock.free_readout or clock.wants_read or self.stop or step - self._last_read >= self.log_every
                or self._mark_due()):
            return True
        estimate = clock.estimate()
        if self.budget.exhausted(step, estimate) or self.budget.progress(step, estimate) >= self.next_eval / self.eval_every:
            return True
        margin = (NEAR_END_STEPS + ESTIMATE_ERROR * clock.steps) * (clock.seconds_per_step or 0.0)
        return self.budget.kind == "wallclock" and estimate + margin >= self.budget.seconds

    def _mark_due(self) -> bool:
        """``checkpoint_every`` wall-clock seconds have passed since the last checkpoint."""
        return bool(self.checkpoint_every) and time.monotonic() - self._last_save >= self.checkpoint_every

    def _read_out(self, trainer: L.Trainer, module: LMModule) -> None:
        """Close the clock's segment, then log the steps since the last read-out; a step whose loss or
        gradient norm is not finite ends the run as diverged (its update, and every later one, was skipped
        on the device)."""
        start = module.clock.elapsed
        dt, n = module.clock.read()
        module.clock.elapsed, _ = distributed.agree(module.clock.elapsed)  # DDP: the slowest rank's clock, everywhere
        rows = module.take_pending()
        self._last_read = trainer.global_step
        if module.device.type == "cuda":
            self.peak_mem_gb = torch.cuda.max_memory_allocated(module.device) / 1e9
        if n and dt > 0:
            rate = n * self.tokens_per_step / dt
            keep = 0.9 ** n  # the same smoothing per step whether steps are read one by one or in groups
            self.throughput = rate if self.throughput is None else keep * self.throughput + (1 - keep) * rate
        # Host floats only (one transfer above): logging adds no device synchronisation.
        loggers = trainer.loggers
        for i, (step, lr, loss, norm) in enumerate(rows):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                what, value = ("training loss", loss) if not math.isfinite(loss) else ("gradient norm", norm)
                module.last_loss = loss
                module.diverged = f"{what} became {value} at step {step}"
                self._finish(trainer, module, "diverged", module.diverged)
                return
            module.last_loss = loss
            self.ema = loss if self.ema is None else EMA * self.ema + (1 - EMA) * loss
            seconds = start + dt * (i + 1) / max(n, 1)  # a segment's steps share its time evenly
            # lr: the rate this step used
            _log(loggers, {"loss/train": loss, "loss/train_smoothed": self.ema, "optim/lr": lr, "optim/grad_norm": norm,
                           TRAIN_SECONDS: seconds}, step + 1)
        if loggers and n and self.throughput and (not module.clock.free_readout or trainer.global_step % 10 == 0):
            perf = {"perf/tokens_per_s": self.throughput, "perf/step_ms": 1000 * self.tokens_per_step / self.throughput,
                    TRAIN_SECONDS: module.clock.elapsed}
            if module.device.type == "cuda":
                perf["perf/peak_mem_gb"] = self.peak_mem_gb
                peak = _peak_flops(module.device)
                if peak:
                    perf["perf/mfu"] = self.throughput * self.flops_per_token / peak
            _log(loggers, perf, trainer.global_step)

    def _say_once(self, line: str) -> None:
        if line not in _SAID and self.emit is not None:
            _SAID.add(line)
            self.emit(f"{self.title}{line}")

    def _evaluate(self, trainer: L.Trainer, module: LMModule) -> None:
        step, seconds = trainer.global_step, module.clock.elapsed
        t0 = time.perf_counter()
        loss = module.evaluate(self.val_batches())
        self.eval_seconds += time.perf_counter() - t0
        prune = self.on_eval is not None and math.isfinite(loss) and self.on_eval(step, seconds, loss)
        loss, prune = distributed.agree_eval(loss, prune)  # DDP: rank 0's loss and pruning decision
        self.next_eval = math.floor(self.budget.progress(step, seconds) * self.eval_every) + 1
        point = {"step": step, "seconds": seconds, "tokens": step * self.tokens_per_step, "val_loss": loss}
        self.curve.append(point)
        tokens = step * self.tokens_per_step
        _log(trainer.loggers, {"loss/val": loss, TRAIN_SECONDS: seconds, TOKENS: tokens,
                               GFLOPS: tokens * self.flops_per_token / 1e9}, step)
        final = self.budget.exhausted(step, seconds)
        if final or (len(self.curve) - 1) % self.heatmap_every == 0:
            self._heatmap(trainer, module, step)
        left = self._remaining(step, seconds)
        if self.emit is not None:
            self.emit(f"{self.title}eval {len(self.curve)}: step {step}, {format_seconds(seconds)} trained, "
                      f"val loss {loss:.4f}{', ' + left if left else ''}")
        if not math.isfinite(loss):
            self._finish(trainer, module, "diverged", f"validation loss became {loss} at step {step}")
        elif prune:
            self._finish(trainer, module, "pruned", f"pruned at step {step}")

    def _heatmap(self, trainer: L.Trainer, module: LMModule, step: int) -> None:
        """The depth weights as an image, for loggers that take images (TensorBoard's)."""
        images = [lg for lg in trainer.loggers if hasattr(lg, "add_image")]
        weights = module.model.residual.last_weights() if images else None
        if weights is None:
            return
        from .heatmap import routing_image

        # rows: routing sites (last = final), columns: sources (0 = embedding), one panel per head
        image = routing_image(weights)
        for lg in images:
            lg.add_image("routing/depth_weights", image, step)

    def _remaining(self, step: int, seconds: float) -> str:
        if self.budget.kind == "steps":
            return f"{max(self.budget.steps - step, 0)} steps left"
        if self.budget.kind == "flops":
            left = max(self.budget.steps - step, 0)
            return f"{left} steps ({format_flops(left * self.budget.flops_per_step)}) left"
        return f"{format_seconds(max(self.budget.seconds - seconds, 0))} left"

    def _save(self, trainer: L.Trainer, weights_only: bool = False) -> None:
        with self.stop.deferred():  # a second Ctrl-C waits until the checkpoint is whole
            self._write_checkpoint(trainer, weights_only)

    def _write_checkpoint(self, trainer: L.Trainer, weights_only: bool = False) -> None:
        """Checkpoint atomically: a kill mid-write leaves the previous checkpoint intact. ``weights_only``
        leaves out the optimiser's state (two thirds of the bytes), which a completed run no longer needs."""
        t0 = time.perf_counter()
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        try:
            # Collective under DDP: every rank calls it, rank 0 writes the file.
            trainer.save_checkpoint(tmp, weights_only=weights_only)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise_if_no_space(e, self.checkpoint)
            raise
        if trainer.is_global_zero:
            commit(tmp, self.checkpoint)
        self._last_save = time.monotonic()
        self.save_seconds += time.perf_counter() - t0

    def _finish(self, trainer: L.Trainer, module: LMModule, status: str, reason: str) -> None:
        self.status, self.reason = status, reason
        trainer.should_stop = True
        if status == "completed":
            self._final_evaluate(module)  # before the final checkpoint, which then records it
        if status in ("completed", "interrupted"):
            # A completed run's checkpoint is its end (a rerun rebuilds the result from its record; `eval`
            # and study trials keep its weights): no optimiser state. An interrupted one resumes from it.
            self._save(trainer, weights_only=status == "completed")
        if reason and self.emit is not None:
            self.emit(f"{self.title}{status}: {reason}")

    def _final_evaluate(self, module: LMModule) -> None:
        """The final evaluation (final_eval.py), once; outside the clock, as every evaluation is."""
        if self.final_eval is not None or self.final_batches is None:
            return
        from .final_eval import describe, evaluate

        # Not recorded for the heatmap: the periodic evaluations' first batches are (the result's weights are
        # the last of those), and recording every batch of this larger set would only cost time.
        residual = module.model.residual
        residual.record = False
        try:
            final = evaluate(module.model, self.final_batches(), module.device, module.autocast, self.seq_len)
        finally:
            residual.record = None
        if not final["sequences"]:
            return
        self.final_eval = final
        if self.emit is not None:
            self.emit(f"{self.title}{describe(final)}")


class ProgressBar(L.Callback):
    """One bar per run: budget consumed, with loss, tokens/s and what is left."""

    def __init__(self, budget: Budget, budget_cb: BudgetCallback, desc: str = "train", position: int = 0):
        self.budget, self.cb, self.desc, self.position = budget, budget_cb, desc, position
        self.bar: tqdm | None = None
        self._drawn = 0.0

    def on_train_start(self, trainer, module: LMModule) -> None:
        total = self.budget.steps if self.budget.counts_steps else round(self.budget.seconds)
        unit = "step" if self.budget.counts_steps else "s"
        self.bar = tqdm(total=total, desc=self.desc, unit=unit, leave=False, position=self.position,
                        dynamic_ncols=True, file=sys.stderr, mininterval=0.5, disable=not bars_enabled())
        self._update(trainer, module)

    def on_train_batch_end(self, trainer, module: LMModule, outputs, batch, batch_idx) -> None:
        if self.bar is not None and time.monotonic() - self._drawn >= 0.5:
            self._update(trainer, module)

    def _update(self, trainer, module: LMModule) -> None:
        """Host values only (the clock's estimate, the last loss read): drawing never waits for the GPU."""
        if self.bar is None:
            return
        self._drawn = time.monotonic()
        seconds = module.clock.estimate()
        done = trainer.global_step if self.budget.counts_steps else min(seconds, self.budget.seconds)
        self.bar.n = round(done) if not self.budget.counts_steps else done
        post = {}
        if module.last_loss is not None:
            post["loss"] = f"{module.last_loss:.3f}"
        if self.cb.throughput:
            post["tok/s"] = f"{self.cb.throughput:,.0f}"
        post["left"] = self.cb._remaining(trainer.global_step, seconds)
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def on_train_end(self, trainer, module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, trainer, module, exception) -> None:
        self.on_train_end(trainer, module)


def _log(loggers, metrics: dict[str, float], step: int) -> None:
    """One row of host floats to every logger, through Lightning's logger API."""
    for logger in loggers:
        logger.log_metrics(metrics, step)


def _peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak by the vendor's datasheet, for model FLOP utilisation; None when unknown."""
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("4090", 165e12)):
        if key in name:
            return peak
    return None
