"""Security: checkpoints load without unpickling arbitrary objects, YAML loads safely, and storage URLs
with passwords are never printed or logged."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from mhar_ablate.cli import main
from mhar_ablate.config import load_yaml
from mhar_ablate.errors import UsageError
from mhar_ablate.redaction import redact

from reliability_helpers import FAST


class Payload:
    """Unpickling this would run code: it must never happen."""

    def __reduce__(self):
        return (Path.touch, (Path(__file__).parent / "PWNED-by-checkpoint",))


def test_tampered_checkpoint_is_refused_not_executed(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--output", str(out), "--steps", "3", *FAST]) == 0
    capsys.readouterr()
    run = next((out / "runs").iterdir())
    (run / "result.json").unlink()  # as after a kill before the result was written: resuming reads the checkpoint
    ckpt = run / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state["evil"] = Payload()
    with open(ckpt, "wb") as f:
        pickle.dump(state, f)
    marker = Path(__file__).parent / "PWNED-by-checkpoint"
    marker.unlink(missing_ok=True)
    code = main(["train", "--output", str(out), "--resume", run.name])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be loaded safely" in err
    assert not marker.exists()


def test_yaml_is_loaded_safely(tmp_path):
    marker = tmp_path / "PWNED-by-yaml"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"seed: !!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path ['{marker}']]\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_yaml(cfg)
    assert not marker.exists()


def test_storage_passwords_are_redacted():
    assert redact("postgresql://bob:hunter2@db.example:5432/studies") == "postgresql://bob:***@db.example:5432/studies"
    assert redact("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_study_log_never_shows_the_password(tmp_path, capsys, monkeypatch):
    from mhar_ablate.sweep import catalog, driver

    seen: list[str] = []
    real_open = catalog.open_storage

    def sqlite_instead(url, create, **options):  # a password-bearing URL, served by a local SQLite file
        seen.append(url)
        return real_open(f"sqlite:///{tmp_path / 'out' / 'studies.db'}", create)

    for module in (catalog, driver):  # the driver holds its own name for it; the workers import it from catalog
        monkeypatch.setattr(module, "open_storage", sqlite_instead)
    from reliability_helpers import write_study

    url = "postgresql://carol:topsecret@127.0.0.1:5432/studies"
    code = main(["study", str(write_study(tmp_path, steps=2)), "--output", str(tmp_path / "out"), "--seeds", "1",
                 "--storage", url, *FAST])
    captured = capsys.readouterr()
    assert code == 0 and seen and seen[0] == url
    assert "topsecret" not in captured.out + captured.err
    assert "carol:***@" in captured.out
    for f in (tmp_path / "out").rglob("*"):  # run folders, and the study's attributes in the database
        if f.is_file() and f.suffix in (".yaml", ".json", ".md", ".db"):
            assert b"topsecret" not in f.read_bytes(), f


SECRET = "s3cr3t-Pw"
CREDENTIAL_FORMS = [
    f"postgresql+psycopg2://:{SECRET}@127.0.0.1:1/db",  # an empty user name
    f"postgresql://alice@127.0.0.1:1/db?password={SECRET}",  # a driver parameter
    f"postgresql://alice@127.0.0.1:1/db?sslmode=require&sslpassword={SECRET}",
    f"mysql+pymysql://bob@127.0.0.1:1/db?passwd={SECRET}",
    f"postgresql://alice:{SECRET.replace('-', '%40')}@127.0.0.1:1/db",  # percent-encoded (an @ in it)
    f"postgresql://alice:pa@{SECRET}@127.0.0.1:1/db",  # an unencoded @ in the password
    f"mssql+pyodbc:///?odbc_connect=DRIVER%3D%7BODBC%7D%3BSERVER%3Dh%3BUID%3Du%3BPWD%3D{SECRET}",
    f"postgresql://alice@127.0.0.1:1/db?access_token={SECRET}",
]


@pytest.mark.parametrize("url", CREDENTIAL_FORMS)
def test_every_credential_form_is_redacted(url):
    from mhar_ablate.redaction import secrets_of

    shown = redact(url)
    assert "***" in shown
    for secret in secrets_of(url) | {SECRET}:
        assert secret not in shown, shown
    assert "127.0.0.1" in shown or "SERVER%3Dh" in shown  # what is not a secret stays readable


@pytest.mark.parametrize("url", CREDENTIAL_FORMS[:2])
def test_storage_errors_never_print_the_password(tmp_path, capsys, url):
    code = main(["study", "heads", "--output", str(tmp_path / "out"), "--storage", url])
    captured = capsys.readouterr()
    assert code == 2 and "cannot open study storage" in captured.err
    assert SECRET not in captured.out + captured.err


def test_registered_secrets_are_masked_in_log_records_and_warnings(monkeypatch):
    import logging
    import warnings

    from mhar_ablate.redaction import register

    url = f"postgresql://dave:{SECRET}x@db.example/studies"
    register(url)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("optuna.storages._rdb.test")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("engine %s failed", url.replace("postgresql://", "psycopg://"))
        logger.warning("the password was %s", f"{SECRET}x")
    finally:
        logger.removeHandler(handler)
    shown: list[str] = []
    # Python shows a warning through warnings.showwarning (pytest records them around it instead)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    register(url)
    warnings.showwarning(f"cannot reach {url}", UserWarning, "x.py", 1)
    assert len(records) == 2 and not any(SECRET in r for r in records), records
    assert shown and "cannot reach" in shown[0] and SECRET not in shown[0]
