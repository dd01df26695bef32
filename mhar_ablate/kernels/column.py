"""Triton kernels for the fused path's backward by source ("by column"): the whole gradient of one buffer
slot in one pass, once every site that reads it has its output gradient.

Summing source gradients site by site, as the forward runs, reads each source and read-modify-writes its
gradient once per site that sees it: three source-sized transfers per (site, source) pair, 3,675 of them a
step at the paper's 350M shape. But a slot's gradient is needed only when autograd reaches the sublayer
that wrote it, and by then every site that reads it has run its backward. So the backward keeps each
site's output gradient (and its ``delta``) in a buffer and computes a slot's gradient in one pass when it
is needed: the slot is read once, written once, and each reading site's output gradient is read once,
one transfer per pair plus two per slot (1,323 at that shape).

* ``_column_bwd_kernel``: one token per program, its row of the slot in registers, streaming over the S
  sites that read the slot; writes the slot's gradient (the part through its RMS statistic included, the
  whole row being at hand) and, per site and head, ``dz * r``, from which the routing parameters'
  gradients follow.
* ``_dqg_kernel``: those gradients, ``dqg[s, c] = sum_n dzr[h(c), s, n] * x[n, c]``, a matrix product
  over tokens per head, on tensor cores (bf16 sources: ``dzr`` split into two bf16 parts, so the product
  keeps about 16 bits of it) or in fp32; partial sums per token chunk, summed after.

Math as in ``history`` (per site s reading the slot x, with g_s its output gradient):
``a = exp(r u_s - lse_s)``, ``dz = a (<g_s, x>_h - delta_s)``,
``dx = sum_s [a g_s + dz r qg_s] - (r^3 x / d) sum_s sum_h dz u_s``, ``dqg_s += dz r x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import head_meta, launch

__all__ = ["column_backward"]


@triton.jit(do_not_specialize=["N", "S"])
def _column_bwd_kernel(
    x_ptr, rms_ptr, g_ptr, lse_ptr, delta_ptr, qg_ptr, dx_ptr, dzr_ptr,
    N, S,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # A program holds BLOCK_N tokens' rows, [BLOCK_N, H, .]; a site's query row [1, H, .] broadcasts over
    # them, so that each is read from cache once per BLOCK_N tokens rather than once per token.
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    nn = n[:, None, None]
    hh = tl.arange(0, H)
    h = hh[None, :, None]
    ja = tl.arange(0, DA)[None, None, :]
    jb = tl.arange(0, BLOCK_DB)[None, None, :]
    col_a = h * DH + ja  # [1, H, DA]
    col_b = h * DH + DA + jb
    b_ok = jb < DB
    row_ok = n_ok[:, None, None]
    offs_a = nn * D + col_a  # [BLOCK_N, H, DA]
    offs_b = nn * D + col_b
    xa = tl.load(x_ptr + offs_a, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_B:
        xb = tl.load(x_ptr + offs_b, mask=row_ok & b_ok, other=0.0).to(tl.float32)
    r = tl.load(rms_ptr + n, mask=n_ok, other=0.0)[:, None]  # [BLOCK_N, 1]
    dxa = tl.zeros([BLOCK_N, H, DA], tl.float32)
    if HAS_B:
        dxb = tl.zeros([BLOCK_N, H, BLOCK_DB], tl.float32)
    dr = tl.zeros([BLOCK_N, H], tl.float32)

    # Site s's output gradients are loaded one site ahead (see mhar_triton: loads that feed no dot are
    # not pipelined by the compiler). The limit is a tensor mask, no rows past the last site.
    g = g_ptr
    next_a = tl.load(g + offs_a, mask=(n < tl.where(S > 0, N, 0))[:, None, None], other=0.0)
    if HAS_B:
        next_b = tl.load(g + offs_b, mask=(n < tl.where(S > 0, N, 0))[:, None, None] & b_ok, other=0.0)
    # The site's query row and statistics too: cached, but a cache's latency still stalls a loop that
    # uses a load right after issuing it.
    stat = n[:, None] * H + hh[None, :]  # [BLOCK_N, H]: offsets in the (sites, N, H) statistics
    stat_ok = n_ok[:, None]
    first = tl.where(S > 0, 1, 0)
    next_qa = tl.load(qg_ptr + col_a, mask=ja < first * DA, other=0.0)  # [1, H, DA]
    if HAS_B:
        next_qb = tl.load(qg_ptr + col_b, mask=jb < first * DB, other=0.0)
    # padded tokens: lse = +inf, weight 0
    next_lse = tl.load(lse_ptr + stat, mask=n[:, None] < first * N, other=float("inf"))
    next_delta = tl.load(delta_ptr + stat, mask=n[:, None] < first * N, other=0.0)
    dzr = dzr_ptr + hh.to(tl.int64)[None, :] * S * N + n[:, None]
    for s in range(S):
        ga = next_a.to(tl.float32)
        qa = next_qa
        lse = next_lse
        delta = next_delta
        more = tl.where(s + 1 < S, 1, 0)
        ahead = (n < more * N)[:, None, None]
        next_a = tl.load(g + N * D + offs_a, mask=ahead, other=0.0)
        next_qa = tl.load(qg_ptr + (s + 1) * D + col_a, mask=ja < more * DA, other=0.0)
        next_lse = tl.load(lse_ptr + stat + N * H, mask=n[:, None] < more * N, other=float("inf"))
        next_delta = tl.load(delta_ptr + stat + N * H, mask=n[:, None] < more * N, other=0.0)
        u = tl.sum(xa * qa, axis=2)  # [BLOCK_N, H]
        da = tl.sum(ga * xa, axis=2)
        if HAS_B:
            gb = next_b.to(tl.float32)
            qb = next_qb
            next_b = tl.load(g + N * D + offs_b, mask=ahead & b_ok, other=0.0)
            next_qb = tl.load(qg_ptr + (s + 1) * D + col_b, mask=jb < more * DB, other=0.0)
            u += tl.sum(xb * qb, axis=2)
            da += tl.sum(gb * xb, axis=2)
        a = tl.exp(u * r - lse)
        dz = a * (da - delta)
        rdz = dz * r
        dr += dz * u
        dxa += a[:, :, None] * ga + rdz[:, :, None] * qa
        if HAS_B:
            dxb += a[:, :, None] * gb + rdz[:, :, None] * qb
        tl.store(dzr + s * N, rdz, mask=stat_ok)
        g += N * D
        stat += N * H
    w = (tl.sum(dr, axis=1)[:, None] * (r * r * r / D))[:, :, None]  # [BLOCK_N, 1, 1]
    tl.store(dx_ptr + offs_a, (dxa - w * xa).to(dx_ptr.dtype.element_ty), mask=row_ok)
    if HAS_B:
        tl.store(dx_ptr + offs_b, (dxb - w * xb).to(dx_ptr.dtype.element_ty), mask=row_ok & b_ok)


@triton.jit(do_not_specialize=["N", "S", "tokens_per_chunk"])
def _dqg_kernel(
    dzr_ptr, x_ptr, part_ptr, N, S, tokens_per_chunk,
    D: tl.constexpr, DH: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_DOT: tl.constexpr, SPLIT_BF16: tl.constexpr,
):
    # Program (channel block, token chunk, site block): partial sums over the chunk's tokens.
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] channels, all in one head
    head = (tl.program_id(0) * BLOCK_C) // DH
    chunk = tl.program_id(1)
    s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < S
    a_rows = dzr_ptr + head.to(tl.int64) * S * N + s.to(tl.int64)[:, None] * N  # [BLOCK_S, 1]
    acc = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    start = chunk.to(tl.int64) * tokens_per_chunk
    for k0 in range(0, tokens_per_chunk, BLOCK_K):
        n = start + k0 + tl.arange(0, BLOCK_K)
        n_ok = (n < N) & (k0 + tl.arange(0, BLOCK_K) < tokens_per_chunk)
        a = tl.load(a_rows + n[None, :], mask=s_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_K]
        b = tl.load(x_ptr + n[:, None] * D + c[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_C]
        if USE_DOT:
            if SPLIT_BF16:
                a_hi = a.to(tl.bfloat16)
                a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(a_hi, b, acc)
                acc = tl.dot(a_lo, b, acc)
            else:
                acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc += tl.sum(a[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    out = part_ptr + chunk.to(tl.int64) * S * D + s.to(tl.int64)[:, None] * D + c[None, :]
    tl.store(out, acc, mask=s_ok[:, None])


# Tokens per program and warps of the column kernel (the interpreter: two tokens, to cover the mask).
# Measured on the H200 at paper350m: one token and 4 warps 20.6 ms for the routing stack, two tokens 22.5 ms
# (4 warps) and 24.2 ms (8 warps), four tokens 46 ms.
COLUMN_CONFIG = (1, 4)


def _channel_block(head_width: int) -> int:
    """The largest power of two dividing the head width, at most 64: a block of channels of one head."""
    return min(64, head_width & -head_width)


def column_backward(x: Tensor, rms: Tensor, grad_out: Tensor, lse: Tensor, delta: Tensor, qg: Tensor,
                    num_heads: int) -> tuple[Tensor, Tensor]:
    """The gradient of one slot ``x`` (N, d) read by S sites, and the S sites' ``qg`` gradients from it.

    ``rms`` (N,) is the slot's RMS statistic; ``grad_out`` (S, N, d) the sites' output gradients,
    ``lse`` and ``delta`` (S, N, H) fp32 their log-sum-exps and deltas, ``qg`` (S, d) fp32 their fused
    query rows. Returns ``(dx (N, d) in x's dtype, dqg (S, d) fp32)``.
    """
    N, d = x.shape
    S = grad_out.shape[0]
    dx = torch.empty_like(x)
    if N == 0 or S == 0:
        return dx.zero_(), torch.zeros((S, d), dtype=torch.float32, device=x.device)
    dzr = torch.empty((num_heads, S, N), dtype=torch.float32, device=x.device)
    block_n, warps = COLUMN_CONFIG if x.device.type != "cpu" else (2, None)
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCK_N": block_n, **({"num_warps": warps} if warps else {})}
    launch(_column_bwd_kernel, (triton.cdiv(N, block_n),), (x, rms, grad_out, lse, delta, qg, dx, dzr, N, S),
           meta, x.device)

    block_c = _channel_block(d // num_heads)
    use_dot = block_c >= 16
    if x.device.type == "cpu":  # interpreter: two chunks, so that tests sum partials
        block_s, block_k, chunks = max(16, triton.next_power_of_2(S)), 16, 2
    else:
        block_s, block_k, chunks = (64 if use_dot else 16), (64 if use_dot else 16), 16
    tokens_per_chunk = triton.cdiv(triton.cdiv(N, chunks), block_k) * block_k
    chunks = triton.cdiv(N, tokens_per_chunk)
    part = torch.empty((chunks, S, d), dtype=torch.float32, device=x.device)
    meta = {"D": d, "DH": d // num_heads, "BLOCK_S": block_s, "BLOCK_K": block_k, "BLOCK_C": block_c,
            "USE_DOT": use_dot, "SPLIT_BF16": x.dtype == torch.bfloat16}
    grid = (d // block_c, chunks, triton.cdiv(S, block_s))
    launch(_dqg_kernel, grid, (dzr, x, part, N, S, tokens_per_chunk), meta, x.device)
    return dx, part.sum(0)
