"""SIGKILL at the package's own commit points: a small study process dies at the N-th ``io.commit`` (a
file written to its temporary name, not yet renamed), the same command is run again, and the study ends
with the uninterrupted run's trial set and losses, no trial left running, and no temporary left behind.
Also the rule by which a start removes temporaries (``io.remove_stale_temporaries``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mhar_ablate.sweep.points import arm_seed
from reliability_helpers import FAST, REPO, env, final_losses, write_study

# A tiny study (2 arms x 1 seed, 2 steps) commits 14 files: 1-2 the token cache and its manifest,
# 3 storages.json, then per arm config.yaml, two checkpoints, (routing.png), result.json, weights. The
# sample: the registry, the first arm's result (its trial not yet recorded), the second arm's heatmap,
# and the second arm's weights after its result (a fixed-name temporary, rewritten by the rerun).
KILL_AT = [3, 7, 12, 14]

CHILD = textwrap.dedent("""
    import os, signal, sys
    import mhar_ablate.io as io

    at, real, count = int(sys.argv[1]), io.commit, [0]

    def commit(tmp, path):
        count[0] += 1
        if count[0] == at:  # the temporary is written and closed; the rename never comes
            os.kill(os.getpid(), signal.SIGKILL)
        real(tmp, path)

    io.commit = commit  # before the package's other modules import it by name
    from mhar_ablate.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _study_args(folder: Path) -> list[str]:
    return ["study", str(write_study(folder, steps=2)), "--budget", "steps", "--seeds", "1",
            "--output", str(folder / "out"), *FAST]


def _temporaries(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*.tmp"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, float]:
    from mhar_ablate.cli import main

    folder = tmp_path_factory.mktemp("clean")
    assert main(_study_args(folder)) == 0
    return final_losses(folder / "out" / "studies" / "pair" / "steps")


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[int, tuple[Path, int, list[Path]]]:
    """Per kill point: (folder, exit code, temporaries the kill left), the processes run at once."""
    folders = {n: tmp_path_factory.mktemp(f"kill{n}") for n in KILL_AT}
    procs = {n: subprocess.Popen([sys.executable, "-c", CHILD, str(n), *_study_args(f)], env=env(), cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n, f in folders.items()}
    out = {}
    for n, proc in procs.items():
        text = proc.communicate(timeout=300)[0]
        assert proc.returncode == -signal.SIGKILL, f"kill point {n} was not reached:\n{text}"
        out[n] = (folders[n], proc.returncode, _temporaries(folders[n] / "out"))
    return out


@pytest.mark.parametrize("n", KILL_AT)
def test_a_study_killed_at_a_commit_reruns_to_the_same_trials(n, killed, uninterrupted, capsys):
    import optuna
    from optuna.trial import TrialState

    from mhar_ablate.cli import main

    folder, code, left = killed[n]
    assert left, f"kill point {n} left no temporary: the commit point is not where this test thinks"
    assert main(_study_args(folder)) == 0
    out = folder / "out"
    got = final_losses(out / "studies" / "pair" / "steps")
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert got[k] == pytest.approx(uninterrupted[k], rel=1e-5, abs=1e-6), k
    study = optuna.load_study(study_name="pair-steps", storage=f"sqlite:///{out / 'studies.db'}")
    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    done = sorted(arm_seed(t) for t in trials if t.state == TrialState.COMPLETE)
    assert done == [("baseline", 0), ("mhar-h2", 0)]
    assert _temporaries(out) == [], f"temporaries left after the rerun of kill point {n}"


def test_the_cleanup_rule(tmp_path):
    from mhar_ablate.io import STALE_TEMPORARY_S, remove_stale_temporaries

    old = time.time() - STALE_TEMPORARY_S - 5
    names = {
        ".result.json.ab12_x9z.tmp": (old, True),  # ours, stale
        ".result.json.ab12_x9q.tmp": (None, False),  # ours, fresh: a live writer may be writing it
        ".storages.json.k3j4l5m6.tmp": (None, True),  # ours, fresh, but owned (its writers' lock is held)
        ".result.json.toolong12.tmp": (old, False),  # not mkstemp's 8 characters
        ".notes.ABCDEFGH.tmp": (old, False),  # upper case: not mkstemp's alphabet
        "result.json.tmp": (old, False),  # no leading dot
        "my.tmp": (old, False),
        "result.json": (old, False),
    }
    for name, (mtime, _) in names.items():
        (tmp_path / name).write_text("x")
        if mtime is not None:
            os.utime(tmp_path / name, (mtime, mtime))
    (tmp_path / ".config.yaml.abcdefgh.tmp").mkdir()  # a folder of that name is not ours
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / ".routing.png.abcdefgh.tmp").symlink_to(target)  # nor is a link (its target stays)
    os.utime(tmp_path / ".routing.png.abcdefgh.tmp", (old, old), follow_symlinks=False)
    removed = remove_stale_temporaries(tmp_path, owned=("storages.json",))
    assert sorted(p.name for p in removed) == sorted(k for k, (_, gone) in names.items() if gone)
    for name, (_, gone) in names.items():
        assert (tmp_path / name).exists() != gone, name
    assert (tmp_path / ".config.yaml.abcdefgh.tmp").is_dir() and target.read_text() == "keep"
    assert (tmp_path / ".routing.png.abcdefgh.tmp").is_symlink()
    # ``names`` limits which files' temporaries are taken at all
    (tmp_path / ".other.json.abcdefgh.tmp").write_text("x")
    os.utime(tmp_path / ".other.json.abcdefgh.tmp", (old, old))
    assert remove_stale_temporaries(tmp_path, names=("storages.json",)) == []
    assert remove_stale_temporaries(tmp_path / "missing") == []
