"""The fused training path of the routed residuals (AttnRes, MHAR): one source buffer, Triton passes over
it (per site, or shared by a group of sites), and a backward that recomputes instead of saving per-site
copies.

The reference path stacks the visible sources at every site (O(L^2) copies, and O(L^2) saved activations
for backward). Here, per forward pass:

- every source is written once into a preallocated buffer ``(slots, N, d)``, with its RMS statistic
  beside it: in ``full`` grouping slot 0 is the embedding and slot j + 1 the output of sublayer j; in
  ``block:K`` grouping slot b + 1 is the sum of block b, written when the block is finished. A written
  slot is never modified again, so any site's backward can re-read it; the running partial sum of an
  unfinished block is an ordinary autograd tensor, saved by the sites that read it. It is summed inside the
  routing kernels, not between them: the first site that reads the block's sum so far adds the last
  output to the sum before it in its own pass (and writes the new sum for the sites after it), and the
  block's last output is added in the pass that writes the block's slot.
- sites are taken in groups of consecutive sites (``sites_per_pass``, never across a block boundary): the
  group's first site routes all of its sites over the slots complete at that point (the history) in one
  pass (``kernels.history``), and each site then merges its partial state with its own extra sources: the
  slots written inside the group (``full``) or the block's partial sum (``block``). A group of one site
  is the per-site mode: one pass over everything the site reads.
- backward recomputes everything from the buffer, by source rather than by site: each site's backward
  keeps its output gradient (where autograd left it, its offset in a table on the device, or a copy in a
  buffer of the same shape, by width: ``kernels.grad_rows``) and its ``delta``; a slot's writer, whose
  backward autograd runs once every site that reads the slot has run its own, computes the slot's whole
  gradient in one pass over those sites (``kernels.column``); an odd slot's pass also sums the share of
  the slot below it from the same sites, so that slot's own pass reads only the sites that read it alone,
  or, where ``kernels.column.slot_passes`` plans a group, the top slot's pass first sums the share of
  every slot of the group from its sites (``kernels.column_group``), leaving the others a carry each.
  A block's partial sum, which is no slot, gets its gradient from the site that reads it, at once, added in
  that site's pass to the gradient the later sums passed back (so that no addition runs between kernels).
- the routing parameters' gradients are summed into one (sites, d) buffer and handed to autograd once, by
  the writer of slot 0, whose backward runs last; the slots' share of them is one matrix product over
  every slot's kept ``dz * r`` there (``kernels.column.query_grads``).

The sublayers' pre-norms can be computed here too (``read_with_norm``, where the model's ``fold_norms``
says): the site's merge writes its input's RMSNorm beside the input (a site that merges nothing takes a row
pass of its own), and its backward prologue takes the normed input's gradient, makes the input's from it
and sums the norm gain's gradient, so that the sublayer's compiled graph reads neither.

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
from torch import Tensor, nn

ROUTING_RANGE = "mhar::routing"  # profiler range around routing work, forward and backward
# Sites per shared pass over the history. Measured on the H200 at paper350m (docs/benchmarks.md): the
# forward's routing kernels take 6.6 ms a step one site a pass, 5.0 ms four a pass, no less at eight.
DEFAULT_SITES_PER_PASS = 4
# Up to this many sites, a shared pass holds every site's state for whole rows (``sites_forward``); beyond
# it, the head-tiled pass (``history_forward``), whose programs hold one head of every site: for heads
# wider than HEAD_TILED_MAX_WIDTH (AttnRes: one head of width d) that would not fit either, and groups are
# cut to ROW_PASS_MAX_SITES.
ROW_PASS_MAX_SITES = 2
HEAD_TILED_MAX_WIDTH = 256


# Whether new models compute the sublayers' pre-norms in the sites' kernels (``FusedState.read_with_norm``)
# rather than in the sublayers' compiled graphs (a model's ``residual.fold_norms``), by grouping. block:K on:
# measured on the H200 (docs/benchmarks.md, "twentieth round"; ``bench model --fold-norms off,on --rounds
# 11``, the shared passes in the stacked form), folded against unfolded in one process: 0.976x against 0.960x
# of the compiled baseline at paper1b, 0.983x against 0.987x at paper350m, 0.986x against 0.976x at paper100m
# (7 rounds); the rest of a paper1b step 1.9-2.3 ms shorter, its routing kernels 0.9 ms longer. full off: not
# yet timed folded. FOLD_NORMS, when set (tests, benchmarks), overrides the table.
FOLD_NORMS_BY_GROUPING = {"full": False, "block": True}
FOLD_NORMS: bool | None = None


def fold_norms(blocks: bool) -> bool:
    """The default for new models, ``blocks`` for block:K grouping (read when one is built, so that a test
    can set it first)."""
    return FOLD_NORMS if FOLD_NORMS is not None else FOLD_NORMS_BY_GROUPING["block" if blocks else "full"]


def _gain(norm: Tensor) -> Tensor:
    """A pre-norm's gain as the kernels read it: fp32, contiguous (a parameter of either already is)."""
    return (norm if norm.dtype == torch.float32 else norm.float()).contiguous()


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
    """What a group's sites share in the forward: fused query rows, log-sum-exps, partial states."""

    def __init__(self, plan: SitePlan, qg: Tensor, lse: Tensor):
        self.plan = plan
        self.qg = qg  # (G, d) fp32: query * key gain of each site
        self.lse = lse  # (G, N, H) fp32: each site's log-sum-exp over everything it reads
        self.first: Tensor | None = None  # the history pass's normalised output of site 0 ...
        self.rest: Tensor | None = None  # ... and of sites 1.. (G - 1, N, d), dropped once merged


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
        # Backward state, allocated by the first site's backward: where every site's output gradient lies
        # (``grads``: in place, the tensors held in ``held`` until the slots' passes have read them, or copied
        # into one buffer, as ``column.grads_in_place`` says for the width), its delta (sites [clean_from,
        # n_sites) that did not run their backward read zeros), and the routing parameters' gradient.
        self.grads = None
        self.held: list[Tensor | None] = []
        self.zeros: Tensor | None = None
        self.delta: Tensor | None = None
        self.ran = [False] * residual.n_sites
        self.clean_from = residual.n_sites
        self.dqg: Tensor | None = None
        per_pass = residual.sites_per_pass
        if d // H > HEAD_TILED_MAX_WIDTH:
            per_pass = min(per_pass, ROW_PASS_MAX_SITES)
        self.plans = plan_sites(residual.n_sites, residual.block_sublayers, per_pass)
        # Every site's query * key gain, and its log-sum-exp per head and token: one tensor each for the
        # whole pass (groups take slices), fewer small launches and allocations per site.
        self.qg = (residual.query.detach().float() * residual.key_weight.detach().float()).contiguous()
        self.lse = torch.empty((residual.n_sites, self.N, H), dtype=torch.float32, device=dev)
        # Block grouping: the RMS statistic of the block partial sum each site read, as its merge reduced it
        # from the row, so that its backward reads it instead of reducing the row again.
        self.sum_rms = (None if residual.block_sublayers == 1 else
                        torch.empty((residual.n_sites, self.N), dtype=torch.float32, device=dev))
        # Folded pre-norms: each site's norm statistics (``history.Norm``), made with its first one.
        self.norm_stats: Tensor | None = None
        self.group: _Group | None = None
        # Block grouping: the unfinished block's running sum, without its last output (``pending``), which
        # the next site to read the sum adds in its own pass.
        self.partial: Tensor | None = None
        self.pending: Tensor | None = None
        self.in_block = 0
        self.done = 0  # finished blocks (block grouping)
        self.released = False
        self.token = _WriteSlot.apply(x0, None, residual.query, residual.key_weight, self, 0)

    # -------------------------------------------------------------------------------- forward

    def read(self, site: int) -> Tensor:
        """The site's input."""
        return self._read(site, None)[0]

    def read_with_norm(self, site: int, norm: nn.Module) -> tuple[Tensor, Tensor]:
        """The site's input and that input after ``norm`` (the sublayer's RMSNorm), made in the site's own
        kernels, forward and backward, instead of the sublayer's. The gradient reaches the routing through the
        normalised input; the input itself is handed on for what looks at it (hooks) and takes none."""
        return self._read(site, norm)

    def _read(self, site: int, norm: nn.Module | None) -> tuple[Tensor, Tensor | None]:
        _refuse_recompute(self.token)
        plan = self.plans[site]
        partial, pending = self.partial, self.pending
        if partial is None and pending is not None:  # the block's first output is its sum so far
            partial, pending = pending, None
        if pending is not None and not (partial.dtype == pending.dtype == self.dtype):
            partial, pending = partial + pending, None  # (dtypes the kernels do not add: as torch adds)
        if self.res.recording():
            self.res.store_weights(site, self._stacked(plan, partial if pending is None else partial + pending))
        # Folded, a site's node returns the normed input first and the input itself last.
        weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        if partial is None:
            outs = _RouteSite.apply(self.token, self, site, weight, eps)
            out, *raw = outs if norm is not None else (outs,)
        else:
            out, self.partial, *raw = _RoutePartial.apply(self.token, partial, pending, self, site, weight, eps)
            self.pending = None
        if site == self.res.n_sites - 1:
            # The forward is over. The token and the partial sum lead into the autograd graph, whose nodes
            # hold this state: drop them, or the cycle (which runs through C++ nodes that Python's
            # collector cannot see) would keep the buffers alive after backward.
            self.token = self.partial = self.pending = self.group = None
        return (out, None) if not raw else (raw[0], out)

    def write(self, site: int, out: Tensor) -> None:
        _refuse_recompute(self.token)
        if self.res.block_sublayers == 1:
            self.token = _WriteSlot.apply(out, self.token, None, None, self, site + 1)
            return
        self.in_block += 1
        if self.in_block < self.res.block_sublayers:
            self.pending = out  # the next site adds it (``read``): the one before it already did
            return
        self.done += 1
        partial, addend = self.partial, out
        if partial is None or not (partial.dtype == out.dtype == self.dtype):
            partial, addend = (out if partial is None else partial + out), None
        self.token = _WriteSlot.apply(partial, self.token, None, None, self, self.done, addend)
        self.partial = self.pending = None
        self.in_block = 0

    def release(self) -> None:
        """Drop the pass's buffers once its backward is complete (slot 0's, the last to run). The state
        can outlive its step: the autograd nodes hold it for as long as the loss tensor lives, and the state
        of the step that compiled the model stays in a reference cycle until Python's cyclic collector runs
        (seen on the CPU). Its buffers (the sources, the sites' output gradients, dz * r: about 2 GB at
        ``paper350m``) would then still be allocated during the next steps."""
        self.buffer = self.rms = self.grads = self.zeros = self.delta = self.dzr = self.dqg = self.lse = self.qg = None
        self.sum_rms = self.norm_stats = None
        self.param_grads = self.dnorm = None
        self.held = []
        self.carry = None
        self.released = True

    def _refuse_released(self) -> None:
        if self.released:
            raise RuntimeError("the fused MHAR path's backward already ran for this forward pass, and its "
                               "buffers are freed: a second backward (retain_graph=True) needs "
                               "residual.backend=reference")

    def write_slot(self, slot: int, source: Tensor, addend: Tensor | None = None) -> None:
        from ..kernels.history import write_slot

        flat = None if addend is None else addend.reshape(self.N, self.d).contiguous()
        write_slot(source.reshape(self.N, self.d).contiguous(), self.buffer[slot], self.rms[slot], self.res.eps,
                   addend=flat)

    def _stacked(self, plan: SitePlan, partial: Tensor | None) -> Tensor:
        """The site's sources as the reference stacks them (S, B, T, d), for recording depth weights."""
        n = plan.history + (plan.k if self.res.block_sublayers == 1 else 0)
        s = self.buffer[:n].view(n, *self.shape)
        return s if partial is None else torch.cat([s, partial.to(s.dtype).unsqueeze(0)])

    def route_forward(self, site: int, partial: Tensor | None, addend: Tensor | None = None,
                      norm: Tensor | None = None, norm_eps: float = 0.0) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The site's input (B, T, d), the block partial sum it read (``partial`` itself, or with ``addend``,
        the block's last output, their sum, made in the site's own pass), and with ``norm`` (a pre-norm's
        gain) the input after that norm, made in the pass that writes the input where one does."""
        from ..kernels.history import Norm, history_forward, norm_rows, sites_forward

        plan = self.plans[site]
        N, d, H, eps = self.N, self.d, self.res.num_heads, self.res.eps
        if plan.k == 0:
            rows = slice(plan.start, plan.start + plan.size)
            group = _Group(plan, self.qg[rows], self.lse[rows])
            group.first = torch.empty((N, d), dtype=self.dtype, device=self.buffer.device)
            history = self.buffer[:plan.history]
            if plan.size > 1:
                group.rest = torch.empty((plan.size - 1, N, d), dtype=self.dtype, device=self.buffer.device)
            if plan.size <= ROW_PASS_MAX_SITES:
                sites_forward(history, group.qg, H, eps, group.first, group.rest, group.lse,
                              rms=self.rms[:plan.history])
            else:
                history_forward(history, self.rms[:plan.history], group.qg, H, group.first, group.rest, group.lse)
            self.group = group
        group = self.group
        state = group.first if plan.k == 0 else group.rest[plan.k - 1]
        extras = self._extras(plan, partial)
        summed, flat = partial, None
        if addend is not None:
            summed = torch.empty_like(partial)
            flat = addend.reshape(N, d).contiguous()
        pre = None
        if norm is not None:
            if self.norm_stats is None:
                self.norm_stats = torch.empty((self.res.n_sites, N, H + 1), dtype=torch.float32,
                                              device=self.buffer.device)
            pre = Norm(_gain(norm), norm_eps, self.norm_stats[site],
                       torch.empty((N, d), dtype=self.dtype, device=self.buffer.device))
        if extras.shape[0] == 0:
            out = state
            if pre is not None:
                norm_rows(out, pre, H)
        else:
            out = torch.empty((N, d), dtype=self.dtype, device=self.buffer.device)
            # In full grouping the extras are slots, whose statistics are known; a block's partial sum's are
            # reduced from the row, and kept for the site's backward.
            full = self.res.block_sublayers == 1
            sites_forward(extras, group.qg[plan.k:plan.k + 1], H, eps, out, None, group.lse[plan.k:plan.k + 1],
                          init=state.unsqueeze(0), rms=self.rms[plan.history:plan.history + plan.k] if full else None,
                          addend=flat, sum_out=None if addend is None else summed.view(N, d), norm=pre,
                          rms_out=None if full else self.sum_rms[site:site + 1])
        if plan.k == plan.size - 1:  # every site of the group has merged: drop the partial states
            group.first = group.rest = None
        return out.view(self.shape), summed, None if pre is None else pre.out.view(self.shape)

    def _extras(self, plan: SitePlan, partial: Tensor | None) -> Tensor:
        """The site's sources beyond the history, (S, N, d): slots written inside its group, or the block's
        partial sum, or none."""
        if self.res.block_sublayers == 1:
            return self.buffer[plan.history:plan.history + plan.k]
        if partial is None:
            return self.buffer[:0]
        return partial.to(self.dtype).reshape(1, self.N, self.d).contiguous()

    # -------------------------------------------------------------------------------- backward

    def _backward_buffers(self) -> None:
        if self.grads is None:
            from ..kernels.column import GradRows, grads_in_place

            n, dev = self.res.n_sites, self.buffer.device
            if grads_in_place(self.d):
                self.grads = GradRows(self.buffer, torch.empty(n, dtype=torch.int64, device=dev))
                self.held = [None] * n
            else:
                self.grads = GradRows.stacked(torch.empty((n, self.N, self.d), dtype=self.dtype, device=dev))
            self.delta = torch.empty((n, self.N, self.res.num_heads), dtype=torch.float32, device=dev)
            # The routing parameters' summed gradient (``dqg``) and the folded pre-norms' gains' (``dnorm``),
            # a site a row, in one tensor so that a folded site's backward adds its row of each in one launch.
            self.param_grads = torch.zeros((2, n, self.d), dtype=torch.float32, device=dev)
            self.dqg, self.dnorm = self.param_grads[0], self.param_grads[1]
            # Every slot's dz * r, (H, S_j, N) one after the other, for the query gradients' one product
            # over all slots (``parameter_grads``).
            from ..kernels.column import dzr_rows

            rows = dzr_rows(self.buffer.shape[0], n, self.res.block_sublayers)
            self.dzr = torch.empty(rows * self.res.num_heads * self.N, dtype=torch.float32, device=dev)
            self.dzr_written = [False] * self.buffer.shape[0]
            # The backward's passes by slot, and the carries a pass over several slots leaves for the
            # slots below its own.
            from ..kernels.column import Carry, carry_rows, group_slots, pairs_slots, slot_passes

            H = self.res.num_heads
            K = self.res.block_sublayers
            passes = slot_passes(self.buffer.shape[0], n, K, pairs_slots(self.d), group_slots(self.d, H, K))
            self.passes = {p.slot: p for p in passes}
            self.carry = Carry.empty(carry_rows(passes), self.N, self.d, H, dev)
            self.carried: set[int] = set()  # the slots whose sums are in ``carry``

    def _dzr_of(self, slot: int) -> Tensor:
        """Slot ``slot``'s (H, S, N) block of ``dzr``: dz * r of the S sites that read it."""
        from ..kernels.column import dzr_block

        return dzr_block(self.dzr, slot, self.res.n_sites, self.res.block_sublayers, self.res.num_heads, self.N)

    def route_backward(self, site: int, grad_out: Tensor, out: Tensor, partial: Tensor | None,
                       base: Tensor | None = None, norm: Tensor | None = None, norm_eps: float = 0.0
                       ) -> tuple[Tensor | None, Tensor | None]:
        """Keep the site's output gradient and delta for the slots' backward; return the gradient of the
        block partial sum the site read, if any, plus ``base`` (the gradient it has from the later sums), and
        with ``norm`` (the folded pre-norm's gain; ``grad_out`` is then the normalised input's gradient) the
        gain's gradient."""
        from ..kernels.history import Norm, sites_backward

        self._refuse_released()
        self._backward_buffers()
        N, d, H, eps = self.N, self.d, self.res.num_heads, self.res.eps
        g = grad_out.to(self.dtype).reshape(N, d)
        rows = slice(site, site + 1)
        if self.grads.offsets is None:
            g, keep = g.contiguous(), {"grad_copy": self.grads.base[rows]}
        else:
            g, offset = self._hold(site, g)
            keep = {"record": (self.grads.offsets[rows], offset)}
            if norm is not None:  # the output's gradient is made from the norm's in place, where it is read
                keep["grad_copy"] = g.unsqueeze(0)
        extras = self._extras(self.plans[site], partial) if partial is not None else self.buffer[:0]
        grad_extras = torch.empty_like(extras)
        if base is not None:
            base = base.to(extras.dtype).reshape(1, N, d).contiguous()
        # Folded, the site's rows of the routing parameters' and the gain's gradients, (2, d).
        dqg, pre = ((self.dqg[rows], None) if norm is None else
                    (self.param_grads[:, site], Norm(_gain(norm), norm_eps, self.norm_stats[site])))
        sites_backward(extras, grad_extras, base, self.qg[rows], H, eps, g.unsqueeze(0), self.lse[rows],
                       self.delta[rows], out=out.reshape(N, d), dqg=dqg, norm=pre,
                       rms=self.sum_rms[rows] if extras.shape[0] else None, **keep)
        self.ran[site] = True
        grad_norm = None if norm is None else self.dnorm[site].to(norm.dtype)
        if partial is None:
            return None, grad_norm
        return grad_extras.view(self.shape).to(partial.dtype), grad_norm

    def _hold(self, site: int, grad: Tensor) -> tuple[Tensor, int]:
        """The site's output gradient (N, d) as the column passes will read it, held until they have, and its
        offset in ``grads``: autograd's tensor itself where a kernel can read it in place and it owns its
        memory (a view of a larger one would keep all of it alive), else a copy."""
        offset = self.grads.offset_of(grad)
        if offset is None or grad.untyped_storage().nbytes() != grad.nbytes:
            grad = grad.clone(memory_format=torch.contiguous_format)
            offset = self.grads.offset_of(grad)
        self.held[site] = grad
        return grad, offset

    def _zeros(self) -> Tensor:
        """An output gradient of zeros, for the sites whose output did not reach the loss."""
        if self.zeros is None:
            self.zeros = torch.zeros((self.N, self.d), dtype=self.dtype, device=self.buffer.device)
        return self.zeros

    def slot_grad(self, slot: int) -> Tensor:
        """The slot's gradient (N, d), from every site that reads it: sites [first, n_sites), in the pass
        ``kernels.column.slot_passes`` plans for it (with the slot below, or finishing a carry)."""
        from ..kernels.column import run_pass

        self._refuse_released()
        if self.grads is None:  # no site's output reached the loss
            return torch.zeros((self.N, self.d), dtype=self.dtype, device=self.buffer.device)
        K = self.res.block_sublayers
        first = slot * K
        for s in range(first, self.clean_from):
            if not self.ran[s]:  # its output did not reach the loss: it contributes nothing
                if self.grads.offsets is None:
                    self.grads.base[s].zero_()
                else:
                    self.grads.offsets[s].fill_(self.grads.offset_of(self._zeros()))
                self.delta[s].zero_()
        self.clean_from = min(self.clean_from, first)
        plan = self.passes[slot]
        grad = run_pass(plan, self.buffer, self.rms, self.grads, self.lse, self.delta, self.qg, self.res.num_heads,
                        K, self.dzr, self.carry, carried=slot in self.carried)
        if plan.group is not None:
            self.carried = set(plan.group) - {slot}
        else:
            self.carried = {slot - 1} if plan.low else self.carried - {slot}
        self.dzr_written[slot] = True
        return grad

    def parameter_grads(self, query: Tensor, key_weight: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Gradients of the routing queries and key gains, from the summed gradient of their product."""
        if self.dqg is None:
            return None, None
        from ..kernels.column import query_grads

        for slot, written in enumerate(self.dzr_written):
            if not written:  # its writer's backward did not run: it contributes nothing
                self._dzr_of(slot).zero_()
        self.dqg += query_grads(self.dzr, self.buffer, self.res.num_heads, self.res.n_sites, self.res.block_sublayers)
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
                state: FusedState, slot: int, addend: Tensor | None = None) -> Tensor:
        state.write_slot(slot, source, addend)  # with addend: the slot is source + addend
        ctx.state, ctx.slot, ctx.dtype, ctx.first = state, slot, source.dtype, token is None
        ctx.added = addend is not None
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
                ctx.state.release()
        # The token carries no value, only the order; its gradient is an empty tensor.
        return grad, None if ctx.first else grad_token, grad_q, grad_k, None, None, grad if ctx.added else None


class _RouteSite(torch.autograd.Function):
    """One routing site that reads slots only: its input, the mixture of the sources it sees; with ``norm``
    (a pre-norm's gain) that input after the norm."""

    @staticmethod
    def forward(ctx, token: Tensor, state: FusedState, site: int, norm: Tensor | None, norm_eps: float
                ) -> Tensor | tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        out, _, normed = state.route_forward(site, None, norm=norm, norm_eps=norm_eps)
        ctx.state, ctx.site, ctx.norm_eps = state, site, norm_eps
        ctx.save_for_backward(out, norm)
        if normed is None:
            return out
        ctx.mark_non_differentiable(out)  # with a norm, the input's gradient comes through its normed form
        return normed, out

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, *_grad_raw: None):
        out, norm = ctx.saved_tensors
        if grad_out is None:  # (the input reached the loss only through what autograd does not see)
            grad_out = torch.zeros_like(out)
        with routing_range():
            _, grad_norm = ctx.state.route_backward(ctx.site, grad_out, out, None, norm=norm, norm_eps=ctx.norm_eps)
        return grad_out.new_empty(0), None, None, grad_norm, None


class _RoutePartial(torch.autograd.Function):
    """A routing site that also reads its block's partial sum: its input, and the sum it read, ``partial``
    or, with ``addend`` (the block's last output), ``partial + addend`` made in the site's pass. The sum's
    gradient from the later sites arrives with the input's and is added in the site's backward pass."""

    @staticmethod
    def forward(ctx, token: Tensor, partial: Tensor, addend: Tensor | None, state: FusedState, site: int,
                norm: Tensor | None, norm_eps: float) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        out, summed, normed = state.route_forward(site, partial, addend, norm=norm, norm_eps=norm_eps)
        ctx.state, ctx.site, ctx.added, ctx.norm_eps = state, site, addend is not None, norm_eps
        ctx.save_for_backward(out, summed, norm)
        if normed is None:
            return out, summed
        ctx.mark_non_differentiable(out)  # with a norm, the input's gradient comes through its normed form
        return normed, summed, out

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_summed: Tensor | None, *_grad_raw: None):
        out, summed, norm = ctx.saved_tensors
        if grad_out is None:  # the site's input did not reach the loss, only the sum after it
            grad_out = torch.zeros_like(out)
        with routing_range():
            grad, grad_norm = ctx.state.route_backward(ctx.site, grad_out, out, summed, base=grad_summed, norm=norm,
                                                       norm_eps=ctx.norm_eps)
        return grad_out.new_empty(0), grad, grad if ctx.added else None, None, None, grad_norm, None
