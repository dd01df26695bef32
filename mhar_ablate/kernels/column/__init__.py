"""Triton kernels for the fused path's backward by source ("by column"): the whole gradient of one buffer
slot in one pass, once every site that reads it has its output gradient.

Summing source gradients site by site, as the forward runs, reads each source and read-modify-writes its
gradient once per site that sees it: three source-sized transfers per (site, source) pair, 3,675 of them a
step at the paper's 350M shape. But a slot's gradient is needed only when autograd reaches the sublayer
that wrote it, and by then every site that reads it has run its backward. So the backward keeps each
site's output gradient (where autograd left it, or copied, by width: ``grad_rows``) and its ``delta``, and
computes a slot's gradient in one pass when it is needed: the slot is read once, written once, and each
reading site's output gradient is read once, one transfer per pair plus two per slot (1,323 at that shape).

* ``_column_bwd_prefetch_kernel`` and ``_column_bwd_kernel``: one or two tokens per program, their rows of
  the slot in registers, streaming over the S sites that read the slot; each writes the slot's gradient
  (the part through its RMS statistic included, the whole row being at hand) and, per site and head,
  ``dz * r``, from which the routing parameters' gradients follow. The first loads a site ahead into
  registers, the second through Triton's shared-memory pipeline; which is faster depends on the width
  (``COLUMN_CONFIGS``, measured).
* Two slots a pass (``slot_passes``, where ``TWO_SLOT_CONFIGS`` says so): the sites that read slot j also
  read slot j - 1, so the pass for an odd slot j sums their share of slot j - 1 too (LOW), reading each
  output-gradient row and query row once for both, and leaves it in a carry; slot j - 1's own pass, when
  autograd reaches it, adds the sites that read it alone (CARRY). The output gradients are then read
  about half as often (843 instead of 1,323 source-sized transfers a step at the 350M shape).
* Group passes (``column_group``, where ``group_slots`` allows them): the sites that read a slot t read
  every slot below it too, so one pass over them sums their share of a group of up to 16 slots t - B + 1
  .. t as matrix products, reading each output gradient once for the group, and leaves a carry a slot;
  each slot's own pass (CARRY) adds the sites that read it but not t. ``slot_passes`` chooses where to
  cut the slots into groups, pairs and single slots by the bytes each moves.
* ``_dqg_kernel``: the query gradients from ``dz * r``, ``dqg[s, c] = sum_n dzr[h(c), s, n] * x[n, c]``, a matrix product
  over tokens per head, on tensor cores (bf16 sources: ``dzr`` split into two bf16 parts, so the product
  keeps about 16 bits of it) or in fp32. The training path runs it once for every slot of a step
  (``query_grads``), when the last slot's gradient is done: a program takes one head (both parts of a
  split one, so each block of ``dzr`` is read once; a head wider than 128 + 127 channels in blocks of
  128) and a chunk of the tokens, and sums over every slot; the chunks' sums are added at the end.

Math as in ``history`` (per site s reading the slot x, with g_s its output gradient):
``a = exp(r u_s - lse_s)``, ``dz = a (<g_s, x>_h - delta_s)``,
``dx = sum_s [a g_s + dz r qg_s] - (r^3 x / d) sum_s sum_h dz u_s``, ``dqg_s += dz r x``.

Files (each kernel family with its launch code; the switches all in ``config``):

* ``slot.py``: ``slot_grad``, a slot's gradient in one pass (the two column kernels; ``Carry``, ``Low``), and
  ``column_backward``.
* ``query.py``: ``query_grads``, the query gradients' product.
* ``passes.py``: ``slot_passes``, the plan of a step's passes (``SlotPass``, the byte model), ``run_pass``, and
  the layout of the step's ``dz * r`` (``dzr_rows``, ``dzr_block``).
* ``config.py``: the launch switches and tables, and the rules that read them (``grads_in_place``,
  ``group_slots``, ``pairs_slots``, ``column_config``). Set a switch on the package (``column.NAME = value``)
  or on ``column.config``: the package forwards its switches there (``kernels/switches.py``), and the launch
  code reads them when it runs.

The group passes' kernel is ``kernels/column_group.py``; the table of the output gradients' rows, which the
history backward writes too, ``kernels/grad_rows.py``.
"""

from __future__ import annotations

from ..grad_rows import GradRows
from ..switches import forward_switches
from . import config
from .config import column_config, grads_in_place, group_slots, pairs_slots
from .passes import CARRY_UNITS, SlotPass, carry_rows, dzr_block, dzr_rows, run_pass, slot_passes
from .query import query_grads
from .slot import Carry, Low, column_backward, slot_grad

__all__ = ["column_backward", "slot_grad", "slot_passes", "pairs_slots", "group_slots", "SlotPass", "run_pass",
           "Carry", "carry_rows", "Low", "query_grads", "dzr_rows", "dzr_block", "GradRows", "grads_in_place",
           "column_config", "CARRY_UNITS", "config"]

forward_switches(__name__)
