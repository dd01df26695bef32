"""The fused training path of the routed residuals (AttnRes, MHAR): one source buffer, Triton passes over
it (per site, or shared by a group of sites), and a backward that recomputes instead of saving per-site
copies.

The reference path stacks the visible sources at every site (O(L^2) copies, and O(L^2) saved activations
for backward). Here, per forward pass:

- every source is written once into a preallocated buffer ``(slots, N, d)``, with its RMS statistic
  beside it: in ``full`` grouping slot 0 is the embedding and slot j + 1 the output of sublayer j; in
  ``block:K`` grouping slot b + 1 is the sum of block b, written when the block is finished. A written
  slot is never modified again, so any site's backward can re-read it; the running partial sum of an
  unfinished block is an ordinary autograd tensor (a new one after every sublayer), passed to the sites
  that see it and saved by them.
- sites are taken in groups of consecutive sites (``sites_per_pass``, never across a block boundary): the
  group's first site routes all of its sites over the slots complete at that point (the history) in one
  pass (``kernels.history``), and each site then merges its partial state with its own extra sources: the
  slots written inside the group (``full``) or the block's partial sum (``block``). A group of one site
  is the per-site mode: one pass over everything the site reads.
- backward recomputes everything from the buffer; source gradients are written or added, in a fixed order,
  into a gradient buffer of the same shape: each site adds the gradients of its extra sources when its own
  backward runs, and the group's first site, whose backward runs after all the others of its group, adds
  the history's in one pass for all of them. A slot's writer hands the slot's gradient to autograd, after
  adding the part through the slot's RMS statistic that shared passes leave for later (their programs see
  one routing head; the statistic spans all of them).
- the routing parameters' gradients are summed into one (sites, d) buffer and handed to autograd once, by
  the writer of slot 0, whose backward runs last.

Order in backward: a slot's gradient is complete only after every site that reads it has run its backward.
Autograd knows nothing of the buffer, so each slot write returns a small dependency token that the next
write and the sites consume: every site that reads slot j is thereby downstream of slot j's writer.

Activation checkpointing of a region that contains routing is refused with an error (its recomputation
in backward cannot rebuild this state); checkpointing the sublayers themselves works.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROUTING_RANGE = "mhar::routing"  # profiler range around routing work, forward and backward
# Sites per shared pass over the history (see docs/benchmarks.md for the measurements behind it).
DEFAULT_SITES_PER_PASS = 1


def routing_range():
    """A profiler range around routing work (``mhar-ablate bench`` attributes kernel time with it), entered
    only while a profiler runs: a range costs microseconds, and there are a few hundred a step."""
    return torch.profiler.record_function(ROUTING_RANGE) if torch.autograd._profiler_enabled() else nullcontext()


def fused_supported(d: int, num_heads: int) -> bool:
    """The kernels tile the routing heads: H must be a power of two dividing d."""
    return num_heads >= 1 and num_heads & (num_heads - 1) == 0 and d % num_heads == 0


@dataclass(frozen=True)
class SitePlan:
    start: int  # the group's first site
    k: int  # this site's position in its group
    size: int  # sites in the group
    history: int  # buffer slots [0, history) read by the group's shared pass


def plan_sites(n_sites: int, block_sublayers: int, sites_per_pass: int) -> list[SitePlan]:
    """Which group each site belongs to and what it reads (see the module docstring)."""
    plans = []
    for s in range(n_sites):
        if block_sublayers == 1:
            start = s - s % sites_per_pass
            size = min(sites_per_pass, n_sites - start)
            history = start + 1
        else:
            finished, pos = divmod(s, block_sublayers)
            block_start = finished * block_sublayers
            start = block_start + pos - pos % sites_per_pass
            size = min(sites_per_pass, min(block_start + block_sublayers, n_sites) - start)
            history = finished + 1
        plans.append(SitePlan(start, s - start, size, history))
    return plans


class _Group:
    """What a group's sites share between forward and backward: fused query rows, log-sum-exps, and in
    backward the output gradients and deltas that the shared history pass needs."""

    def __init__(self, plan: SitePlan, qg: Tensor, lse: Tensor):
        self.plan = plan
        self.qg = qg  # (G, d) fp32: query * key gain of each site
        self.lse = lse  # (G, H, N) fp32: each site's log-sum-exp over everything it reads
        self.first: Tensor | None = None  # the history pass's normalised output of site 0 ...
        self.rest: Tensor | None = None  # ... and of sites 1.. (G - 1, N, d), dropped once merged
        self.grad_out: Tensor | None = None  # (G, N, d) in backward (G > 1)
        self.delta: Tensor | None = None  # (G, H, N) fp32 in backward
        self.ran = [False] * plan.size  # which sites have run their backward


class FusedState:
    """One forward pass of the fused path (``Residual.start`` returns it)."""

    def __init__(self, residual: Any, x0: Tensor):
        self.res = residual
        B, T, d = x0.shape
        self.shape, self.N, self.d = (B, T, d), B * T, d
        H, dev = residual.num_heads, x0.device
        # Sources are kept in the dtype the sublayers produce: under autocast that is the autocast type
        # (the embedding is stored in it too), otherwise the embedding's.
        self.dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else x0.dtype
        n_slots = residual.n_sites if residual.block_sublayers == 1 else 1 + (residual.n_sites - 1) // residual.block_sublayers
        self.buffer = torch.empty((n_slots, self.N, d), dtype=self.dtype, device=dev)
        self.rms = torch.empty((n_slots, self.N), dtype=torch.float32, device=dev)
        # Backward state, allocated by the first backward that needs it: source gradients (slots
        # [grad_low, n_slots) hold gradients; below: not yet), the per-head gradient through each slot's
        # RMS left by shared passes (``pending`` slots have some), and the routing parameters' gradient.
        self.grad: Tensor | None = None
        self.grad_low = n_slots
        self.dr: Tensor | None = None
        self.pending = [False] * n_slots
        self.dqg: Tensor | None = None
        self.plans = plan_sites(residual.n_sites, residual.block_sublayers, residual.sites_per_pass)
        # Every site's query * key gain, and its log-sum-exp per head and token: one tensor each for the
        # whole pass (groups take slices), fewer small launches and allocations per site.
        self.qg = (residual.query.detach().float() * residual.key_weight.detach().float()).contiguous()
        self.lse = torch.empty((residual.n_sites, H, self.N), dtype=torch.float32, device=dev)
        self.group: _Group | None = None
        self.partial: Tensor | None = None  # block grouping: the unfinished block's running sum
        self.in_block = 0
        self.done = 0  # finished blocks (block grouping)
        self.token = _WriteSlot.apply(x0, None, residual.query, residual.key_weight, self, 0)

    # -------------------------------------------------------------------------------- forward

    def read(self, site: int) -> Tensor:
        _refuse_recompute(self.token)
        plan = self.plans[site]
        partial = self.partial if self.res.block_sublayers > 1 else None
        if self.res.recording():
            self.res.store_weights(site, self._stacked(plan, partial))
        out = _RouteSite.apply(self.token, partial, self, site)
        if site == self.res.n_sites - 1:
            # The forward is over. The token and the partial sum lead into the autograd graph, whose nodes
            # hold this state: drop them, or the cycle (which runs through C++ nodes that Python's
            # collector cannot see) would keep the buffers alive after backward.
            self.token = self.partial = self.group = None
        return out

    def write(self, site: int, out: Tensor) -> None:
        _refuse_recompute(self.token)
        if self.res.block_sublayers == 1:
            self.token = _WriteSlot.apply(out, self.token, None, None, self, site + 1)
            return
        self.partial = out if self.partial is None else self.partial + out
        self.in_block += 1
        if self.in_block == self.res.block_sublayers:
            self.done += 1
            self.token = _WriteSlot.apply(self.partial, self.token, None, None, self, self.done)
            self.partial, self.in_block = None, 0

    def write_slot(self, slot: int, source: Tensor) -> None:
        from ...kernels.history import write_slot

        write_slot(source.reshape(self.N, self.d).contiguous(), self.buffer[slot], self.rms[slot], self.res.eps)

    def _stacked(self, plan: SitePlan, partial: Tensor | None) -> Tensor:
        """The site's sources as the reference stacks them (S, B, T, d), for recording depth weights."""
        n = plan.history + (plan.k if self.res.block_sublayers == 1 else 0)
        s = self.buffer[:n].view(n, *self.shape)
        return s if partial is None else torch.cat([s, partial.to(s.dtype).unsqueeze(0)])

    def route_forward(self, site: int, partial: Tensor | None) -> tuple[Tensor, _Group]:
        from ...kernels.history import history_forward, sites_forward

        plan = self.plans[site]
        N, d, H, eps = self.N, self.d, self.res.num_heads, self.res.eps
        if plan.k == 0:
            rows = slice(plan.start, plan.start + plan.size)
            group = _Group(plan, self.qg[rows], self.lse[rows])
            group.first = torch.empty((N, d), dtype=self.dtype, device=self.buffer.device)
            history = self.buffer[:plan.history]
            if plan.size == 1:
                sites_forward(history, group.qg, H, eps, group.first, None, group.lse)
            else:
                group.rest = torch.empty((plan.size - 1, N, d), dtype=self.dtype, device=self.buffer.device)
                history_forward(history, self.rms[:plan.history], group.qg, H, group.first, group.rest, group.lse)
            self.group = group
        group = self.group
        state = group.first if plan.k == 0 else group.rest[plan.k - 1]
        extras = self._extras(plan, partial)
        if extras.shape[0] == 0:
            out = state
        else:
            out = torch.empty((N, d), dtype=self.dtype, device=self.buffer.device)
            sites_forward(extras, group.qg[plan.k:plan.k + 1], H, eps, out, None,
                          group.lse[plan.k:plan.k + 1], init=state.unsqueeze(0))
        if plan.k == plan.size - 1:  # every site of the group has merged: drop the partial states
            group.first = group.rest = None
        return out.view(self.shape), group

    def _extras(self, plan: SitePlan, partial: Tensor | None) -> Tensor:
        """The site's sources beyond the history, (S, N, d): slots written inside its group, or the block's
        partial sum, or none."""
        if self.res.block_sublayers == 1:
            return self.buffer[plan.history:plan.history + plan.k]
        if partial is None:
            return self.buffer[:0]
        return partial.to(self.dtype).reshape(1, self.N, self.d).contiguous()

    # -------------------------------------------------------------------------------- backward

    def grad_slots(self, lo: int, hi: int) -> tuple[Tensor, bool]:
        """Gradient buffer rows [lo, hi) and whether they already hold gradients to add to (else the kernel
        writes them). The rows that hold gradients are always a suffix [grad_low, slots): every site's
        sources are a prefix of the buffer plus rows written after its group began."""
        if self.grad is None:
            self.grad = torch.empty_like(self.buffer)
        if hi <= lo or lo >= self.grad_low:
            return self.grad[lo:hi], True
        if hi > self.grad_low:  # partly fresh: clear the fresh part, then add to all of it
            self.grad[lo:self.grad_low].zero_()
            self.grad_low = lo
            return self.grad[lo:hi], True
        self.grad_low = lo
        return self.grad[lo:hi], False

    def slot_grad(self, slot: int) -> Tensor:
        """The slot's finished gradient (N, d)."""
        if self.grad is None or slot < self.grad_low:  # no site read the slot in a way that reached the loss
            return torch.zeros((self.N, self.d), dtype=self.dtype, device=self.buffer.device)
        if self.pending[slot]:
            from ...kernels.history import finalize_rms_grad

            finalize_rms_grad(self.buffer[slot], self.grad[slot], self.rms[slot], self.dr[slot])
            self.pending[slot] = False
        return self.grad[slot]

    def _add_dqg(self, first_site: int, partials: Tensor, sites: int) -> None:
        if self.dqg is None:
            self.dqg = torch.zeros((self.res.n_sites, self.d), dtype=torch.float32, device=self.buffer.device)
        self.dqg[first_site:first_site + sites] += partials.sum(0)[:sites]

    def route_backward(self, site: int, group: _Group, grad_out: Tensor, out: Tensor,
                       partial: Tensor | None) -> Tensor | None:
        """Gradients of the site's extra sources (added to the buffer, or returned for a block partial sum);
        for the group's first site also the history's, for all of the group's sites at once. Returns the
        partial sum's gradient, if the site read one."""
        from ...kernels.history import history_backward, sites_backward

        plan = self.plans[site]
        N, d, H, eps = self.N, self.d, self.res.num_heads, self.res.eps
        k, size = plan.k, plan.size
        dev = out.device
        g = grad_out.to(self.dtype).reshape(1, N, d).contiguous()
        out = out.reshape(N, d)
        extras = self._extras(plan, partial)
        group.ran[k] = True
        if size == 1 and extras.shape[0] == 0:  # one pass over everything the site reads, delta included
            grad_hist, accumulate = self.grad_slots(0, plan.history)
            delta = torch.empty((1, H, N), dtype=torch.float32, device=dev)
            self._add_dqg(site, sites_backward(self.buffer[:plan.history], grad_hist, accumulate, group.qg, H, eps,
                                               g, group.lse, delta, out=out), 1)
            return None
        if group.delta is None:  # the group's last site runs its backward first
            group.delta = torch.empty((size, H, N), dtype=torch.float32, device=dev)
            if size > 1:
                group.grad_out = torch.empty((size, N, d), dtype=self.dtype, device=dev)
        if self.res.block_sublayers == 1:
            grad_extras, accumulate = self.grad_slots(plan.history, plan.history + k)
        else:
            grad_extras, accumulate = torch.empty_like(extras), False
        # The extras (or, with none, only delta), and the copy of the output gradient for the shared pass.
        self._add_dqg(site, sites_backward(
            extras, grad_extras, accumulate, group.qg[k:k + 1], H, eps, g, group.lse[k:k + 1],
            group.delta[k:k + 1], out=out, grad_copy=group.grad_out[k:k + 1] if size > 1 else None), 1)
        grad_partial = None if partial is None else grad_extras.view(self.shape).to(partial.dtype)
        if k > 0:
            return grad_partial
        grad_hist, accumulate = self.grad_slots(0, plan.history)
        if size == 1:
            self._add_dqg(site, sites_backward(self.buffer[:plan.history], grad_hist, accumulate, group.qg, H, eps,
                                               g, group.lse, group.delta), 1)
        else:
            for j in range(size):
                if not group.ran[j]:  # a site whose output did not reach the loss: it contributes nothing
                    group.grad_out[j].zero_()
                    group.delta[j].zero_()
            if self.dr is None:
                self.dr = torch.zeros((self.buffer.shape[0], H, N), dtype=torch.float32, device=dev)
            self._add_dqg(site, history_backward(self.buffer[:plan.history], self.rms[:plan.history], grad_hist,
                                                 self.dr[:plan.history], accumulate, group.qg, H, group.grad_out,
                                                 group.lse, group.delta), size)
            for j in range(plan.history):
                self.pending[j] = True
        group.grad_out = group.delta = None
        return grad_partial

    def parameter_grads(self, query: Tensor, key_weight: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Gradients of the routing queries and key gains, from the summed gradient of their product."""
        if self.dqg is None:
            return None, None
        return (self.dqg * key_weight.float()).to(query.dtype), (self.dqg * query.float()).to(key_weight.dtype)


def _refuse_recompute(token: Tensor) -> None:
    # Grad enabled inside backward means a checkpointed region is being recomputed; grad disabled in a
    # forward whose earlier sources are recorded for backward means a reentrant checkpoint's first pass,
    # whose routing would be cut off from the graph. Either way the buffer, the dependency tokens and the
    # groups' state belong to one forward pass and cannot be rebuilt.
    recompute = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
    if recompute or (not torch.is_grad_enabled() and token.requires_grad):
        raise RuntimeError(
            "the fused MHAR path cannot run inside an activation-checkpointed region (it would be recomputed "
            "in backward): checkpoint the sublayers only, or set residual.backend=reference")


class _WriteSlot(torch.autograd.Function):
    """Copy a source into its buffer slot; backward hands autograd the slot's finished gradient. The first
    write (slot 0, the embedding) also takes the routing parameters: its backward runs after every site's,
    when their gradients are complete."""

    @staticmethod
    def forward(ctx, source: Tensor, token: Tensor | None, query: Tensor | None, key_weight: Tensor | None,
                state: FusedState, slot: int) -> Tensor:
        state.write_slot(slot, source)
        ctx.state, ctx.slot, ctx.dtype, ctx.first = state, slot, source.dtype, token is None
        if ctx.first:
            ctx.save_for_backward(query, key_weight)
        return torch.empty(0, device=source.device)  # the dependency token

    @staticmethod
    def backward(ctx, grad_token: Tensor):
        with routing_range():
            grad = ctx.state.slot_grad(ctx.slot).view(ctx.state.shape).to(ctx.dtype)
            grad_q = grad_k = None
            if ctx.first:
                grad_q, grad_k = ctx.state.parameter_grads(*ctx.saved_tensors)
        # The token carries no value, only the order; its gradient is an empty tensor.
        return grad, None if ctx.first else grad_token, grad_q, grad_k, None, None


class _RouteSite(torch.autograd.Function):
    """One routing site: its input, the mixture of the sources it sees."""

    @staticmethod
    def forward(ctx, token: Tensor, partial: Tensor | None, state: FusedState, site: int) -> Tensor:
        out, group = state.route_forward(site, partial)
        ctx.state, ctx.site, ctx.group = state, site, group
        ctx.save_for_backward(out, partial)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        out, partial = ctx.saved_tensors
        with routing_range():
            grad_partial = ctx.state.route_backward(ctx.site, ctx.group, grad_out, out, partial)
        return grad_out.new_empty(0), grad_partial, None, None
