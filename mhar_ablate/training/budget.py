"""Equal-step, equal-wall-clock and equal-FLOPs budgets, and the clock that only counts training.

A FLOPs budget F is a step budget whose length each variant buys with its own cost: the run trains
floor(F / FLOPs per step) steps, FLOPs per step = FLOPs per token (``model/flops.py``) x tokens per step,
so a routed arm, which costs more per token, trains fewer steps than the baseline. Like a step budget
it does not depend on the machine. Its progress is FLOPs done / F, with F rounded down to whole steps
(= step / steps), so its schedule ends fully decayed on the last step.

A wall-clock budget is a fixed amount of *training* time: the clock runs only over consecutive optimiser
steps (on a GPU, between CUDA events, read without stalling the device), so validation, checkpointing,
logging and the compile/warm-up pass cost an arm nothing. Progress through either budget is a number in [0, 1] that
drives the learning-rate schedule, so a wall-clock run ends fully decayed instead of truncated.
"""

from __future__ import annotations

import time
import math
from dataclasses import dataclass

import torch

from ..config import format_flops
from ..errors import UsageError


@dataclass(frozen=True)
class Budget:
    kind: str  # steps | wallclock | flops
    steps: int  # under a flops budget: the steps its FLOPs buy (flops_budget_steps)
    seconds: float
    flops: float | None = None  # the flops budget's F
    flops_per_step: float | None = None  # this run's training FLOPs per optimiser step

    @property
    def counts_steps(self) -> bool:
        """Whether the budget ends at a step count (steps, and flops through the steps its FLOPs buy)."""
        return self.kind != "wallclock"

    def progress(self, step: int, seconds: float) -> float:
        p = step / self.steps if self.counts_steps else seconds / self.seconds
        return min(max(p, 0.0), 1.0)

    def exhausted(self, step: int, seconds: float) -> bool:
        return step >= self.steps if self.counts_steps else seconds >= self.seconds

    def describe(self) -> str:
        if self.kind == "flops":
            return f"{format_flops(self.flops)} ({self.steps} steps of {format_flops(self.flops_per_step)})"
        return f"{self.steps} steps" if self.kind == "steps" else f"{format_seconds(self.seconds)} of training time"


def flops_budget_steps(flops: float | None, flops_per_step: float, where: str = "train.flops") -> int:
    """The optimiser steps a FLOPs budget buys at ``flops_per_step``: floor(F / FLOPs per step), at least one."""
    if flops is None:
        raise UsageError("train.budget=flops needs its length: --flops F (like 3e15 or 3P) or train.flops=F")
    steps = math.floor(flops / flops_per_step * (1 + 1e-12))  # F set to k steps' FLOPs buys k steps despite rounding
    if steps < 1:
        raise UsageError(f"{where}={flops:g} is less than one training step of this model ({format_flops(flops_per_step)} "
                         f"per step): give at least {flops_per_step:.3g}")
    return steps


def format_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.2f}h"


class HostTimer:
    """Marks on the host's clock: exact at once, so reading it costs nothing (CPU training)."""

    free_readout = True

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventTimer:
    """Marks are CUDA events in the current stream: recording one does not wait for the device, and the
    time between two is the device's, read once the later one has completed."""

    free_readout = False

    def mark(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class TrainingClock:
    """Seconds spent training, measured without making the host wait for the device between read-outs.

    Consecutive steps form a segment, timed from a mark before its first step to a mark taken when the
    segment is read (``read``), which the loop does where it synchronises anyway: a logging read-out,
    an evaluation, a checkpoint, a stop. Whatever happens between segments (evaluation, checkpointing,
    logging, compilation) is outside the clock. Between read-outs ``estimate`` extrapolates the open
    segment from the seconds per step measured so far.
    """

    def __init__(self, timer=None, elapsed: float = 0.0):
        self.timer = timer if timer is not None else HostTimer()
        self.elapsed = elapsed  # seconds of every segment read so far
        self.seconds_per_step: float | None = None
        self._start = None  # the open segment's first mark
        self.steps = 0  # steps in the open segment

    @property
    def free_readout(self) -> bool:
        return self.timer.free_readout

    @property
    def running(self) -> bool:
        return self._start is not None

    def begin_step(self) -> None:
        if self._start is None:
            self._start, self.steps = self.timer.mark(), 0

    def end_step(self) -> None:
        self.steps += 1

    def estimate(self) -> float:
        """Training seconds so far: read segments exactly, the open one extrapolated."""
        return self.elapsed + self.steps * (self.seconds_per_step or 0.0)

    def read(self) -> tuple[float, int]:
        """Close the open segment: add its seconds (waiting for the device to finish it) and return them
        with its step count."""
        if self._start is None:
            return 0.0, 0
        dt = self.timer.seconds(self._start, self.timer.mark())
        steps = self.steps
        self.elapsed += dt
        if steps:
            self.seconds_per_step = dt / steps
        self._start, self.steps = None, 0
        return dt, steps
