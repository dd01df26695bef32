"""Helpers shared by the reliability tests: a small two-arm study and a real CLI process to break."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = ["model.seq_len=32", "train.batch_size=4", "train.eval_every=6", "train.eval_batches=1",
        "data.val_sequences=4", "residual.backend=reference", "train.threads=1",
        "train.checkpoint_every=0"]


def write_study(folder: Path, steps: int = 48, extra_arm: str = "") -> Path:
    path = folder / "pair.yaml"
    path.write_text(
        "description: two arms\nfixed: {model.preset: tiny}\n"
        "arms:\n  baseline: {residual.kind: baseline}\n  mhar-h2: {residual.kind: mhar, residual.heads: 2}\n"
        f"{extra_arm}baseline: baseline\nseeds: 2\nbudgets: {{steps: {steps}, wallclock: 2s}}\n")
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mhar_ablate", *args]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("MHAR_ABLATE_CACHE", None)
    return e


def trial_in_progress(study_folder: Path) -> Path | None:
    """A trial folder with a checkpoint but no result yet: a run caught mid-way."""
    if not study_folder.is_dir():
        return None
    for p in study_folder.iterdir():
        if (p / "checkpoints" / "last.ckpt").exists() and not (p / "result.json").exists():
            return p
    return None


def run_and_signal(args: list[str], study_folder: Path, sig: signal.Signals, timeout: float = 120) -> tuple[int, Path]:
    """Start the CLI, wait until a trial has checkpointed mid-way, send ``sig``; return (exit code, trial)."""
    proc = subprocess.Popen(cli(*args), env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    victim = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            victim = trial_in_progress(study_folder)
            if victim is not None:
                proc.send_signal(sig)
                break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert victim is not None, f"no trial was caught mid-way; output:\n{out}"
    return proc.returncode, victim


def final_losses(study_folder: Path) -> dict[str, float]:
    return {p.name: json.loads((p / "result.json").read_text())["final_val_loss"]
            for p in sorted(study_folder.iterdir()) if (p / "result.json").exists()}


def fail_running_trials(output: Path, key: str = "pair-steps") -> None:
    """What the rerun's check for dead workers does for a process that was killed mid-trial: an
    in-process "kill" leaves its trial running under a process that still exists."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name=key, storage=f"sqlite:///{output / 'studies.db'}")
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)


class SimulatedKill(BaseException):
    """The process dies here (a BaseException, so no handler of the package can record anything)."""


def kill_before_record(monkeypatch, arm: str) -> None:
    """The trial of ``arm`` dies after training, before its result reaches the study database."""
    from mhar_ablate import study as study_mod

    real_record = study_mod._record

    def kill(trial, result):
        if trial.params["arm"] == arm:
            raise SimulatedKill
        real_record(trial, result)

    monkeypatch.setattr(study_mod, "_record", kill)
