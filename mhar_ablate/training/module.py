"""The LightningModule: a decoder, its next-token loss, and one optimiser step a batch (``step.TrainStep``:
fused AdamW with routing parameters undecayed, clipping, the update skipped on the device when a step is
not finite; captured in a CUDA graph on a GPU), with the learning rate set from budget progress (steps or
training seconds) before every step.

Optimisation is manual: the step is one object that also runs outside Lightning (``mhar-ablate bench
model``), and on a GPU its update happens inside a replayed CUDA graph, which no Lightning hook can wrap.
Nothing here reads a device value during training; the budget callback reads the steps' losses and the
clock at its read-outs.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import lightning as L
import torch
from torch import Tensor

from ..config import RunConfig, from_dict
from ..model import Decoder
from .budget import Budget, CudaEventTimer, HostTimer, TrainingClock
from .schedule import lr_factor
from .step import TrainStep, make_loss, make_optimizer


_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class LMModule(L.LightningModule):
    """``cfg``: the run's config, or its ``to_dict`` form (config.yaml's), which is what the module saves
    as its hyperparameters: ``LMModule.load_from_checkpoint(path)`` rebuilds the module from a checkpoint
    of this package alone. A checkpoint written before the module saved them needs the config passed in:
    ``load_from_checkpoint(path, cfg=load_run_config(run_dir), vocab_size=V)`` (resuming a run reads its
    folder's config.yaml either way)."""

    def __init__(self, cfg: RunConfig | dict, vocab_size: int, autocast: torch.dtype | str | None = None):
        super().__init__()
        if isinstance(cfg, dict):
            cfg = from_dict(cfg)
        if isinstance(autocast, str):
            autocast = _AUTOCAST[autocast]
        # Plain data only (a checkpoint loads without unpickling classes); logger=False: the run's logger
        # gets the hyperparameters it compares arms by (training/loggers.py), not this nested form.
        self.save_hyperparameters({"cfg": cfg.to_dict(), "vocab_size": int(vocab_size),
                                   "autocast": None if autocast is None else str(autocast).removeprefix("torch.")},
                                  logger=False)
        self.automatic_optimization = False
        self.cfg = cfg
        torch.manual_seed(cfg.seed)  # the initial weights are a function of the seed only
        self.model = Decoder(cfg.model, cfg.residual, vocab_size)
        # Under the flops budget train.steps holds the steps its FLOPs buy (run.resolve_flops_budget).
        self.budget = Budget(cfg.train.budget, cfg.train.steps, cfg.train.time, cfg.train.flops)
        self.clock = TrainingClock()
        self.checkpoint_record: Callable[[dict], None] | None = None
        self.autocast_dtype = autocast
        self._loss = make_loss(self.model, None)
        # Evaluation runs uncompiled: it is outside the clock, and compiling its no-grad graph (twice for a
        # routed model: with and without recording depth weights) cost more than a short run's evaluations.
        self._eval_loss = self._loss
        self.step: TrainStep | None = None  # built at the first batch, when device and optimiser exist
        self.pending: list[tuple[int, float, Tensor]] = []  # (step, learning rate, [loss, norm]) not yet read
        self.last_loss: float | None = None
        self.diverged: str | None = None
        self.prepare_seconds: float | None = None  # compile, warm-up and capture, outside the clock

    def configure_model(self) -> None:
        if self.cfg.train.compile:
            self._loss = make_loss(self.model, "default")

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def lr_at(self, step: int, seconds: float) -> float:
        return self.cfg.optim.lr * lr_factor(self.budget.progress(step, seconds), self.cfg.optim)

    # ------------------------------------------------------------------------------------------ training
    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        """Training batches stay in (pinned) host memory: the step copies them into its own device buffers
        without waiting, where Lightning's copy would first allocate a device batch of its own."""
        if self.trainer is not None and self.trainer.training:
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_train_start(self) -> None:
        cuda = self.device.type == "cuda"
        self.clock.timer = CudaEventTimer() if cuda else HostTimer()
        # Under several processes the gradients are reduced by Lightning's backward; a captured graph
        # would hold one process's collective calls, which this package does not yet replay.
        graph = self.cfg.train.cuda_graph and self.trainer.world_size == 1
        self.step = TrainStep(self.model, self.optimizers().optimizer, self._loss, grad_clip=self.cfg.optim.grad_clip,
                              autocast=self.autocast_dtype, device=self.device, cuda_graph=graph,
                              backward=self.manual_backward)

    def prepare_step(self, batch: tuple[Tensor, Tensor], log=None) -> None:
        """Compile, warm up and capture the step outside the clock; the clock's first estimate of a
        step's length is the one measured there."""
        self.prepare_seconds = self.step.prepare(*batch, log=log)
        if self.clock.seconds_per_step is None:
            self.clock.seconds_per_step = self.step.seconds_per_step

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        step = self.global_step
        warmup = not self.clock.warm  # the process's first step: timed apart, off the clock (budget.py)
        self.clock.begin_warmup() if warmup else self.clock.begin_step()
        lr = self.lr_at(step, self.clock.estimate())
        self.step.set_lr(lr)
        self.pending.append((step, lr, self.step(*batch)))
        self.clock.end_warmup() if warmup else self.clock.end_step()
        _count_optimizer_step(self.trainer)

    def take_pending(self) -> list[tuple[int, float, float, float]]:
        """The steps since the last read-out as (step, learning rate, loss, gradient norm): one transfer."""
        if not self.pending:
            return []
        values = torch.stack([s for _, _, s in self.pending]).tolist()
        out = [(step, lr, loss, norm) for (step, lr, _), (loss, norm) in zip(self.pending, values)]
        self.pending.clear()
        return out

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean validation loss over ``batches``, with depth weights recorded for the heatmap."""
        was_training = self.training
        self.eval()
        total, n = 0.0, 0
        residual = self.model.residual
        for i, (x, y) in enumerate(batches):
            residual.record = i == 0
            with self.autocast():
                total += self._eval_loss(x.to(self.device), y.to(self.device)).item() * x.shape[0]
            n += x.shape[0]
        residual.record = None
        self.train(was_training)
        if self.step is not None and self.step.captured:
            # The captured step replays from its graph's own pool; the blocks this eager evaluation cached in
            # the ordinary pool would otherwise stay with the process for the rest of the run, out of reach of
            # a trial sharing the GPU (6-49 GB at paper100m: docs/benchmarks.md, "What a training process
            # holds"). Outside the clock.
            torch.cuda.empty_cache()
        return total / max(n, 1)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["training_clock"] = self.clock.elapsed  # read by checkpoint.resume_point
        checkpoint["training_clock_state"] = self.clock.state_dict()
        if self.checkpoint_record is not None:  # the run's record (run.CheckpointRecord)
            self.checkpoint_record(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.clock.load_state_dict(checkpoint.get("training_clock_state")
                                   or {"elapsed": checkpoint.get("training_clock", 0.0)})

    def configure_optimizers(self):
        return make_optimizer(self.model, self.cfg.optim, self.device)


def _count_optimizer_step(trainer: L.Trainer) -> None:
    """Lightning counts a manual-optimisation step when its own ``LightningOptimizer.step`` runs; this
    step's update runs in ``TrainStep`` (inside a CUDA graph on a GPU), so the count that
    ``trainer.global_step`` and checkpoints read is advanced here, as that method would."""
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()
