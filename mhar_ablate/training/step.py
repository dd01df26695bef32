"""One optimiser step, the code that `train`, `study` and `bench model` all run.

A step is: forward and next-token loss under the run's autocast, backward, gradient clipping, and fused
AdamW, whose update is skipped *on the device* once a step's loss or gradient norm is not finite (and for
every step after it, so the weights stay those from before the divergence). Nothing in a step makes the
host wait for the device: the learning rate is a device tensor that ``set_lr`` writes into, and each step
returns its loss and gradient norm as a device tensor that the caller reads when it synchronises anyway.

On CUDA, ``prepare`` captures the whole step in a CUDA graph (PyTorch's whole-network capture: warm-up on
a side stream, gradients None at capture so that the captured backward writes them afresh every replay,
static input buffers that each batch is copied into), and every later call replays it: a replay launches
no Python, so the step runs at the speed of its GPU work whatever the host costs per kernel. ``prepare``
leaves weights, optimiser state and gradients as it found them, so a captured run trains exactly the
steps that an uncaptured one with the same seed does.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import OptimConfig
from ..model.transformer import Decoder

GRAPH_WARMUP = 3  # side-stream steps before a capture, as in PyTorch's whole-network capture example
TIMED_STEPS = 2  # steps timed by ``prepare``: the training clock's first estimate of a step's length


def make_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW over the model's parameter groups (routing parameters undecayed). Fused, because it is
    one kernel over all parameters, reads a tensor learning rate and skips its update on the device when
    told that a step is not finite. ``TrainStep`` marks it capturable when it captures a CUDA graph."""
    return torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=True)


def make_loss(model: Decoder, compile_mode: str | None) -> Callable[[Tensor, Tensor], Tensor]:
    """Mean next-token cross-entropy of ``model``; compiled with ``compile_mode`` unless it is None. The
    loss is compiled with the model, so that the logits' cast and the cross-entropy fuse. The output head
    is called here rather than inside ``model``'s forward, so that it shares the loss's graph even where the
    model's body breaks the graph (the fused routing is opaque to the compiler), as in the baseline's one
    graph. Split between two graphs, the loss's held a second logits-sized tensor at the step's peak
    (5.0 GB at ``paper100m``; docs/benchmarks.md, "Memory")."""

    def loss(x: Tensor, y: Tensor) -> Tensor:
        embeddings, weight = model.embed_tokens(x)
        logits = model.head(model.hidden(embeddings), weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    return torch.compile(loss, mode=compile_mode) if compile_mode is not None else loss


class TrainStep:
    """``step(x, y)`` trains on one batch and returns ``[loss, grad_norm]`` on the device.

    ``cuda_graph``: capture the step in ``prepare`` (CUDA only). Where capture is impossible (no CUDA
    device) or fails, the step runs uncaptured and ``note`` says why; ``captured`` says what runs.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: Callable[[Tensor, Tensor], Tensor],
                 *, grad_clip: float, autocast: torch.dtype | None, device: torch.device, cuda_graph: bool,
                 backward: Callable[[Tensor], None] | None = None):
        self.model, self.optimizer, self.loss_fn, self.device = model, optimizer, loss, device
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")
        self.autocast_dtype = autocast
        self.backward = backward or (lambda loss: loss.backward())
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.want_graph = cuda_graph
        self.note: str | None = None
        if cuda_graph and device.type != "cuda":
            self.note = "train.cuda_graph: no CUDA device, so the step runs uncaptured"
        self.captured = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self._static: tuple[Tensor, Tensor, Tensor] | None = None  # x, y and the [loss, norm] output
        # One learning-rate tensor shared by every parameter group: the schedule writes one number a step.
        self.lr = torch.tensor(float(optimizer.param_groups[0]["lr"]), device=device)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        # Set once a step is not finite, never cleared: the optimiser reads it as "skip the update".
        self.poisoned = torch.zeros((), device=device)
        optimizer.found_inf = self.poisoned
        self.seconds_per_step: float | None = None  # measured by prepare

    # ------------------------------------------------------------------------------------------ stepping
    def set_lr(self, value: float) -> None:
        self.lr.fill_(value)

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        """Train on ``x, y`` (on the device, or pinned host tensors, copied without waiting)."""
        if self.graph is None:
            out = self._step(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            self.optimizer.zero_grad(set_to_none=True)
            return out
        sx, sy, out = self._static
        sx.copy_(x, non_blocking=True)
        sy.copy_(y, non_blocking=True)
        self.graph.replay()
        return out.clone()  # the graph rewrites its output on the next replay

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # No weight-cast cache: a CUDA graph replays the casts, a cache would be stale after the update.
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _step(self, x: Tensor, y: Tensor) -> Tensor:
        with self.autocast():
            loss = self.loss_fn(x, y)
        self.backward(loss)
        # error_if_nonfinite=False (the default) keeps the norm on the device: no synchronisation.
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        loss = loss.detach().float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        torch.maximum(self.poisoned, bad.float(), out=self.poisoned)
        self.optimizer.step()
        return torch.stack([loss, norm.float()])

    # ------------------------------------------------------------------------------------------ prepare
    def prepare(self, x: Tensor, y: Tensor, log: Callable[[str], None] | None = None) -> float:
        """Compile, warm up and (if asked) capture the step on the batch ``x, y``, then time a few steps;
        weights, optimiser state and gradients are restored afterwards. Returns the seconds it took."""
        started = time.perf_counter()
        x, y = x.to(self.device), y.to(self.device)
        saved = self._snapshot()
        try:
            if self.want_graph and self.can_capture():
                try:
                    self._capture(x, y)
                except Exception as e:  # a capture that cannot work trains uncaptured, and says so
                    self.graph, self._static = None, None
                    self._capturable(False)
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                    self.note = f"train.cuda_graph: capture failed ({type(e).__name__}: {first}), so the step runs uncaptured"
                    self.optimizer.zero_grad(set_to_none=True)
                    self._restore(saved)
            if self.graph is None:
                self.optimizer.zero_grad(set_to_none=True)
                self(x, y)  # compilation and lazy allocation, outside any timing
                _reset_peak_memory(self.device)
            self.seconds_per_step = self._time(x, y)
        finally:
            self._restore(saved)
            if self.graph is None:
                self.optimizer.zero_grad(set_to_none=True)
        self.captured = self.graph is not None
        if self.note and log is not None:
            log(self.note)
        return time.perf_counter() - started

    def can_capture(self) -> bool:
        return self.device.type == "cuda"

    def _capturable(self, on: bool) -> None:
        # AdamW refuses to be captured unless its groups say capturable; fused, it runs the same either way.
        for group in self.optimizer.param_groups:
            group["capturable"] = on

    def _capture(self, x: Tensor, y: Tensor) -> None:
        self._capturable(True)
        # An earlier step's autograd graph that only a reference cycle keeps alive (``FusedState.release``
        # names one: the fused path's state of the step that compiled the model) holds the parameters'
        # AccumulateGrad nodes, bound to the stream that step ran on (the default one); the captured
        # backward would then accumulate on that stream and the capture fail. Collected here, the nodes are
        # made anew on the side stream below.
        gc.collect()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), warnings.catch_warnings():
            # "capturable=True ... step() is running without CUDA graph capture": these steps are the warm-up.
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            for _ in range(GRAPH_WARMUP):
                self._step(x, y)
                self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # The warm-up's activations, freed, would stay cached in the allocator's ordinary pool while the
        # capture allocates a step's worth again in the graph's private pool: handed back first (the
        # evaluations hand back theirs too: LMModule.evaluate).
        torch.cuda.empty_cache()
        # The peak of a captured step is its capture's: a replay allocates nothing.
        _reset_peak_memory(self.device)
        # Gradients None at capture: the captured backward allocates them in the graph's pool and writes
        # rather than accumulates them, so nothing in the graph has to zero them.
        self.optimizer.zero_grad(set_to_none=True)
        sx, sy = x.clone(), y.clone()
        graph = torch.cuda.CUDAGraph()
        home = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph):
                out = self._step(sx, sy)
        finally:
            # A failed capture raises out of torch.cuda.graph's exit before it restores the stream.
            torch.cuda.set_stream(home)
        self.graph, self._static = graph, (sx, sy, out)

    def _time(self, x: Tensor, y: Tensor) -> float:
        """Seconds per step over a few steps (the state is restored afterwards by the caller)."""
        if x.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(TIMED_STEPS):
                self(x, y)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / TIMED_STEPS
        t0 = time.perf_counter()
        for _ in range(TIMED_STEPS):
            self(x, y)
        return (time.perf_counter() - t0) / TIMED_STEPS

    # ------------------------------------------------------------------------------------------ state
    def _snapshot(self) -> dict:
        """Host copies of the weights and optimiser state (host memory: a snapshot on the GPU would count
        in the peak memory that a run reports)."""
        params = [p.detach().to("cpu", copy=True) for p in self.params]
        state = {id(p): {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                         for k, v in self.optimizer.state[p].items()}
                 for p in self.params if p in self.optimizer.state}
        return {"params": params, "state": state, "lr": float(self.lr), "poisoned": float(self.poisoned)}

    @torch.no_grad()
    def _restore(self, saved: dict) -> None:
        """Put the snapshot back in place (the captured graph keeps the tensors' addresses). State that the
        warm-up created from nothing is zeroed, which is what AdamW's first step starts from."""
        for p, value in zip(self.params, saved["params"]):
            p.copy_(value)
        for p in self.params:
            if p not in self.optimizer.state:
                continue
            before = saved["state"].get(id(p))
            for k, v in self.optimizer.state[p].items():
                if not torch.is_tensor(v):
                    continue
                if before is None:
                    v.zero_()
                else:
                    v.copy_(before[k])
        self.lr.fill_(saved["lr"])
        self.poisoned.fill_(saved["poisoned"])


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
