"""``benchmarks/publish_results.py``'s choices on hand-made run folders: which run's heatmap is published,
the per-run table with each arm's throughput spread, and the provenance the runs recorded. (The export
it runs first is tested with the export.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def pub():
    return load_script("publish_results")


def run(folder: Path, arm: str, seed: int, final: float | None, status="completed", tps=100.0, heatmap=True,
        dirty=False, weights=None, finished_at=None):
    d = folder / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    env = {"mhar-ablate": "0.1.0", "torch": "2.11.0", "git_commit": "abcdef1234567890", "git_dirty": dirty}
    result = {"arm": arm, "seed": seed, "status": status, "step": 10, "seconds": 15.0, "tokens_per_s": tps,
              "final_val_loss": 2.0, "final_eval": None if final is None else {"loss": final},
              "device": "NVIDIA H200", "environment": env, "routing_weights": weights}
    if finished_at is not None:
        result["finished_at"] = finished_at
    (d / "result.json").write_text(json.dumps(result))
    if heatmap:
        (d / "routing.png").write_bytes(b"png")
    os.utime(d / "result.json", (1_796_000_000, 1_796_000_000))


def test_the_published_heatmap_is_the_best_completed_mhar_runs(tmp_path, pub):
    run(tmp_path, "baseline", 0, 1.50, heatmap=False)  # better, but not MHAR
    run(tmp_path, "mhar-h4", 0, 1.90)
    run(tmp_path, "mhar-h8", 0, 1.80)
    run(tmp_path, "mhar-h8", 1, 1.70, status="diverged")  # not completed
    run(tmp_path, "mhar-h16", 0, 1.60, heatmap=False)  # no heatmap to publish
    best = pub.best_mhar(pub.runs_of(tmp_path))
    assert (best["arm"], best["seed"]) == ("mhar-h8", 0)
    assert pub.best_mhar(pub.runs_of(tmp_path / "none")) is None


def test_a_heatmap_is_drawn_from_the_recorded_weights_when_the_image_did_not_travel(tmp_path, pub):
    # Two sites of a two-head router: one source, then two (the shapes result.json records).
    weights = [[[1.0, 1.0]], [[0.9, 0.2], [0.1, 0.8]]]
    run(tmp_path, "mhar-h2", 0, 1.80)  # has its image, but is worse
    run(tmp_path, "mhar-h2", 1, 1.70, heatmap=False, weights=weights)
    run(tmp_path, "mhar-h4", 0, 1.60, heatmap=False)  # neither image nor weights: not a candidate
    best = pub.best_mhar(pub.runs_of(tmp_path))
    assert (best["arm"], best["seed"]) == ("mhar-h2", 1)
    pub.write_heatmap(best, tmp_path / "best.png")
    assert (tmp_path / "best.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pub.write_heatmap(pub.runs_of(tmp_path)[0], tmp_path / "copied.png")  # mhar-h2 s0: its own file
    assert (tmp_path / "copied.png").read_bytes() == b"png"


def test_runs_table_and_provenance(tmp_path, pub):
    run(tmp_path, "baseline", 0, 1.5, tps=100_000.0)
    run(tmp_path, "baseline", 1, 1.6, tps=102_000.0, dirty=True)
    runs = pub.runs_of(tmp_path)
    table = pub.runs_table(runs)
    assert "| baseline | 0 | completed | 10 | 15.0 | 100,000 |" in table
    assert "| baseline | 2 | 100,000 | 102,000 | 2.00 |" in table  # two runs, 2 % apart
    text = pub.provenance(runs, ["bash benchmarks/gpu_study.sh heads wallclock 560"], "heads", "wallclock")
    assert "bash benchmarks/gpu_study.sh heads wallclock 560" in text
    assert "- device: NVIDIA H200" in text and "- git commit: abcdef123456 (dirty)" in text
    assert "- results written: 2026-11-30" in text and " to " not in text.split("results written")[1]


def test_provenance_dates_come_from_the_results_not_the_files(tmp_path, pub):
    # An archive's round trip between machines can move a file's time; a result says when it was made.
    run(tmp_path, "baseline", 0, 1.5, finished_at="2026-12-07 09:21 UTC")
    run(tmp_path, "baseline", 1, 1.6, finished_at="2026-12-07 09:46 UTC")
    text = pub.provenance(pub.runs_of(tmp_path), ["cmd"], "heads", "steps")
    assert "- results written: 2026-12-07 09:21 UTC to 2026-12-07 09:46 UTC" in text
