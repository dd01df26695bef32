"""Logging through Lightning's logger API: tags, hyperparameters, the run folder as TensorBoard's run, csv
and (when installed) wandb offline."""

from __future__ import annotations

import csv
import os

import pytest
import yaml

from mhar_ablate.errors import UsageError
from mhar_ablate.training.run import train_run

from run_helpers import cfg_for, read_scalars


def test_tensorboard_tags_hparams_and_run_folder(tmp_path):
    cfg = cfg_for(tmp_path, train__steps=6, residual__kind="mhar", residual__heads=2, train__eval_every=2)
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    assert not (tmp_path / "run" / "tb").exists()  # events in the run folder: TensorBoard names the run by it
    s = read_scalars(tmp_path / "run")
    tags = [t for t in s if not t.startswith("_")]
    assert sorted(tags)[0].startswith("loss/")  # the loss section opens first
    assert not any(t.startswith(("hparams/", "train/", "val/")) for t in tags)
    assert len(s["time/train_seconds"]) >= r["step"]  # the training clock beside every logged step
    assert s["result/train_seconds"] == [pytest.approx(r["seconds"])]
    hp = yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())
    assert hp["arm"] == "mhar-h2" and hp["budget"] == "steps" and hp["seed"] == 0
    assert hp["residual.heads"] == 2 and "model.d_model" in hp and "train.steps" in hp
    assert not any(k.startswith("data.") for k in hp)


def test_csv_logger(tmp_path):
    cfg = cfg_for(tmp_path, train__steps=4, residual__kind="baseline", train__logger="csv")
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert sum(1 for row in rows if row.get("loss/train")) == r["step"]
    assert any(row.get("result/final_val_loss") for row in rows)
    assert yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())["arm"] == "baseline"


def test_wandb_missing_is_one_line(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "wandb" else real(name, *a, **k))
    from mhar_ablate.training.loggers import make_logger

    with pytest.raises(UsageError, match="pip install 'mhar-ablate\\[wandb\\]'"):
        make_logger(cfg_for(tmp_path, train__logger="wandb"), tmp_path / "run")


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = cfg_for(tmp_path, train__steps=3, residual__kind="baseline", train__logger="wandb")
    r = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    assert r["status"] == "completed"
    assert any((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_logger_key_is_checked(tmp_path):
    with pytest.raises(UsageError, match="train.logger"):
        cfg_for(tmp_path, train__logger="mlflow")
