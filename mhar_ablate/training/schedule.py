"""Learning-rate schedules as functions of budget progress in [0, 1] (steps or training seconds alike)."""

from __future__ import annotations

import math

from ..config import OptimConfig


def lr_factor(progress: float, cfg: OptimConfig) -> float:
    """Multiplier of the peak learning rate at ``progress``; equals ``min_lr_ratio`` at progress 1."""
    p = min(max(progress, 0.0), 1.0)
    if cfg.warmup > 0 and p < cfg.warmup:
        return p / cfg.warmup
    if cfg.schedule == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        t = (p - cfg.warmup) / (1.0 - cfg.warmup)
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * t))
    # wsd: warmup, a stable plateau, then a linear decay over the final ``decay_fraction``.
    start = max(1.0 - cfg.decay_fraction, cfg.warmup)
    if p <= start:
        return 1.0
    return 1.0 - (1.0 - lo) * (p - start) / (1.0 - start)
