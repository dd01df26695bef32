"""Triton kernels of the fused training path's forward (``variants/fused.py``): routing sites that
read a buffer of sources in place, alone or several at once over a shared history; and the per-site
backward of the sources a site reads beyond the buffer (a block's partial sum). The gradients of the
buffer's slots are ``column``'s.

In a routed decoder the queries are parameters, not functions of the token, so the G consecutive sites
of a group can share one pass over the sources that were complete when the group began ("the history"):
the forward computes the G partial softmax states at once, and each site then merges its partial state
with the few sources produced inside the group (an online-softmax merge, exact). History bytes drop by
a factor G.

Two families of kernels:

* one token at a time, the whole row of d channels (``_sites_fwd_kernel``, ``_merge_fwd_kernel``,
  ``_sites_bwd_kernel``): a site (or a few) over its sources, the per-site mode, and the merge of a site with
  the sources it reads beyond its group's history (where ``MERGE_CONFIG`` says, in a kernel whose programs
  walk many tokens, pipelined). The RMS of a source is computed from the row. The backward kernel also
  writes a site's ``delta = <g, out>`` for the slots' backward, and where its output gradient lies (or a copy
  of it).
* one routing head per program, the shared pass of G > 2 sites (``history_forward``). Holding G sites'
  accumulators for a whole row would fill the register file (measured on the H200: a shared pass of 8
  sites over full rows took 53 ms a step against 25 ms for one pass per site); a head's [G, d/H] tile is
  the size of one site's row. The RMS statistic spans all heads, so these kernels read it from ``rms``
  (written once per source by ``write_slot``). Three forms: for a token, G sites over S sources is a small
  attention whose two products run on tensor cores (``_history_fwd_dot_kernel``, from
  ``HISTORY_DOT_MIN_S`` sources on, heads wide enough for ``tl.dot``); the same products over several
  tokens' sources at once where S is small (``_history_fwd_stacked_kernel``, where
  ``HISTORY_STACKED_CONFIG`` is set); fewer sources, or narrow heads, take token tiles with every product a
  sum across lanes (``_history_fwd_kernel``).

Math (per site k, r = rsqrt(mean_c s_c^2 + eps), u_k = <s_h, qg_k,h>, z = r u):

    forward:   a_k = softmax over sources of z_k,     out_k = sum_s a_k s
    backward:  dz_k = a_k (<g_k, s> - delta_k),       delta_k = <g_k, out_k>   (flash-attention's identity)
               ds  = sum_k [a_k g_k + dz_k r qg_k] - (r^3 s / d) sum_k sum_h dz_k,h u_k,h,
               dqg_k += dz_k r s

Log-sum-exps and deltas are laid out (sites, N, H): a token's heads in one 32-byte sector, read once per
(token, site) by the backward.
Heads whose width is not a power of two are split into a power-of-two part (DA) and a rest (DB, padded
to BLOCK_DB; ``launch.head_meta``); on CPU tensors the kernels run through Triton's interpreter.

Files (each kernel family with its launch code; the switches all in ``config``):

* ``slots.py``: ``write_slot`` (a source into the buffer, with its RMS), ``norm_rows`` (a site's pre-norm).
* ``sites.py``: ``sites_forward``, the row kernels' forward and the merges' kernel.
* ``backward.py``: ``sites_backward``, the row kernel's backward.
* ``shared.py``: ``history_forward``, the shared pass: which form a pass takes, and the reductions' form.
* ``shared_dot.py``, ``shared_stacked.py``: the shared pass's matrix products' forms, one token at a time
  and several tokens' sources a tile.
* ``row_sums.py``: ``add_row_sums``, the per-program partial sums of the query gradients added up.
* ``common.py``: what several of them share (``Norm``, ``_softmax_step``, ``_normed``, warps and padding).
* ``config.py``: the launch switches and tables. Set one on the package (``history.NAME = value``) or on
  ``history.config``: the package forwards its switches there (``kernels/switches.py``), and the launch code
  reads them when it launches.
"""

from __future__ import annotations

from ..switches import forward_switches
from . import config
from .backward import sites_backward
from .common import Norm
from .row_sums import add_row_sums
from .shared import history_forward
from .shared_stacked import stacked_fits, stacked_tile
from .sites import sites_forward
from .slots import norm_rows, write_slot

__all__ = ["write_slot", "sites_forward", "sites_backward", "history_forward", "add_row_sums", "Norm", "norm_rows",
           "stacked_tile", "stacked_fits", "config"]

forward_switches(__name__)
