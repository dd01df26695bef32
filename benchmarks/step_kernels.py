"""Where a graph-replayed training step's time goes between its kernels: one replay of ``bench model``'s
step (``mhar_ablate.bench.Training``, compiled, captured by ``TrainStep``) under the profiler, its kernels
in the order the GPU ran them. Per variant: kernels a step, their summed time, the replay's span and the
idle rest; then, by kernel name, the count, time and the idle time just before each, as differences from
the first variant (the baseline), largest first. A replay has no host work, so its idle time is the GPU's
own cost of running many kernels one after the other (each one's launch, ramp and tail).

    PYTHONPATH=$PWD python3 benchmarks/step_kernels.py --preset paper350m \\
        --variants baseline-compiled,mhar-block4-fused-compiled --json $OUT/kernels-350m.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from mhar_ablate.bench.variants import PAPER_BATCH, PAPER_VOCAB, all_variants, select_variants
from mhar_ablate.bench.step import Training
from mhar_ablate.config import build_config


def step_kernels(t: Training) -> list[tuple[str, int, int]]:
    """(name, start ns, duration ns) of every kernel, copy and fill of one step (a replay once the step is
    captured), in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t.step(0)
        torch.cuda.synchronize()
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0 and not e.is_user_annotation():
            out.append((e.name(), e.start_ns(), e.duration_ns()))
    return sorted(out, key=lambda k: k[1])


def summarise(kernels: list[tuple[str, int, int]]) -> dict:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, kernel us, idle us before
    end, idle = None, 0.0
    for name, start, dur in kernels:
        gap = max(0.0, (start - end) / 1e3) if end is not None else 0.0
        entry = by_name[name[:70]]
        entry[0] += 1
        entry[1] += dur / 1e3
        entry[2] += gap
        idle += gap
        end = max(end or 0, start + dur)
    span = (end - kernels[0][1]) / 1e3 if kernels else 0.0
    rows = {k: [int(v[0]), round(v[1], 1), round(v[2], 1)] for k, v in by_name.items()}
    return {"kernels": len(kernels), "kernel_ms": sum(k[2] for k in kernels) / 1e6, "span_ms": span / 1e3,
            "idle_ms": idle / 1e3, "by_name": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="paper350m")
    parser.add_argument("--variants", default="baseline-compiled,mhar-block4-fused-compiled")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sites-per-pass", type=int, default=4)
    parser.add_argument("--top", type=int, default=20, help="kernel names listed (default 20)")
    parser.add_argument("--json", help="also write every variant's summary here")
    parser.add_argument("--eager", action="store_true",
                        help="also profile one step launched from Python (no graph) and list, per variant, the "
                             "kernels whose time differs most between the replay and that step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: step_kernels.py replays CUDA graphs; no GPU here", file=sys.stderr)
        return 2
    args.compile_mode = "default"
    device = torch.device("cuda")
    model_cfg = build_config(overrides={"model.preset": args.preset, "residual.kind": "baseline"}).model
    vocab = model_cfg.vocab_size or PAPER_VOCAB
    variants = [v for v in select_variants(args.variants, all_variants([args.sites_per_pass])) if v.compiled]
    results = {}
    for v in variants:
        t = Training(v, args, PAPER_BATCH, model_cfg.seq_len, vocab, device)
        for i in range(2):  # compile
            t.step(i)
        eager = None
        if args.eager:
            torch.cuda.synchronize()
            eager = summarise(step_kernels(t))
            print(f"{v.name}, launched: {eager['kernels']} kernels, {eager['kernel_ms']:.2f} ms of kernels",
                  flush=True)
        t.train_step = t.new_step(cuda_graph=True)
        t.train_step.prepare(*t.data[0])
        if not t.train_step.captured:
            print(f"error: {v.name}: the step was not captured ({t.train_step.note})", file=sys.stderr)
            return 1
        for i in range(3):
            t.step(i)
        torch.cuda.synchronize()
        results[v.name] = s = summarise(step_kernels(t))
        if eager is not None:
            s["launched"] = eager
        print(f"{v.name}: {s['kernels']} kernels a step, {s['kernel_ms']:.2f} ms of kernels in a replay of "
              f"{s['span_ms']:.2f} ms, idle {s['idle_ms']:.2f} ms ({1e3 * s['idle_ms'] / max(1, s['kernels']):.2f} us "
              "a kernel)", flush=True)
        del t
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"preset": args.preset, "variants": results}, indent=1) + "\n")
    if args.eager:
        for name, s in results.items():
            print_diff(f"{name}: the replay against the launched step", s["by_name"], s["launched"]["by_name"],
                       args.top)
    names = list(results)
    base = results[names[0]]["by_name"]
    for name in names[1:]:
        print_diff(f"{name} against {names[0]}", results[name]["by_name"], base, args.top)
    return 0


def print_diff(title: str, rows: dict, base: dict, top: int) -> None:
    """The kernel names whose count, time or idle time before them differ most between two summaries."""
    diff = []
    for k in set(rows) | set(base):
        c, us, idle = rows.get(k, [0, 0.0, 0.0])
        c0, us0, idle0 = base.get(k, [0, 0.0, 0.0])
        diff.append((k, c - c0, us - us0, idle - idle0))
    diff.sort(key=lambda r: -(abs(r[2]) + abs(r[3])))
    print(f"\n{title}, by kernel: more kernels, more kernel us, more idle us before them")
    print("| kernel | count | kernel us | idle us before |")
    print("|---|---|---|---|")
    for k, c, us, idle in diff[:top]:
        print(f"| `{k}` | {c:+d} | {us:+.0f} | {idle:+.0f} |")


if __name__ == "__main__":
    sys.exit(main())
