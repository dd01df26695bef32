"""mHC: Manifold-Constrained Hyper-Connections (Xie et al., DeepSeek, arXiv:2512.24880).

Hyper-Connections (``hc.py``) with n streams x_l (n x d per token, ``residual.mhc.rate``, default 4), whose
maps are computed from all streams at once and constrained:

    x̃      = RMSNorm(vec(x_l))                       the n·d streams of a token, flattened
    H_pre   = σ(α_pre  · x̃ φ_pre  + b_pre)            (1 x n)  read:  h = H_pre x_l
    H_post  = 2σ(α_post · x̃ φ_post + b_post)          (1 x n)  write: x_{l+1} = H_res x_l + H_post^T F(h)
    H_res   = Sinkhorn-Knopp(α_res · mat(x̃ φ_res) + b_res)   (n x n), doubly stochastic

Sinkhorn-Knopp starts from exp(·) and alternates row and column normalisation, t_max = 20 times
(``residual.mhc.sinkhorn_iters``). The gating factors α start at 0.01 (``residual.mhc.gate_init``).

Choices the paper leaves open, and the ones made here:
- φ and b (the paper states no initialisation): φ ~ N(0, 1/(n·d)) (unit-variance logits before the gate,
  and it breaks the symmetry between the streams, which start equal), b = 0: H_pre = 1/2, H_post = 1,
  H_res = 1/n (uniform) before the dynamic terms, as in the public re-implementation the issue's figures
  come from (wdlctc/hyper-connection-factory). With φ = 0 that is pre-norm (each sublayer reads n/2 times
  the running sum, which its pre-norm removes up to eps; tests/variants/test_family.py checks it).
- RMSNorm of the flattened streams without a gain (φ would absorb it), its division applied after the
  product x φ (the paper's kernels reorder it the same way): one read of the streams computes all 2n + n² logits.
- Sinkhorn-Knopp: the first step is a softmax over each row (exp with its maximum subtracted, then the row
  normalisation: the same matrix, without overflow), then columns, rows, ..., t_max row and t_max
  column normalisations in all; column sums are clamped away from zero so that an underflowed column
  cannot divide by zero. On CUDA tensors it is one Triton kernel forward and one backward
  (``kernels/sinkhorn.py``), one graph node each under torch.compile; elsewhere ``_Sinkhorn``, its
  backward written out, which is also the kernels' reference.
- the embedding goes into every stream at the start, and the streams are summed before the output norm,
  as in HC.
- weight decay: none on α and b; φ decays like any matrix. Streams in float32, φ's product under autocast,
  maps in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..ranges import ranged
from .base import Residual, separate_rng
from .hc import expand_streams, mix_streams
from ..kernels.reference import COLUMN_FLOOR


@dataclass
class MHCSettings:
    rate: int = ranged(4, 1)  # n: residual streams
    sinkhorn_iters: int = ranged(20, 1, 10_000)  # t_max: row and column normalisations of H_res
    gate_init: float = ranged(0.01, 0, lo_open=True)  # α_pre, α_post, α_res at initialisation


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Doubly stochastic (..., n, n) from logits: exp, then alternately rows and columns normalised,
    ``iters`` times each (the first row normalisation is a softmax: exp without overflow)."""
    if logits.is_cuda:
        from ..kernels.sinkhorn import sinkhorn_triton  # imports triton: only where it runs

        return sinkhorn_triton(logits, iters)
    return sinkhorn_reference(logits, iters)


def sinkhorn_reference(logits: Tensor, iters: int) -> Tensor:
    """``sinkhorn`` in PyTorch (``_Sinkhorn``): the CPU path, and the Triton kernels' reference."""
    # The n x n axes in front: every sum then adds whole (tokens) planes, where sums over two tiny
    # trailing axes run an order of magnitude slower in eager PyTorch on a CPU.
    m = _Sinkhorn.apply(logits.movedim((-2, -1), (0, 1)).contiguous(), iters)
    return m.movedim((0, 1), (-2, -1))


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp on (n, n, ...) logits (rows: axis 1), its backward written out: y = x / sum(x) along
    an axis has dx = (dy - sum(dy * y)) / sum(x). The same numbers as autograd through the loop, in about a
    third of the graph nodes (2 x 20 normalisations at each of 2L sites is most of mHC's graph under
    torch.compile on the CPU, and of its compile time; on CUDA the kernels make each site one node). The
    backward treats the column floor as inactive: it guards only against an underflowed column, which a
    trained model does not reach."""

    @staticmethod
    def forward(ctx, logits: Tensor, iters: int) -> Tensor:
        m = torch.softmax(logits, dim=1)
        outs, sums = [m], []
        for t in range(2 * iters - 1):  # columns, rows, columns, ...: the last one normalises columns
            s = m.sum(0, keepdim=True).clamp_min(COLUMN_FLOOR) if t % 2 == 0 else m.sum(1, keepdim=True)
            m = m / s
            outs.append(m)
            sums.append(s)
        ctx.save_for_backward(*outs, *sums)
        return m

    @staticmethod
    def backward(ctx, grad: Tensor):
        saved = ctx.saved_tensors
        steps = len(saved) // 2  # normalisations after the softmax
        outs, sums = saved[:steps + 1], saved[steps + 1:]
        grad = grad.contiguous()  # it arrives in the caller's layout (the n x n axes last)
        for t in reversed(range(steps)):
            axis = 0 if t % 2 == 0 else 1
            grad = (grad - (grad * outs[t + 1]).sum(axis, keepdim=True)) / sums[t]
        y = outs[0]  # the softmax
        return y * (grad - (grad * y).sum(1, keepdim=True)), None


class MHCState:
    def __init__(self, H: Tensor):
        self.H = H  # (B, T, n, d) float32
        self.res: Tensor | None = None  # the current site's H_res (B, T, n, n), and H_post (B, T, n)
        self.post: Tensor | None = None


class ManifoldHyperConnections(Residual):
    Settings = MHCSettings

    @classmethod
    def label(cls, cfg: Any) -> str:
        s = cfg.settings("mhc")
        return f"mhc-n{s.rate}" + (f"-t{s.sinkhorn_iters}" if s.sinkhorn_iters != 20 else "") + (
            f"-g{s.gate_init:g}" if s.gate_init != 0.01 else "")

    @classmethod
    def routing_flops(cls, cfg: Any, model: Any) -> float:
        """Per sublayer, multiply-adds per token: the maps' projection x̃ φ (n·d·(2n + n²)), the read
        H_pre x (n·d), the mix H_res x (n²·d) and the write H_post^T F(h) (n·d); times 2 FLOPs and 3 for
        training, over the 2L sublayers. Sinkhorn-Knopp's normalisations of the n x n matrix and the
        sigmoids are pointwise and, like every norm, not counted."""
        n, d = cfg.settings("mhc").rate, model.d_model
        macs = n * d * (2 * n + n * n) + n * d + n * n * d + n * d
        return 6.0 * macs * 2 * model.n_layers

    def __init__(self, cfg: Any, model: Any):
        super().__init__()
        s = cfg.settings("mhc")
        n, d, sites = s.rate, model.d_model, 2 * model.n_layers
        self.n, self.iters, self.eps = n, s.sinkhorn_iters, model.norm_eps
        # Per site φ = [φ_pre | φ_post | φ_res] (n·d, 2n + n²), the gates (α_pre, α_post, α_res) and b.
        with separate_rng():  # drawn without moving the generator the sublayers are initialised from next
            self.phi = nn.Parameter(torch.randn(sites, n * d, 2 * n + n * n) / math.sqrt(n * d))
        self.gate = nn.Parameter(torch.full((sites, 3), s.gate_init))
        self.bias = nn.Parameter(torch.zeros(sites, 2 * n + n * n))

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return [self.gate, self.bias]

    def maps(self, H: Tensor, site: int) -> tuple[Tensor, Tensor, Tensor]:
        """H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n) of the site, from the streams H."""
        n, g, b = self.n, self.gate[site], self.bias[site]
        x = H.flatten(-2)  # (B, T, n·d)
        z = (x @ self.phi[site]).float() * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(g[0] * z[..., :n] + b[:n])
        post = 2 * torch.sigmoid(g[1] * z[..., n:2 * n] + b[n:2 * n])
        res = sinkhorn((g[2] * z[..., 2 * n:] + b[2 * n:]).unflatten(-1, (n, n)), self.iters)
        return pre, post, res

    def start(self, x0: Tensor) -> MHCState:
        return MHCState(expand_streams(x0, self.n))

    def read(self, state: MHCState, site: int) -> Tensor:
        pre, state.post, state.res = self.maps(state.H, site)
        return (pre.unsqueeze(-1) * state.H).sum(-2)  # H_pre x_l

    def write(self, state: MHCState, site: int, out: Tensor) -> None:
        # H_res x_l: stream k gets sum_j H_res[k, j] x_j, i.e. mix weights (j, k) = H_res^T.
        state.H = mix_streams(state.res.transpose(-1, -2), state.H) + state.post.unsqueeze(-1) * out.unsqueeze(-2)
        state.res = state.post = None

    def finish(self, state: MHCState) -> Tensor:
        return state.H.sum(-2)
