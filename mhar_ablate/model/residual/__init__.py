"""Residual-stream variants behind one interface, and the registry that names them.

A variant decides what each sublayer reads and how its output is kept. The decoder calls, per batch:

    state = residual.start(x0)                 # x0: token embeddings (B, T, d)
    for site in range(2 * n_layers):           # attention, MLP, attention, MLP, ...
        x = residual.read(state, site)         # the sublayer's input
        residual.write(state, site, sublayer(x))
    h = residual.finish(state)                 # what the output norm sees

Adding a variant is one module with a class that implements ``Residual`` and one line in ``RESIDUALS``.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn


class Residual(nn.Module):
    """Interface of a residual-stream variant; ``state`` is whatever object the variant needs."""

    def start(self, x0: Tensor) -> Any:
        raise NotImplementedError

    def read(self, state: Any, site: int) -> Tensor:
        raise NotImplementedError

    def write(self, state: Any, site: int, out: Tensor) -> None:
        raise NotImplementedError

    def finish(self, state: Any) -> Tensor:
        raise NotImplementedError

    record: bool | None = None  # whether forward passes record depth weights (see last_weights)

    def routing_parameters(self) -> list[nn.Parameter]:
        """Parameters that take no weight decay (routing queries and key gains)."""
        return []

    def last_weights(self) -> list[Tensor] | None:
        """Per routing site, the depth weights of the last recorded forward pass, (sources, heads)."""
        return None


from .baseline import BaselineResidual  # noqa: E402  (the variants import Residual above)
from .routed import AttnResResidual, MHARResidual  # noqa: E402

RESIDUALS: dict[str, Callable[..., Residual]] = {
    "baseline": BaselineResidual,
    "attnres": AttnResResidual,
    "mhar": MHARResidual,
}


def build_residual(cfg: Any, model: Any) -> Residual:
    """``cfg``: ResidualConfig, ``model``: ModelConfig (validated)."""
    return RESIDUALS[cfg.kind](cfg, model)
