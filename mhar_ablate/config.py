"""Typed run configuration: small dataclasses, loaded from YAML and overridden by dotted ``key=value``.

A run is ``RunConfig`` = model + residual + data + optim + train + seed. ``model.preset`` names a file in
``configs/`` whose keys fill the model section before any explicit ``model.*`` key. Unknown keys and bad
values raise ``UsageError`` with one line that names the key, so a typo fails before training starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from .errors import UsageError
from .ranges import check_fields, ranged

PACKAGE_ROOT = Path(__file__).resolve().parent
# configs/ and studies/ live beside the package in a checkout (and in an editable install); the
# current directory wins so that a user can keep their own presets next to their outputs.
SEARCH_ROOTS = (Path.cwd(), PACKAGE_ROOT.parent, PACKAGE_ROOT / "_data")


def find_resource(folder: str, name: str) -> Path:
    """``configs/<name>.yaml`` or ``studies/<name>.yaml``, or a path given directly."""
    direct = Path(name)
    if direct.suffix in (".yaml", ".yml") and direct.is_file():
        return direct
    for root in SEARCH_ROOTS:
        p = root / folder / f"{name}.yaml"
        if p.is_file():
            return p
    what = {"studies": "study", "configs": "config"}.get(folder, folder)
    raise UsageError(f"unknown {what} {name!r}: choose one of {', '.join(list_resources(folder)) or '(none found)'}")


def list_resources(folder: str) -> list[str]:
    names: set[str] = set()
    for root in SEARCH_ROOTS:
        if (root / folder).is_dir():
            names.update(p.stem for p in (root / folder).glob("*.yaml"))
    return sorted(names)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{p}: not a text file (YAML must be UTF-8 text)") from None
    except OSError as e:
        raise UsageError(f"cannot read {p}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{p}: expected a mapping of keys at the top level")
    return data


@dataclass
class ModelConfig:
    preset: str = "tiny"
    # Ranges (``ranges.py``): wide enough for any model this package trains, narrow enough that a value
    # outside them is a typo, refused before a tensor of that shape is made.
    d_model: int = ranged(64, 1, 65_536)
    n_layers: int = ranged(4, 1, 1024)
    n_heads: int = ranged(4, 1, 4096)
    n_kv_heads: int = ranged(2, 1, 4096)
    head_dim: int | None = ranged(None, 2, 65_536)  # None: d_model // n_heads (Qwen3 sets it explicitly)
    ffn: int = ranged(192, 1, 1_048_576)
    seq_len: int = ranged(128, 1, 1_048_576)
    vocab_size: int | None = ranged(None, 1, 16_777_216)  # None: the tokenizer's vocabulary
    rope_theta: float = ranged(1_000_000.0, 0, lo_open=True)
    norm_eps: float = ranged(1e-6, 0, 1, lo_open=True)
    # The output projection is the input embedding (the presets, small Qwen3 models); false: a separate
    # lm_head matrix, as larger Qwen3 checkpoints have (``mhar-ablate convert`` sets it from the source).
    tie_embeddings: bool = True

    def validate(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise UsageError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise UsageError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model} (or set model.head_dim)")
        if self.head_dim is not None and self.head_dim % 2:
            raise UsageError(f"model.head_dim must be a positive even number, got {self.head_dim}")
        if (self.head_dim or self.d_model // self.n_heads) % 2:
            raise UsageError("the attention head dimension must be even for rotary embeddings")


@dataclass
class ResidualConfig:
    """The shared residual keys, and each kind's own settings (``residual.<kind>.<name>``).

    The kinds, their settings classes and their checks live in the registry, ``variants/``: this class
    holds the values. A kind's settings object is made from the registry the first time it is asked for
    (``settings``); only the run's own kind's settings are saved (``RunConfig.to_dict``).
    """

    kind: str = "mhar"
    heads: int | None = ranged(None, 1, 65_536)  # routing heads H; None: the kind's default (1 for attnres, 8 for mhar and delta)
    grouping: str = "full"  # full | layer | block:K
    query_init: str = "zeros"  # zeros | normal:STD
    backend: str = "auto"  # auto | reference | triton

    def __post_init__(self) -> None:
        # Not a dataclass field: asdict, equality and the key lookup see only the shared keys above.
        self._settings: dict[str, Any] = {}

    def settings(self, kind: str | None = None) -> Any:
        """The settings dataclass of ``kind`` (default: this config's kind), or None for a kind without any."""
        kind = kind or self.kind
        if kind not in self._settings:
            make = kind_class(kind).Settings
            self._settings[kind] = make() if make is not None else None
        return self._settings[kind]

    def resolved_heads(self) -> int | None:
        """Routing heads H of the kinds that route over depth; None for the kinds without heads."""
        default = kind_class(self.kind).default_heads
        if default is None:
            return None
        return self.heads if self.heads is not None else default

    def block_layers(self) -> int | None:
        """Layers per block source; None for ``full`` (every sublayer is its own source)."""
        g = self.grouping
        if g == "full":
            return None
        if g == "layer":
            return 1
        m = re.fullmatch(r"block:(-?\d+)", g)
        if not m:
            raise UsageError(f"residual.grouping must be full, layer or block:K, got {g!r}")
        k = int(m.group(1))
        if k < 1:
            raise UsageError(f"residual.grouping={g}: K must be at least 1")
        return k

    def query_std(self) -> float:
        q = self.query_init
        if q == "zeros":
            return 0.0
        m = re.fullmatch(r"normal:([0-9.eE+-]+)", q)
        if not m:
            raise UsageError(f"residual.query_init must be zeros or normal:STD, got {q!r}")
        try:
            std = float(m.group(1))
        except ValueError:
            raise UsageError(f"residual.query_init={q}: STD is not a number") from None
        if not std > 0 or not math.isfinite(std):
            raise UsageError(f"residual.query_init={q}: STD must be a positive number")
        return std

    def validate(self, model: ModelConfig) -> None:
        cls = kind_class(self.kind)
        if self.backend not in ("auto", "reference", "triton"):
            raise UsageError(f"residual.backend must be auto, reference or triton, got {self.backend!r}")
        # A kind checks the shared keys it reads (and ignores the others, as the baseline ignores them all)
        # and its own settings.
        cls.check(self, model)

    def check_routing(self, model: ModelConfig) -> None:
        """The shared keys of the kinds that route over depth (attnres, mhar, delta): H routing heads that
        divide d, a grouping that fits the depth, a valid query initialisation."""
        h = self.resolved_heads()
        if h < 1 or model.d_model % h:
            raise UsageError(f"residual.heads={h} does not divide model.d_model={model.d_model}")
        if self.backend == "triton" and h & (h - 1):
            raise UsageError(f"residual.backend=triton needs residual.heads to be a power of two, got {h}; "
                             "use residual.backend=reference")
        k = self.block_layers()
        if k is not None and k > model.n_layers:
            raise UsageError(f"residual.grouping={self.grouping}: K={k} is larger than model.n_layers={model.n_layers}")
        self.query_std()


def kind_class(kind: str) -> Any:
    """The registered class of a residual kind (``variants/__init__.py``, ``RESIDUALS``)."""
    from .variants import RESIDUALS  # the registry is the one list of kinds

    if kind not in RESIDUALS:
        raise UsageError(f"unknown residual.kind {kind!r}: choose one of {', '.join(RESIDUALS)}")
    return RESIDUALS[kind]


@dataclass
class DataConfig:
    # stdlib | debian-en (docs/corpora.md) | a path to a file or folder of .txt/.jsonl/.json/.parquet, or to a
    # packed corpus folder | hub:NAME
    source: str = "stdlib"
    text_field: str = "text"  # the column holding text in JSON lines / Parquet / hub datasets
    tokenizer: str = "byte"  # byte | bpe | a tokenizer.json file (a Hugging Face `tokenizers` file)
    vocab_size: int = ranged(4096, 260, 1_000_000)  # for bpe
    val_fraction: float = ranged(0.01, 0, 0.5, lo_open=True, hi_open=True)
    val_sequences: int = ranged(64, 1, 1_000_000_000)  # cap on the validation set (sequences of model.seq_len + 1 tokens)
    # The final evaluation set (every run ends with one evaluation on it): this many sequences of
    # model.seq_len + 1 tokens, spread evenly over the held-out part (capped by what it holds), the same
    # for every arm and seed. None: the preset's default (FINAL_SEQUENCES).
    final_sequences: int | None = ranged(None, 0, 1_000_000_000)  # 0: no final evaluation
    max_tokens: int | None = ranged(None, 1)  # truncate the corpus (after tokenising) for quick experiments

    def validate(self) -> None:
        if self.tokenizer not in ("byte", "bpe"):
            if not self.tokenizer.endswith(".json"):
                raise UsageError(f"data.tokenizer must be byte, bpe or a tokenizer.json file, got {self.tokenizer!r}")
            if not Path(self.tokenizer).is_file():
                raise UsageError(f"data.tokenizer: no such file: {self.tokenizer}")
        if self.source not in ("stdlib", "debian-en") and not self.source.startswith("hub:") and not Path(self.source).exists():
            raise UsageError(f"data.source: no such file or folder: {self.source}")


def unused_vocabulary(model_vocab: int, tokenizer_vocab: int) -> str | None:
    """The warning for a model vocabulary far larger than its tokenizer's (a paper preset's Qwen3
    vocabulary over a smaller tokenizer), or None: shared by ``train`` and ``info``."""
    if model_vocab <= 2 * tokenizer_vocab:
        return None
    return (f"model.vocab_size={model_vocab:,} is {model_vocab / tokenizer_vocab:.1f}x the tokenizer's "
            f"{tokenizer_vocab:,} tokens: {model_vocab - tokenizer_vocab:,} embeddings never see a token yet cost "
            f"parameters and FLOPs; model.vocab_size={tokenizer_vocab} trains the tokenizer's vocabulary")


# Default size of the final evaluation set per model preset (``data.final_sequences``), in sequences of
# seq_len + 1 tokens. At ``small`` (and up) 16,384 sequences put the standard error of a run's loss near
# 0.0027 nats, about half of 0.005 (per-sequence spread ~0.35 nats at 512 tokens), and a paired Δ's near
# 0.0003, where the held-out part holds that many (4.2M tokens at small; the stdlib corpus's 1 % holds 614).
# ``tiny`` is the CPU preset whose default study must stay a few minutes long: 512 sequences (65k tokens)
# cost 0.6-1.8 s a run on 2 CPU cores; a run's standard error there is ~0.019, a paired Δ's 0.002-0.005.
# docs/benchmarks.md ("Final evaluation") has the measurement.
FINAL_SEQUENCES = {"tiny": 512}
FINAL_SEQUENCES_OTHER = 16_384


@dataclass
class OptimConfig:
    lr: float = ranged(3e-3, 0, lo_open=True)
    weight_decay: float = ranged(0.1, 0)
    beta1: float = ranged(0.9, 0, 1, hi_open=True)  # AdamW's betas: [0, 1)
    beta2: float = ranged(0.95, 0, 1, hi_open=True)
    grad_clip: float = ranged(1.0, 0)  # 0: no clipping
    warmup: float = ranged(0.05, 0, 1, hi_open=True)  # fraction of the budget (steps or seconds) spent warming up
    schedule: str = "cosine"  # cosine | wsd | constant
    min_lr_ratio: float = ranged(0.1, 0, 1)
    decay_fraction: float = ranged(0.2, 0, 1, lo_open=True)  # wsd: the final fraction of the budget spent decaying

    def validate(self) -> None:
        if self.schedule not in ("cosine", "wsd", "constant"):
            raise UsageError(f"optim.schedule must be cosine, wsd or constant, got {self.schedule!r}")


BUDGETS = ("steps", "wallclock", "flops")


@dataclass
class TrainConfig:
    budget: str = "steps"  # steps | wallclock | flops
    steps: int = ranged(300, 0, lo_open=True)  # optimiser steps; under the flops budget, set from train.flops (see training/budget.py)
    time: float = ranged(60.0, 0, lo_open=True)  # seconds of training time for the wallclock budget
    # Training FLOPs for the flops budget (3e15, 3P, 300T; the count of model/flops.py). None: in a study,
    # the FLOPs of the baseline arm at train.steps; a run on its own must set it.
    flops: float | None = ranged(None, 0, lo_open=True)
    batch_size: int = ranged(16, 1, 1_048_576)
    eval_every: int = ranged(10, 1)  # number of evaluations spread evenly over the budget
    eval_batches: int = ranged(4, 1)
    heatmap_every: int = ranged(4, 1)  # draw the routing heatmap every N evaluations (and always at the end)
    # A checkpoint is written at every evaluation, on a stop and at the end; between evaluations also
    # once this many wall-clock seconds have passed since the last one (0: only at evaluations), so a
    # SIGKILL loses at most the training since the later of the two.
    checkpoint_every: float = ranged(600.0, 0)
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    # Capture each step in a CUDA graph and replay it (CUDA only; on a CPU the step runs uncaptured).
    cuda_graph: bool = True
    # Steps between read-outs of the device (losses, gradient norms, the clock, divergence): the only
    # points besides evaluations where the host waits for the GPU.
    log_every: int = ranged(20, 1)
    threads: int | None = ranged(None, 1)  # CPU threads for torch (at least 1); None: torch's default
    # Processes (GPUs, or CPU process groups) per run, through Lightning's DDP. batch_size stays the
    # global batch (each rank takes batch_size / devices rows of it), so steps mean the same at any N.
    devices: int = ranged(1, 1)
    # Weights a run starts from when it has no checkpoint of its own: a safetensors file or a checkpoint
    # of this package (``checkpoints/last.ckpt``), read without unpickling. Every non-routing parameter
    # must be in it with its shape; routing parameters it lacks keep the kind's initial values (delta's
    # zero gate: the run starts computing exactly what the file's model computed). The optimiser is fresh.
    # (Its existence is checked when the run starts: a study's source stage writes it after the arms'
    # configs are built.)
    init: str | None = None
    # The training stream's first batch number: a continued run reads on from where its source stopped
    # (batch i depends on (seed, i) only) instead of replaying the batches the source trained on.
    first_batch: int = ranged(0, 0)
    # Where the run's scalars go, through Lightning's logger API (training/loggers.py): tensorboard | csv |
    # wandb (the wandb extra; WANDB_MODE=offline logs without an account).
    logger: str = "tensorboard"

    def validate(self) -> None:
        if self.budget not in BUDGETS:
            raise UsageError(f"train.budget must be steps, wallclock or flops, got {self.budget!r}")
        if self.batch_size % self.devices:
            raise UsageError(f"train.batch_size={self.batch_size} must be divisible by train.devices={self.devices} "
                             "(it is the global batch, split evenly between the processes)")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise UsageError(f"train.precision must be auto, fp32 or bf16, got {self.precision!r}")
        if self.logger not in ("tensorboard", "csv", "wandb"):
            raise UsageError(f"train.logger must be tensorboard, csv or wandb, got {self.logger!r}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = ranged(0, 0, 2**32 - 1)  # the range numpy's and torch's generators take

    def validate(self) -> "RunConfig":
        self.check_ranges()
        self.model.validate()
        self.residual.validate(self.model)
        self.data.validate()
        self.optim.validate()
        self.train.validate()
        return self

    def check_ranges(self) -> None:
        """Every key's own rule (``ranges.py``: finite numbers in the field's range, no empty string), for
        the top-level keys, each section and every kind's settings object made so far, before the checks
        that relate keys and before anything is built from a value."""
        check_fields(self, "")
        for name in ("model", "residual", "data", "optim", "train"):
            check_fields(getattr(self, name), f"{name}.")
        for kind, settings in self.residual._settings.items():
            if settings is not None:
                check_fields(settings, f"residual.{kind}.")

    def final_sequences(self) -> int:
        """Sequences asked of the final evaluation set: ``data.final_sequences``, or the preset's default."""
        if self.data.final_sequences is not None:
            return self.data.final_sequences
        return FINAL_SEQUENCES.get(self.model.preset, FINAL_SEQUENCES_OTHER)

    def to_dict(self) -> dict[str, Any]:
        """Nested sections, as config.yaml holds them; the residual section also holds the run's own kind's
        settings as a mapping (``residual: {kind: hc, ..., hc: {rate: 4, dynamic: true}}``). Kinds without
        settings (baseline, attnres, mhar) save exactly what they saved before settings existed."""
        out = dataclasses.asdict(self)
        own = self.residual.settings()
        if own is not None:
            out["residual"][self.residual.kind] = dataclasses.asdict(own)
        return out

    def flat(self) -> dict[str, Any]:
        """Dotted keys (``residual.hc.rate``), for hyperparameter logging, study tables and fingerprints."""
        return flatten(self.to_dict())


# --------------------------------------------------------------------------- parsing and merging

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([smh]?)\s*$")


def parse_duration(text: str | float | int) -> float:
    """``90s``, ``10m``, ``1.5h`` or a bare number of seconds -> seconds (positive)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip()
        neg = s.startswith("-")
        m = _DURATION.match(s.lstrip("-"))
        if not m:
            raise UsageError(f"not a duration: {text!r} (use 90s, 10m, 1.5h or seconds)")
        seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        seconds = -seconds if neg else seconds
    if not seconds > 0 or not math.isfinite(seconds):
        raise UsageError(f"a duration must be positive, got {text!r}")
    return seconds


_FLOPS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([kKMGTPE]?)\s*(?:(?i:flops?)|F)?\s*$")
FLOP_UNITS = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def parse_flops(text: str | float | int) -> float:
    """``3e15``, ``3P``, ``300T``, ``1.5 PFLOPs`` or a bare number -> FLOPs (positive, finite).
    Units are SI prefixes: k, M, G, T, P, E (a lower-case m would read as milli, so it is refused)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        flops = float(text)
    else:
        s = str(text).replace("_", "").strip()
        m = _FLOPS.match(s.lstrip("-"))
        if not m:
            raise UsageError(f"not a number of FLOPs: {text!r} (use 3e15, 3P, 300T or a plain number)")
        flops = float(m.group(1)) * FLOP_UNITS[m.group(2)] * (-1 if s.startswith("-") else 1)
    if not flops > 0 or not math.isfinite(flops):
        raise UsageError(f"a FLOPs budget must be a positive number, got {text!r}")
    return flops


def format_flops(flops: float) -> str:
    """FLOPs in three significant digits with an SI prefix: 3.42 GFLOPs, 1.00 PFLOPs."""
    for unit in ("E", "P", "T", "G", "M", "k"):
        if flops >= FLOP_UNITS[unit]:
            return f"{flops / FLOP_UNITS[unit]:.3g} {unit}FLOPs"
    return f"{flops:.3g} FLOPs"


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML value or a command-line string to the field's declared type."""
    origin = getattr(typ, "__args__", None)
    optional = origin is not None and type(None) in origin
    base = next((t for t in origin if t is not type(None)), str) if origin else typ
    if isinstance(value, str) and optional and value.lower() in ("none", "null", "~"):
        return None
    if value is None:
        if optional:
            return None
        raise UsageError(f"{key} cannot be empty")
    if isinstance(value, (list, tuple, set, dict)):
        raise UsageError(f"{key}: expected {getattr(base, '__name__', base)}, got a {type(value).__name__} ({value!r})")
    try:
        if base in (int, float) and isinstance(value, bool):  # YAML's true is not the number 1
            raise ValueError
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, str):
                value = value.replace("_", "")
                return int(float(value)) if re.fullmatch(r"[-+]?\d+(\.0*)?([eE]\+?\d+)?", value) else int(value)
            return int(value)
        if base is float:
            try:
                if key == "train.time":
                    return parse_duration(value)
                if key == "train.flops":
                    return parse_flops(value)
            except UsageError as e:
                raise UsageError(f"{key}: {e}") from None
            return float(value)
        if base is str:
            return str(value)
    except UsageError:
        raise
    except (TypeError, ValueError, OverflowError):  # OverflowError: 1e400 for an integer
        raise UsageError(f"{key}: expected {base.__name__}, got {value!r}") from None
    return value


def _section_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def flatten(updates: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys: ``{"residual": {"hc": {"rate": 4}}}`` -> ``{"residual.hc.rate": 4}``.
    No configuration value is itself a mapping, so every mapping is a level of keys."""
    flat: dict[str, Any] = {}
    for k, v in updates.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def apply(cfg: RunConfig, updates: dict[str, Any], where: str = "") -> None:
    """Apply a nested or dotted mapping to ``cfg`` in place; unknown keys are errors.

    Keys are ``name`` (top level: ``seed``), ``section.name`` and, for a residual kind's own settings,
    ``residual.<kind>.<name>``; YAML may nest any of them (``residual: {hc: {rate: 4}}``)."""
    src = f" in {where}" if where else ""
    flat = flatten(updates)
    # The preset goes first so that explicit model.* keys override what it sets.
    if "model.preset" in flat:
        load_preset(cfg, str(flat.pop("model.preset")))
    top = _section_types(RunConfig)
    for key, value in flat.items():
        parts = key.split(".")
        if len(parts) == 1:
            if key not in top or dataclasses.is_dataclass(top[key]):
                raise UsageError(f"unknown config key {key!r}{src}" + (" (it is a section: use section.key=value)" if key in top else ""))
            setattr(cfg, key, _coerce(value, top[key], key))
            continue
        if parts[0] == "residual" and len(parts) in (2, 3) and parts[1] not in _section_types(ResidualConfig):
            _apply_kind_setting(cfg.residual, parts, value, key, src)
            continue
        if len(parts) != 2 or parts[0] not in top or not dataclasses.is_dataclass(top[parts[0]]):
            raise UsageError(f"unknown config key {key!r}{src}")
        section = getattr(cfg, parts[0])
        types = _section_types(type(section))
        if parts[1] not in types:
            raise UsageError(f"unknown config key {key!r}{src}: {parts[0]} has {', '.join(types)}")
        setattr(section, parts[1], _coerce(value, types[parts[1]], key))


def _apply_kind_setting(res: ResidualConfig, parts: list[str], value: Any, key: str, src: str) -> None:
    """``residual.<kind>.<name>=value``: one of a kind's own settings."""
    from .variants import RESIDUALS

    with_settings = [k for k, c in RESIDUALS.items() if c.Settings is not None]
    kind = parts[1]
    if kind not in with_settings:
        raise UsageError(f"unknown config key {key!r}{src}: residual has {', '.join(_section_types(ResidualConfig))}, "
                         f"and residual.KIND.NAME for the kinds with settings of their own ({', '.join(with_settings)})")
    types = _section_types(RESIDUALS[kind].Settings)
    if len(parts) == 2:
        raise UsageError(f"{key}{src} is a kind's group of settings: use {key}.NAME=value ({', '.join(types)})")
    if parts[2] not in types:
        raise UsageError(f"unknown config key {key!r}{src}: residual.{kind} has {', '.join(types)}")
    setattr(res.settings(kind), parts[2], _coerce(value, types[parts[2]], key))


def load_preset(cfg: RunConfig, name: str) -> None:
    if not name.strip():
        raise UsageError(f"model.preset cannot be empty: choose one of {', '.join(list_resources('configs'))}")
    try:
        path = find_resource("configs", name)
    except UsageError as e:
        raise UsageError(f"model.preset: {e}") from None
    data = load_yaml(path)
    types = _section_types(ModelConfig)
    for k, v in data.items():
        if k not in types or k == "preset":
            raise UsageError(f"unknown model key {k!r} in preset {path}")
        setattr(cfg.model, k, _coerce(v, types[k], f"model.{k}"))
    cfg.model.preset = Path(name).stem


def parse_overrides(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"expected key=value, got {item!r}")
        k, v = item.split("=", 1)
        if not k:
            raise UsageError(f"expected key=value, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def build_config(config_file: str | None = None, overrides: dict[str, Any] | None = None,
                 base: dict[str, Any] | None = None) -> RunConfig:
    """Defaults <- ``tiny`` preset <- ``base`` mapping <- config file <- overrides, then validated."""
    cfg = RunConfig()
    load_preset(cfg, cfg.model.preset)
    if base:
        apply(cfg, base, "study")
    if config_file:
        apply(cfg, load_yaml(config_file), str(config_file))
    if overrides:
        apply(cfg, overrides, "the command line")
    return cfg.validate()


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a config saved with ``to_dict`` (a run folder's config.yaml), without re-reading presets."""
    cfg = RunConfig()
    model = dict(data.get("model", {}))
    preset = model.pop("preset", cfg.model.preset)
    apply(cfg, {k: v for k, v in data.items() if k != "model"}, "saved config")
    types = _section_types(ModelConfig)
    for k, v in model.items():
        if k not in types:
            raise UsageError(f"unknown model key {k!r} in saved config")
        setattr(cfg.model, k, _coerce(v, types[k], f"model.{k}"))
    cfg.model.preset = preset
    return cfg.validate()
