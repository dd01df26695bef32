"""Bad input fails fast, before any training: one clear line on stderr, exit code 2, no traceback
(unless --debug), and nothing trained or created."""

from __future__ import annotations

import json
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
    (["study", "nosuch"], "unknown studie"),
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
