"""Checkpoints load the Lightning way, and checkpoints without hyperparameters still resume."""

from __future__ import annotations

import torch

from mhar_ablate.training.checkpoint import CHECKPOINT
from mhar_ablate.training.module import LMModule
from mhar_ablate.training.run import load_run_config, train_run

from run_helpers import cfg_for


def test_load_from_checkpoint_gives_the_trained_logits(tmp_path, monkeypatch):
    kept = {}
    real = LMModule.on_train_end if hasattr(LMModule, "on_train_end") else None

    def keep(self):
        kept["module"] = self
        if real is not None:
            real(self)

    monkeypatch.setattr(LMModule, "on_train_end", keep)
    cfg = cfg_for(tmp_path, train__steps=2, residual__kind="mhar", residual__heads=2)
    train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None)
    loaded = LMModule.load_from_checkpoint(tmp_path / "run" / CHECKPOINT, map_location="cpu")
    assert loaded.cfg.residual.heads == 2 and loaded.cfg.train.steps == 2
    idx = torch.randint(0, loaded.model.vocab_size if hasattr(loaded.model, "vocab_size") else 64, (2, 16))
    trained = kept["module"].cpu().eval()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(idx), trained(idx))


def test_checkpoint_without_hyperparameters_resumes(tmp_path):
    from mhar_ablate.training.stop import StopRequest

    cfg = cfg_for(tmp_path, train__steps=8, residual__kind="baseline", train__eval_every=4)
    stop = StopRequest()
    calls = {"n": 0}
    real = LMModule.training_step

    def step(self, batch, idx):
        calls["n"] += 1
        if calls["n"] == 3:
            stop.signal = "SIGINT"
        return real(self, batch, idx)

    LMModule.training_step = step
    try:
        first = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda s: None, stop=stop)
    finally:
        LMModule.training_step = real
    assert first["status"] == "interrupted"
    ckpt = tmp_path / "run" / CHECKPOINT
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    # As written before the module saved hyperparameters and the clock's state.
    for key in ("hyper_parameters", "hparams_name", "training_clock_state"):
        state.pop(key, None)
    torch.save(state, ckpt)
    done = train_run(load_run_config(tmp_path / "run"), tmp_path / "run", tmp_path / "cache", resume=True,
                     log=lambda s: None)
    assert done["status"] == "completed" and done["step"] == 8
