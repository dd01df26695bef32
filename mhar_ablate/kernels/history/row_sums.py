"""``add_row_sums``: ``out += parts.sum(0)`` over a persistent kernel's per-program partial sums, in one
kernel where torch takes two, in a fixed order (deterministic)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import launch
from . import config


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
    block_p, block_d, warps, stages = config.ROW_SUM_CONFIG if parts.device.type != "cpu" else (4, 16, 1, 1)
    meta = {"BLOCK_P": block_p, "BLOCK_D": block_d, "STAGES": stages}
    if parts.device.type != "cpu":
        meta["num_warps"] = warps
    launch(_add_row_sums_kernel, (triton.cdiv(d, block_d), G),
           (parts, out, P, d, parts.stride(0), parts.stride(1), out.stride(0)), meta, parts.device)
