"""Equal-step and equal-wall-clock budgets, and the clock that only counts training.

A wall-clock budget is a fixed amount of *training* time: the clock runs only between the start and the
end of an optimiser step (CUDA synchronised at both ends), so validation, checkpointing, logging and the
compile/warm-up pass cost an arm nothing. Progress through either budget is a number in [0, 1] that
drives the learning-rate schedule, so a wall-clock run ends fully decayed instead of truncated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Budget:
    kind: str  # steps | wallclock
    steps: int
    seconds: float

    def progress(self, step: int, seconds: float) -> float:
        p = step / self.steps if self.kind == "steps" else seconds / self.seconds
        return min(max(p, 0.0), 1.0)

    def exhausted(self, step: int, seconds: float) -> bool:
        return step >= self.steps if self.kind == "steps" else seconds >= self.seconds

    def describe(self) -> str:
        return f"{self.steps} steps" if self.kind == "steps" else f"{format_seconds(self.seconds)} of training time"


def format_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.2f}h"


class TrainingClock:
    """Accumulates the seconds spent inside training steps only."""

    def __init__(self, elapsed: float = 0.0):
        self.elapsed = elapsed
        self._started: float | None = None

    @staticmethod
    def _sync() -> None:
        # Device work is asynchronous: without a sync the host clock would stop before the GPU does.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> float:
        """Stop and return the seconds of the interval just ended."""
        if self._started is None:
            return 0.0
        self._sync()
        dt = time.perf_counter() - self._started
        self.elapsed += dt
        self._started = None
        return dt

    @property
    def running(self) -> bool:
        return self._started is not None
