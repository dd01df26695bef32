"""The command line's habits: --version, --print-config that --config reads back to the same text, --quiet,
tensorboard --host, no progress-bar frames off a terminal, and training's lines printed above the bar."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from mhar_ablate import __version__
from mhar_ablate.cli import main

from reliability_helpers import FAST, write_study


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_version_names_the_package_and_its_libraries(capsys):
    rc, out, _ = run(capsys, ["--version"])
    assert rc == 0
    first, second = out.strip().splitlines()
    assert first == f"mhar-ablate {__version__}"
    for name in ("torch", "triton", "lightning", "optuna"):
        assert f"{name} {metadata.version(name)}" in second


@pytest.mark.parametrize("command", [["train", "--steps", "7", "residual.kind=hc", "residual.hc.rate=2"],
                                     ["info", "--preset", "tiny", "residual.kind=mhar", "residual.heads=2",
                                      "optim.lr=1e-4", "train.flops=3e12"]])
def test_print_config_round_trips_through_config(tmp_path, capsys, command):
    rc, first, _ = run(capsys, [*command, "--print-config"])
    assert rc == 0 and "residual:" in first
    path = tmp_path / "printed.yaml"
    path.write_text(first)
    rc, second, _ = run(capsys, [command[0], "--config", str(path), "--print-config"])
    assert rc == 0 and second == first
    assert not (tmp_path / "outputs").exists()  # printing trains nothing


def test_study_prints_each_arm_as_a_train_config(tmp_path, capsys):
    rc, out, _ = run(capsys, ["study", str(write_study(tmp_path, steps=5)), "--print-config", "--output",
                              str(tmp_path / "out"), *FAST])
    assert rc == 0 and not (tmp_path / "out").exists()
    docs = out.split("\n---\n")
    assert len(docs) == 2 and "arm baseline" in docs[0] and "arm mhar-h2" in docs[1]
    path = tmp_path / "arm.yaml"
    path.write_text(docs[1] + "\n")
    rc, again, _ = run(capsys, ["train", "--config", str(path), "--print-config"])
    body = "\n".join(line for line in docs[1].splitlines() if not line.startswith("#")) + "\n"
    assert rc == 0 and again == body and "kind: mhar" in again and "steps: 5" in again


def test_quiet_training_prints_its_result_only_and_plain_training_no_bar_frames(tmp_path, capsys, monkeypatch):
    import tqdm.std

    written: list[str] = []
    write = tqdm.std.tqdm.write.__func__
    monkeypatch.setattr(tqdm.std.tqdm, "write", classmethod(lambda cls, s, **k: (written.append(s), write(cls, s, **k))))
    out_dir = str(tmp_path / "out")
    rc, out, err = run(capsys, ["train", "--output", out_dir, "--steps", "2", *FAST])
    assert rc == 0
    # Off a terminal no bar is drawn (no carriage-return frames); the evaluation lines are the progress, and
    # every line printed while training went above the bar (tqdm.write), none onto it.
    assert "\r" not in out + err
    evals = [line for line in out.splitlines() if line.startswith("eval ")]
    assert evals and all(line in written for line in evals)
    assert any(line.startswith("data: ") for line in written) and any(s.startswith("final evaluation") for s in written)

    written.clear()
    rc, out, err = run(capsys, ["--quiet", "train", "--output", out_dir, "--steps", "2", *FAST])
    assert rc == 0 and err == "" and not written
    lines = out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("completed: 2 steps") and lines[1].startswith("run folder: ")

    # A warning still shows under --quiet.
    rc, out, err = run(capsys, ["train", "--quiet", "--time", "5s", "--print-config"])
    assert rc == 0 and err.startswith("warning: --time applies to --budget wallclock")


def test_quiet_turns_bars_off_even_on_a_terminal(monkeypatch):
    from mhar_ablate import console

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    console.set_quiet(False)
    assert console.bars_enabled()
    console.set_quiet(True)
    try:
        assert not console.bars_enabled()
    finally:
        console.set_quiet(False)


def test_tensorboard_host_passes_through(tmp_path, capsys):
    (tmp_path / "studies" / "pair").mkdir(parents=True)
    common = ["tensorboard", "pair", "--output", str(tmp_path), "--print"]
    rc, out, _ = run(capsys, common)
    assert rc == 0 and "--host" not in out  # TensorBoard's default: this machine only
    rc, out, _ = run(capsys, [*common, "--host", "0.0.0.0"])
    assert rc == 0 and out.strip().endswith("--port 6006 --host 0.0.0.0")
