"""Plain PyTorch reference of the MHAR routing op (SPEC.md): the path used on machines without a GPU, and,
evaluated in float64 (``mhar_route_float64``, ``routing_logsumexp_float64``), the one oracle that the
kernels' tests and the benchmarks hold every fused kernel to.

For sources ``s`` of shape (S, B, T, d), query ``q`` and key gain ``g`` (both (d,)), with H routing heads
of width d/H:

    r_s      = rsqrt(mean_c s[s, c]^2 + eps)            (RMS over the full d)
    z[s, h]  = r_s * sum_{c in head h} s[s, c] * g[c] * q[c]
    a[:, h]  = softmax over s of z[:, h]                (fp32)
    out[h]   = sum_s a[s, h] * s[s, head h]

Folding ``g * q`` into one vector and scaling the per-head dot product by ``r_s`` afterwards is the same
arithmetic as normalising first, without materialising the normalised keys.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32 accumulation for half types; float64 stays float64 (the tests' ground truth)."""
    return torch.promote_types(t.dtype, torch.float32)


def routing_logits(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """Depth logits ``z`` of shape (S, B, T, H), in fp32 (float64 for float64 sources)."""
    S, B, T, d = sources.shape
    acc = _acc_dtype(sources)
    x = sources.to(acc)
    rms = torch.rsqrt(x.pow(2).mean(-1) + eps)  # (S, B, T)
    # The per-head dot products as one matmul with a block-diagonal (d, H) matrix of q * g: with narrow
    # heads (d/H = 4) this is several times faster on the CPU than a reduction over a (..., H, d/H) view.
    qg = (query.to(acc) * key_weight.to(acc)).view(num_heads, d // num_heads, 1)
    dots = x @ torch.block_diag(*qg)  # (S, B, T, H)
    return dots * rms.unsqueeze(-1)


def routing_weights(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """Softmax-over-depth weights ``a`` of shape (S, B, T, H), in fp32."""
    return routing_logits(sources, query, key_weight, num_heads, eps).softmax(dim=0)


def mhar_route_reference(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int, eps: float = 1e-6) -> Tensor:
    """Route ``sources`` (S, B, T, d) to one (B, T, d) input; output in the dtype of ``sources``."""
    d = sources.shape[-1]
    a = routing_weights(sources, query, key_weight, num_heads, eps)  # (S, B, T, H)
    a = a.repeat_interleave(d // num_heads, dim=-1)  # each head's weight over its channels
    out = (a * sources.to(a.dtype)).sum(0)
    return out.to(sources.dtype)


# ----------------------------------------------------------------------------------------------------------
# The float64 oracle
# ----------------------------------------------------------------------------------------------------------


def mhar_route_float64(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int,
                       eps: float = 1e-6) -> Tensor:
    """The reference evaluated in float64 on the inputs' values (bf16 inputs as rounded): a float64
    (B, T, d) output, differentiable in all three inputs."""
    return mhar_route_reference(sources.double(), query.double(), key_weight.double(), num_heads, eps)


def routing_logsumexp_float64(sources: Tensor, query: Tensor, key_weight: Tensor, num_heads: int,
                              eps: float = 1e-6) -> Tensor:
    """Log-sum-exp over depth of the routing logits, (B, T, H) float64: the statistic the kernels save for
    their backward."""
    return routing_logits(sources.double(), query.double(), key_weight.double(), num_heads, eps).logsumexp(0)


def query_grads_float64(dzr: Tensor, sources: Tensor, num_heads: int, n_sites: int, block: int) -> Tensor:
    """The sites' query-row gradients (n_sites, d) float64 from every slot's ``dz * r``: slot j of
    ``sources`` (slots, N, d) is read by sites ``block * j`` .. ``n_sites - 1``, and its (H, S_j, N) block
    follows those of the slots before it in the flat ``dzr``; ``dqg[s, c] = sum_j sum_n dzr_j[h(c), s, n]
    x_j[n, c]``."""
    n_slots, N, d = sources.shape
    out = torch.zeros((n_sites, d), dtype=torch.float64, device=sources.device)
    at = 0
    for j in range(n_slots):
        first = block * j
        S = n_sites - first
        if S <= 0:
            break
        part = dzr[at:at + num_heads * S * N].view(num_heads, S, N).double()
        at += num_heads * S * N
        x = sources[j].double().view(N, num_heads, d // num_heads)
        out[first:] += torch.einsum("hsn,nhc->shc", part, x).reshape(S, d)
    return out


# The floor of a column sum in Sinkhorn-Knopp (mHC's reference and its kernel): an all-zero column stays
# finite.
COLUMN_FLOOR = 1e-30
