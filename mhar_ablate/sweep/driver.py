"""The Optuna driver: runs a study's arms x seeds grid under one budget, resumably.

Storage (``storage.py``): SQLite in the output folder for one worker, a journal file there for several
workers on one machine, or a database server (``--storage postgresql://...``) for workers on several
machines; one Optuna study per (name, budget). The workers queue the grid as waiting trials, one point at a
time in grid order, and take them through ``study.optimize`` (``workers.py``). Each grid point trains into a fixed folder
``<output>/studies/<name>/<budget>/<arm>-s<seed>/``, so a rerun after a crash or a kill, or another worker
after a worker died, continues that point from its checkpoint; finished points (completed, diverged or
pruned) are never trained again, and their checkpoints are removed once their result is recorded
(``keep_checkpoints`` keeps them). Before the first trial trains, every grid point still to train is
checked (its configuration, data, vocabulary and any checkpoint it will continue), so bad input fails at
once; a finished study reruns (and prints its table) even in a read-only folder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from . import storage as st
from ..config import RunConfig
from ..console import bars_enabled, log_line
from ..errors import UsageError
from ..io import check_writable_folder, remove_stale_temporaries
from ..provenance import environment
from ..redaction import redact
from .catalog import check_compatible, check_environment, check_readable, choose_storage, corrupt, find_storage, open_storage, under_output
from .definition import STUDY_FORMAT, StudyDefinition, StudyRun
from .points import arm_seed, trial_point
from .trials import DONE_STATES, TRAINED_FILES, drop_finished_checkpoints, drop_checkpoints


# --------------------------------------------------------------------------- the driver


def remove_killed_writes(sr: StudyRun, sole_writer: bool) -> None:
    """Temporaries that writes killed before their rename left in the study's folders (the rule is
    ``io.remove_stale_temporaries``'s; the caller holds ``output_lock``). ``storages.json`` is written only
    under that lock: its temporaries go at once. In the run folders (the grid's and the source stage's),
    the files training writes go at once where this process is the study's only writer (``sole_writer``:
    SQLite, held exclusively); any other temporary, or with workers of other commands about, once stale."""
    remove_stale_temporaries(sr.output, names=(st.REGISTRY_FILE,), owned=(st.REGISTRY_FILE,))
    remove_stale_temporaries(sr.folder)
    runs = [sr.run_dir(arm, seed) for arm, seed in sr.grid()]
    if sr.definition.source:
        runs += [sr.source_dir(seed) for seed in range(sr.seeds)]
    for run_dir in runs:
        remove_stale_temporaries(run_dir, owned=TRAINED_FILES if sole_writer else ())


def run_study(sr: StudyRun, stop=None, log: Callable[[str], None] = log_line) -> dict[str, Any]:
    """Run every missing grid point with ``sr.workers`` workers; return a summary
    {done, ran, diverged, pruned, interrupted, folder}."""
    import optuna
    from tqdm.auto import tqdm

    from .workers import make_pruner, plan, run_workers

    configs = sr.configs()  # validates every arm (and the source stage) before any training
    devices = next(iter(configs.values())).train.devices
    slots = plan(sr.workers, devices, sr.trials_per_gpu, sr.budget)  # fits the machine, or one line why not
    # Cached once here, before any worker starts (the source stage's corpus too).
    corpora, vocabs, final_notes = check_data(configs, sr.output / "cache", extra=sr.source_configs().values())
    sr.resolve_flops(configs, vocabs)  # the flops budget's steps per arm depend on the vocabulary
    fingerprint = sr.fingerprint(configs)
    grid = sr.grid()
    if sr.output.exists() and not sr.output.is_dir():
        raise UsageError(f"--output {sr.output} is a file, not a folder")
    try:
        check_writable_folder(sr.output)
    except UsageError:
        # Nothing can be written here: a finished study still answers (its table), anything else is refused.
        finished_summary = _finished_read_only(sr, fingerprint, grid, log)
        if finished_summary is None:
            raise
        return finished_summary
    sr.output.mkdir(parents=True, exist_ok=True)
    held = None
    # Finding or creating the study and its tables must not interleave with another command
    # starting on the same output folder (SQLite's schema creation is not safe against that).
    with st.output_lock(sr.output), _closing_on_error(lambda: held):
        url = choose_storage(sr, len(slots))
        storage = open_storage(url, create=True, heartbeat=sr.heartbeat)  # a missing folder or corrupt file: one line
        if st.kind(url) == "sqlite":  # one process at a time writes an SQLite study: a second one is told it is busy
            held = st.hold_exclusive(Path(url[len("sqlite:///"):] + ".lock"), f"study {sr.key}")
        try:
            study = optuna.create_study(study_name=sr.key, storage=storage, direction="minimize", load_if_exists=True,
                                        sampler=optuna.samplers.RandomSampler(seed=0), pruner=make_pruner(sr))
        except json.JSONDecodeError as e:  # an attribute that is not JSON
            raise corrupt(sr.key, url, e) from None
        except Exception as e:  # corrupt tables surface here as SQLAlchemy errors of many kinds
            raise UsageError(f"cannot use study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None
        check_readable(study, url)
        check_compatible(study, fingerprint, sr.key, sr.seeds)
        todo = [p for p in grid if p not in _finished_points(study)]
        attrs = {"format": STUDY_FORMAT, "version": __version__, "fingerprint": fingerprint, "study": sr.definition.name,
                 "budget": sr.budget, "arms": list(sr.definition.arms), "seeds": sr.seeds,
                 "baseline": sr.definition.baseline, "curve": sr.definition.curve,
                 "description": sr.definition.description, "folder": sr.folder.relative_to(sr.output).as_posix(),
                 "curve_values": _curve_values(sr.definition, configs)}
        if todo:  # everything that can be wrong with a grid point is found now, not when its trial comes up
            if check_environment(study, sr):  # allowed: the versions earlier trials ran under stay on record
                attrs["environment_history"] = [*study.user_attrs.get("environment_history", []),
                                                study.user_attrs.get("environment")]
            attrs["environment"] = environment()
            preflight(sr, configs, todo, vocabs)
        for k, v in attrs.items():
            if study.user_attrs.get(k) != v:
                study.set_user_attr(k, v)
        if any(s.shared for s in slots) and not study.user_attrs.get("shared_device"):
            study.set_user_attr("shared_device", True)
        st.record(sr.output, sr.key, url)
        remove_killed_writes(sr, sole_writer=held is not None)
        if st.is_local(url):
            reaped = st.reap_dead(study)
            if reaped:
                log(f"{len(reaped)} trial(s) of an earlier run were killed; each resumes from its last checkpoint "
                    "(or from the start where it has none)")
        else:
            st.fail_stale(study)
        # Grid points are queued by the workers, one at a time (workers.queue_next); a point that fails
        # in this run (trial number `since` or later) waits for the next run.
        since = len(study.get_trials(deepcopy=False))
        if not sr.keep_checkpoints:
            drop_finished_checkpoints(sr, study)

    try:
        # The source stage (continued pretraining) trains here, in this process, before any arm: every
        # arm of a seed starts from its checkpoint. Under SQLite this command holds the study alone.
        sources = train_sources(sr, log, stop)
        if sources is None:
            return {"study": sr.key, "done": 0, "ran": 0, "diverged": 0, "pruned": 0, "interrupted": True,
                    "folder": str(sr.folder), "storage": redact(url), "workers": len(slots)}
        if sources and study.user_attrs.get("source_losses") != sources:
            study.set_user_attr("source_losses", sources)
        tuned = tune_arms(sr, configs, storage, log, stop, url) if sr.tune else {}

        def finished() -> set[str]:
            return {trial_point(t) for t in study.get_trials(deepcopy=False) if t.state.name in DONE_STATES
                    and trial_point(t)}

        done = finished()
        summary = {"study": sr.key, "done": len(done), "ran": 0, "diverged": 0, "pruned": 0, "interrupted": False,
                   "folder": str(sr.folder), "storage": redact(url), "workers": len(slots)}
        if len(done) >= len(grid):
            log(f"study {sr.key}: all {len(grid)} grid points are finished; nothing to train")
            return summary
        first = configs[grid[0]]
        log(f"study {sr.key}: {len(grid) - len(done)} of {len(grid)} grid points to train "
            f"({len(sr.definition.arms)} arms x {sr.seeds} seeds, {first.train.budget} budget: "
            f"{_budget_text(first, configs)}); storage {redact(url)}"
            + (f"; {len(slots)} workers" if len(slots) > 1 else "") + (f", {devices} devices per trial" if devices > 1 else ""))
        for text in corpora:
            log(f"data: {text}")
        for text in final_notes:
            log(text)
        bar = tqdm(total=len(grid), initial=len(done), desc=sr.key, unit="trial", position=0, dynamic_ncols=True,
                   file=sys.stderr, disable=len(slots) > 1 or not bars_enabled())

        def log_and_count(msg: str) -> None:
            log(msg)
            if msg.startswith("[") and ("completed" in msg or "diverged" in msg or "pruned" in msg):
                bar.update(1)

        try:
            ran = run_workers(sr, url, study, configs, tuned, slots, log_and_count, stop, since)
        finally:
            bar.close()
        summary.update({k: ran[k] for k in ("ran", "diverged", "pruned", "interrupted")})
        summary["done"] = len(finished())
        summary["workers_died"] = ran.get("workers_died", 0)
        summary["out_of_memory"] = ran.get("out_of_memory", 0)
        return summary
    finally:
        if held is not None:
            os.close(held)


def train_sources(sr: StudyRun, log, stop) -> dict[str, float] | None:
    """Train (or resume, or find finished) each seed's source run; return {seed: final validation loss},
    or None when interrupted. A source folder trained with another configuration is refused, not reused."""
    sources = sr.source_configs()
    if not sources:  # no source stage: nothing to train here, and no import of training.run (Lightning, seconds)
        return {}
    from ..training.run import load_run_config, train_run

    losses: dict[str, float] = {}
    for seed, cfg in sources.items():
        folder = sr.source_dir(seed)
        if (folder / "config.yaml").is_file() and load_run_config(folder).flat() != cfg.flat():
            raise UsageError(f"{folder} was trained with another configuration than study {sr.definition.name!r}'s "
                             "source stage now has; use another --output folder")
        result_file = folder / "result.json"
        result = json.loads(result_file.read_text()) if result_file.is_file() else None
        if result is None or result.get("status") != "completed":
            log(f"source s{seed}: pretraining {_budget_text(cfg)} (shared by every arm and both budgets)")
            result = train_run(cfg, folder, sr.output / "cache", resume=True, log=log, title=f"source s{seed}: ",
                               stop=stop, position=1, log_evals=False)
            if result["status"] == "interrupted":
                log(f"source s{seed}: interrupted; rerun the same command to resume it")
                return None
            if result["status"] != "completed":
                raise UsageError(f"source s{seed} of study {sr.definition.name!r} {result['status']} "
                                 f"({result.get('reason')}): its arms have nothing to start from")
        losses[str(seed)] = float(result["final_val_loss"])
    return losses


@contextlib.contextmanager
def _closing_on_error(fd):
    """Release the study's lock (``fd()``, once taken) when setting the study up fails: the process
    goes on (a test, a caller) and must not keep the study busy."""
    try:
        yield
    except BaseException:
        if fd() is not None:
            os.close(fd())
        raise


def _finished_points(study) -> set[tuple[str, int]]:
    return {point for t in study.get_trials(deepcopy=False) if t.state.name in DONE_STATES and (point := arm_seed(t))}


def _finished_read_only(sr: StudyRun, fingerprint: str, grid, log) -> dict[str, Any] | None:
    """The summary of a study that is finished, read without writing anything (the output folder
    cannot be written); None when the study does not exist or still has points to train."""
    import optuna

    url = find_storage(sr.output, sr.key, sr.storage)
    if url is None:
        return None
    storage = open_storage(url, create=False)
    try:
        study = optuna.load_study(study_name=sr.key, storage=storage)
    except KeyError:
        return None
    except json.JSONDecodeError as e:  # an attribute that is not JSON
        raise corrupt(sr.key, url, e) from None
    check_readable(study, url)
    check_compatible(study, fingerprint, sr.key, sr.seeds)
    done = _finished_points(study)
    if any(p not in done for p in grid):
        return None
    log(f"study {sr.key}: all {len(grid)} grid points are finished; nothing to train")
    return {"study": sr.key, "done": len(done), "ran": 0, "diverged": 0, "pruned": 0, "interrupted": False,
            "folder": str(sr.folder), "storage": redact(url), "workers": 0}


def preflight(sr: StudyRun, configs: dict[tuple[str, int], RunConfig], todo: list[tuple[str, int]],
              vocabs: dict[tuple[str, int], int]) -> None:
    """Check each grid point still to train as its trial will: the vocabulary against its tokenizer,
    its run folder (another run's config.yaml) and the checkpoint it will continue (readable, written
    by this run, fitting its model). The first problem is one error that names the arm and seed."""
    from ..training.checkpoint import CHECKPOINT, check_fits
    from ..model.weights import read_checkpoint
    from ..training.run import check_run_folder, finished_result

    ignore = ("optim.lr",) if sr.tune else ()  # a tuned rate is only known once the search has run
    for arm, seed in todo:
        cfg, run_dir = configs[(arm, seed)], sr.run_dir(arm, seed)
        try:
            vocab = cfg.model.vocab_size or vocabs[(arm, seed)]
            if vocab < vocabs[(arm, seed)]:
                raise UsageError(f"model.vocab_size={vocab} is smaller than the tokenizer's {vocabs[(arm, seed)]} tokens")
            if not run_dir.is_dir():
                continue
            check_run_folder(run_dir, cfg, ignore)
            ckpt = run_dir / CHECKPOINT
            if finished_result(run_dir) is None and ckpt.is_file():
                check_fits(read_checkpoint(ckpt, mmap=True), cfg, vocab, ckpt, ignore)
        except UsageError as e:
            raise UsageError(f"arm {arm!r} seed {seed}: {e}") from None


def _curve_values(d: StudyDefinition, configs) -> dict[str, Any]:
    """Per arm, the value of the study's curve key (the head count for ``heads``); None for arms off it."""
    if not d.curve:
        return {}
    out: dict[str, Any] = {}
    for arm in d.arms:
        cfg = configs[(arm, 0)]
        if d.curve == "residual.heads":
            out[arm] = cfg.residual.resolved_heads()  # None for kinds without routing heads
        else:
            out[arm] = cfg.flat().get(d.curve)
    return out


def check_data(configs: dict[tuple[str, int], RunConfig], cache: Path,
               extra=()) -> tuple[list[str], dict[tuple[str, int], int], list[str]]:
    """Load (and cache) each distinct corpus once up front: a folder without text fails the study at
    once, not an hour in when the first arm that uses it starts. Returns one description per corpus,
    each grid point's tokenizer vocabulary, and a line per corpus and sequence length whose held-out part
    holds fewer final-evaluation sequences than asked."""
    from ..data import fitting_windows, load_corpus
    from ..training.final_eval import shortfall

    seen: dict[str, tuple[str, int]] = {}
    vocabs: dict[tuple[str, int], int] = {}
    notes: list[str] = []
    for point, cfg in [*configs.items(), *((None, c) for c in extra)]:
        key = json.dumps([cfg.data.__dict__, cfg.model.seq_len], sort_keys=True, default=str)
        if key not in seen:
            corpus = load_corpus(cfg.data, cache)  # its errors name the data source, which arms share
            fitting_windows(cfg.data, corpus, cfg.model.seq_len, cfg.data.val_sequences)
            seen[key] = (corpus.info.describe(), corpus.tokenizer.vocab_size)
            if point is not None:  # a source of the cpt study's conversions is not evaluated
                notes.append(shortfall(cfg.data.val_fraction, len(corpus.val), len(corpus.train) + len(corpus.val),
                                       cfg.model.seq_len, cfg.final_sequences()) or "")
        if point is not None:
            vocabs[point] = seen[key][1]
    return list(dict.fromkeys(d for d, _ in seen.values())), vocabs, list(dict.fromkeys(n for n in notes if n))


def _budget_text(cfg: RunConfig, configs: dict[tuple[str, int], RunConfig] | None = None) -> str:
    from ..config import format_flops
    from ..training.budget import format_seconds

    if cfg.train.budget == "flops":
        steps = {arm: c.train.steps for (arm, seed), c in (configs or {}).items() if seed == 0}
        return f"{format_flops(cfg.train.flops)} each" + (
            f", which buy {', '.join(f'{arm} {n}' for arm, n in steps.items())} steps" if steps else "")
    return f"{cfg.train.steps} steps" if cfg.train.budget == "steps" else f"{format_seconds(cfg.train.time)} each"


def tune_arms(sr: StudyRun, configs, storage, log, stop, url: str | None = None) -> dict[str, float]:
    """Per arm, a TPE search over one hyperparameter on seed 0, so no arm is judged on a learning rate
    picked for another. Returns each arm's best value (finished searches are not rerun). Trials run
    through ``study.optimize`` (the heartbeat covers them); one whose process died is queued again and
    resumes its own run folder."""
    import optuna
    from optuna.trial import TrialState

    from ..training.run import train_run

    if sr.tune != "lr":
        raise UsageError(f"--tune supports lr, got {sr.tune!r}")
    best: dict[str, float] = {}
    for arm in sr.definition.arms:
        base = configs[(arm, 0)]
        study = optuna.create_study(study_name=f"{sr.key}-tune-lr-{arm}", storage=storage, direction="minimize",
                                    load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=0))
        if url is None or st.is_local(url):
            st.reap_dead(study)

        def objective(trial, arm=arm, base=base) -> float:
            for k, v in st.owner_attrs().items():
                trial.set_user_attr(k, v)
            lr = trial.suggest_float("lr", base.optim.lr / 10, base.optim.lr * 10, log=True)
            cfg = copy.deepcopy(base)  # the grid's own config: a flops budget's steps are resolved in it
            cfg.optim.lr = lr
            run_dir = under_output(sr.output, trial.user_attrs.get("run_dir"),
                                   sr.folder / "tune" / f"{arm.replace(':', '')}-t{trial.number}")
            trial.set_user_attr("run_dir", run_dir.relative_to(sr.output).as_posix())
            try:
                result = train_run(cfg, run_dir, sr.output / "cache", resume=True, log=log, stop=stop,
                                   title=f"tune {arm} lr={lr:.2e}: ", position=1, log_evals=False,
                                   allow_version_change=sr.allow_version_change)
            except UsageError as e:
                raise UsageError(f"tuning arm {arm!r}: {e}") from None
            if result["status"] == "interrupted":
                raise KeyboardInterrupt
            if not sr.keep_checkpoints:
                drop_checkpoints(run_dir)
            return result["final_val_loss"] if result["status"] == "completed" else float("inf")

        while sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)) < sr.tune_trials:
            study.optimize(objective, n_trials=1, gc_after_trial=False)
        best[arm] = float(study.best_params["lr"])
        log(f"tuned {arm}: lr = {best[arm]:.3g}")
    return best

