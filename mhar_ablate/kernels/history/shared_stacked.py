"""The shared pass as matrix products over several tokens' sources at once (``_history_fwd_stacked_kernel``),
where S is small: a tile's rows are T tokens' sources, so that a pass over a few sources fills the products
(``stacked_tile``), taken by ``history_forward`` where ``config.HISTORY_STACKED_CONFIG`` is set and the pass
fits (``stacked_fits``)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from ..launch import launch, products_fit
from ..products import head_columns, query_operand, split, sum_halves
from . import config
from .common import _block_g


# The matrix products' form for few sources: the rows of one tile are several tokens' sources (T tokens of
# SP >= S rows each, T SP = 16 or 32 rows: ``stacked_tile``), so that a pass over a few sources fills the
# products that ``_history_fwd_dot_kernel`` would pad to 16 sources a token. Scores Z [sites, (t, s)] = Q X^T
# as there; each (site, token) takes the softmax over its own SP columns, and the outputs of a tile's T
# tokens are one product of a block-diagonal weight matrix W [(t, k), (t', s)] = [t = t'] p_k(t', s) with
# the tile's rows, [(t, k), head]: its accumulator holds T BLOCK_G rows, not twice HALF per token. The
# weights' fp32 goes in two products (hi, then lo, into one accumulator). A program (one warp) walks
# consecutive tiles of its head, the next tiles' rows copied into shared memory while one is reduced.
@triton.jit(do_not_specialize=["N", "S", "G", "tiles_per_program"])
def _history_fwd_stacked_kernel(
    src_ptr, rms_ptr, qg_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, tiles_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, SP: tl.constexpr, T: tl.constexpr,
    STAGES: tl.constexpr, PTX: tl.constexpr,
):
    head = tl.program_id(1)
    first_tile = tl.program_id(0).to(tl.int64) * tiles_per_program
    _, _, col_a, col_b, b_ok = head_columns(head, DH, DA, DB, BLOCK_DB)
    dt = src_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if dt == tl.float32 else "tf32"  # (tf32: ignored for 16-bit operands)
    q_a, q_b = query_operand(qg_ptr, G, D, BLOCK_G, col_a, col_b, b_ok, BLOCK_DB, HAS_B, dt)  # [2 BLOCK_G, .]
    # A tile's rows: token t = r // SP, source s = r % SP; their offsets in the first tile (a tile's are these
    # plus its first token's row).
    r = tl.arange(0, T * SP)
    r_tok = r // SP
    r_src = r % SP
    src_ok = r_src < S
    x_rows = src_ptr + (r_src.to(tl.int64) * stride_s + r_tok * D)[:, None]
    rms_rows = rms_ptr + r_src.to(tl.int64) * N + r_tok
    # The outputs' rows: token j // BLOCK_G, site j % BLOCK_G (site 0's in out0, the others' in rest).
    j = tl.arange(0, T * BLOCK_G)
    j_tok = j // BLOCK_G
    j_site = j % BLOCK_G
    out_rows = tl.where(j_site == 0, out0_ptr, rest_ptr + (j_site.to(tl.int64) - 1) * N * D) + j_tok * D
    lse_rows = lse_ptr + j_site.to(tl.int64) * N * H + j_tok * H + head
    live = j_site < G
    same = tl.arange(0, T)[:, None, None, None] == tl.arange(0, T)[None, None, :, None]  # [T, 1, T, 1]
    for it in tl.range(0, tiles_per_program, num_stages=STAGES):
        # The last tile ends at the last token (N >= T), so that no load needs a token mask; it stores only the
        # tokens from where it would have started (the tile before, perhaps another program's, stores the
        # others: its products sum them in another order), and tiles past it store nothing.
        start = (first_tile + it) * T
        tok0 = tl.minimum(start, N - T)
        x_a = tl.load(x_rows + tok0 * D + col_a, mask=src_ok[:, None], other=0.0)  # [T SP, DA]
        u = tl.dot(q_a, tl.trans(x_a), input_precision=PREC)  # [2 BLOCK_G, T SP]
        x_b = x_a
        if HAS_B:
            x_b = tl.load(x_rows + tok0 * D + col_b, mask=src_ok[:, None] & b_ok, other=0.0)
            u = tl.dot(q_b, tl.trans(x_b), u, input_precision=PREC)
        rs = tl.load(rms_rows + tok0, mask=src_ok, other=0.0)
        z = tl.where(src_ok[None, :], sum_halves(u) * rs[None, :], float("-inf"))  # [BLOCK_G, T SP]
        z = tl.reshape(z, [BLOCK_G, T, SP])
        m = tl.max(z, axis=2)  # (finite: a token has at least one source)
        p = ptx.exp(z - m[:, :, None], PTX)  # [BLOCK_G, T, SP]
        l = tl.sum(p, axis=2)  # [BLOCK_G, T]
        w = tl.reshape(tl.where(same, p[None, :, :, :], 0.0), [T * BLOCK_G, T * SP])
        w_hi, w_lo = split(w, dt)
        acc_a = tl.dot(w_hi, x_a, input_precision=PREC)  # [T BLOCK_G, DA]
        acc_a = tl.dot(w_lo, x_a, acc_a, input_precision=PREC)
        inv_l = tl.reshape(tl.trans(1.0 / l), [T * BLOCK_G])[:, None]
        at = out_rows + tok0 * D
        own = live & (tok0 + j_tok >= start)
        tl.store(at[:, None] + col_a, (acc_a * inv_l).to(out0_ptr.dtype.element_ty), mask=own[:, None])
        if HAS_B:
            acc_b = tl.dot(w_hi, x_b, input_precision=PREC)
            acc_b = tl.dot(w_lo, x_b, acc_b, input_precision=PREC)
            tl.store(at[:, None] + col_b, (acc_b * inv_l).to(out0_ptr.dtype.element_ty), mask=own[:, None] & b_ok)
        lse = tl.reshape(tl.trans(m + tl.log(l)), [T * BLOCK_G])
        tl.store(lse_rows + tok0 * H, lse, mask=own)


def stacked_tile(S: int, block_g: int, rows: int) -> tuple[int, int]:
    """The stacked form's tile of ``rows`` rows for S sources and ``block_g`` (padded) sites: tokens T and rows a
    token SP, T SP = rows, SP >= S, T block_g <= 16 accumulator rows."""
    tokens = max(1, min(16 // block_g, rows // triton.next_power_of_2(max(S, 1))))
    return tokens, rows // tokens


def stacked_fits(S: int, N: int, block_g: int, meta: dict) -> bool:
    """Whether a pass over S sources, N tokens and ``block_g`` sites takes the stacked products' form."""
    if config.HISTORY_STACKED_CONFIG is None or not products_fit(meta) or block_g > 16:
        return False
    rows = config.HISTORY_STACKED_CONFIG[3]
    return 1 <= S <= rows // 2 and N >= stacked_tile(S, block_g, rows)[0]


def _history_stacked_forward(sources: Tensor, rms: Tensor, qg: Tensor, meta: dict, out: Tensor, rest: Tensor,
                             lse: Tensor) -> None:
    S, N, d = sources.shape
    G = qg.shape[0]
    block_g = _block_g(G)
    per_program, warps, stages, rows = config.HISTORY_STACKED_CONFIG
    tokens, per_token = stacked_tile(S, block_g, rows)
    if sources.device.type == "cpu":
        tiles_per_program, stages = config._INTERPRETER_STACKED_TILES, 1
    else:
        tiles_per_program = max(1, per_program // tokens)
        meta["num_warps"] = warps
    meta.update(BLOCK_G=block_g, T=tokens, SP=per_token, STAGES=stages, PTX=ptx.use_ptx(sources.device))
    programs = triton.cdiv(triton.cdiv(N, tokens), tiles_per_program)
    launch(_history_fwd_stacked_kernel, (programs, meta["H"]),
           (sources, rms, qg, out, rest, lse, N, S, G, N * d, tiles_per_program), meta, sources.device)
