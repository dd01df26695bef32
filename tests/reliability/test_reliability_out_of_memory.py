"""Out of GPU memory inside a trial: that trial fails with the reason, its worker frees the memory and
goes on with the next grid point, the command says what to rerun and exits 1, and the rerun retries it."""

from __future__ import annotations

import torch

import mhar_ablate.training.run as run_module
from mhar_ablate.cli import main
from mhar_ablate.sweep.catalog import load_studies
from mhar_ablate.sweep.definition import StudyDefinition, StudyRun
from mhar_ablate.sweep.driver import run_study

from reliability_helpers import FAST, write_study


def _baseline_runs_out_of_memory(monkeypatch):
    real = run_module.train_run
    calls = []

    def train_run(cfg, run_dir, *args, **kwargs):
        calls.append(run_dir.name)
        if run_dir.name.startswith("baseline-"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 46.50 MiB is free.")
        return real(cfg, run_dir, *args, **kwargs)

    monkeypatch.setattr(run_module, "train_run", train_run)
    return calls


def test_a_trial_out_of_memory_fails_alone_and_the_rerun_retries_it(tmp_path, monkeypatch):
    sr = StudyRun(StudyDefinition.load(str(write_study(tmp_path, steps=6))), "steps", tmp_path / "out",
                  dict(a.split("=", 1) for a in FAST), seeds=1)
    lines: list[str] = []
    calls = _baseline_runs_out_of_memory(monkeypatch)
    first = run_study(sr, log=lines.append)
    # The baseline is the grid's first point: the worker survived it and trained the next one.
    assert calls == ["baseline-s0", "mhar-h2-s0"]
    assert first["out_of_memory"] == 1 and first["done"] == 1 and not first["interrupted"]
    said = [m for m in lines if "out of GPU memory" in m]
    assert len(said) == 1 and "Tried to allocate 64.00 MiB" in said[0] and "total capacity" not in said[0]
    (study,) = load_studies(sr.output, "pair", "steps", None)
    failed = [t for t in study.trials if t.params.get("arm") == "baseline"]
    assert [t.state.name for t in failed] == ["FAIL"]
    assert failed[0].user_attrs["out_of_memory"].startswith("CUDA out of memory")

    monkeypatch.undo()
    again = run_study(sr, log=lambda m: None)
    assert again["ran"] == 1 and again["done"] == 2 and again["out_of_memory"] == 0


def test_the_command_exits_1_naming_the_rerun(tmp_path, monkeypatch, capsys):
    path = write_study(tmp_path, steps=6)
    _baseline_runs_out_of_memory(monkeypatch)
    argv = ["study", str(path), "--budget", "steps", "--seeds", "1", "--output", str(tmp_path / "out"), "--quiet", *FAST]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: 1 trial(s) ran out of GPU memory and 1 grid point(s) are unfinished: rerun `" in err
    monkeypatch.undo()
    assert main(argv) == 0


def test_train_out_of_memory_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    def train_run(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                     "capacity of 79.18 GiB of which 1.50 GiB is free.")

    monkeypatch.setattr(run_module, "train_run", train_run)
    argv = ["train", "--output", str(tmp_path / "out"), "--quiet", "residual.kind=baseline", *FAST,
            "train.steps=4"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of GPU memory (CUDA out of memory. Tried to allocate")
    assert "internal error" not in err[0] and "train.batch_size" in err[0]
