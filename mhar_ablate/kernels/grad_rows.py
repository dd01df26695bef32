"""The sites' output gradients where autograd left them, for the backward by source (``column``,
``column_group``) to read in place.

Each routing site's output gradient is a tensor of its own, made by the sublayer's backward. The passes by
source read every gradient of the sites that read a slot, so they need one way to reach any of them: a
table of offsets, in elements, from one base tensor of the same dtype. Site s's (N, d) rows start at
``base`` + ``offsets[s]``. Reading the tensors where they lie saves the copy of each gradient into a
stacked buffer (one source-sized write a site).

Where the table costs the passes more than the copies would (measured by width: ``column.grads_in_place``),
the gradients are copied into one (sites, N, d) buffer instead and the kernels compute each site's offset
(``stacked``), as they do for every caller that holds its gradients stacked (tests, benchmarks).

The table lives on the device and is written by the kernel that first reads each gradient (``history``'s
backward prologue stores the offset it is given), not from the host: under CUDA-graph capture that store
is part of a kernel already launched, and the offset, fixed at capture, is right at every replay, since a
replay reuses the addresses its capture recorded.

A kernel adds ``tl.multiple_of(offset, ALIGN)`` to the base pointer, so that its loads stay 16-byte
vector loads; ``offset_of`` refuses a tensor whose offset breaks that (the caller copies it instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["GradRows", "ALIGN", "ALIGN_C", "site_offsets"]

# The offsets' divisibility the kernels assume, in elements: 16 bytes of bf16, 32 of fp32. Tensors from
# torch's allocators start 512-byte aligned. ALIGN_C: the same, as a kernel reads it.
ALIGN = 8
ALIGN_C = tl.constexpr(ALIGN)


@triton.jit
def site_offsets(gtab_ptr, s, S, ND, TABLE: tl.constexpr):
    """The output-gradient offsets of sites ``s`` (a tensor of site indices): from the table (0 for s >= S,
    whose rows the caller does not load), or s N D where the gradients are stacked (``GradRows.stacked``)."""
    if TABLE:
        return tl.multiple_of(tl.load(gtab_ptr + s, mask=s < S, other=0), ALIGN_C)
    return s.to(tl.int64) * ND


@dataclass(frozen=True)
class GradRows:
    """Sites' (N, d) output gradients: stacked in ``base`` (S, N, d), site s at s N d (``offsets`` None), or
    site s's rows at ``offsets[s]`` elements from ``base``'s first."""

    base: Tensor  # the stacked gradients, or any tensor of their dtype that lives as long as they do
    offsets: Tensor | None = None  # (sites,) int64, on the device

    @staticmethod
    def stacked(grad_out: Tensor) -> "GradRows":
        """The rows of a contiguous (S, N, d) tensor."""
        if not grad_out.is_contiguous() or grad_out.dim() != 3:
            raise ValueError("GradRows.stacked takes a contiguous (S, N, d) tensor")
        return GradRows(grad_out)

    @staticmethod
    def of(grads: list[Tensor], base: Tensor | None = None) -> "GradRows":
        """The rows of separate (N, d) tensors, each where it lies (the table written from the host; the
        caller keeps the tensors alive)."""
        base = grads[0] if base is None else base
        offsets = [GradRows(base).offset_of(g) for g in grads]
        if None in offsets:
            raise ValueError("GradRows.of: every gradient must be contiguous, of the base's dtype and device, and "
                             f"aligned to {ALIGN} elements from it")
        return GradRows(base, torch.tensor(offsets, dtype=torch.int64, device=base.device))

    def __len__(self) -> int:
        return self.base.shape[0] if self.offsets is None else self.offsets.shape[0]

    def sites(self, at: slice | int) -> "GradRows":
        """The rows of sites ``at`` (a slice of the sites, or from site ``at`` on)."""
        at = at if isinstance(at, slice) else slice(at, None)
        return GradRows(self.base[at]) if self.offsets is None else GradRows(self.base, self.offsets[at])

    def kernel_args(self) -> tuple[Tensor, Tensor, bool]:
        """What a kernel takes: the base, the table (the base again when stacked) and whether it reads the table
        (its TABLE constant)."""
        return self.base, self.base if self.offsets is None else self.offsets, self.offsets is not None

    def offset_of(self, grad: Tensor) -> int | None:
        """``grad``'s offset from the base in elements, or None where a kernel cannot read it in place (another
        dtype or device, not contiguous, or not aligned to ALIGN elements)."""
        size = self.base.element_size()
        delta = grad.data_ptr() - self.base.data_ptr()
        if (grad.dtype != self.base.dtype or grad.device != self.base.device or not grad.is_contiguous()
                or delta % (size * ALIGN) or grad.data_ptr() % 16):
            return None
        return delta // size
