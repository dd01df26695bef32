"""Bad input fails fast, before any training: one clear line on stderr, exit code 2, no traceback
(unless --debug), and nothing trained or created."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from mhar_ablate.cli import main

from reliability_helpers import FAST, write_study


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


def one_line(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


CASES = [
    (["study", "nosuch"], "unknown study 'nosuch'"),
    (["study", "heads", "model.preset=huge"], "unknown config 'huge'"),
    (["study", "heads", "model.d_modle=64"], "unknown config key"),
    (["study", "grouping", "residual.heads=3"], "does not divide"),
    (["study", "heads", "residual.heads=4"], "varies across its arms"),
    (["study", "heads", "residual.grouping=block:9"], "larger than model.n_layers"),
    (["study", "heads", "--steps", "0"], "must be positive"),
    (["study", "heads", "--budget", "wallclock", "--time", "-5m"], "positive"),
    (["study", "heads", "--time", "soon"], "not a duration"),
    (["study", "heads", "data.source=/no/such/folder"], "no such file or folder"),
    (["train", "residual.kind=hyper"], "unknown residual.kind"),
    (["train", "residual.grouping=block:0"], "at least 1"),
    (["train", "--steps", "-3"], "must be positive"),
    (["train", "--resume", "nosuchrun"], "no run"),
    (["train", "--config", "/no/such.yaml"], "not found"),
    (["train", "seed=-1"], "seed must be between 0 and 4294967295"),
    (["train", "seed=4294967296"], "seed must be between 0 and 4294967295"),
    (["train", "train.threads=-1"], "train.threads must be at least 1"),
    (["train", "optim.lr=inf"], "optim.lr must be a finite number"),
    (["train", "optim.weight_decay=nan"], "optim.weight_decay must be a finite number"),
    (["train", "--config", "/bin/sh"], "not a text file"),
    (["export", "heads"], "no study database"),
    (["frobnicate"], "invalid choice"),
]


@pytest.mark.parametrize("args,needle", CASES)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    code, err = run_cli(capsys, *args, "--output", str(out)) if args[0] != "frobnicate" else run_cli(capsys, *args)
    assert code == 2
    assert needle in one_line(err)
    assert not (out / "runs").exists() and not (out / "studies").exists(), "nothing was trained"


def test_empty_data_folder_fails_before_training(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = run_cli(capsys, "study", str(write_study(tmp_path)), "--output", str(tmp_path / "out"),
                        f"data.source={tmp_path / 'empty'}")
    assert code == 2 and "empty" in one_line(err)
    assert not (tmp_path / "out" / "studies").exists()


def test_missing_storage_folder_is_an_error_not_created(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}"
    code, err = run_cli(capsys, "study", str(write_study(tmp_path)), "--output", str(tmp_path / "out"), "--storage", url)
    assert code == 2 and "does not exist" in one_line(err)
    assert not (tmp_path / "nowhere").exists()


def test_unreachable_storage_hides_its_password(tmp_path, capsys):
    url = "postgresql://alice:s3cret-pw@127.0.0.1:1/studies"
    code, err = run_cli(capsys, "study", str(write_study(tmp_path)), "--output", str(tmp_path / "out"), "--storage", url)
    assert code == 2 and "cannot open study storage" in one_line(err)
    assert "s3cret-pw" not in err and "alice:***@" in err


def test_corrupt_database_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    db = out / "studies.db"
    db.write_bytes(b"this is not a database" * 100)
    code, err = run_cli(capsys, "study", str(write_study(tmp_path)), "--output", str(out), *FAST)
    assert code == 2 and "not an SQLite database" in one_line(err)
    assert db.read_bytes() == b"this is not a database" * 100  # never overwritten: it may hold results
    code, err = run_cli(capsys, "export", "pair", "--output", str(out))
    assert code == 2 and "not an SQLite database" in one_line(err)


def test_study_from_an_incompatible_version_is_refused(tmp_path, capsys):
    import optuna

    out = tmp_path / "out"
    study_file = write_study(tmp_path, steps=2)
    fast = list(FAST)
    assert main(["study", str(study_file), "--output", str(out), "--seeds", "1", *fast]) == 0
    capsys.readouterr()
    study = optuna.load_study(study_name="pair-steps", storage=f"sqlite:///{out / 'studies.db'}")
    assert study.user_attrs["version"]  # the package version is recorded in the study
    study.set_user_attr("format", 999)
    code, err = run_cli(capsys, "study", str(study_file), "--output", str(out), "--seeds", "1", *fast)
    assert code == 2 and "format 999" in one_line(err)
    code, err = run_cli(capsys, "export", "pair", "--output", str(out))
    assert code == 2 and "format 999" in one_line(err)


def test_debug_shows_the_traceback(capsys):
    from mhar_ablate.errors import UsageError

    with pytest.raises(UsageError):
        main(["train", "residual.heads=3", "--debug"])


# --------------------------------------------------------------------------- round two

def study_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    return path


@pytest.mark.parametrize("body,needle", [
    ("arms: {a: 5}\n", "arm 'a' must map config keys to values"),
    ("arms: {a: {residual.kind: baseline}}\nbudgets: [steps]\n", "'budgets' must map steps, wallclock and/or flops"),
    ("arms: {a: {residual.kind: baseline}}\nbudgets: {steps: -4}\n", "budgets.steps must be a positive integer"),
    ("arms: {a: {residual.kind: baseline}}\nfixed: [1]\n", "'fixed' must map config keys"),
    ("arms: {a: {residual.kind: baseline}}\nseeds: true\n", "seeds must be a positive integer"),
])
def test_malformed_study_files_are_one_line(tmp_path, capsys, body, needle):
    code, err = run_cli(capsys, "study", str(study_file(tmp_path, body)), "--output", str(tmp_path / "out"))
    assert code == 2 and needle in one_line(err)


@pytest.fixture
def cache_elsewhere(tmp_path, monkeypatch):
    """The token cache in its own folder (as with MHAR_ABLATE_CACHE), so that nothing about the output
    folder is found while the data load."""
    monkeypatch.setenv("MHAR_ABLATE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("command", ["train", "study"])
def test_an_output_path_that_is_a_file(tmp_path, capsys, cache_elsewhere, command):
    (tmp_path / "out").write_text("a file\n")
    args = ["train", "--steps", "2"] if command == "train" else ["study", str(write_study(tmp_path, steps=2)), "--seeds", "1"]
    code, err = run_cli(capsys, *args, "--output", str(tmp_path / "out"), *FAST)
    assert code == 2 and "is a file, not a folder" in one_line(err)
    assert (tmp_path / "out").read_text() == "a file\n"


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` and everything in it read-only: by permission bits for a user, by the immutable flag for
    root (whom permission bits do not stop)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, m in modes.items():
                p.chmod(m)
        return
    if subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("this file system cannot make a folder read-only for root (chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


@pytest.mark.parametrize("command", ["train", "study"])
def test_a_read_only_output_folder_is_one_line(tmp_path, capsys, cache_elsewhere, command):
    out = tmp_path / "out"
    out.mkdir()
    args = ["train", "--steps", "2"] if command == "train" else ["study", str(write_study(tmp_path, steps=2)), "--seeds", "1"]
    with read_only(out):
        code, err = run_cli(capsys, *args, "--output", str(out), *FAST)
    assert code == 2 and "cannot be written" in one_line(err)
    assert not list(out.iterdir())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-trial study: each test works on its own copy."""
    tmp = tmp_path_factory.mktemp("finished")
    out = tmp / "out"
    assert main(["study", str(write_study(tmp, steps=2)), "--output", str(out), "--seeds", "1", *FAST]) == 0
    return tmp


@pytest.fixture
def study_copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "copy")
    return tmp_path / "copy"


def test_rerunning_a_finished_study_in_a_read_only_folder_prints_its_table(study_copy, capsys, cache_elsewhere):
    args = ["study", str(study_copy / "pair.yaml"), "--output", str(study_copy / "out"), "--seeds", "1", *FAST]
    capsys.readouterr()
    with read_only(study_copy / "out"):
        code = main(args)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "| mhar-h2 | 1 |" in printed.out and "nothing to train" in printed.out


def test_a_corrupt_study_attribute_is_one_line(study_copy, capsys):
    import sqlite3

    db = study_copy / "out" / "studies.db"
    with sqlite3.connect(db) as con:
        con.execute("UPDATE study_user_attributes SET value_json = '{not json' WHERE key = 'arms'")
    for args in (["study", str(study_copy / "pair.yaml"), "--seeds", "1", *FAST], ["export", "pair"]):
        code, err = run_cli(capsys, *args, "--output", str(study_copy / "out"))
        assert code == 2 and "cannot be read: an attribute or a trial is corrupt" in one_line(err)


def test_a_checkpoint_from_another_arm_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--output", str(out), "--steps", "2", "residual.kind=baseline", *FAST]) == 0
    assert main(["train", "--output", str(out), "--steps", "2", "residual.kind=mhar", "residual.heads=4", *FAST]) == 0
    baseline, = (out / "runs").glob("*baseline*")
    mhar, = (out / "runs").glob("*mhar*")
    (mhar / "result.json").unlink()  # an unfinished run, whose checkpoint is then swapped for another arm's
    shutil.copy(baseline / "checkpoints" / "last.ckpt", mhar / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    code, err = run_cli(capsys, "train", "--output", str(out), "--resume", mhar.name)
    line = one_line(err)
    assert code == 2 and "was written by another run (arm 'baseline', seed 0)" in line and "residual.kind" in line


def test_a_run_folder_deleted_while_it_trains_is_one_line(tmp_path, capsys, monkeypatch):
    from mhar_ablate.training.module import LMModule

    out = tmp_path / "out"
    real = LMModule.training_step

    def deletes_its_folder(self, batch, idx):
        if self.global_step == 3:
            shutil.rmtree(next((out / "runs").iterdir()))
        return real(self, batch, idx)

    monkeypatch.setattr(LMModule, "training_step", deletes_its_folder)
    code, err = run_cli(capsys, "train", "--output", str(out), "--steps", "8", *FAST)
    assert code == 2 and "was deleted while it trained" in one_line(err)
    assert not list((out / "runs").iterdir()), "the folder is not recreated"


def test_every_grid_point_is_checked_before_the_first_trial_trains(tmp_path, capsys):
    """A corrupt checkpoint of the last grid point, or an arm whose vocabulary is too small, used to
    be found only when that trial came up, after the others had trained, without naming the arm."""
    out = tmp_path / "out"
    path = write_study(tmp_path, steps=2, extra_arm="  small-vocab: {residual.kind: baseline, model.vocab_size: 100}\n")
    code, err = run_cli(capsys, "study", str(path), "--output", str(out), "--seeds", "1", *FAST)
    assert code == 2 and "arm 'small-vocab' seed 0: model.vocab_size=100 is smaller than" in one_line(err)
    assert not (out / "studies").exists(), "nothing trained"

    path = write_study(tmp_path, steps=2)
    ckpt = out / "studies" / "pair" / "steps" / "mhar-h2-s0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint" * 64)
    code, err = run_cli(capsys, "study", str(path), "--output", str(out), "--seeds", "1", *FAST)
    assert code == 2 and "arm 'mhar-h2' seed 0: checkpoint" in one_line(err) and "cannot be loaded safely" in err
    assert not (out / "studies" / "pair" / "steps" / "baseline-s0").exists(), "nothing trained"
    assert ckpt.read_bytes() == b"not a checkpoint" * 64  # left for the user to look at


def test_options_that_do_not_apply_are_a_warning(tmp_path, capsys, study_copy):
    code = main(["train", "--output", str(tmp_path / "out"), "--budget", "steps", "--steps", "2", "--time", "5s", *FAST])
    err = capsys.readouterr().err
    assert code == 0 and "warning: --time applies to --budget wallclock" in err
    code = main(["study", str(study_copy / "pair.yaml"), "--output", str(study_copy / "out"), "--seeds", "1",
                 "seed=5", "--time", "5s", "--trials", "3", *FAST])
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert code == 0 and len(warnings) == 3, warnings
    assert "seed=5 is ignored" in warnings[1] and "--trials is ignored without --tune" in warnings[2]


def test_the_resume_hint_repeats_the_whole_command(tmp_path, capsys, monkeypatch):
    from mhar_ablate.training.module import LMModule

    real = LMModule.training_step

    def ctrl_c(self, batch, idx):
        if self.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch, idx)

    monkeypatch.setattr(LMModule, "training_step", ctrl_c)
    out = tmp_path / "my out"
    code, err = run_cli(capsys, "study", str(write_study(tmp_path)), "--output", str(out), "--steps", "4",
                        "--seeds", "1", *FAST)
    hint = next(l for l in err.splitlines() if l.startswith("interrupted: rerun"))
    assert code == 130
    assert f"--output '{out}'" in hint and "--steps 4" in hint and "--seeds 1" in hint and "train.threads=1" in hint
