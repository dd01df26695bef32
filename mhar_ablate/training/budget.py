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


EARLY_STEPS = 3  # timed steps after the warm-up whose length is compared with the median step (result's step_timing)
SEGMENTS_KEPT = 2048  # per-step seconds of later segments kept for their median (thinned beyond)


class TrainingClock:
    """Seconds spent training, measured without making the host wait for the device between read-outs.

    Consecutive steps form a segment, timed from a mark before its first step to a mark taken when the
    segment is read (``read``), which the loop does where it synchronises anyway: a logging read-out,
    an evaluation, a checkpoint, a stop. Whatever happens between segments (evaluation, checkpointing,
    logging, compilation) is outside the clock. Between read-outs ``estimate`` extrapolates the open
    segment from the seconds per step measured so far.

    Warm-up: the first step a process trains (``warm`` False: a fresh run, and the first step after a
    resume alike, for every arm) is timed on its own and kept off the clock (``warmup_seconds``,
    ``warmup_steps``): one-time costs that the untimed ``TrainStep.prepare`` pass leaves (first-iteration
    allocations and caches, a process's first trial) are no arm's training time. The next ``EARLY_STEPS``
    steps are read one by one (``wants_read``: a few read-outs per run, never one per step) so that
    ``timing`` can compare them with the median step.
    """

    def __init__(self, timer=None, elapsed: float = 0.0):
        self.timer = timer if timer is not None else HostTimer()
        self.elapsed = elapsed  # seconds of every segment read so far
        self.seconds_per_step: float | None = None
        self._start = None  # the open segment's first mark
        self.steps = 0  # steps in the open segment
        self.warm = False  # this process has trained its warm-up step
        self.warmup_seconds = 0.0
        self.warmup_steps = 0
        self._warmup_marks = None  # the warm-up step's (start, end) marks, until read
        self.early: list[float] = []  # seconds of each of the first EARLY_STEPS timed steps
        self.later: list[float] = []  # seconds per step of each later segment

    @property
    def free_readout(self) -> bool:
        return self.timer.free_readout

    @property
    def running(self) -> bool:
        return self._start is not None

    @property
    def wants_read(self) -> bool:
        """The warm-up step, or one of the early steps, waits to be read on its own."""
        return self._warmup_marks is not None or (self.warm and len(self.early) < EARLY_STEPS and self.steps > 0)

    def begin_warmup(self) -> None:
        self._warmup_marks = (self.timer.mark(), None)

    def end_warmup(self) -> None:
        self._warmup_marks = (self._warmup_marks[0], self.timer.mark())
        self.warm = True

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
        with its step count. A warm-up step waiting to be read is read too, into ``warmup_seconds``."""
        if self._warmup_marks is not None and self._warmup_marks[1] is not None:
            start, end = self._warmup_marks
            self.warmup_seconds += self.timer.seconds(start, end)
            self.warmup_steps += 1
            self._warmup_marks = None
        if self._start is None:
            return 0.0, 0
        dt = self.timer.seconds(self._start, self.timer.mark())
        steps = self.steps
        self.elapsed += dt
        if steps:
            self.seconds_per_step = dt / steps
            early = min(steps, EARLY_STEPS - len(self.early))
            self.early.extend([dt / steps] * max(early, 0))
            if steps > max(early, 0):
                self.later.append(dt / steps)
                if len(self.later) > SEGMENTS_KEPT:
                    self.later = self.later[::2]
        self._start, self.steps = None, 0
        return dt, steps

    def timing(self) -> dict[str, float | int | None]:
        """The warm-up kept off the clock, and the early steps against the median later one."""
        import statistics

        early = statistics.fmean(self.early) if self.early else None
        median = statistics.median(self.later) if self.later else None
        return {"warmup_steps": self.warmup_steps, "warmup_seconds": self.warmup_seconds, "early_steps": len(self.early),
                "early_step_seconds": early, "median_step_seconds": median,
                "early_ratio": early / median if early is not None and median else None}

    def state_dict(self) -> dict:
        return {"elapsed": self.elapsed, "warmup_seconds": self.warmup_seconds, "warmup_steps": self.warmup_steps,
                "early": list(self.early), "later": list(self.later)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's clock (one written before the warm-up was kept apart holds only ``elapsed``)."""
        self.elapsed = float(state.get("elapsed", 0.0))
        self.warmup_seconds = float(state.get("warmup_seconds", 0.0))
        self.warmup_steps = int(state.get("warmup_steps", 0))
        self.early, self.later = list(state.get("early", [])), list(state.get("later", []))
