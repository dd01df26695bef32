"""Interruption: SIGINT, SIGTERM and SIGKILL during a trial of a real study process. Rerunning the same
command resumes, and the study ends with the same results as an uninterrupted run."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from reliability_helpers import (FAST, SimulatedKill, fail_running_trials, final_losses, kill_before_record,
                                 signal_mid_trial, write_study)


def _study_args(folder, out):
    # One seed: a grid of two points, the first killed mid-trial, the second trained after the resumed one.
    return ["study", str(write_study(folder)), "--budget", "steps", "--seeds", "1", "--output", str(out), *FAST]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from mhar_ablate.cli import main

    folder = tmp_path_factory.mktemp("clean")
    out = folder / "out"
    assert main(_study_args(folder, out)) == 0
    return final_losses(out / "studies" / "pair" / "steps")


SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[signal.Signals, tuple[list[str], Path, int, Path]]:
    """Per signal: (command, study folder, exit code, trial caught mid-way) of a real CLI process that took
    the signal once that trial had checkpointed; the three processes run at once."""
    runs = {}
    for sig in SIGNALS:
        tmp = tmp_path_factory.mktemp(sig.name)
        runs[sig] = (_study_args(tmp, tmp / "out"), tmp / "out" / "studies" / "pair" / "steps")
    done = signal_mid_trial([(args, folder, sig) for sig, (args, folder) in runs.items()])
    return {sig: (*runs[sig], *result) for sig, result in zip(runs, done)}


@pytest.mark.parametrize("sig", SIGNALS)
def test_killed_study_resumes_to_the_same_results(capsys, sig, killed, uninterrupted):
    from mhar_ablate.cli import main

    args, folder, code, victim = killed[sig]
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:  # a graceful stop: checkpoint, record, exit 130
        assert code == 130
        assert json.loads((victim / "result.json").read_text())["status"] == "interrupted"
    assert (victim / "checkpoints" / "last.ckpt").exists()
    # The checkpoint it resumes from (the stop's own, or the last evaluation's where the signal stopped the
    # loop first) holds the optimiser's state too.
    import torch

    state = torch.load(victim / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["optimizer_states"] and state["mhar_ablate"]["status"] in ("interrupted", "running")
    finished_before = {k for k, v in final_losses(folder).items()
                       if json.loads((folder / k / "result.json").read_text())["status"] == "completed"}

    # The same command again, in this process (the killed process's checkpoint and database are all it reads).
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"{len(uninterrupted) - len(finished_before)} of {len(uninterrupted)} grid points to train" in printed
    if sig == signal.SIGKILL:
        assert "trial(s) of an earlier run were killed" in printed
    assert "resuming from the checkpoint at step" in printed  # the rerun says what it resumes from
    resumed = json.loads((victim / "result.json").read_text())
    assert resumed["status"] == "completed" and resumed["curve"][0]["step"] == 0
    got = final_losses(folder)
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert got[k] == pytest.approx(uninterrupted[k], rel=1e-5, abs=1e-6), k


# --------------------------------------------------------------------------- a kill after the last checkpoint

def _train(out, *extra):
    from mhar_ablate.cli import main

    return main(["train", "--output", str(out), "--steps", "4", *FAST, *extra])


def _only_run(out):
    (run,) = (out / "runs").iterdir()
    return run


def test_resume_of_a_completed_run_keeps_its_result(tmp_path, capsys):
    from mhar_ablate.cli import main

    out = tmp_path / "out"
    assert _train(out) == 0
    run = _only_run(out)
    before = (run / "result.json").read_text()
    capsys.readouterr()
    assert main(["train", "--output", str(out), "--resume", run.name]) == 0
    assert "completed" in capsys.readouterr().out
    assert (run / "result.json").read_text() == before  # not rewritten, and still completed


def test_run_killed_between_its_last_checkpoint_and_its_result_completes_on_resume(tmp_path, capsys, monkeypatch):
    import mhar_ablate.training.run as run_mod
    from mhar_ablate.cli import main

    real = run_mod.write_json

    def dies_before_the_result(path, obj):
        if path.name == "result.json":
            raise SimulatedKill
        real(path, obj)

    monkeypatch.setattr(run_mod, "write_json", dies_before_the_result)
    out = tmp_path / "out"
    with pytest.raises(SimulatedKill):
        _train(out)
    monkeypatch.undo()
    run = _only_run(out)
    assert not (run / "result.json").exists() and (run / "checkpoints" / "last.ckpt").exists()
    # A completed run's last checkpoint is its end: weights and the run's record, no optimiser state.
    from mhar_ablate.model.weights import read_checkpoint
    from mhar_ablate.training.checkpoint import record_of

    state = read_checkpoint(run / "checkpoints" / "last.ckpt")
    assert "optimizer_states" not in state and record_of(state)["status"] == "completed"
    capsys.readouterr()
    assert main(["train", "--output", str(out), "--resume", run.name]) == 0
    assert "nothing left to train" in capsys.readouterr().out
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["step"] == 4
    assert [p["step"] for p in result["curve"]][0] == 0 and result["curve"][-1]["step"] == 4
    assert result["routing_weights"] and (run / "routing.png").is_file()  # the heatmap comes from the record


@pytest.mark.parametrize("window", ["before result.json", "before the database records it"])
def test_study_killed_after_a_trials_last_checkpoint_finishes_on_rerun(tmp_path, capsys, monkeypatch, window):
    """Every rerun used to call that trial interrupted, exit 130 and rewrite a completed result.json."""
    import mhar_ablate.training.run as run_mod
    from mhar_ablate.cli import main

    args = ["study", str(write_study(tmp_path, steps=4)), "--output", str(tmp_path / "out"), "--seeds", "1", *FAST]
    if window == "before result.json":
        real = run_mod.write_json

        def kill(path, obj):
            if path.name == "result.json" and path.parent.name == "mhar-h2-s0":
                raise SimulatedKill
            real(path, obj)

        monkeypatch.setattr(run_mod, "write_json", kill)
    else:
        kill_before_record(monkeypatch, "mhar-h2")
    with pytest.raises(SimulatedKill):
        main(args)
    monkeypatch.undo()
    fail_running_trials(tmp_path / "out")
    folder = tmp_path / "out" / "studies" / "pair" / "steps"
    capsys.readouterr()
    for _ in range(2):  # the rerun finishes it; the one after finds nothing to do
        assert main(args) == 0
        assert json.loads((folder / "mhar-h2-s0" / "result.json").read_text())["status"] == "completed"
    assert "nothing to train" in capsys.readouterr().out
    assert main(["export", "pair", "--output", str(tmp_path / "out")]) == 0
    assert "| mhar-h2 | 1 |" in capsys.readouterr().out


# --------------------------------------------------------------------------- checkpoint cadence

def _saved_steps(monkeypatch):
    import lightning

    steps: list[int] = []
    real = lightning.Trainer.save_checkpoint

    def spy(self, path, *a, **k):
        steps.append(self.global_step)
        return real(self, path, *a, **k)

    monkeypatch.setattr(lightning.Trainer, "save_checkpoint", spy)
    return steps


def test_a_checkpoint_is_written_at_every_evaluation_under_the_defaults(tmp_path, monkeypatch):
    """With train.checkpoint_every at its default, a run shorter than it used to write no checkpoint
    before its end, so a SIGKILL lost all of it."""
    from mhar_ablate.config import build_config
    from mhar_ablate.training.run import train_run

    fast = dict(a.split("=", 1) for a in FAST if not a.startswith("train.checkpoint_every"))
    cfg = build_config(overrides=fast | {"train.steps": "12", "train.eval_every": "4"})
    assert cfg.train.checkpoint_every == build_config().train.checkpoint_every > 60
    steps = _saved_steps(monkeypatch)
    result = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda m: None)
    evals = [p["step"] for p in result["curve"]]
    assert evals == [0, 3, 6, 9, 12]
    assert steps == [3, 6, 9, 12]  # after every evaluation but the one before training, and at the end


def test_checkpoints_between_evaluations_every_checkpoint_every_seconds(tmp_path, monkeypatch):
    from mhar_ablate.config import build_config
    from mhar_ablate.training.run import train_run

    cfg = build_config(overrides=dict(a.split("=", 1) for a in FAST)
                       | {"train.steps": "6", "train.eval_every": "1", "train.checkpoint_every": "1e-9"})
    steps = _saved_steps(monkeypatch)
    train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda m: None)
    assert steps == [1, 2, 3, 4, 5, 6]  # the only evaluations are at 0 and 6: the rest are time marks


# --------------------------------------------------------------------------- Ctrl-C twice

def _signal_during(monkeypatch, when_step: int, second: str):
    """A first SIGINT during optimiser step ``when_step``; the second either in the same step
    (``step``) or while the checkpoint that the first one asked for is written (``checkpoint``)."""
    import os

    import lightning

    from mhar_ablate.training.module import LMModule

    real_step, real_save = LMModule.training_step, lightning.Trainer.save_checkpoint
    state = {"first": False, "second": False}

    def step(self, batch, idx):
        if self.global_step == when_step and not state["first"]:
            state["first"] = True
            os.kill(os.getpid(), signal.SIGINT)
            if second == "step":
                state["second"] = True
                os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, batch, idx)

    def save(self, path, *a, **k):
        if state["first"] and not state["second"] and second == "checkpoint":
            state["second"] = True
            os.kill(os.getpid(), signal.SIGINT)  # lands inside the write below
        return real_save(self, path, *a, **k)

    monkeypatch.setattr(LMModule, "training_step", step)
    monkeypatch.setattr(lightning.Trainer, "save_checkpoint", save)
    return state


@pytest.mark.parametrize("second", ["checkpoint", "step"])
def test_ctrl_c_twice_keeps_a_whole_checkpoint_and_exits_130(tmp_path, capsys, monkeypatch, second):
    """Lightning answered the second KeyboardInterrupt with sys.exit(1): nothing printed, and the
    checkpoint the first Ctrl-C was writing was lost."""
    from mhar_ablate.cli import main
    from mhar_ablate.model.weights import read_checkpoint

    out = tmp_path / "out"
    state = _signal_during(monkeypatch, 5, second)
    code = main(["train", "--output", str(out), "--steps", "12", *FAST])
    monkeypatch.undo()
    assert state["second"] and code == 130
    printed = capsys.readouterr()
    assert "resume with: mhar-ablate train" in printed.out and "Traceback" not in printed.err
    run = _only_run(out)
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "interrupted" and "second SIGINT" in result["reason"]
    saved = read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"]
    # The first Ctrl-C's checkpoint is whole (step 6); a second Ctrl-C mid-step keeps the evaluation's (step 4).
    assert saved == (6 if second == "checkpoint" else 4)
    assert not list(run.rglob("*.tmp")), "no torn temporary file is left"
    assert main(["train", "--output", str(out), "--resume", run.name]) == 0
    assert f"resuming from the checkpoint at step {saved}" in capsys.readouterr().out
    assert json.loads((run / "result.json").read_text())["step"] == 12
