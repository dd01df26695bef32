"""Every routing kernel of the fused path's training step, alone, at a model preset's shapes: the calls one
step of ``full`` grouping makes (``model/residual/fused.py``'s plan, four sites a pass), each kernel's
calls replayed together from a CUDA graph, their time, the bytes they must move and that over the copy
bandwidth measured in the same run. Launch configurations can be swept, each checked against the default's
outputs first; with ``--prev DIR`` (a package ``prev_kernels`` holding an earlier ``history.py``,
``column.py`` and ``launch.py``, whose column module has ``slot_grad``) the earlier kernels are timed beside
them, for example those of a commit REV:

    mkdir -p .gpu-prev/prev_kernels && touch .gpu-prev/prev_kernels/__init__.py
    for f in launch history column; do git show REV:mhar_ablate/kernels/$f.py > .gpu-prev/prev_kernels/$f.py; done

(carry ``.gpu-prev`` to the device machine).

    PYTHONPATH=$PWD python3 benchmarks/bench_kernels.py --presets paper350m,paper1b --out $OUT \\
        --column-configs '1,4,2;1,4,4' --two-slot-configs '1,2,0;1,2,3' --one-slot \\
        --history-configs '4:1,1,6,2;4:2,1,3,2' --stacked '32,1,3,16' --row-warps '2;8'

Bytes per call (e = bytes of an element of the buffer, U = N·d·e one source):
- write_slot: read the source and write the slot, 2 U, and the RMS (N fp32).
- history_fwd (the shared pass of G sites over S slots): S U + S·N·4 (RMS) read, G U + G·N·H·4 (lse) written.
- block_history (``block:4``'s shared passes: a block's sites in groups of four over the slots of the blocks
  finished before it): as history_fwd.
- sites_fwd (a site's merge with its k extra slots, and the lone last group): k U + the partial state U read,
  U written, the log-sum-exps read and written.
- sites_bwd (each site's backward prologue): the output gradient and the output read, 2 U (3 U with an earlier
  history module, which copies the output gradient), the log-sum-exps read and delta written.
- column (a pass over S sites, ``column.slot_passes``): the slot U, the S output gradients S U, the gradient
  U; the sites' log-sum-exps and deltas read, dz·r written: 3·S·N·H·4. A two-slot pass also reads the
  lower slot U and writes its dz·r, S·N·H·4, and its carry, N·(d + H)·4, which the lower slot's own pass
  (over the sites that read it alone) reads back. A group pass of B slots (``column_group``, before its
  top slot's own pass) reads the B slots and their RMS, B U, the S output gradients, S U, and their
  statistics, 2·S·N·H·4, and writes dz·r for every (site, slot), S·B·N·H·4, and B carries.
- block_column (``block:4``'s passes: its slots are the embedding and the finished blocks, slot j read by the
  sites from 8 j on, in pairs or alone as ``column.slot_passes`` plans them for eight sites a block): as column.
- block_fwd, block_bwd (``block:4``'s sites that read their block's partial sum, 42 at ``paper350m``): the
  merge reads the partial state, the sum before and the block's last output and writes the new sum and the
  output, 5 U; the backward reads the output gradient, the output, the sum and the gradient the later sums
  passed back and writes the sum's gradient, 5 U (6 U with an earlier history module's output-gradient copy;
  both with the statistics, and the sum's RMS statistic, N·4, that the merge keeps and the backward reads).
- query_grad (one product over all slots): every slot's dz·r and every slot read, and 3·slots·sites·d·4
  for partial sums (what the per-slot sums of an earlier form moved, kept so that the figures compare
  across rounds; the chunks' sums of the present form move 0.6 to 3.4 times that, 2-4 % of the total, by arithmetic).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time

import torch
import triton

from mhar_ablate.config import RunConfig, load_preset
from mhar_ablate.kernels.column_group import MAX_GROUP, group_pass
from mhar_ablate.variants.fused import plan_sites

SITES_PER_PASS = 4
BLOCK_SITES = 8  # block:4's sites a block (four layers of two sublayers)
# The paper's tokens per step (mhar_ablate/bench/): 8 x 2048 at 100M, 8 x 1024 otherwise; a few on the CPU.
BATCH = {"paper100m": (8, 2048), "tiny": (1, 6)}


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def graph_time(fn, steps: int = 20) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (captured after warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 4 GB, bytes read + written per second (median)."""
    if device.type == "cpu":  # a smoke run of the script's logic (the interpreter): nothing to compare with
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    del a, b
    return 2 * (4 << 30) / (ms * 1e-3)


class Step:
    """The buffers of one step and, per kernel, the calls that step makes (closures) and their bytes."""

    def __init__(self, preset: str, heads: int, dtype: torch.dtype, device, kernels):
        cfg = RunConfig()
        load_preset(cfg, preset)
        d, layers = cfg.model.d_model, cfg.model.n_layers
        batch, seq = BATCH.get(preset, (8, cfg.model.seq_len))
        self.preset, self.d, self.H, self.N = preset, d, heads, batch * seq
        self.n_sites = 2 * layers + 1
        N, H, n = self.N, heads, self.n_sites
        e = torch.empty((), dtype=dtype).element_size()
        self.U = N * d * e
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

        self.source = randn(n, N, d)  # what the sublayers wrote
        self.buffer = torch.empty((n, N, d), dtype=dtype, device=device)
        self.rms = torch.empty((n, N), dtype=torch.float32, device=device)
        for j in range(n):
            kernels["history"].write_slot(self.source[j], self.buffer[j], self.rms[j], 1e-6)
        self.qg = torch.randn(n, d, generator=gen, device=device) * 0.5 / d ** 0.5 * 8
        self.lse = torch.empty((n, N, H), dtype=torch.float32, device=device)
        self.block_lse = torch.empty((n, N, H), dtype=torch.float32, device=device)
        self.grad_out = randn(n, N, d)
        self.out = randn(n, N, d)
        self.delta = torch.empty((n, N, H), dtype=torch.float32, device=device)
        self.plans = plan_sites(n, 1, SITES_PER_PASS)
        self.first = {}
        self.rest = {}
        for p in self.plans:
            if p.k == 0:
                self.first[p.start] = torch.empty((N, d), dtype=dtype, device=device)
                self.rest[p.start] = torch.empty((max(p.size - 1, 1), N, d), dtype=dtype, device=device)
        self.merged = torch.empty((N, d), dtype=dtype, device=device)
        self.summed = torch.empty((N, d), dtype=dtype, device=device)
        self.grad_partial = torch.empty((1, N, d), dtype=dtype, device=device)
        self.kept_rms = torch.empty((1, N), dtype=torch.float32, device=device)  # a merge's partial sum's RMS
        # the routing parameters' and the folded norms' gains' gradients, a site a row each, as the fused path
        # keeps them (one tensor, so that a site's backward adds both rows in one launch)
        self.param_grads = torch.zeros((2, n, d), dtype=torch.float32, device=device)
        self.dqg = self.param_grads[0]
        # --norms: the sublayers' pre-norms folded into the kernels (``history.Norm``), gains away from 1
        self.norms = False
        self.gain = 1 + 0.1 * torch.randn(n, d, generator=gen, device=device)
        self.normed = torch.empty((N, d), dtype=dtype, device=device)
        # the norms' statistics: where a forward writes them, and those of each site's output, which its
        # backward reads (each head's sum of squares, then the rsqrt of the mean square plus eps)
        self.normed_stats = torch.empty((N, H + 1), dtype=torch.float32, device=device)
        heads = self.out.float().view(n, N, H, d // H).pow(2).sum(-1)
        self.norm_stats = torch.cat([heads, torch.rsqrt(heads.sum(-1, keepdim=True) / d + 1e-6)], -1)
        self.norm_grads = torch.empty((n, N, d), dtype=dtype, device=device)  # where the prologues write
        self.dzr = torch.randn(kernels["column"].dzr_rows(n, n, 1) * H * N, generator=gen, device=device)
        block_slots = (n - 1) // BLOCK_SITES + 1
        self.block_dzr = torch.randn(kernels["column"].dzr_rows(block_slots, n, BLOCK_SITES) * H * N, generator=gen,
                                     device=device)
        # Where the column passes read the output gradients: in place, through a table (``GradRows``, whose
        # offsets the backward prologue records), or the copies the prologue writes, here onto the gradients
        # themselves (the same bytes moved, the same values read); ``column.grads_in_place`` decides.
        self.copy = self.grad_out
        self.table = torch.arange(n, dtype=torch.int64, device=device) * (N * d)
        # one carry row a slot of the largest group; an earlier column module takes 2-D carries
        rows = MAX_GROUP if hasattr(kernels["column"], "group_slots") else None
        self.carry_acc = torch.empty((rows, N, d) if rows else (N, d), dtype=torch.float32, device=device)
        self.carry_dr = torch.empty((rows, N, H) if rows else (N, H), dtype=torch.float32, device=device)
        # The statistics a real forward leaves: run the forward passes once with the default kernels.
        for fn, _ in self.calls("history_fwd", kernels) + self.calls("sites_fwd", kernels):
            fn()
        for fn, _ in self.calls("sites_bwd", kernels):
            fn()
        sync()

    def calls(self, kind: str, kernels) -> list[tuple]:
        """(closure, bytes) for each call of ``kind`` in one step."""
        history, column = kernels["history"], kernels["column"]
        N, d, H, U, eps = self.N, self.d, self.H, self.U, 1e-6
        nstats = N * (H + 1) * 4 if self.norms else 0  # --norms: a norm's statistics, written or read
        out = []
        if kind == "write_slot":
            for j in range(self.n_sites):
                def write(j=j):
                    history.write_slot(self.source[j], self.buffer[j], self.rms[j], eps)
                    return self.buffer[j], self.rms[j]

                out.append((write, 2 * U + N * 4))
        elif kind == "history_fwd":
            out = self.shared_passes(self.plans, self.lse, history)
        elif kind == "block_history":
            # block:4's shared passes: a group of four sites of a block (eight sites) over the slots of the
            # blocks finished before it, with log-sum-exps of their own (the column kernels read the step's)
            out = self.shared_passes(plan_sites(self.n_sites, 8, SITES_PER_PASS), self.block_lse, history)
        elif kind == "sites_fwd":
            for p in self.plans:
                rows = slice(p.start, p.start + p.size)
                h = p.history
                if p.k == 0 and p.size <= 2:
                    out.append((lambda p=p, rows=rows, h=h: history.sites_forward(
                        self.buffer[:h], self.qg[rows], H, eps, self.first[p.start],
                        self.rest[p.start] if p.size > 1 else None, self.lse[rows], rms=self.rms[:h]),
                        h * U + h * N * 4 + p.size * (U + N * H * 4)))
                if p.k > 0:
                    site = p.start + p.k
                    state = self.rest[p.start][p.k - 1]
                    # The merge writes its output to a scratch row, but its log-sum-exp back in place: each replay
                    # moves it a little, which changes no timing (the column kernels, which read it, are
                    # checked against outputs computed after every merge has run).
                    out.append((lambda p=p, site=site, state=state, h=h: history.sites_forward(
                        self.buffer[h:h + p.k], self.qg[site:site + 1], H, eps, self.merged, None,
                        self.lse[site:site + 1], init=state.unsqueeze(0), rms=self.rms[h:h + p.k],
                        **self.norm_out(site, kernels)),
                        p.k * U + p.k * N * 4 + (3 if self.norms else 2) * U + 2 * N * H * 4 + nstats))
        elif kind == "sites_bwd":
            empty = self.buffer[:0]
            for s in range(self.n_sites):
                def prologue(s=s):  # a site's delta, and where its output gradient lies (or its copy)
                    history.sites_backward(empty, empty, None, self.qg[s:s + 1], H, eps, self.grad_out[s:s + 1],
                                           self.lse[s:s + 1], self.delta[s:s + 1], out=self.out[s],
                                           **self.keep_grad(s, kernels))
                    return (self.delta[s], self.norm_grads[s]) if self.norms else (self.delta[s], self.copy[s])

                out.append((prologue, (2 if self.in_place(kernels) and not self.norms else 3) * U + 2 * N * H * 4
                            + nstats))
        elif kind == "norm_rows":  # --norms: block:4's sites that merge nothing, their pre-norm a pass of its own
            if self.norms:
                for s in range(0, self.n_sites - 1, 8):
                    out.append((lambda s=s: (history.norm_rows(self.out[s], self.norm(kernels, s, self.normed), H),
                                             self.normed)[1:], 2 * U + nstats))
        elif kind in ("block_fwd", "block_bwd"):
            # block:4's sites that read their block's partial sum (sites s with s % 8 > 0): the merge that
            # also makes the sum (partial + the block's last output, written), and the backward that adds the
            # gradient the later sums passed back and the query-row gradient into the step's rows
            # whether the merge keeps the sum's RMS for the backward (an earlier history module does not)
            keeps_rms = "rms_out" in inspect.signature(history.sites_forward).parameters
            for s in (s for s in range(self.n_sites) if s % 8):
                partial, addend, rows = self.source[s:s + 1], self.out[s], slice(s, s + 1)
                if kind == "block_fwd":
                    state = self.out[s - 1:s]

                    def merge(s=s, partial=partial, addend=addend, rows=rows, state=state):
                        kept = {"rms_out": self.kept_rms} if keeps_rms else {}
                        history.sites_forward(partial, self.qg[rows], H, eps, self.merged, None, self.lse[rows],
                                              init=state, addend=addend, sum_out=self.summed,
                                              **self.norm_out(s, kernels), **kept)
                        return self.merged, self.summed

                    out.append((merge, (6 if self.norms else 5) * U + 2 * N * H * 4 + N * 4 + nstats))
                else:
                    def block_bwd(s=s, partial=partial, rows=rows):
                        # the partial sum's RMS as its merge kept it: here the statistic of its row, in rms[s]
                        kept = {"rms": self.rms[rows]} if keeps_rms else {}
                        history.sites_backward(partial, self.grad_partial, self.out[s - 1:s], self.qg[rows], H, eps,
                                               self.grad_out[rows], self.lse[rows], self.delta[rows],
                                               out=self.out[s], **{"dqg": self.dqg[rows], **self.keep_grad(s, kernels)},
                                               **kept)
                        return self.grad_partial, self.delta[s], self.norm_grads[s] if self.norms else self.copy[s]

                    out.append((block_bwd, (5 if self.in_place(kernels) and not self.norms else 6) * U
                                + 2 * N * H * 4 + N * 4 + nstats))
        elif kind in ("column", "block_column"):
            stats = 3 * N * H * 4  # per site: its log-sum-exps and deltas read, dz * r written
            if not hasattr(column, "slot_passes"):  # an earlier column module: one pass a slot, full grouping
                for j in range(self.n_sites if kind == "column" else 0):
                    S = self.n_sites - j
                    out.append((lambda j=j: column.slot_grad(self.buffer[j], self.rms[j], self.copy[j:],
                                                             self.lse[j:], self.delta[j:], self.qg[j:], H),
                                 (S + 2) * U + N * 4 + S * stats))
                return out
            carry = column.Carry(self.carry_acc, self.carry_dr)
            n = self.n_sites
            # block:4's slots are its blocks (eight sites each, slot j read by sites 8 j ..), its dz * r as many
            # rows as those pairs; the sites' statistics are full's (weights at most 1, as in a real step)
            K = 1 if kind == "column" else BLOCK_SITES
            slots = (n - 1) // K + 1
            dzr = self.dzr if K == 1 else self.block_dzr
            groups = [column.group_slots(d, H, K) if K > 1 else column.group_slots(d, H)] \
                if hasattr(column, "group_slots") else []
            for p in column.slot_passes(slots, n, K, column.pairs_slots(d), *groups):
                S = len(p.sites)
                moved = (S + 2) * U + N * 4 + S * stats
                if p.low:  # the lower slot and its RMS read, its dz * r written, its carry written
                    moved += U + N * 4 + S * N * H * 4 + N * (d + H) * 4
                if p.carried:  # the carry read
                    moved += N * (d + H) * 4
                if getattr(p, "group", None) is not None:  # the group pass before this slot's own
                    moved += self.group_bytes(len(p.group), n - p.slot)

                def run(p=p, K=K, dzr=dzr):
                    grad = column.run_pass(p, self.buffer, self.rms, self.grads(kernels), self.lse, self.delta, self.qg,
                                           H, K, dzr, carry)
                    return (grad,)

                out.append((run, moved))
        elif kind == "column_groups":  # the column passes' group passes alone (``column_group``)
            if not hasattr(column, "group_slots"):
                return out
            n = self.n_sites
            for p in column.slot_passes(n, n, 1, column.pairs_slots(d), column.group_slots(d, H)):
                if p.group is None:
                    continue
                moved = self.group_bytes(len(p.group), n - p.slot)

                def run(p=p):
                    group_pass(self.buffer, self.rms, self.grads(kernels), self.lse, self.delta, self.qg, H, p.group,
                               range(p.slot, self.n_sites), self.n_sites, 1, self.dzr, self.carry_acc, self.carry_dr)
                    return (self.carry_acc[:len(p.group)],)

                out.append((run, moved))
        elif kind == "query_grad":  # one product over every slot of the step
            P = column.dzr_rows(self.n_sites, self.n_sites, 1)
            out.append((lambda: (column.query_grads(self.dzr, self.buffer, H, self.n_sites, 1),),
                        P * H * N * 4 + self.n_sites * U + 3 * self.n_sites * self.n_sites * d * 4))
        else:
            raise ValueError(kind)
        return out


    def shared_passes(self, plans, lse, history) -> list[tuple]:
        """(closure, bytes) for the shared passes of ``plans``' groups of more than two sites, writing their
        log-sum-exps to ``lse``."""
        N, H, U = self.N, self.H, self.U
        out = []
        for p in plans:
            if p.k == 0 and p.size > 2:
                rows, h = slice(p.start, p.start + p.size), p.history

                def run(p=p, rows=rows, h=h):
                    first, rest = self.first[p.start], self.rest[p.start]
                    history.history_forward(self.buffer[:h], self.rms[:h], self.qg[rows], H, first, rest, lse[rows])
                    return first, rest[:p.size - 1], lse[rows]

                out.append((run, h * U + h * N * 4 + p.size * (U + N * H * 4)))
        return out

    def in_place(self, kernels) -> bool:
        """Whether these kernels read the output gradients where they lie (a table) at this width."""
        return hasattr(kernels["column"], "grads_in_place") and kernels["column"].grads_in_place(self.d)

    def grads(self, kernels):
        """The output gradients as the column passes take them."""
        if not hasattr(kernels["column"], "GradRows"):
            return self.copy
        GradRows = kernels["column"].GradRows
        return GradRows(self.grad_out, self.table) if self.in_place(kernels) else GradRows.stacked(self.copy)

    def keep_grad(self, s: int, kernels) -> dict:
        """How site s's backward prologue keeps its output gradient for the column passes: its offset recorded
        in the table (the value the table holds already), or a copy; with --norms the gradient it makes from
        the normed input's, written where the fused path writes it (in place, here into a row of its own so
        that replays read the same values, or the copy)."""
        if self.norms:  # the site's rows of the query-row and gain gradients, (2, d)
            norm = {"norm": self.norm(kernels, s), "grad_copy": self.norm_grads[s:s + 1],
                    "dqg": self.param_grads[:, s]}
            if self.in_place(kernels):
                norm["record"] = (self.table[s:s + 1], s * self.N * self.d)
            return norm
        if self.in_place(kernels):
            return {"record": (self.table[s:s + 1], s * self.N * self.d)}
        return {"grad_copy": self.copy[s:s + 1]}

    def norm_out(self, s: int, kernels) -> dict:
        """With --norms, a merge's pre-norm written too."""
        return {"norm": self.norm(kernels, s, self.normed)} if self.norms else {}

    def norm(self, kernels, s: int, out=None):
        """Site s's pre-norm as the kernels take it: with ``out`` a forward's (writing the normed row and its
        statistics to scratch rows), else a backward's (reading the statistics of the site's output)."""
        stats = self.normed_stats if out is not None else self.norm_stats[s]
        return kernels["history"].Norm(self.gain[s], 1e-6, stats, out)

    def group_bytes(self, B: int, S: int) -> int:
        """What a group pass of B slots over S sites moves (the module docstring's list)."""
        N, d, H, U = self.N, self.d, self.H, self.U
        return B * (U + N * 4) + S * (U + 2 * N * H * 4) + S * B * N * H * 4 + B * N * (d + H) * 4


KINDS = ("write_slot", "history_fwd", "sites_fwd", "sites_bwd", "column", "column_groups", "query_grad", "block_fwd",
         "block_bwd", "block_history", "block_column", "norm_rows")


def time_calls(calls, device, reps: int = 10) -> float:
    """Median ms of the calls replayed together from one CUDA graph (on the CPU: one run, interpreted)."""
    if device.type == "cpu":
        t0 = time.perf_counter()
        for fn, _ in calls:
            fn()
        return (time.perf_counter() - t0) * 1e3
    for fn, _ in calls:  # compile outside the capture
        fn()
    return graph_time(lambda: [fn() for fn, _ in calls], steps=reps)


def outputs(calls) -> list[torch.Tensor]:
    """What the calls return (the tensors they wrote), cloned, each call run once."""
    got = []
    for fn, _ in calls:
        got += [t.clone() for t in fn()]
    sync()
    return got


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_configs(text: str, with_g: bool) -> list:
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        if with_g:
            g, cfg = item.split(":")
            out.append((int(g), tuple(int(v) for v in cfg.split(","))))
        else:
            out.append(tuple(int(v) for v in item.split(",")))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="paper350m")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the script's logic through the interpreter "
                   "(tiny preset) to check it, timing nothing that matters")
    p.add_argument("--column-configs", default="", help="'TOKENS,WARPS,STAGES;...' for the column kernel")
    p.add_argument("--two-slot-configs", default="",
                   help="'TOKENS,WARPS,STAGES;...' for the column kernel's passes over two slots")
    p.add_argument("--one-slot", action="store_true", help="also time the column passes one slot a pass")
    p.add_argument("--other-grads", action="store_true",
                   help="also time the backward prologues and the column passes with the output gradients kept the "
                        "other way (copied where the width's table reads them in place, and the reverse)")
    p.add_argument("--group-slots", default="", help="'K;...': the column passes planned with group passes of at "
                   "most K slots (0: none, the two-slot plan)")
    p.add_argument("--group-weights", default="", help="'W;...': the column passes planned with a group pass's "
                   "bytes counted W times (column.GROUP_PASS_WEIGHT)")
    p.add_argument("--group-configs", default="",
                   help="'TOKENS,WARPS,STAGES,MAX_S[,HOLD];...' for the column passes' group pass")
    p.add_argument("--history-configs", default="",
                   help="'G:TOKENS,WARPS,STAGES,SOURCES;...' for the head-tiled forward")
    p.add_argument("--history-dot", default="",
                   help="'TOKENS,WARPS,STAGES,MAX_S;...' for the head-tiled forward's matrix-product form "
                   "(--history-configs entries time its reductions' form)")
    p.add_argument("--stacked", default="",
                   help="'TOKENS,WARPS,STAGES,ROWS;...' for the head-tiled forward's stacked products' form at "
                   "few sources (history.HISTORY_STACKED_CONFIG)")
    p.add_argument("--history-tiles", default="",
                   help="'T;...': token tiles a program of the head-tiled forward's reductions' form walks "
                        "(0: as many as make its programs fit on the GPU at once)")
    p.add_argument("--merge-configs", default="",
                   help="'WARPS,STAGES;...' for the merges' kernel (sites_fwd, block_fwd)")
    p.add_argument("--query-configs", default="",
                   help="'SITES,TOKENS,WARPS,STAGES,PER_SM;...' for query_grad")
    p.add_argument("--write-configs", default="", help="'TOKENS,WARPS;...' for write_slot")
    p.add_argument("--row-warps", default="", help="'W;...': warps of the row kernels (sites_fwd, sites_bwd)")
    p.add_argument("--row-stages", default="", help="'S[,CAP];...': the backward row kernel's pipeline depths "
                   "(sites_bwd, block_bwd), with CAP a register cap in place of the table's (0: none)")
    p.add_argument("--row-maxnreg", default="", help="'R;...': a cap on the row kernels' registers a thread")
    p.add_argument("--profile", action="store_true", help="no timing: run the largest call of the column, the "
                   "head-tiled forward, query_grad, block_bwd and sites_bwd per version, inside an NVTX range "
                   "'profile' (for ncu --nvtx-include)")
    p.add_argument("--kinds", default=",".join(KINDS), help="the kinds timed at their defaults")
    p.add_argument("--profile-kinds", default="column,history_fwd,query_grad,block_bwd,sites_bwd",
                   help="with --profile: the kinds whose largest call is profiled (the variants' too)")
    p.add_argument("--norms", action="store_true",
                   help="the sublayers' pre-norms folded in, as training runs them: the merges write the normed "
                        "input too, the backward rows make the input's gradient from the normed one's (sites_fwd, "
                        "block_fwd, sites_bwd, block_bwd), and block:4's sites that merge nothing take a pass of "
                        "their own (norm_rows); the earlier kernels (--prev) run without")
    p.add_argument("--prev", default="", help="folder holding a package prev_kernels (earlier kernels) to time too")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_kernels_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    from mhar_ablate.kernels import column, column_group, history

    current = {"history": history, "column": column}
    prev = None
    if args.prev:
        sys.path.insert(0, args.prev)
        prev = {"history": importlib.import_module("prev_kernels.history"),
                "column": importlib.import_module("prev_kernels.column")}
    copy = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy / 1e12:.2f} TB/s", flush=True)
    rows = []
    for preset in args.presets.split(","):
        # fp32 on the interpreter, whose bf16 products are not faithful: the CPU run checks the forms agree
        step = Step(preset, args.heads, torch.float32 if device.type == "cpu" else torch.bfloat16, device, current)
        step.norms = args.norms
        print(f"{preset}: d {step.d}, N {step.N}, {step.n_sites} sites", flush=True)

        def record(kind, label, kernels, check=None):
            calls = step.calls(kind, kernels)
            if not calls:  # (no group passes at this width, or in an earlier column module)
                return None
            t0 = time.perf_counter()
            ms = time_calls(calls, device)
            err = None
            if check is not None:
                err = max(rel(a.double(), b.double()) for a, b in zip(outputs(calls), check))
            gb = sum(b for _, b in calls) / 1e9
            row = {"preset": preset, "kernel": kind, "version": label, "calls": len(calls), "ms": round(ms, 3),
                   "GB": round(gb, 3), "TB/s": round(gb / ms, 3), "of copy": round(gb / ms / (copy / 1e12), 3),
                   "rel err vs default": err, "wall s": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            return ms

        if not args.profile:
            for kind in args.kinds.split(","):
                record(kind, "default", current)
        reference = {k: outputs(step.calls(k, current))
                     for k in ("write_slot", "history_fwd", "block_history", "sites_bwd", "column", "block_column",
                               "column_groups", "query_grad")}
        # the merges move their log-sum-exps in place: nothing fixed to compare
        reference["sites_fwd"] = reference["block_fwd"] = None
        reference["block_bwd"] = outputs(step.calls("block_bwd", current))
        reference["norm_rows"] = None
        # The column kernels first: the head-tiled forward rewrites the log-sum-exps that they read.
        saved = (column.COLUMN_CONFIG, column.QUERY_GRAD_CONFIG, column.COLUMN_MAXNREG,
                 {k: dict(v) for k, v in history.HISTORY_CONFIG.items()}, history.WRITE_SLOT_CONFIG,
                 history.ROW_WARPS, column.TWO_SLOT_CONFIG, column.TWO_SLOTS, history.ROW_MAXNREG,
                 history.ROW_BWD_STAGES, (dict(history.ROW_BWD_CONFIG), dict(history.ROW_BWD_NORM_CONFIG)),
                history.HISTORY_DOT_CONFIG,
                 column.GROUP_SLOTS, column_group.GROUP_CONFIG, column.GROUP_PASS_WEIGHT, column.GRADS_IN_PLACE,
                 history.HISTORY_TILES, dict(history.MERGE_CONFIG), history.HISTORY_STACKED_CONFIG)
        columns = ("column", "block_column")  # full's passes and block:4's
        variants = [(kind, "prev", prev, None) for kind in columns] if prev is not None else []
        variants += [(kind, f"col {c}", current, ("col", c)) for c in parse_configs(args.column_configs, False)
                     for kind in columns]
        variants += [(kind, f"two-slot {c}", current, ("two", c))
                     for c in parse_configs(args.two_slot_configs, False) for kind in columns]
        if args.one_slot:
            variants += [(kind, "one slot a pass", current, ("one-slot", None)) for kind in columns]
        if args.other_grads:
            other = not column.grads_in_place(step.d)
            variants += [(kind, "grads in place" if other else "grads copied", current, ("grads", other))
                         for kind in (*columns, "column_groups", "sites_bwd", "block_bwd")]
        variants += [(kind, f"groups of <= {k[0]}", current, ("groups", k[0]))
                     for k in parse_configs(args.group_slots, False) for kind in (*columns, "column_groups")]
        variants += [("column", f"group weight {w}", current, ("weight", float(w)))
                     for w in filter(None, (t.strip() for t in args.group_weights.split(";")))]
        variants += [(kind, f"group {c}", current, ("group", c)) for c in parse_configs(args.group_configs, False)
                     for kind in ("column", "column_groups")]
        variants += [("query_grad", f"qg {c}", current, ("qg", c)) for c in parse_configs(args.query_configs, False)]
        variants += [("write_slot", f"write {c}", current, ("write", c))
                     for c in parse_configs(args.write_configs, False)]
        # (the backward kernels first: the merges move the log-sum-exps that they read)
        rows_settings = [(f"rows {w[0]} warps", ("rows", w[0])) for w in parse_configs(args.row_warps, False)]
        rows_settings += [(f"rows maxnreg {r[0]}", ("maxnreg", r[0])) for r in parse_configs(args.row_maxnreg, False)]
        variants += [(kind, label, current, setting) for kind in ("sites_bwd", "block_bwd", "sites_fwd", "block_fwd")
                     for label, setting in rows_settings]
        variants += [(kind, f"rows {r[0]} stages" + (f", cap {r[1]}" if len(r) > 1 else ""), current, ("stages", r))
                     for kind in ("sites_bwd", "block_bwd") for r in parse_configs(args.row_stages, False)]
        if prev is not None:
            variants += [(kind, "prev", prev, None)
                         for kind in ("sites_bwd", "block_bwd", "history_fwd", "block_history", "sites_fwd", "block_fwd")]
        variants += [(kind, f"merge {c}", current, ("merge", c)) for c in parse_configs(args.merge_configs, False)
                     for kind in ("sites_fwd", "block_fwd")]
        variants += [(kind, f"tiles {t[0]}", current, ("tiles", t[0]))
                     for t in parse_configs(args.history_tiles, False) for kind in ("history_fwd", "block_history")]
        variants += [(kind, f"fwd G{g} {c}", current, (g, c))
                     for g, c in parse_configs(args.history_configs, True) for kind in ("history_fwd", "block_history")]
        variants += [("history_fwd", f"fwd dot {c}", current, ("dot", c)) for c in parse_configs(args.history_dot, False)]
        variants += [(kind, f"stacked {c}", current, ("stacked", c))
                     for c in parse_configs(args.stacked, False) for kind in ("history_fwd", "block_history")]

        def apply(setting):
            if setting is None:
                return
            what, cfg = setting
            if what == "col":  # TOKENS, WARPS, STAGES (0: the prefetching kernel), optional MAXNREG
                column.COLUMN_CONFIG, column.COLUMN_MAXNREG = cfg[:3], cfg[3] if len(cfg) > 3 else 0
            elif what == "two":
                column.TWO_SLOT_CONFIG = cfg
            elif what == "grads":
                column.GRADS_IN_PLACE = cfg
            elif what == "one-slot":
                column.TWO_SLOTS, column.GROUP_SLOTS = False, 0
            elif what == "groups":
                column.GROUP_SLOTS = cfg
            elif what == "weight":
                column.GROUP_PASS_WEIGHT = cfg
            elif what == "group":  # TOKENS, WARPS, STAGES, MAX_S[, HOLD]
                column_group.GROUP_CONFIG = cfg
            elif what == "qg":
                column.QUERY_GRAD_CONFIG = cfg
            elif what == "write":
                history.WRITE_SLOT_CONFIG = cfg
            elif what == "rows":
                history.ROW_WARPS = cfg
            elif what == "maxnreg":
                history.ROW_MAXNREG = cfg
            elif what == "stages":
                history.ROW_BWD_STAGES = cfg[0]
                if len(cfg) > 1:  # the same cap for both forms, with the pre-norm or without
                    history.ROW_BWD_CONFIG = {(step.d, args.heads): ((cfg[1], cfg[0]),) * 2}
                    history.ROW_BWD_NORM_CONFIG = dict(history.ROW_BWD_CONFIG)
            elif what == "dot":
                history.HISTORY_DOT_CONFIG = cfg
            elif what == "stacked":
                history.HISTORY_STACKED_CONFIG = cfg
            elif what == "merge":
                history.MERGE_CONFIG = {(step.d, args.heads): cfg}
            elif what == "tiles":
                history.HISTORY_TILES = cfg
            else:  # the reductions' form; the preset's head split decides which table is read
                history.HISTORY_DOT_CONFIG = None
                history.HISTORY_CONFIG["fwd"][what] = history.HISTORY_CONFIG["fwd_split"][what] = cfg

        def restore():
            column.COLUMN_CONFIG, column.QUERY_GRAD_CONFIG, column.COLUMN_MAXNREG = saved[:3]
            history.HISTORY_CONFIG = {k: dict(v) for k, v in saved[3].items()}
            (history.WRITE_SLOT_CONFIG, history.ROW_WARPS, column.TWO_SLOT_CONFIG, column.TWO_SLOTS,
             history.ROW_MAXNREG, history.ROW_BWD_STAGES) = saved[4:10]
            history.ROW_BWD_CONFIG, history.ROW_BWD_NORM_CONFIG = dict(saved[10][0]), dict(saved[10][1])
            history.HISTORY_DOT_CONFIG = saved[11]
            (column.GROUP_SLOTS, column_group.GROUP_CONFIG, column.GROUP_PASS_WEIGHT,
             column.GRADS_IN_PLACE) = saved[12:16]
            history.HISTORY_TILES, history.MERGE_CONFIG = saved[16], dict(saved[17])
            history.HISTORY_STACKED_CONFIG = saved[18]

        if args.profile:
            import torch.cuda.nvtx as nvtx

            profiled = args.profile_kinds.split(",")
            for kind, label, kernels, setting in [(k, "default", current, None) for k in profiled] + [
                    v for v in variants if v[0] in profiled]:
                apply(setting)
                calls = step.calls(kind, kernels)
                if not calls:
                    restore()
                    continue
                # the call that moves the most bytes: for the column kernel the pass over the most sites (a
                # two-slot pass where the width pairs slots), for the head-tiled forward the longest history
                fn = max(calls, key=lambda call: call[1])[0]
                fn()  # compile outside the range
                sync()
                with nvtx.range("profile"):
                    fn()
                sync()
                print(f"profiled: {preset} {kind} {label}", flush=True)
                restore()
            continue
        for kind, label, kernels, setting in variants:
            apply(setting)
            step.norms = args.norms and kernels is current
            # another plan's group passes cover other slots: nothing of the default's to compare them with
            check = None if kind == "column_groups" and setting[0] == "groups" else reference[kind]
            try:
                record(kind, label, kernels, check)
            except Exception as exc:  # a configuration that does not compile or fit: say so, go on
                print(f"{kind} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            restore()
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump({"copy_TBps": copy / 1e12, "rows": rows}, f, indent=1)
    if rows:
        import pandas as pd

        print(pd.DataFrame(rows).drop(columns=["wall s"]).to_markdown(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
