"""Hyper-Connections (Zhu et al., ICLR 2025, arXiv:2409.19606), static and dynamic.

The residual stream is widened to n copies (``residual.hc.rate``, default 4): a state H of shape
(B, T, n, d), with the embedding in every stream at the start. Every sublayer (attention and MLP alike)
has its own hyper-connection matrix (§2)

    HC = | 0    B   |      B   (1 x n)  how the sublayer's output is written into each stream
         | A_m  A_r |      A_m (n x 1)  how the streams are mixed into the sublayer's input
                           A_r (n x n)  how the streams are mixed with each other

    read   h  = A_m^T H                    the sublayer's input, (B, T, d)
    write  H' = B^T out + A_r^T H          out = sublayer(h)

Dynamic HC (``residual.hc.dynamic``, default true; Eqs. 10-13) adds per-token terms computed from
the normalised streams H̄ = norm(H):

    B(H)   = s_β tanh(H̄ W_β)^T + B
    A_m(H) = s_α tanh(H̄ W_m) + A_m
    A_r(H) = s_α tanh(H̄ W_r) + A_r

Initialisation (§2.3, Eq. 14): W_β, W_m, W_r = 0, s_α = s_β = 0.01, B = 1, A_m = e_(k mod n) for sublayer
k, A_r = I. Every stream then holds the pre-norm running sum and each sublayer reads one of them: at step
0 every sublayer's input is bitwise pre-norm's. After the last sublayer the streams are summed
before the output norm.

Choices the paper leaves open, and the ones made here:
- the norm in H̄: the paper uses its model's LayerNorm; here RMSNorm (this decoder's norm) without a gain,
  since W would absorb one (a gain in front of a linear map is redundant with it).
- k in e_(k mod n) counts sublayers, attention and MLP separately, as the paper's per-layer modules do.
- the sum of the n streams enters the output RMSNorm at n times pre-norm's scale, which the norm removes
  except in its eps: the logits at step 0 are those of pre-norm with that eps divided by n² (to rounding),
  about 1e-3 relative from pre-norm's own at the tiny preset's small activations (tests/variants/test_family.py).
- weight decay: none on B, A_m, A_r, s_α, s_β (the static parts: decay pulls A_r and B from the identity
  they start at, and users have seen NaNs with it, lucidrains/hyper-connections#4); W decays like any
  matrix of the model.
- precision: the streams are float32, as pre-norm's residual stream is under bf16 autocast; the dynamic
  projection H̄ W runs under autocast like the decoder's other linear maps.

Speed: per sublayer, ``read`` computes the coefficients (dynamic: one (n·B·T, d) x (d, n + 2) product) and
the input; ``write`` mixes the streams and adds the output in one expression, from the streams the read
saw (nothing of the mix is materialised between the two calls). Under torch.compile the mixes are
pointwise code (``mix_streams``), which inductor can fuse with what surrounds them: a static write with
the next read, for one. There static HC's weights are broadcast to every token, so that their gradient is
dynamic HC's per-token reduction over d and a sum over tokens (``benchmarks/bench_hc_static.py``, removed
since, timed both: git history);
eagerly its streams' mix in ``write`` is one float32 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..ranges import ranged
from .base import Residual


@dataclass
class HCSettings:
    rate: int = ranged(4, 1)  # n: the expansion rate, copies of the residual stream
    dynamic: bool = True  # per-token terms on top of the static matrices (DHC; false: SHC)


def mix_streams(weights: Tensor, H: Tensor) -> Tensor:
    """``out[..., k, :] = sum_j weights[..., j, k] * H[..., j, :]``: weights (n, m) or (..., n, m), H (..., n, d)
    -> (..., m, d), in float32.

    Under torch.compile, a broadcast product summed over the n streams: inductor turns a reduction of n <= 8
    terms (its ``unroll_reductions_threshold``) into pointwise code fused with its neighbours, where a matmul
    would be a separate batched GEMM of tiny n x m blocks per token. Eagerly, that product would be an
    (n, m, d) temporary per token: static weights take one float32 matmul instead (autocast off, which would
    make it bf16); per-token weights keep the product, which beat a batched matmul of n x m blocks on CPU."""
    if weights.dim() == 2 and not torch.compiler.is_compiling():
        with torch.autocast(H.device.type, enabled=False):
            return torch.matmul(weights.t(), H)
    return (weights.unsqueeze(-1) * H.unsqueeze(-2)).sum(-3)


def expand_streams(x0: Tensor, n: int) -> Tensor:
    """The embedding in each of n streams: (B, T, d) -> (B, T, n, d), a view (the first write copies)."""
    return x0.unsqueeze(-2).expand(*x0.shape[:-1], n, x0.shape[-1])


class HCState:
    def __init__(self, H: Tensor):
        self.H = H  # (B, T, n, d) float32
        self.alpha: Tensor | None = None  # the current site's [A_m | A_r], (n, n + 1) or (B, T, n, n + 1)
        self.beta: Tensor | None = None  # its B, (n,) or (B, T, n)


class HyperConnections(Residual):
    Settings = HCSettings

    @classmethod
    def label(cls, cfg: Any) -> str:
        s = cfg.settings("hc")
        return f"hc-n{s.rate}" + ("" if s.dynamic else "-static")

    @classmethod
    def bench_variants(cls) -> dict[str, dict[str, str]]:
        return {"hc": {}, "hc-static": {"residual.hc.dynamic": "false"}}

    @classmethod
    def routing_flops(cls, cfg: Any, model: Any) -> float:
        """Per sublayer, multiply-adds per token: the read A_m^T H (n·d), the streams' mix A_r^T H (n²·d),
        the output written into each stream B^T out (n·d) and, dynamic, the projection H̄ W (n·d·(n + 2));
        times 2 FLOPs and 3 for training, over the 2L sublayers. The final sum of the streams is an
        addition, not counted."""
        s = cfg.settings("hc")
        n, d = s.rate, model.d_model
        macs = n * d + n * n * d + n * d + (n * d * (n + 2) if s.dynamic else 0)
        return 6.0 * macs * 2 * model.n_layers

    def __init__(self, cfg: Any, model: Any):
        super().__init__()
        s = cfg.settings("hc")
        n, d, sites = s.rate, model.d_model, 2 * model.n_layers
        self.n, self.dynamic, self.eps = n, s.dynamic, model.norm_eps
        # Per site [A_m | A_r] (n, n + 1): column 0 reads the input, columns 1.. mix the streams (Eq. 14).
        alpha = torch.zeros(sites, n, n + 1)
        alpha[torch.arange(sites), torch.arange(sites) % n, 0] = 1.0
        alpha[:, :, 1:] = torch.eye(n)
        self.static_alpha = nn.Parameter(alpha)
        self.static_beta = nn.Parameter(torch.ones(sites, n))
        if self.dynamic:
            # [W_β | W_m | W_r] per site, (d, n + 2), and the scales s_β, s_α.
            self.dynamic_proj = nn.Parameter(torch.zeros(sites, d, n + 2))
            self.beta_scale = nn.Parameter(torch.full((sites,), 0.01))
            self.alpha_scale = nn.Parameter(torch.full((sites,), 0.01))

    def no_decay_parameters(self) -> list[nn.Parameter]:
        static = [self.static_alpha, self.static_beta]
        return static + ([self.beta_scale, self.alpha_scale] if self.dynamic else [])

    def coefficients(self, H: Tensor, site: int) -> tuple[Tensor, Tensor]:
        """The site's [A_m | A_r] and B: static, plus the dynamic terms of H (Eqs. 10-13)."""
        alpha, beta = self.static_alpha[site], self.static_beta[site]
        if not self.dynamic:
            if torch.compiler.is_compiling():
                # Per-token weights, as dynamic HC's: inductor then computes their gradient as a reduction
                # over d within each token, fused with the rest of the backward, and a small sum over the
                # tokens; with 2-D weights it is a global reduction that re-reads the streams per output.
                lead = H.shape[:-2]
                return alpha.expand(*lead, *alpha.shape), beta.expand(*lead, *beta.shape)
            return alpha, beta
        Hn = H * torch.rsqrt(H.pow(2).mean(-1, keepdim=True) + self.eps)
        t = torch.tanh((Hn @ self.dynamic_proj[site]).float())  # (B, T, n, n + 2)
        return alpha + self.alpha_scale[site] * t[..., 1:], beta + self.beta_scale[site] * t[..., 0]

    def start(self, x0: Tensor) -> HCState:
        return HCState(expand_streams(x0, self.n))

    def read(self, state: HCState, site: int) -> Tensor:
        state.alpha, state.beta = self.coefficients(state.H, site)
        return (state.alpha[..., 0].unsqueeze(-1) * state.H).sum(-2)  # A_m^T H

    def write(self, state: HCState, site: int, out: Tensor) -> None:
        # A_r^T H + B^T out, from the streams the site read.
        state.H = mix_streams(state.alpha[..., 1:], state.H) + state.beta.unsqueeze(-1) * out.unsqueeze(-2)
        state.alpha = state.beta = None

    def finish(self, state: HCState) -> Tensor:
        return state.H.sum(-2)
