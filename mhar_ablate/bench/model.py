"""``mhar-ablate bench model``: training-step throughput, peak memory and routing time of the residual
variants, measured on one GPU, so that "is MHAR worth it per hour?" has numbers behind it.

For one model preset it trains, on random tokens, the baseline and every residual kind of the registry
(``variants/``): the kinds with a fused path (AttnRes, MHAR with H routing heads, delta) with ``full``
and ``block:4`` grouping on the reference and the fused path, the others (hc, hc-static, mhc, denseformer,
muddformer: each kind's ``bench_variants``) as they are, each eager and under ``torch.compile``, and
reports per variant: tokens/s, the ratio to the baseline of the same compile mode, peak memory, and the
step time split into routing and the rest. A step is what training does: forward and loss under bf16
autocast, backward, fused AdamW (routing parameters without weight decay). Times are CUDA-event medians over
several steps after warm-up (compilation excluded). ``--sites-per-pass``, ``--fold-norms`` and
``--stacked-config`` give one fused row per value (the sites sharing a pass over the history; the sublayers'
pre-norms in the routing kernels or in the sublayers; the shared pass's stacked products' form, off or a
launch configuration), so that the forms are timed in one process, against one baseline.

The split comes from one extra step under ``torch.profiler``: routing is the GPU time of the kernels
launched inside the ``mhar::routing`` ranges (forward) and by the backward nodes those ranges created
(matched by autograd sequence number) or marked themselves (the fused path's backward); ``kernel_ms`` is
the GPU time of all the step's kernels, so that step time minus kernel time is what the GPU spent waiting
on the host; ``top_kernels`` (in the JSON) the step's costliest kernels. Routing is not split off for
compiled reference-path variants (the comparison family among them), whose routing kernels are fused with
their neighbours: their rows have the kernel time and the top kernels only. ``--check`` first compares
the fused path with the reference on a small model.

``--cuda-graph`` adds a row after each variant's (``NAME-graph``): the same model and optimiser, the whole
step (forward, backward, optimiser step) captured once in a CUDA graph and replayed. A replay launches no
Python, so the host cost per routing site is gone and the row measures the GPU work; the baseline is
captured too, and ``ratio_to_fastest_baseline`` compares every row with the baseline at its best.

``--rounds R`` makes a ratio that one call can trust to a fraction of a percent: a card's steps drift by a
few percent from minute to minute, more than a routing change gains. The baseline stays on the GPU, and
after each variant's rows its last step (the replayed one with ``--cuda-graph``) and the baseline's are
timed in turn R times; the ratio is the median of the rounds' ratios (``round_ratios`` in the JSON, with the
SM clock after each side's steps in ``round_clocks_mhz`` where NVML answers).

Without a GPU the command refuses, unless ``--device cpu`` asks for a small smoke run (tiny shapes, fp32,
eager variants only).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from .check import check_forms
from .options import bench_device, fold_norms_option, sites_per_pass, stacked_configs
from .step import Training, record_times, timed_steps, attempt, run_variant
from .variants import CPU_SHAPE, PAPER_BATCH, PAPER_VOCAB, Variant, all_variants, select_variants

if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported inside the functions that run: the command line builds this parser for every command.

def bench_model(args: argparse.Namespace) -> int:
    import torch

    from ..config import build_config

    device = bench_device(args, "bench model")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        raise UsageError("--steps, --warmup and --rounds must be at least 1")
    if args.heads < 1:
        raise UsageError(f"--heads must be positive, got {args.heads}")
    variants = select_variants(args.variants, all_variants(sites_per_pass(args.sites_per_pass),
                                                           fold_norms_option(args.fold_norms),
                                                           stacked_configs(args.stacked_config)))
    cpu = device.type == "cpu"
    if cpu:
        variants = [v for v in variants if not v.compiled]
        if not variants:
            raise UsageError("--device cpu runs eager variants only: select some, e.g. --variants '*-eager'")
        if args.cuda_graph:
            raise UsageError("--cuda-graph needs a GPU: a CUDA graph replays CUDA work, and --device cpu has none")
    model_cfg = build_config(overrides={"model.preset": args.preset, "residual.kind": "baseline"}).model
    batch = args.batch or (CPU_SHAPE[0] if cpu else PAPER_BATCH)
    seq = args.seq or (CPU_SHAPE[1] if cpu else model_cfg.seq_len)
    vocab = model_cfg.vocab_size or PAPER_VOCAB
    if batch < 1 or not 1 <= seq <= model_cfg.seq_len:
        raise UsageError(f"--batch must be positive and --seq between 1 and the preset's seq_len {model_cfg.seq_len}")

    env = {"device": torch.cuda.get_device_name(device) if not cpu else "cpu", "torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    precision = "fp32, AdamW (a smoke run)" if cpu else "bf16 autocast, fused AdamW"
    if args.cuda_graph:
        precision += ", each step also replayed from a CUDA graph"
    print(f"bench model: preset {args.preset} (d={model_cfg.d_model}, {model_cfg.n_layers} layers, vocab {vocab:,}), "
          f"{batch} x {seq} tokens a step, {precision}; {env['device']}, torch {env['torch']}", flush=True)
    if args.check and cpu:
        raise UsageError("--check needs a GPU (on CPU the test suite checks the fused path)")
    if args.check and not check_forms(device, variants):
        print("fused path check FAILED: nothing timed", file=sys.stderr)
        return 1

    rows = []

    def publish() -> None:
        _ratios(rows)
        if args.json:  # after every row: a run cut short still leaves what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")

    baselines: dict[bool, tuple[Training, dict]] = {}  # --rounds: each compile mode's baseline, kept
    try:
        for v in variants:
            print(f"-- {v.name}{_variant_detail(v)}", flush=True)
            held: list[Training] = []
            for row in run_variant(v, args, batch, seq, vocab, device, held):
                row.update(preset=args.preset, batch=batch, seq=seq, vocab=vocab, **env)
                rows.append(row)
                print(("   graph: " if row["cuda_graph"] else "   ") + _row_summary(row), flush=True)
                publish()
            last = rows[-1]
            if args.rounds > 1 and held and last["status"] == "ok":
                if v.routing == "baseline":
                    baselines[v.compiled] = (held.pop(), last)
                elif v.compiled in baselines:
                    base, base_row = baselines[v.compiled]
                    # A failure here leaves the row's own measurement standing, with the reason beside it.
                    attempt(last, interleave, base, base_row, held[0], last, args, batch * seq, device,
                            status="rounds_status")
                    publish()
                    print(f"   {args.rounds} rounds: " + _rounds_summary(last), flush=True)
                else:
                    print(f"   {args.rounds} rounds: not timed, the baseline's step failed", flush=True)
            held.clear()
            release(device)
    finally:
        baselines.clear()
        release(device)
    print()
    print(render_table(rows))
    return 0


def _variant_detail(v: Variant) -> str:
    detail = ([f"sites per pass {v.sites_per_pass}"] if v.sites_per_pass else []) + (
        [] if v.fold_norms is None else ["norms folded" if v.fold_norms else "norms in the sublayers"]) + (
        [] if v.stacked is None else [f"stacked {v.stacked}"])
    return f" ({', '.join(detail)})" if detail else ""


def release(device: torch.device) -> None:
    """Free what the trainings just dropped held (models, optimisers, gradients in a graph's pool after a
    capture) before the next variant is built."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def interleave(base: Training, base_row: dict, t: Training, row: dict, args: argparse.Namespace, tokens: int,
               device: torch.device) -> None:
    """``--rounds``: the variant's step and its baseline's, after ``--warmup`` untimed steps each, timed in
    turn (the first of each pair alternating, so that a drift of the clocks weighs on both alike). A round's
    ratio is the baseline's median step time over the variant's in that round; the row's ratio, step time
    and tokens/s become the rounds' medians. Where NVML answers, the SM clock after each side's steps of a
    round goes to ``round_clocks_mhz`` ([variant's, baseline's] a round), to tell a card's clocks from its
    steps when one round stands out."""
    # Untimed first, so that no timed replay is a step's first after its capture or a pause. A first round
    # can still stand out (docs/benchmarks.md, sixteenth round): the median of the rounds is the figure.
    for training in (base, t):
        timed_steps(training.step, 0, args.warmup, device)
    ours, theirs, ratios, clocks = [], [], [], []
    loss = None
    for r in range(args.rounds):
        pair = [(t, ours), (base, theirs)]
        clock = {}
        for training, into in pair if r % 2 == 0 else pair[::-1]:
            times, loss_r = timed_steps(training.step, args.warmup + args.steps * (r + 1), args.steps, device)
            clock[training is t] = sm_clock_mhz(device)
            into.append(statistics.median(times))
            if training is t:
                loss = loss_r
        ratios.append(theirs[-1] / ours[-1])
        clocks.append([clock[True], clock[False]])
    record_times(row, ours, loss, tokens)  # the median of the rounds' medians
    if row["routing_ms"] is not None:
        row["rest_ms"] = round(row["step_ms"] - row["routing_ms"], 2)
    row.update(rounds=args.rounds, round_ratios=[round(x, 4) for x in ratios],
               baseline_step_ms=round(statistics.median(theirs), 2), baseline_variant=base_row["variant"])
    if any(c is not None for pair in clocks for c in pair):
        row["round_clocks_mhz"] = clocks


def sm_clock_mhz(device: torch.device) -> int | None:
    """The GPU's SM clock in MHz over NVML's last sample period (1/6 to 1 s); None off CUDA or where NVML
    does not answer (no pynvml)."""
    import torch

    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except (ImportError, RuntimeError, AttributeError, ValueError):
        return None


def _rounds_summary(row: dict) -> str:
    if "rounds_status" in row:
        return row["rounds_status"]
    r = row["round_ratios"]
    return (f"{row['step_ms']:.1f} ms/step against the baseline's {row['baseline_step_ms']:.1f}, "
            f"x baseline {row['ratio_to_baseline']:.3f} (rounds {min(r):.3f}-{max(r):.3f})")


def _ratios(rows: list[dict]) -> None:
    """Tokens/s and peak memory of each row over the baseline's measured the same way (compile mode, CUDA
    graph or not), and tokens/s over the fastest baseline of the run, whatever its mode: the variant
    against the baseline at its best. A row timed in rounds (``interleave``) takes its rounds' median ratio,
    and reaches the fastest baseline through its own."""
    fastest = max((r["tokens_per_s"] for r in rows
                   if r["routing"] == "baseline" and r["status"] == "ok" and r["tokens_per_s"]), default=None)
    for row in rows:
        base = next((r for r in rows if r["routing"] == "baseline" and r["compiled"] == row["compiled"]
                     and r["cuda_graph"] == row["cuda_graph"]), None)
        ok = base is not None and base["tokens_per_s"] and row["tokens_per_s"]
        row["ratio_to_baseline"] = round(row["tokens_per_s"] / base["tokens_per_s"], 4) if ok else None
        if ok and row.get("round_ratios"):  # --rounds: steps timed side by side
            row["ratio_to_baseline"] = round(statistics.median(row["round_ratios"]), 4)
        row["peak_ratio_to_baseline"] = (round(row["peak_gb"] / base["peak_gb"], 4)
                                         if ok and row["peak_gb"] and base["peak_gb"] else None)
        row["ratio_to_fastest_baseline"] = (round(row["tokens_per_s"] / fastest, 4)
                                            if fastest and row["tokens_per_s"] else None)
        if ok and fastest and row.get("round_ratios"):  # through its baseline: rounds' times ran under load
            row["ratio_to_fastest_baseline"] = round(row["ratio_to_baseline"] * base["tokens_per_s"] / fastest, 4)


def _row_summary(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    split = "" if row["routing_ms"] is None else f", routing {row['routing_ms']:.1f} ms"
    if row["kernel_ms"] is not None:
        split += f", kernels {row['kernel_ms']:.1f} ms"
    if row.get("routing_top"):
        split += "; top routing kernels: " + ", ".join(f"{n} {ms:.1f}" for n, ms in row["routing_top"])
    elif row.get("top_kernels"):  # no routing split (the baseline, compiled kinds without a fused path)
        split += "; top kernels: " + ", ".join(f"{n} {ms:.1f}" for n, ms in row["top_kernels"][:4])
    if row["split_from"]:
        split += f" (split from the {row['split_from']})"
    peak = "" if row["peak_gb"] is None else f", peak {row['peak_gb']:.1f} GB"
    return f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s{peak}{split}"


def cell(x, fmt: str) -> str:
    """A table cell: the value formatted, or – where it is missing."""
    return "–" if x is None else format(x, fmt)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def render_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (what ``docs/benchmarks.md`` shows); where a row's sublayers' pre-norms
    ran in its routing kernels (``--fold-norms``), a column says where each fused row's ran, and where a row's
    shared passes took the stacked products' form (``--stacked-config``), one says each fused row's form."""
    norms = any(r.get("fold_norms") for r in rows)
    stacked = any(r.get("stacked_config") not in (None, "off") for r in rows)
    return markdown_table(
        ["variant", "sites/pass", *(["norms"] if norms else []), *(["stacked"] if stacked else []), "tokens/s",
         "× baseline", "× fastest baseline", "peak GB", "× baseline peak", "step ms", "routing ms", "rest ms",
         "kernel ms", "status"],
        [[r["variant"], cell(r["sites_per_pass"], "d"), *([_norms_cell(r)] if norms else []),
          *([r.get("stacked_config") or "–"] if stacked else []),
          cell(r["tokens_per_s"], ",.0f"), _ratio_cell(r), cell(r["ratio_to_fastest_baseline"], ".3f"),
          cell(r["peak_gb"], ".1f"), cell(r.get("peak_ratio_to_baseline"), ".3f"), cell(r["step_ms"], ".1f"),
          cell(r["routing_ms"], ".1f"), cell(r["rest_ms"], ".1f"), cell(r["kernel_ms"], ".1f"), r["status"]]
         for r in rows])


def _norms_cell(row: dict) -> str:
    """Where a fused row's sublayers' pre-norms ran: folded into the routing kernels, or in the sublayers."""
    fold = row.get("fold_norms")
    return "–" if fold is None else "folded" if fold else "sublayers"


def _ratio_cell(row: dict) -> str:
    """× baseline, and with --rounds the range of the rounds' ratios."""
    r = row.get("round_ratios")
    if not r or row["ratio_to_baseline"] is None:
        return cell(row["ratio_to_baseline"], ".3f")
    return f"{row['ratio_to_baseline']:.3f} ({min(r):.3f}–{max(r):.3f}, {len(r)} rounds)"


