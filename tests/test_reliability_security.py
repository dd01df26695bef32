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
from mhar_ablate.study import redact

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
    import mhar_ablate.study as study_mod

    seen: list[str] = []
    real_open = study_mod.open_storage

    def sqlite_instead(url, create, **options):  # a password-bearing URL, served by a local SQLite file
        seen.append(url)
        return real_open(f"sqlite:///{tmp_path / 'out' / 'studies.db'}", create)

    monkeypatch.setattr(study_mod, "open_storage", sqlite_instead)
    from reliability_helpers import write_study

    url = "postgresql://carol:topsecret@127.0.0.1:5432/studies"
    code = main(["study", str(write_study(tmp_path, steps=2)), "--output", str(tmp_path / "out"), "--seeds", "1",
                 "--storage", url, *FAST])
    captured = capsys.readouterr()
    assert code == 0 and seen and seen[0] == url
    assert "topsecret" not in captured.out + captured.err
    assert "carol:***@" in captured.out
    for f in (tmp_path / "out").rglob("*"):
        if f.is_file() and f.suffix in (".yaml", ".json", ".md"):
            assert "topsecret" not in f.read_text(errors="ignore"), f
