"""Reproducible environments: what each result and study records about the software it ran with, the
refusal to continue under other library versions, and what the package declares it needs."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata

import optuna
import pytest
import torch

from mhar_ablate.cli import main
from mhar_ablate.provenance import CHECKOUT, environment

from reliability_helpers import FAST, REPO, SimulatedKill, fail_running_trials, kill_before_record, write_study


def test_environment_names_the_libraries_and_the_checkout():
    env = environment()
    for name in ("torch", "triton", "lightning", "optuna"):
        assert env[name] == metadata.version(name)
    assert env["mhar-ablate"] == metadata.version("mhar-ablate")
    if (CHECKOUT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", env["git_commit"]) and isinstance(env["git_dirty"], bool)


def test_a_study_records_its_versions_and_refuses_others_unless_allowed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    args = ["study", str(write_study(tmp_path, steps=2)), "--output", str(out), "--seeds", "1", *FAST]
    kill_before_record(monkeypatch, "mhar-h2")  # the second trial's result never reaches the database
    with pytest.raises(SimulatedKill):
        main(args)
    monkeypatch.undo()
    fail_running_trials(out)
    storage = f"sqlite:///{out / 'studies.db'}"
    study = optuna.load_study(study_name="pair-steps", storage=storage)
    current = environment()
    assert study.user_attrs["environment"] == current
    done = next(t for t in study.trials if t.state.name == "COMPLETE")
    assert done.user_attrs["environment"] == current
    run = out / "studies" / "pair" / "steps" / "baseline-s0"
    assert (run / "result.json").read_text().count(f'"torch": "{current["torch"]}"') == 1

    study.set_user_attr("environment", {**current, "torch": "0.0.1", "optuna": "1.0.0"})
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was run under torch 0.0.1, optuna 1.0.0" in err
    assert f"this environment has torch {current['torch']}, optuna {current['optuna']}" in err
    assert "--allow-version-change" in err

    assert main([*args, "--allow-version-change"]) == 0
    study = optuna.load_study(study_name="pair-steps", storage=storage)
    assert study.user_attrs["environment"] == current
    assert study.user_attrs["environment_history"][-1]["torch"] == "0.0.1"  # what the earlier trials ran under


def test_a_checkpoint_is_not_resumed_under_other_versions_unless_allowed(tmp_path, capsys):
    from mhar_ablate.training.checkpoint import RECORD

    out = tmp_path / "out"
    assert main(["train", "--output", str(out), "--steps", "2", *FAST]) == 0
    run = next((out / "runs").iterdir())
    (run / "result.json").unlink()  # as after a kill: resuming reads the checkpoint
    ckpt = run / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state[RECORD]["environment"]["lightning"] = "1.0.0"
    torch.save(state, ckpt)
    capsys.readouterr()
    assert main(["train", "--output", str(out), "--resume", run.name]) == 2
    err = capsys.readouterr().err
    assert "written under lightning 1.0.0" in err and "--allow-version-change" in err
    assert main(["train", "--output", str(out), "--resume", run.name, "--allow-version-change"]) == 0


# --------------------------------------------------------------------------- what the package declares

def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements():
    from packaging.requirements import Requirement

    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    extras = [Requirement(r) for group in project.get("optional-dependencies", {}).values() for r in group]
    return {r.name.lower(): r for r in reqs}, {r.name.lower() for r in extras}


def test_every_imported_package_is_declared():
    imported: set[str] = set()
    for path in (REPO / "mhar_ablate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in ("mhar_ablate", "__future__")}
    dists = metadata.packages_distributions()
    required, extras = _requirements()
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731  (PEP 503: lm_eval is lm-eval)
    declared = {norm(n) for n in set(required) | extras}
    undeclared = [m for m in sorted(third_party) if not {norm(d) for d in dists.get(m, [m])} & declared]
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert "sqlalchemy" in required and "scipy" in required
    assert "torchmetrics" not in required, "declared but not used"


@pytest.mark.parametrize("name,version", [("torch", "2.11.0"), ("torch", "2.13.0"), ("triton", "3.6.0"),
                                          ("triton", "3.9.0"), ("optuna", "5.0.0")])
def test_the_requirements_admit_the_stacks_in_use(name, version):
    required, _ = _requirements()
    assert required[name].specifier.contains(version), f"{name} {version} is refused by {required[name]}"


def test_a_private_api_dependency_has_an_upper_bound():
    """kernels/mhar_triton.py drives Triton's interpreter through its internals, which a later release
    may change."""
    required, _ = _requirements()
    assert any(s.operator in ("<", "<=", "~=", "==") for s in required["triton"].specifier), required["triton"]
