"""The sites' forward a whole row at a time (``sites_forward``): one token a program over a site's (or a few
sites') sources (``_sites_fwd_kernel``), and a site's merge of its partial state with the few sources it reads
beyond its group's history, in a kernel whose programs walk many tokens (``_merge_fwd_kernel``, where
``config.MERGE_CONFIG`` says). The RMS of a source is computed from the row unless given."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ..launch import head_meta, launch, persistent_programs
from . import config
from .common import Norm, _block_g, _first, _normed, _num_warps, _softmax_step


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


def _norm_args(norm: Norm | None, placeholder: Tensor, out_placeholder: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A forward's (gain, normed output, statistics) pointers."""
    if norm is None:
        return placeholder, out_placeholder, placeholder
    return norm.weight, norm.out, norm.stats


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
    if init is not None and G == 1 and 1 <= S <= config.MERGE_MAX_S and (d, num_heads) in config.MERGE_CONFIG:
        _merge_forward(sources, qg, num_heads, eps, out, lse, init, rms, addend, sum_out, norm, rms_out)
        return
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCK_G": _block_g(G), "HAS_INIT": init is not None,
            "USE_RMS": rms is not None, "KEEP_RMS": rms_out is not None, "ADD": addend is not None,
            "NORM": norm is not None}
    if sources.device.type != "cpu":
        meta["num_warps"] = _num_warps(d, num_heads, meta["BLOCK_G"])
        if config.ROW_MAXNREG:
            meta["maxnreg"] = config.ROW_MAXNREG
    args = (sources, _first(rms, rms_out, qg), qg, init if init is not None else out, out,
            rest if rest is not None else out, lse, addend if addend is not None else out,
            sum_out if sum_out is not None else out, *_norm_args(norm, qg, out), N, S, G, N * d, eps,
            norm.eps if norm is not None else 0.0)
    launch(_sites_fwd_kernel, (N,), args, meta, sources.device)


def _merge_forward(sources: Tensor, qg: Tensor, num_heads: int, eps: float, out: Tensor, lse: Tensor, init: Tensor,
                   rms: Tensor | None, addend: Tensor | None, sum_out: Tensor | None, norm: Norm | None,
                   rms_out: Tensor | None) -> None:
    S, N, d = sources.shape
    meta = {**head_meta(d, num_heads, has_b=True), "S": S, "USE_RMS": rms is not None, "KEEP_RMS": rms_out is not None,
            "ADD": addend is not None, "NORM": norm is not None}
    warps, meta["STAGES"] = config.MERGE_CONFIG[d, num_heads]
    if sources.device.type != "cpu":
        meta["num_warps"] = warps
    args = [sources, _first(rms, rms_out, qg), qg, init, out, lse, addend if addend is not None else out,
            sum_out if sum_out is not None else out, *_norm_args(norm, qg, out), N, N * d, eps,
            norm.eps if norm is not None else 0.0, 1]
    programs = persistent_programs(_merge_fwd_kernel, args, meta, sources.device, N)
    args[-1] = triton.cdiv(N, programs)
    launch(_merge_fwd_kernel, (programs,), tuple(args), meta, sources.device)
