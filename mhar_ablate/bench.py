"""``mhar-ablate bench model``: training-step throughput, peak memory and routing time of the residual
variants, measured on one GPU, so that "is MHAR worth it per hour?" has numbers behind it.

For one model preset it trains, on random tokens, the baseline and every residual kind of the registry
(``model/residual``): the kinds with a fused path (AttnRes, MHAR with H routing heads, delta) with ``full``
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
import copy
import fnmatch
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported inside the functions that run: the command line builds this parser for every command.

# The paper's tokens per step: 8 sequences of the preset's length (8 x 2048 at 100M, 8 x 1024 otherwise).
PAPER_BATCH = 8
PAPER_VOCAB = 151_936  # Qwen3 tokenizer, tied embeddings
CPU_SHAPE = (1, 16)  # --device cpu: a smoke run, not a measurement


@dataclass(frozen=True)
class Variant:
    routing: str  # the residual kind (model/residual's RESIDUALS): baseline, attnres, mhar, delta, hc, ...
    grouping: str | None  # kinds with a fused path: full | block:4 (None otherwise)
    # Kinds with a fused path: reference | fused; the others: reference (plain PyTorch; under compile the
    # routing is fused with its neighbours and not split off); None for the baseline.
    path: str | None
    compiled: bool
    sites_per_pass: int | None = None  # fused path: consecutive sites sharing one pass over the history
    # fused path of a kind that can fold (``folds_norms``): the sublayers' pre-norms in its kernels; None:
    # the model's default
    fold_norms: bool | None = None
    # fused path: the shared pass's stacked products' form for this row, "off" or "TOKENS,WARPS,STAGES,ROWS"
    # (``history.HISTORY_STACKED_CONFIG``, set while the row's model builds, steps and is captured); None: the
    # package's
    stacked: str | None = None
    label: str | None = None  # kinds without a fused path: the row's name (the kind's bench_variants)
    settings: tuple[tuple[str, str], ...] = ()  # and its residual.<kind>.<name> overrides

    @property
    def name(self) -> str:
        mode = "compiled" if self.compiled else "eager"
        if self.routing == "baseline":
            return f"baseline-{mode}"
        if self.label is not None:
            return f"{self.label}-{mode}"
        path = "ref" if self.path == "reference" else "fused"
        return f"{self.routing}-{self.grouping.replace(':', '')}-{path}-{mode}"

    def overrides(self, heads: int) -> dict[str, str]:
        """The config overrides (the preset aside) that build this variant's model: what `train` is given
        to train the same model as this row."""
        from .model.residual import RESIDUALS

        over = {"residual.kind": self.routing, **dict(self.settings)}
        cls = RESIDUALS[self.routing]
        if cls.fused_path:
            over.update({"residual.grouping": self.grouping,
                         "residual.backend": "triton" if self.path == "fused" else "reference"})
        if "heads" in cls.shared:  # the kinds whose head count varies (mhar, delta)
            over["residual.heads"] = str(heads)
        return over


def _baseline(compiled: bool) -> Variant:
    return Variant("baseline", None, None, compiled)


def all_variants(sites_per_pass: Sequence[int | None], fold_norms: Sequence[bool | None] = (None,),
                 stacked: Sequence[str | None] = (None,)) -> list[Variant]:
    """Every kind of the registry, eager variants first, then compiled ones; the baseline first in each
    mode. A kind with a fused path gets full and block:4 grouping, each on the reference and the fused path
    (one fused row per sites-per-pass value, per fold-norms value where the kind folds, and per stacked
    configuration); the others get one row per entry of their bench_variants."""
    from .model.residual import RESIDUALS

    out = []
    for compiled in (False, True):
        out.append(_baseline(compiled))
        for kind, cls in RESIDUALS.items():
            if kind == "baseline":
                continue
            if not cls.fused_path:
                out.extend(Variant(kind, None, "reference", compiled, label=label, settings=tuple(over.items()))
                           for label, over in cls.bench_variants().items())
                continue
            for grouping in ("full", "block:4"):
                out.append(Variant(kind, grouping, "reference", compiled))
                folds = fold_norms if cls.folds_norms else (None,)
                out.extend(Variant(kind, grouping, "fused", compiled, g, f, k)
                           for g in sites_per_pass for f in folds for k in stacked)
    return out


def select_variants(spec: str, variants: list[Variant]) -> list[Variant]:
    """Comma-separated names or shell patterns (``mhar-full-*``); the baseline of each selected compile
    mode is added, since every ratio is taken against it."""
    patterns = [p.strip() for p in spec.split(",") if p.strip()]
    chosen = []
    for pattern in patterns:
        hits = [v for v in variants if fnmatch.fnmatchcase(v.name, pattern) or (pattern == "all")]
        if not hits:
            names = ", ".join(dict.fromkeys(v.name for v in variants))
            raise UsageError(f"--variants: {pattern!r} matches no variant; the variants are {names}")
        chosen.extend(h for h in hits if h not in chosen)
    for compiled in {v.compiled for v in chosen}:
        base = _baseline(compiled)
        if base not in chosen:
            chosen.append(base)
    return [v for v in variants if v in chosen]  # in the canonical order


def add_shared_options(m: argparse.ArgumentParser) -> None:
    """The options ``bench model`` and ``bench infer`` share, with the same meaning and defaults."""
    m.add_argument("--preset", default="paper350m", help="model preset from configs/ (default: paper350m)")
    m.add_argument("--heads", type=int, default=8, help="routing heads of the mhar and delta variants (default 8)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu for a small smoke run of the command itself")
    m.add_argument("--debug", action="store_true", help="show tracebacks")


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench`` (with its targets ``model`` and ``infer``) to the command line's subparsers."""
    from .bench_infer import add_infer_parser

    bench = subparsers.add_parser("bench", help="measure training and inference speed and memory of the residual "
                                                "variants on a GPU")
    targets = bench.add_subparsers(dest="bench_target", metavar="TARGET", parser_class=type(bench))
    m = targets.add_parser("model", help="training step of each variant: tokens/s, ratio to the baseline, "
                                         "peak memory, routing time")
    add_shared_options(m)
    m.add_argument("--variants", default="all", metavar="LIST",
                   help="comma-separated variant names or patterns, e.g. 'mhar-full-*,*-compiled' (default: all); "
                        "names: baseline-{eager,compiled}, {attnres,mhar,delta}-{full,block4}-{ref,fused}-{eager,compiled}, "
                        "{hc,hc-static,mhc,denseformer,muddformer}-{eager,compiled}")
    m.add_argument("--sites-per-pass", default=None, metavar="N[,N...]",
                   help="fused path: sites sharing one pass over the history (default: the model's); "
                        "several values give one row each")
    m.add_argument("--fold-norms", default=None, metavar="off|on[,...]",
                   help="fused path of mhar and attnres: compute the sublayers' pre-norms in the routing kernels "
                        "(on) or in the sublayers (off); default: the model's; 'off,on' gives one row each")
    m.add_argument("--stacked-config", default=None, metavar="off|T,W,S,R[;...]",
                   help="fused path: the shared pass's stacked products' form, off or its tokens a program, warps, "
                        "stages and rows a tile (16 or 32); default: the package's; 'off;32,1,3,16' gives one row "
                        "each")
    m.add_argument("--batch", type=int, help="sequences per step (default 8; 1 with --device cpu)")
    m.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's seq_len; 16 with --device cpu)")
    m.add_argument("--steps", type=int, default=10, help="timed steps, after warm-up (default 10)")
    m.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    m.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="after a variant's own rows, time its last step (the replayed one with --cuda-graph) and "
                        "its baseline's in turn R times, each round's ratio from steps timed side by side: the "
                        "ratio is their median, with their range (default 1: the rows alone, one after another). "
                        "Holds the baselines on the GPU beside each variant")
    m.add_argument("--no-split", action="store_true", help="skip the profiled step that splits routing time off")
    m.add_argument("--cuda-graph", action="store_true",
                   help="also replay each variant's whole step from a CUDA graph (a NAME-graph row after each): "
                        "the GPU work without the host's launch cost")
    # The modes that capture CUDA graphs themselves are left out: --cuda-graph captures the whole step.
    m.add_argument("--compile-mode", choices=("default", "max-autotune-no-cudagraphs"), default="default",
                   help="torch.compile mode of the compiled variants (default: default)")
    m.add_argument("--check", action="store_true",
                   help="first check the fused path against the reference (loss and gradients, small model), in "
                        "each --stacked-config form")
    m.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
    add_infer_parser(targets)


def cmd_bench(args: argparse.Namespace) -> int:
    target = getattr(args, "bench_target", None)
    if target == "infer":
        from .bench_infer import bench_infer

        return bench_infer(args)
    if target != "model":
        raise UsageError("bench needs a target: mhar-ablate bench model|infer [--preset NAME] ...")
    return bench_model(args)


# ------------------------------------------------------------------------------------------------ the command


def _sites_per_pass(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sites-per-pass takes positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"--sites-per-pass takes positive integers, got {text!r}")
    return values


def _fold_norms(text: str | None) -> list[bool | None]:
    if text is None:
        return [None]
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values):
        raise UsageError(f"--fold-norms takes on, off or both (off,on), got {text!r}")
    return [v == "on" for v in dict.fromkeys(values)]


def _stacked_configs(text: str | None) -> list[str | None]:
    """``--stacked-config``: "off" or "TOKENS,WARPS,STAGES,ROWS" per row, as ``kernel_forms`` takes them."""
    if text is None:
        return [None]
    out = []
    for item in (t.strip().replace(" ", "") for t in text.split(";")):
        if item == "off":
            out.append(item)
            continue
        try:
            values = [int(v) for v in item.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) < 1 or values[3] not in (16, 32):
            raise UsageError(f"--stacked-config takes off or TOKENS,WARPS,STAGES,ROWS (positive, ROWS 16 or 32), "
                             f"';'-separated, got {item!r}")
        out.append(",".join(map(str, values)))
    return list(dict.fromkeys(out))


@contextmanager
def kernel_forms(stacked: str | None) -> Iterator[None]:
    """The kernel forms a row asks for (``Variant.stacked``), in force inside the block: the fused path reads
    them when it launches, and a CUDA graph keeps what it captured."""
    from .kernels import history

    if stacked is None:
        yield
        return
    before = history.HISTORY_STACKED_CONFIG
    history.HISTORY_STACKED_CONFIG = None if stacked == "off" else tuple(int(v) for v in stacked.split(","))
    try:
        yield
    finally:
        history.HISTORY_STACKED_CONFIG = before


def _stacked_label(config: tuple[int, ...] | None) -> str:
    return "off" if config is None else ",".join(map(str, config))


def bench_device(args: argparse.Namespace, command: str) -> "torch.device":
    """The device a bench command measures: --device, or one clear line where it asks for a missing GPU."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{command} measures a GPU and this machine has none (torch sees no CUDA device); "
                         "--device cpu runs a small smoke test of the command instead")
    return torch.device(args.device)


def bench_model(args: argparse.Namespace) -> int:
    import torch

    from .config import build_config

    device = bench_device(args, "bench model")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        raise UsageError("--steps, --warmup and --rounds must be at least 1")
    if args.heads < 1:
        raise UsageError(f"--heads must be positive, got {args.heads}")
    variants = select_variants(args.variants, all_variants(_sites_per_pass(args.sites_per_pass),
                                                           _fold_norms(args.fold_norms),
                                                           _stacked_configs(args.stacked_config)))
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
        _timed_steps(training.step, 0, args.warmup, device)
    ours, theirs, ratios, clocks = [], [], [], []
    loss = None
    for r in range(args.rounds):
        pair = [(t, ours), (base, theirs)]
        clock = {}
        for training, into in pair if r % 2 == 0 else pair[::-1]:
            times, loss_r = _timed_steps(training.step, args.warmup + args.steps * (r + 1), args.steps, device)
            clock[training is t] = sm_clock_mhz(device)
            into.append(statistics.median(times))
            if training is t:
                loss = loss_r
        ratios.append(theirs[-1] / ours[-1])
        clocks.append([clock[True], clock[False]])
    _record_times(row, ours, loss, tokens)  # the median of the rounds' medians
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


# ------------------------------------------------------------------------------------------------ one variant


def build_model(v: Variant, preset: str, heads: int, vocab: int, device: torch.device):
    import torch

    from .config import build_config
    from .model import Decoder

    cfg = build_config(overrides={"model.preset": preset, **v.overrides(heads)})
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(cfg.model, cfg.residual, vocab)
    if v.sites_per_pass is not None:
        model.residual.sites_per_pass = v.sites_per_pass
    if v.fold_norms is not None:
        model.residual.fold_norms = v.fold_norms
    return model


def run_variant(v: Variant, args: argparse.Namespace, batch: int, seq: int, vocab: int,
                device: torch.device, held: list[Training]) -> Iterator[dict]:
    """The variant's rows, each as soon as it is measured: the ordinary step, then (``--cuda-graph``) the
    same model's step replayed from a CUDA graph. A measurement that fails is a row that says why (out of
    memory, an error), and the next one still runs. The training, where it was built, is left in ``held``
    (running its last step: the replayed one after a capture) for the caller to release."""
    row = _new_row(v, args, cuda_graph=False)
    training = attempt(row, _measure, v, args, batch, seq, vocab, device, row)
    if training is not None:
        held.append(training)
    yield row
    if args.cuda_graph:
        graph_row = _new_row(v, args, cuda_graph=True)
        if training is None:
            graph_row["status"] = "not measured: the ordinary step failed"
        elif attempt(graph_row, _measure_graph, training, args, batch * seq, row, graph_row) is None:
            held.clear()  # a failed capture's step is not the one to time again
        yield graph_row


def routing_heads(v: Variant, heads: int) -> int | None:
    """The routing heads of a row: --heads for kinds that read residual.heads, 1 for AttnRes, else none."""
    from .model.residual import RESIDUALS

    if v.routing == "attnres":
        return 1
    return heads if "heads" in RESIDUALS[v.routing].shared else None


def _new_row(v: Variant, args: argparse.Namespace, cuda_graph: bool) -> dict[str, Any]:
    return {
        "variant": v.name + ("-graph" if cuda_graph else ""), "routing": v.routing,
        "heads": routing_heads(v, args.heads),
        "grouping": v.grouping, "path": v.path, "compiled": v.compiled,
        "compile_mode": args.compile_mode if v.compiled else None, "cuda_graph": cuda_graph, "sites_per_pass": None,
        "fold_norms": None, "stacked_config": None,
        "tokens_per_s": None, "peak_gb": None, "step_ms": None, "routing_ms": None, "rest_ms": None,
        "kernel_ms": None, "split_from": None, "warmup_s": None, "status": "ok"}


def attempt(row: dict, measure, *args, status: str = "status"):
    """``measure(*args)``, or None with the reason in ``row[status]`` (``bench infer`` uses it too)."""
    import torch

    try:
        return measure(*args)
    except torch.OutOfMemoryError:
        row[status] = "out of memory"
    except Exception as e:  # a row that says what broke, and the next measurement still runs
        row[status] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        traceback.print_exc()
    return None


class Training:
    """What a variant's rows share: the model, and the training step that ``train`` runs on it
    (``training.step.TrainStep``: bf16 autocast, clipping, fused AdamW with routing parameters undecayed),
    fed a few random batches. Built once per variant: compiling the paper's shapes takes a minute."""

    def __init__(self, v: Variant, args: argparse.Namespace, batch: int, seq: int, vocab: int,
                 device: torch.device):
        import torch

        from .config import OptimConfig
        from .training.step import make_loss, make_optimizer

        self.device, self.cuda = device, device.type == "cuda"
        self.stacked = v.stacked  # the kernel forms its steps launch (``kernel_forms``)
        # What was on the GPU before this variant (--rounds keeps the baselines there): not its memory.
        self.resident = torch.cuda.memory_allocated(device) if self.cuda else 0
        if v.compiled:
            torch._dynamo.reset()  # each model compiles afresh: no stale guards, no cache-size fallback to eager
        self.model = model = build_model(v, args.preset, args.heads, vocab, device)
        self.optim = OptimConfig(lr=1e-4)  # the paper's recipe: AdamW (0.9, 0.95), weight decay 0.1, clip 1.0
        self.opt = make_optimizer(model, self.optim, device)
        gen = torch.Generator(device=device).manual_seed(1)
        data = [torch.randint(0, vocab, (batch, seq + 1), device=device, generator=gen) for _ in range(3)]
        self.data = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
        self.loss_fn = make_loss(model, args.compile_mode if v.compiled else None)
        self.train_step = self.new_step(cuda_graph=False)

    def new_step(self, cuda_graph: bool):
        import torch

        from .training.step import TrainStep

        return TrainStep(self.model, self.opt, self.loss_fn, grad_clip=self.optim.grad_clip,
                         autocast=torch.bfloat16 if self.cuda else None, device=self.device, cuda_graph=cuda_graph)

    def step(self, i: int) -> torch.Tensor:
        with kernel_forms(self.stacked):
            return self.train_step(*self.data[i % len(self.data)])

    def peak_gb(self) -> float:
        """The GPU memory this variant's step peaked at since the last reset, in GB."""
        import torch

        return round((torch.cuda.max_memory_allocated(self.device) - self.resident) / 1e9, 2)


def _measure(v: Variant, args: argparse.Namespace, batch: int, seq: int, vocab: int, device: torch.device,
             row: dict) -> Training:
    """The ordinary row: warm-up (compilation included), timed steps, the profiled step that splits the
    time; returns the training for the graph row."""
    import torch

    t = Training(v, args, batch, seq, vocab, device)
    if v.path == "fused":
        from .kernels import history

        row["sites_per_pass"] = t.model.residual.sites_per_pass
        row["fold_norms"] = t.model.residual.fold_norms
        row["stacked_config"] = v.stacked or _stacked_label(history.HISTORY_STACKED_CONFIG)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        t.step(i)
    _sync(device)
    row["warmup_s"] = round(time.perf_counter() - t0, 1)
    if t.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    _record_times(row, *_timed_steps(t.step, args.warmup, args.steps, device), batch * seq)
    if t.cuda:
        row["peak_gb"] = t.peak_gb()
    if not args.no_split:
        split = _split(t.model, t.step, device, v.compiled)
        # Compiled reference-path routing is fused with its neighbours: no routing time of its own, but
        # the step's kernels still say where its GPU time goes.
        if v.routing != "baseline" and not (v.compiled and v.path == "reference"):
            row["routing_ms"] = round(split["routing_ms"], 2)
            row["rest_ms"] = round(row["step_ms"] - row["routing_ms"], 2)
            row["routing_top"] = split.get("routing_top")
        if "kernel_ms" in split:
            row["kernel_ms"] = round(split["kernel_ms"], 2)
            row["top_kernels"] = split["top_kernels"]
    return t


def _measure_graph(t: Training, args: argparse.Namespace, tokens: int, ordinary: dict, row: dict) -> Training:
    """The graph row: the same step captured once (``TrainStep.prepare``), then replayed (untimed, then
    timed) after copying each batch into the captured inputs."""
    import torch

    for key in ("sites_per_pass", "fold_norms", "stacked_config"):
        row[key] = ordinary[key]
    t0 = time.perf_counter()
    t.train_step = t.new_step(cuda_graph=True)
    with kernel_forms(t.stacked):  # what the graph captures is what its replays run
        t.train_step.prepare(*t.data[0])  # resets the peak before capturing: a replay allocates nothing
    if not t.train_step.captured:
        raise RuntimeError(t.train_step.note)
    for i in range(args.warmup):
        t.step(i)
    _sync(t.device)
    row["warmup_s"] = round(time.perf_counter() - t0, 1)
    _record_times(row, *_timed_steps(t.step, args.warmup, args.steps, t.device), tokens)
    row["peak_gb"] = t.peak_gb()
    _copy_split(ordinary, row)
    return t


def _copy_split(ordinary: dict, row: dict) -> None:
    """A replay runs the kernels of the ordinary step, so the ordinary row's profiled routing and kernel
    times hold for the graph row; its rest is its own step time less routing."""
    if ordinary["routing_ms"] is None and ordinary["kernel_ms"] is None:
        return
    row["routing_ms"], row["kernel_ms"] = ordinary["routing_ms"], ordinary["kernel_ms"]
    for key in ("routing_top", "top_kernels"):
        if key in ordinary:
            row[key] = ordinary[key]
    if row["routing_ms"] is not None:
        row["rest_ms"] = round(row["step_ms"] - row["routing_ms"], 2)
    row["split_from"] = "profiled eager-launch step"


def _record_times(row: dict, times: list[float], loss: torch.Tensor, tokens: int) -> None:
    """Median step time and tokens/s, once the last step's loss is known to be finite."""
    loss = loss[0] if loss.dim() else loss  # a step returns [loss, gradient norm]
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"the loss is {loss.item()}")
    row["step_ms"] = round(statistics.median(times), 2)
    row["tokens_per_s"] = round(tokens / (row["step_ms"] / 1e3), 1)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(step, first: int, n: int, device: torch.device) -> tuple[list[float], torch.Tensor]:
    """Milliseconds per step: CUDA events around each step (no synchronisation between steps, so the
    host runs ahead as in training), or the host clock on CPU."""
    import torch

    if device.type == "cuda":
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for i, (a, b) in enumerate(marks):
            a.record()
            loss = step(first + i)
            b.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in marks], loss
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        loss = step(first + i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times, loss


def _split(model, step, device: torch.device, compiled: bool) -> dict:
    """Routing time in one profiled step: kernel time on a GPU (CPU time on a CPU run), the total kernel
    time of the step (the GPU was idle for the rest: waiting on the host), the costliest routing kernels
    and the costliest kernels of the whole step."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from .model.residual.fused import ROUTING_RANGE

    residual = model.residual
    patched = {}
    # The reference path has no ranges of its own: wrap its calls for this step (the fused path marks its
    # forward and backward itself, and the instance is left as it was afterwards). Not under compile,
    # where a patched method would fail the guards and recompile the model.
    for name in ("start", "read", "write", "finish") if not compiled else ():
        method = getattr(residual, name)

        def wrapped(*a, _m=method):
            with record_function(ROUTING_RANGE):
                return _m(*a)

        patched[name] = wrapped
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        for name, fn in patched.items():
            setattr(residual, name, fn)
        with profile(activities=activities) as prof:
            step(10_000)
            _sync(device)
    finally:
        for name in patched:
            delattr(residual, name)
    return routing_time(prof.events(), device.type == "cuda")


def routing_time(events, on_device: bool) -> dict:
    """Attribute time to routing: the ``mhar::routing`` ranges, and the backward nodes whose forward op ran
    inside one (same autograd sequence number). On a GPU, the durations of the kernels launched under
    them (each kernel once); on a CPU, the outermost ranges' CPU time. Milliseconds."""
    from collections import Counter

    from .model.residual.fused import ROUTING_RANGE

    def inside(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name == ROUTING_RANGE:
                return True
            p = p.cpu_parent
        return False

    forward_seq = {(e.sequence_nr, e.thread) for e in events
                   if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine") and inside(e)}
    chosen = {id(e) for e in events if e.name == ROUTING_RANGE
              or (e.name.startswith("autograd::engine::evaluate_function")
                  and (e.sequence_nr, e.fwd_thread) in forward_seq)}

    def routed(e) -> bool:
        while e is not None:
            if id(e) in chosen:
                return True
            e = e.cpu_parent
        return False

    if not on_device:
        total = sum(e.cpu_time_total for e in events if id(e) in chosen and not routed(e.cpu_parent))
        return {"routing_ms": total / 1e3}
    routing, busy, top, every = 0.0, 0.0, Counter(), Counter()
    for e in events:
        kernels = [k for k in e.kernels if k.name != ROUTING_RANGE]
        if not kernels:
            continue
        us = sum(k.duration for k in kernels)
        busy += us
        for k in kernels:
            every[k.name[:60]] += k.duration
        if routed(e):
            routing += us
            for k in kernels:
                top[k.name[:60]] += k.duration
    return {"routing_ms": routing / 1e3, "kernel_ms": busy / 1e3,
            "routing_top": [[name, round(us / 1e3, 2)] for name, us in top.most_common(6)],
            "top_kernels": [[name, round(us / 1e3, 2)] for name, us in every.most_common(8)]}


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

    from .config import build_config
    from .model import Decoder

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
