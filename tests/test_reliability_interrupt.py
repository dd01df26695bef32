"""Interruption: SIGINT, SIGTERM and SIGKILL during a trial of a real study process. Rerunning the same
command resumes, and the study ends with the same results as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from reliability_helpers import FAST, REPO, cli, env, final_losses, run_and_signal, write_study


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clean")
    study = write_study(folder)
    out = folder / "out"
    done = subprocess.run(cli("study", str(study), "--budget", "steps", "--output", str(out), *FAST), env=env(),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return final_losses(out / "studies" / "pair" / "steps")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killed_study_resumes_to_the_same_results(tmp_path, sig, uninterrupted):
    study = write_study(tmp_path)
    out = tmp_path / "out"
    folder = out / "studies" / "pair" / "steps"
    args = ["study", str(study), "--budget", "steps", "--output", str(out), *FAST]
    code, victim = run_and_signal(args, folder, sig)
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:  # a graceful stop: checkpoint, record, exit 130
        assert code == 130
        assert json.loads((victim / "result.json").read_text())["status"] == "interrupted"
    assert (victim / "checkpoints" / "last.ckpt").exists()
    finished_before = {k for k, v in final_losses(folder).items()
                       if json.loads((folder / k / "result.json").read_text())["status"] == "completed"}

    rerun = subprocess.run(cli(*args), env=env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"{len(uninterrupted) - len(finished_before)} of {len(uninterrupted)} grid points to train" in rerun.stdout
    if sig == signal.SIGKILL:
        assert "resumed from their checkpoints" in rerun.stdout
    resumed = json.loads((victim / "result.json").read_text())
    assert resumed["status"] == "completed" and resumed["curve"][0]["step"] == 0
    got = final_losses(folder)
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert got[k] == pytest.approx(uninterrupted[k], rel=1e-5, abs=1e-6), k
