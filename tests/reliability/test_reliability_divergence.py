"""Divergence: a trial whose loss goes NaN/inf is a result (diverged, with the reason and its partial
curve), the study goes on, and a rerun does not train it again."""

from __future__ import annotations

import json
import math

from mhar_ablate.reporting.table import build_table
from mhar_ablate.reporting.render import render
from mhar_ablate.sweep.definition import StudyDefinition, StudyRun
from mhar_ablate.sweep.catalog import load_studies
from mhar_ablate.sweep.driver import run_study

from reliability_helpers import FAST, write_study


def strict_json(text: str):
    def refuse(name):  # NaN and Infinity are not JSON: a strict reader (jq, JavaScript) refuses them
        raise ValueError(f"not JSON: a bare {name}")

    return json.loads(text, parse_constant=refuse)


def test_diverged_trial_is_recorded_and_not_rerun(tmp_path):
    path = write_study(tmp_path, steps=12, extra_arm="  hot: {residual.kind: baseline, optim.lr: 1.0e+6, "
                                                      "optim.warmup: 0, optim.grad_clip: 0}\n")
    overrides = dict(a.split("=", 1) for a in FAST)
    sr = StudyRun(StudyDefinition.load(str(path)), "steps", tmp_path / "out", overrides, seeds=1)
    first = run_study(sr, log=lambda m: None)
    assert first["diverged"] == 1 and first["done"] == 3  # the other arms still ran
    hot = strict_json((sr.folder / "hot-s0" / "result.json").read_text())
    assert hot["status"] == "diverged" and "became" in hot["reason"]
    assert hot["curve"] and hot["curve"][0]["step"] == 0  # its partial curve is kept

    (study,) = load_studies(sr.output, "pair", "steps", None)
    trial = next(t for t in study.trials if t.params.get("arm") == "hot")
    assert trial.state.name == "COMPLETE" and trial.user_attrs["status"] == "diverged"
    assert trial.user_attrs["reason"] == hot["reason"]

    again = run_study(sr, log=lambda m: None)
    assert again["ran"] == 0  # a diverged trial is a result, not a crash

    table = build_table(study)
    row = next(r for r in table.rows if r["arm"] == "hot")
    assert row["n"] == 0 and row["diverged"] == 1
    assert table.at_step == 12  # the diverged curve does not drag the equal-step point down
    assert "(+1 diverged)" in render(table, "md")


def test_a_run_whose_validation_loss_is_nan_writes_strict_json(tmp_path):
    from mhar_ablate.config import build_config
    from mhar_ablate.training.run import finished_result, train_run

    over = dict(a.split("=", 1) for a in FAST) | {"train.steps": "6", "train.eval_every": "6", "optim.lr": "1e6",
                                                   "optim.warmup": "0", "optim.grad_clip": "0"}
    result = train_run(build_config(overrides=over), tmp_path / "run", tmp_path / "cache", log=lambda m: None)
    assert result["status"] == "diverged" and "validation loss became nan" in result["reason"]
    saved = strict_json((tmp_path / "run" / "result.json").read_text())
    assert saved["final_val_loss"] == "nan" and saved["curve"][-1]["val_loss"] == "nan"
    assert math.isnan(finished_result(tmp_path / "run")["final_val_loss"])  # read back as the float it was
