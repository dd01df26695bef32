"""The query-row gradients of a block site's backward: the persistent backward kernel's partial sums (one
row per program) added into the step's (sites, d) row, by ``history.add_row_sums`` in each launch
configuration against torch's ``rows += parts.sum(0)`` (two kernels). A step of ``block:4`` makes one such
sum for every site that reads a block's partial sum (42 at ``paper350m``); here that many calls are
replayed together from a CUDA graph, at each preset's width and programs per call, and each configuration's
result is checked against torch's first.

    PYTHONPATH=$PWD python3 benchmarks/bench_row_sums.py --configs '128,16,4,3;64,32,4,3;256,16,8,3'
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_stack import graph_time  # benchmarks/, beside this script
from mhar_ablate.config import RunConfig, load_preset
from mhar_ablate.kernels import history


def block_sites(preset: str) -> tuple[int, int]:
    """(width, sites that read a partial sum) of ``block:4`` (blocks of 8 sublayers) at a preset."""
    cfg = RunConfig()
    load_preset(cfg, preset)
    return cfg.model.d_model, sum(1 for s in range(2 * cfg.model.n_layers + 1) if s % 8)


def partials(d: int, H: int, N: int) -> torch.Tensor:
    """A block site's partial sums as its backward kernel writes them (the real program count)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(1, N, d, device="cuda", generator=gen).bfloat16()
    g = torch.randn(1, N, d, device="cuda", generator=gen).bfloat16()
    qg = torch.randn(1, d, device="cuda", generator=gen)
    lse = torch.randn(1, N, H, device="cuda", generator=gen).abs() + 2
    delta = torch.randn(1, N, H, device="cuda", generator=gen)
    return history.sites_backward(src, torch.empty_like(src), None, qg, H, 1e-6, g, lse, delta)[:, :1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="paper100m,paper350m,paper1b")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens a step (default 8,192)")
    parser.add_argument("--configs", default="", help="ROW_SUM_CONFIG entries to time beside the default: "
                        "'BLOCK_P,BLOCK_D,warps,stages;...'")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_row_sums.py times CUDA kernels; no GPU here", file=sys.stderr)
        return 2
    configs = [history.ROW_SUM_CONFIG] + [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    rows = []
    for preset in args.presets.split(","):
        d, calls = block_sites(preset)
        parts = partials(d, 8, args.tokens)
        out = torch.zeros(calls, d, device="cuda")

        def torch_sums():
            for s in range(calls):
                out[s:s + 1] += parts.sum(0)

        want = out.clone()
        torch_sums()
        want = out - want
        rows.append((preset, d, parts.shape[0], calls, "torch sum + add", graph_time(torch_sums), 0.0))
        for config in configs:
            history.ROW_SUM_CONFIG = config

            def fused_sums():
                for s in range(calls):
                    history.add_row_sums(parts, out[s:s + 1])

            out.zero_()
            fused_sums()
            err = ((out - want).norm() / want.norm()).item()
            rows.append((preset, d, parts.shape[0], calls, f"add_row_sums {config}", graph_time(fused_sums), err))
        history.ROW_SUM_CONFIG = configs[0]
    print("| preset | d | programs (rows) | calls | form | ms for the calls | us a call | rel. err. |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, d, programs, calls, form, ms, err in rows:
        print(f"| {preset} | {d} | {programs} | {calls} | {form} | {ms:.3f} | {1e3 * ms / calls:.1f} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
