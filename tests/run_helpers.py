"""What tests of runs share: a small real-text corpus, a fast config on it, and a run's TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path

from mhar_ablate.config import build_config


def corpus(tmp_path: Path) -> Path:
    """A small real-text corpus: this package's own sources, so the test needs no download."""
    root = Path(__file__).resolve().parents[1] / "mhar_ablate"
    text = "\n\n".join(p.read_text() for p in sorted(root.rglob("*.py")))
    path = tmp_path / "corpus.txt"
    path.write_text(text * 2)
    return path


def cfg_for(tmp_path, **over):
    base = {"data.source": str(corpus(tmp_path)), "model.seq_len": "32", "train.batch_size": "4",
            "train.eval_every": "4", "train.eval_batches": "2", "data.val_sequences": "8",
            "residual.backend": "reference", "train.threads": "2"}
    base.update({k.replace("__", "."): str(v) for k, v in over.items()})
    return build_config(overrides=base)


def read_scalars(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    out = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    out["_images"] = acc.Tags()["images"]
    out["_val_walltimes"] = [e.wall_time for e in acc.Scalars("loss/val")]
    out["_val_steps_seconds"] = [e.step for e in acc.Scalars("loss/val_vs_train_seconds")]
    return out
