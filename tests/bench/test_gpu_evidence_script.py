"""``benchmarks/gpu_evidence.sh``, the script that grows the evidence studies across device calls and
sessions, on the CPU with a tiny study: the state archive it writes is what a later session needs to
go on (databases and results, no images or events), and restoring it never overwrites a newer state."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def evidence(work: Path, out: Path, restore: Path | None = None, studies: str = "budget:1") -> str:
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "PACK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if restore is not None:
        env["RESTORE"] = str(restore)
    done = subprocess.run(["bash", "benchmarks/gpu_evidence.sh", "steps", "300", studies, "--preset", "tiny",
                           "--steps", "2", "train.eval_batches=1", "data.final_sequences=8"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_state_archive_resumes_a_finished_study_and_never_overwrites_newer_state(tmp_path):
    out = evidence(tmp_path / "work", tmp_path / "out")
    assert "budget steps: 3 runs" in out and "exit 0" in out
    state = tmp_path / "out" / "state.tgz"
    names = tarfile.open(state).getnames()
    assert any(n.endswith("studies/budget/steps/mhar-h8-s0/result.json") for n in names)
    assert any(n.endswith(".journal") or n.endswith("studies.db") for n in names)
    assert not any(n.endswith((".png", ".ckpt", ".safetensors")) or "/tb/" in n for n in names)

    # A fresh machine: the study is restored and found finished (nothing trains again).
    again = evidence(tmp_path / "fresh", tmp_path / "out2", restore=state)
    assert "restored budget-steps" in again and "budget steps: 3 runs" in again
    log = (tmp_path / "fresh" / "evidence" / "budget-steps" / "log" / "study-budget-steps.log").read_text()
    assert "nothing to train" in log

    # A warm machine already holds a state: RESTORE leaves it alone.
    marker = tmp_path / "work" / "evidence" / "budget-steps" / "newer"
    marker.write_text("kept")
    third = evidence(tmp_path / "work", tmp_path / "out3", restore=state, studies="")  # no study: the restore alone
    assert "restored" not in third and marker.read_text() == "kept"
