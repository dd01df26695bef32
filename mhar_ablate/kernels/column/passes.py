"""The plan of a step's backward by source and its passes: ``slot_passes`` cuts the slots into single slots,
pairs and group passes (``column_group``) by the bytes each moves (the byte model below, a group pass's bytes
weighted by ``config.GROUP_PASS_WEIGHT``); ``run_pass`` runs one over the step's tensors; ``dzr_rows`` /
``dzr_block`` lay out the step's flat ``dz * r``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..grad_rows import GradRows
from . import config
from .slot import Carry, Low, slot_grad


def carry_rows(passes: list["SlotPass"]) -> int:
    """The rows a ``Carry`` needs for ``passes``: the largest group's slots, or one."""
    return max([len(p.group) for p in passes if p.group is not None] + [1])


@dataclass(frozen=True)
class SlotPass:
    """One pass of a step's backward by source: slot ``slot``'s gradient from the sites ``sites``.

    With ``low``, the pass also sums those sites' share of slot - 1 (which they read too) into carry row 0.
    With ``group`` (slots ending at ``slot``), a group pass first sums the share of every slot of the group
    from the sites that read ``slot`` (``column_group``), one carry row a slot in order, and ``sites`` is
    empty: this slot's gradient is its row finished. With ``carried``, the slot's share from its other sites
    comes from carry row ``carry_row``, and ``sites`` are the rest."""

    slot: int
    sites: range
    low: bool = False
    carried: bool = False
    group: range | None = None
    carry_row: int = 0


# The byte model that plans a step's passes, in units of one source (N x d in the buffer's dtype, bf16 in
# training, so an fp32 carry counts 2): a pass reads its slot and each of its sites' output gradients once
# and writes the slot's gradient; a carry is written once and read once. The statistics (N x H a site)
# are left out.
CARRY_UNITS = 2


def _single_cost(S: int) -> int:
    return S + 2


def _pair_cost(S: int, block: int) -> int:
    # the pass over both slots (the two slots, S gradients, a gradient and a carry written) and the lower
    # slot's own pass (its slot, its block of sites, the carry read, its gradient)
    return (S + 3 + CARRY_UNITS) + (block + 2 + CARRY_UNITS)


def _group_cost(S: int, B: int, block: int) -> float:
    # the group pass (B slots, S gradients, B carries written), then each slot's own pass (its slot, the
    # carry read, its gradient, and the sites that read it but not the top slot: block * k for the k-th
    # slot below the top)
    return (config.GROUP_PASS_WEIGHT * (S + B + CARRY_UNITS * B) + B * (2 + CARRY_UNITS)
            + block * B * (B - 1) // 2)


def slot_passes(n_slots: int, n_sites: int, block: int, two_slots: bool, max_group: int = 0) -> list[SlotPass]:
    """The passes of a step's backward by source, in the order autograd reaches the slots (the last
    first), when slot j is read by sites ``block * j`` .. ``n_sites - 1``.

    Without groups (``max_group`` < 3), with ``two_slots`` (take ``pairs_slots(d)``) every odd slot's pass
    takes the even slot below it: the sites that read both are read once for the two, and the lower slot's
    own pass reads only the ``block`` sites that read it alone (whose output gradients are not known yet
    when the pass above runs). This reads the output gradients about half as often as one pass a slot.

    With ``max_group`` >= 3 (take ``group_slots(d, H, block)``), slots are cut into runs taken one slot a pass,
    two (if ``two_slots``) or 3 .. ``max_group`` a group pass, the cut of least cost by the byte model
    above with a group pass's bytes counted ``GROUP_PASS_WEIGHT`` times: groups where many sites read the
    slots, which they then read once for the group."""
    if max_group < 3:
        passes = []
        for j in reversed(range(n_slots)):
            first = block * j
            if two_slots and j % 2 == 0 and j + 1 < n_slots:
                passes.append(SlotPass(j, range(first, first + block), carried=True))
            else:
                passes.append(SlotPass(j, range(first, n_sites), low=two_slots and j % 2 == 1))
        return passes
    # best[j]: the least cost of slots [0, j) and the size of the run that ends at j - 1
    best = [(0, 0)] * (n_slots + 1)
    for j in range(1, n_slots + 1):
        S = n_sites - block * (j - 1)  # sites that read the run's top slot
        options = [(best[j - 1][0] + _single_cost(S), 1)]
        if two_slots and j >= 2:
            options.append((best[j - 2][0] + _pair_cost(S, block), 2))
        options += [(best[j - B][0] + _group_cost(S, B, block), B) for B in range(3, min(max_group, j) + 1)]
        best[j] = min(options)
    passes, j = [], n_slots
    while j > 0:
        size = best[j][1]
        top, first = j - 1, block * (j - 1)
        if size == 1:
            passes.append(SlotPass(top, range(first, n_sites)))
        elif size == 2:
            passes.append(SlotPass(top, range(first, n_sites), low=True))
            passes.append(SlotPass(top - 1, range(first - block, first), carried=True))
        else:
            group = range(j - size, j)
            passes.append(SlotPass(top, range(first, first), group=group, carried=True, carry_row=size - 1))
            passes += [SlotPass(u, range(block * u, first), carried=True, carry_row=u - group.start)
                       for u in reversed(range(j - size, top))]
        j -= size
    return passes


def run_pass(p: SlotPass, sources: Tensor, rms: Tensor, grad_out: Tensor | GradRows, lse: Tensor, delta: Tensor,
             qg: Tensor, num_heads: int, block: int, dzr: Tensor, carry: Carry, carried: bool = True) -> Tensor:
    """Pass ``p`` of a step's backward (``slot_passes``) over the step's tensors: ``sources`` (slots, N, d)
    and ``rms`` (slots, N) as written in the forward; every site's output gradient, (sites, N, d) or
    ``GradRows``, ``lse`` and ``delta`` (sites, N, H), ``qg`` (sites, d); the step's flat ``dz * r``
    (``dzr_block``); ``carry``, where a two-slot or group pass leaves the lower slots' sums and a carried
    pass finds them (``carried`` False: the pass that would have left them did not run, so the slot takes
    every site that reads it). Returns the slot's gradient (N, d)."""
    grads = grad_out if isinstance(grad_out, GradRows) else GradRows.stacked(grad_out)
    j, n_sites, N = p.slot, len(grads), sources.shape[1]
    rows, sites, start, low = dzr_block(dzr, j, n_sites, block, num_heads, N), p.sites, None, None
    if p.group is not None:
        from ..column_group import group_pass

        group_pass(sources, rms, grads, lse, delta, qg, num_heads, p.group, range(block * j, n_sites), n_sites,
                   block, dzr, carry.acc, carry.dr)
    if p.carried and (carried or p.group is not None):
        rows, start = rows[:, :len(sites)], carry.row(p.carry_row)
    elif p.carried:
        sites = range(block * j, n_sites)
    elif p.low:
        below = dzr_block(dzr, j - 1, n_sites, block, num_heads, N)[:, block:]
        low = Low(sources[j - 1], rms[j - 1], below, carry.row(0))
    at = slice(sites.start, sites.stop)
    grad, _ = slot_grad(sources[j], rms[j], grads.sites(at), lse[at], delta[at], qg[at], num_heads, dzr=rows,
                        carry=start, low=low)
    return grad


def dzr_block(dzr: Tensor, slot: int, n_sites: int, block: int, num_heads: int, N: int) -> Tensor:
    """Slot ``slot``'s (H, S, N) block of a step's flat ``dz * r`` (``dzr_rows``): the S sites that read it."""
    start, S = dzr_rows(slot, n_sites, block) * num_heads * N, n_sites - block * slot
    return dzr[start:start + S * num_heads * N].view(num_heads, S, N)


def dzr_rows(slots: int, n_sites: int, block: int) -> int:
    """Sites read by slots 0 .. ``slots`` - 1 together, when slot j is read by sites ``block * j`` ..
    ``n_sites - 1``: where slot ``slots``'s (H, S, N) block of ``dzr`` starts, in units of H * N elements
    (with ``slots`` = every slot, the size of ``dzr``)."""
    return slots * n_sites - block * slots * (slots - 1) // 2
