"""The public routing op, ``mhar_route``, with the contract SPEC.md fixes: argument checks, then a
backend (``reference``, ``triton``, or ``auto`` = triton on CUDA tensors, reference elsewhere)."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels.reference import mhar_route_reference

BACKENDS = ("auto", "reference", "triton")


def _check(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(sources, Tensor) or sources.dim() != 4:
        shape = tuple(sources.shape) if isinstance(sources, Tensor) else type(sources).__name__
        raise ValueError(f"sources must be one tensor of shape (S, B, T, d), got {shape}")
    S, _, _, d = sources.shape
    if S == 0:
        raise ValueError("sources is empty: S = 0, routing needs at least one source")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if d % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide d={d}")
    for name, t in (("query", query), ("key_weight", key_weight)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (d,):
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape ({d},) to match sources, got {shape}")
        if t.device != sources.device:
            raise ValueError(f"{name} is on {t.device} but sources are on {sources.device}")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return backend


def mhar_route(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float = 1e-6,
               backend: str = "auto") -> Tensor:
    """Softmax-over-depth mixture of ``sources`` (S, B, T, d) with ``num_heads`` routing heads.

    Returns (B, T, d) in the dtype of ``sources``; differentiable in ``sources``, ``query`` and
    ``key_weight``. Raises ``ValueError`` naming the bad argument.
    """
    _check(sources, query, key_weight, num_heads, backend)
    chosen = resolve_backend(backend, sources.device)
    if chosen == "reference":
        return mhar_route_reference(sources, query, key_weight, num_heads, eps)
    from .kernels.mhar_triton import mhar_route_triton  # imported lazily: triton is heavy to import

    return mhar_route_triton(sources, query, key_weight, num_heads, eps)
