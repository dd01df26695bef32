"""Residual-stream variants behind one interface, and the registry that names them.

A variant decides what each sublayer reads and how its output is kept. The decoder calls, per batch:

    state = residual.start(x0)                 # x0: token embeddings (B, T, d)
    for site in range(2 * n_layers):           # attention, MLP, attention, MLP, ...
        x, normed = residual.read_with_norm(state, site, sublayer.norm)  # the sublayer's input
        residual.write(state, site, sublayer(x, normed=normed))
    h = residual.finish(state)                 # what the output norm sees

``read`` returns one tensor (B, T, d), or for an attention site of a multiway variant (MUDDFormer) a
triple (queries', keys', values' input), normalised one by one. ``read_with_norm`` returns it with the
sublayer's pre-norm of it, where the variant computes that norm in its own kernels (MHAR's fused path
does: ``fused.py``), or None, the sublayer's to compute.

A variant is one module: its class implements ``Residual`` and carries, as class attributes, what the
rest of the package asks of a kind without building a model: its settings (a small dataclass whose
fields are the ``residual.<kind>.<name>`` keys), the shared ``residual.*`` keys it reads, its check of
the configuration, its label in run names and tables, whether it has a fused GPU path, whether it
records depth weights, its own training FLOPs per token (``routing_flops``, which the flops budget
counts), and the rows it adds to ``mhar-ablate bench model``. ``RESIDUALS`` below is the one
list of kinds: the configuration, the command line, studies, results, export and ``bench model`` read it.
"""

from __future__ import annotations

from typing import Any

from .base import Residual


from .baseline import BaselineResidual
from .delta import DeltaResidual
from .denseformer import DenseFormerResidual
from .hc import HyperConnections
from .mhc import ManifoldHyperConnections
from .muddformer import MUDDFormerResidual
from .routed import AttnResResidual, MHARResidual

RESIDUALS: dict[str, type[Residual]] = {
    "baseline": BaselineResidual,
    "attnres": AttnResResidual,
    "mhar": MHARResidual,
    "delta": DeltaResidual,
    "hc": HyperConnections,
    "mhc": ManifoldHyperConnections,
    "denseformer": DenseFormerResidual,
    "muddformer": MUDDFormerResidual,
}
for _kind, _cls in RESIDUALS.items():
    _cls.kind = _kind


def build_residual(cfg: Any, model: Any) -> Residual:
    """``cfg``: ResidualConfig, ``model``: ModelConfig (validated)."""
    return RESIDUALS[cfg.kind](cfg, model)
