"""Graph size under torch.compile of each residual kind's model: FX nodes of the AOT forward and backward
graphs of the training loss (``training.step.make_loss``, under autocast), the seconds of the
first forward+backward (compiling) and of the next one (running only).

Compile time grows with these graphs (docs/benchmarks.md, "Comparison family", has the counts and the
H200's compile times). The model has the preset's depth (``--preset``, default paper350m: 24 layers, 48
residual sites) and, unless ``--full-width``, a tiny width, which changes no graph's node count. Each kind
may carry settings, ``kind:key=value:key=value``.

mHC rows come once per ``--sinkhorn`` path: ``reference`` (``_Sinkhorn``, the loop in the graph) and
``kernel`` (the Triton custom ops, one node each way; forced on the CPU too, where the interpreter runs
the graphs' real calls, not their tracing).

``--backend count`` (default) stops at the AOT graphs, which then run as traced, eagerly: first minus next
is the time to trace. ``inductor`` compiles them, for compile time on a GPU. Run from the repository root:

    PYTHONPATH=$PWD python3 benchmarks/compile_graph_size.py                     # baseline hc mhc, CPU
    PYTHONPATH=$PWD python3 benchmarks/compile_graph_size.py hc:residual.hc.dynamic=false mhc --sinkhorn kernel
    PYTHONPATH=$PWD python3 benchmarks/compile_graph_size.py mhc --device cuda --backend inductor --full-width

Prints a Markdown table: kind and settings, Sinkhorn path, forward nodes, backward nodes, first and next
seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from mhar_ablate.bench.model import cell, markdown_table
from mhar_ablate.config import build_config
from mhar_ablate.model import Decoder
from mhar_ablate.variants import mhc
from mhar_ablate.training.step import make_loss

TINY = {"model.d_model": "64", "model.ffn": "128", "model.n_heads": "4", "model.n_kv_heads": "2"}


def parse_kind(spec: str) -> tuple[str, dict]:
    """``kind:key=value:...`` -> (kind, overrides)."""
    kind, *settings = spec.split(":")
    over = {"residual.kind": kind}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise SystemExit(f"{spec}: settings are key=value, got {setting!r}")
        over[key] = value
    return kind, over


@contextlib.contextmanager
def sinkhorn_path(path: str):
    """mHC's ``sinkhorn`` forced to the reference or the kernel path, whatever the device."""
    from mhar_ablate.kernels.sinkhorn import sinkhorn_triton

    original = mhc.sinkhorn
    mhc.sinkhorn = sinkhorn_triton if path == "kernel" else mhc.sinkhorn_reference
    try:
        yield
    finally:
        mhc.sinkhorn = original


def counting_backend(counts: dict):
    """AOT autograd with compilers that count each graph's FX nodes and run it unchanged."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(name):
        def compile_graph(gm, example_inputs):
            counts[name] = counts.get(name, 0) + len(gm.graph.nodes)
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


def measure(over: dict, args, device: torch.device) -> tuple[int | None, int | None, float, float]:
    """(forward nodes, backward nodes, seconds of the first forward+backward, compiled cold, and of the
    next)."""
    cfg = build_config(overrides={"model.preset": args.preset, "model.seq_len": str(args.seq),
                                  "model.vocab_size": "256", **({} if args.full_width else TINY), **over})
    torch.manual_seed(0)
    model = Decoder(cfg.model, cfg.residual, cfg.model.vocab_size).to(device)
    vocab = cfg.model.vocab_size
    counts: dict = {}
    torch._dynamo.reset()
    backend = counting_backend(counts) if args.backend == "count" else "inductor"
    compiled = torch.compile(make_loss(model, None), backend=backend)  # the training loss, uncompiled, compiled here
    x, y = (torch.randint(0, vocab, (args.batch, args.seq), device=device) for _ in range(2))
    seconds = []
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compiled(x, y)
        loss.backward()  # the backward graph is compiled at its first call
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return counts.get("fw"), counts.get("bw"), *seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kinds", nargs="*", default=["baseline", "hc", "mhc"],
                   help="residual kinds, each optionally kind:key=value:... (default: baseline hc mhc)")
    p.add_argument("--sinkhorn", choices=("reference", "kernel", "both"), default="both",
                   help="mHC's Sinkhorn-Knopp path (default: a row for each)")
    p.add_argument("--backend", choices=("count", "inductor"), default="count")
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="paper350m")
    p.add_argument("--full-width", action="store_true", help="the preset's own width, not a tiny one")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args(argv)
    device = torch.device(args.device)

    rows = []
    for spec in args.kinds:
        kind, over = parse_kind(spec)
        paths = ["-"]
        if kind == "mhc":
            paths = ["reference", "kernel"] if args.sinkhorn == "both" else [args.sinkhorn]
        for path in paths:
            with sinkhorn_path(path) if path != "-" else contextlib.nullcontext():
                fw, bw, first, after = measure(over, args, device)
            rows.append((spec, path, fw, bw, first, after))
            print(f"{spec} ({path}): fw {fw}, bw {bw}, {first:.1f} s, next {after:.1f} s", flush=True)

    print(f"\n{args.preset}, backend {args.backend}, device {device}:\n")
    print(markdown_table(["kind", "sinkhorn", "fw nodes", "bw nodes", "first s", "next s"],
                         [[s, p, cell(f, ","), cell(b, ","), cell(t, ".1f"), cell(u, ".1f")]
                          for s, p, f, b, t, u in rows]))


if __name__ == "__main__":
    main()
