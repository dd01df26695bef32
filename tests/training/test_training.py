"""Training runs: budgets, the training clock, the time-aware schedule, TensorBoard series, resume."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from mhar_ablate.config import OptimConfig
from mhar_ablate.training.budget import Budget, TrainingClock
from mhar_ablate.training.callbacks import StopRequest
from mhar_ablate.training.module import LMModule
from mhar_ablate.training.run import train_run
from mhar_ablate.training.schedule import lr_factor
from run_helpers import cfg_for, read_scalars


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_schedule_warms_up_and_ends_at_its_final_rate(schedule):
    cfg = OptimConfig(schedule=schedule, warmup=0.1, min_lr_ratio=0.1)
    assert lr_factor(0.0, cfg) == 0.0
    assert lr_factor(0.05, cfg) == pytest.approx(0.5)
    assert lr_factor(0.1, cfg) == pytest.approx(1.0)
    assert lr_factor(1.0, cfg) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    xs = [lr_factor(p / 100, cfg) for p in range(10, 101)]
    assert all(a >= b - 1e-12 for a, b in zip(xs, xs[1:])), "no increase after warm-up"


def test_wallclock_schedule_follows_training_seconds_not_steps():
    b = Budget("wallclock", steps=10, seconds=100.0)
    assert b.progress(step=5, seconds=50.0) == 0.5
    assert b.progress(step=10_000, seconds=25.0) == 0.25  # steps are irrelevant under a time budget
    assert b.exhausted(1, 100.0) and not b.exhausted(10_000, 99.0)
    cfg = OptimConfig(warmup=0.0, min_lr_ratio=0.1)
    assert lr_factor(b.progress(3, 100.0), cfg) == pytest.approx(0.1)


def test_host_clock_counts_only_its_segments():
    c = TrainingClock()
    c.begin_step(); time.sleep(0.05); c.end_step(); c.read()
    time.sleep(0.5)  # e.g. validation
    c.begin_step(); time.sleep(0.05); c.end_step(); c.read()
    assert 0.09 < c.elapsed < 0.45  # generous for a loaded machine, but far from the 0.6 s that passed


def test_wallclock_run_excludes_validation_time_and_decays_fully(tmp_path, monkeypatch):
    slow = LMModule.evaluate

    def slow_eval(self, batches):
        time.sleep(0.4)
        return slow(self, batches)

    monkeypatch.setattr(LMModule, "evaluate", slow_eval)
    cfg = cfg_for(tmp_path, train__budget="wallclock", train__time="3")
    start = time.perf_counter()
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    wall = time.perf_counter() - start
    assert r["status"] == "completed"
    assert 3.0 <= r["seconds"] < 3.0 + 1.0  # stops at the first step past the budget
    assert wall > r["seconds"] + 5 * 0.4 * 0.9  # at least five slow evaluations happened outside the clock
    curve = r["curve"]
    assert curve[0]["step"] == 0 and curve[-1]["seconds"] >= 3.0
    assert [p["seconds"] for p in curve] == sorted(p["seconds"] for p in curve)
    scalars = read_scalars(tmp_path / "run")
    assert scalars["optim/lr"][-1] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio, rel=0.05)


def test_tensorboard_has_loss_per_step_per_hour_and_heatmap(tmp_path):
    cfg = cfg_for(tmp_path, train__steps=12, residual__kind="mhar", residual__heads=4, train__heatmap_every=2)
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    s = read_scalars(tmp_path / "run")
    for tag in ("loss/train", "loss/val", "loss/val_vs_train_seconds", "loss/train_smoothed_vs_train_seconds",
                "optim/lr", "perf/tokens_per_s", "time/train_seconds"):
        assert tag in s, tag
    assert len(s["loss/val"]) == len(r["curve"]) == len(s["loss/val_vs_train_seconds"])
    # every series is laid out on the training clock too: wall times offset by training seconds (Relative axis)
    walls = s["_val_walltimes"]
    secs = [p["seconds"] for p in r["curve"]]
    assert [w - walls[0] for w in walls] == pytest.approx([x - secs[0] for x in secs], abs=1e-3)
    assert "routing/depth_weights" in s["_images"]
    assert "result/final_val_loss" in s  # the HPARAMS view gets the run's final metrics
    assert (tmp_path / "run" / "routing.png").stat().st_size > 1000
    assert len(r["routing_weights"]) == 2 * cfg.model.n_layers + 1


def test_validation_set_is_identical_across_arms_and_seeds(tmp_path):
    from mhar_ablate.data import TokenDataModule

    seen = []
    for kind, seed in (("baseline", 0), ("mhar", 1)):
        cfg = cfg_for(tmp_path, residual__kind=kind, seed=seed)
        dm = TokenDataModule(cfg.data, cfg.model.seq_len, cfg.train.batch_size, cfg.seed, tmp_path / "cache",
                             eval_batches=cfg.train.eval_batches)
        dm.prepare_data(); dm.setup("fit")
        seen.append(torch.cat([x for x, _ in dm.val_dataloader()]))
    assert torch.equal(seen[0], seen[1])


def test_resume_continues_the_same_run(tmp_path):
    """Stop at step 6 of 12, resume: same steps, clock continuity, schedule, batches and losses as an
    uninterrupted run."""
    batches: dict[str, list[torch.Tensor]] = {"full": [], "split": []}
    orig = LMModule.training_step
    current = {"key": "full"}

    def spy(self, batch, idx):
        batches[current["key"]].append(batch[0].clone())
        return orig(self, batch, idx)

    mp = pytest.MonkeyPatch()
    mp.setattr(LMModule, "training_step", spy)
    try:
        cfg = cfg_for(tmp_path, train__steps=12, residual__kind="mhar", residual__heads=2)
        full = train_run(cfg, tmp_path / "full", tmp_path / "cache", log=lambda s: None)
        current["key"] = "split"
        stop = StopRequest()

        def stop_after_6(self, outputs, batch, idx):
            if self.global_step == 5:  # the budget callback reads the flag at the end of the next step
                stop.signal = "SIGTERM"

        mp.setattr(LMModule, "on_train_batch_end", stop_after_6)
        first = train_run(cfg, tmp_path / "split", tmp_path / "cache", stop=stop, log=lambda s: None)
        mp.undo()
        mp.setattr(LMModule, "training_step", spy)
        assert first["status"] == "interrupted" and first["step"] == 6
        clock_at_stop = first["seconds"]
        second = train_run(cfg, tmp_path / "split", tmp_path / "cache", resume=True, log=lambda s: None)
    finally:
        mp.undo()
    assert second["status"] == "completed" and second["step"] == 12
    assert second["seconds"] > clock_at_stop  # the clock continued, it did not restart
    assert len(batches["split"]) == len(batches["full"]) == 12
    for a, b in zip(batches["full"], batches["split"]):
        assert torch.equal(a, b)
    assert [p["step"] for p in second["curve"]] == [p["step"] for p in full["curve"]]
    for p, q in zip(full["curve"], second["curve"]):
        assert p["val_loss"] == pytest.approx(q["val_loss"], rel=1e-5, abs=1e-6)


def test_divergence_stops_with_a_clear_status(tmp_path):
    cfg = cfg_for(tmp_path, train__steps=40, optim__lr=1e6, optim__warmup=0, optim__grad_clip=0)
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    assert r["status"] == "diverged"
    # Which turns non-finite first, the loss or the gradient norm, depends on the corpus, which is this
    # package's own source text (it changes with every edit): either is a clear reason.
    assert any(f"{what} became" in r["reason"] for what in ("loss", "gradient norm")), r["reason"]
    assert r["step"] < 40
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["status"] == "diverged" and saved["curve"]
    # When it was made, for the provenance a published study states (a file's time may not travel).
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", saved["finished_at"])


def test_an_embedding_far_larger_than_the_tokenizer_is_warned_of(tmp_path, capsys):
    # A paper preset names the Qwen3 vocabulary (151,936); over a 16k BPE or byte tokenizer most of the
    # embedding would never see a token, and its parameters and FLOPs would be counted anyway.
    cfg = cfg_for(tmp_path, train__steps=2, model__vocab_size=1024)
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    err = capsys.readouterr().err
    assert r["status"] == "completed"
    assert "model.vocab_size=1,024 is 4.0x the tokenizer's 256 tokens" in err and "model.vocab_size=256" in err
    cfg = cfg_for(tmp_path, train__steps=2, model__vocab_size=320)  # a little padding is no waste worth a line
    train_run(cfg, tmp_path / "run2", tmp_path / "cache", log=lambda s: None)
    assert "warning" not in capsys.readouterr().err


def test_info_warns_of_the_same_unused_embedding_before_anything_trains(capsys):
    from mhar_ablate.cli import main

    assert main(["info", "--preset", "paper100m"]) == 0
    err = capsys.readouterr().err
    assert "warning: model.vocab_size=151,936 is 593.5x the tokenizer's 256 tokens" in err
    assert main(["info", "--preset", "paper100m", "model.vocab_size=16384", "data.tokenizer=bpe",
                 "data.vocab_size=16384"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_evaluations_hand_back_their_cached_memory_when_the_step_is_a_graph(tmp_path, monkeypatch):
    # A replayed step allocates from its graph's own pool; what an eager evaluation cached would stay with
    # the process (tens of GB at paper100m) unless handed back after each evaluation.
    from mhar_ablate.training.step import TrainStep

    prepare = TrainStep.prepare

    def as_if_captured(self, *a, **kw):
        seconds = prepare(self, *a, **kw)
        self.captured = True
        return seconds

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    r = train_run(cfg_for(tmp_path, train__steps=8), tmp_path / "eager", tmp_path / "cache", log=lambda s: None)
    assert r["status"] == "completed"
    eager = len(calls)  # an eager step reuses what its evaluations cached (the run's teardown frees it)
    monkeypatch.setattr(TrainStep, "prepare", as_if_captured)
    r = train_run(cfg_for(tmp_path, train__steps=8), tmp_path / "graph", tmp_path / "cache", log=lambda s: None)
    assert r["status"] == "completed"
    # Once an evaluation, from the first after the step was prepared.
    assert len(r["curve"]) - 1 <= len(calls) - 2 * eager <= len(r["curve"])


def test_only_the_periodic_evaluations_record_depth_weights(tmp_path, monkeypatch):
    # The heatmap's weights come from each periodic evaluation's first batch; the final evaluation's many
    # batches record none (recording every one of them would only cost time and memory).
    from mhar_ablate.variants.routed import MHARResidual

    sites = []
    store = MHARResidual.store_weights
    monkeypatch.setattr(MHARResidual, "store_weights", lambda self, site, stacked: (sites.append(site),
                                                                                   store(self, site, stacked)))
    cfg = cfg_for(tmp_path, train__steps=8, residual__kind="mhar", residual__heads=2, data__final_sequences=8)
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    assert r["status"] == "completed" and r["final_eval"]["sequences"] == 8
    assert len(sites) == len(set(sites)) * len(r["curve"])
    assert len(r["routing_weights"]) == len(set(sites))
