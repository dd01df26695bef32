"""The head-tiled shared-pass kernels (``kernels/history.py``) against the plain PyTorch reference, through
Triton's interpreter in fp32: forward outputs and log-sum-exps of G sites over one history, and the
backward's source and query gradients once the RMS part is finalised, over awkward shapes (head widths
split 8 + 4, token counts that are not a multiple of the tile, a padded site count, a single source) and
every tile size and prefetch depth the launch table can choose."""

from __future__ import annotations

import pytest
import torch

from mhar_ablate.kernels import history
from mhar_ablate.kernels.reference import mhar_route_reference, routing_logits

EPS = 1e-6


def _reference(src, qg, H, grad_out):
    """Each site's output, log-sum-exp (G, H, N) and the gradients of sum_k <g_k, out_k> by autograd."""
    S, N, d = src.shape
    src = src.detach().double().requires_grad_(True)
    qg = qg.detach().double().requires_grad_(True)
    ones = torch.ones(d, dtype=torch.float64)
    outs, lses = [], []
    for k in range(qg.shape[0]):
        outs.append(mhar_route_reference(src.view(S, 1, N, d), qg[k], ones, H, EPS).view(N, d))
        lses.append(routing_logits(src.view(S, 1, N, d), qg[k], ones, H, EPS).logsumexp(0).view(N, H).t())
    loss = sum((o * g.double()).sum() for o, g in zip(outs, grad_out))
    dsrc, dqg = torch.autograd.grad(loss, (src, qg))
    return torch.stack(outs).detach(), torch.stack(lses).detach(), dsrc, dqg


def _inputs(S, N, d, G, seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(S, N, d, generator=gen) * (1 + torch.rand(S, N, 1, generator=gen))
    qg = torch.randn(G, d, generator=gen)
    grad_out = torch.randn(G, N, d, generator=gen)
    return src, qg, grad_out


def _rms(src):
    return torch.rsqrt(src.pow(2).mean(-1) + EPS)


@pytest.mark.parametrize("S,N,d,H,G", [
    (5, 7, 48, 4, 3),  # head width 12 = 8 + 4; 7 tokens in tiles of 2 or 4; 3 sites padded to 4
    (1, 5, 32, 8, 2),  # one source, head width 4
    (4, 6, 64, 2, 4),
])
@pytest.mark.parametrize("block_n,prefetch", [(1, 1), (2, 2), (4, 3)])
def test_shared_pass_matches_the_reference(monkeypatch, S, N, d, H, G, block_n, prefetch):
    monkeypatch.setattr(history, "_INTERPRETER_CONFIG", (block_n, 1, prefetch))
    src, qg, grad_out = _inputs(S, N, d, G, seed=S * 100 + N)
    out_r, lse_r, dsrc_r, dqg_r = _reference(src, qg, H, grad_out)

    rms = _rms(src)
    out0 = torch.full((N, d), float("nan"))
    rest = torch.full((G - 1, N, d), float("nan"))
    lse = torch.full((G, H, N), float("nan"))
    history.history_forward(src, rms, qg, H, out0, rest, lse)
    torch.testing.assert_close(out0, out_r[0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, out_r[1:].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_r.float(), rtol=1e-5, atol=1e-5)

    # Backward into buffers that already hold gradients (as later groups leave them): it must add.
    delta = torch.einsum("knhc,knhc->khn", grad_out.view(G, N, H, -1), out_r.float().view(G, N, H, -1)).contiguous()
    prior = torch.randn(S, N, d)
    grad = prior.clone()
    dr = torch.zeros(S, H, N)
    parts = history.history_backward(src, rms, grad, dr, True, qg, H, grad_out, lse_r.float().contiguous(), delta)
    for s in range(S):
        history.finalize_rms_grad(src[s], grad[s], rms[s], dr[s])
    torch.testing.assert_close(grad - prior, dsrc_r.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(parts.sum(0)[:G], dqg_r.float(), rtol=1e-4, atol=1e-4)


def test_backward_writes_fresh_gradients_when_told_not_to_add(monkeypatch):
    monkeypatch.setattr(history, "_INTERPRETER_CONFIG", (2, 1, 2))
    S, N, d, H, G = 3, 5, 32, 4, 2
    src, qg, grad_out = _inputs(S, N, d, G, seed=7)
    out_r, lse_r, dsrc_r, _ = _reference(src, qg, H, grad_out)
    delta = torch.einsum("knhc,knhc->khn", grad_out.view(G, N, H, -1), out_r.float().view(G, N, H, -1)).contiguous()
    rms = _rms(src)
    grad = torch.full((S, N, d), float("nan"))  # garbage that a write must not read
    dr = torch.zeros(S, H, N)
    history.history_backward(src, rms, grad, dr, False, qg, H, grad_out, lse_r.float().contiguous(), delta)
    for s in range(S):
        history.finalize_rms_grad(src[s], grad[s], rms[s], dr[s])
    torch.testing.assert_close(grad, dsrc_r.float(), rtol=1e-4, atol=1e-4)


def test_write_slot_stores_the_row_and_its_rms():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=gen) * 3
    slot = torch.full((6, 40), float("nan"))
    rms = torch.full((6,), float("nan"))
    history.write_slot(x, slot, rms, EPS)
    torch.testing.assert_close(slot, x)
    torch.testing.assert_close(rms, _rms(x))
