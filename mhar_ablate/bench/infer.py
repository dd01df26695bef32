"""``mhar-ablate bench infer``: inference cost of the residual variants on one GPU.

Per variant and per ``--batch`` value, on random weights and tokens (speed does not depend on them):

- prefill: one forward over ``batch`` prompts of the preset's ``seq_len`` tokens into an empty KV cache,
  the last position's logits only (what generation needs); tokens/s from the median of ``--repeats`` runs;
- decode: after a prompt of ``seq_len - new_tokens`` tokens, ``--new-tokens`` greedy steps of one token
  (a step: the cached forward and the argmax that feeds the next one); the median step time per token,
  CUDA events on a GPU, so decode runs at context lengths seq_len - new_tokens .. seq_len;
- peak memory over both (weights, KV cache and activations), and the KV cache's own size;
- with ``--cuda-graph``, the same decode with each step replayed from one CUDA graph (``graph_decode``):
  the GPU's work per token without the host's launch cost, which dominates an eager step at batch 1.

Variants are those of ``bench model`` (the registry's kinds; AttnRes, MHAR and delta with ``full`` and
``block:4`` grouping, each on the reference and the fused path), run eagerly: the model's weights in bf16
under bf16 autocast on a GPU (fp32 without autocast on a CPU). Each row of a variant is measured after one
untimed round of the same work (Triton compilation, allocator warm-up). The fused path decodes through
the same kernels as in training, with one token per sequence (T = 1).

Without a GPU the command refuses, unless ``--device cpu`` asks for a small smoke run (16-token prompts,
4 new tokens).
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .variants import PAPER_VOCAB, Variant, all_variants
from .step import attempt, build_model, routing_heads
from .options import add_shared_options, bench_device
from .model import cell, markdown_table
from ..errors import UsageError

CPU_SEQ, CPU_NEW_TOKENS = 16, 4  # --device cpu: a smoke run, not a measurement


def infer_name(v: Variant) -> str:
    """``bench model``'s name without the compile mode: every row here is eager."""
    return v.name.removesuffix("-eager")


def infer_variants() -> list[Variant]:
    return [v for v in all_variants([None]) if not v.compiled]


def select(spec: str, variants: list[Variant]) -> list[Variant]:
    """Comma-separated names or shell patterns (``mhar-*``, ``all``); the baseline is always added."""
    chosen = set()
    for pattern in (p.strip() for p in spec.split(",") if p.strip()):
        hits = [v for v in variants if pattern == "all" or fnmatch.fnmatchcase(infer_name(v), pattern)]
        if not hits:
            names = ", ".join(infer_name(v) for v in variants)
            raise UsageError(f"--variants: {pattern!r} matches no variant; the variants are {names}")
        chosen.update(hits)
    chosen.add(variants[0])  # the baseline, first in the registry's order
    return [v for v in variants if v in chosen]


def add_infer_parser(targets: Any) -> None:
    m = targets.add_parser("infer", help="inference of each variant: prefill tokens/s, per-token decode latency "
                                         "with a KV cache, peak memory")
    add_shared_options(m)
    m.add_argument("--variants", default="all", metavar="LIST",
                   help="comma-separated variant names or patterns, e.g. 'mhar-*,attnres-full-fused' (default: all); "
                        "names: baseline, {attnres,mhar,delta}-{full,block4}-{ref,fused}, "
                        "hc, hc-static, mhc, denseformer, muddformer")
    m.add_argument("--batch", default="1,16", metavar="N[,N...]",
                   help="sequences at once, one row per value (default 1,16)")
    m.add_argument("--seq", type=int, help=f"prefill tokens per sequence (default: the preset's seq_len; "
                                           f"{CPU_SEQ} with --device cpu)")
    m.add_argument("--new-tokens", type=int, help=f"decode steps timed, after a prompt of seq - new tokens "
                                                  f"(default 32; {CPU_NEW_TOKENS} with --device cpu)")
    m.add_argument("--repeats", type=int, default=3, help="timed prefill runs, median taken (default 3)")
    m.add_argument("--cuda-graph", action="store_true",
                   help="also replay each decode step from a CUDA graph (the graph ms/token column): the GPU work "
                        "without the host's launch cost")
    m.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list (after every row)")


def _batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"--batch takes positive integers, e.g. 1,16; got {text!r}")
    return list(dict.fromkeys(values))


def bench_infer(args: argparse.Namespace) -> int:
    import torch

    from ..config import build_config

    device = bench_device(args, "bench infer")
    if args.heads < 1 or args.repeats < 1:
        raise UsageError("--heads and --repeats must be at least 1")
    if args.cuda_graph and args.device == "cpu":
        raise UsageError("--cuda-graph needs a GPU: a CUDA graph replays CUDA work, and --device cpu has none")
    batches = _batches(args.batch)
    variants = select(args.variants, infer_variants())
    cpu = device.type == "cpu"
    model_cfg = build_config(overrides={"model.preset": args.preset, "residual.kind": "baseline"}).model
    seq = args.seq or (CPU_SEQ if cpu else model_cfg.seq_len)
    new = args.new_tokens or (CPU_NEW_TOKENS if cpu else 32)
    if not 2 <= seq <= model_cfg.seq_len:
        raise UsageError(f"--seq must be between 2 and the preset's seq_len {model_cfg.seq_len}, got {seq}")
    if not 1 <= new < seq:
        raise UsageError(f"--new-tokens must be between 1 and --seq - 1 = {seq - 1} (decode follows a prompt of "
                         f"seq - new tokens), got {new}")
    vocab = model_cfg.vocab_size or PAPER_VOCAB
    dtype = torch.float32 if cpu else torch.bfloat16
    env = {"device": torch.cuda.get_device_name(device) if not cpu else "cpu", "torch": torch.__version__,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    print(f"bench infer: preset {args.preset} (d={model_cfg.d_model}, {model_cfg.n_layers} layers, vocab {vocab:,}); "
          f"prefill {seq} tokens a sequence, decode {new} tokens after {seq - new}; batch {', '.join(map(str, batches))}; "
          f"{'fp32' if cpu else 'bf16 weights, bf16 autocast'}{', decode also from CUDA graphs' if args.cuda_graph else ''}; "
          f"{env['device']}, torch {env['torch']}", flush=True)
    rows: list[dict] = []
    for v in variants:
        print(f"-- {infer_name(v)}", flush=True)
        built: dict[str, str] = {"status": "ok"}
        model = attempt(built, inference_model, v, args, vocab, device, dtype)
        for batch in batches:
            row = _new_row(v, args, batch, seq, new, dtype)
            row.update(preset=args.preset, vocab=vocab, **env)
            if model is None:
                row["status"] = built["status"]
            else:
                attempt(row, measure, model, batch, seq, new, vocab, device, args.repeats, args.cuda_graph, row)
            rows.append(row)
            print("   " + _summary(row), flush=True)
            _ratios(rows)
            if args.json:  # after every row: a run cut short still leaves what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        del model
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
    print()
    print(render_table(rows))
    return 0


def inference_model(v: Variant, args: argparse.Namespace, vocab: int, device, dtype):
    """The variant's model in inference form."""
    model = build_model(v, args.preset, args.heads, vocab, device).eval().requires_grad_(False)
    model.to(dtype)
    # The rotary tables stay float32, as under autocast in training (bf16 angles are off by a token's
    # phase at a thousand positions).
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    if hasattr(model.residual, "record"):
        model.residual.record = False  # depth weights are a training diagnostic
    return model


def _new_row(v: Variant, args: argparse.Namespace, batch: int, seq: int, new: int, dtype) -> dict[str, Any]:
    return {"variant": infer_name(v), "routing": v.routing, "heads": routing_heads(v, args.heads), "grouping": v.grouping,
            "path": v.path, "batch": batch, "prefill_tokens": seq, "decode_context": seq - new, "new_tokens": new,
            "dtype": str(dtype).removeprefix("torch."), "prefill_ms": None, "prefill_tokens_per_s": None,
            "decode_ms_per_token": None, "decode_tokens_per_s": None, "peak_gb": None, "kv_cache_mb": None,
            "decode_graph_ms_per_token": None, "decode_graph_tokens_per_s": None, "graph_check_rel_err": None,
            "graph_status": None, "status": "ok"}


class _Clock:
    """Milliseconds of a piece of work: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.marks: list = []
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def __enter__(self):
        self._start = self._event() if self.cuda else time.perf_counter()
        if self.cuda:
            self._start.record()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            end = self._event()
            end.record()
            self.marks.append((self._start, end))
        else:
            self.marks.append((time.perf_counter() - self._start) * 1e3)

    def times(self) -> list[float]:
        import torch

        if not self.cuda:
            return list(self.marks)
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.marks]


def measure(model, batch: int, seq: int, new: int, vocab: int, device, repeats: int, cuda_graph: bool,
            row: dict) -> None:
    """Fill the row's prefill, decode and memory figures (see the module docstring)."""
    import torch

    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    # No cast cache: the weights are bf16 already, and a CUDA graph must not capture cached casts.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda, cache_enabled=False)

    def prefill(clock: _Clock | None):
        cache = model.new_cache(batch, seq)
        with clock or nullcontext():
            logits = model(prompt, cache, last_only=True)
        return logits

    def decode(clock: _Clock | None):
        """The timed steps; returns the first step's logits (what the graph's first replay must give)."""
        cache = model.new_cache(batch, seq)
        tok = model(prompt[:, :seq - new], cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        first = None
        for _ in range(new):
            with clock or nullcontext():
                logits = model(tok, cache)
                tok = logits[:, -1].argmax(-1, keepdim=True)
            first = logits if first is None else first
        return first

    with torch.inference_mode(), autocast:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        prefill(None)  # warm-up: Triton compilation, the allocator's first blocks
        clock = _Clock(device)
        for _ in range(repeats):
            logits = prefill(clock)
        row["prefill_ms"] = round(statistics.median(clock.times()), 3)
        if not torch.isfinite(logits).all():
            raise RuntimeError("the prefill's logits are not finite")
        decode(None)
        clock = _Clock(device)
        eager_first = decode(clock)
        row["decode_ms_per_token"] = round(statistics.median(clock.times()), 3)
        if cuda:
            row["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 3)
        if cuda_graph:
            row["graph_status"] = "ok"
            attempt(row, graph_decode, model, prompt, new, eager_first, row, status="graph_status")
    cfg = model.cfg  # keys and values of every layer, as KVCache holds them
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    elements = 2 * cfg.n_layers * batch * cfg.n_kv_heads * seq * head_dim
    row["kv_cache_mb"] = round(elements * model.embed.weight.element_size() / 1e6, 3)
    row["prefill_tokens_per_s"] = round(batch * seq / (row["prefill_ms"] / 1e3), 1)
    row["decode_tokens_per_s"] = round(batch / (row["decode_ms_per_token"] / 1e3), 1)


# The first replayed step against the eager one at the same position: bf16 logits of two attention kernels
# (the prefix of the cache; all of it, masked) differ by rounding only; a captured step that read a stale
# position or cache would be off by far more.
GRAPH_CHECK_REL_ERR = 0.05


def graph_decode(model, prompt, new: int, eager_first, row: dict) -> None:
    """The decode of ``measure`` with every step replayed from one CUDA graph: the prompt into a cache made
    static (``KVCache.make_static``), two warm-up steps on a side stream, one step captured (forward and
    argmax into the token it reads), then ``new`` replays from the prompt's end, the first checked against
    the eager step, the others timed."""
    import torch

    batch, seq = prompt.shape
    cache = model.new_cache(batch, seq)
    tok = model(prompt[:, :seq - new], cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    cache.make_static()
    start = cache.position.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(tok, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(tok, cache)
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
    # The warm-up and the capture moved the position on; the replays start at the prompt's end again (the
    # warm-up's keys and values there are overwritten by the replays before anything reads them).
    cache.position.copy_(start)
    graph.replay()
    err = ((logits.float() - eager_first.float()).norm() / eager_first.float().norm()).item()
    row["graph_check_rel_err"] = round(err, 5)
    if not err <= GRAPH_CHECK_REL_ERR:
        raise RuntimeError(f"the replayed step's logits are {err:.3f} from the eager step's (relative norm)")
    clock = _Clock(torch.device("cuda"))
    for _ in range(new - 1):
        with clock:
            graph.replay()
    row["decode_graph_ms_per_token"] = round(statistics.median(clock.times()), 3)
    row["decode_graph_tokens_per_s"] = round(batch / (row["decode_graph_ms_per_token"] / 1e3), 1)
    del graph


def _ratios(rows: list[dict]) -> None:
    """Each row's prefill throughput and decode latency over the baseline's at the same batch."""
    for row in rows:
        base = next((r for r in rows if r["routing"] == "baseline" and r["batch"] == row["batch"]
                     and r["status"] == "ok"), None)
        ok = base is not None and row["status"] == "ok"
        row["prefill_ratio_to_baseline"] = (round(row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 4)
                                            if ok else None)
        row["decode_latency_ratio_to_baseline"] = (round(row["decode_ms_per_token"] / base["decode_ms_per_token"], 4)
                                                   if ok else None)
        graphs = ok and row["decode_graph_ms_per_token"] and base["decode_graph_ms_per_token"]
        row["graph_latency_ratio_to_baseline"] = (
            round(row["decode_graph_ms_per_token"] / base["decode_graph_ms_per_token"], 4) if graphs else None)


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"batch {row['batch']}: {row['status']}"
    peak = "" if row["peak_gb"] is None else f", peak {row['peak_gb']:.2f} GB"
    graph = ""
    if row["graph_status"] == "ok":
        graph = f", from a CUDA graph {row['decode_graph_ms_per_token']:.2f} ms/token"
    elif row["graph_status"] is not None:
        graph = f", CUDA graph: {row['graph_status']}"
    return (f"batch {row['batch']}: prefill {row['prefill_tokens_per_s']:,.0f} tokens/s, decode "
            f"{row['decode_ms_per_token']:.2f} ms/token{graph}{peak}")


def render_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (what ``docs/benchmarks.md`` shows)."""
    return markdown_table(
        ["variant", "batch", "prefill tokens/s", "× baseline", "decode ms/token", "× baseline", "decode tokens/s",
         "graph ms/token", "× baseline", "peak GB", "KV cache MB", "status"],
        [[r["variant"], str(r["batch"]), cell(r["prefill_tokens_per_s"], ",.0f"), cell(r["prefill_ratio_to_baseline"], ".3f"),
          cell(r["decode_ms_per_token"], ".2f"), cell(r["decode_latency_ratio_to_baseline"], ".3f"),
          cell(r["decode_tokens_per_s"], ",.0f"), cell(r["decode_graph_ms_per_token"], ".2f"),
          cell(r.get("graph_latency_ratio_to_baseline"), ".3f"), cell(r["peak_gb"], ".2f"), cell(r["kv_cache_mb"], ",.1f"),
          r["status"] if r["graph_status"] in (None, "ok") else f"{r['status']}; graph: {r['graph_status']}"]
         for r in rows])
