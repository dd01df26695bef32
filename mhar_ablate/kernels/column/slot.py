"""A slot's gradient in one pass (``slot_grad``): one or two tokens a program, their rows of the slot in
registers, streaming over the S sites that read it. ``_column_bwd_prefetch_kernel`` loads a site ahead into
registers, ``_column_bwd_kernel`` through Triton's shared-memory pipeline (which one: ``config.column_config``,
by width). Each writes the slot's gradient (the part through its RMS statistic included) and, per site and head,
``dz * r`` for the query gradients (``query``); with LOW a second slot's share (``Low``) is summed in the same
pass and left in a ``Carry``, which the slot's own pass (CARRY) adds. ``column_backward``: one slot's gradient and
its sites' query gradients, for tests and benchmarks."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from ..grad_rows import ALIGN_C, GradRows, site_offsets
from ..launch import head_meta, launch
from . import config
from .config import column_config
from .query import query_grads


@triton.jit
def _head_columns(H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_DB: tl.constexpr):
    """A row's channels by head: the heads [H]; the offsets within a head of its power-of-two part [1, 1, DA]
    and of its rest [1, 1, BLOCK_DB]; the row offsets of both parts, [1, H, DA] and [1, H, BLOCK_DB]; the
    rest's mask."""
    hh = tl.arange(0, H)
    h = hh[None, :, None]
    ja = tl.arange(0, DA)[None, None, :]
    jb = tl.arange(0, BLOCK_DB)[None, None, :]
    return hh, ja, jb, h * DH + ja, h * DH + DA + jb, jb < DB


@triton.jit
def _token_rows(ptr, n, N, offs_a, offs_b, b_ok, HAS_B: tl.constexpr, on=None):
    """One token's row at ``ptr``, as its [1, H, DA] and [1, H, BLOCK_DB] blocks (the second is the first
    again without HAS_B); zeros past the last token, or everywhere where ``on`` is 0."""
    if on is None:
        ok = (n < N)[:, None, None]
    else:
        ok = (n < on * N)[:, None, None]
    ra = tl.load(ptr + offs_a, mask=ok, other=0.0)
    rb = ra
    if HAS_B:
        rb = tl.load(ptr + offs_b, mask=ok & b_ok, other=0.0)
    return ra, rb


@triton.jit
def _grad_offset(gtab_ptr, s, S, ND, TABLE: tl.constexpr):
    """Site s's output-gradient offset (``grad_rows.site_offsets``) as a [1, 1, 1] tensor."""
    return site_offsets(gtab_ptr, s + tl.arange(0, 1), S, ND, TABLE)[:, None, None]


@triton.jit
def _column_site(xa, xb, ga, gb, qa, qb, r, lse, delta, dxa, dxb, dr, HAS_B: tl.constexpr, PTX: tl.constexpr):
    """One site's share of a slot's gradient for a tile of tokens [T, H, .] (the rest block ``*b`` used
    only with HAS_B): returns dz * r [T, H] and the updated accumulators."""
    u = tl.sum(xa * qa, axis=2)  # [T, H]
    da = tl.sum(ga * xa, axis=2)
    if HAS_B:
        u += tl.sum(xb * qb, axis=2)
        da += tl.sum(gb * xb, axis=2)
    a = ptx.exp(u * r - lse, PTX)
    dz = a * (da - delta)
    rdz = dz * r
    dr += dz * u
    # two fused multiply-adds an element, where (a g + rdz q) then its sum takes three
    dxa = dxa + a[:, :, None] * ga
    dxa = dxa + rdz[:, :, None] * qa
    if HAS_B:
        dxb = dxb + a[:, :, None] * gb
        dxb = dxb + rdz[:, :, None] * qb
    return rdz, dxa, dxb, dr


@triton.jit
def _carried(carry_ptr, carry_dr_ptr, offs_a, offs_b, stat, row_ok, b_ok, stat_ok, dxb, HAS_B: tl.constexpr):
    """A slot's sums over its other sites, from the pass above that carried them (``dxb`` returned as it
    is without HAS_B)."""
    dxa = tl.load(carry_ptr + offs_a, mask=row_ok, other=0.0)
    if HAS_B:
        dxb = tl.load(carry_ptr + offs_b, mask=row_ok & b_ok, other=0.0)
    dr = tl.load(carry_dr_ptr + stat, mask=stat_ok, other=0.0)
    return dxa, dxb, dr


@triton.jit
def _carry_out(carry_ptr, carry_dr_ptr, offs_a, offs_b, stat, row_ok, b_ok, stat_ok, dya, dyb, dry,
               HAS_B: tl.constexpr):
    """The low slot's sums over this pass's sites, before its RMS term, for its own pass to finish."""
    tl.store(carry_ptr + offs_a, dya, mask=row_ok)
    if HAS_B:
        tl.store(carry_ptr + offs_b, dyb, mask=row_ok & b_ok)
    tl.store(carry_dr_ptr + stat, dry, mask=stat_ok)


@triton.jit
def _finish(dx_ptr, offs_a, offs_b, row_ok, b_ok, xa, xb, dxa, dxb, dr, r, D: tl.constexpr, HAS_B: tl.constexpr):
    """The slot's gradient: the sums less the part through its RMS statistic, in the slot's dtype."""
    w = (tl.sum(dr, axis=1)[:, None] * (r * r * r / D))[:, :, None]  # [T, 1, 1]
    tl.store(dx_ptr + offs_a, (dxa - w * xa).to(dx_ptr.dtype.element_ty), mask=row_ok)
    if HAS_B:
        tl.store(dx_ptr + offs_b, (dxb - w * xb).to(dx_ptr.dtype.element_ty), mask=row_ok & b_ok)


@triton.jit(do_not_specialize=["N", "S", "dzr_head", "low_head"])
def _column_bwd_kernel(
    x_ptr, rms_ptr, g_ptr, gtab_ptr, lse_ptr, delta_ptr, qg_ptr, dx_ptr, dzr_ptr,
    y_ptr, ry_ptr, dzr_low_ptr, carry_ptr, carry_dr_ptr,
    N, S, dzr_head, low_head,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PTX: tl.constexpr,
    LOW: tl.constexpr, CARRY: tl.constexpr, TABLE: tl.constexpr,
):
    # A program holds BLOCK_N tokens' rows, [BLOCK_N, H, .] (and, with LOW, those of the low slot y); a
    # site's query row [1, H, .] broadcasts over them. Per site the program reads one output-gradient row
    # from memory and the site's query row from cache and does a few reductions: too little to cover the
    # memory's latency from registers. The loop is software-pipelined over STAGES sites instead
    # (``tl.range``: the site's loads are copied into shared memory STAGES - 1 sites ahead), which puts
    # bytes in flight without holding them in registers.
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    nn = n[:, None, None]
    hh, ja, jb, col_a, col_b, b_ok = _head_columns(H, DH, DA, DB, BLOCK_DB)
    row_ok = n_ok[:, None, None]
    offs_a = nn * D + col_a  # [BLOCK_N, H, DA]
    offs_b = nn * D + col_b
    stat = n[:, None] * H + hh[None, :]  # [BLOCK_N, H]: offsets in the (sites, N, H) statistics
    stat_ok = n_ok[:, None]
    xa = tl.load(x_ptr + offs_a, mask=row_ok, other=0.0).to(tl.float32)
    xb = tl.zeros([BLOCK_N, H, BLOCK_DB], tl.float32)  # (a placeholder without HAS_B)
    if HAS_B:
        xb = tl.load(x_ptr + offs_b, mask=row_ok & b_ok, other=0.0).to(tl.float32)
    r = tl.load(rms_ptr + n, mask=n_ok, other=0.0)[:, None]  # [BLOCK_N, 1]
    dxa = tl.zeros([BLOCK_N, H, DA], tl.float32)
    dxb = tl.zeros([BLOCK_N, H, BLOCK_DB], tl.float32)
    dr = tl.zeros([BLOCK_N, H], tl.float32)
    if CARRY:
        dxa, dxb, dr = _carried(carry_ptr, carry_dr_ptr, offs_a, offs_b, stat, row_ok, b_ok, stat_ok, dxb, HAS_B)
    if LOW:
        ya = tl.load(y_ptr + offs_a, mask=row_ok, other=0.0).to(tl.float32)
        yb = xb
        if HAS_B:
            yb = tl.load(y_ptr + offs_b, mask=row_ok & b_ok, other=0.0).to(tl.float32)
        ry = tl.load(ry_ptr + n, mask=n_ok, other=0.0)[:, None]
        dya = tl.zeros([BLOCK_N, H, DA], tl.float32)
        dyb = tl.zeros([BLOCK_N, H, BLOCK_DB], tl.float32)
        dry = tl.zeros([BLOCK_N, H], tl.float32)
        dzr_low = dzr_low_ptr + hh.to(tl.int64)[None, :] * low_head + n[:, None]
    dzr = dzr_ptr + hh.to(tl.int64)[None, :] * dzr_head + n[:, None]
    for s in tl.range(S, num_stages=STAGES):
        site = tl.cast(s, tl.int64)
        if TABLE:  # the site's output gradient where it lies (``grad_rows``)
            g = g_ptr + tl.multiple_of(tl.load(gtab_ptr + site), ALIGN_C)
        else:
            g = g_ptr + site * N * D
        ga = tl.load(g + offs_a, mask=row_ok, other=0.0).to(tl.float32)
        qa = tl.load(qg_ptr + site * D + col_a)
        gb, qb = xb, xb
        if HAS_B:
            gb = tl.load(g + offs_b, mask=row_ok & b_ok, other=0.0).to(tl.float32)
            qb = tl.load(qg_ptr + site * D + col_b, mask=b_ok, other=0.0)
        # padded tokens: lse = +inf, weight 0
        lse = tl.load(lse_ptr + site * N * H + stat, mask=stat_ok, other=float("inf"))
        delta = tl.load(delta_ptr + site * N * H + stat, mask=stat_ok, other=0.0)
        rdz, dxa, dxb, dr = _column_site(xa, xb, ga, gb, qa, qb, r, lse, delta, dxa, dxb, dr, HAS_B, PTX)
        ptx.store_f32(dzr + site * N, rdz, stat_ok, PTX)
        if LOW:
            rdz, dya, dyb, dry = _column_site(ya, yb, ga, gb, qa, qb, ry, lse, delta, dya, dyb, dry, HAS_B, PTX)
            ptx.store_f32(dzr_low + site * N, rdz, stat_ok, PTX)
    _finish(dx_ptr, offs_a, offs_b, row_ok, b_ok, xa, xb, dxa, dxb, dr, r, D, HAS_B)
    if LOW:
        _carry_out(carry_ptr, carry_dr_ptr, offs_a, offs_b, stat, row_ok, b_ok, stat_ok, dya, dyb, dry, HAS_B)


@triton.jit(do_not_specialize=["N", "S", "dzr_head", "low_head"])
def _column_bwd_prefetch_kernel(
    x_ptr, rms_ptr, g_ptr, gtab_ptr, lse_ptr, delta_ptr, qg_ptr, dx_ptr, dzr_ptr,
    y_ptr, ry_ptr, dzr_low_ptr, carry_ptr, carry_dr_ptr,
    N, S, dzr_head, low_head,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, PAIR: tl.constexpr, PTX: tl.constexpr,
    LOW: tl.constexpr, CARRY: tl.constexpr, TABLE: tl.constexpr,
):
    # One token (two with PAIR) per program, its row in registers [1, H, .] (with LOW, one token, and its
    # row of the low slot y beside it), streaming over the S sites: per site one output-gradient row from
    # memory and the site's query row from cache, both loaded one site ahead into registers. The query
    # rows are most of the cache traffic (fp32, twice a bf16 row); with PAIR the program's two tokens share
    # each one (two tensors of one layout, so that a thread holds the same channels of both and loads them
    # once), at twice the registers; with LOW the two slots share it and the output-gradient row too.
    tl.static_assert(not (PAIR and LOW), "two slots a pass take one token a program")
    n0 = tl.program_id(0).to(tl.int64) * (2 if PAIR else 1) + tl.arange(0, 1)  # [1]
    n1 = n0 + 1
    hh, ja, jb, col_a, col_b, b_ok = _head_columns(H, DH, DA, DB, BLOCK_DB)
    offs0_a = n0[:, None, None] * D + col_a
    offs0_b = n0[:, None, None] * D + col_b
    offs1_a = offs0_a + D
    offs1_b = offs0_b + D
    ok0 = (n0 < N)[:, None, None]
    x0a, x0b = _token_rows(x_ptr, n0, N, offs0_a, offs0_b, b_ok, HAS_B)
    x0a, x0b = x0a.to(tl.float32), x0b.to(tl.float32)
    r0 = tl.load(rms_ptr + n0, mask=n0 < N, other=0.0)[:, None]  # [1, 1]
    stat0 = n0[:, None] * H + hh[None, :]  # [1, H]: offsets in the (sites, N, H) statistics
    dx0a = tl.zeros([1, H, DA], tl.float32)
    dx0b = tl.zeros([1, H, BLOCK_DB], tl.float32)
    dr0 = tl.zeros([1, H], tl.float32)
    if CARRY:
        dx0a, dx0b, dr0 = _carried(carry_ptr, carry_dr_ptr, offs0_a, offs0_b, stat0, ok0, b_ok, n0[:, None] < N,
                                   dx0b, HAS_B)
    if PAIR:
        ok1 = (n1 < N)[:, None, None]
        x1a, x1b = _token_rows(x_ptr, n1, N, offs1_a, offs1_b, b_ok, HAS_B)
        x1a, x1b = x1a.to(tl.float32), x1b.to(tl.float32)
        r1 = tl.load(rms_ptr + n1, mask=n1 < N, other=0.0)[:, None]
        stat1 = stat0 + H
        dx1a = tl.zeros([1, H, DA], tl.float32)
        dx1b = tl.zeros([1, H, BLOCK_DB], tl.float32)
        dr1 = tl.zeros([1, H], tl.float32)
        if CARRY:
            dx1a, dx1b, dr1 = _carried(carry_ptr, carry_dr_ptr, offs1_a, offs1_b, stat1, ok1, b_ok,
                                       n1[:, None] < N, dx1b, HAS_B)
    if LOW:
        y0a, y0b = _token_rows(y_ptr, n0, N, offs0_a, offs0_b, b_ok, HAS_B)
        y0a, y0b = y0a.to(tl.float32), y0b.to(tl.float32)
        ry0 = tl.load(ry_ptr + n0, mask=n0 < N, other=0.0)[:, None]
        dy0a = tl.zeros([1, H, DA], tl.float32)
        dy0b = tl.zeros([1, H, BLOCK_DB], tl.float32)
        dry0 = tl.zeros([1, H], tl.float32)
        dzr_low = dzr_low_ptr + hh.to(tl.int64)[None, :] * low_head + n0[:, None]  # [1, H]

    # Loads one site ahead (see mhar_triton: loads that feed no dot are not pipelined by the compiler
    # unless asked, and the shared-memory pipeline measured slower here); the limit is a tensor mask.
    first = tl.where(S > 0, 1, 0)
    # The output gradients' offsets are read two sites ahead, so that a row's load never waits for its offset's.
    g = g_ptr + _grad_offset(gtab_ptr, 0, S, N * D, TABLE)
    next_off = _grad_offset(gtab_ptr, 1, S, N * D, TABLE)
    next0a, next0b = _token_rows(g, n0, N, offs0_a, offs0_b, b_ok, HAS_B, first)
    if PAIR:
        next1a, next1b = _token_rows(g, n1, N, offs1_a, offs1_b, b_ok, HAS_B, first)
    next_qa = tl.load(qg_ptr + col_a, mask=ja < first * DA, other=0.0)  # [1, H, DA]
    next_qb = next_qa
    if HAS_B:
        next_qb = tl.load(qg_ptr + col_b, mask=jb < first * DB, other=0.0)
    # padded tokens: lse = +inf, weight 0
    next_lse0 = tl.load(lse_ptr + stat0, mask=n0[:, None] < first * N, other=float("inf"))
    next_delta0 = tl.load(delta_ptr + stat0, mask=n0[:, None] < first * N, other=0.0)
    if PAIR:
        next_lse1 = tl.load(lse_ptr + stat1, mask=n1[:, None] < first * N, other=float("inf"))
        next_delta1 = tl.load(delta_ptr + stat1, mask=n1[:, None] < first * N, other=0.0)
    dzr = dzr_ptr + hh.to(tl.int64)[None, :] * dzr_head + n0[:, None]  # [1, H]
    for s in range(S):
        more = tl.where(s + 1 < S, 1, 0)
        qa, qb = next_qa, next_qb
        next_qa = tl.load(qg_ptr + (s + 1) * D + col_a, mask=ja < more * DA, other=0.0)
        if HAS_B:
            next_qb = tl.load(qg_ptr + (s + 1) * D + col_b, mask=jb < more * DB, other=0.0)
        g0a, g0b, lse0, delta0 = next0a.to(tl.float32), next0b.to(tl.float32), next_lse0, next_delta0
        g = g_ptr + next_off
        next_off = _grad_offset(gtab_ptr, s + 2, S, N * D, TABLE)
        next0a, next0b = _token_rows(g, n0, N, offs0_a, offs0_b, b_ok, HAS_B, more)
        next_lse0 = tl.load(lse_ptr + stat0 + N * H, mask=n0[:, None] < more * N, other=float("inf"))
        next_delta0 = tl.load(delta_ptr + stat0 + N * H, mask=n0[:, None] < more * N, other=0.0)
        if PAIR:
            g1a, g1b, lse1, delta1 = next1a.to(tl.float32), next1b.to(tl.float32), next_lse1, next_delta1
            next1a, next1b = _token_rows(g, n1, N, offs1_a, offs1_b, b_ok, HAS_B, more)
            next_lse1 = tl.load(lse_ptr + stat1 + N * H, mask=n1[:, None] < more * N, other=float("inf"))
            next_delta1 = tl.load(delta_ptr + stat1 + N * H, mask=n1[:, None] < more * N, other=0.0)
        rdz0, dx0a, dx0b, dr0 = _column_site(x0a, x0b, g0a, g0b, qa, qb, r0, lse0, delta0, dx0a, dx0b, dr0, HAS_B,
                                             PTX)
        ptx.store_f32(dzr + s * N, rdz0, n0[:, None] < N, PTX)
        if PAIR:
            rdz1, dx1a, dx1b, dr1 = _column_site(x1a, x1b, g1a, g1b, qa, qb, r1, lse1, delta1, dx1a, dx1b, dr1,
                                                 HAS_B, PTX)
            ptx.store_f32(dzr + s * N + 1, rdz1, n1[:, None] < N, PTX)
        if LOW:
            rdz0, dy0a, dy0b, dry0 = _column_site(y0a, y0b, g0a, g0b, qa, qb, ry0, lse0, delta0, dy0a, dy0b, dry0,
                                                  HAS_B, PTX)
            ptx.store_f32(dzr_low + s * N, rdz0, n0[:, None] < N, PTX)
        stat0 += N * H
        if PAIR:
            stat1 += N * H
    _finish(dx_ptr, offs0_a, offs0_b, ok0, b_ok, x0a, x0b, dx0a, dx0b, dr0, r0, D, HAS_B)
    if PAIR:
        _finish(dx_ptr, offs1_a, offs1_b, ok1, b_ok, x1a, x1b, dx1a, dx1b, dr1, r1, D, HAS_B)
    if LOW:
        _carry_out(carry_ptr, carry_dr_ptr, offs0_a, offs0_b, n0[:, None] * H + hh[None, :], ok0, b_ok,
                   n0[:, None] < N, dy0a, dy0b, dry0, HAS_B)


class Carry(NamedTuple):
    """Slots' sums over some of the sites that read them, before the part through their RMS statistics:
    what a pass over several slots leaves for their own passes. ``acc`` (R, N, d) and ``dr`` (R, N, H) fp32,
    one slot a row (``SlotPass.carry_row``); a two-slot pass uses row 0, a group pass rows 0 .. B - 1."""

    acc: Tensor
    dr: Tensor

    def row(self, i: int) -> "Carry":
        return Carry(self.acc[i], self.dr[i])

    @staticmethod
    def empty(rows: int, N: int, d: int, num_heads: int, device) -> "Carry":
        return Carry(torch.empty((rows, N, d), dtype=torch.float32, device=device),
                     torch.empty((rows, N, num_heads), dtype=torch.float32, device=device))


class Low(NamedTuple):
    """The second slot of a two-slot pass: its rows ``x`` (N, d) and RMS statistic ``rms`` (N,), where its
    ``dz * r`` for the pass's sites go (``dzr``, an (H, S, N) view), and its ``carry`` out."""

    x: Tensor
    rms: Tensor
    dzr: Tensor
    carry: Carry


def column_backward(x: Tensor, rms: Tensor, grad_out: Tensor | GradRows, lse: Tensor, delta: Tensor, qg: Tensor,
                    num_heads: int) -> tuple[Tensor, Tensor]:
    """The gradient of one slot ``x`` (N, d) read by S sites, and the S sites' ``qg`` gradients from it.

    ``rms`` (N,) is the slot's RMS statistic; ``grad_out`` the sites' output gradients, (S, N, d) or
    wherever they lie (``GradRows``), ``lse`` and ``delta`` (S, N, H) fp32 their log-sum-exps and deltas,
    ``qg`` (S, d) fp32 their fused query rows. Returns ``(dx (N, d) in x's dtype, dqg (S, d) fp32)``.
    """
    N, d = x.shape
    S = len(grad_out)
    if N == 0 or S == 0:
        return torch.zeros_like(x), torch.zeros((S, d), dtype=torch.float32, device=x.device)
    dx, dzr = slot_grad(x, rms, grad_out, lse, delta, qg, num_heads)
    return dx, query_grads(dzr, x.unsqueeze(0), num_heads, S, 1)


def _head_stride(dzr: Tensor, S: int, N: int) -> int:
    """The head stride of an (H, S, N) view of ``dz * r`` whose sites and tokens are contiguous."""
    if dzr.dtype != torch.float32 or dzr.shape[1:] != (S, N) or (S > 1 and dzr.stride(1) != N) or dzr.stride(2) != 1:
        raise ValueError(f"dz * r must be an fp32 (H, {S}, {N}) view with contiguous sites and tokens, got "
                         f"{tuple(dzr.shape)} strides {dzr.stride()}")
    return dzr.stride(0)


def slot_grad(x: Tensor, rms: Tensor, grad_out: Tensor | GradRows, lse: Tensor, delta: Tensor, qg: Tensor,
              num_heads: int, dzr: Tensor | None = None, *, carry: Carry | None = None,
              low: Low | None = None) -> tuple[Tensor, Tensor]:
    """``column_backward``'s first kernel, for N > 0: the slot's gradient and ``dz * r`` (H, S, N) fp32,
    written to ``dzr`` if given (a view whose heads may be strided: rows of a slot's block in the step's
    buffer). ``grad_out``: the S sites' output gradients, (S, N, d) or ``GradRows``. With ``carry``, the
    slot's sums over its other sites are added first. With ``low``, the same sites' share of a second slot
    is summed in the same pass (each site's output gradient and query row read once for both) and left in
    ``low.carry``."""
    N, d = x.shape
    grads = grad_out if isinstance(grad_out, GradRows) else GradRows.stacked(grad_out)
    S = len(grads)
    dx = torch.empty_like(x)
    if dzr is None:
        dzr = torch.empty((num_heads, S, N), dtype=torch.float32, device=x.device)
    if carry is not None and low is not None:
        raise ValueError("a two-slot pass starts from no carry")
    head = _head_stride(dzr, S, N)
    block_n, warps, stages = column_config(d, two_slots=low is not None)
    g_base, g_table, table = grads.kernel_args()
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCK_N": block_n, "PTX": ptx.use_ptx(x.device),
            "LOW": low is not None, "CARRY": carry is not None, "TABLE": table}
    if x.device.type != "cpu":
        meta["num_warps"] = warps
    if x.device.type != "cpu" and config.COLUMN_MAXNREG:
        meta["maxnreg"] = config.COLUMN_MAXNREG
    if stages:
        kernel, meta["STAGES"] = _column_bwd_kernel, stages
    else:  # the prefetching kernel: one or two tokens a program
        kernel, meta["PAIR"] = _column_bwd_prefetch_kernel, block_n == 2
        del meta["BLOCK_N"]
    y, ry, dzr_low, out = (low.x, low.rms, low.dzr, low.carry) if low is not None else (x, rms, dzr, carry)
    low_head = _head_stride(dzr_low, S, N) if low is not None else 0
    acc, dr = out if out is not None else (dx, rms)  # (unused pointers without LOW or CARRY)
    launch(kernel, (triton.cdiv(N, block_n),),
           (x, rms, g_base, g_table, lse, delta, qg, dx, dzr, y, ry, dzr_low, acc, dr, N, S, head, low_head),
           meta, x.device)
    return dx, dzr
