"""The LightningModule: a decoder, its next-token loss, AdamW with routing parameters undecayed, and a
learning rate set from budget progress (steps or training seconds) before every optimiser step."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import RunConfig
from ..model import Decoder
from .budget import Budget, TrainingClock
from .schedule import lr_factor


class LMModule(L.LightningModule):
    def __init__(self, cfg: RunConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(cfg.seed)  # the initial weights are a function of the seed only
        self.model = Decoder(cfg.model, cfg.residual, vocab_size)
        self.budget = Budget(cfg.train.budget, cfg.train.steps, cfg.train.time)
        self.clock = TrainingClock()
        self._forward = self.model
        self.last_loss: float | None = None
        self.diverged: str | None = None

    def configure_model(self) -> None:
        if self.cfg.train.compile and self._forward is self.model:
            self._forward = torch.compile(self.model)

    def forward(self, idx: Tensor) -> Tensor:
        return self._forward(idx)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    def current_lr_factor(self) -> float:
        return lr_factor(self.budget.progress(self.global_step, self.clock.elapsed), self.cfg.optim)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        factor = self.current_lr_factor()
        for group in self.optimizers().optimizer.param_groups:
            group["lr"] = self.cfg.optim.lr * factor
        loss = self.loss(batch)
        value = loss.detach().item()
        if not math.isfinite(value):
            # Returning None skips backward and the step: a NaN must not reach the weights.
            self.diverged = f"training loss became {value} at step {self.global_step}"
            self.last_loss = value
            return None
        self.last_loss = value
        return loss

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean validation loss over ``batches``, with depth weights recorded for the heatmap."""
        was_training = self.training
        self.eval()
        total, n = 0.0, 0
        ctx = self.trainer.precision_plugin.forward_context() if self._trainer is not None else torch.no_grad()
        residual = self.model.residual
        with ctx:
            for i, (x, y) in enumerate(batches):
                residual.record = i == 0
                total += self.loss((x.to(self.device), y.to(self.device))).item() * x.shape[0]
                n += x.shape[0]
        residual.record = None
        self.train(was_training)
        return total / max(n, 1)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["training_clock"] = self.clock.elapsed

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.clock.elapsed = float(checkpoint.get("training_clock", 0.0))

    def configure_optimizers(self):
        o = self.cfg.optim
        groups = self.model.param_groups(o.weight_decay)
        # Not fused=True: Lightning refuses gradient clipping with optimizers that unscale internally.
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2))
