"""Which tensors make a routed model's peak memory exceed the baseline's (issue 16: "peak memory <= 1.05x the
baseline's, compiled and eager; measure which tensors make today's excess before changing anything").

For each preset and compile mode it trains the baseline and the fused MHAR variants (``full`` and
``block:4``) with the step ``bench model`` times (``mhar_ablate.bench.Training``: ``TrainStep``, bf16
autocast, fused AdamW, the paper's batch and vocabulary), warms up (compilation included), then records
one step with ``torch.cuda.memory._record_memory_history`` and replays the allocator's trace to the
moment of the step's peak. What is live then is grouped by the innermost stack frame inside the package
(file, function, line and the line's code: e.g. a sublayer's saved activations, the routing's source
buffer, the logits), or, for allocations with no package frame, by autograd node (C++ stacks, ``--stacks
all``) or as backward work; what was allocated before the step (weights, optimiser state) is one group.
The table printed last lists, per routed variant, the groups that make up most of routed-minus-baseline
at the peak. Under ``--out``: ``memory.json`` (every variant's peak and full grouping) and one text
summary per variant; ``--pickles`` also writes the raw snapshots (https://pytorch.org/memory_viz).

    PYTHONPATH=$PWD python3 benchmarks/memory_excess.py --out $OUT

needs a CUDA GPU (the allocator's history is CUDA-only).
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import pickle
import re
import sys
import time
from pathlib import Path

VARIANTS = {  # name: (residual kind, grouping, path)
    "baseline": ("baseline", None, None),
    "mhar-full": ("mhar", "full", "fused"),
    "mhar-block4": ("mhar", "block:4", "fused"),
}
BEFORE_STEP = "alive before the step (weights, optimiser state, caches)"
PACKAGE = "mhar_ablate/"
GB = 1e9


# ----------------------------------------------------------------------------------------------------------
# Grouping a snapshot (pure functions of the snapshot dict: tested on the CPU in tests/bench/test_memory_excess.py)
# ----------------------------------------------------------------------------------------------------------


def area_of(path: str) -> str:
    """A coarse area for a file inside the package (path relative to the package)."""
    if path.startswith(("model/residual/", "kernels/")) or path == "ops.py":
        return "routing"
    if path.startswith("model/"):
        return "model"
    if path.startswith("training/"):
        return "training step"
    return path


def group_of(frames: list[dict]) -> tuple[str, str, str]:
    """``(group, area, code)`` of an allocation from its stack (innermost frame first)."""
    for f in frames:
        name = f.get("filename", "")
        if PACKAGE in name:
            rel = name[name.rindex(PACKAGE) + len(PACKAGE):]
            code = linecache.getline(name, f.get("line", 0)).strip()
            # Dynamo names the code after a graph break torch_dynamo_resume_in_FUNC_at_LINE: the same line
            # of the same function, to be compared with an unbroken model's.
            func = re.sub(r"^torch_dynamo_resume_in_(\w+?)_at_\d+$", r"\1", f.get("name", "?"))
            return f"{rel}:{f.get('line', 0)} {func}", area_of(rel), code
    for f in frames:
        m = re.search(r"(\w+Backward\w*)", f.get("name", ""))
        if m:
            return f"autograd {m.group(1)}", "backward (autograd)", ""
    if not frames:
        return "no Python frame (autograd's C++ backward; --stacks all names the node)", "backward (autograd)", ""
    if any("_inductor" in f.get("filename", "") or "torchinductor" in f.get("filename", "") for f in frames):
        return "inductor code entered outside the package", "compiled code", ""
    f = frames[0]
    return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', 0)} {f.get('name', '?')}", "other", ""


def live_at_peak(trace: list[dict], allocated_before: int) -> dict:
    """Replay one device's allocator trace (``snapshot['device_traces'][i]``), recorded over a step that
    began with ``allocated_before`` bytes allocated, to the step's peak of allocated bytes, and group what
    is live then. Returns ``{"peak": bytes, "groups": {group: {"bytes", "count", "area", "code"}}}``."""
    # The allocator's count rises at "alloc" and drops when a free completes ("free_completed"; a
    # "free_requested" block may still be in use by a stream). First pass: when the peak is.
    current = peak = allocated_before
    peak_at = -1
    for i, e in enumerate(trace):
        if e.get("action") == "alloc":
            current += e["size"]
            if current > peak:
                peak, peak_at = current, i
        elif e.get("action") == "free_completed":
            current -= e["size"]
    # Second pass: what is live at that moment.
    live: dict[int, tuple[int, list]] = {}  # address -> (bytes, frames) of blocks allocated in the trace
    freed_before = 0  # bytes of blocks allocated before the step and freed by the peak
    for e in trace[:peak_at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e.get("action") == "free_completed" and live.pop(e["addr"], None) is None:
            freed_before += e["size"]
    groups: dict[str, dict] = {}
    if allocated_before - freed_before > 0:
        groups[BEFORE_STEP] = {"bytes": allocated_before - freed_before, "count": None, "area": "before the step",
                               "code": ""}
    for size, frames in live.values():
        key, area, code = group_of(frames)
        g = groups.setdefault(key, {"bytes": 0, "count": 0, "area": area, "code": code})
        g["bytes"] += size
        g["count"] += 1
    return {"peak": peak, "groups": groups}


def excess_rows(base: dict, routed: dict, top: int) -> list[dict]:
    """The groups whose live bytes at the peak differ most between a routed variant and the baseline
    (``live_at_peak`` results), largest excess first; at most ``top`` rows."""
    rows = []
    for key in set(base["groups"]) | set(routed["groups"]):
        b, r = base["groups"].get(key), routed["groups"].get(key)
        info = r or b
        rows.append({"group": key, "area": info["area"], "code": info["code"],
                     "baseline": b["bytes"] if b else 0, "routed": r["bytes"] if r else 0})
    for row in rows:
        row["excess"] = row["routed"] - row["baseline"]
    rows.sort(key=lambda row: (-row["excess"], row["group"]))
    return rows[:top]


def by_area(result: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in result["groups"].values():
        out[g["area"]] = out.get(g["area"], 0) + g["bytes"]
    return out


def render(preset: str, mode: str, name: str, base: dict, routed: dict, top: int) -> str:
    """The markdown table of one routed variant's excess over the baseline at the peak."""
    excess = routed["peak"] - base["peak"]
    lines = [f"### {preset} {mode}: {name} peak {routed['peak'] / GB:.2f} GB, baseline {base['peak'] / GB:.2f} GB, "
             f"excess {excess / GB:+.2f} GB ({routed['peak'] / max(base['peak'], 1):.3f}x)", "",
             "| group | area | code | baseline GB | routed GB | excess GB |", "|---|---|---|---|---|---|"]
    shown = 0
    for row in excess_rows(base, routed, top):
        shown += row["excess"]
        code = row["code"].replace("|", "\\|")[:70]
        lines.append(f"| {row['group']} | {row['area']} | `{code}` | {row['baseline'] / GB:.3f} | "
                     f"{row['routed'] / GB:.3f} | {row['excess'] / GB:+.3f} |")
    lines.append(f"| (these rows) | | | | | {shown / GB:+.3f} |")
    areas_b, areas_r = by_area(base), by_area(routed)
    lines.append("")
    lines.append("by area (GB at the peak, baseline -> routed): " + "; ".join(
        f"{a} {areas_b.get(a, 0) / GB:.2f} -> {areas_r.get(a, 0) / GB:.2f}"
        for a in sorted(set(areas_b) | set(areas_r), key=lambda a: -(areas_r.get(a, 0) - areas_b.get(a, 0)))))
    return "\n".join(lines)


def summary(result: dict, top: int = 40) -> str:
    """Every group live at one variant's peak, largest first (the per-variant file under --out)."""
    lines = [f"peak {result['peak'] / GB:.3f} GB (reconstructed from the trace; max_memory_allocated "
             f"{result.get('max_memory_allocated', 0) / GB:.3f} GB)"]
    for key, g in sorted(result["groups"].items(), key=lambda kv: -kv[1]["bytes"])[:top]:
        lines.append(f"{g['bytes'] / GB:9.3f} GB  {g['count'] if g['count'] is not None else '-':>6}  "
                     f"{g['area']:<20} {key}  {g['code']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Measuring (GPU)
# ----------------------------------------------------------------------------------------------------------


def start_history(stacks: str) -> None:
    import torch

    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks,
                                                 max_entries=2_000_000, clear_history=True)
    except TypeError:  # torch without clear_history: the history starts with recording anyway
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks, max_entries=2_000_000)


def measure(preset: str, compiled: bool, name: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """One variant: warm-up steps, then one recorded step; ``(live_at_peak result, raw snapshot)``."""
    import torch

    from mhar_ablate.bench.variants import PAPER_BATCH, PAPER_VOCAB, Variant
    from mhar_ablate.bench.step import Training
    from mhar_ablate.config import build_config

    kind, grouping, path = VARIANTS[name]
    model_cfg = build_config(overrides={"model.preset": preset, "residual.kind": "baseline"}).model
    batch, seq, vocab = PAPER_BATCH, model_cfg.seq_len, model_cfg.vocab_size or PAPER_VOCAB
    variant = Variant(kind, grouping, path, compiled, sites_per_pass=args.sites_per_pass if path == "fused" else None)
    bench_args = argparse.Namespace(preset=preset, heads=args.heads, compile_mode="default")
    device = torch.device("cuda")
    t = Training(variant, bench_args, batch, seq, vocab, device)
    for i in range(args.warmup):
        t.step(i)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start_history(args.stacks)
    try:
        t.step(args.warmup)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    result = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], before)
    result.update(max_memory_allocated=torch.cuda.max_memory_allocated(), allocated_before=before,
                  variant=variant.name, preset=preset, batch=batch, seq=seq)
    del t
    gc.collect()
    torch.cuda.empty_cache()
    return result, snapshot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "memory_excess_out"))
    p.add_argument("--presets", default="paper100m,paper350m")
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--variants", default="mhar-full,mhar-block4", help=f"routed variants among {', '.join(VARIANTS)}")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--sites-per-pass", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="steps before the recorded one (compilation included)")
    p.add_argument("--top", type=int, default=12, help="rows per table")
    p.add_argument("--stacks", choices=("python", "all"), default="python",
                   help="python: package frames (fast); all: C++ frames too, naming autograd nodes (slow to record)")
    p.add_argument("--pickles", action="store_true", help="also write each raw snapshot (large) for memory_viz")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("memory_excess.py: needs a CUDA GPU (torch.cuda.memory's allocation history is CUDA-only), "
              "and torch sees none here", file=sys.stderr)
        return 2
    routed = [v.strip() for v in args.variants.split(",") if v.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [v for v in routed if v not in VARIANTS or v == "baseline"]
    bad += [m for m in modes if m not in ("eager", "compiled")]
    if bad:
        print(f"memory_excess.py: unknown variant or mode {', '.join(bad)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"memory_excess: {torch.cuda.get_device_name()}, torch {torch.__version__}; presets {args.presets}, "
          f"modes {','.join(modes)}, variants baseline,{','.join(routed)}", flush=True)
    results: dict[str, dict] = {}
    tables = []
    t0 = time.time()
    for preset in (s.strip() for s in args.presets.split(",") if s.strip()):
        for mode in modes:
            measured = {}
            for name in ["baseline", *routed]:
                label = f"{preset}-{name}-{mode}"
                try:
                    measured[name], snapshot = measure(preset, mode == "compiled", name, args)
                except torch.OutOfMemoryError:
                    print(f"  {label}: out of memory", flush=True)
                    continue
                except Exception as e:  # one line says what broke; the other variants still run
                    torch.cuda.memory._record_memory_history(enabled=None)
                    first = (str(e).strip().splitlines() or [""])[0][:200]
                    print(f"  {label}: failed: {type(e).__name__}: {first}", flush=True)
                    continue
                results[label] = measured[name]
                r = measured[name]
                print(f"  {label}: peak {r['peak'] / GB:.2f} GB (max_memory_allocated "
                      f"{r['max_memory_allocated'] / GB:.2f}), {time.time() - t0:.0f}s", flush=True)
                (out / f"{label}.txt").write_text(summary(r) + "\n")
                if args.pickles:
                    with open(out / f"{label}.pickle", "wb") as f:
                        pickle.dump(snapshot, f)
                del snapshot
                (out / "memory.json").write_text(json.dumps(results, indent=1) + "\n")  # after every variant
            if "baseline" not in measured:
                continue
            for name in routed:
                if name in measured:
                    tables.append(render(preset, mode, name, measured["baseline"], measured[name], args.top))
    print()
    text = "\n\n".join(tables)
    (out / "tables.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
