"""The shared forward pass (``history.history_forward``) by source count: its forms, the reductions (a tile
of tokens and one head a program, every product a sum over lanes), the matrix products
(``_history_fwd_dot_kernel``, a token's sources in a tile) and, with ``--stacked``, the stacked products
(``_history_fwd_stacked_kernel``, several tokens' sources in a tile, up to half its rows), timed on the same
inputs for each S, at a preset's width and tokens. Where one beats another decides
``history.HISTORY_DOT_MIN_S`` and ``HISTORY_STACKED_CONFIG``: `full` grouping's passes read up to 2 L + 1
slots, `block:K`'s the blocks finished before the pass.

    PYTHONPATH=$PWD python3 benchmarks/bench_history.py --presets paper350m,paper1b,paper100m \\
        --sources 2,4,8,12,16,24,32,48 --dot '16,1,3,32;16,1,3,64' \\
        --stacked '32,1,3,16;32,1,2,16;32,1,3,32' --out $OUT

Each call is replayed from a CUDA graph (median of 20). Bytes: the S sources and their RMS read, the G
outputs and log-sum-exps written. "rel err": the norm of a form's outputs less the reductions' form's,
over the norm of the latter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench_kernels import BATCH, copy_bandwidth, parse_configs  # benchmarks/, beside this script
from bench_stack import graph_time, rel
from mhar_ablate.bench.model import markdown_table
from mhar_ablate.config import RunConfig, load_preset
from mhar_ablate.kernels import history


def forms(dot_configs: list[tuple], stacked: list[tuple]) -> list[tuple[str, tuple | None, tuple | None]]:
    """(label, HISTORY_DOT_CONFIG, HISTORY_STACKED_CONFIG) of each form timed, the reductions' first (a
    stacked configuration applies up to half its rows' sources; past that no row is timed)."""
    return ([("reductions", None, None)] + [(f"dot {c}", c, None) for c in dot_configs]
            + [(f"stacked {c}", None, c) for c in stacked])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="paper350m")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--sites", type=int, default=4, help="sites a pass (G)")
    p.add_argument("--sources", default="2,4,8,12,16,24,32,48")
    p.add_argument("--dot", default="", help="'TOKENS,WARPS,STAGES,MAX_S;...': the matrix-product form's "
                   "configurations (default: the launch table's)")
    p.add_argument("--stacked", default="", help="'TOKENS,WARPS,STAGES,ROWS;...': the stacked products' form "
                   "(several tokens' sources in a tile's 16 or 32 rows; history.HISTORY_STACKED_CONFIG)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_history_out"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_history.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    saved = history.HISTORY_DOT_CONFIG, history.HISTORY_DOT_MIN_S, history.HISTORY_STACKED_CONFIG
    dot_configs = parse_configs(args.dot, False) or [saved[0]]
    stacked = parse_configs(args.stacked, False)
    H, G = args.heads, args.sites
    rows = []
    for preset in args.presets.split(","):
        cfg = RunConfig()
        load_preset(cfg, preset)
        d = cfg.model.d_model
        batch, seq = BATCH.get(preset, (8, cfg.model.seq_len))
        N = batch * seq
        gen = torch.Generator(device=device).manual_seed(0)
        counts = [int(s) for s in args.sources.split(",")]
        src_all = torch.randn(max(counts), N, d, generator=gen, device=device).to(torch.bfloat16)
        rms_all = torch.rsqrt(src_all.float().pow(2).mean(-1) + 1e-6)
        qg = torch.randn(G, d, generator=gen, device=device) * 4 / d ** 0.5
        out0 = torch.empty((N, d), dtype=torch.bfloat16, device=device)
        rest = torch.empty((G - 1, N, d), dtype=torch.bfloat16, device=device)
        lse = torch.empty((G, N, H), dtype=torch.float32, device=device)
        for S in counts:
            src, rms = src_all[:S], rms_all[:S]
            nbytes = src.numel() * 2 + rms.numel() * 4 + G * N * d * 2 + lse.numel() * 4
            reference = None
            for label, config, stack in forms(dot_configs, stacked):
                if stack is not None and S > stack[3] // 2:
                    continue
                history.HISTORY_DOT_CONFIG, history.HISTORY_DOT_MIN_S = config, (0, 0)
                history.HISTORY_STACKED_CONFIG = stack
                try:
                    def call():
                        history.history_forward(src, rms, qg, H, out0, rest, lse)

                    call()
                    got = torch.cat([out0.unsqueeze(0), rest]).float()
                    if reference is None:
                        reference = got.clone()
                    ms = graph_time(call)
                finally:
                    history.HISTORY_DOT_CONFIG, history.HISTORY_DOT_MIN_S, history.HISTORY_STACKED_CONFIG = saved
                row = {"preset": preset, "d": d, "S": S, "form": label, "ms": round(ms, 4),
                       "of copy": round(nbytes / (ms * 1e-3) / copy, 3), "rel err": rel(got, reference)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del src_all, rms_all
    with open(os.path.join(args.out, "bench_history.json"), "w") as f:
        json.dump({"copy_TBps": copy / 1e12, "rows": rows}, f, indent=1)
    print(f"copy {copy / 1e12:.2f} TB/s, {G} sites a pass, {H} heads; ms a call (share of copy)")
    labels = [label for label, _, _ in forms(dot_configs, stacked)]
    table = []
    for (preset, S) in dict.fromkeys((r["preset"], r["S"]) for r in rows):
        cells = {r["form"]: r for r in rows if r["preset"] == preset and r["S"] == S}
        best = min(cells.values(), key=lambda r: r["ms"])["form"]
        table.append([preset, str(S)] + [f"{cells[f]['ms']:.4f} ({cells[f]['of copy']:.0%})" if f in cells else "–"
                                          for f in labels] + [best])
    print(markdown_table(["preset", "S", *labels, "fastest"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
