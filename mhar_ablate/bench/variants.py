"""The rows of ``mhar-ablate bench model``: one ``Variant`` per residual kind, grouping, path and compile
mode, read from the registry (``variants/``), and the kernel forms a row may switch on while it runs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported inside the functions that run: the command line builds this parser for every command.


# The paper's tokens per step: 8 sequences of the preset's length (8 x 2048 at 100M, 8 x 1024 otherwise).
PAPER_BATCH = 8
PAPER_VOCAB = 151_936  # Qwen3 tokenizer, tied embeddings
CPU_SHAPE = (1, 16)  # --device cpu: a smoke run, not a measurement


@dataclass(frozen=True)
class Variant:
    routing: str  # the residual kind (variants/'s RESIDUALS): baseline, attnres, mhar, delta, hc, ...
    grouping: str | None  # kinds with a fused path: full | block:4 (None otherwise)
    # Kinds with a fused path: reference | fused; the others: reference (plain PyTorch; under compile the
    # routing is fused with its neighbours and not split off); None for the baseline.
    path: str | None
    compiled: bool
    sites_per_pass: int | None = None  # fused path: consecutive sites sharing one pass over the history
    # fused path of a kind that can fold (``folds_norms``): the sublayers' pre-norms in its kernels; None:
    # the model's default
    fold_norms: bool | None = None
    # fused path: the shared pass's stacked products' form for this row, "off" or "TOKENS,WARPS,STAGES,ROWS"
    # (``history.HISTORY_STACKED_CONFIG``, set while the row's model builds, steps and is captured); None: the
    # package's
    stacked: str | None = None
    label: str | None = None  # kinds without a fused path: the row's name (the kind's bench_variants)
    settings: tuple[tuple[str, str], ...] = ()  # and its residual.<kind>.<name> overrides

    @property
    def name(self) -> str:
        mode = "compiled" if self.compiled else "eager"
        if self.routing == "baseline":
            return f"baseline-{mode}"
        if self.label is not None:
            return f"{self.label}-{mode}"
        path = "ref" if self.path == "reference" else "fused"
        return f"{self.routing}-{self.grouping.replace(':', '')}-{path}-{mode}"

    def overrides(self, heads: int) -> dict[str, str]:
        """The config overrides (the preset aside) that build this variant's model: what `train` is given
        to train the same model as this row."""
        from ..variants import RESIDUALS

        over = {"residual.kind": self.routing, **dict(self.settings)}
        cls = RESIDUALS[self.routing]
        if cls.fused_path:
            over.update({"residual.grouping": self.grouping,
                         "residual.backend": "triton" if self.path == "fused" else "reference"})
        if "heads" in cls.shared:  # the kinds whose head count varies (mhar, delta)
            over["residual.heads"] = str(heads)
        return over


def _baseline(compiled: bool) -> Variant:
    return Variant("baseline", None, None, compiled)


def all_variants(sites_per_pass: Sequence[int | None], fold_norms: Sequence[bool | None] = (None,),
                 stacked: Sequence[str | None] = (None,)) -> list[Variant]:
    """Every kind of the registry, eager variants first, then compiled ones; the baseline first in each
    mode. A kind with a fused path gets full and block:4 grouping, each on the reference and the fused path
    (one fused row per sites-per-pass value, per fold-norms value where the kind folds, and per stacked
    configuration); the others get one row per entry of their bench_variants."""
    from ..variants import RESIDUALS

    out = []
    for compiled in (False, True):
        out.append(_baseline(compiled))
        for kind, cls in RESIDUALS.items():
            if kind == "baseline":
                continue
            if not cls.fused_path:
                out.extend(Variant(kind, None, "reference", compiled, label=label, settings=tuple(over.items()))
                           for label, over in cls.bench_variants().items())
                continue
            for grouping in ("full", "block:4"):
                out.append(Variant(kind, grouping, "reference", compiled))
                folds = fold_norms if cls.folds_norms else (None,)
                out.extend(Variant(kind, grouping, "fused", compiled, g, f, k)
                           for g in sites_per_pass for f in folds for k in stacked)
    return out


def select_variants(spec: str, variants: list[Variant]) -> list[Variant]:
    """Comma-separated names or shell patterns (``mhar-full-*``); the baseline of each selected compile
    mode is added, since every ratio is taken against it."""
    patterns = [p.strip() for p in spec.split(",") if p.strip()]
    chosen = []
    for pattern in patterns:
        hits = [v for v in variants if fnmatch.fnmatchcase(v.name, pattern) or (pattern == "all")]
        if not hits:
            names = ", ".join(dict.fromkeys(v.name for v in variants))
            raise UsageError(f"--variants: {pattern!r} matches no variant; the variants are {names}")
        chosen.extend(h for h in hits if h not in chosen)
    for compiled in {v.compiled for v in chosen}:
        base = _baseline(compiled)
        if base not in chosen:
            chosen.append(base)
    return [v for v in variants if v in chosen]  # in the canonical order


@contextmanager
def kernel_forms(stacked: str | None) -> Iterator[None]:
    """The kernel forms a row asks for (``Variant.stacked``), in force inside the block: the fused path reads
    them when it launches, and a CUDA graph keeps what it captured."""
    from ..kernels import history

    if stacked is None:
        yield
        return
    before = history.HISTORY_STACKED_CONFIG
    history.HISTORY_STACKED_CONFIG = None if stacked == "off" else tuple(int(v) for v in stacked.split(","))
    try:
        yield
    finally:
        history.HISTORY_STACKED_CONFIG = before


def stacked_label(config: tuple[int, ...] | None) -> str:
    return "off" if config is None else ",".join(map(str, config))


