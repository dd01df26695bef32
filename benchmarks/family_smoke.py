"""Correctness smoke of every residual kind on a GPU: a few training steps in bf16 autocast on a learnable
token stream, eager (each kind's own path: the fused Triton one for attnres, mhar and delta), without NaN
and with the loss coming down; and, for the kinds that start as pre-norm, the first loss against the
baseline's at the same seed (the sublayers start from the same weights, so it should match to bf16 noise).

    PYTHONPATH=$PWD python3 benchmarks/family_smoke.py --json /tmp/smoke.json     # exit 1 if a kind fails

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
import torch.nn.functional as F

from mhar_ablate.config import build_config
from mhar_ablate.model import Decoder
from mhar_ablate.model.residual import RESIDUALS
from mhar_ablate.training.run import arm_label

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
    cfg = build_config(overrides={"model.preset": args.preset, **over})
    torch.manual_seed(0)
    model = Decoder(cfg.model, cfg.residual, args.vocab).to(device)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, t0 = [], time.perf_counter()
    for x, y in batches(args.vocab, args.batch, args.seq, args.steps, device):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"kind": cfg.residual.kind, "label": arm_label(cfg), "first_loss": losses[0], "last_loss": losses[-1],
            "finite": all(math.isfinite(v) for v in losses), "seconds": round(time.perf_counter() - t0, 2),
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
            r["ok"] = r["finite"] and r["last_loss"] < 0.9 * r["first_loss"] and (
                r["case"] not in PRENORM or abs(r["first_vs_baseline"]) < 2e-2)
            peak = "–" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
            print(f"{r['case']:<18} {r['first_loss']:8.4f} {r['last_loss']:8.4f} {r['first_vs_baseline']:+20.2e} "
                  f"{r['seconds']:6.1f} {peak:>8}  {'ok' if r['ok'] else 'FAILED'}")
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
