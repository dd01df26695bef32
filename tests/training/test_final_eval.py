"""The final evaluation on the large fixed held-out set, and time to a target loss: the set is the same
for every arm and seed, its standard error is the per-sequence one, it stays outside the training clock,
and the export shows both (with – for runs recorded before they existed)."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import time

import numpy as np
import optuna
import pytest
import torch

from mhar_ablate.config import build_config
from mhar_ablate.data import TokenDataModule
from mhar_ablate.reporting.table import build_table
from mhar_ablate.reporting.render import render
from mhar_ablate.model import Decoder
from mhar_ablate.reporting.to_target import crossing, speedup, to_target
from mhar_ablate.training import final_eval
from mhar_ablate.training.run import train_run
from run_helpers import cfg_for

FINAL = {"data.final_sequences": "24"}


def test_the_final_set_is_the_same_for_every_arm_and_seed_and_held_out(tmp_path):
    windows = []
    for kind, seed in (("baseline", 0), ("mhar", 3), ("hc", 7)):
        cfg = cfg_for(tmp_path, residual__kind=kind, seed=seed, **FINAL)
        dm = TokenDataModule(cfg.data, cfg.model.seq_len, cfg.train.batch_size, cfg.seed, tmp_path / "cache",
                             eval_batches=cfg.train.eval_batches, final_sequences=cfg.final_sequences())
        dm.setup()
        windows.append(dm.final_windows)
        val = np.asarray(dm.corpus.val)
    assert windows[0].shape == (24, 33)
    assert all(np.array_equal(windows[0], w) for w in windows[1:])
    # every window is a slice of the held-out tail, and they are spread over all of it
    text = val.tobytes() if val.dtype == np.uint8 else None
    starts = [text.find(w.astype(np.uint8).tobytes()) for w in windows[0]] if text is not None else []
    assert starts and min(starts) == 0 and all(s >= 0 for s in starts)
    assert max(starts) > len(val) - 2 * 33


def test_the_final_set_size_defaults_by_preset_and_is_capped_by_the_held_out_part(tmp_path):
    assert build_config().final_sequences() == 512
    assert build_config(overrides={"model.preset": "small"}).final_sequences() == 16_384
    assert build_config(overrides={"data.final_sequences": "100"}).final_sequences() == 100
    cfg = cfg_for(tmp_path, data__final_sequences=10**6)
    dm = TokenDataModule(cfg.data, cfg.model.seq_len, 4, 0, tmp_path / "cache", final_sequences=10**6)
    dm.setup()
    assert len(dm.final_windows) == len(dm.corpus.val) // 33


def test_a_held_out_part_too_small_for_the_final_set_is_said_with_what_would_hold_it(tmp_path, capsys):
    # 100 windows of 33 tokens held out of 100,000 tokens; 1,000 asked: 33 % would hold them.
    line = final_eval.shortfall(0.01, 3_300, 100_000, 32, 1_000)
    assert "1,000 sequences asked" in line and "holds 100 windows of 33 tokens" in line
    assert "data.val_fraction=0.33 would hold them" in line
    assert "too small" in final_eval.shortfall(0.01, 3_300, 100_000, 32, 10**6)
    assert final_eval.shortfall(0.01, 3_300, 100_000, 32, 100) is None  # it holds them
    assert final_eval.shortfall(0.01, 3_300, 100_000, 32, 0) is None  # the final evaluation is off
    from mhar_ablate.cli import main

    cfg = cfg_for(tmp_path)
    over = [f"{k}={v}" for k, v in cfg.flat().items() if k in ("data.source", "model.seq_len", "train.batch_size",
                                                             "data.val_sequences", "residual.backend")]
    assert main(["train", "--output", str(tmp_path / "out"), "--steps", "2", *over, "data.final_sequences=1000000",
                 "model.preset=tiny", "train.eval_every=1"]) == 0
    out = capsys.readouterr().out
    assert "final evaluation: 1,000,000 sequences asked" in out and "too small to hold them" in out


def test_standard_error_is_per_sequence_on_a_constructed_example():
    losses = [2.0, 2.5, 3.0, 3.5]
    s = final_eval.summarize(losses, seq_len=8)
    assert s["loss"] == pytest.approx(2.75) and s["sequences"] == 4 and s["tokens"] == 32
    # sample std of 2.0..3.5 is sqrt(5/12); over sqrt(4)
    assert s["se"] == pytest.approx(math.sqrt(5 / 12) / 2, rel=1e-12)
    # a constant offset between two runs has no evaluation noise; a sequence-wise one has
    assert final_eval.paired_se([x + 0.1 for x in losses], losses) == pytest.approx(0.0, abs=1e-12)
    assert final_eval.paired_se([2.1, 2.5, 3.1, 3.5], losses) == pytest.approx(statistics.stdev([0.1, 0, 0.1, 0]) / 2)
    assert math.isnan(final_eval.paired_se(losses, losses[:3]))


def test_per_sequence_losses_are_each_rows_mean_and_average_to_the_token_mean(tmp_path):
    cfg = cfg_for(tmp_path)
    model = Decoder(cfg.model, cfg.residual, 256)
    x = torch.randint(0, 256, (6, 32))
    y = torch.randint(0, 256, (6, 32))
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    out = final_eval.evaluate(model, batches, torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False), 32)
    with torch.no_grad():
        logits = model(x)
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none").view(6, 32)
    assert out["sequence_losses"] == pytest.approx(per_token.mean(1).tolist(), abs=1e-6)
    assert out["loss"] == pytest.approx(per_token.mean().item(), abs=1e-6)
    assert out["se"] == pytest.approx(per_token.mean(1).std().item() / math.sqrt(6), rel=1e-4)


def test_a_run_ends_with_the_final_evaluation_outside_the_training_clock(tmp_path, monkeypatch):
    """... and a run killed between its final checkpoint and its result keeps it: the final checkpoint
    records the final evaluation, and the result rebuilt from it has it too."""
    real = final_eval.evaluate

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(final_eval, "evaluate", slow)
    cfg = cfg_for(tmp_path, train__steps=4, residual__kind="baseline", **FINAL)
    result = train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda m: None)
    fe = result["final_eval"]
    assert result["status"] == "completed" and fe["sequences"] == 24 and fe["asked"] == 24
    assert len(fe["sequence_losses"]) == 24 and fe["se"] > 0 and fe["seconds"] > 0
    # the clock stood still through it: the run's training seconds are those of its last evaluation
    assert result["seconds"] - result["curve"][-1]["seconds"] < 0.5, "the final evaluation is not training time"
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["final_eval"]["loss"] == pytest.approx(fe["loss"])

    (tmp_path / "run" / "result.json").unlink()  # as if killed between the final checkpoint and the result
    monkeypatch.setattr(final_eval, "evaluate", None)  # nothing is evaluated again
    again = train_run(cfg, tmp_path / "run", tmp_path / "cache", resume=True, log=lambda m: None)
    assert again["final_eval"]["sequence_losses"] == fe["sequence_losses"]


# ------------------------------------------------------------------------------------------ time to target

CURVE = [(0, 0.0, 0, 5.0), (10, 2.0, 0, 3.0), (20, 4.0, 0, 2.0), (30, 6.0, 0, 1.8)]


def test_crossing_interpolates_steps_and_seconds_between_evaluations():
    assert crossing(CURVE, 2.5) == pytest.approx((15.0, 3.0))
    assert crossing(CURVE, 3.0) == pytest.approx((10.0, 2.0))
    assert crossing(CURVE, 1.9) == pytest.approx((25.0, 5.0))
    assert crossing(CURVE, 6.0) == (0.0, 0.0)  # reached at the start
    assert crossing(CURVE, 1.7) is None  # never reached: not extrapolated
    bumpy = [(0, 0.0, 0, 4.0), (10, 1.0, 0, 2.0), (20, 2.0, 0, 2.5), (30, 3.0, 0, 1.0)]
    assert crossing(bumpy, 2.0) == pytest.approx((10.0, 1.0))  # the first time, not the last


class Run:
    def __init__(self, seed, curve):
        self.seed, self.curve = seed, curve


def t95(df):
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def test_speedup_is_paired_by_seed_with_a_t_interval_on_logs_and_not_reached_is_counted():
    base = [Run(0, [(0, 0.0, 0, 4.0), (100, 10.0, 0, 2.0)]), Run(1, [(0, 0.0, 0, 4.0), (100, 12.0, 0, 2.2)])]
    fast = [Run(0, [(0, 0.0, 0, 4.0), (50, 6.0, 0, 2.0), (100, 12.0, 0, 1.8)]),
            Run(1, [(0, 0.0, 0, 4.0), (40, 6.0, 0, 2.2), (100, 15.0, 0, 2.0)])]
    slow = [Run(0, [(0, 0.0, 0, 4.0), (100, 8.0, 0, 2.5)]), Run(1, [(0, 0.0, 0, 4.0), (100, 9.0, 0, 2.1)])]
    rows, about = to_target({"base": base, "fast": fast, "slow": slow}, "base", None, t95)
    assert about["kind"] == "baseline" and about["per_seed"] == {0: 2.0, 1: 2.2}
    assert about["loss"] == pytest.approx(2.1)
    assert rows["base"]["steps_to_target"] == 100 and rows["base"]["speedup_steps"] is None
    f = rows["fast"]
    assert f["target_reached"] == 2 and f["steps_to_target"] == pytest.approx(45)
    ratios = [100 / 50, 100 / 40]
    m, lo, hi, n = f["speedup_steps"]
    logs = [math.log(r) for r in ratios]
    half = t95(1) * statistics.stdev(logs) / math.sqrt(2)
    assert n == 2 and m == pytest.approx(math.sqrt(2 * 2.5))
    assert (lo, hi) == pytest.approx((math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half)))
    assert f["speedup_time"][0] == pytest.approx(math.sqrt(10 / 6 * 12 / 6))
    s = rows["slow"]  # seed 0 never gets to 2.0; seed 1 reaches 2.2 at 1.9 / 2.0 of its last segment
    assert s["target_runs"] == 2 and s["target_reached"] == 1
    assert s["speedup_steps"][3] == 1 and math.isnan(s["speedup_steps"][1])
    named, about = to_target({"base": base, "slow": slow}, "base", 1.5, t95)
    assert about == {"kind": "loss", "loss": 1.5, "per_seed": {}}
    assert named["slow"]["target_reached"] == 0 and named["slow"]["speedup_time"] is None
    assert speedup([], t95) is None


# ------------------------------------------------------------------------------------------ export

def _study(final: bool):
    """An in-memory study of two arms and two seeds, with (or, as recorded before the final evaluation
    existed, without) its final-evaluation attributes."""
    study = optuna.create_study(study_name="toy")
    for k, v in {"study": "toy", "budget": "steps", "arms": ["baseline", "mhar-h4"], "seeds": 2,
                 "baseline": "baseline", "description": "toy"}.items():
        study.set_user_attr(k, v)
    dist = {"arm": optuna.distributions.CategoricalDistribution(["baseline", "mhar-h4"]),
            "seed": optuna.distributions.IntDistribution(0, 1)}
    for arm, shift, speed in (("baseline", 0.0, 1.0), ("mhar-h4", -0.05, 1.5)):
        for seed in (0, 1):
            end = 2.0 + shift + 0.02 * seed
            curve = [[0, 0.0, 0, 5.0], [50, 5.0 * speed, 800, 2.6 + shift], [100, 10.0 * speed, 1600, end]]
            attrs = {"status": "completed", "curve": curve, "tokens_per_s": 160 / speed, "peak_mem_gb": None,
                     "params": 1000, "param_overhead_pct": 0.5 if arm != "baseline" else 0.0, "device": "cpu",
                     "routing_backend": "reference"}
            if final:
                losses = [end + 0.01 * ((7 * i) % 5 - 2) + (0.002 * i if arm != "baseline" else 0) for i in range(20)]
                attrs.update({"final_eval_loss": statistics.fmean(losses), "final_eval_se": 0.003,
                              "final_eval_sequences": 20, "final_eval_losses": losses})
            study.add_trial(optuna.trial.create_trial(params={"arm": arm, "seed": seed}, distributions=dist,
                                                      value=end, user_attrs=attrs))
    return study


def test_export_shows_the_final_evaluation_and_time_to_target_columns():
    table = build_table(_study(final=True))
    mhar = next(r for r in table.rows if r["arm"] == "mhar-h4")
    assert mhar["final_n"] == 2 and mhar["final_se"] == pytest.approx(0.003)
    assert mhar["delta_final"][0] == pytest.approx(-0.05 + 0.019, abs=1e-9)
    assert mhar["delta_final_se"] == pytest.approx(statistics.stdev([0.002 * i for i in range(20)]) / math.sqrt(20))
    assert mhar["target_reached"] == 2 and mhar["speedup_steps"][0] > 1 and mhar["speedup_time"][0] < mhar["speedup_steps"][0]
    md = render(table, "md")
    assert "#### Final evaluation and time to target" in md and "Target: each seed's baseline final" in md
    line = next(l for l in md.splitlines() if l.startswith("| mhar-h4 |") and "×" in l and "[" in l.split("|")[5])
    assert "0.0030" in line
    rows = {r["arm"]: r for r in csv.DictReader(io.StringIO(render(table, "csv")))}
    assert float(rows["mhar-h4"]["final_loss_mean"]) == pytest.approx(mhar["final_loss"][0])
    assert float(rows["mhar-h4"]["speedup_steps"]) == pytest.approx(mhar["speedup_steps"][0])
    data = json.loads(render(table, "json"))
    assert data["target"]["kind"] == "baseline" and data["target"]["per_seed"] == {"0": 2.0, "1": 2.02}
    assert r"speed-up (steps)" in render(table, "latex")
    named = build_table(_study(final=True), target_loss=2.3)
    assert "Target: validation loss 2.3000 (--target-loss)" in render(named, "md")


def test_old_runs_without_a_final_evaluation_still_export_with_dashes():
    table = build_table(_study(final=False))
    md = render(table, "md")
    final_table = md.split("#### Final evaluation and time to target")[1]
    line = next(l for l in final_table.splitlines() if l.startswith("| mhar-h4 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:6] == ["–"] * 5  # n, loss, SE, Δ, SE of Δ
    assert cells[6] != "–"  # time to target needs only the curve
    rows = {r["arm"]: r for r in csv.DictReader(io.StringIO(render(table, "csv")))}
    assert rows["mhar-h4"]["final_loss_mean"] == ""


def test_a_study_from_before_the_final_set_keeps_its_identity(tmp_path):
    """The study's fingerprint leaves data.final_sequences out at its default, as it was computed before
    the key existed, so an earlier study continues; another size is another study."""
    import hashlib

    from study_helpers import study_run

    sr = study_run(tmp_path, seeds=1)
    del sr.overrides["data.final_sequences"]  # at its default
    configs = sr.configs()
    per_arm = {}
    for (arm, _), cfg in configs.items():
        flat = {k: v for k, v in cfg.flat().items() if k not in ("seed", "train.devices", "train.flops", "data.final_sequences", "train.logger")}
        per_arm[arm] = flat
    before = hashlib.sha256(json.dumps([per_arm, {"tune": sr.tune}], sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert sr.fingerprint(configs) == before
    sr.overrides["data.final_sequences"] = "100"
    assert sr.fingerprint(sr.configs()) != before
