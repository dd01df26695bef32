"""Triton kernel of the backward by source over a group of slots at once, as matrix products.

A slot's gradient must be complete when autograd reaches the sublayer that wrote it, so ``column``'s
passes take one slot (or two) at a time and read every site's output gradient once per slot or pair: at
the 350M shape most of the backward's bytes. But the sites that read the top slot t of a group
[j0, t] read every slot of the group too, and their output gradients are all known when slot t's
gradient is needed. One pass then sums those sites' share of all the group's slots, reading each site's
output gradient once for the group, and leaves each slot's sums in a carry; each slot's own pass
(``column``'s kernel with CARRY) adds the few sites that read it but not slot t, and the part through its
RMS statistic. ``column.slot_passes`` plans the groups from a byte count.

For one token and one head, the group's B slots X [B, head] and the pass's S sites (output gradients
G [S, head], fused query rows Q [S, head], log-sum-exps and deltas [S]) give every term as a product:

    U^T = X Q^T,  P^T = X G^T                        [B, S]: scores before the RMS scale, <g_s, x>
    A^T = exp(r U^T - lse),  dz^T = A^T (P^T - delta)
    dX += A^T G + (r dz)^T Q                          [B, head]
    dr += sum_s dz U                                  [B]: each head's share of the RMS term

``r dz`` is also written to the step's ``dz * r`` buffer (rows of each slot's (H, S_j, N) block), from
which ``column.query_grads`` takes the query gradients. The fp32 operands (Q, A, r dz) are split into
hi + lo parts of the sources' dtype (``products.split``): two products for the scores, five for dX (the
lo x lo terms left out, 2^-18 of a term), one for P.

A program takes one head and a run of tokens; its loop walks (token, tile of sites) pairs through the
software pipeline. The products' rows are the group's slots, BLOCK_B = 16 (a group has at most 16); a
tile has at most 64 sites, one tile (ONE_TILE, the query rows loaded once a program) wherever the pass's
sites fit.

A token's ``r dz`` is one fp32 value in each of B x S rows of ``dz * r``, whose tokens are contiguous: stored
alone, each value takes a 32-byte sector of its own. With one tile a program holds HOLD tokens' values in
registers and stores them together, HOLD x 4 contiguous bytes a row (``GROUP_CONFIGS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import ptx
from .grad_rows import GradRows, site_offsets
from .launch import head_meta, launch, products_fit
from .products import head_columns, split

__all__ = ["group_pass", "group_fits", "unpack_config", "MAX_GROUP", "MAX_HEAD_WIDTH", "GROUP_CONFIGS", "GROUP_CONFIG"]

MAX_GROUP = 16  # slots a group pass takes at most: BLOCK_B, the rows of its products


@triton.jit
def _dot_parts(a_hi, a_lo, b_hi, b_lo, acc, HI_LO: tl.constexpr, LO_HI: tl.constexpr, PREC: tl.constexpr):
    """acc + a_hi b_hi, + a_hi b_lo with HI_LO, + a_lo b_hi with LO_HI: a product of two-part operands
    without the lo x lo term (2^-18 of a term)."""
    acc = tl.dot(a_hi, b_hi, acc, input_precision=PREC)
    if HI_LO:
        acc = tl.dot(a_hi, b_lo, acc, input_precision=PREC)
    if LO_HI:
        acc = tl.dot(a_lo, b_hi, acc, input_precision=PREC)
    return acc


# N is specialised (16-divisible in practice): the held tokens' dz * r rows are then 16-byte aligned stores.
@triton.jit(do_not_specialize=["B", "S", "j0", "n_sites", "s_top", "block", "tokens_per_program"])
def _column_group_kernel(
    x_ptr, rms_ptr, g_ptr, gtab_ptr, lse_ptr, delta_ptr, qg_ptr, acc_ptr, dr_ptr, dzr_ptr,
    N, B, S, j0, n_sites, s_top, block, tokens_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr, ONE_TILE: tl.constexpr, HOLD: tl.constexpr, PTX: tl.constexpr, TABLE: tl.constexpr,
):
    # x_ptr, rms_ptr: the group's first slot (slots N * D and N apart); g_ptr (with TABLE, gtab_ptr: the
    # output gradients' offsets from g_ptr, ``grad_rows``), lse_ptr, delta_ptr, qg_ptr: the pass's first site,
    # s_top; acc_ptr, dr_ptr: the group's carries, (B, N, D) and (B, N, H) fp32.
    head = tl.program_id(1)
    first_tok = tl.program_id(0).to(tl.int64) * tokens_per_program
    _, _, col_a, col_b, b_ok = head_columns(head, DH, DA, DB, BLOCK_DB)
    dt = x_ptr.dtype.element_ty
    SPLIT: tl.constexpr = dt != tl.float32
    PREC: tl.constexpr = "ieee" if dt == tl.float32 else "tf32"  # (tf32: ignored for 16-bit operands)
    bi = tl.arange(0, BLOCK_B)
    slot_ok = bi < B
    slot_rows = bi.to(tl.int64)[:, None] * N * D  # [BLOCK_B, 1]
    # Site s_top + i's dz * r for slot j = j0 + b goes to row s_top + i - block * j of slot j's (H, S_j, N)
    # block, which starts after the blocks of slots 0 .. j - 1 (``column.dzr_rows``).
    j = j0 + bi
    before = j * n_sites - block * j * (j - 1) // 2
    dzr_row = before.to(tl.int64) * H + head * (n_sites - block * j) + s_top - block * j  # [BLOCK_B]
    si = tl.arange(0, BLOCK_S)
    if ONE_TILE:
        tiles = 1
        g_off = site_offsets(gtab_ptr, si, S, N * D, TABLE)
        q_ok = (si < S)[:, None]
        q_hi_a, q_lo_a = split(tl.load(qg_ptr + si[:, None] * D + col_a, mask=q_ok, other=0.0), dt)
        q_hi_b, q_lo_b = q_hi_a, q_lo_a
        if HAS_B:
            q_hi_b, q_lo_b = split(tl.load(qg_ptr + si[:, None] * D + col_b, mask=q_ok & b_ok, other=0.0), dt)
    else:
        tiles = tl.cdiv(S, BLOCK_S)
    if HOLD > 1:  # (ONE_TILE only) a token's [slots, sites] dz * r waits in [slots, sites, HOLD] for the rest
        hold_at = tl.arange(0, HOLD)[None, None, :]
        held = tl.zeros([BLOCK_B, BLOCK_S, HOLD], tl.float32)
        held_rows = (dzr_row[:, None, None] + si[None, :, None]) * N
        held_ok = slot_ok[:, None, None] & (si < S)[None, :, None]
    acc_a = tl.zeros([BLOCK_B, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_B, BLOCK_DB], tl.float32)
    dr = tl.zeros([BLOCK_B], tl.float32)
    for it in tl.range(0, tokens_per_program * tiles, num_stages=STAGES):
        t = it // tiles
        tile = it - t * tiles
        tok = first_tok + t
        row = tl.minimum(tok, N - 1)  # past the last token: recompute it, store nothing
        x_a = tl.load(x_ptr + slot_rows + row * D + col_a, mask=slot_ok[:, None], other=0.0)  # [BLOCK_B, DA]
        r = tl.load(rms_ptr + bi * N + row, mask=slot_ok, other=0.0)[:, None]  # [BLOCK_B, 1]
        s = tile * BLOCK_S + si  # [BLOCK_S] sites, from s_top
        s_ok = s < S
        if not ONE_TILE:
            g_off = site_offsets(gtab_ptr, s, S, N * D, TABLE)
        g_rows = g_off[:, None] + row * D
        g_a = tl.load(g_ptr + g_rows + col_a, mask=s_ok[:, None], other=0.0)  # [BLOCK_S, DA]
        if not ONE_TILE:
            q_hi_a, q_lo_a = split(tl.load(qg_ptr + s[:, None] * D + col_a, mask=s_ok[:, None], other=0.0), dt)
        u = _dot_parts(x_a, x_a, tl.trans(q_hi_a), tl.trans(q_lo_a), tl.zeros([BLOCK_B, BLOCK_S], tl.float32),
                       SPLIT, False, PREC)  # [BLOCK_B, BLOCK_S]
        p = tl.dot(x_a, tl.trans(g_a), input_precision=PREC)
        if HAS_B:
            x_b = tl.load(x_ptr + slot_rows + row * D + col_b, mask=slot_ok[:, None] & b_ok, other=0.0)
            g_b = tl.load(g_ptr + g_rows + col_b, mask=s_ok[:, None] & b_ok, other=0.0)
            if not ONE_TILE:
                q_hi_b, q_lo_b = split(tl.load(qg_ptr + s[:, None] * D + col_b, mask=s_ok[:, None] & b_ok,
                                               other=0.0), dt)
            u = _dot_parts(x_b, x_b, tl.trans(q_hi_b), tl.trans(q_lo_b), u, SPLIT, False, PREC)
            p = tl.dot(x_b, tl.trans(g_b), p, input_precision=PREC)
        stat = s.to(tl.int64) * N * H + row * H + head
        lse = tl.load(lse_ptr + stat, mask=s_ok, other=float("inf"))[None, :]  # padded sites: weight 0
        delta = tl.load(delta_ptr + stat, mask=s_ok, other=0.0)[None, :]
        a = tl.where(slot_ok[:, None], ptx.exp(u * r - lse, PTX), 0.0)  # [BLOCK_B, BLOCK_S]
        dz = a * (p - delta)
        rdz = dz * r
        # A token's first tile starts its sums afresh.
        keep = tl.where(tile == 0, 0.0, 1.0)
        dr = dr * keep + tl.sum(dz * u, axis=1)
        a_hi, a_lo = split(a, dt)
        rdz_hi, rdz_lo = split(rdz, dt)
        acc_a = _dot_parts(a_hi, a_lo, g_a, g_a, acc_a * keep, False, SPLIT, PREC)
        acc_a = _dot_parts(rdz_hi, rdz_lo, q_hi_a, q_lo_a, acc_a, SPLIT, SPLIT, PREC)
        if HAS_B:
            acc_b = _dot_parts(a_hi, a_lo, g_b, g_b, acc_b * keep, False, SPLIT, PREC)
            acc_b = _dot_parts(rdz_hi, rdz_lo, q_hi_b, q_lo_b, acc_b, SPLIT, SPLIT, PREC)
        if HOLD > 1:
            k = t % HOLD
            held = tl.where(hold_at == k, rdz[:, :, None], held)
            if k == HOLD - 1:  # tokens_per_program is a multiple of HOLD
                toks = tl.max_contiguous(tl.multiple_of(first_tok + (t - k) + hold_at, [1, 1, HOLD]), [1, 1, HOLD])
                tl.store(dzr_ptr + held_rows + toks, held, mask=held_ok & (toks < N))
        else:
            s_live = s_ok & (s * 0 + tok < N)
            tl.store(dzr_ptr + (dzr_row[:, None] + s[None, :]) * N + tok, rdz, mask=slot_ok[:, None] & s_live[None, :])
        if (tile == tiles - 1) & (tok < N):
            out = acc_ptr + slot_rows + tok * D
            tl.store(out + col_a, acc_a, mask=slot_ok[:, None])
            if HAS_B:
                tl.store(out + col_b, acc_b, mask=slot_ok[:, None] & b_ok)
            tl.store(dr_ptr + bi.to(tl.int64) * N * H + tok * H + head, dr, mask=slot_ok)


# Launch configuration by model width: tokens a program, warps, pipeline stages, sites a tile at most (a
# tile is the next power of two >= S, at least 16, up to that), and HOLD, the tokens whose dz * r a
# program stores together where the sites fit one tile (optional: 1, each token alone). Measured on the
# H200 (a step's column passes, benchmarks/bench_kernels.py, call N2): d = 1024 4.78 ms with
# (16, 4, 2, 64, 4), 4.84-5.24 with seven others (5.05 with (8, 4, 2, 64), none held); d = 1280 10.66 ms with
# (16, 4, 3, 64, 4), 10.82-12.24 with seven others (11.40 with (16, 4, 3, 64)). Other widths take the
# nearest; GROUP_CONFIG, when set (benchmarks, tests), overrides the table.
GROUP_CONFIGS = {1024: (16, 4, 2, 64, 4), 1280: (16, 4, 3, 64, 4)}
GROUP_CONFIG: tuple[int, ...] | None = None
_INTERPRETER_CONFIG = (4, 1, 1, 16, 2)  # four tokens a program, two held, tiles of 16: tests walk every loop


def unpack_config(config: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """A launch configuration as (tokens, warps, stages, most sites a tile, HOLD), HOLD 1 where it has none."""
    tokens, warps, stages, max_s = config[:4]
    hold = config[4] if len(config) > 4 else 1
    if hold & (hold - 1) or tokens % hold:
        raise ValueError(f"a group pass holds a power of two of tokens that divides its tokens a program: {config}")
    return tokens, warps, stages, max_s, hold


# The widest head a group pass takes: compiled for sm_90 at 160 channels (128 + 32, paper1b) its one-tile
# form holds 255 registers without spilling; at 256 it spills and needs 225 KiB of shared memory a program
# (benchmarks/kernel_resources.py), and AttnRes's one head of d channels would not fit at all.
MAX_HEAD_WIDTH = 160


def group_fits(d: int, num_heads: int) -> bool:
    """Whether a group pass can run at width ``d`` with ``num_heads`` heads: blocks wide enough for
    ``tl.dot``, heads at most MAX_HEAD_WIDTH wide."""
    meta = head_meta(d, num_heads, has_b=True)
    return products_fit(meta) and meta["DH"] <= MAX_HEAD_WIDTH


def group_pass(sources: Tensor, rms: Tensor, grad_out: Tensor | GradRows, lse: Tensor, delta: Tensor, qg: Tensor,
               num_heads: int, slots: range, sites: range, n_sites: int, block: int, dzr: Tensor,
               acc: Tensor, dr: Tensor) -> None:
    """Sites ``sites``' share of the gradients of slots ``slots`` (each read by all of them), left in the
    carries ``acc`` (>= B, N, d) and ``dr`` (>= B, N, H) fp32, the group's b-th slot in row b.

    ``sources`` (slots, N, d) and ``rms`` (slots, N) are the step's buffer and statistics, ``grad_out``
    ((n_sites, N, d) or ``GradRows``), ``lse`` and ``delta`` (n_sites, N, H), ``qg`` (n_sites, d) every site's;
    ``dzr`` the step's flat ``dz * r`` (``column.dzr_rows``), where slot j is read by sites ``block * j`` ..
    ``n_sites - 1``, and where this pass writes its (site, slot) rows."""
    B, S = len(slots), len(sites)
    _, N, d = sources.shape
    if not 0 < B <= MAX_GROUP or S == 0 or block * (slots.stop - 1) > sites.start or sites.stop != n_sites:
        raise ValueError(f"a group pass takes 1..{MAX_GROUP} slots read by all of its sites, up to the last: "
                         f"slots {slots}, sites {sites} of {n_sites}, block {block}")
    if N == 0:
        return
    grads = grad_out if isinstance(grad_out, GradRows) else GradRows.stacked(grad_out)
    meta = head_meta(d, num_heads, has_b=True)
    if not group_fits(d, num_heads):
        raise ValueError(f"a group pass needs heads 16 to {MAX_HEAD_WIDTH} channels wide, in blocks of at least "
                         f"16: d = {d}, H = {num_heads}")
    cpu = sources.device.type == "cpu"
    if cpu:
        config = _INTERPRETER_CONFIG
    elif GROUP_CONFIG is not None:
        config = GROUP_CONFIG
    else:
        config = GROUP_CONFIGS[min(GROUP_CONFIGS, key=lambda w: (abs(w - d), w))]
    tokens, warps, stages, max_s, hold = unpack_config(config)
    block_s = min(max_s, max(16, triton.next_power_of_2(S)))
    one_tile = S <= block_s
    g_base, g_table, table = grads.sites(sites.start).kernel_args()
    meta.update(BLOCK_B=MAX_GROUP, BLOCK_S=block_s, STAGES=stages, ONE_TILE=one_tile, HOLD=hold if one_tile else 1,
                PTX=ptx.use_ptx(sources.device), TABLE=table)
    if not cpu:
        meta["num_warps"] = warps
    s0, j0 = sites.start, slots.start
    launch(_column_group_kernel, (triton.cdiv(N, tokens), num_heads),
           (sources[j0], rms[j0], g_base, g_table, lse[s0], delta[s0], qg[s0], acc, dr, dzr,
            N, B, S, j0, n_sites, s0, block, tokens), meta, sources.device)
