"""Sinkhorn-Knopp of mHC's H_res as one Triton kernel forward and one backward (``sinkhorn_triton``).

Unrolled, the 2 x t_max normalisations at each of the 2L sites are most of mHC's graph under
torch.compile (tens of thousands of nodes at 24 layers, and most of its compile time). As the custom ops
``mhar_ablate::sinkhorn_fwd`` / ``sinkhorn_bwd`` (fake implementations and an autograd formula, as in
``mhar_triton``) each site is one opaque node forward and one backward.

The math is ``variants/mhc.py``'s ``_Sinkhorn``, the reference and the CPU path, on (N, n, n)
matrices m[i, j]: a softmax over each row (j), then columns (sums over i, clamped at ``COLUMN_FLOOR``),
rows, ..., ending with columns: 2 x iters normalisations in all.

* forward: a program holds BLOCK tokens as a (BLOCK, NP, NP) register tile (n padded to a power of two;
  padded entries are zero after the softmax and stay zero, so they enter no sum) and runs every
  normalisation in registers. Nothing is saved but the logits.
* backward: y = x / s along an axis has dx = (dy - sum(dy * y)) / s, walked from the last normalisation
  to the first, then the softmax's dx = y (dy - sum(dy * y)). The states it needs are recomputed from
  the softmax for each (row, column) pair on the way back: O(iters^2) normalisations of a few registers
  per token, the same operations as the forward, and no scratch memory. As in ``_Sinkhorn`` the column
  floor is treated as inactive (it only guards against an underflowed column).

On CPU tensors the kernels run through Triton's interpreter (fp32; see ``launch.launch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import COLUMN_FLOOR  # the reference's floor of a column sum
from .launch import launch

__all__ = ["sinkhorn_triton", "sinkhorn_fwd", "sinkhorn_bwd", "COLUMN_FLOOR"]


# ----------------------------------------------------------------------------------------------------------
# Kernels: a tile m[b, i, j] holds BLOCK tokens' n x n matrices; rows are axis 2, columns axis 1.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _columns(m, FLOOR: tl.constexpr):
    s = tl.maximum(tl.sum(m, axis=1), FLOOR)[:, None, :]  # padded columns: 0 / FLOOR = 0
    return m / s, s


@triton.jit
def _rows(m, row_ok):
    s = tl.where(row_ok, tl.sum(m, axis=2)[:, :, None], 1.0)  # padded rows: 0 / 1 = 0, not 0 / 0
    return m / s, s


# Backward of y = x / s along the columns or the rows. Padded entries are kept at zero: the broadcast
# subtraction would fill them, and the divisions by padded sums (1, or the floor) would grow them past
# float range, where even a product with y = 0 is NaN.
@triton.jit
def _columns_grad(g, y, s, valid):
    return tl.where(valid, (g - tl.sum(g * y, axis=1)[:, None, :]) / s, 0.0)


@triton.jit
def _rows_grad(g, y, s, valid):
    return tl.where(valid, (g - tl.sum(g * y, axis=2)[:, :, None]) / s, 0.0)


@triton.jit
def _softmax(x, valid, row_ok):
    x = tl.where(valid, x, float("-inf"))
    top = tl.where(row_ok, tl.max(x, axis=2)[:, :, None], 0.0)  # padded rows: exp(-inf - 0) = 0
    return _rows(tl.exp(x - top), row_ok)[0]


@triton.jit
def _tile(N, pid, n: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets of the program's tile (from its first token), load mask, valid-entry mask, valid-row mask."""
    b = tl.arange(0, BLOCK)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    valid = (i < n) & (j < n)
    in_range = (pid.to(tl.int64) * BLOCK + b) < N
    return b * (n * n) + i * n + j, in_range & valid, valid, i < n


@triton.jit
def _sinkhorn_fwd_kernel(x_ptr, out_ptr, N, iters, n: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
                         FLOOR: tl.constexpr):
    pid = tl.program_id(0)
    offs, mask, valid, row_ok = _tile(N, pid, n, NP, BLOCK)
    start = pid.to(tl.int64) * BLOCK * (n * n)
    x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    m, _ = _columns(_softmax(x, valid, row_ok), FLOOR)
    for _ in range(iters - 1):
        m, _ = _rows(m, row_ok)
        m, _ = _columns(m, FLOOR)
    tl.store(out_ptr + start + offs, m.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(x_ptr, dy_ptr, dx_ptr, N, iters, n: tl.constexpr, NP: tl.constexpr,
                         BLOCK: tl.constexpr, FLOOR: tl.constexpr):
    pid = tl.program_id(0)
    offs, mask, valid, row_ok = _tile(N, pid, n, NP, BLOCK)
    start = pid.to(tl.int64) * BLOCK * (n * n)
    soft = _softmax(tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32), valid, row_ok)
    g = tl.load(dy_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    # Pairs (rows, columns) p = iters - 1, ..., 1, last first. Pair p's input is the state after the first
    # column step and p - 1 pairs, recomputed from the softmax.
    for q in range(iters - 1):
        m, _ = _columns(soft, FLOOR)
        for _ in range(iters - 2 - q):
            m, _ = _rows(m, row_ok)
            m, _ = _columns(m, FLOOR)
        m, s_row = _rows(m, row_ok)
        y, s_col = _columns(m, FLOOR)
        g = _rows_grad(_columns_grad(g, y, s_col, valid), m, s_row, valid)
    y, s_col = _columns(soft, FLOOR)
    g = _columns_grad(g, y, s_col, valid)
    dx = soft * (g - tl.sum(g * soft, axis=2)[:, :, None])
    tl.store(dx_ptr + start + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration and host functions
# ----------------------------------------------------------------------------------------------------------


def _meta(n: int, device: torch.device) -> dict:
    """Tokens are independent and tiny (n = 4: 16 values), and the kernels are latency-bound chains of small
    reductions: on the GPU about 4 values a thread and many small programs (N ~ 8192 a site gives ~256
    programs of 4 warps, all resident at once); on the interpreter few, large programs run faster."""
    np_ = triton.next_power_of_2(n)
    meta = {"n": n, "NP": np_, "FLOOR": COLUMN_FLOOR}
    if device.type == "cpu":
        return {**meta, "BLOCK": 64}
    return {**meta, "BLOCK": max(1, 512 // (np_ * np_)), "num_warps": 4}


def forward(logits: Tensor, iters: int) -> Tensor:
    N, n, _ = logits.shape
    x = logits.contiguous()
    out = torch.empty_like(x)
    if N:
        meta = _meta(n, x.device)
        launch(_sinkhorn_fwd_kernel, (triton.cdiv(N, meta["BLOCK"]),), (x, out, N, iters), meta, x.device)
    return out


def backward(grad: Tensor, logits: Tensor, iters: int) -> Tensor:
    N, n, _ = logits.shape
    x, dy = logits.contiguous(), grad.contiguous()
    dx = torch.empty_like(x)
    if N:
        meta = _meta(n, x.device)
        launch(_sinkhorn_bwd_kernel, (triton.cdiv(N, meta["BLOCK"]),), (x, dy, dx, N, iters), meta, x.device)
    return dx


# ----------------------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mhar_ablate::sinkhorn_fwd", mutates_args=())
def sinkhorn_fwd(logits: Tensor, iters: int) -> Tensor:
    """Doubly stochastic (N, n, n) from logits (N, n, n)."""
    return forward(logits, iters)


@sinkhorn_fwd.register_fake
def _sinkhorn_fwd_fake(logits, iters):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("mhar_ablate::sinkhorn_bwd", mutates_args=())
def sinkhorn_bwd(grad: Tensor, logits: Tensor, iters: int) -> Tensor:
    """Gradient of the logits, the forward recomputed from them."""
    return backward(grad, logits, iters)


@sinkhorn_bwd.register_fake
def _sinkhorn_bwd_fake(grad, logits, iters):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, iters = inputs
    ctx.save_for_backward(logits)
    ctx.iters = iters


def _backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    return sinkhorn_bwd(grad, logits, ctx.iters), None


sinkhorn_fwd.register_autograd(_backward, setup_context=_setup_context)


def sinkhorn_triton(logits: Tensor, iters: int) -> Tensor:
    """Doubly stochastic (..., n, n) from logits (..., n, n), fp32, ``iters`` >= 1 (``mhc.sinkhorn``)."""
    n = logits.shape[-1]
    return sinkhorn_fwd(logits.reshape(-1, n, n), iters).view(logits.shape)
