"""Routing alone, at a model's depth: the fused path's forward and backward over a whole stack of routing
sites, with the sublayers replaced by a per-channel scale, replayed from a CUDA graph (no host time).

This isolates what issue 6 is about, the routing's cost per training step, from the sublayers (the
matrix products that the baseline pays too), and sweeps what decides it: sites per shared pass
(``sites_per_pass``) and the kernels' launch configurations (``HISTORY_CONFIG``, ``COLUMN_CONFIG``). Each
configuration is checked first against the reference path on a smaller token count (loss and the
gradients of the embedding, the scales, the queries and the key gains), then timed.

    PYTHONPATH=$PWD python3 benchmarks/bench_stack.py --out $OUT              # paper350m: d 1024, 24 layers
    PYTHONPATH=$PWD python3 benchmarks/bench_stack.py --d 1280 --layers 36   # paper1b

Rows: grouping, sites per pass, the launch configs of the head-tiled forward (tokens per program, warps,
sources in flight) and of the column backward (tokens per program, warps), forward ms, forward+backward ms, and the same for the baseline residual (a running
sum), so that routing's own share reads off as the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mhar_ablate.config import build_config
from mhar_ablate.kernels import column, history
from mhar_ablate.variants import build_residual


def make(grouping: str, d: int, layers: int, heads: int, backend: str, device: str, query_std: float = 0.5):
    over = {"model.d_model": str(d), "model.n_layers": str(layers), "model.n_heads": "8", "model.n_kv_heads": "4",
            "model.ffn": str(4 * d), "residual.kind": "mhar" if heads > 1 else "attnres", "residual.grouping": grouping,
            "residual.backend": backend, "residual.query_init": f"normal:{query_std}"}
    if heads > 1:
        over["residual.heads"] = str(heads)
    cfg = build_config(overrides=over)
    torch.manual_seed(0)
    res = build_residual(cfg.residual, cfg.model).to(device)
    with torch.no_grad():
        res.key_weight.add_(0.3 * torch.randn_like(res.key_weight))
    res.record = False
    return res


def baseline_residual(device: str):
    cfg = build_config(overrides={"residual.kind": "baseline"})
    return build_residual(cfg.residual, cfg.model).to(device)


class Stack(torch.nn.Module):
    """Routing sites with a per-channel affine map for sublayers: the residual's own cost, and little else.
    The shifts keep the sources apart (with scales alone every source would be nearly the embedding, and
    the routing gradients a difference of near-equal numbers that bf16 cannot resolve); the scales stay
    under 0.5 in size, so that no channel grows with depth (a chaotic stack would make bf16 and fp32 runs
    disagree whatever the kernels do)."""

    def __init__(self, residual, layers: int, d: int, device: str, dtype: torch.dtype):
        super().__init__()
        self.residual = residual
        gen = torch.Generator(device=device).manual_seed(4)
        scale = 0.5 * torch.tanh(torch.randn(2 * layers, d, device=device, generator=gen))
        self.scale = torch.nn.Parameter(scale.to(dtype))
        self.register_buffer("shift", torch.randn(2 * layers, d, device=device, generator=gen).to(dtype))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        state = self.residual.start(x0)
        for site in range(self.scale.shape[0]):
            x = self.residual.read(state, site)
            self.residual.write(state, site, x * self.scale[site] + self.shift[site])
        return self.residual.finish(state)


def grads(stack: Stack, x0: torch.Tensor, probe: torch.Tensor):
    stack.zero_grad(set_to_none=True)
    x0 = x0.detach().requires_grad_(True)
    loss = (stack(x0).float() * probe).sum()
    loss.backward()
    named = {"x0": x0.grad, **{n: p.grad for n, p in stack.named_parameters()}}
    return loss.item(), {n: g.detach().float().clone() for n, g in named.items() if g is not None}


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(grouping, d, layers, heads, spp, tokens, device) -> dict:
    """Fused (bf16) against the reference in fp32 and in bf16, on the same weights and inputs."""
    ref = make(grouping, d, layers, heads, "reference", device)
    fused = make(grouping, d, layers, heads, "triton", device)
    fused.sites_per_pass = spp
    gen = torch.Generator(device=device).manual_seed(1)
    x0 = torch.randn(1, tokens, d, device=device, generator=gen)
    probe = torch.randn(1, tokens, d, device=device, generator=gen)
    loss_t, truth = grads(Stack(ref, layers, d, device, torch.float32), x0, probe)
    out = {}
    for name, res in (("ref-bf16", ref), ("fused-bf16", fused)):
        loss, g = grads(Stack(res, layers, d, device, torch.bfloat16), x0.bfloat16(), probe)
        out[name] = {"loss": abs(loss - loss_t) / abs(loss_t), **{n: rel(g[n], t) for n, t in truth.items()}}
    worst_ref = max(v for k, v in out["ref-bf16"].items())
    worst_fused = max(v for k, v in out["fused-bf16"].items())
    out["ok"] = worst_fused <= max(3 * worst_ref, 0.02)
    return out


def graph_time(fn, steps: int = 20) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (captured after warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return sorted(times)[len(times) // 2]


def time_stack(res, layers, d, tokens, device) -> tuple[float, float]:
    stack = Stack(res, layers, d, device, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(2)
    x0 = torch.randn(1, tokens, d, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    probe = torch.randn(1, tokens, d, device=device, generator=gen, dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            stack(x0)

    def fwd_bwd():
        (stack(x0) * probe).sum().backward()

    stack.zero_grad(set_to_none=False)
    f = graph_time(fwd)
    fb = graph_time(fwd_bwd)
    return f, fb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--check-tokens", type=int, default=512)
    p.add_argument("--groupings", default="full,block:4")
    p.add_argument("--sites-per-pass", default="1,2,4,8")
    p.add_argument("--configs", default="", help="extra rows with launch configs of the head-tiled forward and the "
                   "column backward: 'GROUPING:SITES:fwd=TOKENS,WARPS,STAGES,SOURCES:col=TOKENS,WARPS,STAGES;...' "
                   "(block:4 as block4; the forward's table for whole heads or split ones, by --d and --heads)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_stack_out"))
    p.add_argument("--budget", type=float, default=400.0, help="seconds; stop starting rows after this")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    dev = "cuda"
    rows = []
    L, d = args.layers, args.d
    print(f"stack: d {d}, {L} layers, H {args.heads}, {args.tokens} tokens; {torch.cuda.get_device_name()}", flush=True)
    base_f, base_fb = time_stack(baseline_residual(dev), L, d, args.tokens, dev)
    rows.append({"grouping": "baseline residual", "fwd_ms": base_f, "fwd_bwd_ms": base_fb})
    print(f"baseline residual: fwd {base_f:.3f} ms, fwd+bwd {base_fb:.3f} ms", flush=True)

    variants = []
    for grouping in args.groupings.split(","):
        for spp in (int(x) for x in args.sites_per_pass.split(",")):
            variants.append((grouping, spp, None))
    for spec in filter(None, args.configs.split(";")):
        # "full:4:fwd=1,1,4,4:col=1,4,0"
        parts = spec.split(":")
        grouping = parts[0] if parts[0] != "block4" else "block:4"
        spp = int(parts[1])
        cfg = {}
        for item in parts[2:]:
            kind, vals = item.split("=")
            cfg[kind] = tuple(int(v) for v in vals.split(","))
        variants.append((grouping, spp, cfg))

    saved = {k: dict(v) for k, v in history.HISTORY_CONFIG.items()}
    saved_column = column.COLUMN_CONFIG
    for grouping, spp, cfg in variants:
        if time.time() - t0 > args.budget:
            print(f"budget reached: {grouping} spp {spp} not run", flush=True)
            continue
        history.HISTORY_CONFIG = {k: dict(v) for k, v in saved.items()}
        column.COLUMN_CONFIG = (cfg or {}).get("col", saved_column)
        g = 1 << (max(spp, 1) - 1).bit_length()
        if cfg and "fwd" in cfg:
            history.HISTORY_CONFIG["fwd"][g] = history.HISTORY_CONFIG["fwd_split"][g] = cfg["fwd"]
        split = "fwd_split" if (d // args.heads) & (d // args.heads - 1) else "fwd"
        fwd = history.HISTORY_CONFIG[split].get(g) if spp > 2 else "row kernels"
        label = f"fwd {fwd}, column {column.column_config(d)}"
        row = {"grouping": grouping, "sites_per_pass": spp, "config": str(label)}
        try:
            row["check"] = check(grouping, d, L, args.heads, spp, args.check_tokens, dev)
            res = make(grouping, d, L, args.heads, "triton", dev)
            res.sites_per_pass = spp
            row["fwd_ms"], row["fwd_bwd_ms"] = time_stack(res, L, d, args.tokens, dev)
            row["status"] = "ok" if row["check"]["ok"] else "CHECK FAILED"
        except Exception as e:  # one row says what broke; the next still runs
            row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        ck = row.get("check", {})
        print(f"{grouping} spp {spp} {label}: {row['status']} fwd {row.get('fwd_ms', float('nan')):.3f} "
              f"fwd+bwd {row.get('fwd_bwd_ms', float('nan')):.3f} ms; worst rel err fused "
              f"{max((v for k, v in ck.get('fused-bf16', {}).items()), default=float('nan')):.2e} ref "
              f"{max((v for k, v in ck.get('ref-bf16', {}).items()), default=float('nan')):.2e}", flush=True)
        with open(os.path.join(args.out, "stack.json"), "w") as f:
            json.dump(rows, f, indent=1)
        torch.cuda.empty_cache()
    print()
    print("| grouping | sites/pass | config | fwd ms | fwd+bwd ms | status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['grouping']} | {r.get('sites_per_pass', '–')} | {r.get('config', '–')} | "
              f"{r.get('fwd_ms', float('nan')):.3f} | {r.get('fwd_bwd_ms', float('nan')):.3f} | {r.get('status', 'ok')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
