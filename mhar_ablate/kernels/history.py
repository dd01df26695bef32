"""Triton kernels for routing several sites in one pass over a shared history of sources.

The per-site op (``mhar_triton``) reads all S sources of a token for one site. In a routed decoder the
queries are parameters, not functions of the token, so the G consecutive sites of a group can share one
pass over the sources that were complete when the group began ("the history"): the forward computes the
G partial softmax states at once, and each site then merges its partial state with the few sources
produced inside the group (an online-softmax merge, exact). The backward pass over the history is also
shared: once all G sites have their output gradients, one pass reads each history source once and writes
(or adds) its gradient, the sum of the G sites' contributions. History bytes drop by a factor G. With
G = 1 (the decoder's default, see ``model/residual/fused.py``) these are per-site kernels that read the
source buffer in place and add source gradients into a gradient buffer.

Two kernels, each one token per program (the tile of a token is [G, H, head width]):

* ``_sites_fwd_kernel``: for G sites over S sources laid out ``stride_s`` apart (a contiguous range of
  the decoder's source buffer), the normalised partial output and the log-sum-exp of each site; it can
  start from an earlier partial state (``HAS_INIT``: the merge step, G = 1) instead of an empty one.
* ``_sites_bwd_kernel`` (persistent): the gradient of the S sources summed over G sites, written or
  added to a gradient buffer (``ACCUMULATE``), and the per-program partial sums of each site's ``qg``
  gradient (deterministic: summed by torch afterwards, no atomics). With ``COMPUTE_DELTA`` (G = 1) it
  first computes the site's ``delta = <g, out>`` per head and copies the output gradient into the
  group's stack, where the shared history pass reads both later.

The gradient of a site's full output with respect to a history source depends only on the site's full
softmax (its final log-sum-exp) and ``delta``, not on how the sum was split into history and merge, so the
history pass needs no partial state from the forward (math as in ``mhar_triton``, per site k):

    a_k = exp(r u_k - lse_k),  dz_k = a_k (<g_k, s> - delta_k)
    ds  = sum_k [a_k g_k + dz_k r qg_k] - (r^3 s / d) sum_k sum_h dz_k,h u_k,h,   dqg_k += dz_k r s

Heads whose width is not a power of two are split into a power-of-two part (DA) and a rest (DB, padded
to BLOCK_DB), as in ``mhar_triton``; on CPU tensors the kernels run through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .mhar_triton import _head_meta, _launch, _num_sms, _resident_programs

__all__ = ["sites_forward", "sites_backward"]


# Counts are not specialised on (S == 1, N % 16, ...): every site's S differs, and each specialisation would
# be one more compilation, paid inside the first training steps. The rest part of a head (DB channels) is
# compiled in only when the head width is not a power of two (HAS_B), so that power-of-two widths carry no
# empty loads, masks or reductions.
@triton.jit(do_not_specialize=["N", "S", "G"])
def _sites_fwd_kernel(
    src_ptr, qg_ptr, init_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, HAS_INIT: tl.constexpr,
):
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
    for s in range(S):
        xa = next_a.to(tl.float32)
        # Issue the loads of source s + 1 before reducing source s (see mhar_triton: the pipeliner does not
        # stage loads that feed no dot).
        next_a = tl.load(src + stride_s + col_a, mask=ja < tl.where(s + 1 < S, DA, 0), other=0.0)
        ss = tl.sum(tl.sum(tl.sum(xa * xa, axis=2), axis=1), axis=0)
        z = tl.sum(xa * qg_a, axis=2)  # [BLOCK_G, H]
        if HAS_B:
            xb = next_b.to(tl.float32)
            next_b = tl.load(src + stride_s + col_b, mask=jb < tl.where(s + 1 < S, DB, 0), other=0.0)
            ss += tl.sum(tl.sum(tl.sum(xb * xb, axis=2), axis=1), axis=0)
            z += tl.sum(xb * qg_b, axis=2)
        src += stride_s
        r = 1.0 / tl.sqrt(ss / D + eps)
        z = z * r
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        l = l * alpha + p
        acc_a = acc_a * alpha[:, :, None] + p[:, :, None] * xa
        if HAS_B:
            acc_b = acc_b * alpha[:, :, None] + p[:, :, None] * xb
        m = m_new

    inv_l = 1.0 / l[:, :, None]
    # Site 0's output goes to its own tensor (it may be kept for backward while the other partial states
    # are dropped after their merge); sites 1.. go to ``rest``, site k at row k - 1.
    first = k == 0
    rest_row = (k.to(tl.int64) - 1) * N * D + row
    later = (k > 0) & k_ok
    out_a = (acc_a * inv_l).to(out0_ptr.dtype.element_ty)
    tl.store(out0_ptr + row + col_a + k * 0, out_a, mask=first)
    tl.store(rest_ptr + rest_row + col_a, out_a, mask=later)
    if HAS_B:
        out_b = (acc_b * inv_l).to(out0_ptr.dtype.element_ty)
        tl.store(out0_ptr + row + col_b + k * 0, out_b, mask=first & b_ok)
        tl.store(rest_ptr + rest_row + col_b, out_b, mask=later & b_ok)
    tl.store(lse_ptr + kh, m + tl.log(l), mask=kh_ok)


@triton.jit(do_not_specialize=["N", "S", "G", "tokens_per_program"])
def _sites_bwd_kernel(
    src_ptr, dsrc_ptr, qg_ptr, g_ptr, lse_ptr, delta_ptr, out_ptr, gcopy_ptr, dqg_part_ptr,
    N, S, G, stride_s, eps, tokens_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, ACCUMULATE: tl.constexpr,
    COMPUTE_DELTA: tl.constexpr,
):
    # Persistent: program p walks tokens p, p + P, ... so that the qg-gradient partial sums are one
    # [BLOCK_G, D] row per program, not per token.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
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
    if HAS_B:
        qg_b = tl.load(qg_ptr + k * D + col_b, mask=k_ok & b_ok, other=0.0)
        dqg_b = tl.zeros([BLOCK_G, H, BLOCK_DB], tl.float32)

    for i in range(tokens_per_program):
        tok = (pid + i * num_programs).to(tl.int64)
        # Past the last token the program recomputes token N - 1 and stores nothing: no masks on loads.
        # (``live`` has shape [1], not a scalar: the interpreter takes no scalar in a combined mask.)
        live = (tok + tl.zeros([1], tl.int64)) < N
        tok = tl.minimum(tok, N - 1)
        row = tok * D
        site_row = k.to(tl.int64) * N * D + row
        kh = tl.arange(0, BLOCK_G)[:, None] * N * H + tok * H + tl.arange(0, H)[None, :]
        ga = tl.load(g_ptr + site_row + col_a, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_B:
            gb = tl.load(g_ptr + site_row + col_b, mask=k_ok & b_ok, other=0.0).to(tl.float32)
        # padded sites get lse = +inf, hence weight 0 and no gradient
        lse = tl.load(lse_ptr + kh, mask=kh_ok, other=float("inf"))
        if COMPUTE_DELTA:
            oa = tl.load(out_ptr + row + col_a).to(tl.float32)
            delta = tl.sum(ga * oa, axis=2)  # [BLOCK_G, H]
            tl.store(gcopy_ptr + site_row + col_a, ga.to(gcopy_ptr.dtype.element_ty), mask=k_ok & live)
            if HAS_B:
                ob = tl.load(out_ptr + row + col_b, mask=b_ok, other=0.0).to(tl.float32)
                delta += tl.sum(gb * ob, axis=2)
                tl.store(gcopy_ptr + site_row + col_b, gb.to(gcopy_ptr.dtype.element_ty), mask=k_ok & b_ok & live)
            tl.store(delta_ptr + kh, delta, mask=kh_ok & live)
        else:
            delta = tl.load(delta_ptr + kh, mask=kh_ok, other=0.0)

        src = src_ptr + row
        dsrc = dsrc_ptr + row
        next_a = tl.load(src + col_a, mask=ja < tl.where(S > 0, DA, 0), other=0.0)
        if HAS_B:
            next_b = tl.load(src + col_b, mask=jb < tl.where(S > 0, DB, 0), other=0.0)
        for s in range(S):
            xa = next_a.to(tl.float32)
            next_a = tl.load(src + stride_s + col_a, mask=ja < tl.where(s + 1 < S, DA, 0), other=0.0)
            if ACCUMULATE:
                prev_a = tl.load(dsrc + col_a).to(tl.float32)
            ss = tl.sum(tl.sum(tl.sum(xa * xa, axis=2), axis=1), axis=0)
            u = tl.sum(xa * qg_a, axis=2)  # [BLOCK_G, H]
            da = tl.sum(ga * xa, axis=2)
            if HAS_B:
                xb = next_b.to(tl.float32)
                next_b = tl.load(src + stride_s + col_b, mask=jb < tl.where(s + 1 < S, DB, 0), other=0.0)
                if ACCUMULATE:
                    prev_b = tl.load(dsrc + col_b, mask=b_ok, other=0.0).to(tl.float32)
                ss += tl.sum(tl.sum(tl.sum(xb * xb, axis=2), axis=1), axis=0)
                u += tl.sum(xb * qg_b, axis=2)
                da += tl.sum(gb * xb, axis=2)
            src += stride_s
            r = 1.0 / tl.sqrt(ss / D + eps)
            a = tl.exp(u * r - lse)
            dz = a * (da - delta)
            rdz = (dz * r)[:, :, None]
            w = tl.sum(tl.sum(dz * u, axis=1), axis=0) * (r * r * r / D)
            a = a[:, :, None]
            ds_a = tl.sum(a * ga + rdz * qg_a, axis=0, keep_dims=True) - w * xa
            if ACCUMULATE:
                ds_a += prev_a
            tl.store(dsrc + col_a, ds_a.to(dsrc_ptr.dtype.element_ty), mask=(ja >= 0) & live)
            if HAS_B:
                ds_b = tl.sum(a * gb + rdz * qg_b, axis=0, keep_dims=True) - w * xb
                if ACCUMULATE:
                    ds_b += prev_b
                tl.store(dsrc + col_b, ds_b.to(dsrc_ptr.dtype.element_ty), mask=b_ok & live)
            dsrc += stride_s
            rdz = tl.where(live, rdz, 0.0)
            dqg_a += rdz * xa
            if HAS_B:
                dqg_b += rdz * xb

    part = dqg_part_ptr + pid.to(tl.int64) * BLOCK_G * D
    tl.store(part + k * D + col_a, dqg_a)
    if HAS_B:
        tl.store(part + k * D + col_b, dqg_b, mask=b_ok & (k >= 0))


# ----------------------------------------------------------------------------------------------------------
# Host functions
# ----------------------------------------------------------------------------------------------------------


def _meta(d: int, num_heads: int) -> dict:
    meta = _head_meta(d, num_heads)
    return {**meta, "HAS_B": meta["DB"] > 0}


def _block_g(groups: int) -> int:
    return triton.next_power_of_2(max(groups, 1))


def _num_warps(d: int, num_heads: int, block_g: int) -> int:
    """Warps per program. One site: about 8 elements of a [1, H, head] tile per thread, 4 warps at d = 1024
    (the per-site kernel's measured best; here 25 ms a step of routing kernels at paper350m, near the
    bandwidth floor). Several sites: their per-token state ([G, H, head] query rows, gradients and
    accumulators) fills the register file whatever the warp count, so one program is resident per SM;
    spreading it over more warps, about 4 elements per thread (up to 32), gives that SM more independent
    instructions in flight (ptxas of triton 3.9: G = 8 at d = 1024 takes ~128 registers a thread at 16
    warps, ~60 at 32). Still latency-bound: 53 ms a step at G = 8 on the H200."""
    meta = _head_meta(d, num_heads)
    width = block_g * num_heads * (meta["DA"] + (meta["BLOCK_DB"] if meta["DB"] else 0))
    per_thread = 8 if block_g == 1 else 4
    warps = max(1, width // (32 * per_thread))
    return min(32, 1 << (warps.bit_length() - 1))


def sites_forward(sources: Tensor, qg: Tensor, num_heads: int, eps: float, out: Tensor, rest: Tensor | None,
                  lse: Tensor, init: Tensor | None = None) -> None:
    """Route ``sources`` (S, N, d), contiguous, for the G sites whose fused query·key-gain rows are ``qg``
    (G, d) fp32. Writes site 0's normalised output to ``out`` (N, d), site k's to ``rest[k - 1]`` and
    every site's log-sum-exp to ``lse`` (G, N, H) fp32. With ``init`` (G, N, d) the sites continue from that
    partial state, whose log-sum-exps are read from ``lse`` first (in place)."""
    S, N, d = sources.shape
    G = qg.shape[0]
    if N == 0:
        return
    meta = {**_meta(d, num_heads), "BLOCK_G": _block_g(G), "HAS_INIT": init is not None}
    if sources.device.type != "cpu":
        meta["num_warps"] = _num_warps(d, num_heads, meta["BLOCK_G"])
    args = (sources, qg, init if init is not None else out, out, rest if rest is not None else out, lse,
            N, S, G, N * d, eps)
    _launch(_sites_fwd_kernel, (N,), args, meta, sources.device)


def sites_backward(sources: Tensor, grad_sources: Tensor, accumulate: bool, qg: Tensor, num_heads: int,
                   eps: float, grad_out: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None = None,
                   grad_copy: Tensor | None = None) -> Tensor:
    """Gradients of ``sources`` (S, N, d) summed over G sites, written to ``grad_sources`` (same layout)
    or added to it (``accumulate``); returns the sites' ``qg`` gradients (G, d) fp32.

    ``grad_out`` (G, N, d), ``lse`` and ``delta`` (G, N, H) fp32 describe the sites. With ``out`` (one
    site's output, G = 1) ``delta`` is computed from it and written, and ``grad_out`` is copied into
    ``grad_copy``. S may be 0 (then only that prologue runs).
    """
    S, N, d = sources.shape
    G = qg.shape[0]
    block_g = _block_g(G)
    if N == 0:
        return torch.zeros((G, d), dtype=torch.float32, device=sources.device)
    meta = {**_meta(d, num_heads), "BLOCK_G": block_g, "ACCUMULATE": accumulate,
            "COMPUTE_DELTA": out is not None}
    args = [sources, grad_sources, qg, grad_out, lse, delta, out if out is not None else grad_out,
            grad_copy if grad_copy is not None else grad_out,
            torch.empty((1, block_g, d), dtype=torch.float32, device=sources.device), N, S, G, N * d, eps, 1]
    if sources.device.type == "cpu":
        programs = min(N, 3)  # few programs, so that tests walk the persistent loop and its idle tail
    else:
        meta["num_warps"] = _num_warps(d, num_heads, block_g)
        index = sources.device.index if sources.device.index is not None else torch.cuda.current_device()
        programs = min(N, _resident_programs(_sites_bwd_kernel, args, meta, sources.device) * _num_sms(index))
    partials = torch.empty((programs, block_g, d), dtype=torch.float32, device=sources.device)
    args[8], args[-1] = partials, triton.cdiv(N, programs)
    _launch(_sites_bwd_kernel, (programs,), tuple(args), meta, sources.device)
    return partials.sum(0)[:G]
