"""Static Hyper-Connections under torch.compile: the package's formulation (weights broadcast per token, so
that their gradient is a per-token reduction over d and a sum over tokens) against 2-D weights (their
gradient a global reduction over B·T·d per output), with dynamic HC for reference.

A chain of ``--sites`` HC sites (read -> a fixed random linear d -> d -> write) over the package's
``HyperConnections`` (n = 4), compiled with torch.compile (default mode) and timed forward+backward:
warm-up, then the median of ``--iters`` iterations (CUDA events on a GPU, wall clock on the CPU).
``--profile`` lists each variant's top 5 kernels by device time (torch.profiler). Run from the repository
root:

    PYTHONPATH=$PWD python3 benchmarks/bench_hc_static.py                      # B 8, T 1024, d 1024, 8 sites
    PYTHONPATH=$PWD python3 benchmarks/bench_hc_static.py --profile
    PYTHONPATH=$PWD python3 benchmarks/bench_hc_static.py --device cpu --batch 1 --seq 16 --d-model 64 \\
        --sites 2 --iters 2                                                    # smoke check

Rows: variant, ms per forward+backward, ms per site, and the ratio to dynamic HC's time.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhar_ablate.config import build_config
from mhar_ablate.variants.hc import HyperConnections


class GlobalStaticHC(HyperConnections):
    """Static HC with its 2-D weights under torch.compile too: their gradient one global reduction per weight."""

    def coefficients(self, H: Tensor, site: int) -> tuple[Tensor, Tensor]:
        if self.dynamic:
            return super().coefficients(H, site)
        return self.static_alpha[site], self.static_beta[site]


def make_hc(dynamic: bool, d: int, sites: int, device: str, cls: type = HyperConnections) -> HyperConnections:
    over = {"model.d_model": str(d), "model.n_layers": str((sites + 1) // 2), "model.n_heads": "8",
            "model.n_kv_heads": "4", "model.ffn": str(4 * d), "residual.kind": "hc", "residual.hc.rate": "4",
            "residual.hc.dynamic": str(dynamic).lower()}
    cfg = build_config(overrides=over)
    torch.manual_seed(0)
    return cls(cfg.residual, cfg.model).to(device)


class Chain(nn.Module):
    """``sites`` HC sites, each sublayer a fixed random linear map (no gradient of its own) under autocast."""

    def __init__(self, hc: HyperConnections, sites: int, d: int, device: str, autocast: bool):
        super().__init__()
        self.hc, self.sites, self.autocast = hc, sites, autocast
        gen = torch.Generator(device=device).manual_seed(3)
        self.register_buffer("weight", torch.randn(sites, d, d, device=device, generator=gen) / d ** 0.5)

    def forward(self, x0: Tensor) -> Tensor:
        state = self.hc.start(x0)
        with torch.autocast(x0.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for site in range(self.sites):
                h = self.hc.read(state, site)
                self.hc.write(state, site, F.linear(h, self.weight[site]))
        return self.hc.finish(state)


def timed(fn, device: str, warmup: int, iters: int) -> float:
    """Median ms of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def top_kernels(fn, device: str, k: int = 5) -> str:
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=k)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--sites", type=int, default=8)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="bf16: the sublayers under autocast")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="each variant's top 5 kernels by device time")
    args = p.parse_args()
    dev, B, T, d, S = args.device, args.batch, args.seq, args.d_model, args.sites
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"hc static: B {B}, T {T}, d {d}, n 4, {S} sites, {args.dtype}; {name} | torch {torch.__version__}",
          flush=True)
    variants = [("hc-static (per-token)", make_hc(False, d, S, dev)),
                ("hc-static (global, old)", make_hc(False, d, S, dev, GlobalStaticHC)),
                ("hc-dynamic", make_hc(True, d, S, dev))]
    gen = torch.Generator(device=dev).manual_seed(1)
    x0 = torch.randn(B, T, d, device=dev, generator=gen).requires_grad_(True)
    gout = torch.randn(B, T, d, device=dev, generator=gen)
    rows = []
    for label, hc in variants:
        chain = Chain(hc, S, d, dev, args.dtype == "bf16")
        torch._dynamo.reset()
        compiled = torch.compile(chain)

        def step():
            chain.zero_grad(set_to_none=True)
            x0.grad = None
            compiled(x0).backward(gout)

        t = time.time()
        step()
        print(f"  {label}: compiled in {time.time() - t:.0f}s", flush=True)
        ms = timed(step, dev, args.warmup, args.iters)
        rows.append((label, ms))
        if args.profile:
            print(f"== {label}: top 5 kernels\n{top_kernels(step, dev)}", flush=True)
        del chain, compiled
        if dev == "cuda":
            torch.cuda.empty_cache()
    torch._dynamo.reset()
    ref = rows[-1][1]
    print("\n| variant | ms fwd+bwd | ms per site | / dynamic |\n|---|---|---|---|")
    for label, ms in rows:
        print(f"| {label} | {ms:.3f} | {ms / S:.3f} | {ms / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
