"""The shared pass as matrix products, one token at a time (``_history_fwd_dot_kernel``): G sites over a
token's S sources as a small attention whose two products run on tensor cores, taken by ``history_forward``
from ``config.HISTORY_DOT_MIN_S`` sources on, heads wide enough for ``tl.dot``."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from ..launch import launch
from ..products import head_columns, query_operand, split, stack_halves, sum_halves
from . import config
from .common import _block_g


# The shared pass as matrix products. For one token and one head, G sites over S sources is a small
# attention: scores Z [G, S] = Q [G, head] X^T [head, S] (Q the sites' query rows, X the sources' rows)
# and outputs O [G, head] = softmax_S(Z r) X. A program walks its tokens and, for each, the sources in
# tiles of BLOCK_S rows (one tile when S <= BLOCK_S: ONE_TILE, no running softmax state), both products
# on tensor cores; the loop runs over (token, tile) pairs, so that the pipeline copies the next token's
# tiles while this one is reduced, and a token's last tile normalises and stores its outputs.
# An fp32 operand (the query rows, the weights) is split into hi + lo parts of the sources' dtype, so
# that the products carry about 16 bits of it (a weight rounded to bf16 alone moves an output by up to
# 2^-9 of a term). The two parts are the two halves of one product's rows, [hi of the HALF sites; lo of
# them], so that one product does both and the halves are summed inside each thread (``sum_halves``).
# fp32 sources take fp32 products, with lo = 0.
@triton.jit(do_not_specialize=["N", "S", "G", "tokens_per_program"])
def _history_fwd_dot_kernel(
    src_ptr, rms_ptr, qg_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, tokens_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr, ONE_TILE: tl.constexpr, PTX: tl.constexpr,
):
    head = tl.program_id(1)
    first_tok = tl.program_id(0).to(tl.int64) * tokens_per_program
    k = tl.arange(0, HALF)[:, None]  # [HALF, 1] site
    ja, jb, col_a, col_b, b_ok = head_columns(head, DH, DA, DB, BLOCK_DB)
    dt = src_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if dt == tl.float32 else "tf32"  # (tf32: ignored for 16-bit operands)
    q_a, q_b = query_operand(qg_ptr, G, D, HALF, col_a, col_b, b_ok, BLOCK_DB, HAS_B, dt)  # [2 HALF, .]
    si = tl.arange(0, BLOCK_S)
    if ONE_TILE:
        tiles = 1
    else:
        tiles = tl.cdiv(S, BLOCK_S)
    stride = tl.cast(stride_s, tl.int64)
    m = tl.full([HALF], float("-inf"), tl.float32)
    l = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([2 * HALF, DA], tl.float32)
    acc_b = tl.zeros([2 * HALF, BLOCK_DB], tl.float32)
    for it in tl.range(0, tokens_per_program * tiles, num_stages=STAGES):
        t = it // tiles
        j = it - t * tiles
        tok = first_tok + t
        row = tl.minimum(tok, N - 1) * D  # past the last token: recompute it, store nothing
        s = j * BLOCK_S + si  # [BLOCK_S] sources
        s_ok = s < S
        rows = s.to(tl.int64)[:, None] * stride + row
        x_a = tl.load(src_ptr + rows + col_a, mask=s_ok[:, None], other=0.0)  # [BLOCK_S, DA]
        u = tl.dot(q_a, tl.trans(x_a), input_precision=PREC)  # [2 HALF, BLOCK_S]
        x_b = x_a
        if HAS_B:
            x_b = tl.load(src_ptr + rows + col_b, mask=s_ok[:, None] & b_ok, other=0.0)
            u = tl.dot(q_b, tl.trans(x_b), u, input_precision=PREC)
        r = tl.load(rms_ptr + s.to(tl.int64) * N + row // D, mask=s_ok, other=0.0)
        z = tl.where(s_ok[None, :], sum_halves(u) * r[None, :], float("-inf"))  # [HALF, BLOCK_S]
        if ONE_TILE:
            m = tl.max(z, axis=1)
            p = ptx.exp(z - m[:, None], PTX)
            l = tl.sum(p, axis=1)
            p_hi, p_lo = split(p, dt)
            weights = stack_halves(p_hi, p_lo)
            acc_a = tl.dot(weights, x_a, input_precision=PREC)
            if HAS_B:
                acc_b = tl.dot(weights, x_b, input_precision=PREC)
        else:
            # A token's first tile starts the softmax afresh: exp(-inf) = 0 clears the accumulators.
            m = tl.where(j == 0, float("-inf"), m)
            m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: a tile holds at least one source
            alpha = ptx.exp(m - m_new, PTX)[:, None]
            p = ptx.exp(z - m_new[:, None], PTX)
            l = l * tl.reshape(alpha, [HALF]) + tl.sum(p, axis=1)
            alpha = stack_halves(alpha, alpha)  # [2 HALF, 1]
            p_hi, p_lo = split(p, dt)
            weights = stack_halves(p_hi, p_lo)
            acc_a = tl.dot(weights, x_a, acc_a * alpha, input_precision=PREC)
            if HAS_B:
                acc_b = tl.dot(weights, x_b, acc_b * alpha, input_precision=PREC)
            m = m_new
        if (j == tiles - 1) & (tok < N):
            inv_l = (1.0 / l)[:, None]
            at = tok * D
            rest = rest_ptr + (k.to(tl.int64) - 1) * N * D + at
            later = (k > 0) & (k < G)
            out_a = (sum_halves(acc_a) * inv_l).to(out0_ptr.dtype.element_ty)
            tl.store(out0_ptr + at + col_a + k * 0, out_a, mask=(k == 0) & (ja >= 0))
            tl.store(rest + col_a, out_a, mask=later & (ja >= 0))
            if HAS_B:
                out_b = (sum_halves(acc_b) * inv_l).to(out0_ptr.dtype.element_ty)
                tl.store(out0_ptr + at + col_b + k * 0, out_b, mask=(k == 0) & b_ok)
                tl.store(rest + col_b, out_b, mask=later & b_ok)
            kk = tl.arange(0, HALF)
            tl.store(lse_ptr + kk * N * H + tok * H + head, m + tl.log(l), mask=kk < G)


def _history_dot_forward(sources: Tensor, rms: Tensor, qg: Tensor, meta: dict, out: Tensor, rest: Tensor,
                         lse: Tensor) -> None:
    S, N, d = sources.shape
    G = qg.shape[0]
    cpu = sources.device.type == "cpu"
    tokens, warps, stages, max_s = config._INTERPRETER_DOT_CONFIG if cpu else config.HISTORY_DOT_CONFIG
    block_s = min(max_s, max(16, triton.next_power_of_2(S)))
    meta.update(HALF=max(8, _block_g(G)), BLOCK_S=block_s, STAGES=stages, ONE_TILE=S <= block_s,
                PTX=ptx.use_ptx(sources.device))
    if not cpu:
        meta["num_warps"] = warps
    launch(_history_fwd_dot_kernel, (triton.cdiv(N, tokens), meta["H"]),
           (sources, rms, qg, out, rest, lse, N, S, G, N * d, tokens), meta, sources.device)
