"""MUDDFormer: multiway dynamic dense connections (Xiao et al., arXiv:2502.12170).

Like DenseFormer (``denseformer.py``), every block's output X_i is kept, but the weights are per token and
the next block gets four separately mixed inputs, for its queries, keys, values and residual stream.
After block i (X_0 = the embedding):

    A_i    = GELU(RMSNorm(X_i) W_1) W_2 + a_i          per token: C x (i + 1) weights, C = 4 (Q, K, V, R)
    X_i^c  = sum_(j <= i) A_i[c, j] X_j                 c = Q, K, V, R
    block i+1:  X_A = X_i^R + attention(norm(X_i^Q), norm(X_i^K), norm(X_i^V)),  X_(i+1) = X_A + MLP(norm(X_A))

After the last block one stream (C = 1) is mixed for the output norm. Initialisation, as in the authors'
code (Caiyun-AI/MUDDFormer, MaxText ``dense_proj1/2``): W_1 ~ N(0, 1/d), W_2 = 0, a_i = the current block
only (a_i[c, i] = 1): every stream is X_i, the standard transformer, exactly (every sublayer's input at
step 0 is bitwise pre-norm's).

``residual.muddformer.multiway=false`` mixes the residual stream only (C = 1 everywhere: the paper's
DDFormer ablation).

Choices the paper leaves open (or its code makes), and the ones made here:
- hidden width of the weight MLP: C·(i + 1), times 4 after the last block, rounded up as the authors'
  code does ((k // 64 + 1) · 64: always a step of 64 above).
- RMSNorm before W_1 without a gain (the authors' RMSnormNoscale).
- Q, K and V inputs normalised separately by the attention's pre-norm (their own RMS statistics); the
  authors' model gives each its own gain too, which the projection after it would absorb, so here they
  share the attention's one gain.
- left out: the authors' FFN width that grows with depth (a confound), and their optional pre/post
  norms around the mix (not in the paper's main model).
- weight decay: none on a_i; W_1, W_2 decay like any matrix. Mixing in float32; the weight MLP under
  autocast.

Speed: each mix is a sum of products over the list of block outputs, written for torch.compile to fuse
the four streams into one pass over the X_j; backward is O(L²), as for every dense connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Residual, separate_rng
from .denseformer import weighted_sum


@dataclass
class MUDDFormerSettings:
    multiway: bool = True  # separate Q, K, V and residual streams; false: the residual stream only (DDFormer)


class MUDDState:
    def __init__(self, x0: Tensor):
        self.xs = [x0]  # X_0 .. X_i
        self.qkv: tuple[Tensor, Tensor, Tensor] | None = None  # the next attention's inputs (None: = r)
        self.r = x0  # the next block's residual stream X_i^R
        self.h = x0  # inside a block: X_A = X^R + attention


class MUDDFormerResidual(Residual):
    Settings = MUDDFormerSettings

    @classmethod
    def label(cls, cfg: Any) -> str:
        return "muddformer" if cfg.settings("muddformer").multiway else "muddformer-oneway"

    @staticmethod
    def ways_of(multiway: bool, n_layers: int) -> list[int]:
        """The streams C mixed after each block: 4 (Q, K, V, R), 1 after the last block or when one-way."""
        return [4 if multiway and i < n_layers - 1 else 1 for i in range(n_layers)]

    @staticmethod
    def hidden_width(ways: int, sources: int, last: bool) -> int:
        """The weight MLP's hidden width: C·(i + 1) sources' weights, times 4 after the last block,
        rounded up a step of 64 as the authors' code does."""
        return (ways * sources * (4 if last else 1) // 64 + 1) * 64

    @classmethod
    def routing_flops(cls, cfg: Any, model: Any) -> float:
        """After block i (S = i + 2 sources, C streams, hidden width h), multiply-adds per token: the weight
        MLP RMSNorm(X_i) W_1 W_2 (d·h + h·C·S) and the C mixes of the S sources (C·S·d); times 2 FLOPs and
        3 for training, over the L blocks."""
        d, L = model.d_model, model.n_layers
        macs = 0
        for i, C in enumerate(cls.ways_of(cfg.settings("muddformer").multiway, L)):
            S, h = i + 2, cls.hidden_width(C, i + 2, i == L - 1)
            macs += d * h + h * C * S + C * S * d
        return 6.0 * macs

    def __init__(self, cfg: Any, model: Any):
        super().__init__()
        d, L = model.d_model, model.n_layers
        self.multiway, self.eps = cfg.settings("muddformer").multiway, model.norm_eps
        self.ways = self.ways_of(self.multiway, L)
        w1, w2, static = [], [], []
        # Drawn without moving the generator the sublayers are initialised from next (separate_rng).
        with separate_rng():
            for i, C in enumerate(self.ways):
                sources = i + 2  # X_0 .. X_(i+1) after block i (0-based)
                hidden = self.hidden_width(C, sources, i == L - 1)
                w1.append(nn.Linear(d, hidden, bias=False))
                nn.init.normal_(w1[-1].weight, std=d ** -0.5)
                w2.append(nn.Linear(hidden, C * sources, bias=False))
                nn.init.zeros_(w2[-1].weight)
                a = torch.zeros(C, sources)
                a[:, -1] = 1.0
                static.append(nn.Parameter(a))
        self.w1, self.w2, self.static = nn.ModuleList(w1), nn.ModuleList(w2), nn.ParameterList(static)

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return list(self.static)

    def mix(self, state: MUDDState, block: int) -> list[Tensor]:
        """The C streams after ``block`` (0-based), from its output state.xs[-1] and every earlier one."""
        x = state.xs[-1]
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        C, sources = self.ways[block], len(state.xs)
        dyn = self.w2[block](F.gelu(self.w1[block](xn))).float().unflatten(-1, (C, sources))
        weights = dyn + self.static[block]  # (B, T, C, sources)
        return [weighted_sum(weights[..., c, :], state.xs) for c in range(C)]

    def start(self, x0: Tensor) -> MUDDState:
        return MUDDState(x0)

    def read(self, state: MUDDState, site: int) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        if site % 2:  # MLP
            return state.h
        return state.qkv if state.qkv is not None else state.r

    def write(self, state: MUDDState, site: int, out: Tensor) -> None:
        if site % 2 == 0:  # attention: its output joins the residual stream X^R
            state.h = state.r + out
            return
        state.xs.append(state.h + out)  # X_(i+1)
        streams = self.mix(state, site // 2)
        if len(streams) == 4:
            state.qkv, state.r = (streams[0], streams[1], streams[2]), streams[3]
        else:
            state.qkv, state.r = None, streams[0]

    def finish(self, state: MUDDState) -> Tensor:
        return state.r

