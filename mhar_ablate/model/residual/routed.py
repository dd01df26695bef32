"""Attention Residuals (H = 1) and Multi-Head Attention Residuals (H routing heads).

Every sublayer, and a final site before the output norm, reads a softmax-over-depth mixture of the
sources computed so far (SPEC.md). Sources depend on ``residual.grouping``:

- ``full``: the embedding and every sublayer output (2L + 1 sources at the final site);
- ``block:K`` (``layer`` = ``block:1``): the embedding, the sum of each finished block of K layers, and
  for a site inside an unfinished block the running partial sum of that block. K need not divide the
  layer count: the last block is then shorter.

Each site owns a query and a key gain of width d. Queries start at zero (a uniform mixture) unless
``residual.query_init`` is ``normal:STD``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...kernels.reference import routing_weights
from ...ops import mhar_route
from . import Residual


@dataclass
class RoutedState:
    done: list[Tensor] = field(default_factory=list)  # finished sources, oldest first
    partial: Tensor | None = None  # the unfinished block's running sum
    in_block: int = 0  # sublayers already summed into ``partial``


class MHARResidual(Residual):
    def __init__(self, cfg: Any, model: Any):
        super().__init__()
        d = model.d_model
        self.num_heads = cfg.resolved_heads()
        self.n_sites = 2 * model.n_layers + 1
        k = cfg.block_layers()
        # Sublayers per source: 1 for full grouping, 2K for blocks of K layers.
        self.block_sublayers = 1 if k is None else 2 * k
        self.eps = model.norm_eps
        self.backend = cfg.backend
        std = cfg.query_std()
        self.query = nn.Parameter(torch.randn(self.n_sites, d) * std if std > 0 else torch.zeros(self.n_sites, d))
        self.key_weight = nn.Parameter(torch.ones(self.n_sites, d))
        # None: record the depth weights on every eval-mode forward; True/False force it on or off
        # (the training loop records on one validation batch only: the weights cost a second pass).
        self.record: bool | None = None
        self._weights: list[Tensor | None] = [None] * self.n_sites

    def routing_parameters(self) -> list[nn.Parameter]:
        return [self.query, self.key_weight]

    def num_sources(self, site: int) -> int:
        """How many sources the given site mixes (site 2L is the final one)."""
        finished, partial = divmod(site, self.block_sublayers)
        return 1 + finished + (1 if partial else 0)

    def start(self, x0: Tensor) -> RoutedState:
        return RoutedState(done=[x0])

    def _route(self, sources: list[Tensor], site: int) -> Tensor:
        stacked = torch.stack(sources)
        if self.record or (self.record is None and not self.training):
            with torch.no_grad():
                w = routing_weights(stacked, self.query[site], self.key_weight[site], self.num_heads, self.eps)
                self._weights[site] = w.mean(dim=(1, 2)).cpu()
        return mhar_route(stacked, self.query[site], self.key_weight[site], self.num_heads, self.eps, self.backend)

    def read(self, state: RoutedState, site: int) -> Tensor:
        sources = state.done if state.partial is None else [*state.done, state.partial]
        return self._route(sources, site)

    def write(self, state: RoutedState, site: int, out: Tensor) -> None:
        state.partial = out if state.partial is None else state.partial + out
        state.in_block += 1
        if state.in_block == self.block_sublayers:
            state.done.append(state.partial)
            state.partial, state.in_block = None, 0

    def finish(self, state: RoutedState) -> Tensor:
        return self.read(state, self.n_sites - 1)

    def last_weights(self) -> list[Tensor] | None:
        if any(w is None for w in self._weights):
            return None
        return list(self._weights)  # type: ignore[arg-type]


class AttnResResidual(MHARResidual):
    """Single-head Attention Residuals: MHAR with H = 1 (the config refuses any other H)."""
