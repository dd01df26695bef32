"""The training step (training/step.py) and the clock that reads it without stalling the device: the
learning-rate tensor, the update skipped on the device when a step is not finite, the warm-up that leaves
no trace, the fallback when a CUDA graph cannot be used, and the clock's accounting between read-outs.
On a GPU (skipped elsewhere): a captured step of the baseline and of the fused MHAR path makes no host sync."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mhar_ablate.config import OptimConfig, build_config
from mhar_ablate.model import Decoder
from mhar_ablate.training.budget import TrainingClock
from mhar_ablate.training.step import TrainStep, make_loss, make_optimizer

CPU = torch.device("cpu")


def _model(seed: int = 0, kind: str = "mhar") -> Decoder:
    cfg = build_config(overrides={"residual.kind": kind, "residual.heads": "2" if kind == "mhar" else "none",
                                  "residual.backend": "reference", "model.seq_len": "16"})
    torch.manual_seed(seed)
    return Decoder(cfg.model, cfg.residual, 64)


def _step(model: nn.Module, loss=None, clip: float = 1.0, **kw) -> TrainStep:
    opt = make_optimizer(model, OptimConfig(lr=1e-2), CPU)
    return TrainStep(model, opt, loss or make_loss(model, None), grad_clip=clip, autocast=None, device=CPU,
                     cuda_graph=kw.pop("cuda_graph", False), **kw)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(0, 64, (2, 17), generator=g)
    return d[:, :-1].contiguous(), d[:, 1:].contiguous()


def _state(step: TrainStep) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in step.params]
    for p in step.params:
        out.extend(v.clone() for v in step.optimizer.state[p].values() if torch.is_tensor(v))
    return out


def test_every_group_reads_the_one_learning_rate_tensor():
    step = _step(_model())
    assert len(step.optimizer.param_groups) > 1
    assert all(g["lr"] is step.lr for g in step.optimizer.param_groups)
    before = [p.detach().clone() for p in step.params]
    step.set_lr(1e-3)
    out = step(*_batch(0))
    assert out.shape == (2,) and math.isfinite(out[0].item()) and out[1].item() > 0
    # AdamW's first update moves each weight with a gradient by about lr (m / sqrt(v) = +-1), whatever the
    # gradient's size: the step used the rate written into the tensor, not the optimiser's initial 1e-2.
    moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(step.params, before)])
    moved = moved[moved > 0]
    assert moved.median().item() == pytest.approx(1e-3, rel=0.05)
    step.set_lr(0.0)
    frozen = [p.detach().clone() for p in step.params]
    step(*_batch(1))
    assert all(torch.equal(p, f) for p, f in zip(step.params, frozen))


def test_a_non_finite_step_changes_nothing_then_or_after():
    model = _model()
    plain = make_loss(model, None)
    poison = {"on": False}

    def loss(x, y):
        value = plain(x, y)
        return value * float("nan") if poison["on"] else value

    step = _step(model, loss)
    step(*_batch(0))
    before = _state(step)
    poison["on"] = True
    out = step(*_batch(1)).tolist()
    assert math.isnan(out[0])
    poison["on"] = False
    out = step(*_batch(2)).tolist()  # a finite loss again: the run is still diverged, nothing moves
    assert math.isfinite(out[0])
    after = _state(step)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "weights, moments and step count unchanged"


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward, infinite backward: a finite loss whose gradient overflows."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def test_a_non_finite_gradient_norm_also_skips_the_update():
    model = _model()
    plain = make_loss(model, None)
    overflow = {"on": False}

    def loss(x, y):
        value = plain(x, y)
        return _InfiniteGradient.apply(value) if overflow["on"] else value

    step = _step(model, loss, clip=0.0)  # no clipping: the norm is still computed and checked
    step(*_batch(0))
    before = _state(step)
    overflow["on"] = True
    loss_value, norm = step(*_batch(1)).tolist()
    assert math.isfinite(loss_value) and not math.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(step)))


def test_prepare_leaves_no_trace():
    """A step that was warmed up and timed trains exactly what a fresh one does."""
    a, b = _step(_model(3)), _step(_model(3))
    seconds = a.prepare(*_batch(9))
    assert seconds > 0 and a.seconds_per_step > 0 and not a.captured
    for i in range(3):
        for s in (a, b):
            s.set_lr(1e-3 * (i + 1))
        assert torch.equal(a(*_batch(i)), b(*_batch(i)))
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))


def test_cuda_graph_on_a_cpu_trains_uncaptured_and_says_so():
    step = _step(_model(), cuda_graph=True)
    said = []
    step.prepare(*_batch(0), log=said.append)
    assert not step.captured
    assert said == ["train.cuda_graph: no CUDA device, so the step runs uncaptured"]


def test_a_failed_capture_falls_back_to_the_uncaptured_step(monkeypatch):
    a, b = _step(_model(4), cuda_graph=True), _step(_model(4))
    monkeypatch.setattr(TrainStep, "can_capture", lambda self: True)

    def refuse(self, x, y):
        self.params[0].data.add_(1.0)  # a capture that had already touched the weights before failing
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(TrainStep, "_capture", refuse)
    said = []
    a.prepare(*_batch(0), log=said.append)
    assert not a.captured
    assert said and "capture failed (RuntimeError: operation not permitted when stream is capturing)" in said[0]
    for i in range(2):
        assert torch.equal(a(*_batch(i)), b(*_batch(i)))


class FakeTimer:
    """A device timer whose marks are read off a hand-moved clock, and whose reads count."""

    free_readout = False

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        self.reads += 1
        return end - start


def test_clock_extrapolates_between_read_outs_and_corrects_at_each():
    timer = FakeTimer()
    clock = TrainingClock(timer)
    clock.seconds_per_step = 0.10  # prepare's measurement
    for _ in range(5):
        clock.begin_step(); timer.now += 0.12; clock.end_step()
    assert clock.estimate() == pytest.approx(0.50)  # extrapolated, nothing read
    assert timer.reads == 0 and clock.elapsed == 0.0
    assert clock.read() == (pytest.approx(0.60), 5)
    assert clock.elapsed == pytest.approx(0.60) and clock.seconds_per_step == pytest.approx(0.12)
    timer.now += 7.0  # evaluation, checkpoint: between segments, not counted
    for _ in range(2):
        clock.begin_step(); timer.now += 0.12; clock.end_step()
    assert clock.estimate() == pytest.approx(0.84)
    clock.read()
    assert clock.elapsed == pytest.approx(0.84) and timer.reads == 2
    assert clock.read() == (0.0, 0)  # nothing open: nothing added


class StepTimer:
    """A device clock that advances only when a step runs, and is costly to read, as CUDA events are: the
    run's accounting is then deterministic whatever else loads the machine. Steps take 10 ms, then 20 ms
    from the 61st training step on (the step's preparation runs 3 first), so the extrapolation lags just
    before the budget's end."""

    free_readout = False

    def __init__(self):
        self.now, self.reads, self.steps = 0.0, 0, 0

    @property
    def step_seconds(self) -> float:
        return 0.01 if self.steps <= 63 else 0.02

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        self.reads += 1
        return end - start


def test_wallclock_run_with_a_costly_clock_reads_rarely_and_still_stops_on_time(tmp_path, monkeypatch):
    """The GPU's regime on a CPU: the clock is read every log_every steps, at evaluations and near the
    end, yet the run stops at the first step past its budget and its schedule ends fully decayed."""
    from mhar_ablate.training import module as module_mod
    from mhar_ablate.training.run import train_run

    from run_helpers import cfg_for, read_scalars

    timer = StepTimer()
    monkeypatch.setattr(module_mod, "HostTimer", lambda: timer)
    step = TrainStep.__call__

    def timed_step(self, x, y):
        out = step(self, x, y)
        timer.steps += 1
        timer.now += timer.step_seconds
        return out

    monkeypatch.setattr(TrainStep, "__call__", timed_step)
    cfg = cfg_for(tmp_path, train__budget="wallclock", train__time="0.995", train__log_every="25",
                  residual__kind="baseline", train__eval_every="3")
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    assert r["status"] == "completed" and not r["cuda_graph"]
    # The warm-up step (off the clock; the fourth 10 ms step after prepare's three), then 59 timed steps of
    # 10 ms and 21 of 20 ms pass the budget: the run stops at that first step past it, although the estimate
    # then still assumed shorter steps.
    assert r["step"] == 81 and r["seconds"] == pytest.approx(1.01)
    assert r["warmup_steps"] == 1 and r["warmup_seconds"] == pytest.approx(0.01)
    assert timer.reads < r["step"] / 3, f"{timer.reads} read-outs for {r['step']} steps"
    assert [p["seconds"] for p in r["curve"]] == sorted(p["seconds"] for p in r["curve"])
    scalars = read_scalars(tmp_path / "run")
    assert len(scalars["loss/train"]) == r["step"]  # every step's loss is logged, read in groups
    assert scalars["optim/lr"][-1] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio, rel=0.05)


def test_logged_learning_rate_is_the_one_each_step_used(tmp_path):
    from mhar_ablate.training.run import train_run
    from mhar_ablate.training.schedule import lr_factor

    from run_helpers import cfg_for, read_scalars

    cfg = cfg_for(tmp_path, train__steps=10, residual__kind="baseline", optim__warmup="0.3")
    train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    logged = read_scalars(tmp_path / "run")["optim/lr"]
    used = [cfg.optim.lr * lr_factor(s / 10, cfg.optim) for s in range(10)]  # step s runs at progress s/10
    assert logged == pytest.approx(used, rel=1e-6, abs=1e-12)
    assert logged[0] == 0.0  # warm-up starts from zero: the first step's rate, not the second's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("over", [{"residual.kind": "baseline"},
                                  {"residual.kind": "mhar", "residual.heads": "8", "residual.grouping": "full"},
                                  {"residual.kind": "mhar", "residual.heads": "8", "residual.grouping": "block:4"}],
                         ids=["baseline", "mhar-full", "mhar-block4"])
def test_a_captured_step_makes_no_host_sync_on_a_gpu(over):
    """Five replays of a captured step under torch.cuda.set_sync_debug_mode: no synchronising call, finite
    outputs (what benchmarks/gpu_step_check.py's `syncs` stage checked, before it was folded in here)."""
    import warnings

    dev = torch.device("cuda")
    cfg = build_config(overrides={**over, "model.preset": "small"})
    torch.manual_seed(0)
    with dev:
        model = Decoder(cfg.model, cfg.residual, 4096)
    step = TrainStep(model, make_optimizer(model, OptimConfig(), dev), make_loss(model, None), grad_clip=1.0,
                     autocast=torch.bfloat16, device=dev, cuda_graph=True)
    x = torch.randint(0, 4096, (2, cfg.model.seq_len), device=dev)
    step.prepare(x, x)
    torch.cuda.synchronize()
    assert step.captured
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outs = []
            for i in range(5):
                step.set_lr(1e-3 * (i + 1))
                outs.append(step(x, x))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message).lower()]
    assert syncs == []
    assert all(math.isfinite(v) for o in outs for v in o.tolist())
