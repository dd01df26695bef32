"""What the history kernels share: the jit helpers of more than one kernel (a running softmax's step, a
sublayer's pre-norm of a row), the pre-norm's arguments (``Norm``), and the host's rules for the sites'
padding and the row kernels' warps."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from ..launch import tile_width
from . import config


@triton.jit
def _softmax_step(m, l, z):
    """One more source into running (max, sum) softmax states: the new states, the factor that rescales
    what was accumulated, and the new source's weight."""
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    p = tl.exp(z - m_new)
    return m_new, l * alpha + p, alpha, p


@triton.jit
def _normed(ya, yb, w_ptr, stats_ptr, col_a, col_b, b_ok, eps, dtype: tl.constexpr, D: tl.constexpr,
            H: tl.constexpr, HAS_B: tl.constexpr, live):
    """A whole row's pre-norm as the decoder's RMSNorm computes it: ``(y * rsqrt(mean(y^2) + eps))`` rounded
    to ``dtype``, times the gain, in fp32. ``ya``/``yb``: the row's two blocks, [H, .] or [1, H, .] (``yb``
    ignored without HAS_B; its padding lanes zero), the row as stored. Its statistics go to the row's H + 1
    floats at ``stats_ptr`` where ``live`` (shape [1]): each head's sum of squares, then the rsqrt, what the
    backward reads (``_sites_bwd_kernel``, NORM) instead of reducing the row again."""
    qa = tl.sum(ya * ya, axis=len(ya.shape) - 1)  # per head
    if HAS_B:
        qa += tl.sum(yb * yb, axis=len(yb.shape) - 1)
    ss = tl.sum(tl.reshape(qa, [qa.numel]), axis=0)
    r = 1.0 / tl.sqrt(ss / D + eps)
    # (a store from the row's own layout, one lane a head, compiled to more instructions for sm_90)
    tl.store(stats_ptr + tl.arange(0, H), tl.reshape(qa, [H]), mask=live)
    tl.store(stats_ptr + H + tl.zeros([1], tl.int32), r + tl.zeros([1], tl.float32), mask=live)
    na = (ya * r).to(dtype).to(tl.float32) * tl.load(w_ptr + col_a)
    nb = na
    if HAS_B:
        nb = (yb * r).to(dtype).to(tl.float32) * tl.load(w_ptr + col_b, mask=b_ok, other=0.0)
    return na, nb


def _block_g(groups: int) -> int:
    return triton.next_power_of_2(max(groups, 1))


def _num_warps(d: int, num_heads: int, block_g: int) -> int:
    """Warps per program of the row kernels (G = 1 in practice): about 8 elements of a [1, H, head] tile
    per thread, 4 warps at d = 1024 (the per-site kernel's measured best on the H200)."""
    if config.ROW_WARPS:
        return config.ROW_WARPS
    width = block_g * tile_width(d, num_heads)
    warps = max(1, width // (32 * 8))
    return min(32, 1 << (warps.bit_length() - 1))


class Norm(NamedTuple):
    """A sublayer's pre-norm (the decoder's RMSNorm) folded into a routing kernel: its gain ``weight`` (d,)
    fp32, ``eps``, its statistics ``stats`` (N, H + 1) fp32 (each head's sum of the squares of the output as
    stored, then the rsqrt of the row's mean square plus eps: written by the forward, read by the
    backward), and where the forward writes the normalised output (``out``, (N, d); None in the backward)."""

    weight: Tensor
    eps: float
    stats: Tensor
    out: Tensor | None = None


def _first(*tensors: Tensor | None) -> Tensor:
    """The first tensor given: a pointer argument, or the placeholder last when its flag is off."""
    return next(t for t in tensors if t is not None)
