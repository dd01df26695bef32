"""The per-site backward a whole row at a time (``sites_backward``, ``_sites_bwd_kernel``): the gradients of
the sources a site reads beyond the buffer (a block's partial sum) and of its query row, a site's ``delta =
<g, out>`` for the slots' backward (``column``), where its output gradient lies (or a copy of it), and, with
a folded pre-norm (``Norm``), the output's own gradient and the gain's. The qg partial sums of the
programs are added by ``row_sums.add_row_sums``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import head_meta, launch, persistent_programs
from . import config
from .common import Norm, _block_g, _first, _num_warps
from .row_sums import add_row_sums


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
    table, default = ((config.ROW_BWD_CONFIG, config.ROW_BWD_DEFAULT) if norm is None
                      else (config.ROW_BWD_NORM_CONFIG, config.ROW_BWD_NORM_DEFAULT))
    cap, meta["STAGES"] = table.get((d, num_heads), (default,) * 2)[S > 0]
    if config.ROW_BWD_STAGES:
        meta["STAGES"] = config.ROW_BWD_STAGES
    if sources.device.type != "cpu":
        meta["num_warps"] = _num_warps(d, num_heads, block_g)
        if config.ROW_MAXNREG or cap:
            meta["maxnreg"] = config.ROW_MAXNREG or cap
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
