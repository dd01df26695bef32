"""Triton kernels of the fused training path's forward (``model/residual/fused.py``): routing sites that
read a buffer of sources in place, alone or several at once over a shared history; and the per-site
backward of the sources a site reads beyond the buffer (a block's partial sum). The gradients of the
buffer's slots are ``column``'s.

In a routed decoder the queries are parameters, not functions of the token, so the G consecutive sites
of a group can share one pass over the sources that were complete when the group began ("the history"):
the forward computes the G partial softmax states at once, and each site then merges its partial state
with the few sources produced inside the group (an online-softmax merge, exact). History bytes drop by
a factor G.

Two families of kernels:

* one token at a time, the whole row of d channels (``_sites_fwd_kernel``, ``_merge_fwd_kernel``,
  ``_sites_bwd_kernel``): a site (or a few) over its sources, the per-site mode, and the merge of a site with
  the sources it reads beyond its group's history (where ``MERGE_CONFIG`` says, in a kernel whose programs
  walk many tokens, pipelined). The RMS of a source is computed from the row. The backward kernel also
  writes a site's ``delta = <g, out>`` for the slots' backward, and where its output gradient lies (or a copy
  of it).
* one routing head per program, the shared pass of G > 2 sites (``history_forward``). Holding G sites'
  accumulators for a whole row would fill the register file (measured on the H200: a shared pass of 8
  sites over full rows took 53 ms a step against 25 ms for one pass per site); a head's [G, d/H] tile is
  the size of one site's row. The RMS statistic spans all heads, so these kernels read it from ``rms``
  (written once per source by ``write_slot``). Three forms: for a token, G sites over S sources is a small
  attention whose two products run on tensor cores (``_history_fwd_dot_kernel``, from
  ``HISTORY_DOT_MIN_S`` sources on, heads wide enough for ``tl.dot``); the same products over several
  tokens' sources at once where S is small (``_history_fwd_stacked_kernel``, where
  ``HISTORY_STACKED_CONFIG`` is set); fewer sources, or narrow heads, take token tiles with every product a
  sum across lanes (``_history_fwd_kernel``).

Math (per site k, r = rsqrt(mean_c s_c^2 + eps), u_k = <s_h, qg_k,h>, z = r u):

    forward:   a_k = softmax over sources of z_k,     out_k = sum_s a_k s
    backward:  dz_k = a_k (<g_k, s> - delta_k),       delta_k = <g_k, out_k>   (flash-attention's identity)
               ds  = sum_k [a_k g_k + dz_k r qg_k] - (r^3 s / d) sum_k sum_h dz_k,h u_k,h,
               dqg_k += dz_k r s

Log-sum-exps and deltas are laid out (sites, N, H): a token's heads in one 32-byte sector, read once per
(token, site) by the backward.
Heads whose width is not a power of two are split into a power-of-two part (DA) and a rest (DB, padded
to BLOCK_DB; ``launch.head_meta``); on CPU tensors the kernels run through Triton's interpreter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from ..launch import by_width, head_meta, launch, persistent_programs, products_fit, tile_width
from ..products import head_columns, query_operand, split, stack_halves, sum_halves

__all__ = ["write_slot", "sites_forward", "sites_backward", "history_forward", "add_row_sums", "Norm", "norm_rows"]


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


# Counts are not specialised on (S == 1, N % 16, ...): every site's S differs, and each specialisation would
# be one more compilation, paid inside the first training steps. The rest part of a head (DB channels) is
# compiled in only when the head width is not a power of two (HAS_B), so that power-of-two widths carry no
# empty loads, masks or reductions.
@triton.jit(do_not_specialize=["N", "S", "G"])
def _sites_fwd_kernel(
    src_ptr, rms_ptr, qg_ptr, init_ptr, out0_ptr, rest_ptr, lse_ptr, add_ptr, sum_ptr, nw_ptr, normed_ptr,
    nstats_ptr, N, S, G, stride_s, eps, norm_eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, HAS_INIT: tl.constexpr,
    USE_RMS: tl.constexpr, KEEP_RMS: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
):
    # USE_RMS: the sources' RMS statistics are read from ``rms`` (buffer slots have them) instead of being
    # reduced from the row, a reduction across the program's warps per source; KEEP_RMS (without USE_RMS):
    # the reduced ones are written there, for the backward to read (a block's partial sum). ADD (one
    # source, S = 1): the source is src + add, summed in fp32 and rounded to sum's dtype as torch adds, and
    # written to sum (a block's partial sum, made in the pass that first reads it). NORM (one site, G = 1): the output's
    # pre-norm by the gain at ``nw`` is written to ``normed`` too, its statistics to ``nstats`` (``_normed``).
    tok = tl.program_id(0).to(tl.int64)
    row = tok * D
    k = tl.arange(0, BLOCK_G)[:, None, None]  # [BLOCK_G, 1, 1] site within the group
    h = tl.arange(0, H)[None, :, None]
    ja = tl.arange(0, DA)[None, None, :]
    jb = tl.arange(0, BLOCK_DB)[None, None, :]
    col_a = h * DH + ja  # [1, H, DA]
    col_b = h * DH + DA + jb  # [1, H, BLOCK_DB]
    b_ok = jb < DB
    k_ok = k < G
    # Per-site tensors are [BLOCK_G, H, .]; one source is [1, H, .] and broadcasts over the sites.
    qg_a = tl.load(qg_ptr + k * D + col_a, mask=k_ok, other=0.0)
    if HAS_B:
        qg_b = tl.load(qg_ptr + k * D + col_b, mask=k_ok & b_ok, other=0.0)
    kh = tl.arange(0, BLOCK_G)[:, None] * N * H + tok * H + tl.arange(0, H)[None, :]  # [BLOCK_G, H]
    kh_ok = (tl.arange(0, BLOCK_G) < G)[:, None]

    if HAS_INIT:  # continue from a partial state: its normalised output, weight 1 at its log-sum-exp
        m = tl.load(lse_ptr + kh, mask=kh_ok, other=0.0)
        l = tl.full([BLOCK_G, H], 1.0, tl.float32)
        site_row = k.to(tl.int64) * N * D + row
        acc_a = tl.load(init_ptr + site_row + col_a, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_B:
            acc_b = tl.load(init_ptr + site_row + col_b, mask=k_ok & b_ok, other=0.0).to(tl.float32)
    else:
        m = tl.full([BLOCK_G, H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G, H], tl.float32)
        acc_a = tl.zeros([BLOCK_G, H, DA], tl.float32)
        if HAS_B:
            acc_b = tl.zeros([BLOCK_G, H, BLOCK_DB], tl.float32)

    src = src_ptr + row
    # Loads are masked by a column limit that is 0 when there is no such source (a tensor mask: it works
    # the same in the compiler and the interpreter).
    next_a = tl.load(src + col_a, mask=ja < tl.where(S > 0, DA, 0), other=0.0)
    if HAS_B:
        next_b = tl.load(src + col_b, mask=jb < tl.where(S > 0, DB, 0), other=0.0)
    if ADD:
        next_a = (next_a.to(tl.float32) + tl.load(add_ptr + row + col_a).to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row + col_a, next_a)
        if HAS_B:
            next_b = (next_b.to(tl.float32) + tl.load(add_ptr + row + col_b, mask=b_ok, other=0.0).to(tl.float32)
                      ).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row + col_b, next_b, mask=b_ok)
    rms = rms_ptr + tok
    for s in range(S):
        xa = next_a.to(tl.float32)
        # Issue the loads of source s + 1 before reducing source s (see mhar_triton: the pipeliner does not
        # stage loads that feed no dot).
        next_a = tl.load(src + stride_s + col_a, mask=ja < tl.where(s + 1 < S, DA, 0), other=0.0)
        z = tl.sum(xa * qg_a, axis=2)  # [BLOCK_G, H]
        if not USE_RMS:
            ss = tl.sum(tl.sum(tl.sum(xa * xa, axis=2), axis=1), axis=0)
        if HAS_B:
            xb = next_b.to(tl.float32)
            next_b = tl.load(src + stride_s + col_b, mask=jb < tl.where(s + 1 < S, DB, 0), other=0.0)
            if not USE_RMS:
                ss += tl.sum(tl.sum(tl.sum(xb * xb, axis=2), axis=1), axis=0)
            z += tl.sum(xb * qg_b, axis=2)
        src += stride_s
        if USE_RMS:
            r = tl.load(rms)
        else:
            r = 1.0 / tl.sqrt(ss / D + eps)
            if KEEP_RMS:
                tl.store(rms, r)
        rms += N
        z = z * r
        m, l, alpha, p = _softmax_step(m, l, z)
        acc_a = acc_a * alpha[:, :, None] + p[:, :, None] * xa
        if HAS_B:
            acc_b = acc_b * alpha[:, :, None] + p[:, :, None] * xb

    inv_l = 1.0 / l[:, :, None]
    # Site 0's output goes to its own tensor (it may be kept for backward while the other partial states
    # are dropped after their merge); sites 1.. go to ``rest``, site k at row k - 1.
    first = k == 0
    rest_row = (k.to(tl.int64) - 1) * N * D + row
    later = (k > 0) & k_ok
    out_a = (acc_a * inv_l).to(out0_ptr.dtype.element_ty)
    tl.store(out0_ptr + row + col_a + k * 0, out_a, mask=first)
    tl.store(rest_ptr + rest_row + col_a, out_a, mask=later)
    out_b = out_a  # (a placeholder without HAS_B)
    if HAS_B:
        out_b = (acc_b * inv_l).to(out0_ptr.dtype.element_ty)
        tl.store(out0_ptr + row + col_b + k * 0, out_b, mask=first & b_ok)
        tl.store(rest_ptr + rest_row + col_b, out_b, mask=later & b_ok)
    tl.store(lse_ptr + kh, m + tl.log(l), mask=kh_ok)
    if NORM:
        na, nb = _normed(out_a.to(tl.float32), out_b.to(tl.float32), nw_ptr, nstats_ptr + tok * (H + 1), col_a, col_b,
                         b_ok, norm_eps, out0_ptr.dtype.element_ty, D, H, HAS_B, tl.full([1], 1, tl.int1))
        tl.store(normed_ptr + row + col_a + k * 0, na.to(normed_ptr.dtype.element_ty), mask=first)
        if HAS_B:
            tl.store(normed_ptr + row + col_b + k * 0, nb.to(normed_ptr.dtype.element_ty), mask=first & b_ok)


# A site's merge of its partial state with the few sources it reads beyond its group's history (a block's
# partial sum, or the slots written inside its group): one site, S <= MERGE_MAX_S sources unrolled, so that
# the loop runs over tokens only and is software-pipelined over STAGES of them (the next tokens' rows are
# copied into shared memory while this one is reduced), the query row loaded once a program. Persistent:
# program p walks tokens p, p + P, ...; the same arithmetic as ``_sites_fwd_kernel`` with HAS_INIT.
@triton.jit(do_not_specialize=["N", "tokens_per_program"])
def _merge_fwd_kernel(
    src_ptr, rms_ptr, qg_ptr, init_ptr, out_ptr, lse_ptr, add_ptr, sum_ptr, nw_ptr, normed_ptr, nstats_ptr,
    N, stride_s, eps, norm_eps, tokens_per_program,
    S: tl.constexpr, D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, USE_RMS: tl.constexpr, KEEP_RMS: tl.constexpr, ADD: tl.constexpr,
    NORM: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    h = tl.arange(0, H)
    ja = tl.arange(0, DA)[None, :]
    jb = tl.arange(0, BLOCK_DB)[None, :]
    col_a = h[:, None] * DH + ja  # [H, DA]
    col_b = h[:, None] * DH + DA + jb  # [H, BLOCK_DB]
    b_ok = jb < DB
    qg_a = tl.load(qg_ptr + col_a)
    qg_b = tl.zeros([H, BLOCK_DB], tl.float32)  # (a placeholder without HAS_B)
    if HAS_B:
        qg_b = tl.load(qg_ptr + col_b, mask=b_ok, other=0.0)
    for i in tl.range(tokens_per_program, num_stages=STAGES):
        tok = (pid + i * num_programs).to(tl.int64)
        # Past the last token the program recomputes token N - 1 and stores nothing: no masks on loads.
        # (``live`` has shape [1, 1], not a scalar: the interpreter takes no scalar in a combined mask.)
        live = (tok + tl.zeros([1, 1], tl.int64)) < N
        tok = tl.minimum(tok, N - 1)
        row = tok * D
        # the partial state: its normalised output, weight 1 at its log-sum-exp
        m = tl.load(lse_ptr + tok * H + h)
        l = tl.full([H], 1.0, tl.float32)
        acc_a = tl.load(init_ptr + row + col_a).to(tl.float32)
        acc_b = qg_b
        if HAS_B:
            acc_b = tl.load(init_ptr + row + col_b, mask=b_ok, other=0.0).to(tl.float32)
        for s in tl.static_range(S):
            at = s * stride_s + row
            xa = tl.load(src_ptr + at + col_a)
            xb = xa
            if HAS_B:
                xb = tl.load(src_ptr + at + col_b, mask=b_ok, other=0.0)
            if ADD:  # (S = 1) the source is src + add, rounded to sum's dtype as torch adds, and written there
                xa = (xa.to(tl.float32) + tl.load(add_ptr + row + col_a).to(tl.float32)).to(sum_ptr.dtype.element_ty)
                tl.store(sum_ptr + row + col_a, xa, mask=live & (ja >= 0))
                if HAS_B:
                    xb = (xb.to(tl.float32) + tl.load(add_ptr + row + col_b, mask=b_ok, other=0.0).to(tl.float32)
                          ).to(sum_ptr.dtype.element_ty)
                    tl.store(sum_ptr + row + col_b, xb, mask=live & b_ok)
            xa = xa.to(tl.float32)
            z = tl.sum(xa * qg_a, axis=1)  # [H]
            if not USE_RMS:
                ss = tl.sum(tl.sum(xa * xa, axis=1), axis=0)
            if HAS_B:
                xb = xb.to(tl.float32)
                if not USE_RMS:
                    ss += tl.sum(tl.sum(xb * xb, axis=1), axis=0)
                z += tl.sum(xb * qg_b, axis=1)
            if USE_RMS:
                r = tl.load(rms_ptr + s * N + tok)
            else:
                r = 1.0 / tl.sqrt(ss / D + eps)
                if KEEP_RMS:
                    tl.store(rms_ptr + s * N + tok + tl.zeros([1, 1], tl.int64), r + tl.zeros([1, 1], tl.float32),
                             mask=live)
            z = z * r
            m, l, alpha, p = _softmax_step(m, l, z)
            acc_a = acc_a * alpha[:, None] + p[:, None] * xa
            if HAS_B:
                acc_b = acc_b * alpha[:, None] + p[:, None] * xb
        inv_l = 1.0 / l[:, None]
        out_a = (acc_a * inv_l).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row + col_a, out_a, mask=live & (ja >= 0))
        out_b = out_a
        if HAS_B:
            out_b = (acc_b * inv_l).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row + col_b, out_b, mask=live & b_ok)
        tl.store(lse_ptr + tok * H + h[None, :], (m + tl.log(l))[None, :], mask=live & (h[None, :] >= 0))
        if NORM:
            na, nb = _normed(out_a.to(tl.float32), out_b.to(tl.float32), nw_ptr, nstats_ptr + tok * (H + 1), col_a,
                             col_b, b_ok, norm_eps, out_ptr.dtype.element_ty, D, H, HAS_B, tl.reshape(live, [1]))
            tl.store(normed_ptr + row + col_a, na.to(normed_ptr.dtype.element_ty), mask=live & (ja >= 0))
            if HAS_B:
                tl.store(normed_ptr + row + col_b, nb.to(normed_ptr.dtype.element_ty), mask=live & b_ok)


@triton.jit(do_not_specialize=["N", "G", "tokens_per_program", "g_offset"])
def _sites_bwd_kernel(
    src_ptr, dsrc_ptr, base_ptr, qg_ptr, g_ptr, lse_ptr, delta_ptr, out_ptr, gcopy_ptr, gtab_ptr, dqg_part_ptr,
    nw_ptr, nstats_ptr, rms_ptr, N, G, stride_s, eps, norm_eps, tokens_per_program, g_offset,
    S: tl.constexpr, D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, ACCUMULATE: tl.constexpr,
    COMPUTE_DELTA: tl.constexpr, COPY_GRAD: tl.constexpr, RECORD: tl.constexpr, WRITE_DQG: tl.constexpr,
    NORM: tl.constexpr, USE_RMS: tl.constexpr, STAGES: tl.constexpr,
):
    # Persistent: program p walks tokens p, p + P, ... so that the qg-gradient partial sums are one
    # [BLOCK_G, D] row per program, not per token. ACCUMULATE: the sources' gradients are base + this
    # pass's (base may be dsrc itself). The S sources (0 or 1 in training: a block's partial sum) are
    # unrolled, so that the token loop holds no inner loop and is software-pipelined over STAGES tokens:
    # the next tokens' rows are copied into shared memory while this one is reduced.
    # NORM (one site, with COMPUTE_DELTA and COPY_GRAD): ``g`` is the gradient of the site's output after
    # the sublayer's pre-norm (gain at ``nw``, statistics as the forward kept them at ``nstats``); the
    # output's own gradient is made from it first, and is what the rest of the pass uses and ``gcopy``
    # keeps; the gain's partial sums follow the qg ones, in row BLOCK_G of each program's partials.
    # USE_RMS: the sources' RMS statistics are read from ``rms`` (as the forward kept them) rather than
    # reduced from the rows, a reduction across the program's warps less.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if RECORD:  # where the column passes will find this site's output gradient (``grad_rows``)
        if pid == 0:
            tl.store(gtab_ptr, g_offset)
    k = tl.arange(0, BLOCK_G)[:, None, None]
    h = tl.arange(0, H)[None, :, None]
    ja = tl.arange(0, DA)[None, None, :]
    jb = tl.arange(0, BLOCK_DB)[None, None, :]
    col_a = h * DH + ja
    col_b = h * DH + DA + jb
    b_ok = jb < DB
    k_ok = k < G
    kh_ok = (tl.arange(0, BLOCK_G) < G)[:, None]
    qg_a = tl.load(qg_ptr + k * D + col_a, mask=k_ok, other=0.0)
    dqg_a = tl.zeros([BLOCK_G, H, DA], tl.float32)
    qg_b = tl.zeros([BLOCK_G, H, BLOCK_DB], tl.float32)  # (placeholders without HAS_B)
    dqg_b = tl.zeros([BLOCK_G, H, BLOCK_DB], tl.float32)
    if HAS_B:
        qg_b = tl.load(qg_ptr + k * D + col_b, mask=k_ok & b_ok, other=0.0)
    if NORM:
        nw_a = tl.load(nw_ptr + col_a)
        nw_b = qg_b
        if HAS_B:
            nw_b = tl.load(nw_ptr + col_b, mask=b_ok, other=0.0)
        dnw_a = tl.zeros([BLOCK_G, H, DA], tl.float32)
        dnw_b = tl.zeros([BLOCK_G, H, BLOCK_DB], tl.float32)

    for i in tl.range(tokens_per_program, num_stages=STAGES):
        tok = (pid + i * num_programs).to(tl.int64)
        # Past the last token the program recomputes token N - 1 and stores nothing: no masks on loads.
        # (``live`` has shape [1], not a scalar: the interpreter takes no scalar in a combined mask.)
        live = (tok + tl.zeros([1], tl.int64)) < N
        tok = tl.minimum(tok, N - 1)
        row = tok * D
        site_row = k.to(tl.int64) * N * D + row
        kh = tl.arange(0, BLOCK_G)[:, None] * N * H + tok * H + tl.arange(0, H)[None, :]
        ga = tl.load(g_ptr + site_row + col_a, mask=k_ok, other=0.0).to(tl.float32)
        gb = qg_b
        if HAS_B:
            gb = tl.load(g_ptr + site_row + col_b, mask=k_ok & b_ok, other=0.0).to(tl.float32)
        # padded sites get lse = +inf, hence weight 0 and no gradient
        lse = tl.load(lse_ptr + kh, mask=kh_ok, other=float("inf"))
        if COMPUTE_DELTA:
            oa = tl.load(out_ptr + row + col_a).to(tl.float32)
            ob = oa
            if HAS_B:
                ob = tl.load(out_ptr + row + col_b, mask=b_ok, other=0.0).to(tl.float32)
            if NORM:
                # RMSNorm's backward, n = o r with r = rsqrt(mean(o^2) + eps): do = r gw - o r^3 <gw, o> / D
                # (gw = g * gain). r and the per-head sums of o^2 are the forward's; <gw, o> is the sum of
                # per-head ones, which with them also give delta = <do, o> per head, so that the pass has one
                # reduction across its warps before the gradient is formed.
                gwa = ga * nw_a
                go = tl.sum(gwa * oa, axis=2)  # [BLOCK_G, H]
                if HAS_B:
                    gwb = gb * nw_b
                    go += tl.sum(gwb * ob, axis=2)
                stats = nstats_ptr + tok * (H + 1)
                oo = tl.load(stats + tl.arange(0, H)[None, :] + tl.zeros([BLOCK_G, 1], tl.int64))
                rn = tl.load(stats + H)
                row_go = tl.sum(tl.sum(go, axis=1), axis=0)
                k3 = rn * rn * rn * row_go / D
                delta = rn * go - k3 * oo
                # The gain's gradient sums g * n over tokens (n unrounded: the forward's bf16 rounding of n
                # is no function of the gain), past the last token with a factor 0.
                rl = tl.where(live, rn, 0.0)
                dnw_a += ga * (oa * rl)
                ga = rn * gwa - k3 * oa
                if HAS_B:
                    dnw_b += gb * (ob * rl)
                    gb = rn * gwb - k3 * ob
            else:
                delta = tl.sum(ga * oa, axis=2)  # [BLOCK_G, H]
                if HAS_B:
                    delta += tl.sum(gb * ob, axis=2)
            if COPY_GRAD:
                tl.store(gcopy_ptr + site_row + col_a, ga.to(gcopy_ptr.dtype.element_ty), mask=k_ok & live)
                if HAS_B:
                    tl.store(gcopy_ptr + site_row + col_b, gb.to(gcopy_ptr.dtype.element_ty), mask=k_ok & b_ok & live)
            tl.store(delta_ptr + kh, delta, mask=kh_ok & live)
        else:
            delta = tl.load(delta_ptr + kh, mask=kh_ok, other=0.0)

        for s in tl.static_range(S):
            at = s * stride_s + row
            xa = tl.load(src_ptr + at + col_a).to(tl.float32)
            xb = gb
            if HAS_B:
                xb = tl.load(src_ptr + at + col_b, mask=b_ok, other=0.0).to(tl.float32)
            u = tl.sum(xa * qg_a, axis=2)  # [BLOCK_G, H]
            da = tl.sum(ga * xa, axis=2)
            if HAS_B:
                u += tl.sum(xb * qg_b, axis=2)
                da += tl.sum(gb * xb, axis=2)
            if USE_RMS:
                r = tl.load(rms_ptr + s * N + tok)
            else:
                ss = tl.sum(tl.sum(tl.sum(xa * xa, axis=2), axis=1), axis=0)
                if HAS_B:
                    ss += tl.sum(tl.sum(tl.sum(xb * xb, axis=2), axis=1), axis=0)
                r = 1.0 / tl.sqrt(ss / D + eps)
            a = tl.exp(u * r - lse)
            dz = a * (da - delta)
            rdz = (dz * r)[:, :, None]
            w = tl.sum(tl.sum(dz * u, axis=1), axis=0) * (r * r * r / D)
            a = a[:, :, None]
            if BLOCK_G == 1:
                ds_a = a * ga + rdz * qg_a - w * xa
            else:
                ds_a = tl.sum(a * ga + rdz * qg_a, axis=0, keep_dims=True) - w * xa
            if ACCUMULATE:
                ds_a += tl.load(base_ptr + at + col_a).to(tl.float32)
            tl.store(dsrc_ptr + at + col_a, ds_a.to(dsrc_ptr.dtype.element_ty), mask=(ja >= 0) & live)
            if HAS_B:
                if BLOCK_G == 1:
                    ds_b = a * gb + rdz * qg_b - w * xb
                else:
                    ds_b = tl.sum(a * gb + rdz * qg_b, axis=0, keep_dims=True) - w * xb
                if ACCUMULATE:
                    ds_b += tl.load(base_ptr + at + col_b, mask=b_ok, other=0.0).to(tl.float32)
                tl.store(dsrc_ptr + at + col_b, ds_b.to(dsrc_ptr.dtype.element_ty), mask=b_ok & live)
            rdz = tl.where(live, rdz, 0.0)
            dqg_a += rdz * xa
            if HAS_B:
                dqg_b += rdz * xb

    part = dqg_part_ptr + pid.to(tl.int64) * (BLOCK_G + NORM) * D
    if WRITE_DQG:
        tl.store(part + k * D + col_a, dqg_a)
        if HAS_B:
            tl.store(part + k * D + col_b, dqg_b, mask=b_ok & (k >= 0))
    if NORM:
        tl.store(part + BLOCK_G * D + k * D + col_a, dnw_a)
        if HAS_B:
            tl.store(part + BLOCK_G * D + k * D + col_b, dnw_b, mask=b_ok & (k >= 0))


@triton.jit(do_not_specialize=["P"])
def _add_row_sums_kernel(part_ptr, out_ptr, P, D, stride_p, stride_g, stride_out, BLOCK_P: tl.constexpr,
                         BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    # Program (channel block, row g): out[g, c] += sum_p part[p, g, c], in a fixed order (deterministic).
    c = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = c < D
    rows = tl.arange(0, BLOCK_P)
    part = part_ptr + tl.program_id(1).to(tl.int64) * stride_g + c[None, :]
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for p0 in tl.range(0, P, BLOCK_P, num_stages=STAGES):
        p = p0 + rows
        acc += tl.load(part + p.to(tl.int64)[:, None] * stride_p, mask=(p < P)[:, None] & c_ok[None, :], other=0.0)
    out = out_ptr + tl.program_id(1).to(tl.int64) * stride_out + c
    tl.store(out, tl.load(out, mask=c_ok, other=0.0) + tl.sum(acc, axis=0), mask=c_ok)


@triton.jit
def _scored_source(src, rms, ok, offs_a, offs_b, b_ok, qg_a, qg_b, HAS_B: tl.constexpr):
    """One source for a tile of tokens: its [BLOCK_N, 1, .] blocks in fp32 and its scores z [BLOCK_N,
    BLOCK_G] for the program's sites, -inf where ``ok`` [BLOCK_N] is false (no such source, or past the
    last token)."""
    xa = tl.load(src + offs_a, mask=ok[:, None, None], other=0.0).to(tl.float32)
    z = tl.sum(xa * qg_a, axis=2)
    xb = xa
    if HAS_B:
        xb = tl.load(src + offs_b, mask=ok[:, None, None] & b_ok, other=0.0).to(tl.float32)
        z += tl.sum(xb * qg_b, axis=2)
    r = tl.load(rms, mask=ok, other=1.0)[:, None]
    return xa, xb, tl.where(ok[:, None], z * r, float("-inf"))


# The head-tiled pass's reductions' form (passes over few sources, heads too narrow for ``tl.dot``; the
# matrix products' form is ``_history_fwd_dot_kernel``). A tile is [BLOCK_N tokens, BLOCK_G sites, channels
# of one head]; a source is [BLOCK_N, 1, .] and broadcasts over the sites. Programs are persistent, each
# walking ``tiles_per_program`` consecutive token tiles of its head: the sites' query rows are loaded once a
# program, not once a tile (at few sources they were as many bytes as the sources), and the loop runs over
# (tile, SOURCES sources) pairs, so that the pipeline (``tl.range``: iteration i + STAGES - 1's sources are
# copied into shared memory while iteration i's are reduced) carries on from one tile into the next; a
# tile's first iteration starts the softmax afresh and its last stores the outputs. Its time follows the
# instructions it issues more than its bytes in flight (Nsight: "not selected" the largest stall), so an
# iteration takes SOURCES sources (2 or 4): the accumulators are rescaled once for all of them.
@triton.jit(do_not_specialize=["N", "S", "G", "tiles_per_program"])
def _history_fwd_kernel(
    src_ptr, rms_ptr, qg_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, tiles_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, SOURCES: tl.constexpr, PTX: tl.constexpr,
):
    head = tl.program_id(1)
    first_tile = tl.program_id(0).to(tl.int64) * tiles_per_program
    tn = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_G)[None, :, None]
    ja = tl.arange(0, DA)[None, None, :]
    jb = tl.arange(0, BLOCK_DB)[None, None, :]
    col_a = head * DH + ja
    col_b = head * DH + DA + jb
    b_ok = jb < DB
    k_ok = k < G
    qg_a = tl.load(qg_ptr + k * D + col_a, mask=k_ok, other=0.0)  # [1, BLOCK_G, DA]
    qg_b = qg_a
    if HAS_B:
        qg_b = tl.load(qg_ptr + k * D + col_b, mask=k_ok & b_ok, other=0.0)
    rest_offs = (k.to(tl.int64) - 1) * N * D
    kg = tl.arange(0, BLOCK_G)[None, :]

    m = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    acc_a = tl.zeros([BLOCK_N, BLOCK_G, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_DB], tl.float32)  # (a placeholder without HAS_B)
    stride = tl.cast(stride_s, tl.int64)  # SOURCES * stride_s may pass 2^31
    chunks = tl.cdiv(S, SOURCES)
    for it in tl.range(0, tiles_per_program * chunks, num_stages=STAGES):
        t = it // chunks
        j = it - t * chunks
        s0 = j * SOURCES
        n = (first_tile + t) * BLOCK_N + tn  # [BLOCK_N]; past the last token: loads masked, nothing stored
        n_ok = n < N
        nn = n[:, None, None]
        offs_a = nn * D + col_a  # [BLOCK_N, 1, DA]
        offs_b = nn * D + col_b
        src = src_ptr + s0 * stride
        rms = rms_ptr + s0.to(tl.int64) * N + n
        # Source s0 + i exists for the tile's tokens below a limit that is 0 when it does not (a tensor
        # mask: it works the same in the compiler and the interpreter).
        x1a, x1b, z1 = _scored_source(src, rms, n_ok, offs_a, offs_b, b_ok, qg_a, qg_b, HAS_B)
        x2a, x2b, z2 = _scored_source(src + stride, rms + N, n < tl.where(s0 + 1 < S, N, 0), offs_a, offs_b,
                                      b_ok, qg_a, qg_b, HAS_B)
        # A tile's first iteration starts afresh: exp(-inf) = 0 clears the sums carried from the tile before.
        m = tl.where(j == 0, float("-inf"), m)
        m_new = tl.maximum(m, tl.maximum(z1, z2))
        if SOURCES == 4:
            x3a, x3b, z3 = _scored_source(src + 2 * stride, rms + 2 * N, n < tl.where(s0 + 2 < S, N, 0), offs_a,
                                          offs_b, b_ok, qg_a, qg_b, HAS_B)
            x4a, x4b, z4 = _scored_source(src + 3 * stride, rms + 3 * N, n < tl.where(s0 + 3 < S, N, 0), offs_a,
                                          offs_b, b_ok, qg_a, qg_b, HAS_B)
            m_new = tl.maximum(m_new, tl.maximum(z3, z4))
        # A padded token's scores are all -inf: its m stays -inf and exp(m - m_new) would be NaN.
        m_new = tl.where(n_ok[:, None], m_new, 0.0)
        alpha = ptx.exp(m - m_new, PTX)
        p1 = ptx.exp(z1 - m_new, PTX)
        p2 = ptx.exp(z2 - m_new, PTX)
        l = l * alpha + p1 + p2
        acc_a = acc_a * alpha[:, :, None] + p1[:, :, None] * x1a + p2[:, :, None] * x2a
        if HAS_B:
            acc_b = acc_b * alpha[:, :, None] + p1[:, :, None] * x1b + p2[:, :, None] * x2b
        if SOURCES == 4:
            p3 = ptx.exp(z3 - m_new, PTX)
            p4 = ptx.exp(z4 - m_new, PTX)
            l += p3 + p4
            # one fused multiply-add a term (written as a sum of products, the compiler would not chain them)
            acc_a = acc_a + p3[:, :, None] * x3a
            acc_a = acc_a + p4[:, :, None] * x4a
            if HAS_B:
                acc_b = acc_b + p3[:, :, None] * x3b
                acc_b = acc_b + p4[:, :, None] * x4b
        m = m_new
        if j == chunks - 1:
            inv_l = 1.0 / l[:, :, None]
            row_ok = n_ok[:, None, None]
            out_a = (acc_a * inv_l).to(out0_ptr.dtype.element_ty)
            tl.store(out0_ptr + offs_a + k * 0, out_a, mask=row_ok & (k == 0))
            tl.store(rest_ptr + rest_offs + offs_a, out_a, mask=row_ok & (k > 0) & k_ok)
            if HAS_B:
                out_b = (acc_b * inv_l).to(out0_ptr.dtype.element_ty)
                tl.store(out0_ptr + offs_b + k * 0, out_b, mask=row_ok & (k == 0) & b_ok)
                tl.store(rest_ptr + rest_offs + offs_b, out_b, mask=row_ok & (k > 0) & k_ok & b_ok)
            kn = kg * N * H + n[:, None] * H + head  # [BLOCK_N, BLOCK_G]
            tl.store(lse_ptr + kn, m + tl.log(l), mask=n_ok[:, None] & (kg < G))


# The shared pass as matrix products. For one token and one head, G sites over S sources is a small
# attention: scores Z [G, S] = Q [G, head] X^T [head, S] (Q the sites' query rows, X the sources' rows)
# and outputs O [G, head] = softmax_S(Z r) X. A program walks its tokens and, for each, the sources in
# tiles of BLOCK_S rows (one tile when S <= BLOCK_S: ONE_TILE, no running softmax state), both products
# on tensor cores; the loop runs over (token, tile) pairs, so that the pipeline copies the next token's
# tiles while this one is reduced, and a token's last tile normalises and stores its outputs.
# An fp32 operand (the query rows, the weights) is split into hi + lo parts of the sources' dtype, so
# that the products carry about 16 bits of it (a weight rounded to bf16 alone moves an output by up to
# 2^-9 of a term). The two parts are the two halves of one product's rows, [hi of the HALF sites; lo of
# them], so that one product does both and the halves are summed inside each thread (``sum_halves``).
# fp32 sources take fp32 products, with lo = 0.
@triton.jit(do_not_specialize=["N", "S", "G", "tokens_per_program"])
def _history_fwd_dot_kernel(
    src_ptr, rms_ptr, qg_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, tokens_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr, ONE_TILE: tl.constexpr, PTX: tl.constexpr,
):
    head = tl.program_id(1)
    first_tok = tl.program_id(0).to(tl.int64) * tokens_per_program
    k = tl.arange(0, HALF)[:, None]  # [HALF, 1] site
    ja, jb, col_a, col_b, b_ok = head_columns(head, DH, DA, DB, BLOCK_DB)
    dt = src_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if dt == tl.float32 else "tf32"  # (tf32: ignored for 16-bit operands)
    q_a, q_b = query_operand(qg_ptr, G, D, HALF, col_a, col_b, b_ok, BLOCK_DB, HAS_B, dt)  # [2 HALF, .]
    si = tl.arange(0, BLOCK_S)
    if ONE_TILE:
        tiles = 1
    else:
        tiles = tl.cdiv(S, BLOCK_S)
    stride = tl.cast(stride_s, tl.int64)
    m = tl.full([HALF], float("-inf"), tl.float32)
    l = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([2 * HALF, DA], tl.float32)
    acc_b = tl.zeros([2 * HALF, BLOCK_DB], tl.float32)
    for it in tl.range(0, tokens_per_program * tiles, num_stages=STAGES):
        t = it // tiles
        j = it - t * tiles
        tok = first_tok + t
        row = tl.minimum(tok, N - 1) * D  # past the last token: recompute it, store nothing
        s = j * BLOCK_S + si  # [BLOCK_S] sources
        s_ok = s < S
        rows = s.to(tl.int64)[:, None] * stride + row
        x_a = tl.load(src_ptr + rows + col_a, mask=s_ok[:, None], other=0.0)  # [BLOCK_S, DA]
        u = tl.dot(q_a, tl.trans(x_a), input_precision=PREC)  # [2 HALF, BLOCK_S]
        x_b = x_a
        if HAS_B:
            x_b = tl.load(src_ptr + rows + col_b, mask=s_ok[:, None] & b_ok, other=0.0)
            u = tl.dot(q_b, tl.trans(x_b), u, input_precision=PREC)
        r = tl.load(rms_ptr + s.to(tl.int64) * N + row // D, mask=s_ok, other=0.0)
        z = tl.where(s_ok[None, :], sum_halves(u) * r[None, :], float("-inf"))  # [HALF, BLOCK_S]
        if ONE_TILE:
            m = tl.max(z, axis=1)
            p = ptx.exp(z - m[:, None], PTX)
            l = tl.sum(p, axis=1)
            p_hi, p_lo = split(p, dt)
            weights = stack_halves(p_hi, p_lo)
            acc_a = tl.dot(weights, x_a, input_precision=PREC)
            if HAS_B:
                acc_b = tl.dot(weights, x_b, input_precision=PREC)
        else:
            # A token's first tile starts the softmax afresh: exp(-inf) = 0 clears the accumulators.
            m = tl.where(j == 0, float("-inf"), m)
            m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: a tile holds at least one source
            alpha = ptx.exp(m - m_new, PTX)[:, None]
            p = ptx.exp(z - m_new[:, None], PTX)
            l = l * tl.reshape(alpha, [HALF]) + tl.sum(p, axis=1)
            alpha = stack_halves(alpha, alpha)  # [2 HALF, 1]
            p_hi, p_lo = split(p, dt)
            weights = stack_halves(p_hi, p_lo)
            acc_a = tl.dot(weights, x_a, acc_a * alpha, input_precision=PREC)
            if HAS_B:
                acc_b = tl.dot(weights, x_b, acc_b * alpha, input_precision=PREC)
            m = m_new
        if (j == tiles - 1) & (tok < N):
            inv_l = (1.0 / l)[:, None]
            at = tok * D
            rest = rest_ptr + (k.to(tl.int64) - 1) * N * D + at
            later = (k > 0) & (k < G)
            out_a = (sum_halves(acc_a) * inv_l).to(out0_ptr.dtype.element_ty)
            tl.store(out0_ptr + at + col_a + k * 0, out_a, mask=(k == 0) & (ja >= 0))
            tl.store(rest + col_a, out_a, mask=later & (ja >= 0))
            if HAS_B:
                out_b = (sum_halves(acc_b) * inv_l).to(out0_ptr.dtype.element_ty)
                tl.store(out0_ptr + at + col_b + k * 0, out_b, mask=(k == 0) & b_ok)
                tl.store(rest + col_b, out_b, mask=later & b_ok)
            kk = tl.arange(0, HALF)
            tl.store(lse_ptr + kk * N * H + tok * H + head, m + tl.log(l), mask=kk < G)


# The matrix products' form for few sources: the rows of one tile are several tokens' sources (T tokens of
# SP >= S rows each, T SP = 16 or 32 rows: ``stacked_tile``), so that a pass over a few sources fills the
# products that ``_history_fwd_dot_kernel`` would pad to 16 sources a token. Scores Z [sites, (t, s)] = Q X^T
# as there; each (site, token) takes the softmax over its own SP columns, and the outputs of a tile's T
# tokens are one product of a block-diagonal weight matrix W [(t, k), (t', s)] = [t = t'] p_k(t', s) with
# the tile's rows, [(t, k), head]: its accumulator holds T BLOCK_G rows, not twice HALF per token. The
# weights' fp32 goes in two products (hi, then lo, into one accumulator). A program (one warp) walks
# consecutive tiles of its head, the next tiles' rows copied into shared memory while one is reduced.
@triton.jit(do_not_specialize=["N", "S", "G", "tiles_per_program"])
def _history_fwd_stacked_kernel(
    src_ptr, rms_ptr, qg_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, tiles_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, SP: tl.constexpr, T: tl.constexpr,
    STAGES: tl.constexpr, PTX: tl.constexpr,
):
    head = tl.program_id(1)
    first_tile = tl.program_id(0).to(tl.int64) * tiles_per_program
    _, _, col_a, col_b, b_ok = head_columns(head, DH, DA, DB, BLOCK_DB)
    dt = src_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if dt == tl.float32 else "tf32"  # (tf32: ignored for 16-bit operands)
    q_a, q_b = query_operand(qg_ptr, G, D, BLOCK_G, col_a, col_b, b_ok, BLOCK_DB, HAS_B, dt)  # [2 BLOCK_G, .]
    # A tile's rows: token t = r // SP, source s = r % SP; their offsets in the first tile (a tile's are these
    # plus its first token's row).
    r = tl.arange(0, T * SP)
    r_tok = r // SP
    r_src = r % SP
    src_ok = r_src < S
    x_rows = src_ptr + (r_src.to(tl.int64) * stride_s + r_tok * D)[:, None]
    rms_rows = rms_ptr + r_src.to(tl.int64) * N + r_tok
    # The outputs' rows: token j // BLOCK_G, site j % BLOCK_G (site 0's in out0, the others' in rest).
    j = tl.arange(0, T * BLOCK_G)
    j_tok = j // BLOCK_G
    j_site = j % BLOCK_G
    out_rows = tl.where(j_site == 0, out0_ptr, rest_ptr + (j_site.to(tl.int64) - 1) * N * D) + j_tok * D
    lse_rows = lse_ptr + j_site.to(tl.int64) * N * H + j_tok * H + head
    live = j_site < G
    same = tl.arange(0, T)[:, None, None, None] == tl.arange(0, T)[None, None, :, None]  # [T, 1, T, 1]
    for it in tl.range(0, tiles_per_program, num_stages=STAGES):
        # The last tile ends at the last token (N >= T), so that no load needs a token mask; it stores only the
        # tokens from where it would have started (the tile before, perhaps another program's, stores the
        # others: its products sum them in another order), and tiles past it store nothing.
        start = (first_tile + it) * T
        tok0 = tl.minimum(start, N - T)
        x_a = tl.load(x_rows + tok0 * D + col_a, mask=src_ok[:, None], other=0.0)  # [T SP, DA]
        u = tl.dot(q_a, tl.trans(x_a), input_precision=PREC)  # [2 BLOCK_G, T SP]
        x_b = x_a
        if HAS_B:
            x_b = tl.load(x_rows + tok0 * D + col_b, mask=src_ok[:, None] & b_ok, other=0.0)
            u = tl.dot(q_b, tl.trans(x_b), u, input_precision=PREC)
        rs = tl.load(rms_rows + tok0, mask=src_ok, other=0.0)
        z = tl.where(src_ok[None, :], sum_halves(u) * rs[None, :], float("-inf"))  # [BLOCK_G, T SP]
        z = tl.reshape(z, [BLOCK_G, T, SP])
        m = tl.max(z, axis=2)  # (finite: a token has at least one source)
        p = ptx.exp(z - m[:, :, None], PTX)  # [BLOCK_G, T, SP]
        l = tl.sum(p, axis=2)  # [BLOCK_G, T]
        w = tl.reshape(tl.where(same, p[None, :, :, :], 0.0), [T * BLOCK_G, T * SP])
        w_hi, w_lo = split(w, dt)
        acc_a = tl.dot(w_hi, x_a, input_precision=PREC)  # [T BLOCK_G, DA]
        acc_a = tl.dot(w_lo, x_a, acc_a, input_precision=PREC)
        inv_l = tl.reshape(tl.trans(1.0 / l), [T * BLOCK_G])[:, None]
        at = out_rows + tok0 * D
        own = live & (tok0 + j_tok >= start)
        tl.store(at[:, None] + col_a, (acc_a * inv_l).to(out0_ptr.dtype.element_ty), mask=own[:, None])
        if HAS_B:
            acc_b = tl.dot(w_hi, x_b, input_precision=PREC)
            acc_b = tl.dot(w_lo, x_b, acc_b, input_precision=PREC)
            tl.store(at[:, None] + col_b, (acc_b * inv_l).to(out0_ptr.dtype.element_ty), mask=own[:, None] & b_ok)
        lse = tl.reshape(tl.trans(m + tl.log(l)), [T * BLOCK_G])
        tl.store(lse_rows + tok0 * H, lse, mask=own)


# ----------------------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------------------


def _block_g(groups: int) -> int:
    return triton.next_power_of_2(max(groups, 1))


# When set (benchmarks), the row kernels' warps. Measured on the H200: 2 or 8 warps instead of the rule's
# 4 were slower at every preset but `sites_fwd` at d = 1024 (0.933 against 0.961 ms a step).
ROW_WARPS: int | None = None
# The backward row kernel's launch by (model width, heads), for a site's prologue alone (S = 0) and with a
# source (S = 1, a block's partial sum): a cap on its registers a thread (0: none) and the tokens its loop
# keeps in flight (``num_stages``); other shapes take ROW_BWD_DEFAULT. Measured on the H200
# (benchmarks/bench_kernels.py --row-stages, a step's calls, docs/benchmarks.md "ninth round"): at
# d = 1280 (heads split 128 + 32) the partial-sum backward 2.86 ms with 2 stages, 2.45 with 3 (uncapped:
# 2.64, 2.54), the prologues 1.26 ms with 2 stages and a cap of 96 (1.25 with 160, 1.31-1.37 with 1 or 3
# stages or no cap); at d = 1024,
# 1.28 and 0.70 ms with 2 stages and no cap (3 stages 1.32 and 0.71, 1 stage 1.53 and 0.70).
ROW_BWD_CONFIG: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]] = {(1280, 8): ((96, 2), (128, 3))}
ROW_BWD_DEFAULT = (0, 2)
# The same for the sites whose sublayer's pre-norm the prologue's backward takes in (``Norm``, where a
# model's ``fold_norms`` says). Measured on the H200 for the first form of the kernel, whose norm took two
# levels of row sums (benchmarks/bench_kernels.py --norms, a step's calls, docs/benchmarks.md "seventeenth
# round"): it waited on its sums rather than on memory, and 3 stages without a cap were the fastest of 1-3
# stages and caps of 128 and 160 at d = 1024 and 1280 (at paper1b 2.04 ms for the prologues and 3.42 for the
# partial sums' backward, against 2.36 / 3.69 with the table's caps and 1.27 / 2.47 without the norm). The
# present form, which reads the norm's statistics and the partial sum's RMS from the forward, is not yet
# measured there.
ROW_BWD_NORM_CONFIG: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]] = {}
ROW_BWD_NORM_DEFAULT = (0, 3)
# When set (benchmarks): a cap on every row kernel's registers, the backward's stages.
ROW_MAXNREG: int | None = None
ROW_BWD_STAGES: int | None = None


def _num_warps(d: int, num_heads: int, block_g: int) -> int:
    """Warps per program of the row kernels (G = 1 in practice): about 8 elements of a [1, H, head] tile
    per thread, 4 warps at d = 1024 (the per-site kernel's measured best on the H200)."""
    if ROW_WARPS:
        return ROW_WARPS
    width = block_g * tile_width(d, num_heads)
    warps = max(1, width // (32 * 8))
    return min(32, 1 << (warps.bit_length() - 1))


# Launch configuration of the head-tiled kernel by the number of sites G (padded): tokens per program,
# warps, pipeline stages (iterations ahead), sources an iteration (2 or 4); "fwd_split" where a head is
# split in two blocks (a width that is not a power of two: with one token the rest block's loads are 2
# bytes a thread). Measured on the H200 at G = 4 (benchmarks/bench_kernels.py, a step's calls): d = 1024
# 2.70 ms (4 sources an iteration 2.93, two tokens 3.34), d = 512 1.02 ms, d = 1280 6.91 ms (one token
# 11.6); docs/benchmarks.md. A benchmark may replace entries to sweep them. On the interpreter: two-token
# tiles, so that tests cover the token mask.
HISTORY_CONFIG: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "fwd": {2: (1, 1, 3, 2), 4: (1, 1, 3, 2), 8: (1, 1, 3, 2), 16: (1, 2, 3, 2)},
    "fwd_split": {2: (2, 1, 3, 2), 4: (2, 1, 3, 2), 8: (2, 1, 3, 2), 16: (2, 2, 3, 2)},  # heads split in two
}
_INTERPRETER_CONFIG = (2, 1, 2, 2)
# Token tiles a program of the reductions' form walks, by model width (0: as many programs as fit on the GPU at
# once, the tiles shared among them); HISTORY_TILES, when set (benchmarks), overrides the table. Measured on the
# H200 (benchmarks/bench_kernels.py, block:4's shared passes of a step, docs/benchmarks.md "fifteenth round"),
# ms with 16 / 4 / 1 / 0 tiles, and for the earlier kernel (one tile a program, no loop over tiles): d = 512
# 0.353 / 0.368 / 0.540 / 0.367 against 0.507; d = 1024 0.742 / 0.743 / 0.895 / 0.851 against 0.770; d = 1280
# 1.685 / 1.796 / 2.187 / 1.658 against 1.609 (64 tiles: 2.44). full's passes (this form below 8 or 12 sources):
# within 1 % of the earlier kernel's at d = 1024 and 1280, 4 % faster at 512.
HISTORY_TILES_BY_WIDTH = {512: 16, 1024: 16, 1280: 0}
HISTORY_TILES: int | None = None


def _history_config(kind: str, block_g: int, device: torch.device) -> tuple[int, dict]:
    if device.type == "cpu":
        block_n, _, stages, sources = _INTERPRETER_CONFIG
        return block_n, {"STAGES": stages, "SOURCES": sources}
    block_n, warps, stages, sources = HISTORY_CONFIG[kind].get(block_g, HISTORY_CONFIG[kind][16])
    return block_n, {"num_warps": warps, "STAGES": stages, "SOURCES": sources}


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


def _norm_args(norm: Norm | None, placeholder: Tensor, out_placeholder: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A forward's (gain, normed output, statistics) pointers."""
    if norm is None:
        return placeholder, out_placeholder, placeholder
    return norm.weight, norm.out, norm.stats


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


# write_slot: tokens a program and warps, when set (benchmarks); else as many tokens as make 2,048 channels
# (4 KB of a bf16 buffer), 4 warps. Measured on the H200: at d = 512 four tokens 0.261 ms a step against
# 0.303 for one (75 against 65 % of copy); at d = 1024 and 1280, 1 to 8 tokens a program within 4 %.
WRITE_SLOT_CONFIG: tuple[int, int] | None = None


def write_slot(source: Tensor, slot: Tensor, rms: Tensor, eps: float, addend: Tensor | None = None) -> None:
    """Copy ``source`` (N, d), contiguous, into the buffer row ``slot`` (N, d), in the row's dtype, and
    write the RMS statistic ``rsqrt(mean(x^2) + eps)`` of each stored row to ``rms`` (N,) fp32. With
    ``addend`` (N, d), contiguous, the row written is ``source + addend`` (a block's last output added to
    its partial sum without a kernel of its own)."""
    N, d = slot.shape
    if N:
        block_d = triton.next_power_of_2(d)
        tokens, warps = WRITE_SLOT_CONFIG or (max(1, 2048 // block_d), 4)
        meta = {"D": d, "BLOCK_D": block_d, "BLOCK_T": tokens, "ADD": addend is not None}
        if slot.device.type != "cpu":
            meta["num_warps"] = warps
        args = (source, addend if addend is not None else source, slot, rms, N, eps)
        launch(_write_slot_kernel, (triton.cdiv(N, tokens),), args, meta, slot.device)


def sites_forward(sources: Tensor, qg: Tensor, num_heads: int, eps: float, out: Tensor, rest: Tensor | None,
                  lse: Tensor, init: Tensor | None = None, rms: Tensor | None = None,
                  addend: Tensor | None = None, sum_out: Tensor | None = None,
                  norm: Norm | None = None, rms_out: Tensor | None = None) -> None:
    """Route ``sources`` (S, N, d), contiguous, for the G sites whose fused query·key-gain rows are ``qg``
    (G, d) fp32, a whole row at a time (a merge of one site with at most MERGE_MAX_S sources, at the shapes in
    MERGE_CONFIG, in ``_merge_fwd_kernel``; else one token a program). Writes site 0's normalised output to
    ``out`` (N, d), site k's to ``rest[k - 1]`` and every site's log-sum-exp to ``lse`` (G, N, H) fp32. With
    ``init`` (G, N, d) the sites continue from that partial state, whose log-sum-exps are read from ``lse``
    first (in place).
    ``rms`` (S, N): the sources' RMS statistics, if known (else reduced from the rows, and written to
    ``rms_out`` (S, N) fp32 if given, for ``sites_backward``: a block's partial sum). With ``addend``
    (N, d) and ``sum_out`` (N, d), both contiguous, and one source: the source routed is ``sources[0] +
    addend``, rounded to ``sum_out``'s dtype and written there. With ``norm`` (one site) the output's
    pre-norm is written to ``norm.out`` as well."""
    S, N, d = sources.shape
    G = qg.shape[0]
    if (addend is None) != (sum_out is None) or (addend is not None and (S != 1 or rms is not None)):
        raise ValueError("sites_forward: addend and sum_out go together, with one source and no rms")
    if norm is not None and G != 1:
        raise ValueError("sites_forward: a pre-norm is written for one site only")
    if rms is not None and rms_out is not None:
        raise ValueError("sites_forward: rms_out keeps the statistics reduced from the rows, without rms")
    if N == 0:
        return
    if init is not None and G == 1 and 1 <= S <= MERGE_MAX_S and (d, num_heads) in MERGE_CONFIG:
        _merge_forward(sources, qg, num_heads, eps, out, lse, init, rms, addend, sum_out, norm, rms_out)
        return
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCK_G": _block_g(G), "HAS_INIT": init is not None,
            "USE_RMS": rms is not None, "KEEP_RMS": rms_out is not None, "ADD": addend is not None,
            "NORM": norm is not None}
    if sources.device.type != "cpu":
        meta["num_warps"] = _num_warps(d, num_heads, meta["BLOCK_G"])
        if ROW_MAXNREG:
            meta["maxnreg"] = ROW_MAXNREG
    args = (sources, _first(rms, rms_out, qg), qg, init if init is not None else out, out,
            rest if rest is not None else out, lse, addend if addend is not None else out,
            sum_out if sum_out is not None else out, *_norm_args(norm, qg, out), N, S, G, N * d, eps,
            norm.eps if norm is not None else 0.0)
    launch(_sites_fwd_kernel, (N,), args, meta, sources.device)


# The merges' kernel (``_merge_fwd_kernel``) takes up to MERGE_MAX_S sources (unrolled: each count is a kernel
# of its own; training takes 1 to sites_per_pass - 1), at the (model width, heads) in MERGE_CONFIG, launched
# with its (warps, pipeline stages); other shapes merge in ``_sites_fwd_kernel``, one token a program.
# Measured on the H200 (benchmarks/bench_kernels.py, a step's calls, docs/benchmarks.md "fifteenth round"):
# at d = 1280 (heads split 128 + 32) block:4's merges 1.86 ms with (4, 2) against 2.11 in the row kernel
# (full's: 1.78 against 2.08; 3 stages 1.91 / 1.82, 4 stages 2.14 / 1.93, 2 or 8 warps slower); at d = 1024
# and 512 the row kernel was as fast or faster (block:4's 0.92 against 0.97 ms at paper350m, 0.48 against
# 0.51 at paper100m).
MERGE_MAX_S = 4
MERGE_CONFIG: dict[tuple[int, int], tuple[int, int]] = {(1280, 8): (4, 2)}


def _merge_forward(sources: Tensor, qg: Tensor, num_heads: int, eps: float, out: Tensor, lse: Tensor, init: Tensor,
                   rms: Tensor | None, addend: Tensor | None, sum_out: Tensor | None, norm: Norm | None,
                   rms_out: Tensor | None) -> None:
    S, N, d = sources.shape
    meta = {**head_meta(d, num_heads, has_b=True), "S": S, "USE_RMS": rms is not None, "KEEP_RMS": rms_out is not None,
            "ADD": addend is not None, "NORM": norm is not None}
    warps, meta["STAGES"] = MERGE_CONFIG[d, num_heads]
    if sources.device.type != "cpu":
        meta["num_warps"] = warps
    args = [sources, _first(rms, rms_out, qg), qg, init, out, lse, addend if addend is not None else out,
            sum_out if sum_out is not None else out, *_norm_args(norm, qg, out), N, N * d, eps,
            norm.eps if norm is not None else 0.0, 1]
    programs = persistent_programs(_merge_fwd_kernel, args, meta, sources.device, N)
    args[-1] = triton.cdiv(N, programs)
    launch(_merge_fwd_kernel, (programs,), tuple(args), meta, sources.device)


# The matrix-product form of the shared pass (``_history_fwd_dot_kernel``), used where a head's blocks are
# wide enough for ``tl.dot``: tokens a program, warps, pipeline stages, and the most sources a tile (a
# tile is the next power of two >= S, at least 16, up to that). None (benchmarks): the reductions' form
# everywhere. Measured on the H200 (benchmarks/bench_history.py, G = 4, docs/benchmarks.md "tenth
# round"): 76-85 % of copy at S = 16, 32 and 64 against 36-50 % for the reductions, and within 8 % of the
# best of five configurations at every S measured. On the interpreter:
# three tokens a program, so that tests walk a program's token loop and a last program past the last token.
HISTORY_DOT_CONFIG: tuple[int, int, int, int] | None = (32, 1, 3, 32)
_INTERPRETER_DOT_CONFIG = (3, 1, 1, 16)
# From how many sources the products' form is used, for heads of a power-of-two width and for split heads:
# a tile is at least 16 sources, and below these counts the reductions' form measured faster (at S = 4:
# 0.070 against 0.089 ms at paper350m; at S = 8 with the split head of paper1b, 0.117 against 0.121).
HISTORY_DOT_MIN_S = (8, 12)


def _history_dot_forward(sources: Tensor, rms: Tensor, qg: Tensor, meta: dict, out: Tensor, rest: Tensor,
                         lse: Tensor) -> None:
    S, N, d = sources.shape
    G = qg.shape[0]
    cpu = sources.device.type == "cpu"
    tokens, warps, stages, max_s = _INTERPRETER_DOT_CONFIG if cpu else HISTORY_DOT_CONFIG
    block_s = min(max_s, max(16, triton.next_power_of_2(S)))
    meta.update(HALF=max(8, _block_g(G)), BLOCK_S=block_s, STAGES=stages, ONE_TILE=S <= block_s,
                PTX=ptx.use_ptx(sources.device))
    if not cpu:
        meta["num_warps"] = warps
    launch(_history_fwd_dot_kernel, (triton.cdiv(N, tokens), meta["H"]),
           (sources, rms, qg, out, rest, lse, N, S, G, N * d, tokens), meta, sources.device)


# The stacked products' form (``_history_fwd_stacked_kernel``), where a head's blocks are wide enough for
# ``tl.dot``, for passes over at most half as many sources as a tile has rows (so that a tile holds at least two
# tokens' sources; a pass over more, or over fewer tokens than a tile holds, takes the matrix products' or the
# reductions' form): tokens a program, warps, pipeline stages, rows a tile (16 or 32). None: not used.
# Compiled for sm_90 (benchmarks/kernel_resources.py --only stacked; docs/benchmarks.md "nineteenth round"),
# with 16 rows its loop issues 0.13-0.15 instructions a byte read, a warp, at d = 1024 and 1280 against the
# reductions' form's 0.84 and 0.64 (0.19-0.22 against 1.15 at d = 512); 32 rows 0.10-0.11 there, with 196-255
# registers. Measured on the H200 in training steps (docs/benchmarks.md "twentieth round"): block:4's shared
# passes at paper1b 1.7 -> 1.2 ms a step (0.9 in this form, 0.3 for the pass over 9 sources, which takes the
# reductions'); the step, block:4 against the compiled baseline with --rounds 11: 0.987x against 0.977x at
# paper350m, 0.976x against 0.974x at paper1b with the norms folded. On the interpreter: two tiles a program,
# so that tests walk a program's tiles and a last tile that overlaps the one before.
HISTORY_STACKED_CONFIG: tuple[int, int, int, int] | None = (32, 1, 3, 16)
_INTERPRETER_STACKED_TILES = 2


def stacked_tile(S: int, block_g: int, rows: int) -> tuple[int, int]:
    """The stacked form's tile of ``rows`` rows for S sources and ``block_g`` (padded) sites: tokens T and rows a
    token SP, T SP = rows, SP >= S, T block_g <= 16 accumulator rows."""
    tokens = max(1, min(16 // block_g, rows // triton.next_power_of_2(max(S, 1))))
    return tokens, rows // tokens


def stacked_fits(S: int, N: int, block_g: int, meta: dict) -> bool:
    """Whether a pass over S sources, N tokens and ``block_g`` sites takes the stacked products' form."""
    if HISTORY_STACKED_CONFIG is None or not products_fit(meta) or block_g > 16:
        return False
    rows = HISTORY_STACKED_CONFIG[3]
    return 1 <= S <= rows // 2 and N >= stacked_tile(S, block_g, rows)[0]


def _history_stacked_forward(sources: Tensor, rms: Tensor, qg: Tensor, meta: dict, out: Tensor, rest: Tensor,
                             lse: Tensor) -> None:
    S, N, d = sources.shape
    G = qg.shape[0]
    block_g = _block_g(G)
    per_program, warps, stages, rows = HISTORY_STACKED_CONFIG
    tokens, per_token = stacked_tile(S, block_g, rows)
    if sources.device.type == "cpu":
        tiles_per_program, stages = _INTERPRETER_STACKED_TILES, 1
    else:
        tiles_per_program = max(1, per_program // tokens)
        meta["num_warps"] = warps
    meta.update(BLOCK_G=block_g, T=tokens, SP=per_token, STAGES=stages, PTX=ptx.use_ptx(sources.device))
    programs = triton.cdiv(triton.cdiv(N, tokens), tiles_per_program)
    launch(_history_fwd_stacked_kernel, (programs, meta["H"]),
           (sources, rms, qg, out, rest, lse, N, S, G, N * d, tiles_per_program), meta, sources.device)


def history_forward(sources: Tensor, rms: Tensor, qg: Tensor, num_heads: int, out: Tensor, rest: Tensor,
                    lse: Tensor) -> None:
    """``sites_forward`` for G > 1 sites, tiled by head: reads the sources' RMS from ``rms`` (S, N)."""
    S, N, d = sources.shape
    G = qg.shape[0]
    if N == 0:
        return
    block_g = _block_g(G)
    meta = head_meta(d, num_heads, has_b=True)
    if stacked_fits(S, N, block_g, meta):
        _history_stacked_forward(sources, rms, qg, meta, out, rest, lse)
        return
    if HISTORY_DOT_CONFIG is not None and products_fit(meta) and S >= max(1, HISTORY_DOT_MIN_S[meta["HAS_B"]]):
        _history_dot_forward(sources, rms, qg, meta, out, rest, lse)
        return
    block_n, options = _history_config("fwd_split" if meta["HAS_B"] else "fwd", block_g, sources.device)
    meta.update(BLOCK_G=block_g, BLOCK_N=block_n, PTX=ptx.use_ptx(sources.device), **options)
    tiles = triton.cdiv(N, block_n)
    args = [sources, rms, qg, out, rest, lse, N, S, G, N * d, 1]
    if sources.device.type == "cpu":  # a few programs, so that tests walk a program's tiles and an idle tail
        programs = min(tiles, 3)
    elif (per_program := HISTORY_TILES if HISTORY_TILES is not None else by_width(HISTORY_TILES_BY_WIDTH, d)):
        programs = triton.cdiv(tiles, per_program)
    else:  # as many as fit on the GPU at once, shared among the heads
        programs = max(1, persistent_programs(_history_fwd_kernel, args, meta, sources.device, tiles * num_heads)
                       // num_heads)
    args[-1] = triton.cdiv(tiles, programs)
    launch(_history_fwd_kernel, (programs, num_heads), tuple(args), meta, sources.device)


def sites_backward(sources: Tensor, grad_sources: Tensor, base: Tensor | None, qg: Tensor, num_heads: int,
                   eps: float, grad_out: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None = None,
                   grad_copy: Tensor | None = None, record: tuple[Tensor, int] | None = None,
                   dqg: Tensor | None = None, norm: Norm | None = None, rms: Tensor | None = None) -> Tensor | None:
    """Gradients of ``sources`` (S, N, d) summed over G sites, a whole row per program, written to
    ``grad_sources`` (same layout), plus ``base`` if given (same layout; ``grad_sources`` itself adds in
    place). The sites' ``qg`` gradients are added to ``dqg`` (G, d) fp32 if given; else returned as the
    per-program partial sums (programs, G', d) fp32 (G' >= G: sum over programs, keep G rows). Returns
    None when S = 0 or ``dqg`` is given.

    ``grad_out`` (G, N, d), ``lse`` and ``delta`` (G, N, H) fp32 describe the sites. With ``out`` (one
    site's output, G = 1) ``delta`` is computed from it and written, and ``grad_out`` is copied into
    ``grad_copy`` if given. ``record`` (a one-element int64 tensor and a value): the value is stored there, on
    the device (the site's output-gradient offset in the step's ``grad_rows.GradRows``). S may be 0: then
    only that prologue runs. S is compiled into the kernel (its sources unrolled), so each source count is a
    kernel of its own; training takes 0 and 1. ``rms`` (S, N) fp32: the sources' RMS statistics as the
    forward used them (``sites_forward``'s ``rms_out``), if kept (else reduced from the rows again).

    With ``norm`` (one site; ``out``, ``grad_copy`` and ``dqg`` given, ``dqg`` (2, d) with a second row for
    the gain's gradient): ``grad_out`` is the gradient of the site's output after the sublayer's pre-norm;
    the output's own gradient is made from it in the pass, used for the rest and written to ``grad_copy``
    (which may be ``grad_out`` itself), and the gain's gradient is added to ``dqg[1]``.
    """
    S, N, d = sources.shape
    G = qg.shape[0]
    block_g = _block_g(G)
    if norm is not None and (G != 1 or out is None or grad_copy is None or dqg is None or dqg.shape[0] != 2):
        raise ValueError("sites_backward: a pre-norm's backward takes one site, its output, a grad_copy and a "
                         "dqg of two rows")
    if N == 0:
        return None if S == 0 or dqg is not None else torch.zeros((1, block_g, d), dtype=torch.float32,
                                                                   device=sources.device)
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCK_G": block_g, "ACCUMULATE": base is not None,
            "COMPUTE_DELTA": out is not None, "COPY_GRAD": grad_copy is not None, "RECORD": record is not None,
            "WRITE_DQG": S > 0, "NORM": norm is not None, "USE_RMS": rms is not None, "S": S}
    table, default = (ROW_BWD_CONFIG, ROW_BWD_DEFAULT) if norm is None else (ROW_BWD_NORM_CONFIG, ROW_BWD_NORM_DEFAULT)
    cap, meta["STAGES"] = table.get((d, num_heads), (default,) * 2)[S > 0]
    if ROW_BWD_STAGES:
        meta["STAGES"] = ROW_BWD_STAGES
    if sources.device.type != "cpu":
        meta["num_warps"] = _num_warps(d, num_heads, block_g)
        if ROW_MAXNREG or cap:
            meta["maxnreg"] = ROW_MAXNREG or cap
    table, value = record if record is not None else (delta, 0)
    rows = block_g + (norm is not None)  # each program's partial sums: the qg ones, then the gain's
    args = [sources, grad_sources, base if base is not None else grad_sources, qg, grad_out, lse, delta,
            out if out is not None else grad_out, grad_copy if grad_copy is not None else grad_out, table,
            torch.empty((1, rows, d), dtype=torch.float32, device=sources.device),
            norm.weight if norm is not None else qg, norm.stats if norm is not None else qg, _first(rms, qg),
            N, G, N * d, eps, norm.eps if norm is not None else 0.0, 1, value]
    programs = persistent_programs(_sites_bwd_kernel, args, meta, sources.device, N)
    partials = torch.empty((programs if S or norm is not None else 1, rows, d), dtype=torch.float32,
                           device=sources.device)
    args[10], args[-2] = partials, triton.cdiv(N, programs)  # (the tokens a program: the last but one)
    launch(_sites_bwd_kernel, (programs,), tuple(args), meta, sources.device)
    if norm is not None:  # the programs' rows: the qg sums (written with a source), then the gain's
        add_row_sums(partials if S else partials[:, 1:], dqg if S else dqg[1:])
        return None
    if not S:
        return None
    if dqg is None:
        return partials
    add_row_sums(partials[:, :G], dqg)
    return None


# add_row_sums: rows a tile, channels a program, warps, pipeline stages. Its input is a persistent kernel's
# partial sums, one row per program (1,056 at d = 1024 on the H200), just written and in L2. Measured there
# (benchmarks/bench_row_sums.py, a step's calls replayed from a CUDA graph): 2.8 us a call at d = 1024,
# 3.9 at d = 512, 2.4 at d = 1280, against 9.0-9.9 for torch's sum and add; (128, 16, 4, 3) 3.0 / 4.3 / 2.4.
ROW_SUM_CONFIG = (256, 16, 4, 3)


def add_row_sums(parts: Tensor, out: Tensor) -> None:
    """``out += parts.sum(0)``: ``parts`` (P, G, d) fp32, contiguous in its last dimension, into ``out``
    (G, d) fp32 (rows may be strided), in one kernel where torch takes two (``ROW_SUM_CONFIG``)."""
    P, G, d = parts.shape
    if out.shape != (G, d) or out.dtype != torch.float32 or parts.dtype != torch.float32 or out.stride(1) != 1 \
            or parts.stride(2) != 1:
        raise ValueError(f"add_row_sums: parts (P, G, d) and out (G, d), fp32 with contiguous channels; got "
                         f"{tuple(parts.shape)} {parts.dtype} and {tuple(out.shape)} {out.dtype}")
    if P == 0 or G == 0 or d == 0:
        return
    block_p, block_d, warps, stages = ROW_SUM_CONFIG if parts.device.type != "cpu" else (4, 16, 1, 1)
    meta = {"BLOCK_P": block_p, "BLOCK_D": block_d, "STAGES": stages}
    if parts.device.type != "cpu":
        meta["num_warps"] = warps
    launch(_add_row_sums_kernel, (triton.cdiv(d, block_d), G),
           (parts, out, P, d, parts.stride(0), parts.stride(1), out.stride(0)), meta, parts.device)
