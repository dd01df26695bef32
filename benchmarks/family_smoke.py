"""Correctness smoke of every residual kind on a GPU: a few training steps in bf16 autocast on a learnable
token stream, eager by default (each kind's own path: the fused Triton one for attnres, mhar and delta),
without NaN and with the loss coming down; and, for the kinds that start as pre-norm, the first loss
against the baseline's at the same seed (the sublayers start from the same weights: it should match to
bf16 noise).

    PYTHONPATH=$PWD python3 benchmarks/family_smoke.py --json /tmp/smoke.json     # exit 1 if a kind fails

Each case trains with the step that ``train`` runs (``training/step.py``): on the GPU it is captured in a
CUDA graph and replayed, so a kind that cannot be captured fails here. ``--compile`` compiles each model
too (slow: a minute or more per case at the ``small`` preset).

The tokens follow a fixed random permutation (token t+1 = perm[token t], a fresh start per sequence): a
bigram table the model can learn in a few dozen steps, unlike uniform random tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from mhar_ablate.config import build_config
from mhar_ablate.model import Decoder
from mhar_ablate.variants import RESIDUALS
from mhar_ablate.training.run import arm_label
from mhar_ablate.training.step import TrainStep, make_loss, make_optimizer

# Every kind with its defaults, plus the settings that change a kind's structure.
CASES = {kind: {"residual.kind": kind} for kind in RESIDUALS} | {
    "hc-static": {"residual.kind": "hc", "residual.hc.dynamic": "false"},
    "mhar-block4": {"residual.kind": "mhar", "residual.grouping": "block:4"},
    "denseformer-4x2": {"residual.kind": "denseformer", "residual.denseformer.dilation": "4",
                        "residual.denseformer.period": "2"},
}
# The kinds whose initialisation is pre-norm at step 0 (hc: up to the output norm's eps).
PRENORM = {"delta", "hc", "hc-static", "denseformer", "denseformer-4x2", "muddformer"}


def batches(vocab: int, batch: int, seq: int, steps: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    perm = torch.randperm(vocab, generator=g)
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            x[:, t + 1] = perm[x[:, t]]
        x = x.to(device)
        yield x[:, :-1], x[:, 1:]


def run(over: dict, args, device: torch.device) -> dict:
    """Train one case with the step that ``train`` runs (training/step.py: on CUDA captured in a CUDA graph
    and replayed)."""
    cfg = build_config(overrides={"model.preset": args.preset, "optim.lr": str(args.lr), **over})
    torch.manual_seed(0)
    model = Decoder(cfg.model, cfg.residual, args.vocab).to(device)
    cuda = device.type == "cuda"
    opt = make_optimizer(model, cfg.optim, device)
    step = TrainStep(model, opt, make_loss(model, "default" if args.compile else None), grad_clip=cfg.optim.grad_clip,
                     autocast=torch.bfloat16 if cuda else None, device=device, cuda_graph=cuda)
    data = list(batches(args.vocab, args.batch, args.seq, args.steps, device))
    prepare_s = step.prepare(*data[0])
    t0 = time.perf_counter()
    out = torch.stack([step(x, y) for x, y in data])  # (steps, [loss, grad norm]), read once at the end
    losses = out[:, 0].tolist()
    return {"kind": cfg.residual.kind, "label": arm_label(cfg), "first_loss": losses[0], "last_loss": losses[-1],
            "finite": all(math.isfinite(v) for v in out.flatten().tolist()), "captured": step.captured,
            "note": step.note, "prepare_s": round(prepare_s, 1), "seconds": round(time.perf_counter() - t0, 2),
            "peak_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if cuda else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a check of the script itself (fp32)")
    p.add_argument("--compile", action="store_true", help="compile each model too (a minute or more per case)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("family_smoke.py: no GPU (--device cpu checks the script itself)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    rows, ok = [], True
    for name, over in CASES.items():
        try:
            row = {"case": name, **run(over, args, device)}
        except Exception as e:  # a row that says what broke; the next kind still runs
            row = {"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        rows.append(row)
    base = next(r for r in rows if r["case"] == "baseline")
    print(f"{'case':<18} {'first':>8} {'last':>8} {'Δ first vs baseline':>20} {'s':>6} {'peak GB':>8}  verdict")
    for r in rows:
        if "error" in r:
            r["ok"] = False
            print(f"{r['case']:<18} error: {r['error']}")
        else:
            r["first_vs_baseline"] = r["first_loss"] - base["first_loss"]
            # Captured where a GPU is: a kind that cannot be captured trains uncaptured, and says why.
            r["ok"] = r["finite"] and r["last_loss"] < 0.9 * r["first_loss"] and (
                r["case"] not in PRENORM or abs(r["first_vs_baseline"]) < 2e-2) and (
                r["captured"] or device.type != "cuda")
            peak = "–" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
            print(f"{r['case']:<18} {r['first_loss']:8.4f} {r['last_loss']:8.4f} {r['first_vs_baseline']:+20.2e} "
                  f"{r['seconds']:6.1f} {peak:>8}  {'ok' if r['ok'] else 'FAILED'}" + (f"  ({r['note']})" if r["note"] else ""))
        ok &= r["ok"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    print("smoke:", "every kind ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
