"""Study workers: where each worker may run (GPUs, CPU cores), the worker processes, and the loop each
worker runs through ``study.optimize`` so that Optuna's heartbeat covers every trial.

The grid is handed out as Optuna *waiting* trials (``study.enqueue_trial``), one grid point at a time in
grid order, queued by a worker that finds none waiting: it takes it with ``study.optimize`` (Optuna pops a
waiting trial atomically in every storage), so no sampler guesses and no point is given out twice. Should two
workers queue the same point at the same moment, the worker that takes the later copy sees the
earlier one running or finished and drops its own (``surplus``) before training anything.

Fairness: under ``--budget wallclock`` every worker has its own GPU (or its own CPU cores), because a
trial that shares a device measures the other one too. ``--trials-per-gpu K`` lets K trials share one GPU
under ``--budget steps`` or ``flops``, where speed does not change the result; such trials are marked
``shared_device`` and the export says that their equal-time and throughput columns were measured on a
shared device.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UsageError, out_of_memory_reason
from . import storage as st
from .points import point_key, seed_of_key, trial_point
from ..processes import NotATerminal, die_with_parent


@dataclass(frozen=True)
class Slot:
    index: int
    cuda: tuple[int, ...] | None  # the GPUs this worker sees (CUDA_VISIBLE_DEVICES), None: leave as it is
    cores: tuple[int, ...] | None  # CPU cores it is pinned to, None: not pinned
    shared: bool = False  # another trial runs on the same GPU at the same time


def visible_gpus() -> list[str]:
    """GPU ids as CUDA_VISIBLE_DEVICES names them (the env var's own entries where it is set)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:n]
    return [str(i) for i in range(n)]


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def plan(workers: str | int, devices: int, trials_per_gpu: int, budget: str,
         gpus: list[str] | None = None, cores: list[int] | None = None) -> list[Slot]:
    """Each worker's GPUs and cores, or one line saying why the request does not fit this machine."""
    gpus = visible_gpus() if gpus is None else gpus
    cores = available_cores() if cores is None else cores
    if devices < 1:
        raise UsageError(f"--devices must be at least 1, got {devices}")
    if trials_per_gpu < 1:
        raise UsageError(f"--trials-per-gpu must be at least 1, got {trials_per_gpu}")
    if trials_per_gpu > 1 and budget == "wallclock":
        raise UsageError("--trials-per-gpu applies to --budget steps and flops only: under a wall-clock budget, trials sharing a "
                         "GPU would slow each other down and the equal-time comparison would measure that")
    if trials_per_gpu > 1 and devices > 1:
        raise UsageError("--trials-per-gpu shares one GPU between trials; it cannot be combined with --devices N")
    if isinstance(workers, str) and workers != "gpus":
        try:
            workers = int(workers)
        except ValueError:
            raise UsageError(f"--workers takes a number or 'gpus', got {workers!r}") from None
    if gpus:
        groups = len(gpus) // devices
        if groups == 0:
            raise UsageError(f"--devices {devices} needs {devices} GPUs; {len(gpus)} visible here")
        capacity = groups * trials_per_gpu
        n = capacity if workers == "gpus" else int(workers)
        if n < 1:
            raise UsageError(f"--workers must be at least 1, got {n}")
        if n > capacity:
            need = -(-n // trials_per_gpu) * devices
            raise UsageError(f"--workers {n} x --devices {devices} needs {need} GPUs"
                             + (f" at --trials-per-gpu {trials_per_gpu}" if trials_per_gpu > 1 else "")
                             + f"; {len(gpus)} visible here"
                             + ("" if trials_per_gpu > 1 or budget == "wallclock" else
                                " (under --budget steps or flops, --trials-per-gpu K lets K trials share a GPU)"))
        per = len(cores) // n if n > 1 else 0
        slots = []
        for i in range(n):
            group = i // trials_per_gpu
            sharing = sum(1 for j in range(n) if j // trials_per_gpu == group) > 1
            ids = tuple(int(g) if g.isdigit() else g for g in gpus[group * devices:(group + 1) * devices])
            slots.append(Slot(i, ids if n > 1 or devices > 1 else None,
                              tuple(cores[i * per:(i + 1) * per]) if per else None, sharing))
        return slots
    if workers == "gpus":
        raise UsageError("--workers gpus: no GPU is visible here; give a number of workers")
    n = int(workers)
    if n < 1:
        raise UsageError(f"--workers must be at least 1, got {n}")
    if trials_per_gpu > 1:
        raise UsageError("--trials-per-gpu: no GPU is visible here; on a CPU each worker gets cores of its own")
    if n * devices > len(cores):
        raise UsageError(f"--workers {n} x --devices {devices} = {n * devices} training processes need a CPU core each; "
                         f"this process may use {len(cores)}")
    if n == 1 and devices == 1:
        return [Slot(0, None, None)]  # one worker on a CPU: every core, as a plain `train` would
    per = len(cores) // (n * devices) * devices  # whole cores per worker, split again between its DDP ranks
    return [Slot(i, None, tuple(cores[i * per:(i + 1) * per])) for i in range(n)]


def pin(slot: Slot) -> None:
    """Confine this process to the slot's cores (its threads too); GPUs are chosen before torch sees them."""
    if slot.cuda is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in slot.cuda)
    if slot.cores:
        os.sched_setaffinity(0, slot.cores)
        import torch

        torch.set_num_threads(len(slot.cores))
        os.environ["MHAR_ABLATE_CORES"] = ",".join(map(str, slot.cores))  # DDP ranks split these further


# --------------------------------------------------------------------------- the grid as a queue


def queue_next(study, grid: list[tuple[str, int]], since: int) -> bool:
    """Queue the first grid point, in grid order, that no trial holds: none waiting, running or finished,
    and none failed in this run (trial number ``since`` or later: out of memory or out of retries, which
    the next run retries). Points are queued one at a time, when a worker finds the queue empty, because
    Optuna hands out waiting trials oldest first: a point interrupted by an earlier run then comes before
    the points after it, instead of behind a backlog queued at the start. Returns whether one was queued."""
    from optuna.trial import TrialState

    held = set()
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED) or (
                t.state == TrialState.FAIL and t.number >= since and "surplus" not in t.user_attrs):
            held.add(trial_point(t))
    for arm, seed in grid:
        if point_key(arm, seed) not in held:
            study.enqueue_trial({"arm": arm}, user_attrs={"grid_point": point_key(arm, seed), "seed": seed})
            return True
    return False


def taken_elsewhere(study, trial, point: str) -> bool:
    """Another trial of this point finished, or runs and was taken first (a lower number): this one is
    a copy queued twice and must not train the same folder at the same time."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)):
        if t.number != trial.number and trial_point(t) == point:
            if t.state != TrialState.RUNNING or t.number < trial.number:
                return True
    return False


class Surplus(Exception):
    """The trial Optuna handed out was not a queued grid point (the queue ran dry between looking and
    asking), or a second copy of one: it is failed at once with this reason and nothing trains."""


class Interrupted(Exception):
    """The run stopped on a signal after checkpointing: the trial is failed and the next run resumes it."""


class OutOfMemory(Exception):
    """The run ran out of GPU memory (a neighbour on a shared GPU, or a batch too large): the trial is failed,
    its worker frees the memory and takes the next point, and the next run retries it from its checkpoint."""


def make_pruner(sr):
    import optuna

    if sr.prune:
        return optuna.pruners.MedianPruner(n_startup_trials=len(sr.definition.arms), n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def work(sr, study, configs, tuned: dict[str, float], slot: Slot, log: Callable[[str], None], stop,
         local: bool, since: int, poll: float = 1.0) -> dict[str, Any]:
    """One worker: take grid points until none is left and none runs elsewhere (a trial running in a
    worker that dies is then queued again, and taken here). ``since``: the first trial number of this run."""
    import optuna
    import torch
    from optuna.trial import TrialState

    from ..errors import UsageError
    from .trials import DONE_STATES, pruning_reporter, record_result, drop_checkpoints
    from ..training.run import quiet_lightning, train_run

    quiet_lightning()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # surplus trials are expected, not worth a warning
    grid = sr.grid()
    arms = list(sr.definition.arms)
    summary = {"ran": 0, "diverged": 0, "pruned": 0, "out_of_memory": 0, "interrupted": False}
    cache = sr.output / "cache"

    def done_count() -> int:
        return len({trial_point(t) for t in study.get_trials(deepcopy=False) if t.state.name in DONE_STATES})

    def objective(trial) -> float:
        point = trial.user_attrs.get("grid_point")
        if point is None:
            trial.set_user_attr("surplus", "no queued grid point was left")
            raise Surplus()
        for k, v in {**st.owner_attrs(), "worker": slot.index, "shared_device": slot.shared}.items():
            trial.set_user_attr(k, v)  # first: a worker killed from here on is recognised as dead
        arm = trial.suggest_categorical("arm", arms)
        seed = seed_of_key(point)  # also for a point queued before the seed became an attribute (points.py)
        trial.set_user_attr("seed", seed)
        if taken_elsewhere(study, trial, point):
            trial.set_user_attr("surplus", "another trial of this grid point ran first")
            raise Surplus()
        cfg = configs[(arm, seed)]
        if arm in tuned:
            cfg.optim.lr = tuned[arm]
        run_dir = sr.run_dir(arm, seed)
        trial.set_user_attr("run_dir", run_dir.relative_to(sr.output).as_posix())  # a copied study stays whole
        trial.set_user_attr("lr", cfg.optim.lr)
        trial.set_user_attr("keep_checkpoints", sr.keep_checkpoints)
        title = f"[{done_count() + 1}/{len(grid)}] {arm} s{seed}: "
        if "failed_trial" in _system_attrs(study, trial):
            log(f"{title}resuming from the checkpoint of a worker that died")
        on_eval = pruning_reporter(trial, sr.budget, cfg) if sr.prune else None
        oom = None
        try:
            result = train_run(cfg, run_dir, cache, resume=True, on_eval=on_eval, log=log, title=title, stop=stop,
                               position=1, log_evals=False, allow_version_change=sr.allow_version_change)
        except UsageError as e:
            raise UsageError(f"arm {arm!r} seed {seed}: {e}") from None
        except torch.OutOfMemoryError as e:
            oom = out_of_memory_reason(e)
        if oom is not None:  # outside the handler: the traceback's frames, which hold the run's tensors, are gone
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            summary["out_of_memory"] += 1
            trial.set_user_attr("out_of_memory", oom)
            log(f"{title}out of GPU memory ({oom}); the trial is failed and the next run retries it"
                + (" (fewer --trials-per-gpu leaves it more)" if slot.shared else ""))
            raise OutOfMemory(oom)
        record_result(trial, result)
        status = result["status"]
        if status == "interrupted":
            summary["interrupted"] = True
            log(f"{title}interrupted ({result['reason']}); rerun the same command to resume it")
            raise Interrupted()
        if not sr.keep_checkpoints:  # result.json is written: a rerun that finds it needs no checkpoint
            drop_checkpoints(run_dir)
        summary["ran"] += 1
        final = result.get("final_eval")
        log(f"{title}{status}, val loss {result['final_val_loss']:.4f} at step {result['step']}, "
            f"{result['seconds']:.1f}s trained, {result['tokens_per_s'] or 0:,.0f} tokens/s"
            + (f", final-set loss {final['loss']:.4f} ± {final['se']:.4f} ({final['sequences']:,} sequences)"
               if final else ""))
        if status == "pruned":
            summary["pruned"] += 1
            raise optuna.TrialPruned()
        summary["diverged"] += status == "diverged"
        # A diverged run is a result (its loss is +inf), not a crash: it is never trained again.
        return result["final_val_loss"] if status == "completed" else float("inf")

    said_waiting = False
    # A stop that arrives between trials still starts the next one, which stops after its first step with
    # a checkpoint (the summary then says "interrupted" and the rerun resumes it): one rule for every stop.
    while not summary["interrupted"]:
        if local:
            reaped = st.reap_dead(study)
            if reaped:
                log(f"trial(s) {', '.join(map(str, reaped))} of a worker that died are queued again, to be resumed "
                    "from their checkpoints")
        else:
            st.fail_stale(study)  # Optuna's heartbeat check; optimize() runs it too before each trial
        trials = study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
        if not any(t.state == TrialState.WAITING for t in trials) and not queue_next(study, grid, since):
            running = [t for t in trials if t.state == TrialState.RUNNING]
            if not running:
                break
            if stop:
                summary["interrupted"] = True
                break
            if not said_waiting:
                log(f"waiting for {len(running)} trial(s) running in other workers (if one of them dies, its "
                    "trial is resumed here)")
                said_waiting = True
            time.sleep(poll)
            continue
        said_waiting = False
        try:
            study.optimize(objective, n_trials=1, catch=(Surplus, Interrupted, OutOfMemory), gc_after_trial=False,
                           show_progress_bar=False)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Our trial was failed by another worker while it trained: its heartbeat missed the grace period
            # (a database unreachable for that long). The retry copy goes on from the run's checkpoint.
            log("a trial of this worker was given up by the heartbeat check while it ran; its retry resumes it")
    return summary


def _system_attrs(study, trial) -> dict[str, Any]:
    """A running trial's system attributes, read through the study's public trial list."""
    for t in study.get_trials(deepcopy=False):
        if t.number == trial.number:
            return t.system_attrs
    return {}


# --------------------------------------------------------------------------- worker processes


def _child(slot: Slot, sr, url: str, configs, tuned, results, since: int) -> None:
    """A worker process (spawned): its own process group (Ctrl-C reaches the parent, which passes the
    stop on once), pinned to its slot, dying with the parent."""
    os.setpgrp()
    die_with_parent(signal.SIGTERM)
    pin(slot)
    sys.stderr = NotATerminal(sys.stderr)
    from ..console import log_line
    from .catalog import open_storage
    from ..training.stop import stop_on_signals

    import optuna

    prefix = f"w{slot.index}: "
    log = lambda m: log_line(prefix + m)  # noqa: E731
    storage = open_storage(url, create=False, heartbeat=sr.heartbeat)
    study = optuna.load_study(study_name=sr.key, storage=storage, pruner=make_pruner(sr),
                              sampler=optuna.samplers.RandomSampler(seed=slot.index))
    with stop_on_signals() as stop:
        summary = work(sr, study, configs, tuned, slot, log, stop, st.is_local(url), since, poll=_poll(sr, url))
    results.put((slot.index, summary))


def _poll(sr, url: str) -> float:
    return 0.5 if st.is_local(url) else max(0.5, min(2.0, sr.heartbeat / 2))


def run_workers(sr, url: str, study, configs, tuned, slots: list[Slot], log, stop, since: int) -> dict[str, Any]:
    """Run the workers: in this process when there is one, else as spawned processes. Signals this
    process receives (SIGINT, SIGTERM) are passed on to every worker, which checkpoints and stops.
    ``since``: the first trial number of this run (see ``queue_next``)."""
    if len(slots) == 1:
        if slots[0].cores:
            pin(Slot(0, None, slots[0].cores))
        return work(sr, study, configs, tuned, slots[0], log, stop, st.is_local(url), since, poll=_poll(sr, url))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = []
    for slot in slots:
        p = ctx.Process(target=_child, args=(slot, sr, url, configs, tuned, results, since), name=f"mhar-worker-{slot.index}")
        p.start()
        procs.append(p)
        where = (f"GPU {','.join(map(str, slot.cuda))}" if slot.cuda is not None else "") + (
            f"{' and ' if slot.cuda is not None else ''}cores {_ranges(slot.cores)}" if slot.cores else "")
        log(f"worker w{slot.index} (pid {p.pid}){' on ' + where if where else ''}"
            f"{' (shares its GPU)' if slot.shared else ''}")
    forwarded: str | None = None
    summary = {"ran": 0, "diverged": 0, "pruned": 0, "out_of_memory": 0, "interrupted": False, "workers_died": 0}
    while any(p.is_alive() for p in procs):
        if stop and stop.signal != forwarded:
            forwarded = stop.signal
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, getattr(signal, stop.signal))
        for p in procs:
            p.join(timeout=0.2 / len(procs))
    for p in procs:
        if p.exitcode and p.exitcode < 0:
            summary["workers_died"] += 1
            log(f"worker w{procs.index(p)} (pid {p.pid}) was killed by {signal.Signals(-p.exitcode).name}; "
                "its trial was queued again for the other workers or the next run")
        elif p.exitcode:
            summary["workers_died"] += 1
            log(f"worker w{procs.index(p)} (pid {p.pid}) failed with exit code {p.exitcode}")
    while not results.empty():
        _, s = results.get()
        for k in ("ran", "diverged", "pruned", "out_of_memory"):
            summary[k] += s[k]
        summary["interrupted"] |= s["interrupted"]
    if stop:
        summary["interrupted"] = True
    return summary


def _ranges(cores) -> str:
    cores = list(cores)
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1 else ",".join(map(str, cores))
