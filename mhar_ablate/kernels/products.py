"""Helpers of the routing kernels' matrix-product forms (``history.shared_dot``, ``history.shared_stacked``,
``column_group``), whose programs each take one routing head: the head's channel blocks, an fp32 operand
as two parts of a 16-bit dtype, and the stacking of two [R, C] blocks as the halves of one product's rows.

A product on tensor cores takes 16-bit operands. A query row or a softmax weight rounded to bf16 alone
moves a score or an output by up to 2^-9 of a term; split into hi + lo parts (hi = x rounded, lo = the
rest rounded) the two products carry about 16 bits of it. fp32 sources take fp32 products, and lo = 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["head_columns", "split", "query_operand", "stack_halves", "sum_halves"]


@triton.jit
def head_columns(head, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_DB: tl.constexpr):
    """Head ``head``'s channels as a [1, DA] block and a [1, BLOCK_DB] one (the rest of a head split in two,
    ``launch.head_meta``): the offsets within each block, their columns in a row, and the rest's mask."""
    ja = tl.arange(0, DA)[None, :]
    jb = tl.arange(0, BLOCK_DB)[None, :]
    return ja, jb, head * DH + ja, head * DH + DA + jb, jb < DB


@triton.jit
def split(x, dt: tl.constexpr):
    """fp32 ``x`` as hi + lo, both of dtype ``dt`` (lo is 0 when ``dt`` is fp32)."""
    hi = x.to(dt)
    return hi, (x - hi.to(tl.float32)).to(dt)


@triton.jit
def query_operand(qg_ptr, G, D: tl.constexpr, R: tl.constexpr, col_a, col_b, b_ok, BLOCK_DB: tl.constexpr,
                  HAS_B: tl.constexpr, dt: tl.constexpr):
    """The sites' query rows as a product's [2 R, .] operand of dtype ``dt``, for a head's two blocks (at
    ``col_a`` and ``col_b``, the latter a placeholder without HAS_B): row i holds site i % R (zeros from G on),
    its hi part in the first half, its lo part in the second. Built elementwise: stacked with
    ``stack_halves``, its layout kept the sources' loads out of the pipeline."""
    i = tl.arange(0, 2 * R)[:, None]
    q_site = (i % R) * D
    q_hi, q_lo = split(tl.load(qg_ptr + q_site + col_a, mask=i % R < G, other=0.0), dt)
    q_a = tl.where(i < R, q_hi, q_lo)
    q_b = tl.zeros([2 * R, BLOCK_DB], dt)
    if HAS_B:
        q_hi, q_lo = split(tl.load(qg_ptr + q_site + col_b, mask=(i % R < G) & b_ok, other=0.0), dt)
        q_b = tl.where(i < R, q_hi, q_lo)
    return q_a, q_b


@triton.jit
def stack_halves(a, b):
    """[R, C] and [R, C] -> [2 R, C], the rows of ``a`` then those of ``b``. In a one-warp matrix product's
    accumulator layout row r + R lies in the same thread as row r (R = 8 or 16), so ``sum_halves``
    splits them back without an element leaving its thread."""
    R: tl.constexpr = a.shape[0]
    C: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), [2 * R, C])


@triton.jit
def sum_halves(x):
    """[2 R, C] -> [R, C]: row r plus row R + r."""
    R: tl.constexpr = x.shape[0] // 2
    C: tl.constexpr = x.shape[1]
    return tl.sum(tl.reshape(x, [2, R, C]), axis=0)
