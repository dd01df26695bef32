"""The delta form of MHAR (SPEC.md, "continued pretraining"): the ordinary residual stream h, plus at every
routing site a gated, routed increment over a learned null source and the blocks' true deltas:

    x_l = h_l + α_l · sum_i a_i v_i          v_0 = null (a learned d-vector), v_i = h_end(i) - h_start(i)
    a   = MHAR's per-head softmax over depth of q_l · (g_l ⊙ RMSNorm(v_i))   (routed.py, SPEC.md)

α_l is one scalar per site (2L + 1 sites: before every sublayer and before the output norm), 0 at the
start, so the model computes exactly what pre-norm computes (bitwise, every sublayer input and the
logits): a pre-norm checkpoint converts to it unchanged, and it also trains from scratch.

The routing is MHAR's, with the embedding's place (source 0) taken by the null source: with
``residual.grouping=full`` a block is one sublayer and its delta is that sublayer's output; with
``block:K`` a block is K layers, its delta the sum of their outputs, and a site inside an unfinished block
also sees the block's delta so far (what MHAR's partial sum is). ``residual.heads`` (default 8),
``residual.query_init`` and ``residual.backend`` mean what they mean for MHAR, the fused GPU path included.

Choices SPEC.md leaves open, and the ones made here:
- the deltas are the sums of the block's sublayer outputs, which is h_end - h_start without the
  cancellation of subtracting two large, nearly equal sums.
- the null source, α, the queries and the key gains take no weight decay.
- at step 0 only α has a gradient (α = 0 cuts everything behind it); the queries and the null source get
  theirs from the second step, the key gains from the third (the queries start at zero), and α at site 0,
  whose only source is the null, once the null has moved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .routed import MHARResidual


class DeltaState:
    def __init__(self, h: Tensor, routed: Any):
        self.h = h  # the ordinary residual stream
        self.routed = routed  # MHAR's state, over the null source and the deltas


class DeltaResidual(MHARResidual):
    default_heads = 8
    folds_norms = False  # the sublayer's input is h + gate * the routed read: no site kernel writes it whole

    @classmethod
    def label(cls, cfg: Any) -> str:
        return cls.routed_label(cfg, f"delta-h{cfg.resolved_heads()}")

    def __init__(self, cfg: Any, model: Any):
        super().__init__(cfg, model)
        self.gate = nn.Parameter(torch.zeros(self.n_sites))  # α_l
        self.null = nn.Parameter(torch.zeros(model.d_model))  # v_0

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return [*self.routing_parameters(), self.gate, self.null]

    def start(self, x0: Tensor) -> DeltaState:
        return DeltaState(x0, super().start(self.null.to(x0.dtype).expand_as(x0)))

    def read(self, state: DeltaState, site: int) -> Tensor:
        return state.h + self.gate[site] * super().read(state.routed, site)

    def write(self, state: DeltaState, site: int, out: Tensor) -> None:
        state.h = state.h + out
        super().write(state.routed, site, out)

    def finish(self, state: DeltaState) -> Tensor:
        return self.read(state, self.n_sites - 1)
