"""Triton kernels for the fused path's backward by source ("by column"): the whole gradient of one buffer
slot in one pass, once every site that reads it has its output gradient.

Summing source gradients site by site, as the forward runs, reads each source and read-modify-writes its
gradient once per site that sees it: three source-sized transfers per (site, source) pair, 3,675 of them a
step at the paper's 350M shape. But a slot's gradient is needed only when autograd reaches the sublayer
that wrote it, and by then every site that reads it has run its backward. So the backward keeps each
site's output gradient (where autograd left it, or copied, by width: ``grad_rows``) and its ``delta``, and
computes a slot's gradient in one pass when it is needed: the slot is read once, written once, and each
reading site's output gradient is read once, one transfer per pair plus two per slot (1,323 at that shape).

* ``_column_bwd_prefetch_kernel`` and ``_column_bwd_kernel``: one or two tokens per program, their rows of
  the slot in registers, streaming over the S sites that read the slot; each writes the slot's gradient
  (the part through its RMS statistic included, the whole row being at hand) and, per site and head,
  ``dz * r``, from which the routing parameters' gradients follow. The first loads a site ahead into
  registers, the second through Triton's shared-memory pipeline; which is faster depends on the width
  (``COLUMN_CONFIGS``, measured).
* Two slots a pass (``slot_passes``, where ``TWO_SLOT_CONFIGS`` says so): the sites that read slot j also
  read slot j - 1, so the pass for an odd slot j sums their share of slot j - 1 too (LOW), reading each
  output-gradient row and query row once for both, and leaves it in a carry; slot j - 1's own pass, when
  autograd reaches it, adds the sites that read it alone (CARRY). The output gradients are then read
  about half as often (843 instead of 1,323 source-sized transfers a step at the 350M shape).
* Group passes (``column_group``, where ``group_slots`` allows them): the sites that read a slot t read
  every slot below it too, so one pass over them sums their share of a group of up to 16 slots t - B + 1
  .. t as matrix products, reading each output gradient once for the group, and leaves a carry a slot;
  each slot's own pass (CARRY) adds the sites that read it but not t. ``slot_passes`` chooses where to
  cut the slots into groups, pairs and single slots by the bytes each moves.
* ``_dqg_kernel``: the query gradients from ``dz * r``, ``dqg[s, c] = sum_n dzr[h(c), s, n] * x[n, c]``, a matrix product
  over tokens per head, on tensor cores (bf16 sources: ``dzr`` split into two bf16 parts, so the product
  keeps about 16 bits of it) or in fp32. The training path runs it once for every slot of a step
  (``query_grads``), when the last slot's gradient is done: a program takes one head (both parts of a
  split one, so each block of ``dzr`` is read once; a head wider than 128 + 127 channels in blocks of
  128) and a chunk of the tokens, and sums over every slot; the chunks' sums are added at the end.

Math as in ``history`` (per site s reading the slot x, with g_s its output gradient):
``a = exp(r u_s - lse_s)``, ``dz = a (<g_s, x>_h - delta_s)``,
``dx = sum_s [a g_s + dz r qg_s] - (r^3 x / d) sum_s sum_h dz u_s``, ``dqg_s += dz r x``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from ..grad_rows import ALIGN_C, GradRows, site_offsets
from ..launch import by_width, device_index, head_meta, launch, num_sms, products_fit

__all__ = ["column_backward", "slot_grad", "slot_passes", "pairs_slots", "group_slots", "SlotPass", "run_pass",
           "Carry", "carry_rows", "Low", "query_grads", "dzr_rows", "dzr_block", "GradRows", "grads_in_place"]


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


@triton.jit(do_not_specialize=["N", "n_sites", "n_slots", "K", "chunk"])
def _dqg_kernel(
    dzr_ptr, x_ptr, part_ptr, N, n_sites, n_slots, K, chunk,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, SPLIT_BF16: tl.constexpr,
):
    # Program (channel block, site block, token chunk): the query gradients of its sites on one block of a
    # head's channels, summed over every slot and the chunk's tokens, to part[chunk]. Slot j is read by
    # sites K j .. n_sites - 1 (S_j of them); its dz * r, (H, S_j, N), follows those of the slots before it
    # in ``dzr``. One loop walks (slot, token block) pairs, so that the pipeline runs across slots. A head
    # is one block (its DA channels and, with HAS_B, its rest: each block of dz * r loaded once for both)
    # or, when wide, BLOCKS blocks of DA channels.
    h = tl.program_id(0) // BLOCKS
    c0 = h * DH + (tl.program_id(0) % BLOCKS) * DA  # the block's first channel
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] sites
    s_ok = s < n_sites
    t0 = tl.program_id(2) * chunk
    t1 = tl.minimum(t0 + chunk, N)
    ja = tl.arange(0, DA)
    jb = tl.arange(0, BLOCK_DB)
    b_ok = jb < DB
    acc_a = tl.zeros([BLOCK_S, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_S, BLOCK_DB], tl.float32)  # (a placeholder without HAS_B)
    # slots that some site of the block reads: j <= (last site) / K
    slots = tl.minimum(n_slots, (tl.program_id(1) * BLOCK_S + BLOCK_S - 1) // K + 1)
    blocks = tl.cdiv(t1 - t0, BLOCK_K)
    for i in range(0, slots * blocks):
        j = i // blocks
        n = t0 + (i - j * blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = n < t1
        first = K * j
        before = j * n_sites - K * j * (j - 1) // 2  # sites read by slots 0 .. j - 1
        row = s - first  # the site's row in slot j's block; negative: the site does not read slot j
        block = (before.to(tl.int64) * H + h * (n_sites - first)) * N
        a = tl.load(dzr_ptr + block + row.to(tl.int64)[:, None] * N + n[None, :],
                    mask=(s_ok & (row >= 0))[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_K]
        x_rows = x_ptr + j.to(tl.int64) * N * D + n.to(tl.int64)[:, None] * D + c0
        xa = tl.load(x_rows + ja[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_K, DA]
        xb = xa
        if HAS_B:
            xb = tl.load(x_rows + DA + jb[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        if USE_DOT:
            if SPLIT_BF16:
                a_hi = a.to(tl.bfloat16)
                a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
                acc_a = tl.dot(a_lo, xa, tl.dot(a_hi, xa, acc_a))
                if HAS_B:
                    acc_b = tl.dot(a_lo, xb, tl.dot(a_hi, xb, acc_b))
            else:
                acc_a = tl.dot(a, xa.to(tl.float32), acc_a, input_precision="ieee")
                if HAS_B:
                    acc_b = tl.dot(a, xb.to(tl.float32), acc_b, input_precision="ieee")
        else:
            acc_a += tl.sum(a[:, :, None] * xa.to(tl.float32)[None, :, :], axis=1)
            if HAS_B:
                acc_b += tl.sum(a[:, :, None] * xb.to(tl.float32)[None, :, :], axis=1)
    out = part_ptr + tl.program_id(2).to(tl.int64) * n_sites * D + s.to(tl.int64)[:, None] * D + c0
    tl.store(out + ja[None, :], acc_a, mask=s_ok[:, None])
    if HAS_B:
        tl.store(out + DA + jb[None, :], acc_b, mask=s_ok[:, None] & b_ok[None, :])


# Launch configuration of the column kernel by model width: tokens per program, warps, pipeline stages (0:
# the kernel that loads one site ahead into registers, one or two tokens; else the shared-memory pipeline
# over STAGES sites, for a tile of tokens that share each query row). Measured on the H200
# (benchmarks/bench_kernels.py, a step's calls; docs/benchmarks.md): d = 512 2.24 ms (pipelined 2.47 at
# best), d = 1024 7.84 ms (pipelined 9.4 at best), d = 1280 17.9 ms with two tokens, 3 stages (one token
# 27.5, registers 30.3). Other widths take the nearest. COLUMN_CONFIG, when set (benchmarks, tests),
# overrides the table; so does COLUMN_MAXNREG (0: no register cap).
COLUMN_CONFIGS = {512: (1, 2, 0), 1024: (1, 4, 0), 1280: (2, 2, 3)}
COLUMN_CONFIG: tuple[int, int, int] | None = None
COLUMN_MAXNREG = 0
# The same for a pass over two slots (``slot_passes``), whose program holds both slots' rows and sums; None:
# one slot a pass at that width. Measured on the H200 (a step's passes, docs/benchmarks.md): d = 512 1.91 ms
# against 2.26 one slot a pass, d = 1024 5.97 against 7.88; at d = 1280 the one-slot passes' two-token
# tiles (17.6 ms, 83 % of copy) are as fast as the best two-slot pass (one token, 17.6 ms at 195
# registers). TWO_SLOT_CONFIG overrides the table (and pairs at every width); TWO_SLOTS = False
# (benchmarks) takes one slot a pass everywhere.
TWO_SLOT_CONFIGS: dict[int, tuple[int, int, int] | None] = {512: (1, 2, 0), 1024: (1, 4, 0), 1280: None}
TWO_SLOT_CONFIG: tuple[int, int, int] | None = None
TWO_SLOTS = True
# The query gradients' product: sites a block at most (the sites padded to a power of two, at least 16),
# tokens a block, warps, stages, and programs an SM (the tokens are split in as many chunks as that
# takes, each chunk's sums a row of the partial sums). Measured on the H200 (one launch for a step's
# slots, d = 1024 / 1280 / 512): 0.454 / 1.100 / 0.304 ms; 2 programs an SM 0.483 / 1.197 / 0.420; blocks
# of 128 sites with 8 warps 1.40 / 1.26 / 0.47.
QUERY_GRAD_CONFIG = (64, 32, 4, 3, 8)


# Group passes (``column_group``) by model width: the most slots one takes (``slot_passes`` chooses the
# runs), 0 for none. Measured on the H200 (benchmarks/bench_kernels.py, a step's column passes of ``full``,
# call M1; docs/benchmarks.md "eleventh round"): d = 1024 5.04 ms against 5.96 for two slots a pass,
# d = 1280 11.4 against 17.5 one slot a pass; d = 512 2.11-2.32 against 1.92, so none there. Other widths
# take the nearest. ``block:K`` groupings take none: with them block:4's routing kernels took 4.4 ms at
# paper350m and 9.4 at paper1b (call M6) against 4.0 and 9.1 without (tenth round). GROUP_SLOTS, when set
# (benchmarks, tests), overrides the table.
GROUP_SLOTS_BY_WIDTH = {512: 0, 1024: 16, 1280: 16}
GROUP_SLOTS: int | None = None


# Whether a step's backward reads the sites' output gradients where autograd left them (``grad_rows``: a table
# of offsets, which each site's backward prologue writes) or copies each into one stacked buffer, by model
# width. Measured on the H200 in one call (benchmarks/bench_kernels.py --other-grads, a step's calls of
# ``full``; docs/benchmarks.md "fourteenth round"), copied -> in place: at d = 1024 the prologues 0.708 ->
# 0.503 ms, the partial-sum backward of block:4's sites 1.296 -> 1.137, the column passes 4.487 -> 4.561; at
# d = 512 0.367 -> 0.265, 0.664 -> 0.581 and 1.905 -> 1.971; at d = 1280 1.271 -> 1.149, 2.477 -> 2.191 but
# the column passes 9.691 -> 10.029 (not profiled: the pipelined kernel used there reads each site's offset
# back from shared memory before it can issue that site's row copies). Other widths take the nearest;
# GRADS_IN_PLACE overrides the table.
GRADS_IN_PLACE_BY_WIDTH = {512: True, 1024: True, 1280: False}
GRADS_IN_PLACE: bool | None = None


def grads_in_place(d: int) -> bool:
    """Whether the backward reads the output gradients in place (a table) at width ``d``, or copies them."""
    return GRADS_IN_PLACE if GRADS_IN_PLACE is not None else by_width(GRADS_IN_PLACE_BY_WIDTH, d)


def group_slots(d: int, num_heads: int, block: int = 1) -> int:
    """The most slots a group pass may take at width ``d`` with ``num_heads`` heads, when slot j is read by
    sites ``block * j`` .. (0: none)."""
    from ..column_group import MAX_GROUP, group_fits

    if GROUP_SLOTS is not None:
        most = GROUP_SLOTS
    else:
        most = by_width(GROUP_SLOTS_BY_WIDTH, d) if block == 1 else 0
    return min(most, MAX_GROUP) if most >= 3 and group_fits(d, num_heads) else 0


def pairs_slots(d: int) -> bool:
    """Whether the backward by source takes two slots a pass at width ``d`` (``slot_passes``)."""
    return TWO_SLOTS and (TWO_SLOT_CONFIG is not None or by_width(TWO_SLOT_CONFIGS, d) is not None)


def column_config(d: int, two_slots: bool = False) -> tuple[int, int, int]:
    """(tokens a program, warps, stages) of the column kernel at width ``d``, for one slot a pass or two."""
    override, table = (TWO_SLOT_CONFIG, TWO_SLOT_CONFIGS) if two_slots else (COLUMN_CONFIG, COLUMN_CONFIGS)
    config = override if override is not None else by_width(table, d)
    if config is None:
        raise ValueError(f"no two-slot column config at d = {d}: the table takes one slot a pass there")
    if two_slots and config[0] > 1 and config[2] == 0:
        raise ValueError(f"column config {config}: a pass over two slots takes one token a program unless "
                         "pipelined (stages > 0)")
    return config


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


def carry_rows(passes: list["SlotPass"]) -> int:
    """The rows a ``Carry`` needs for ``passes``: the largest group's slots, or one."""
    return max([len(p.group) for p in passes if p.group is not None] + [1])


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
    if x.device.type != "cpu" and COLUMN_MAXNREG:
        meta["maxnreg"] = COLUMN_MAXNREG
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


@dataclass(frozen=True)
class SlotPass:
    """One pass of a step's backward by source: slot ``slot``'s gradient from the sites ``sites``.

    With ``low``, the pass also sums those sites' share of slot - 1 (which they read too) into carry row 0.
    With ``group`` (slots ending at ``slot``), a group pass first sums the share of every slot of the group
    from the sites that read ``slot`` (``column_group``), one carry row a slot in order, and ``sites`` is
    empty: this slot's gradient is its row finished. With ``carried``, the slot's share from its other sites
    comes from carry row ``carry_row``, and ``sites`` are the rest."""

    slot: int
    sites: range
    low: bool = False
    carried: bool = False
    group: range | None = None
    carry_row: int = 0


# The byte model that plans a step's passes, in units of one source (N x d in the buffer's dtype, bf16 in
# training, so an fp32 carry counts 2): a pass reads its slot and each of its sites' output gradients once
# and writes the slot's gradient; a carry is written once and read once. The statistics (N x H a site)
# are left out.
CARRY_UNITS = 2


def _single_cost(S: int) -> int:
    return S + 2


def _pair_cost(S: int, block: int) -> int:
    # the pass over both slots (the two slots, S gradients, a gradient and a carry written) and the lower
    # slot's own pass (its slot, its block of sites, the carry read, its gradient)
    return (S + 3 + CARRY_UNITS) + (block + 2 + CARRY_UNITS)


# What a unit that a group pass moves costs against a unit of the other passes (1: the byte model). The
# group kernel moves its bytes at about 36 % of copy and the slots' own passes at about 75 %
# (benchmarks/bench_kernels.py, call N2), so 2: fewer, larger groups, and more pairs. Measured (a step's
# column passes, call N5): 4.80 -> 4.51 ms at paper350m, 10.69 -> 9.70 at paper1b; 1.25 and 1.5 gave
# 4.52 / 4.46 and 10.41 / 10.25 ms, 3 gave 5.93 and 9.81.
GROUP_PASS_WEIGHT = 2.0


def _group_cost(S: int, B: int, block: int) -> float:
    # the group pass (B slots, S gradients, B carries written), then each slot's own pass (its slot, the
    # carry read, its gradient, and the sites that read it but not the top slot: block * k for the k-th
    # slot below the top)
    return GROUP_PASS_WEIGHT * (S + B + CARRY_UNITS * B) + B * (2 + CARRY_UNITS) + block * B * (B - 1) // 2


def slot_passes(n_slots: int, n_sites: int, block: int, two_slots: bool, max_group: int = 0) -> list[SlotPass]:
    """The passes of a step's backward by source, in the order autograd reaches the slots (the last
    first), when slot j is read by sites ``block * j`` .. ``n_sites - 1``.

    Without groups (``max_group`` < 3), with ``two_slots`` (take ``pairs_slots(d)``) every odd slot's pass
    takes the even slot below it: the sites that read both are read once for the two, and the lower slot's
    own pass reads only the ``block`` sites that read it alone (whose output gradients are not known yet
    when the pass above runs). This reads the output gradients about half as often as one pass a slot.

    With ``max_group`` >= 3 (take ``group_slots(d, H, block)``), slots are cut into runs taken one slot a pass,
    two (if ``two_slots``) or 3 .. ``max_group`` a group pass, the cut of least cost by the byte model
    above with a group pass's bytes counted ``GROUP_PASS_WEIGHT`` times: groups where many sites read the
    slots, which they then read once for the group."""
    if max_group < 3:
        passes = []
        for j in reversed(range(n_slots)):
            first = block * j
            if two_slots and j % 2 == 0 and j + 1 < n_slots:
                passes.append(SlotPass(j, range(first, first + block), carried=True))
            else:
                passes.append(SlotPass(j, range(first, n_sites), low=two_slots and j % 2 == 1))
        return passes
    # best[j]: the least cost of slots [0, j) and the size of the run that ends at j - 1
    best = [(0, 0)] * (n_slots + 1)
    for j in range(1, n_slots + 1):
        S = n_sites - block * (j - 1)  # sites that read the run's top slot
        options = [(best[j - 1][0] + _single_cost(S), 1)]
        if two_slots and j >= 2:
            options.append((best[j - 2][0] + _pair_cost(S, block), 2))
        options += [(best[j - B][0] + _group_cost(S, B, block), B) for B in range(3, min(max_group, j) + 1)]
        best[j] = min(options)
    passes, j = [], n_slots
    while j > 0:
        size = best[j][1]
        top, first = j - 1, block * (j - 1)
        if size == 1:
            passes.append(SlotPass(top, range(first, n_sites)))
        elif size == 2:
            passes.append(SlotPass(top, range(first, n_sites), low=True))
            passes.append(SlotPass(top - 1, range(first - block, first), carried=True))
        else:
            group = range(j - size, j)
            passes.append(SlotPass(top, range(first, first), group=group, carried=True, carry_row=size - 1))
            passes += [SlotPass(u, range(block * u, first), carried=True, carry_row=u - group.start)
                       for u in reversed(range(j - size, top))]
        j -= size
    return passes


def run_pass(p: SlotPass, sources: Tensor, rms: Tensor, grad_out: Tensor | GradRows, lse: Tensor, delta: Tensor,
             qg: Tensor, num_heads: int, block: int, dzr: Tensor, carry: Carry, carried: bool = True) -> Tensor:
    """Pass ``p`` of a step's backward (``slot_passes``) over the step's tensors: ``sources`` (slots, N, d)
    and ``rms`` (slots, N) as written in the forward; every site's output gradient, (sites, N, d) or
    ``GradRows``, ``lse`` and ``delta`` (sites, N, H), ``qg`` (sites, d); the step's flat ``dz * r``
    (``dzr_block``); ``carry``, where a two-slot or group pass leaves the lower slots' sums and a carried
    pass finds them (``carried`` False: the pass that would have left them did not run, so the slot takes
    every site that reads it). Returns the slot's gradient (N, d)."""
    grads = grad_out if isinstance(grad_out, GradRows) else GradRows.stacked(grad_out)
    j, n_sites, N = p.slot, len(grads), sources.shape[1]
    rows, sites, start, low = dzr_block(dzr, j, n_sites, block, num_heads, N), p.sites, None, None
    if p.group is not None:
        from ..column_group import group_pass

        group_pass(sources, rms, grads, lse, delta, qg, num_heads, p.group, range(block * j, n_sites), n_sites,
                   block, dzr, carry.acc, carry.dr)
    if p.carried and (carried or p.group is not None):
        rows, start = rows[:, :len(sites)], carry.row(p.carry_row)
    elif p.carried:
        sites = range(block * j, n_sites)
    elif p.low:
        below = dzr_block(dzr, j - 1, n_sites, block, num_heads, N)[:, block:]
        low = Low(sources[j - 1], rms[j - 1], below, carry.row(0))
    at = slice(sites.start, sites.stop)
    grad, _ = slot_grad(sources[j], rms[j], grads.sites(at), lse[at], delta[at], qg[at], num_heads, dzr=rows,
                        carry=start, low=low)
    return grad


def dzr_block(dzr: Tensor, slot: int, n_sites: int, block: int, num_heads: int, N: int) -> Tensor:
    """Slot ``slot``'s (H, S, N) block of a step's flat ``dz * r`` (``dzr_rows``): the S sites that read it."""
    start, S = dzr_rows(slot, n_sites, block) * num_heads * N, n_sites - block * slot
    return dzr[start:start + S * num_heads * N].view(num_heads, S, N)


def dzr_rows(slots: int, n_sites: int, block: int) -> int:
    """Sites read by slots 0 .. ``slots`` - 1 together, when slot j is read by sites ``block * j`` ..
    ``n_sites - 1``: where slot ``slots``'s (H, S, N) block of ``dzr`` starts, in units of H * N elements
    (with ``slots`` = every slot, the size of ``dzr``)."""
    return slots * n_sites - block * slots * (slots - 1) // 2


def query_grads(dzr: Tensor, sources: Tensor, num_heads: int, n_sites: int, block: int) -> Tensor:
    """The sites' ``qg`` gradients (n_sites, d) fp32 from every slot at once: ``sources`` (slots, N, d)
    and, for each slot j in turn (read by sites ``block * j`` .. ``n_sites - 1``), its ``dz * r`` (H, S_j, N)
    packed one after the other in ``dzr`` (``dzr_rows``)."""
    n_slots, N, d = sources.shape
    if N == 0 or n_slots == 0:
        return torch.zeros((n_sites, d), dtype=torch.float32, device=sources.device)
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCKS": 1}
    if meta["DA"] > 128 or not products_fit(meta):
        # a wide head (AttnRes: one head of d channels), or one with a part narrower than a matrix
        # product: blocks of the largest power of two dividing its width, at most 128
        width = d // num_heads
        meta.update(DA=min(128, width & -width), DB=0, BLOCK_DB=1, HAS_B=False)
        meta["BLOCKS"] = width // meta["DA"]
    use_dot = products_fit(meta)
    sites = max(16, triton.next_power_of_2(n_sites))
    if sources.device.type == "cpu":  # interpreter: two chunks, so that tests cover their sum
        block_s, block_k, chunks, options = min(sites, 64), 16, 2, {}
    else:
        max_s, block_k, warps, stages, per_sm = QUERY_GRAD_CONFIG
        block_s = min(sites, max_s)
        if not use_dot:  # elementwise products [sites, tokens, channels]: small blocks
            block_s, block_k = 16, 16
        programs = num_heads * meta["BLOCKS"] * triton.cdiv(n_sites, block_s)
        chunks = triton.cdiv(per_sm * num_sms(device_index(sources.device)), programs)
        options = {"num_warps": warps, "num_stages": stages}
    chunk = triton.cdiv(triton.cdiv(N, chunks), block_k) * block_k  # tokens a chunk, whole blocks
    chunks = triton.cdiv(N, chunk)
    part = torch.empty((chunks, n_sites, d), dtype=torch.float32, device=sources.device)
    meta.update(BLOCK_S=block_s, BLOCK_K=block_k, USE_DOT=use_dot, SPLIT_BF16=sources.dtype == torch.bfloat16,
                **options)
    grid = (num_heads * meta["BLOCKS"], triton.cdiv(n_sites, block_s), chunks)
    launch(_dqg_kernel, grid, (dzr, sources, part, N, n_sites, n_slots, block, chunk), meta, sources.device)
    return part.sum(0)
