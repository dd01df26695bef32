"""Studies: a study definition (``studies/NAME.yaml``) and the Optuna driver that runs its arms × seeds
grid under one budget, resumably.

Storage (``storage.py``): SQLite in the output folder for one worker, a journal file there for several
workers on one machine, or a database server (``--storage postgresql://...``) for workers on several
machines; one Optuna study per (name, budget). The grid is queued as waiting trials and the workers take
them through ``study.optimize`` (``workers.py``). Each grid point trains into a fixed folder
``<output>/studies/<name>/<budget>/<arm>-s<seed>/``, so a rerun after a crash or a kill, or another worker
after a worker died, continues that point from its checkpoint; finished points (completed, diverged or
pruned) are never trained again, and their checkpoints are removed once their result is recorded
(``keep_checkpoints`` keeps them). Paths stored in the database are relative to the output folder, so a
copied or moved output folder is self-contained. Before the first trial trains, every grid point still
to train is checked (its configuration, data, vocabulary and any checkpoint it will continue), so bad
input fails at once; a finished study reruns (and prints its table) even in a read-only folder.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__
from . import storage as st
from .config import BUDGETS, RunConfig, build_config, find_resource, load_yaml, parse_duration, parse_flops
from .errors import UsageError
from .io import check_writable_folder
from .provenance import describe_differences, differences, environment
from .redaction import redact, register

STUDY_FORMAT = 1  # bump when the stored attributes change meaning; older studies are then refused
DONE_STATES = ("COMPLETE", "PRUNED")


@dataclass
class StudyDefinition:
    name: str
    description: str
    fixed: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    baseline: str | None
    seeds: int
    budgets: dict[str, str | int]
    curve: str | None = None  # a config key to plot the loss against (the head count for `heads`)
    path: Path = field(default_factory=Path)
    # A source stage (continued pretraining, `cpt`): settings of a baseline run pretrained once per seed,
    # for every arm and both budgets; each arm starts from its seed's source (train.init) and reads on in
    # its data stream (train.first_batch). None: every arm starts from scratch.
    source: dict[str, Any] | None = None

    KEYS = ("description", "fixed", "arms", "baseline", "seeds", "budgets", "curve", "source")
    # Set for every arm from the source stage.
    SOURCE_KEYS = ("train.init", "train.first_batch")

    @classmethod
    def load(cls, name: str) -> "StudyDefinition":
        path = find_resource("studies", name)
        data = load_yaml(path)
        unknown = set(data) - set(cls.KEYS)
        if unknown:
            raise UsageError(f"{path}: unknown study key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(cls.KEYS)}")
        arms = data.get("arms") or {}
        if not isinstance(arms, dict) or not arms:
            raise UsageError(f"{path}: 'arms' must map arm labels to config overrides")
        for arm, settings in arms.items():
            if settings is not None and not isinstance(settings, dict):
                raise UsageError(f"{path}: arm {arm!r} must map config keys to values (like "
                                 f"{{residual.kind: mhar}}), got {settings!r}")
        fixed = data.get("fixed") or {}
        if not isinstance(fixed, dict):
            raise UsageError(f"{path}: 'fixed' must map config keys to values, got {fixed!r}")
        budgets = data.get("budgets") or {}
        if not isinstance(budgets, dict):
            raise UsageError(f"{path}: 'budgets' must map steps, wallclock and/or flops to a length "
                             f"(like {{steps: 150, wallclock: 15s, flops: 1e15}}), got {budgets!r}")
        if set(budgets) - set(BUDGETS):
            raise UsageError(f"{path}: budgets may only set {', '.join(BUDGETS)}")
        if "steps" in budgets and (isinstance(budgets["steps"], bool) or not isinstance(budgets["steps"], int)
                                   or budgets["steps"] < 1):
            raise UsageError(f"{path}: budgets.steps must be a positive integer, got {budgets['steps']!r}")
        if "wallclock" in budgets:
            try:
                parse_duration(budgets["wallclock"])
            except UsageError as e:
                raise UsageError(f"{path}: budgets.wallclock: {e}") from None
        if "flops" in budgets:
            try:
                parse_flops(budgets["flops"])
            except UsageError as e:
                raise UsageError(f"{path}: budgets.flops: {e}") from None
        baseline = data.get("baseline")
        if baseline is not None and baseline not in arms:
            raise UsageError(f"{path}: baseline arm {baseline!r} is not one of the arms")
        seeds = data.get("seeds", 2)
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise UsageError(f"{path}: seeds must be a positive integer")
        source = data.get("source")
        if source is not None:
            if not isinstance(source, dict):
                raise UsageError(f"{path}: 'source' must map config keys to values (the pretrained stage's settings)")
            if "seed" in source:
                raise UsageError(f"{path}: the source stage takes each arm's seed; drop 'seed' from 'source'")
            clash = sorted({k for arm in arms.values() for k in (arm or {})} & set(cls.SOURCE_KEYS))
            if clash:
                raise UsageError(f"{path}: {', '.join(clash)} are set from the source stage, not by an arm")
        curve = data.get("curve")
        if curve is not None and not isinstance(curve, str):
            raise UsageError(f"{path}: curve must name a config key, got {curve!r}")
        return cls(name=Path(name).stem, description=str(data.get("description", "")), fixed=dict(fixed),
                   arms={str(k): dict(v or {}) for k, v in arms.items()}, baseline=baseline, seeds=seeds,
                   budgets=dict(budgets), curve=curve, path=path, source=dict(source) if source else None)

    def source_config(self, seed: int, overrides: dict[str, Any]) -> RunConfig:
        """The source stage's config at ``seed``: the study's fixed settings, the source's own, and the
        command line's except the budget (which is the continuation's: the source has its own length)."""
        over = {k: v for k, v in overrides.items() if k not in ("train.budget", "train.steps", "train.time", "train.flops")}
        try:
            cfg = build_config(overrides={**over, "seed": seed}, base={**self.fixed, **(self.source or {})})
        except UsageError as e:
            raise UsageError(f"source stage: {e}") from None
        if cfg.residual.kind != "baseline" or cfg.train.budget != "steps":
            raise UsageError(f"{self.path}: the source stage must be residual.kind=baseline under train.budget=steps "
                             f"(got {cfg.residual.kind}, {cfg.train.budget}): the arms convert it and read on at its step count")
        return cfg

    def check_overrides(self, overrides: dict[str, Any]) -> None:
        varied = sorted({k for arm in self.arms.values() for k in arm} & set(overrides))
        if varied:
            raise UsageError(f"{', '.join(varied)} is what study {self.name!r} varies across its arms; "
                             "it cannot be overridden for all of them")

    def arm_config(self, arm: str, seed: int, budget: str, overrides: dict[str, Any]) -> RunConfig:
        base = {**self.fixed, **self.arms[arm]}
        over = {**overrides, "seed": seed, "train.budget": budget}
        # The study's default budget length applies unless the command line set one. Under the flops budget
        # train.steps is the baseline's step count that sets the default F (StudyRun.resolve_flops).
        if budget in ("steps", "flops") and "train.steps" not in over and "steps" in self.budgets:
            over["train.steps"] = self.budgets["steps"]
        if budget == "flops" and "train.flops" not in over and "flops" in self.budgets:
            over["train.flops"] = parse_flops(self.budgets["flops"])
        if budget == "wallclock" and "train.time" not in over and "wallclock" in self.budgets:
            over["train.time"] = parse_duration(self.budgets["wallclock"])
        try:
            return build_config(overrides=over, base=base)
        except UsageError as e:
            raise UsageError(f"arm {arm!r}: {e}") from None


@dataclass
class StudyRun:
    """What a study run needs besides the definition."""

    definition: StudyDefinition
    budget: str
    output: Path
    overrides: dict[str, Any]
    seeds: int
    storage: str | None = None
    prune: bool = False
    tune: str | None = None
    tune_trials: int = 0
    workers: str | int = 1  # a number, or "gpus": one per visible GPU (per --devices GPUs)
    trials_per_gpu: int = 1
    heartbeat: int = 30  # seconds between a server-stored trial's heartbeats (three missed: it is retried)
    keep_checkpoints: bool = False  # keep finished trials' checkpoints (by default only resuming needs them)
    allow_version_change: bool = False  # continue a study under other library versions than it ran with

    @property
    def key(self) -> str:
        return f"{self.definition.name}-{self.budget}"

    @property
    def folder(self) -> Path:
        return self.output / "studies" / self.definition.name / self.budget

    def source_dir(self, seed: int) -> Path:
        """A source run, shared by both budgets of the study."""
        return self.output / "studies" / self.definition.name / "source" / f"s{seed}"

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.folder / f"{arm.replace(':', '')}-s{seed}"

    def grid(self) -> list[tuple[str, int]]:
        return [(arm, seed) for arm in self.definition.arms for seed in range(self.seeds)]

    def configs(self) -> dict[tuple[str, int], RunConfig]:
        """Every grid point's config, built (and so validated) before anything trains."""
        self.definition.check_overrides(self.overrides)
        configs = {(arm, seed): self.definition.arm_config(arm, seed, self.budget, self.overrides)
                   for arm, seed in self.grid()}
        if self.definition.source is not None:
            for (arm, seed), cfg in configs.items():
                src = self.definition.source_config(seed, self.overrides)
                # Every arm of a seed starts from the same weights and reads the same batches after them.
                cfg.train.init = str((self.source_dir(seed) / "checkpoints" / "last.ckpt").resolve())
                cfg.train.first_batch = src.train.steps
        return configs

    def resolve_flops(self, configs: dict[tuple[str, int], RunConfig], vocabs: dict[tuple[str, int], int]) -> None:
        """Under the flops budget, every grid point's ``train.flops`` and the steps it buys that arm
        (``train.steps``), in place. F is the command line's (--flops), else the study's ``budgets.flops``,
        else what the baseline arm spends in its ``train.steps`` (the study's ``budgets.steps`` or
        --steps): the baseline then trains exactly those steps and every other arm as many as the same
        FLOPs buy it."""
        if self.budget != "flops":
            return
        from .model.flops import training_flops_per_token
        from .training.budget import flops_budget_steps

        def per_step(point: tuple[str, int]) -> float:
            cfg = configs[point]
            return (training_flops_per_token(cfg, cfg.model.vocab_size or vocabs[point])
                    * cfg.train.batch_size * cfg.model.seq_len)

        default = None
        if any(cfg.train.flops is None for cfg in configs.values()):
            base = self.definition.baseline
            if base is None:
                raise UsageError(f"study {self.definition.name!r} has no baseline arm to set its FLOPs budget from: "
                                 "give --flops F, or budgets.flops in the study file")
            default = per_step((base, 0)) * configs[(base, 0)].train.steps
        for (arm, seed), cfg in configs.items():
            if cfg.train.flops is None:
                cfg.train.flops = default
            try:
                cfg.train.steps = flops_budget_steps(cfg.train.flops, per_step((arm, seed)))
            except UsageError as e:
                raise UsageError(f"arm {arm!r}: {e}") from None

    def source_configs(self) -> dict[int, RunConfig]:
        if self.definition.source is None:
            return {}
        return {seed: self.definition.source_config(seed, self.overrides) for seed in range(self.seeds)}

    def fingerprint(self, configs: dict[tuple[str, int], RunConfig]) -> str:
        """Identity of what the study measures: the arms' configs minus the seed."""
        # Keys at the value that reproduces what ran before they existed are left out, so that studies from
        # before them keep their identity.
        per_arm = {arm: {k: v for k, v in cfg.flat().items() if k != "seed" and (k, v) not in NEW_KEY_DEFAULTS}
                   for (arm, seed), cfg in configs.items() if seed == 0}
        extra = {"tune": self.tune}
        return hashlib.sha256(json.dumps([per_arm, extra], sort_keys=True, default=str).encode()).hexdigest()[:16]


# (key, value) pairs a study's fingerprint leaves out: keys added after studies existed, at their defaults.
NEW_KEY_DEFAULTS = (("train.devices", 1), ("train.flops", None), ("data.final_sequences", None))


# --------------------------------------------------------------------------- storage


def storage_url(output: Path, storage: str | None) -> str:
    if storage:
        return storage
    return st.sqlite_url(output)


def study_folder(output: Path, study, name: str) -> Path:
    """Where a study's runs and exports live: always under ``output`` (the folder recorded in the
    database is not trusted, so exporting a copied study cannot write into the original)."""
    attrs = study.user_attrs
    recorded, budget = str(attrs.get("study") or ""), str(attrs.get("budget") or "")
    safe = lambda part: bool(part) and Path(part).name == part and part not in (".", "..")
    return output / "studies" / (recorded if safe(recorded) else Path(name).stem) / (budget if safe(budget) else "")


def under_output(output: Path, recorded: str | None, default: Path) -> Path:
    """A run folder recorded in the database: relative to the output folder (an absolute one, written
    before paths were relative, may point into another copy of the study and is not used)."""
    if recorded and not Path(recorded).is_absolute() and ".." not in Path(recorded).parts:
        return output / recorded
    return default


def open_storage(url: str, create: bool, heartbeat: int | None = None):
    """An Optuna storage, or one clear UsageError for a missing folder, a corrupt file or a dead server.
    ``heartbeat`` (seconds) applies to database servers only: see ``storage.server_kwargs``."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    register(url)  # from here on its secrets are masked everywhere, library log lines included
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if st.kind(url) == "journal":
        return st.open_journal(url, create)
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if not create and not path.is_file():
            raise UsageError(f"no study database at {path} (run `mhar-ablate study NAME` with this --output first)")
        if not path.parent.is_dir():
            raise UsageError(f"storage folder does not exist: {path.parent}")
        if path.is_file() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise UsageError(f"{path} is not an SQLite database (corrupt or not written by mhar-ablate)")
    try:
        return st.create_rdb(url, **(st.server_kwargs(heartbeat) if st.kind(url) == "server" else {}))
    except (SQLAlchemyError, RuntimeError, ValueError, ImportError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = " (pip install 'mhar-ablate[postgres]' brings the PostgreSQL driver)" if isinstance(e, ImportError) else ""
        raise UsageError(f"cannot open study storage {redact(url)}: {redact(msg)}{hint}") from None


def check_readable(study, url: str) -> None:
    """Every attribute and trial of ``study`` can be read: a database edited by hand or damaged is one
    clear error, here, not a traceback in the middle of a run or an export."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        _ = study.user_attrs
        for t in study.get_trials(deepcopy=False):
            _ = t.user_attrs, t.params
    except (ValueError, TypeError, KeyError, AttributeError, SQLAlchemyError) as e:
        raise corrupt(study.study_name, url, e) from None


def corrupt(name: str, url: str, e: Exception) -> UsageError:
    first = (str(e).splitlines() or [type(e).__name__])[0][:160]
    return UsageError(f"study {name} in {redact(url)} cannot be read: an attribute or a trial is corrupt "
                      f"({redact(first)}); restore the database from a copy, or use another --output folder")


def check_compatible(study, fingerprint: str | None, key: str, seeds: int | None = None) -> None:
    attrs = study.user_attrs
    fmt = attrs.get("format")
    if fmt is not None and fmt != STUDY_FORMAT:
        raise UsageError(f"study {key} was written by mhar-ablate {attrs.get('version', '?')} (study format {fmt}); "
                         f"this is {__version__} (format {STUDY_FORMAT}): use a new --output folder")
    if fingerprint and attrs.get("fingerprint") not in (None, fingerprint):
        raise UsageError(f"study {key} already exists in this output folder with a different configuration; "
                         "rerun with the same options, or use another --output folder")
    stored = attrs.get("seeds")
    if seeds is not None and stored not in (None, seeds) and study.get_trials(deepcopy=False):
        # The seed is an Optuna parameter whose choices are fixed once a study has trials.
        raise UsageError(f"study {key} was run with {stored} seed(s) per arm; --seeds {seeds} would change its grid: "
                         f"rerun with --seeds {stored}, or use another --output folder")


def check_environment(study, sr: "StudyRun") -> list[tuple[str, Any, Any]]:
    """Refuse to continue a study under other library versions than it ran with, unless allowed;
    return the differences (empty when none)."""
    diffs = differences(study.user_attrs.get("environment"), environment())
    if diffs and not sr.allow_version_change:
        old, new = describe_differences(diffs)
        raise UsageError(f"study {sr.key} was run under {old}; this environment has {new}: rerun with "
                         "--allow-version-change to continue it under these versions (each trial records its own), "
                         "or use another --output folder")
    return diffs


def _has_study(url: str, key: str) -> bool:
    import optuna

    try:
        return key in {s.study_name for s in optuna.get_all_study_summaries(open_storage(url, create=False),
                                                                             include_best_trial=False)}
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot read study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None


def find_storage(output: Path, key: str, given: str | None) -> str | None:
    """The storage that holds study ``key``: ``--storage`` when given; else the one recorded in the
    output folder when the study was created; else a local SQLite file or journal that has it."""
    if given:
        return given
    recorded = st.recorded(output, key)
    if recorded:
        return recorded
    for url in st.local_candidates(output):
        if _has_study(url, key):
            return url
    return None


def choose_storage(sr: "StudyRun", workers: int) -> str:
    """Where this run's study lives: the existing one if any, else SQLite for one worker and the
    journal for several (SQLite serves one writer at a time). Called under the output lock."""
    url = find_storage(sr.output, sr.key, sr.storage)
    if url is None:
        url = st.journal_url(sr.output) if workers > 1 else st.sqlite_url(sr.output)
    if workers > 1 and st.kind(url) == "sqlite":
        where = "--storage" if sr.storage else f"{sr.output / st.SQLITE_FILE}"
        raise UsageError(f"study {sr.key} is in SQLite ({where}), which one worker writes at a time: run it without "
                         "--workers, or give --storage postgresql://... (several workers on one machine use a journal "
                         "file when the study is new)")
    return url


# --------------------------------------------------------------------------- the driver


def _log(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


def run_study(sr: StudyRun, stop=None, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run every missing grid point with ``sr.workers`` workers; return a summary
    {done, ran, diverged, pruned, interrupted, folder}."""
    import optuna
    from tqdm.auto import tqdm

    from .workers import make_pruner, plan, queue_grid, run_workers

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
    # Finding or creating the study, its tables and its queue must not interleave with another command
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
        if st.is_local(url):
            reaped = st.reap_dead(study)
            if reaped:
                log(f"{len(reaped)} trial(s) of an earlier run were killed; each resumes from its last checkpoint "
                    "(or from the start where it has none)")
        else:
            st.fail_stale(study)
        queue_grid(study, grid)
        if not sr.keep_checkpoints:
            _drop_finished_checkpoints(sr, study)

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
            from .workers import trial_point

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
                   file=sys.stderr, disable=len(slots) > 1 or not sys.stderr.isatty())

        def log_and_count(msg: str) -> None:
            log(msg)
            if msg.startswith("[") and ("completed" in msg or "diverged" in msg or "pruned" in msg):
                bar.update(1)

        try:
            ran = run_workers(sr, url, study, configs, tuned, slots, log_and_count, stop)
        finally:
            bar.close()
        summary.update({k: ran[k] for k in ("ran", "diverged", "pruned", "interrupted")})
        summary["done"] = len(finished())
        summary["workers_died"] = ran.get("workers_died", 0)
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
    from .training.run import load_run_config, train_run

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
    return {(t.params["arm"], t.params["seed"]) for t in study.get_trials(deepcopy=False)
            if t.state.name in DONE_STATES and "arm" in t.params and "seed" in t.params}


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
    from .training.checkpoint import CHECKPOINT, check_fits, read_checkpoint
    from .training.run import check_run_folder, finished_result

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


def drop_checkpoints(run_dir: Path) -> None:
    """A finished run's checkpoints: its result is recorded, and only resuming needs them. Its trained
    weights stay, as ``weights.safetensors`` (``training/checkpoint.py``), for `eval` and later analyses."""
    from .training.checkpoint import FINAL_WEIGHTS, save_final_weights

    if not (run_dir / FINAL_WEIGHTS).is_file():
        try:
            save_final_weights(run_dir)
        except UsageError:  # an unreadable checkpoint has no weights to keep; the result is recorded already
            pass
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def _drop_finished_checkpoints(sr: StudyRun, study) -> None:
    """Checkpoints of finished trials that a kill left behind (between the result and their removal);
    a trial run with ``keep_checkpoints`` keeps its own."""
    for t in study.get_trials(deepcopy=False):
        if t.state.name in DONE_STATES and t.user_attrs.get("keep_checkpoints") is False and "arm" in t.params:
            drop_checkpoints(sr.run_dir(t.params["arm"], t.params["seed"]))


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
    from .data import fitting_windows, load_corpus
    from .training.final_eval import shortfall

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
    from .config import format_flops
    from .training.budget import format_seconds

    if cfg.train.budget == "flops":
        steps = {arm: c.train.steps for (arm, seed), c in (configs or {}).items() if seed == 0}
        return f"{format_flops(cfg.train.flops)} each" + (
            f", which buy {', '.join(f'{arm} {n}' for arm, n in steps.items())} steps" if steps else "")
    return f"{cfg.train.steps} steps" if cfg.train.budget == "steps" else f"{format_seconds(cfg.train.time)} each"


def _record(trial, result: dict[str, Any]) -> None:
    """Everything the export needs, as trial attributes (so any Optuna storage carries it)."""
    curve = [[p["step"], p["seconds"], p["tokens"], p["val_loss"]] for p in result["curve"]]
    attrs = {
        "status": result["status"], "reason": result["reason"],
        "final_val_loss": result["final_val_loss"], "final_step": result["step"], "final_seconds": result["seconds"],
        "curve": curve, "tokens_per_s": result["tokens_per_s"], "peak_mem_gb": result["peak_mem_gb"],
        "params": result["params"], "baseline_params": result["baseline_params"],
        "flops_per_token": result.get("flops_per_token"),
        "param_overhead_pct": result["param_overhead_pct"], "device": result["device"],
        "routing_backend": result["routing_backend"], "environment": result.get("environment"),
    }
    attrs.update(_final_eval_attrs(result.get("final_eval")))
    for k, v in attrs.items():
        trial.set_user_attr(k, _finite_or_str(v))


def _final_eval_attrs(final: dict[str, Any] | None) -> dict[str, Any]:
    """The final evaluation's numbers as trial attributes (``final_eval_*``); its per-sequence losses too,
    so that the export can take the evaluation's noise out of paired differences between arms."""
    if not final:
        return {}
    out = {f"final_eval_{k}": final.get(k) for k in ("loss", "se", "sequences", "tokens", "seconds", "asked")}
    out["final_eval_losses"] = final.get("sequence_losses")
    return out


def _finite_or_str(v: Any) -> Any:
    """JSON (and so Optuna's storage) has no NaN or infinity: keep them as strings."""
    import math

    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_finite_or_str(x) for x in v]
    return v


def _pruning_reporter(trial, budget: str, cfg: RunConfig | None = None) -> Callable[[int, float, float], bool]:
    """Report at the global step (step budgets), at whole training seconds (wall-clock budgets) or, under
    a FLOPs budget (where arms train different step counts), at the nominal point of the evaluation in
    per mille of the budget: the k-th of ``train.eval_every`` evaluations is at 1000·k/eval_every for every
    arm (``cfg``: the run's config, its ``train.steps`` resolved). Optuna's stock Lightning callback
    reports per epoch, which means nothing here."""
    seen: set[int] = set()

    def at_point(step: int, seconds: float) -> int:
        if budget == "flops":
            every = cfg.train.eval_every
            return 1000 * min(step * every // cfg.train.steps, every) // every
        return step if budget == "steps" else int(seconds)

    def report(step: int, seconds: float, loss: float) -> bool:
        at = at_point(step, seconds)
        if at in seen or at == 0:
            return False
        seen.add(at)
        trial.report(loss, at)
        return trial.should_prune()

    return report


def tune_arms(sr: StudyRun, configs, storage, log, stop, url: str | None = None) -> dict[str, float]:
    """Per arm, a TPE search over one hyperparameter on seed 0, so no arm is judged on a learning rate
    picked for another. Returns each arm's best value (finished searches are not rerun). Trials run
    through ``study.optimize`` (the heartbeat covers them); one whose process died is queued again and
    resumes its own run folder."""
    import optuna
    from optuna.trial import TrialState

    from .training.run import train_run

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


def load_studies(output: Path, name: str, budget: str | None, storage: str | None) -> list[Any]:
    """The Optuna studies of ``name`` in ``output`` (one per budget that was run), wherever the workers
    kept them: ``--storage`` if given, else the storage recorded in the output folder, else a local
    SQLite file or journal that holds them."""
    import optuna

    budgets = [budget] if budget else list(BUDGETS)
    if not storage and not st.local_candidates(output) and not any(st.recorded(output, f"{name}-{b}") for b in budgets):
        open_storage(st.sqlite_url(output), create=False)  # raises: no study database here
    found, names = [], set()
    for b in budgets:
        key = f"{name}-{b}"
        url = find_storage(output, key, storage)
        if url is None:
            continue
        st_obj = open_storage(url, create=False)
        try:
            have = {s.study_name for s in optuna.get_all_study_summaries(st_obj, include_best_trial=False)}
        except json.JSONDecodeError as e:  # an attribute that is not JSON
            raise corrupt(key, url, e) from None
        except Exception as e:
            raise UsageError(f"cannot read study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None
        names |= have
        if key in have:
            found.append(optuna.load_study(study_name=key, storage=st_obj))
    if not found:
        for url in st.local_candidates(output):
            try:
                names |= {s.study_name for s in optuna.get_all_study_summaries(open_storage(url, create=False),
                                                                               include_best_trial=False)}
            except Exception:
                pass
        have = sorted({n.rsplit("-", 1)[0] for n in names if "-tune-" not in n})
        raise UsageError(f"no study {name!r}{' with --budget ' + budget if budget else ''} in {output}"
                         + (f" (found: {', '.join(have)})" if have else " (run `mhar-ablate study NAME` first)"))
    for s in found:
        check_readable(s, find_storage(output, s.study_name, storage) or "")
        check_compatible(s, None, s.study_name)
    return found
