"""DenseFormer: Depth-Weighted Averaging after each block (Pagliardini et al., arXiv:2402.02622).

Blocks (an attention and an MLP sublayer with the ordinary residual sum inside) are kept; after block i a
DWA module replaces the block's output by a learned average of every earlier one:

    X_0 = embedding,   X_i = Block_i(Y_(i-1)),   Y_i = sum_(j <= i) α_(i,j) X_j,   Y_0 = X_0

with α_(i,i) = 1 and α_(i,j) = 0 for j < i at initialisation: Y_i = X_i, the standard transformer,
exactly (every sublayer's input at step 0 is bitwise pre-norm's). The output norm reads Y_L.

Sparsity: dilation k (``residual.denseformer.dilation``) keeps only X_j with j ≡ i (mod k); period p
(``residual.denseformer.period``) places a DWA only after every p-th block (elsewhere Y_i = X_i). The
paper's names: "k x p DenseFormer"; 1 x 1 (the default) is the dense one.

Choices the paper leaves open (or its code makes), and the ones made here:
- the block index counts from 1 for the dilation and period tests, as in the authors' DWAModules
  (epfml/DenseFormer): the DWA after block i exists when i mod p = 0 and averages X_i, X_(i-k), ...
- the α are one vector per DWA (exactly the weights that exist), no weight decay (decay would pull
  α_(i,i) from 1).
- averaging in float32: the X_j are the float32 residual stream of pre-norm under autocast.

Speed: the average is a sum of products over a Python list of the kept X_j, pointwise code that
torch.compile can fuse into one pass reading each X_j once (no stacked copy of the history). Backward is
O(L²) like any dense connection (each X_j gets a gradient from every later DWA that reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ..ranges import ranged
from .base import Residual


@dataclass
class DenseFormerSettings:
    dilation: int = ranged(1, 1, 1024)  # k: block i's average keeps X_j for j ≡ i (mod k) only
    period: int = ranged(1, 1, 1024)  # p: a DWA after every p-th block only


def weighted_sum(weights: Tensor, xs: list[Tensor]) -> Tensor:
    """``sum_j weights[..., j, None] * xs[j]``, written out (one fused pass under torch.compile)."""
    out = weights[..., 0, None] * xs[0]
    for j in range(1, len(xs)):
        out = out + weights[..., j, None] * xs[j]
    return out


class DenseFormerState:
    def __init__(self, x0: Tensor):
        self.xs = [x0]  # X_0 .. X_i: the embedding and every finished block's output
        self.h = x0  # the stream inside the current block (Y_(i-1), then + attention)


class DenseFormerResidual(Residual):
    Settings = DenseFormerSettings

    @classmethod
    def check(cls, cfg: Any, model: Any) -> None:
        s = cfg.settings("denseformer")
        if s.period > model.n_layers:
            raise UsageError(f"residual.denseformer.period={s.period} is larger than model.n_layers={model.n_layers}: "
                             "no block would get a DWA")

    @classmethod
    def label(cls, cfg: Any) -> str:
        s = cfg.settings("denseformer")
        return "denseformer" + (f"-{s.dilation}x{s.period}" if (s.dilation, s.period) != (1, 1) else "")

    @classmethod
    def routing_flops(cls, cfg: Any, model: Any) -> float:
        """Each DWA (after block i, every p-th) averages the i // k + 1 kept block outputs: d multiply-adds
        per token each, times 2 FLOPs and 3 for training."""
        s = cfg.settings("denseformer")
        kept = sum(i // s.dilation + 1 for i in range(s.period, model.n_layers + 1, s.period))
        return 6.0 * model.d_model * kept

    def __init__(self, cfg: Any, model: Any):
        super().__init__()
        s = cfg.settings("denseformer")
        self.dilation, self.period, self.n_layers = s.dilation, s.period, model.n_layers
        # Block i (1-based) with a DWA -> the index of its weights; they weigh X_(i mod k), ..., X_(i-k), X_i.
        self.dwa = {i: n for n, i in enumerate(range(s.period, model.n_layers + 1, s.period))}
        weights = []
        for i in self.dwa:
            a = torch.zeros(i // s.dilation + 1)
            a[-1] = 1.0
            weights.append(nn.Parameter(a))
        self.alpha = nn.ParameterList(weights)

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return list(self.alpha)

    def start(self, x0: Tensor) -> DenseFormerState:
        return DenseFormerState(x0)

    def read(self, state: DenseFormerState, site: int) -> Tensor:
        return state.h

    def write(self, state: DenseFormerState, site: int, out: Tensor) -> None:
        state.h = state.h + out
        if site % 2 == 0:  # an attention sublayer: the block goes on
            return
        i = site // 2 + 1  # block i is finished
        state.xs.append(state.h)
        if i in self.dwa:
            kept = state.xs[i % self.dilation::self.dilation]
            state.h = weighted_sum(self.alpha[self.dwa[i]], kept)

    def finish(self, state: DenseFormerState) -> Tensor:
        return state.h
