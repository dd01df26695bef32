"""Studies end to end on the tiny preset: run, interrupt, resume, rerun (no training), export."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from mhar_ablate.cli import main
from mhar_ablate.errors import UsageError
from mhar_ablate.reporting.table import build_table
from mhar_ablate.reporting.render import render
from mhar_ablate.sweep.definition import StudyDefinition, StudyRun
from mhar_ablate.sweep.catalog import load_studies
from mhar_ablate.sweep.driver import run_study
from mhar_ablate.training.callbacks import StopRequest
from study_helpers import FAST, FakeTrial, study_run

def stop_at_step(monkeypatch, stop: StopRequest, n: int, signal: str = "SIGINT") -> None:
    """Request a stop in the n-th training step of the process (counting across trials)."""
    from mhar_ablate.training.module import LMModule

    steps = {"n": 0}
    real_step = LMModule.training_step

    def step(self, batch, idx):
        steps["n"] += 1
        if steps["n"] == n:
            stop.signal = signal
        return real_step(self, batch, idx)

    monkeypatch.setattr(LMModule, "training_step", step)


def test_study_interrupt_resume_rerun_and_export(tmp_path, capsys, monkeypatch, caplog):
    sr = study_run(tmp_path)
    del sr.overrides["data.final_sequences"]  # the tiny preset's own final set, checked after the resume below
    stop = StopRequest()
    lines: list[str] = []
    stop_at_step(monkeypatch, stop, 8)  # the first trial trains 6 steps: interrupt the second one mid-way
    first = run_study(sr, stop=stop, log=lines.append)
    monkeypatch.undo()
    assert first["interrupted"] and first["ran"] == 1
    interrupted = [p for p in sr.folder.iterdir() if (p / "checkpoints" / "last.ckpt").exists()
                   and json.loads((p / "result.json").read_text())["status"] == "interrupted"]
    assert len(interrupted) == 1, "the interrupted trial left a checkpoint to resume from"

    import logging

    import optuna

    optuna.logging.enable_propagation()  # Optuna's own handler writes around pytest's capture
    with caplog.at_level(logging.WARNING, logger="optuna"):
        second = run_study(sr, log=lines.append)
    optuna.logging.disable_propagation()
    assert not [r for r in caplog.records if r.name.startswith("optuna")], "a resumed study prints no Optuna warnings"
    assert not second["interrupted"] and second["ran"] == 3 and second["done"] == 4
    resumed = json.loads((interrupted[0] / "result.json").read_text())
    assert resumed["status"] == "completed" and resumed["step"] == 6
    assert resumed["curve"][0]["step"] == 0  # the curve kept its points from before the interruption
    assert resumed["final_eval"]["sequences"] == 512  # the tiny preset's final set, after the resume too

    third = run_study(sr, log=lines.append)
    assert third["ran"] == 0 and third["done"] == 4
    assert "nothing to train" in lines[-1]

    (study,) = load_studies(sr.output, "pair", "steps", None)
    states = sorted(t.state.name for t in study.trials)
    assert states == ["COMPLETE"] * 4 + ["FAIL"], "one failed trial: the interruption, and no other"
    table = build_table(study)
    assert [r["arm"] for r in table.rows] == ["baseline", "mhar-h2"]
    assert all(r["n"] == 2 for r in table.rows)
    assert table.at_step == 6
    md = render(table, "md")
    assert "| mhar-h2 | 2 |" in md and "**" in md and "Missing" not in md

    assert main(["export", "pair", "--output", str(sr.output), "--format", "csv"]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(out)))
    assert {r["arm"] for r in rows} == {"baseline", "mhar-h2"}
    assert all(float(r["final_loss_mean"]) > 0 and float(r["final_se"]) > 0 for r in rows)
    assert rows[0]["target_reached"] == "2"  # the baseline reaches its own final loss, by definition
    for name in ("table.csv", "loss_vs_steps.png", "loss_vs_time.png", "gap_vs_steps.png", "pair_curve.png"):
        assert (sr.folder / name).stat().st_size > 0, name
    assert main(["export", "pair", "--output", str(sr.output), "--format", "latex"]) == 0
    assert r"\begin{tabular}" in capsys.readouterr().out
    assert main(["export", "pair", "--output", str(sr.output), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["at_step"] == 6 and len(data["rows"]) == 2


def test_a_point_interrupted_by_an_earlier_run_trains_before_the_points_after_it(tmp_path, monkeypatch):
    sr = study_run(tmp_path)  # grid: baseline s0, mhar-h2 s0, baseline s1, mhar-h2 s1
    stop = StopRequest()
    stop_at_step(monkeypatch, stop, 8)  # interrupts the second point, mhar-h2 s0
    run_study(sr, stop=stop, log=lambda m: None)
    monkeypatch.undo()
    lines: list[str] = []
    second = run_study(sr, log=lines.append)
    assert second["ran"] == 3
    order = [m.split("] ", 1)[1].split(":", 1)[0] for m in lines if m.startswith("[") and "completed" in m]
    assert order == ["mhar-h2 s0", "baseline s1", "mhar-h2 s1"], "grid order, the resumed point first"


def test_unfinished_study_export_names_the_missing_trials(tmp_path, monkeypatch):
    sr = study_run(tmp_path, seeds=1)
    stop = StopRequest()
    stop_at_step(monkeypatch, stop, 8, "SIGTERM")
    run_study(sr, stop=stop, log=lambda m: None)
    (study,) = load_studies(sr.output, "pair", "steps", None)
    md = render(build_table(study), "md")
    assert "Missing trials:" in md and "crashed or interrupted" in md


def test_a_study_grows_by_seeds_and_keeps_the_runs_it_has(tmp_path, capsys):
    import sqlite3

    from optuna.distributions import CategoricalDistribution, distribution_to_json

    sr = study_run(tmp_path, seeds=1)
    sr.overrides["train.steps"] = "3"
    assert run_study(sr, log=lambda m: None)["ran"] == 2
    first = {p: p.read_bytes() for p in sr.folder.glob("*-s0/result.json")}
    assert len(first) == 2
    # As studies were written before the seed became a trial attribute: a categorical parameter whose
    # choices Optuna fixes. Such a study must grow too.
    with sqlite3.connect(sr.output / "studies.db") as con:
        ids = [r[0] for r in con.execute("SELECT trial_id FROM trials")]
        for i in ids:
            con.execute("INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json) "
                        "VALUES (?, 'seed', 0.0, ?)", (i, distribution_to_json(CategoricalDistribution([0]))))
        con.execute("DELETE FROM trial_user_attributes WHERE key = 'seed'")
    grown = study_run(tmp_path, seeds=2)
    grown.overrides["train.steps"] = "3"
    assert run_study(grown, log=lambda m: None)["ran"] == 2  # seed 1 of each arm, nothing again
    assert {p: p.read_bytes() for p in sr.folder.glob("*-s0/result.json")} == first
    (study,) = load_studies(sr.output, "pair", "steps", None)
    md = render(build_table(study), "md")
    assert "| baseline | 2 |" in md and "| mhar-h2 | 2 |" in md and "Missing trials" not in md
    # Fewer seeds would leave trained ones out of its tables: one line from the command, nothing lost.
    capsys.readouterr()
    args = ["study", str(tmp_path / "pair.yaml"), "--output", str(sr.output), "--budget", "steps", "--seeds", "1",
            "train.steps=3", *(f"{k}={v}" for k, v in FAST.items())]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run with 2 seed(s) per arm; --seeds 1 would drop some" in err
    assert {p: p.read_bytes() for p in sr.folder.glob("*-s0/result.json")} == first


def test_changed_configuration_is_refused_not_mixed(tmp_path):
    sr = study_run(tmp_path, seeds=1)
    sr.overrides["train.steps"] = "3"
    run_study(sr, log=lambda m: None)
    sr.overrides["model.d_model"] = "32"
    with pytest.raises(UsageError, match="different configuration"):
        run_study(sr, log=lambda m: None)


def test_export_of_unknown_study_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["export", "nosuch", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def test_tensorboard_command_points_at_the_study(tmp_path, capsys):
    sr = study_run(tmp_path, seeds=1)
    sr.overrides["train.steps"] = "2"
    run_study(sr, log=lambda m: None)
    assert main(["tensorboard", "pair", "--output", str(sr.output), "--print"]) == 0
    assert f"--logdir {sr.output / 'studies' / 'pair'}" in capsys.readouterr().out


def test_tune_picks_a_learning_rate_per_arm_then_runs_the_grid(tmp_path):
    sr = study_run(tmp_path, seeds=1, tune="lr", tune_trials=2)
    sr.overrides["train.steps"] = "3"
    summary = run_study(sr, log=lambda m: None)
    assert summary["done"] == 2
    import optuna

    storage = f"sqlite:///{sr.output / 'studies.db'}"
    lrs = {}
    for arm in ("baseline", "mhar-h2"):
        tune = optuna.load_study(study_name=f"pair-steps-tune-lr-{arm}", storage=storage)
        assert len(tune.trials) == 2
        lrs[arm] = tune.best_params["lr"]
    (study,) = load_studies(sr.output, "pair", "steps", None)
    for t in study.trials:
        assert t.user_attrs["lr"] == pytest.approx(lrs[t.params["arm"]])  # each arm trains at its own best rate
    assert run_study(sr, log=lambda m: None)["ran"] == 0  # finished searches are not rerun


def test_pruning_reports_at_steps_or_training_seconds():
    from mhar_ablate.sweep.trials import pruning_reporter

    t = FakeTrial(prune_after=3)
    report = pruning_reporter(t, "steps")
    assert report(0, 0.0, 5.0) is False  # the evaluation before training is not a result
    assert report(10, 1.5, 4.0) is False and report(20, 3.1, 3.5) is False
    assert report(30, 4.6, 3.2) is True
    assert [s for _, s in t.reports] == [10, 20, 30]

    t = FakeTrial(prune_after=99)
    report = pruning_reporter(t, "wallclock")
    report(10, 1.4, 4.0); report(12, 1.9, 3.9); report(30, 7.2, 3.0)
    assert [s for _, s in t.reports] == [1, 7]  # whole training seconds, one report per second


def test_cpt_study_pretrains_once_and_continues_both_ways(tmp_path, capsys):
    """The source stage trains once per seed for both budgets; plain and delta start from its weights (their
    step-0 loss is its final one, exactly) and read the same batches after it; the export reports Δ against
    plain continued training with the start as its own row."""
    path = tmp_path / "cpt.yaml"
    path.write_text(
        "description: cpt\nfixed: {model.preset: tiny}\n"
        "source: {residual.kind: baseline, train.budget: steps, train.steps: 4}\n"
        "arms:\n  plain: {residual.kind: baseline}\n"
        "  delta-h2-b2: {residual.kind: delta, residual.heads: 2, residual.grouping: 'block:2'}\n"
        "baseline: plain\nseeds: 1\nbudgets: {steps: 3, wallclock: 1s}\n")
    definition = StudyDefinition.load(str(path))
    lines: list[str] = []
    steps = StudyRun(definition, "steps", tmp_path / "out", dict(FAST), seeds=1)
    assert run_study(steps, log=lines.append)["done"] == 2
    source = json.loads((steps.source_dir(0) / "result.json").read_text())
    assert source["status"] == "completed" and source["step"] == 4
    for arm in ("plain", "delta-h2-b2"):
        result = json.loads((steps.folder / f"{arm}-s0" / "result.json").read_text())
        assert result["curve"][0]["step"] == 0 and result["curve"][0]["val_loss"] == source["final_val_loss"]
    configs = steps.configs()
    assert {c.train.first_batch for c in configs.values()} == {4}  # both read on after the source's batches
    wall = StudyRun(definition, "wallclock", tmp_path / "out", dict(FAST), seeds=1)
    assert run_study(wall, log=lines.append)["done"] == 2
    assert sum("source s0: pretraining" in line for line in lines) == 1  # shared by both budgets
    (study,) = load_studies(tmp_path / "out", "cpt", "steps", None)
    table = build_table(study)
    start = next(r for r in table.rows if r.get("start"))
    assert start["loss_at_steps"][0] == pytest.approx(source["final_val_loss"])
    text = render(table, "md")
    assert "| start (source checkpoint) | 1 |" in text and "(start)" in text and "gain over plain" in text


def test_cpt_study_file_builds_every_arm_from_one_source():
    d = StudyDefinition.load("cpt")
    sr = StudyRun(d, "steps", Path("/tmp/cpt-check"), {}, seeds=d.seeds)
    configs = sr.configs()
    assert len(d.arms) == 7 and d.baseline == "plain"
    kinds = {(c.residual.kind, c.residual.resolved_heads(), c.residual.grouping) for (a, s), c in configs.items()}
    assert kinds == {("baseline", None, "full")} | {("delta", h, g) for h in (1, 4, 8) for g in ("block:2", "block:1")}
    for (arm, seed), c in configs.items():
        assert c.train.init == str(sr.source_dir(seed).resolve() / "checkpoints" / "last.ckpt")
        assert c.train.first_batch == 300
    src = sr.source_configs()[0]
    assert src.residual.kind == "baseline" and src.train.steps == 300


def test_source_stage_must_be_a_baseline_under_steps(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("fixed: {}\nsource: {residual.kind: mhar}\narms:\n  plain: {residual.kind: baseline}\n")
    sr = StudyRun(StudyDefinition.load(str(path)), "steps", tmp_path / "out", {}, seeds=1)
    with pytest.raises(UsageError, match="source stage must be residual.kind=baseline"):
        sr.configs()


def test_grid_is_seed_major_so_a_partial_study_is_balanced():
    """Workers take grid points in order: a study stopped after k * arms trials holds every arm at seeds 0..k-1."""
    d = StudyDefinition.load("budget")
    sr = StudyRun(d, "steps", Path("/tmp/grid-order"), {}, seeds=3)
    grid = sr.grid()
    assert len(grid) == len(set(grid)) == 3 * len(d.arms)
    first = grid[:len(d.arms)]
    assert {arm for arm, _ in first} == set(d.arms) and {seed for _, seed in first} == {0}
    assert [seed for _, seed in grid] == sorted(seed for _, seed in grid)
