"""What tests of studies share: a fast two-arm study on the CPU and a stand-in for an Optuna trial."""

from __future__ import annotations

from pathlib import Path

from mhar_ablate.sweep.definition import StudyDefinition, StudyRun


# A final evaluation of 8 sequences: the tiny preset's default 512 took about 1.3 s of a run on the CPU.
FAST = {"model.seq_len": "32", "train.batch_size": "4", "train.eval_every": "3", "train.eval_batches": "1",
        "data.val_sequences": "4", "data.final_sequences": "8", "residual.backend": "reference", "train.threads": "2"}


def two_arm_study(tmp_path: Path) -> Path:
    path = tmp_path / "pair.yaml"
    path.write_text(
        "description: two arms\n"
        "fixed: {model.preset: tiny}\n"
        "arms:\n  baseline: {residual.kind: baseline}\n  mhar-h2: {residual.kind: mhar, residual.heads: 2}\n"
        "baseline: baseline\nseeds: 2\nbudgets: {steps: 6, wallclock: 2s}\ncurve: residual.heads\n")
    return path


def study_run(tmp_path, budget="steps", **kw) -> StudyRun:
    return StudyRun(StudyDefinition.load(str(two_arm_study(tmp_path))), budget, tmp_path / "out", dict(FAST),
                    seeds=kw.pop("seeds", 2), **kw)


class FakeTrial:
    def __init__(self, prune_after: int):
        self.reports: list[tuple[float, int]] = []
        self.prune_after = prune_after

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return len(self.reports) >= self.prune_after
