"""Fused Triton kernels for the MHAR routing op (``mhar_route``, backend ``"triton"``).

The op is memory-bound: every call reads all S sources of a token and writes one output row, and its
backward reads them again and writes one gradient row per source. Both kernels therefore make exactly one
pass over the sources and keep everything else per token in registers:

* forward: for a tile of tokens, walk the S sources once; for each one compute the full-d RMS and the H
  per-head dot products with ``qg = query * key_weight`` from the same registers, fold the logits into an
  online (running max / running sum) softmax per head and accumulate the output. Only the per-token,
  per-head log-sum-exp (fp32, tokens x H) is saved for backward, next to the output itself.
* backward: the flash-attention "delta" identity ``sum_s a_s <g_h, s_h> = <g_h, out_h>`` gives the softmax
  gradient without a first pass over the sources, so one pass reads each source once, recomputes its
  logits, and writes its gradient. The gradient of ``qg`` is summed per program in registers and written
  to a (programs x d) buffer that torch sums afterwards: deterministic, no atomics.

Math (r = rsqrt(mean_c s_c^2 + eps), u_h = <s_h, qg_h>, z_h = r u_h, a = softmax_s(z), dz = a (da - delta)):

    ds_c  = a_{h(c)} g_c + dz_{h(c)} r qg_c - (r^3 s_c / d) sum_h dz_h u_h
    dqg_c = sum_s dz_{s,h(c)} r_s s_c,      dq = dqg * key_weight,   dkey_weight = dqg * query

The op is registered as the ``torch.library`` custom ops ``mhar_ablate::route_fwd`` / ``route_bwd`` with
fake implementations and an autograd formula (``register_autograd`` builds the autograd Function), so
``torch.compile`` traces models that call it without a graph break.

On CPU tensors the same kernels run through Triton's interpreter (use fp32 there: its bf16 arithmetic is
not faithful), whether or not ``TRITON_INTERPRET=1`` was set before triton was imported; see
``launch.launch``.

Precision: fp32 accumulation throughout. With bf16/fp16 sources the backward's ``delta`` uses the output as
stored (rounded to the sources' dtype), as flash-attention does; that is the one error the reference does
not have, and it shows in the query/key-gain gradients: relative error up to 7e-3 in bf16 on the H200,
against ~3e-7 for the fp32-upcasting reference (``tests/kernels/test_kernels_gpu.py`` holds each dtype to its
tolerance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import head_meta, launch, persistent_programs, tile_width

__all__ = ["mhar_route_triton", "route_fwd", "route_bwd", "forward_config", "backward_config"]


# ----------------------------------------------------------------------------------------------------------
# Kernels
#
# A token tile is held per head: channel ``h * DH + j`` of token ``n`` sits at [n, h, j], so the per-head dot
# products are reductions over the last axis. Each head is two blocks, DA + DB channels (``launch.head_meta``):
# 160 = 128 + 32 with no padding at all (H200, d = 1280, S = 49: forward 55 % -> 65 % of copy bandwidth
# against padding to 256). When DH is a power of two the rest is an empty, fully masked block of width 1.
#
# Pointers advance by ``stride_s`` per source instead of being recomputed as s * stride_s, which would
# overflow int32 past 2^31 elements (S = 73, 32k tokens, d = 1024 already does). The next source is loaded
# before the current one is reduced: Triton's software pipeliner does not stage loads that feed no dot, and
# without this one load in flight during the reductions the loops ran 11-16 % slower on the H200; loading
# two sources ahead was slower again (more registers, fewer resident programs).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _mhar_fwd_kernel(
    src_ptr, qg_ptr, out_ptr, lse_ptr,
    N, S, stride_s, eps,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    tile_start = pid.to(tl.int64) * BLOCK_N

    r_idx = tl.arange(0, BLOCK_N)
    h_idx = tl.arange(0, H)
    col_a = h_idx[:, None] * DH + tl.arange(0, DA)[None, :]  # [H, DA] channel index
    jb = tl.arange(0, BLOCK_DB)[None, :]
    col_b = h_idx[:, None] * DH + DA + jb  # [H, BLOCK_DB]
    b_ok = (jb < DB)[None, :, :]
    offs_a = r_idx[:, None, None] * D + col_a[None, :, :]  # within the tile: int32 is enough
    offs_b = r_idx[:, None, None] * D + col_b[None, :, :]
    in_range = (tile_start + r_idx) < N
    row_ok = in_range[:, None, None]

    qg_a = tl.load(qg_ptr + col_a)[None, :, :]
    qg_b = tl.load(qg_ptr + col_b, mask=jb < DB, other=0.0)[None, :, :]

    src = src_ptr + tile_start * D
    m = tl.full([BLOCK_N, H], float("-inf"), tl.float32)  # running max of the logits
    l = tl.zeros([BLOCK_N, H], tl.float32)  # running sum of exp(z - m)
    acc_a = tl.zeros([BLOCK_N, H, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_N, H, BLOCK_DB], tl.float32)

    next_a = tl.load(src + offs_a, mask=row_ok, other=0.0)
    next_b = tl.load(src + offs_b, mask=row_ok & b_ok, other=0.0)
    for s in range(S):
        xa = next_a.to(tl.float32)
        xb = next_b.to(tl.float32)
        # Issue the loads of source s + 1 now; past the last source the row limit is 0, nothing is read.
        n_lim = tl.where(s + 1 < S, N, 0)
        ahead_ok = ((tile_start + r_idx) < n_lim)[:, None, None]
        next_a = tl.load(src + stride_s + offs_a, mask=ahead_ok, other=0.0)
        next_b = tl.load(src + stride_s + offs_b, mask=ahead_ok & b_ok, other=0.0)
        src += stride_s

        ms = (tl.sum(tl.sum(xa * xa, axis=2), axis=1) + tl.sum(tl.sum(xb * xb, axis=2), axis=1)) / D
        r = 1.0 / tl.sqrt(ms + eps)
        z = (tl.sum(xa * qg_a, axis=2) + tl.sum(xb * qg_b, axis=2)) * r[:, None]  # [BLOCK_N, H]

        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        l = l * alpha + p
        acc_a = acc_a * alpha[:, :, None] + p[:, :, None] * xa
        acc_b = acc_b * alpha[:, :, None] + p[:, :, None] * xb
        m = m_new

    inv_l = 1.0 / l[:, :, None]
    out = out_ptr + tile_start * D
    tl.store(out + offs_a, (acc_a * inv_l).to(out_ptr.dtype.element_ty), mask=row_ok)
    tl.store(out + offs_b, (acc_b * inv_l).to(out_ptr.dtype.element_ty), mask=row_ok & b_ok)
    lse_offs = r_idx[:, None] * H + h_idx[None, :]
    tl.store(lse_ptr + tile_start * H + lse_offs, m + tl.log(l), mask=in_range[:, None])


@triton.jit
def _mhar_bwd_kernel(
    src_ptr, qg_ptr, out_ptr, gout_ptr, lse_ptr, dsrc_ptr, dqg_part_ptr,
    N, S, stride_s, eps, tiles_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Persistent: program p walks tiles p, p + P, p + 2P, ... so that the qg-gradient partial sums are one
    # row per program (about a thousand rows), not one per tile.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)

    r_idx = tl.arange(0, BLOCK_N)
    h_idx = tl.arange(0, H)
    col_a = h_idx[:, None] * DH + tl.arange(0, DA)[None, :]
    jb = tl.arange(0, BLOCK_DB)[None, :]
    col_b = h_idx[:, None] * DH + DA + jb
    b_ok = (jb < DB)[None, :, :]
    offs_a = r_idx[:, None, None] * D + col_a[None, :, :]
    offs_b = r_idx[:, None, None] * D + col_b[None, :, :]
    lse_offs = r_idx[:, None] * H + h_idx[None, :]

    qg_a = tl.load(qg_ptr + col_a)[None, :, :]
    qg_b = tl.load(qg_ptr + col_b, mask=jb < DB, other=0.0)[None, :, :]
    # the qg gradient, summed over this program's tokens; reduced over the tile's rows once, at the end
    dqg_a = tl.zeros([BLOCK_N, H, DA], tl.float32)
    dqg_b = tl.zeros([BLOCK_N, H, BLOCK_DB], tl.float32)

    for i in range(tiles_per_program):
        tile_start = (pid + i * num_programs).to(tl.int64) * BLOCK_N
        in_range = (tile_start + r_idx) < N
        row_ok = in_range[:, None, None]
        tile = tile_start * D

        ga = tl.load(gout_ptr + tile + offs_a, mask=row_ok, other=0.0).to(tl.float32)
        gb = tl.load(gout_ptr + tile + offs_b, mask=row_ok & b_ok, other=0.0).to(tl.float32)
        oa = tl.load(out_ptr + tile + offs_a, mask=row_ok, other=0.0).to(tl.float32)
        ob = tl.load(out_ptr + tile + offs_b, mask=row_ok & b_ok, other=0.0).to(tl.float32)
        delta = tl.sum(ga * oa, axis=2) + tl.sum(gb * ob, axis=2)  # [BLOCK_N, H] = sum_s a_s <g_h, s_h>
        lse = tl.load(lse_ptr + tile_start * H + lse_offs, mask=in_range[:, None], other=0.0)

        src = src_ptr + tile
        dsrc = dsrc_ptr + tile
        next_a = tl.load(src + offs_a, mask=row_ok, other=0.0)
        next_b = tl.load(src + offs_b, mask=row_ok & b_ok, other=0.0)
        for s in range(S):
            xa = next_a.to(tl.float32)
            xb = next_b.to(tl.float32)
            n_lim = tl.where(s + 1 < S, N, 0)
            ahead_ok = ((tile_start + r_idx) < n_lim)[:, None, None]
            next_a = tl.load(src + stride_s + offs_a, mask=ahead_ok, other=0.0)
            next_b = tl.load(src + stride_s + offs_b, mask=ahead_ok & b_ok, other=0.0)
            src += stride_s

            ms = (tl.sum(tl.sum(xa * xa, axis=2), axis=1) + tl.sum(tl.sum(xb * xb, axis=2), axis=1)) / D
            r = 1.0 / tl.sqrt(ms + eps)
            u = tl.sum(xa * qg_a, axis=2) + tl.sum(xb * qg_b, axis=2)  # [BLOCK_N, H]
            a = tl.exp(u * r[:, None] - lse)
            da = tl.sum(ga * xa, axis=2) + tl.sum(gb * xb, axis=2)
            dz = a * (da - delta)
            rdz = (dz * r[:, None])[:, :, None]
            w = (tl.sum(dz * u, axis=1) * (r * r * r / D))[:, None, None]
            a = a[:, :, None]

            tl.store(dsrc + offs_a, (a * ga + rdz * qg_a - w * xa).to(dsrc_ptr.dtype.element_ty), mask=row_ok)
            tl.store(dsrc + offs_b, (a * gb + rdz * qg_b - w * xb).to(dsrc_ptr.dtype.element_ty),
                     mask=row_ok & b_ok)
            dsrc += stride_s
            dqg_a += rdz * xa
            dqg_b += rdz * xb

    part = dqg_part_ptr + pid.to(tl.int64) * D
    tl.store(part + col_a, tl.sum(dqg_a, axis=0))
    tl.store(part + col_b, tl.sum(dqg_b, axis=0), mask=jb < DB)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration (launch helpers and the head split: ``launch.py``)
# ----------------------------------------------------------------------------------------------------------


def forward_config(d: int, num_heads: int, device: torch.device) -> dict:
    """Tokens per program and warps for the forward kernel.

    Measured on the H200 at S = 49, 32k tokens (docs/benchmarks.md): one token per program and 4 warps
    (8 to 10 channels a thread) ran best at d = 1024 and 1280; 2 tokens and 8 warps, or a register cap,
    were slower. Narrow d packs several tokens into a program to keep about 1k channels per program.
    """
    if device.type == "cpu":
        return {"BLOCK_N": 8}  # interpreter: fewer, larger programs run faster
    width = tile_width(d, num_heads)
    block_n = min(16, triton.next_power_of_2(max(1, 1024 // width)) if width < 1024 else 1)
    return {"BLOCK_N": block_n, "num_warps": 4 if block_n * width <= 2048 else 8}


# Register caps for the backward, measured on the H200 (tile width, tokens per program, warps): ptxas takes
# 64 / 117 registers at d = 1024 / 1280, capping at 56 / 96 (8 / 32 bytes spilled) fits 9 / 5 programs per
# SM instead of 8 / 4: 1.97 -> 1.82 ms and 3.79 -> 3.12 ms at S = 49.
_BWD_MAXNREG = {(1024, 1, 4): 56, (1280, 1, 4): 96}


def backward_config(d: int, num_heads: int, device: torch.device) -> dict:
    """Tokens per program, warps and register cap for the persistent backward kernel (programs per SM: as
    many as fit, see ``launch.resident_programs``; ``programs_per_sm`` or ``max_programs`` override it)."""
    if device.type == "cpu":
        # few programs, so that tests exercise the persistent loop and its empty trailing tiles
        return {"BLOCK_N": 4, "max_programs": 3}
    cfg = forward_config(d, num_heads, device)
    maxnreg = _BWD_MAXNREG.get((tile_width(d, num_heads), cfg["BLOCK_N"], cfg["num_warps"]))
    return {**cfg, "maxnreg": maxnreg} if maxnreg else cfg


# ----------------------------------------------------------------------------------------------------------
# Host functions (called by the custom ops; ``config`` overrides are for the benchmark's tuning sweep)
# ----------------------------------------------------------------------------------------------------------


def _fused_qg(query: Tensor, key_weight: Tensor) -> Tensor:
    return (query.float() * key_weight.float()).contiguous()


def forward(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float,
            config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Returns ``(out (B, T, d) in sources' dtype, lse (B, T, H) fp32)``."""
    S, B, T, d = sources.shape
    n = B * T
    src = sources.contiguous()
    out = torch.empty((B, T, d), dtype=sources.dtype, device=sources.device)
    lse = torch.empty((B, T, num_heads), dtype=torch.float32, device=sources.device)
    if n == 0:
        return out, lse
    cfg = dict(config or forward_config(d, num_heads, sources.device))
    block_n = cfg.pop("BLOCK_N")
    grid = (triton.cdiv(n, block_n),)
    launch(_mhar_fwd_kernel, grid, (src, _fused_qg(query, key_weight), out, lse, n, S, n * d, eps),
           {**head_meta(d, num_heads), "BLOCK_N": block_n, **cfg}, sources.device)
    return out, lse


def backward(grad_out: Tensor, sources: Tensor, query: Tensor, key_weight: Tensor, out: Tensor, lse: Tensor,
             num_heads: int, eps: float, config: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns the gradients of ``sources`` (its dtype), ``query`` and ``key_weight`` (their dtypes)."""
    S, B, T, d = sources.shape
    n = B * T
    src = sources.contiguous()
    grad_sources = torch.empty_like(src)
    if n == 0:
        return grad_sources, torch.zeros_like(query), torch.zeros_like(key_weight)
    cfg = dict(config or backward_config(d, num_heads, sources.device))
    block_n = cfg.pop("BLOCK_N")
    programs_per_sm = cfg.pop("programs_per_sm", None)
    max_programs = cfg.pop("max_programs", None)
    meta = {**head_meta(d, num_heads), "BLOCK_N": block_n, **cfg}
    num_tiles = triton.cdiv(n, block_n)
    # the partial-sum buffer and tiles per program depend on the grid: stand-ins while it is sized
    args = [src, _fused_qg(query, key_weight), out.contiguous(), grad_out.contiguous(), lse.contiguous(),
            grad_sources, torch.empty((1, d), dtype=torch.float32, device=sources.device), n, S, n * d, eps, 2]
    if max_programs is None:
        programs = persistent_programs(_mhar_bwd_kernel, args, meta, sources.device, num_tiles, programs_per_sm)
    else:
        programs = max(1, min(num_tiles, max_programs))
    partials = torch.empty((programs, d), dtype=torch.float32, device=sources.device)
    args[6], args[-1] = partials, triton.cdiv(num_tiles, programs)
    launch(_mhar_bwd_kernel, (programs,), tuple(args), meta, sources.device)
    grad_qg = partials.sum(0)
    grad_query = (grad_qg * key_weight.float()).to(query.dtype)
    grad_key_weight = (grad_qg * query.float()).to(key_weight.dtype)
    return grad_sources, grad_query, grad_key_weight


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mhar_ablate::route_fwd", mutates_args=())
def route_fwd(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float) -> tuple[Tensor, Tensor]:
    """Fused routing forward: ``(out, lse)``; ``lse`` (B, T, H) fp32 is kept for the backward."""
    return forward(sources, query, key_weight, num_heads, eps)


@route_fwd.register_fake
def _route_fwd_fake(sources, query, key_weight, num_heads, eps):
    S, B, T, d = sources.shape
    return (sources.new_empty((B, T, d)), sources.new_empty((B, T, num_heads), dtype=torch.float32))


@torch.library.custom_op("mhar_ablate::route_bwd", mutates_args=())
def route_bwd(grad_out: Tensor, sources: Tensor, query: Tensor, key_weight: Tensor, out: Tensor, lse: Tensor,
              num_heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Fused routing backward: gradients of ``sources``, ``query`` and ``key_weight``."""
    return backward(grad_out, sources, query, key_weight, out, lse, num_heads, eps)


@route_bwd.register_fake
def _route_bwd_fake(grad_out, sources, query, key_weight, out, lse, num_heads, eps):
    return (torch.empty_like(sources, memory_format=torch.contiguous_format), torch.empty_like(query),
            torch.empty_like(key_weight))


def _setup_context(ctx, inputs, output):
    sources, query, key_weight, num_heads, eps = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(sources, query, key_weight, out, lse)
    ctx.num_heads = num_heads
    ctx.eps = eps


def _backward(ctx, grad_out, grad_lse):
    sources, query, key_weight, out, lse = ctx.saved_tensors
    grad_sources, grad_query, grad_key_weight = route_bwd(grad_out, sources, query, key_weight, out, lse,
                                                          ctx.num_heads, ctx.eps)
    return grad_sources, grad_query, grad_key_weight, None, None


route_fwd.register_autograd(_backward, setup_context=_setup_context)


def mhar_route_triton(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """Fused routing op; arguments are checked by ``mhar_ablate.ops.mhar_route``."""
    return route_fwd(sources, query, key_weight, num_heads, float(eps))[0]
