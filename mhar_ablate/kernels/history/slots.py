"""Rows written once per source or site, one token a program: ``write_slot`` copies a source into the
buffer and writes its RMS statistic, which the head-tiled kernels read; ``norm_rows`` writes a site's
sublayer pre-norm (and its statistics) where no routing kernel of the site's own does."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ..launch import head_meta, launch
from . import config
from .common import Norm, _normed, _num_warps


@triton.jit
def _write_slot_kernel(src_ptr, add_ptr, dst_ptr, rms_ptr, N, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_T: tl.constexpr, ADD: tl.constexpr):
    # BLOCK_T tokens a program. The RMS is taken of the value as stored (rounded to the buffer's dtype): the
    # one every reader sees. ADD: the source is src + add, summed in fp32 and rounded once, as torch adds.
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_D)
    ok = (tok < N)[:, None] & (c < D)[None, :]
    offs = tok[:, None] * D + c[None, :]
    y = tl.load(src_ptr + offs, mask=ok, other=0.0)
    if ADD:
        y = y.to(tl.float32) + tl.load(add_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = y.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs, y, mask=ok)
    yf = y.to(tl.float32)
    tl.store(rms_ptr + tok, 1.0 / tl.sqrt(tl.sum(yf * yf, axis=1) / D + eps), mask=tok < N)


@triton.jit
def _norm_rows_kernel(src_ptr, w_ptr, dst_ptr, stats_ptr, eps, D: tl.constexpr, H: tl.constexpr,
                      DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_DB: tl.constexpr,
                      HAS_B: tl.constexpr):
    # A sublayer's pre-norm of a site's output (``norm_rows``), one token a program, in the heads' layout so
    # that its statistics are the ones the merges keep (``_normed``).
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H)[:, None]
    ja = tl.arange(0, DA)[None, :]
    jb = tl.arange(0, BLOCK_DB)[None, :]
    col_a = h * DH + ja  # [H, DA]
    col_b = h * DH + DA + jb
    b_ok = jb < DB
    ya = tl.load(src_ptr + tok * D + col_a).to(tl.float32)
    yb = ya
    if HAS_B:
        yb = tl.load(src_ptr + tok * D + col_b, mask=b_ok, other=0.0).to(tl.float32)
    na, nb = _normed(ya, yb, w_ptr, stats_ptr + tok * (H + 1), col_a, col_b, b_ok, eps, src_ptr.dtype.element_ty, D,
                     H, HAS_B, tl.full([1], 1, tl.int1))
    tl.store(dst_ptr + tok * D + col_a, na.to(dst_ptr.dtype.element_ty))
    if HAS_B:
        tl.store(dst_ptr + tok * D + col_b, nb.to(dst_ptr.dtype.element_ty), mask=b_ok)


def norm_rows(x: Tensor, norm: Norm, num_heads: int) -> None:
    """Write the pre-norm of ``x`` (N, d), contiguous, to ``norm.out``: ``(x * rsqrt(mean(x^2) + eps))``
    rounded to x's dtype, times the gain, as the decoder's RMSNorm computes it, and its statistics to
    ``norm.stats`` (for a site whose output no routing kernel of its own writes: the shared pass's, which
    holds one head of a row at a time). One token a program, as the row kernels take it."""
    N, d = x.shape
    if N:
        meta = head_meta(d, num_heads, has_b=True)
        if x.device.type != "cpu":
            meta["num_warps"] = _num_warps(d, num_heads, 1)
        launch(_norm_rows_kernel, (N,), (x, norm.weight, norm.out, norm.stats, norm.eps), meta, x.device)


def write_slot(source: Tensor, slot: Tensor, rms: Tensor, eps: float, addend: Tensor | None = None) -> None:
    """Copy ``source`` (N, d), contiguous, into the buffer row ``slot`` (N, d), in the row's dtype, and
    write the RMS statistic ``rsqrt(mean(x^2) + eps)`` of each stored row to ``rms`` (N,) fp32. With
    ``addend`` (N, d), contiguous, the row written is ``source + addend`` (a block's last output added to
    its partial sum without a kernel of its own)."""
    N, d = slot.shape
    if N:
        block_d = triton.next_power_of_2(d)
        tokens, warps = config.WRITE_SLOT_CONFIG or (max(1, 2048 // block_d), 4)
        meta = {"D": d, "BLOCK_D": block_d, "BLOCK_T": tokens, "ADD": addend is not None}
        if slot.device.type != "cpu":
            meta["num_warps"] = warps
        args = (source, addend if addend is not None else source, slot, rms, N, eps)
        launch(_write_slot_kernel, (triton.cdiv(N, tokens),), args, meta, slot.device)
