"""Scale-out with real components: study workers sharing a journal file or a real PostgreSQL server,
a worker SIGKILLed mid-trial, two commands started at the same moment, and a DDP run of two gloo
processes on the CPU. Every process here is a real CLI process; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mhar_ablate.cli import main
from mhar_ablate.errors import UsageError

from reliability_helpers import FAST, REPO, cli, env, trial_in_progress, write_study

SMALL = [*FAST, "data.max_tokens=200000"]  # 13 stdlib files: the token cache builds in a moment
TIMEOUT = 240


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(cli(*args), env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def load(url: str, key: str = "pair-steps"):
    import optuna

    from mhar_ablate.sweep.catalog import open_storage

    return optuna.load_study(study_name=key, storage=open_storage(url, create=False))


def check_grid_once(study, points: int = 4) -> dict[str, list]:
    """Every grid point has exactly one finished trial, and no point was trained by two trials: the
    trials that were not COMPLETE never trained (surplus copies) or were killed (FAIL, then retried)."""
    by_point: dict[str, list] = {}
    for t in study.get_trials(deepcopy=False):
        if "grid_point" in t.user_attrs:
            by_point.setdefault(t.user_attrs["grid_point"], []).append(t)
    assert len(by_point) == points, sorted(by_point)
    for point, trials in by_point.items():
        complete = [t for t in trials if t.state.name == "COMPLETE"]
        assert len(complete) == 1, (point, [(t.number, t.state.name) for t in trials])
        assert all(t.state.name in ("COMPLETE", "FAIL") for t in trials), point
    return by_point


def tb_writers(folder: Path) -> dict[str, int]:
    """Per run folder, how many processes wrote TensorBoard events into it (the file names end in
    HOST.PID.N): a grid point trained twice at once shows two."""
    return {p.name: len({f.name.split(".")[-2] for f in p.glob("events.out.tfevents.*")})
            for p in folder.iterdir() if any(p.glob("events.out.tfevents.*"))}


def wait_for_trial_mid_way(folder: Path, procs: list[subprocess.Popen], timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        victim = trial_in_progress(folder)
        if victim is not None:
            return victim
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.02)
    raise AssertionError("no trial was caught mid-way: " + "\n".join(finish(p)[1] for p in procs))


def owner_of(url: str, run_dir: Path, timeout: float = 30) -> tuple[int, int]:
    """(pid, trial number) of the running trial that trains ``run_dir``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in load(url).get_trials(deepcopy=False):
            recorded = t.user_attrs.get("run_dir")  # relative to the output folder
            if t.state.name == "RUNNING" and recorded and run_dir.as_posix().endswith("/" + recorded) \
                    and "pid" in t.user_attrs:
                return t.user_attrs["pid"], t.number
        time.sleep(0.05)
    raise AssertionError(f"no running trial owns {run_dir}")


# --------------------------------------------------------------------------- journal (one machine)


def test_two_workers_on_the_journal_finish_the_grid_once_and_reruns_find_it(tmp_path, capsys):
    out = tmp_path / "out"
    code, text = finish(start("study", str(write_study(tmp_path, steps=12)), "--workers", "2", "--output", str(out), *SMALL))
    assert code == 0, text
    assert "2 workers" in text and "studies.journal" in text
    assert not (out / "studies.db").exists(), "several workers never share an SQLite file"
    study = load(f"journal://{out / 'studies.journal'}")
    check_grid_once(study)
    assert all(n == 1 for n in tb_writers(out / "studies" / "pair" / "steps").values()), "each folder trained once"

    # Neither a rerun nor export is told where the workers kept the study.
    assert main(["study", str(write_study(tmp_path, steps=12)), "--output", str(out), *SMALL]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert main(["export", "pair", "--output", str(out), "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 2


def test_a_worker_killed_mid_trial_has_its_trial_finished_by_the_other(tmp_path):
    out = tmp_path / "out"
    folder = out / "studies" / "pair" / "steps"
    url = f"journal://{out / 'studies.journal'}"
    proc = start("study", str(write_study(tmp_path, steps=48)), "--workers", "2", "--output", str(out), *SMALL)
    victim = wait_for_trial_mid_way(folder, [proc])
    pid, number = owner_of(url, victim)
    assert pid != proc.pid  # a worker process, not the command
    os.kill(pid, signal.SIGKILL)
    code, text = finish(proc)
    assert code == 0, text
    assert "killed by SIGKILL" in text
    by_point = check_grid_once(load(url))
    trials = next(ts for ts in by_point.values() if any(t.number == number for t in ts))
    killed = next(t for t in trials if t.number == number)
    done = next(t for t in trials if t.state.name == "COMPLETE")
    assert killed.state.name == "FAIL" and done.system_attrs.get("failed_trial") == number  # Optuna's retry copy
    assert done.user_attrs["pid"] != pid
    result = json.loads((victim / "result.json").read_text())
    assert result["status"] == "completed" and result["step"] == 48
    assert result["curve"][0]["step"] == 0, "resumed from the checkpoint, keeping the curve from before the kill"


def test_two_commands_started_together_on_sqlite_both_succeed_or_one_says_busy(tmp_path):
    out = tmp_path / "out"
    study = str(write_study(tmp_path, steps=6))
    procs = [start("study", study, "--output", str(out), *SMALL) for _ in range(2)]
    results = [finish(p) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 0], [0, 2]), results
    for code, text in results:
        assert "UNIQUE" not in text and "Traceback" not in text, text
        if code == 2:
            errors = [line for line in text.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "busy" in errors[0], text
    check_grid_once(load(f"sqlite:///{out / 'studies.db'}"))
    # An SQLite study stays single-writer: more workers on it are refused in one line.
    with pytest.raises(UsageError, match="SQLite"):
        main(["study", study, "--output", str(out), "--workers", "2", "--debug", *SMALL])


# --------------------------------------------------------------------------- PostgreSQL (several machines)


def test_two_machines_share_a_postgresql_study(tmp_path, postgres):
    url = postgres.new_database()
    study = str(write_study(tmp_path, steps=12))
    out = tmp_path / "shared-out"  # on several machines: one shared folder for the run folders
    procs = [start("study", study, "--storage", url, "--heartbeat", "2", "--output", str(out), *SMALL) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [code for code, _ in results] == [0, 0], results
    check_grid_once(load(url))
    assert all(n == 1 for n in tb_writers(out / "studies" / "pair" / "steps").values())
    # export finds the server recorded in the output folder (libpq would bring a password from ~/.pgpass)
    assert json.loads((out / "storages.json").read_text())["pair-steps"] == url
    assert main(["export", "pair", "--output", str(out), "--format", "md"]) == 0


def test_a_machine_killed_mid_trial_has_its_trial_finished_by_heartbeat(tmp_path, postgres):
    url = postgres.new_database()
    study = str(write_study(tmp_path, steps=48))
    out = tmp_path / "shared-out"
    folder = out / "studies" / "pair" / "steps"
    args = ["study", study, "--storage", url, "--heartbeat", "1", "--output", str(out), *SMALL]
    # Both machines start together (their start-up overlaps); the one training the first trial caught mid-way
    # is killed, and the other takes that trial over once its heartbeat is stale.
    procs = [start(*args) for _ in range(2)]
    victim = wait_for_trial_mid_way(folder, procs)
    pid, number = owner_of(url, victim)
    assert pid in [p.pid for p in procs]  # a command trains its one worker's trials itself
    killed, survivor = sorted(procs, key=lambda p: p.pid != pid)
    os.kill(pid, signal.SIGKILL)
    assert finish(killed)[0] == -signal.SIGKILL
    code, text = finish(survivor)
    assert code == 0, text
    by_point = check_grid_once(load(url))
    trials = next(ts for ts in by_point.values() if any(t.number == number for t in ts))
    done = next(t for t in trials if t.state.name == "COMPLETE")
    assert done.system_attrs.get("failed_trial") == number and done.user_attrs["pid"] == survivor.pid
    assert "resuming from the checkpoint of a worker that died" in text
    result = json.loads((victim / "result.json").read_text())
    assert result["status"] == "completed" and result["curve"][0]["step"] == 0


# --------------------------------------------------------------------------- DDP


def test_ddp_with_two_cpu_processes_stops_every_rank_on_the_same_step(tmp_path):
    out = tmp_path / "out"
    code, text = finish(start("train", "--devices", "2", "--budget", "wallclock", "--time", "2s", "--output", str(out),
                              "residual.kind=mhar", "residual.heads=2", *SMALL))
    assert code == 0, text
    (run,) = (out / "runs").iterdir()
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["devices"] == 2
    assert result["seconds"] >= 2.0 and result["step"] > 0
    assert result["rank_steps"] == [result["step"]] * 2, "both ranks stopped on the same step"
    a, b = result["rank_weight_sums"]
    assert a == pytest.approx(b, rel=0, abs=1e-9), "DDP kept the two replicas identical"
    assert result["tokens"] == result["step"] * 4 * 32  # the global batch (4 x 32 tokens), not a rank's half
    final = result["final_eval"]  # each rank evaluated every other batch of the final set; together, every row
    assert final["sequences"] > 4 and all(v > 0 for v in final["sequence_losses"])


# --------------------------------------------------------------------------- planning and reporting


def test_workers_must_fit_the_machine_and_wallclock_trials_never_share():
    from mhar_ablate.sweep.workers import plan

    slots = plan(2, 1, 1, "wallclock", gpus=[], cores=[0, 1, 2, 3])
    assert [s.cores for s in slots] == [(0, 1), (2, 3)] and not any(s.shared for s in slots)
    slots = plan("gpus", 2, 1, "wallclock", gpus=["0", "1", "2", "3"], cores=list(range(8)))
    assert [s.cuda for s in slots] == [(0, 1), (2, 3)]
    slots = plan(2, 1, 2, "steps", gpus=["0"], cores=[0, 1])
    assert [s.cuda for s in slots] == [(0,), (0,)] and all(s.shared for s in slots)
    for args, needle in [((3, 1, 1, "steps", [], [0, 1]), "need a CPU core each"),
                         ((1, 2, 1, "steps", [], [0]), "need a CPU core each"),
                         ((2, 1, 1, "steps", ["0"], [0, 1]), "needs 2 GPUs"),
                         ((2, 1, 2, "wallclock", ["0"], [0, 1]), "--budget steps and flops only"),
                         (("gpus", 1, 1, "steps", [], [0, 1]), "no GPU is visible"),
                         ((1, 2, 1, "steps", ["0"], [0, 1]), "needs 2 GPUs")]:
        with pytest.raises(UsageError, match=needle):
            plan(*args[:4], gpus=args[4], cores=args[5])


@pytest.mark.parametrize("args,needle", [
    (["--workers", "64"], "need a CPU core each"),
    (["--budget", "wallclock", "--trials-per-gpu", "2"], "--budget steps and flops only"),
    (["--workers", "many"], "a number or 'gpus'"),
    (["--devices", "3"], "divisible by train.devices"),
])
def test_bad_scale_out_options_are_one_line_and_exit_2(tmp_path, capsys, args, needle):
    assert main(["study", str(write_study(tmp_path)), "--output", str(tmp_path / "out"), *args, *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out" / "studies").exists()


def test_a_study_that_shared_a_device_marks_its_time_and_throughput_columns():
    import optuna

    from mhar_ablate.reporting.table import SHARED_NOTE, build_table
    from mhar_ablate.reporting.render import render

    study = optuna.create_study(direction="minimize")
    for k, v in {"study": "pair", "budget": "steps", "arms": ["baseline", "mhar-h2"], "seeds": 1, "baseline": "baseline",
                 "shared_device": True}.items():
        study.set_user_attr(k, v)
    dist = optuna.distributions.CategoricalDistribution
    for arm, loss, tps in (("baseline", 3.0, 1000.0), ("mhar-h2", 2.9, 800.0)):
        study.add_trial(optuna.trial.create_trial(
            params={"arm": arm, "seed": 0}, distributions={"arm": dist(["baseline", "mhar-h2"]), "seed": dist([0])},
            value=loss, user_attrs={"status": "completed", "curve": [[0, 0.0, 0, 5.0], [10, 1.0, 640, loss]],
                                    "tokens_per_s": tps, "device": "NVIDIA H200", "shared_device": True}))
    table = build_table(study)
    md = render(table, "md")
    header = next(line for line in md.splitlines() if line.startswith("| arm"))
    assert header.count("†") == 3 and "val loss @ 10 steps |" in header  # the equal-step column is unmarked
    assert SHARED_NOTE in md
    assert json.loads(render(table, "json"))["shared_device"] is True


def test_storage_urls_name_psycopg_and_are_recorded_without_password():
    from mhar_ablate.sweep import storage as st

    assert st.driver_url("postgresql://bob:pw@db:5432/s") == "postgresql+psycopg://bob:pw@db:5432/s"
    assert st.driver_url("postgresql+psycopg2://bob@db/s") == "postgresql+psycopg2://bob@db/s"
    assert st.without_password("postgresql://bob:hunter2@db:5432/s") == "postgresql://bob@db:5432/s"
    assert st.kind("journal:///x/studies.journal") == "journal" and st.is_local("sqlite:////x.db")
