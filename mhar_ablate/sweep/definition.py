"""A study's definition (``studies/NAME.yaml``: arms, seeds, budget, curve key) and one invocation of it
(``StudyRun``: the definition with the command line's budget, output folder, workers and overrides), which
builds every grid point's configuration.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import BUDGETS, RunConfig, build_config, find_resource, load_yaml, parse_duration, parse_flops
from ..errors import UsageError


STUDY_FORMAT = 1  # bump when the stored attributes change meaning; older studies are then refused


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
        """Seed-major: workers take the points in this order, so a study stopped part-way (a time-limited
        session, a kill) holds every arm at its first seeds rather than some arms at every seed."""
        return [(arm, seed) for seed in range(self.seeds) for arm in self.definition.arms]

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
        from ..model.flops import training_flops_per_token
        from ..training.budget import flops_budget_steps

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
        # train.logger says where the series go, not what is measured: any logger continues a study.
        per_arm = {arm: {k: v for k, v in cfg.flat().items() if k not in ("seed", "train.logger") and (k, v) not in NEW_KEY_DEFAULTS}
                   for (arm, seed), cfg in configs.items() if seed == 0}
        extra = {"tune": self.tune}
        return hashlib.sha256(json.dumps([per_arm, extra], sort_keys=True, default=str).encode()).hexdigest()[:16]


# (key, value) pairs a study's fingerprint leaves out: keys added after studies existed, at their defaults.
NEW_KEY_DEFAULTS = (("train.devices", 1), ("train.flops", None), ("data.final_sequences", None))

