"""One row of ``bench model``: a variant's model and optimiser built on random tokens, its steps timed with
CUDA events (eager, compiled or replayed from a CUDA graph), its peak memory, and the step split into
routing and the rest from one profiled step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from .variants import Variant, stacked_label, kernel_forms


if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported inside the functions that run: the command line builds this parser for every command.

# ------------------------------------------------------------------------------------------------ one variant


def build_model(v: Variant, preset: str, heads: int, vocab: int, device: torch.device):
    import torch

    from ..config import build_config
    from ..model import Decoder

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
    from ..variants import RESIDUALS

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

        from ..config import OptimConfig
        from ..training.step import make_loss, make_optimizer

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

        from ..training.step import TrainStep

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
        from ..kernels import history

        row["sites_per_pass"] = t.model.residual.sites_per_pass
        row["fold_norms"] = t.model.residual.fold_norms
        row["stacked_config"] = v.stacked or stacked_label(history.HISTORY_STACKED_CONFIG)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        t.step(i)
    _sync(device)
    row["warmup_s"] = round(time.perf_counter() - t0, 1)
    if t.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    record_times(row, *timed_steps(t.step, args.warmup, args.steps, device), batch * seq)
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
    record_times(row, *timed_steps(t.step, args.warmup, args.steps, t.device), tokens)
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


def record_times(row: dict, times: list[float], loss: torch.Tensor, tokens: int) -> None:
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


def timed_steps(step, first: int, n: int, device: torch.device) -> tuple[list[float], torch.Tensor]:
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

    from ..variants.fused import ROUTING_RANGE

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

    from ..variants.fused import ROUTING_RANGE

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


