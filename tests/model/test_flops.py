"""The FLOPs count and the equal-FLOPs budget: the count by hand at the tiny preset, runs that stop at the
steps their FLOPs buy, a study under the flops budget, its export, and bad values."""

from __future__ import annotations

import argparse
import csv
import io
import json

import pytest
import torch
import yaml

from mhar_ablate.cli import main
from mhar_ablate.cli.main import _warn_unused_budget_options
from mhar_ablate.config import build_config, format_flops, parse_flops
from mhar_ablate.errors import UsageError
from mhar_ablate.model.flops import flops_per_token, matmul_parameters
from mhar_ablate.variants import RESIDUALS
from mhar_ablate.sweep.definition import StudyDefinition, StudyRun
from mhar_ablate.sweep.trials import pruning_reporter
from mhar_ablate.sweep.driver import run_study
from mhar_ablate.training.run import train_run
from mhar_ablate.training.schedule import lr_factor
from study_helpers import FAST, FakeTrial
from run_helpers import cfg_for, corpus, read_scalars

BYTE_VOCAB = 256


def test_baseline_count_at_the_tiny_preset_is_the_hand_count():
    cfg = build_config(overrides={"residual.kind": "baseline"})
    # tiny: d 64, 4 layers, 4 heads of 16, 2 KV heads, MLP 192, window 128; bytes: vocabulary 256.
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192  # q, k, v, o; gate, up, down
    n_matmul = 4 * per_layer + 64 * 256  # and the (tied) output projection
    assert n_matmul == 212_992
    f = flops_per_token(cfg.model, cfg.residual, BYTE_VOCAB)
    assert f.matmul == 6 * 212_992
    assert f.attention == 12 * 4 * 4 * 16 * 128 == 393_216
    assert f.routing == 0
    assert f.total == 1_671_168


def test_matmul_parameters_are_the_decoders_matrices():
    from mhar_ablate.model import Decoder

    for over in ({}, {"model.tie_embeddings": "false", "model.head_dim": "32"}):
        cfg = build_config(overrides={"residual.kind": "baseline", **over})
        with torch.device("meta"):
            model = Decoder(cfg.model, cfg.residual, BYTE_VOCAB)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        output = 0 if model.lm_head is not None else model.embed.weight.numel()  # tied: the embedding
        assert matmul_parameters(cfg.model, BYTE_VOCAB) == linear + output


def test_every_routed_kind_counts_more_than_the_baseline():
    base = build_config(overrides={"residual.kind": "baseline"})
    base_total = flops_per_token(base.model, base.residual, BYTE_VOCAB).total
    for kind in RESIDUALS:
        if kind == "baseline":
            continue
        cfg = build_config(overrides={"residual.kind": kind})
        f = flops_per_token(cfg.model, cfg.residual, BYTE_VOCAB)
        assert f.routing > 0 and f.total > base_total, kind
    # MHAR, full grouping: sites 0..8 mix 1..9 sources, 12·d FLOPs per source; H splits d, so no H term.
    for heads in (1, 2, 8):
        cfg = build_config(overrides={"residual.kind": "mhar", "residual.heads": str(heads)})
        assert flops_per_token(cfg.model, cfg.residual, BYTE_VOCAB).routing == 12 * 64 * 45
    blocks = build_config(overrides={"residual.kind": "mhar", "residual.grouping": "block:2"})
    full = build_config(overrides={"residual.kind": "mhar"})
    assert (flops_per_token(blocks.model, blocks.residual, BYTE_VOCAB).routing
            < flops_per_token(full.model, full.residual, BYTE_VOCAB).routing)  # fewer sources per site


def test_flops_values_take_human_units():
    assert parse_flops("3e15") == parse_flops("3P") == parse_flops("3 PFLOPs") == parse_flops("3000T") == 3e15
    assert parse_flops(2.5e12) == parse_flops("2.5T") == 2.5e12
    assert format_flops(3.4e9) == "3.4 GFLOPs"
    for bad in ("abc", "3p", "-3P", "0", "inf", "3 parsecs"):
        with pytest.raises(UsageError):
            parse_flops(bad)


def _per_step(cfg, vocab: int) -> float:
    return flops_per_token(cfg.model, cfg.residual, vocab).total * cfg.train.batch_size * cfg.model.seq_len


def test_flops_budget_trains_the_steps_its_flops_buy_each_arm(tmp_path):
    """Equal FLOPs: the baseline trains 6 steps, MHAR (2 % more per token) 5; each run stops at its own
    last step fully decayed, with its FLOPs and step count recorded."""
    probe = cfg_for(tmp_path, residual__kind="baseline")
    budget = 6 * _per_step(probe, BYTE_VOCAB)
    steps = {}
    for kind in ("baseline", "mhar"):
        cfg = cfg_for(tmp_path, residual__kind=kind, residual__heads=2 if kind == "mhar" else "none",
                      train__budget="flops", train__flops=budget, train__eval_every=2)
        r = train_run(cfg, tmp_path / kind, tmp_path / "cache", log=lambda s: None)
        assert r["status"] == "completed" and r["budget"] == "flops"
        assert r["curve"][-1]["step"] == r["step"]
        assert r["flops"] == pytest.approx(r["step"] * _per_step(cfg, BYTE_VOCAB))
        assert budget - _per_step(cfg, BYTE_VOCAB) < r["flops"] <= budget  # the most whole steps that fit
        saved = yaml.safe_load((tmp_path / kind / "config.yaml").read_text())
        assert saved["train"]["steps"] == r["step"] and saved["train"]["flops"] == budget
        s = read_scalars(tmp_path / kind)
        assert len(s["loss/val_vs_gflops"]) == len(r["curve"])
        # the schedule's progress is FLOPs done / the FLOPs of the steps bought: step / steps
        assert s["optim/lr"] == pytest.approx([cfg.optim.lr * lr_factor(i / r["step"], cfg.optim) for i in range(r["step"])])
        steps[kind] = r["step"]
    assert steps == {"baseline": 6, "mhar": 5}
    # A finished folder is the same run when continued: the resolved steps do not make it another.
    again = cfg_for(tmp_path, residual__kind="baseline", train__budget="flops", train__flops=budget, train__eval_every=2)
    assert train_run(again, tmp_path / "baseline", tmp_path / "cache", resume=True, log=lambda s: None)["step"] == 6


def pair_study(tmp_path, budgets: str = "{steps: 4}"):
    path = tmp_path / "pair.yaml"
    path.write_text(
        "description: two arms\nfixed: {model.preset: tiny}\n"
        "arms:\n  baseline: {residual.kind: baseline}\n  mhar-h2: {residual.kind: mhar, residual.heads: 2}\n"
        f"baseline: baseline\nseeds: 1\nbudgets: {budgets}\n")
    return path


def test_study_under_the_flops_budget_and_its_export(tmp_path, capsys):
    """Without budgets.flops the FLOPs are the baseline's at budgets.steps: it trains 4 steps and MHAR 3.
    The export has the equal-FLOPs column pair, and with the steps budget run too, both rankings."""
    data = {**FAST, "data.source": str(corpus(tmp_path)), "train.eval_every": "2"}
    definition = StudyDefinition.load(str(pair_study(tmp_path)))
    out = tmp_path / "out"
    lines: list[str] = []
    flops = StudyRun(definition, "flops", out, dict(data), seeds=1)
    assert run_study(flops, log=lines.append)["done"] == 2
    assert any("which buy baseline 4, mhar-h2 3 steps" in line for line in lines)
    results = {arm: json.loads((flops.run_dir(arm, 0) / "result.json").read_text()) for arm in ("baseline", "mhar-h2")}
    assert {a: r["step"] for a, r in results.items()} == {"baseline": 4, "mhar-h2": 3}
    assert run_study(StudyRun(definition, "steps", out, dict(data), seeds=1), log=lines.append)["done"] == 2

    assert main(["export", "pair", "--output", str(out), "--budget", "flops", "--format", "csv"]) == 0
    rows = {r["arm"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    at = min(r["flops"] for r in results.values())  # MHAR's 3 steps: less than the baseline's 4
    assert float(rows["baseline"]["at_flops"]) == pytest.approx(at)
    assert rows["mhar-h2"]["delta_at_flops"] and not rows["baseline"]["delta_at_flops"]
    assert (flops.folder / "loss_vs_flops.png").stat().st_size > 0
    assert (flops.folder / "gap_vs_steps.png").read_bytes()[:4] == b"\x89PNG"  # one seed: the mean gap, no band

    assert main(["export", "pair", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"val loss @ {format_flops(at)} | Δ vs baseline" in captured.out
    assert "(flops budget)" in captured.out and "(steps budget)" in captured.out
    side = (out / "studies" / "pair" / "rankings.md").read_text()
    header = next(line for line in side.splitlines() if line.startswith("| rank"))
    assert "steps budget, at 4 steps" in header and f"flops budget, at {format_flops(at)}" in header
    assert "the ranking under each budget" in captured.err


def test_study_file_flops_budget_and_its_errors(tmp_path):
    d = StudyDefinition.load(str(pair_study(tmp_path, "{steps: 4, flops: 2.5T}")))
    sr = StudyRun(d, "flops", tmp_path / "out", {}, seeds=1)
    configs = sr.configs()
    assert {c.train.flops for c in configs.values()} == {2.5e12}
    sr.resolve_flops(configs, {p: BYTE_VOCAB for p in configs})
    per_step = {arm: _per_step(c, BYTE_VOCAB) for (arm, _), c in configs.items()}
    assert {arm: c.train.steps for (arm, _), c in configs.items()} == {a: int(2.5e12 // f) for a, f in per_step.items()}
    assert configs[("mhar-h2", 0)].train.steps < configs[("baseline", 0)].train.steps
    # the command line's --flops wins over the study's
    over = StudyRun(d, "flops", tmp_path / "out", {"train.flops": "1e12"}, seeds=1).configs()
    assert {c.train.flops for c in over.values()} == {1e12}

    with pytest.raises(UsageError, match="budgets.flops"):
        StudyDefinition.load(str(pair_study(tmp_path, "{flops: lots}")))
    tiny = StudyRun(d, "flops", tmp_path / "out", {"train.flops": "1000"}, seeds=1)
    with pytest.raises(UsageError, match="less than one training step"):
        configs = tiny.configs()
        tiny.resolve_flops(configs, {p: BYTE_VOCAB for p in configs})
    nobase = tmp_path / "nobase.yaml"
    nobase.write_text("fixed: {}\narms:\n  a: {residual.kind: mhar}\n")
    sr = StudyRun(StudyDefinition.load(str(nobase)), "flops", tmp_path / "out", {}, seeds=1)
    with pytest.raises(UsageError, match="no baseline arm"):
        configs = sr.configs()
        sr.resolve_flops(configs, {p: BYTE_VOCAB for p in configs})


def test_pruning_under_flops_reports_at_the_same_points_for_every_arm():
    """Arms train different step counts; their k-th evaluation is reported at the same point."""
    reported = []
    for steps in (8, 7):
        cfg = build_config(overrides={"train.budget": "flops", "train.flops": "1e12", "train.eval_every": "4",
                                      "train.steps": str(steps)})
        t = FakeTrial(prune_after=99)
        report = pruning_reporter(t, "flops", cfg)
        evals = [s for s in range(steps + 1) if s * 4 // steps > (s - 1) * 4 // steps or s == 0]
        for s in evals:
            report(s, 0.0, 1.0)
        reported.append([at for _, at in t.reports])
    assert reported[0] == reported[1] == [250, 500, 750, 1000]


@pytest.mark.parametrize("args, message", [
    (["--flops", "lots"], "not a number of FLOPs"),
    (["--flops", "-3P"], "must be a positive number"),
    ([], "--budget flops needs its length"),
    (["--flops", "1000"], "less than one training step"),
])
def test_bad_flops_budget_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code = main(["train", "--budget", "flops", *args, "--output", str(out), f"data.source={corpus(tmp_path)}",
                 "model.seq_len=32", "train.batch_size=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (out / "runs").exists()  # nothing was written


def test_a_length_option_of_another_budget_is_a_warning(capsys):
    ns = argparse.Namespace(steps=None, time=None, flops="3P")
    assert _warn_unused_budget_options(ns, "steps") and ns.flops is None
    assert "--flops applies to --budget flops" in capsys.readouterr().err
    ns = argparse.Namespace(steps=100, time=None, flops=None)
    assert not _warn_unused_budget_options(ns, "flops", study=True) and ns.steps == 100  # the baseline's steps
    assert _warn_unused_budget_options(ns, "flops") and ns.steps is None  # train: the steps follow from --flops
