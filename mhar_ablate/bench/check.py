"""``bench model --check``: the fused path against the reference on a small model, forward and gradients,
in each kernel form the rows take.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING
from .variants import Variant, kernel_forms


if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported inside the functions that run: the command line builds this parser for every command.

# ------------------------------------------------------------------------------------------------ the check


def _grads(model, idx, targets, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(grads: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> tuple[float, str]:
    errs = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in truth.items() if g.norm() > 0}
    name = max(errs, key=errs.get)
    return errs[name], name


def check_forms(device: torch.device, variants: list[Variant]) -> bool:
    """``check_fused`` in each shared-pass form that the fused rows take (``--stacked-config``), stopping at the
    first that fails."""
    for stacked in dict.fromkeys(v.stacked for v in variants if v.path == "fused") or [None]:
        with kernel_forms(stacked):
            if not check_fused(device, "" if stacked is None else f", stacked {stacked}"):
                return False
    return True


def check_fused(device: torch.device, label: str = "") -> bool:
    """The fused path against the reference on a small model (d 384, H 8: head width 48 = 32 + 16): loss
    and every gradient, in fp32 (tight) and under bf16 autocast (against an fp32 truth, no further from it
    than three times the bf16 reference, or 5 % for the worst parameter: a bug is off by far more), and
    bitwise determinism of the fused gradients; with the sublayers' pre-norms in the sublayers and folded
    into the routing kernels (``fold_norms``)."""
    import torch

    from ..config import build_config
    from ..model import Decoder

    ok = True
    tokens = (4, 256)
    cases = (("mhar", "full", 8, 1), ("mhar", "full", 8, 4), ("mhar", "block:4", 8, 1), ("mhar", "block:4", 8, 8),
             ("attnres", "full", 1, 1), ("attnres", "full", 1, 4))
    for (kind, grouping, heads, per_pass), fold in [(c, f) for f in (False, True) for c in cases]:
        over = {"model.preset": "small", "residual.kind": kind, "residual.grouping": grouping, "residual.heads": str(heads),
                "residual.query_init": "normal:0.1", "residual.backend": "reference"}
        cfg = build_config(overrides=over)
        torch.manual_seed(0)
        with torch.device(device):
            ref = Decoder(cfg.model, cfg.residual, 4096)
        with torch.no_grad():
            ref.residual.key_weight.add_(0.3 * torch.randn_like(ref.residual.key_weight))
        fused = copy.deepcopy(ref)
        fused.residual.backend = "triton"
        fused.residual.sites_per_pass = per_pass
        fused.residual.fold_norms = fold
        gen = torch.Generator(device=device).manual_seed(2)
        idx = torch.randint(0, 4096, tokens, device=device, generator=gen)
        targets = torch.randint(0, 4096, tokens, device=device, generator=gen)
        loss_t, truth = _grads(ref, idx, targets, autocast=False)
        loss_f32, g_f32 = _grads(fused, idx, targets, autocast=False)
        loss_r, g_r = _grads(ref, idx, targets, autocast=True)
        loss_f, g_f = _grads(fused, idx, targets, autocast=True)
        _, g_f2 = _grads(fused, idx, targets, autocast=True)
        e32, n32 = _worst(g_f32, truth)
        er, _ = _worst(g_r, truth)
        ef, nf = _worst(g_f, truth)
        deterministic = all(torch.equal(g_f[n], g_f2[n]) for n in g_f)
        passed = (abs(loss_f32 - loss_t) <= 1e-4 * abs(loss_t) and e32 <= 1e-3 and deterministic
                  and ef <= max(3 * er, 0.05) and abs(loss_f - loss_t) <= max(3 * abs(loss_r - loss_t), 0.02))
        ok &= passed
        print(f"check {kind} {grouping} H={heads} sites/pass {per_pass}{', norms folded' if fold else ''}{label}: "
              f"fp32 loss {loss_t:.5f} fused {loss_f32:.5f}, worst grad rel err "
              f"{e32:.1e} ({n32}); bf16 vs fp32 truth: loss ref {loss_r - loss_t:+.1e} fused {loss_f - loss_t:+.1e}, "
              f"worst grad rel err ref {er:.1e} fused {ef:.1e} ({nf}); deterministic {deterministic}: "
              f"{'ok' if passed else 'FAILED'}", flush=True)
    return ok
