"""Inline PTX for two operations the compiler emits slower than the hardware allows, each beside the
portable form that Triton's interpreter (and any non-NVIDIA backend) runs; ``PTX`` picks one at compile
time, and ``use_ptx`` says where the PTX form applies.

* ``exp``: ``ex2.approx.ftz`` of ``x log2(e)``, one instruction. ``tl.exp`` compiles to ``ex2.approx``
  without flush-to-zero, which ptxas wraps in a range test and two predicated multiplies: in the routing
  forward's loop (bound by the instructions it issues) 17 of the 252 instructions of an iteration at
  d = 1024, two sources, 4 stages (benchmarks/kernel_resources.py). Results below 2^-126 become 0, which
  for a softmax weight relative to its running maximum changes nothing.
* ``store_f32``: a masked fp32 store that leaves its operands in the layout they were computed in.
  ``tl.store`` of a reduction's result converts it to a store layout first, through shared memory with a
  barrier, once per loop iteration in the column kernel. Every lane that holds a copy of an element
  stores the same word to the same address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["exp", "store_f32", "use_ptx"]

LOG2E = tl.constexpr(1.4426950408889634)


def use_ptx(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` take the PTX forms: compiled for an NVIDIA GPU."""
    return device.type == "cuda" and torch.version.hip is None


@triton.jit
def exp(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * LOG2E], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def store_f32(ptr, value, mask, PTX: tl.constexpr):
    if PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }", "=r,l,f,r",
            [ptr.to(tl.int64, bitcast=True), value, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, value, mask=mask)
