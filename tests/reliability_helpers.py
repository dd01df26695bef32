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
# A final evaluation of 8 sequences still runs every run's last stage; at these settings the tiny preset's
# default set of 512 took 1.27 s of a run on the CPU, 8 took 0.02 s.
FAST = ["model.seq_len=32", "train.batch_size=4", "train.eval_every=6", "train.eval_batches=1",
        "data.val_sequences=4", "data.final_sequences=8", "residual.backend=reference", "train.threads=1",
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


def signal_mid_trial(runs: list[tuple[list[str], Path, signal.Signals]], timeout: float = 120) -> list[tuple[int, Path]]:
    """Start a CLI process per (args, study folder, signal), all at once (their start-up, seconds of imports,
    overlaps); send each its signal once a trial of its own study has checkpointed and has no result yet,
    a run caught mid-way. Returns (exit code, that trial) per process."""
    procs = [subprocess.Popen(cli(*args), env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for args, _, _ in runs]
    deadline = time.monotonic() + timeout
    victims: list[Path | None] = [None] * len(runs)
    outs = [""] * len(runs)
    try:
        while time.monotonic() < deadline and any(v is None and p.poll() is None for v, p in zip(victims, procs)):
            for i, ((_, folder, sig), proc) in enumerate(zip(runs, procs)):
                if victims[i] is None and proc.poll() is None:
                    victims[i] = trial_in_progress(folder)
                    if victims[i] is not None:
                        proc.send_signal(sig)
            time.sleep(0.02)
        outs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for victim, out in zip(victims, outs):
        assert victim is not None, f"no trial was caught mid-way; output:\n{out}"
    return [(proc.returncode, victim) for proc, victim in zip(procs, victims)]


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
    from mhar_ablate.sweep import trials

    real_record = trials.record_result

    def kill(trial, result):
        if trial.params["arm"] == arm:
            raise SimulatedKill
        real_record(trial, result)

    monkeypatch.setattr(trials, "record_result", kill)  # the workers import it when a trial ends
