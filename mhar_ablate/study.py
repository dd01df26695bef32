"""Studies: a study definition (``studies/NAME.yaml``) and the Optuna driver that runs its arms × seeds
grid under one budget, resumably.

Storage is one Optuna database per output folder (SQLite by default, any Optuna URL with ``--storage``),
with one Optuna study per (name, budget). Each grid point trains into a fixed folder
``<output>/studies/<name>/<budget>/<arm>-s<seed>/``, so a rerun after a crash or a kill continues that
point from its checkpoint; finished points (completed, diverged or pruned) are never trained again.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .config import RunConfig, build_config, find_resource, load_yaml, parse_duration
from .errors import UsageError

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

    KEYS = ("description", "fixed", "arms", "baseline", "seeds", "budgets", "curve")

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
        budgets = data.get("budgets") or {}
        if set(budgets) - {"steps", "wallclock"}:
            raise UsageError(f"{path}: budgets may only set steps and wallclock")
        baseline = data.get("baseline")
        if baseline is not None and baseline not in arms:
            raise UsageError(f"{path}: baseline arm {baseline!r} is not one of the arms")
        seeds = data.get("seeds", 2)
        if not isinstance(seeds, int) or seeds < 1:
            raise UsageError(f"{path}: seeds must be a positive integer")
        return cls(name=Path(name).stem, description=str(data.get("description", "")), fixed=dict(data.get("fixed") or {}),
                   arms={str(k): dict(v or {}) for k, v in arms.items()}, baseline=baseline, seeds=seeds,
                   budgets=dict(budgets), curve=data.get("curve"), path=path)

    def check_overrides(self, overrides: dict[str, Any]) -> None:
        varied = sorted({k for arm in self.arms.values() for k in arm} & set(overrides))
        if varied:
            raise UsageError(f"{', '.join(varied)} is what study {self.name!r} varies across its arms; "
                             "it cannot be overridden for all of them")

    def arm_config(self, arm: str, seed: int, budget: str, overrides: dict[str, Any]) -> RunConfig:
        base = {**self.fixed, **self.arms[arm]}
        over = {**overrides, "seed": seed, "train.budget": budget}
        # The study's default budget length applies unless the command line set one.
        if budget == "steps" and "train.steps" not in over and "steps" in self.budgets:
            over["train.steps"] = self.budgets["steps"]
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

    @property
    def key(self) -> str:
        return f"{self.definition.name}-{self.budget}"

    @property
    def folder(self) -> Path:
        return self.output / "studies" / self.definition.name / self.budget

    def grid(self) -> list[tuple[str, int]]:
        return [(arm, seed) for arm in self.definition.arms for seed in range(self.seeds)]

    def configs(self) -> dict[tuple[str, int], RunConfig]:
        """Every grid point's config, built (and so validated) before anything trains."""
        self.definition.check_overrides(self.overrides)
        return {(arm, seed): self.definition.arm_config(arm, seed, self.budget, self.overrides)
                for arm, seed in self.grid()}

    def fingerprint(self, configs: dict[tuple[str, int], RunConfig]) -> str:
        """Identity of what the study measures: the arms' configs minus the seed."""
        per_arm = {arm: {k: v for k, v in cfg.flat().items() if k != "seed"} for (arm, seed), cfg in configs.items() if seed == 0}
        extra = {"tune": self.tune}
        return hashlib.sha256(json.dumps([per_arm, extra], sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- storage


def storage_url(output: Path, storage: str | None) -> str:
    if storage:
        return storage
    return f"sqlite:///{(output / 'studies.db').resolve()}"


def redact(url: str) -> str:
    """Storage URLs can carry passwords; nothing we print or log shows them."""
    import re

    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def open_storage(url: str, create: bool):
    """An Optuna storage, or one clear UsageError for a missing folder, a corrupt file or a dead server."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = {} if url.startswith("sqlite") else {"heartbeat_interval": 60, "grace_period": 180}
            return optuna.storages.RDBStorage(url, **kwargs)
    except (SQLAlchemyError, RuntimeError, ValueError, ImportError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"cannot open study storage {redact(url)}: {redact(msg)}") from None


def check_compatible(study, fingerprint: str | None, key: str) -> None:
    attrs = study.user_attrs
    fmt = attrs.get("format")
    if fmt is not None and fmt != STUDY_FORMAT:
        raise UsageError(f"study {key} was written by mhar-ablate {attrs.get('version', '?')} (study format {fmt}); "
                         f"this is {__version__} (format {STUDY_FORMAT}): use a new --output folder")
    if fingerprint and attrs.get("fingerprint") not in (None, fingerprint):
        raise UsageError(f"study {key} already exists in this output folder with a different configuration; "
                         "rerun with the same options, or use another --output folder")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_abandoned(study) -> int:
    """Trials left RUNNING by a process of this host that no longer exists were killed: mark them
    failed so the grid gives their point out again (other hosts' trials expire by heartbeat)."""
    from optuna.trial import TrialState

    host, n = socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") == host and t.user_attrs.get("pid") != os.getpid() and not _pid_alive(t.user_attrs.get("pid", -1)):
            study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            n += 1
    return n


# --------------------------------------------------------------------------- the driver


def _grid_sampler(search_space: dict[str, list[Any]]):
    """Optuna's GridSampler, minus its habit of calling ``study.stop()`` once the grid is used up:
    that only works inside ``study.optimize``, and this driver asks and tells itself so that it can
    resume a point's checkpoint and record a diverged run as a result."""
    import optuna

    class Grid(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            return None

    return Grid(search_space, seed=0)


def _log(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()


def run_study(sr: StudyRun, stop=None, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run every missing grid point; return a summary {done, ran, diverged, failed, interrupted}."""
    import optuna
    from optuna.trial import TrialState
    from tqdm.auto import tqdm

    configs = sr.configs()  # validates every arm before any training
    corpora = check_data(configs.values(), sr.output / "cache")
    fingerprint = sr.fingerprint(configs)
    sr.output.mkdir(parents=True, exist_ok=True)
    url = storage_url(sr.output, sr.storage)
    storage = open_storage(url, create=True)
    grid = sr.grid()
    search_space = {"arm": list(sr.definition.arms), "seed": list(range(sr.seeds))}
    try:
        study = optuna.create_study(study_name=sr.key, storage=storage, direction="minimize", load_if_exists=True,
                                    sampler=_grid_sampler(search_space),
                                    pruner=optuna.pruners.MedianPruner(n_startup_trials=len(sr.definition.arms), n_warmup_steps=0)
                                    if sr.prune else optuna.pruners.NopPruner())
    except Exception as e:  # corrupt tables surface here as SQLAlchemy errors of many kinds
        raise UsageError(f"cannot use study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None
    check_compatible(study, fingerprint, sr.key)
    for k, v in {"format": STUDY_FORMAT, "version": __version__, "fingerprint": fingerprint, "study": sr.definition.name,
                 "budget": sr.budget, "arms": list(sr.definition.arms), "seeds": sr.seeds,
                 "baseline": sr.definition.baseline, "curve": sr.definition.curve,
                 "description": sr.definition.description, "folder": str(sr.folder),
                 "curve_values": _curve_values(sr.definition, configs)}.items():
        if study.user_attrs.get(k) != v:
            study.set_user_attr(k, v)
    abandoned = fail_abandoned(study)
    if abandoned:
        log(f"{abandoned} trial(s) of an earlier, killed run will be resumed from their checkpoints")

    tuned = tune_arms(sr, configs, storage, log, stop) if sr.tune else {}

    def finished() -> set[tuple[str, int]]:
        return {(t.params["arm"], t.params["seed"]) for t in study.get_trials(deepcopy=False)
                if t.state.name in DONE_STATES and "arm" in t.params}

    done = finished()
    todo = [p for p in grid if p not in done]
    summary = {"study": sr.key, "done": len(done), "ran": 0, "diverged": 0, "pruned": 0, "interrupted": False,
               "folder": str(sr.folder)}
    if not todo:
        log(f"study {sr.key}: all {len(grid)} grid points are finished; nothing to train")
        return summary
    log(f"study {sr.key}: {len(todo)} of {len(grid)} grid points to train "
        f"({len(sr.definition.arms)} arms x {sr.seeds} seeds, {configs[todo[0]].train.budget} budget: "
        f"{_budget_text(configs[todo[0]])}); storage {redact(url)}")
    for text in corpora:
        log(f"data: {text}")
    from .training.run import quiet_lightning, train_run  # Lightning loads only when something trains

    quiet_lightning()
    bar = tqdm(total=len(grid), initial=len(done), desc=sr.key, unit="trial", position=0, dynamic_ncols=True,
               file=sys.stderr, disable=not sys.stderr.isatty())
    cache = sr.output / "cache"
    try:
        while True:
            done = finished()
            if len(done) >= len(grid):
                break
            trial = study.ask()
            arm = trial.suggest_categorical("arm", search_space["arm"])
            seed = trial.suggest_categorical("seed", search_space["seed"])
            if (arm, seed) in done:  # another worker finished it meanwhile
                study.tell(trial, state=TrialState.FAIL)
                continue
            cfg = configs[(arm, seed)]
            if arm in tuned:
                cfg.optim.lr = tuned[arm]
            run_dir = sr.folder / f"{arm.replace(':', '')}-s{seed}"
            for k, v in {"host": socket.gethostname(), "pid": os.getpid(), "run_dir": str(run_dir), "lr": cfg.optim.lr}.items():
                trial.set_user_attr(k, v)
            on_eval = _pruning_reporter(trial, sr.budget) if sr.prune else None
            title = f"[{len(done) + 1}/{len(grid)}] {arm} s{seed}: "
            try:
                result = train_run(cfg, run_dir, cache, resume=True, on_eval=on_eval, log=log, title=title,
                                   stop=stop, position=1, log_evals=False)
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            _record(trial, result)
            status = result["status"]
            if status == "interrupted":
                study.tell(trial, state=TrialState.FAIL)  # rerun resumes it from its checkpoint
                summary["interrupted"] = True
                log(f"{title}interrupted; rerun the same command to resume from the checkpoint")
                break
            if status == "pruned":
                study.tell(trial, state=TrialState.PRUNED)
                summary["pruned"] += 1
            else:
                # A diverged run is a result (its loss is +inf), not a crash: it is never trained again.
                value = result["final_val_loss"] if status == "completed" else float("inf")
                study.tell(trial, value)
                summary["diverged"] += status == "diverged"
            summary["ran"] += 1
            bar.update(1)
            log(f"{title}{status}, val loss {result['final_val_loss']:.4f} at step {result['step']}, "
                f"{result['seconds']:.1f}s trained, {result['tokens_per_s'] or 0:,.0f} tokens/s")
    finally:
        bar.close()
    summary["done"] = len(finished())
    return summary


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


def check_data(configs, cache: Path) -> list[str]:
    """Load (and cache) each distinct corpus once up front: a folder without text fails the study at
    once, not an hour in when the first arm that uses it starts. Returns one description per corpus."""
    from .data import fitting_windows, load_corpus

    seen: dict[str, str] = {}
    for cfg in configs:
        key = json.dumps([cfg.data.__dict__, cfg.model.seq_len], sort_keys=True, default=str)
        if key not in seen:
            corpus = load_corpus(cfg.data, cache)
            fitting_windows(cfg.data, corpus, cfg.model.seq_len, cfg.data.val_sequences)
            seen[key] = corpus.info.describe()
    return list(dict.fromkeys(seen.values()))


def _budget_text(cfg: RunConfig) -> str:
    from .training.budget import format_seconds

    return f"{cfg.train.steps} steps" if cfg.train.budget == "steps" else f"{format_seconds(cfg.train.time)} each"


def _record(trial, result: dict[str, Any]) -> None:
    """Everything the export needs, as trial attributes (so any Optuna storage carries it)."""
    curve = [[p["step"], p["seconds"], p["tokens"], p["val_loss"]] for p in result["curve"]]
    attrs = {
        "status": result["status"], "reason": result["reason"],
        "final_val_loss": result["final_val_loss"], "final_step": result["step"], "final_seconds": result["seconds"],
        "curve": curve, "tokens_per_s": result["tokens_per_s"], "peak_mem_gb": result["peak_mem_gb"],
        "params": result["params"], "baseline_params": result["baseline_params"],
        "param_overhead_pct": result["param_overhead_pct"], "device": result["device"],
        "routing_backend": result["routing_backend"],
    }
    for k, v in attrs.items():
        trial.set_user_attr(k, _finite_or_str(v))


def _finite_or_str(v: Any) -> Any:
    """JSON (and so Optuna's storage) has no NaN or infinity: keep them as strings."""
    import math

    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_finite_or_str(x) for x in v]
    return v


def _pruning_reporter(trial, budget: str) -> Callable[[int, float, float], bool]:
    """Report at the global step (step budgets) or at whole training seconds (wall-clock budgets):
    Optuna's stock Lightning callback reports per epoch, which means nothing here."""
    seen: set[int] = set()

    def report(step: int, seconds: float, loss: float) -> bool:
        at = step if budget == "steps" else int(seconds)
        if at in seen or at == 0:
            return False
        seen.add(at)
        trial.report(loss, at)
        return trial.should_prune()

    return report


def tune_arms(sr: StudyRun, configs, storage, log, stop) -> dict[str, float]:
    """Per arm, a TPE search over one hyperparameter on seed 0, so no arm is judged on a learning rate
    picked for another. Returns each arm's best value (finished searches are not rerun)."""
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
        fail_abandoned(study)
        while sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)) < sr.tune_trials:
            trial = study.ask()
            lr = trial.suggest_float("lr", base.optim.lr / 10, base.optim.lr * 10, log=True)
            cfg = sr.definition.arm_config(arm, 0, sr.budget, sr.overrides)
            cfg.optim.lr = lr
            run_dir = sr.folder / "tune" / f"{arm.replace(':', '')}-t{trial.number}"
            trial.set_user_attr("host", socket.gethostname())
            trial.set_user_attr("pid", os.getpid())
            result = train_run(cfg, run_dir, sr.output / "cache", resume=True, log=log, stop=stop,
                               title=f"tune {arm} lr={lr:.2e}: ", position=1, log_evals=False)
            if result["status"] == "interrupted":
                study.tell(trial, state=TrialState.FAIL)
                raise KeyboardInterrupt
            study.tell(trial, result["final_val_loss"] if result["status"] == "completed" else float("inf"))
        best[arm] = float(study.best_params["lr"])
        log(f"tuned {arm}: lr = {best[arm]:.3g}")
    return best


def load_studies(output: Path, name: str, budget: str | None, storage: str | None) -> list[Any]:
    """The Optuna studies of ``name`` in ``output`` (one per budget that was run)."""
    import optuna

    url = storage_url(output, storage)
    st = open_storage(url, create=False)
    try:
        names = [s.study_name for s in optuna.get_all_study_summaries(st, include_best_trial=False)]
    except Exception as e:
        raise UsageError(f"cannot read study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None
    budgets = [budget] if budget else ["steps", "wallclock"]
    found = [optuna.load_study(study_name=f"{name}-{b}", storage=st) for b in budgets if f"{name}-{b}" in names]
    if not found:
        have = sorted({n.rsplit("-", 1)[0] for n in names if "-tune-" not in n})
        raise UsageError(f"no study {name!r}{' with --budget ' + budget if budget else ''} in {output}"
                         + (f" (found: {', '.join(have)})" if have else " (run `mhar-ablate study NAME` first)"))
    for s in found:
        check_compatible(s, None, s.study_name)
    return found
