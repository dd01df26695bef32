"""Files: exports, checkpoints and data caches are written atomically, so a failure mid-write never
leaves a half-written file that a rerun trusts; a full disk is one clear error."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from mhar_ablate import io as atomic
from mhar_ablate.cli import main
from mhar_ablate.errors import UsageError

from reliability_helpers import FAST, write_study


class SimulatedCrash(Exception):
    pass


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "table.md"
    atomic.write_text(path, "old table\n")
    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(UsageError, match="no space left on device while writing .*table.md"):
        atomic.write_text(path, "new table that never lands\n")
    assert path.read_text() == "old table\n"
    assert [p.name for p in tmp_path.iterdir()] == ["table.md"], "no temporary file is left behind"


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("files")
    out = tmp / "out"
    assert main(["study", str(write_study(tmp, steps=4)), "--output", str(out), "--seeds", "1", *FAST]) == 0
    return out


def test_export_on_a_full_disk_is_one_clear_line_and_keeps_the_previous_table(finished_study, capsys, monkeypatch):
    assert main(["export", "pair", "--output", str(finished_study)]) == 0
    table = finished_study / "studies" / "pair" / "steps" / "table.md"
    before = table.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(os, "replace", enospc)
    assert main(["export", "pair", "--output", str(finished_study)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no space left on device while writing") and "\n" not in err
    assert table.read_bytes() == before


def test_checkpoint_on_a_full_disk_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import lightning

    monkeypatch.setattr(lightning.Trainer, "save_checkpoint", lambda self, path, *a, **k: enospc())
    code = main(["train", "--output", str(tmp_path / "out"), "--steps", "4", *FAST])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: no space left on device while writing") and "last.ckpt" in err
    assert not list((tmp_path / "out").rglob("*.ckpt")), "no partial checkpoint is left"


def test_checkpoints_are_replaced_atomically(tmp_path, monkeypatch):
    """A checkpoint write that dies half-way leaves the previous checkpoint, not a torn file."""
    import lightning

    from mhar_ablate.config import build_config
    from mhar_ablate.model.weights import read_checkpoint
    from mhar_ablate.training.run import train_run

    cfg = build_config(overrides=dict(a.split("=", 1) for a in FAST) | {"train.steps": "12"})
    calls = {"n": 0}
    real = lightning.Trainer.save_checkpoint

    def dies_on_third(self, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            Path(path).write_bytes(b"half a checkpoint")
            raise SimulatedCrash  # the process dies mid-write
        return real(self, path, *a, **k)

    monkeypatch.setattr(lightning.Trainer, "save_checkpoint", dies_on_third)
    with pytest.raises(SimulatedCrash):
        train_run(cfg, tmp_path / "run", tmp_path / "cache", log=lambda m: None)
    state = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")  # still the second, intact
    assert state["global_step"] > 0


def test_corrupt_data_cache_is_rebuilt_not_trusted(tmp_path):
    from mhar_ablate.config import DataConfig
    from mhar_ablate.data import load_corpus

    src = tmp_path / "text.txt"
    src.write_text("hello world, " * 2000)
    cfg = DataConfig(source=str(src))
    # A copy: the first load is a memory map of the very file this test truncates.
    expected = load_corpus(cfg, tmp_path / "cache").train.copy()
    tokens = sorted((tmp_path / "cache").rglob("*.bin"))
    assert tokens
    with open(tokens[0], "r+b") as f:  # a torn write: the file is cut short
        f.truncate(10)
    again = load_corpus(cfg, tmp_path / "cache")
    assert len(again.train) == len(expected) and (again.train == expected).all()


# --------------------------------------------------------------------------- everything stays under --output

def test_export_of_a_copied_or_moved_study_writes_only_under_its_output(finished_study, tmp_path, capsys):
    import shutil

    original_table = finished_study / "studies" / "pair" / "steps" / "table.md"
    original_table.unlink(missing_ok=True)
    copy = tmp_path / "copy"
    shutil.copytree(finished_study, copy)
    assert main(["export", "pair", "--output", str(copy)]) == 0
    written = capsys.readouterr().err.split("written: ", 1)[1].strip().split(", ")
    assert written and all(Path(f).resolve().is_relative_to(copy.resolve()) for f in written), written
    assert (copy / "studies" / "pair" / "steps" / "table.md").is_file()
    assert not original_table.exists(), "the original study was not written to"
    moved = tmp_path / "moved"
    copy.rename(moved)
    assert main(["export", "pair", "--output", str(moved)]) == 0
    assert not copy.exists(), "the old location was not recreated"


# --------------------------------------------------------------------------- disk

def test_finished_trials_checkpoints_are_removed(finished_study):
    runs = sorted((finished_study / "studies" / "pair" / "steps").glob("*-s0"))
    assert len(runs) == 2 and all((r / "result.json").is_file() for r in runs)
    assert not list(finished_study.rglob("*.ckpt")), "a finished trial keeps no checkpoint"


def test_keep_checkpoints_keeps_them(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["study", str(write_study(tmp_path, steps=2)), "--output", str(out), "--seeds", "1",
                 "--keep-checkpoints", *FAST]) == 0
    assert len(list(out.rglob("last.ckpt"))) == 2


def test_a_trial_does_not_start_without_room_for_its_checkpoints(tmp_path, capsys, monkeypatch):
    from collections import namedtuple

    import mhar_ablate.io as io_mod
    from mhar_ablate.config import build_config
    from mhar_ablate.model import routing_overhead
    from mhar_ablate.training.checkpoint import checkpoint_bytes

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(io_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))  # 1 MB free
    out = tmp_path / "out"
    code = main(["study", str(write_study(tmp_path, steps=2)), "--output", str(out), "--seeds", "1", *FAST])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "not enough free space" in err
    cfg = build_config(overrides={"residual.kind": "baseline"})
    needed = 2 * checkpoint_bytes(routing_overhead(cfg.model, cfg.residual, 256)[0])  # a checkpoint and its replacement
    assert "arm 'baseline' seed 0: not enough free space" in err
    assert f"needs about {io_mod.human_bytes(needed)}" in err and "which has 1.0 MB free" in err
    assert not list(out.rglob("result.json")) and not list(out.rglob("*.ckpt"))


def test_checkpoint_size_estimate_covers_a_real_checkpoint(tmp_path):
    from mhar_ablate.config import build_config
    from mhar_ablate.model import routing_overhead
    from mhar_ablate.training.checkpoint import checkpoint_bytes
    from mhar_ablate.training.run import train_run
    from mhar_ablate.training.stop import StopRequest

    cfg = build_config(overrides=dict(a.split("=", 1) for a in FAST) | {"train.steps": "2"})
    params = routing_overhead(cfg.model, cfg.residual, 256)[0]
    stopped = StopRequest()
    stopped.signal = "SIGTERM"  # asked before the first step: the run stops after it, with a checkpoint
    stopped_run = train_run(cfg, tmp_path / "stopped", tmp_path / "cache", log=lambda m: None, stop=stopped)
    assert stopped_run["status"] == "interrupted"
    size = (tmp_path / "stopped" / "checkpoints" / "last.ckpt").stat().st_size
    assert 12 * params <= size <= checkpoint_bytes(params)  # fp32 weights and AdamW's two moments
    # A completed run's last checkpoint leaves the optimiser's state out: about a third of that.
    assert train_run(cfg, tmp_path / "done", tmp_path / "cache", log=lambda m: None)["status"] == "completed"
    assert 4 * params <= (tmp_path / "done" / "checkpoints" / "last.ckpt").stat().st_size < 8 * params


def test_a_checkpoint_replaced_while_it_is_read_is_read_again(tmp_path, monkeypatch):
    """A run renames its new checkpoint over the old one while another process reads it (a study's second
    worker checking the points still to train). torch.load with mmap opens the file twice, so the read can
    fail on the mix of both files: it is read again, and the new checkpoint is what comes back. A broken
    file that nothing replaced is refused at once, in one clear error."""
    import torch

    from mhar_ablate.model import weights as checkpoint

    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(3)}, "global_step": 4}, path)
    newer = tmp_path / "last.ckpt.tmp"
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 8}, newer)
    real_load, calls = torch.load, []

    def load_while_replaced(f, *args, **kwargs):
        calls.append(f)
        if newer.exists():  # the run renames its new checkpoint over the file mid-read
            os.replace(newer, path)
            raise RuntimeError("unexpected EOF: the size of the file is smaller than the requested size")
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "load", load_while_replaced)
    state = checkpoint.read_checkpoint(path, mmap=True)
    assert state["global_step"] == 8 and len(calls) == 2

    path.write_bytes(b"not a checkpoint")
    calls.clear()
    with pytest.raises(UsageError, match="cannot be loaded safely.*delete it"):
        checkpoint.read_checkpoint(path, mmap=True)
    assert len(calls) == 1
