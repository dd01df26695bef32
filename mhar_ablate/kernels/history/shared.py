"""The shared pass of G > 1 sites over one history, one routing head a program (``history_forward``): the form
it takes for a pass, and its reductions' form (``_history_fwd_kernel``: token tiles, every product a sum
across lanes), taken for fewer sources than ``config.HISTORY_DOT_MIN_S`` or heads too narrow for
``tl.dot`` where the stacked form does not fit. The matrix products' forms are ``shared_dot`` and
``shared_stacked``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import ptx
from ..launch import by_width, head_meta, launch, persistent_programs, products_fit
from . import config
from .common import _block_g
from .shared_dot import _history_dot_forward
from .shared_stacked import _history_stacked_forward, stacked_fits


@triton.jit
def _scored_source(src, rms, ok, offs_a, offs_b, b_ok, qg_a, qg_b, HAS_B: tl.constexpr):
    """One source for a tile of tokens: its [BLOCK_N, 1, .] blocks in fp32 and its scores z [BLOCK_N,
    BLOCK_G] for the program's sites, -inf where ``ok`` [BLOCK_N] is false (no such source, or past the
    last token)."""
    xa = tl.load(src + offs_a, mask=ok[:, None, None], other=0.0).to(tl.float32)
    z = tl.sum(xa * qg_a, axis=2)
    xb = xa
    if HAS_B:
        xb = tl.load(src + offs_b, mask=ok[:, None, None] & b_ok, other=0.0).to(tl.float32)
        z += tl.sum(xb * qg_b, axis=2)
    r = tl.load(rms, mask=ok, other=1.0)[:, None]
    return xa, xb, tl.where(ok[:, None], z * r, float("-inf"))


# The head-tiled pass's reductions' form (passes over few sources, heads too narrow for ``tl.dot``; the
# matrix products' form is ``_history_fwd_dot_kernel``). A tile is [BLOCK_N tokens, BLOCK_G sites, channels
# of one head]; a source is [BLOCK_N, 1, .] and broadcasts over the sites. Programs are persistent, each
# walking ``tiles_per_program`` consecutive token tiles of its head: the sites' query rows are loaded once a
# program, not once a tile (at few sources they were as many bytes as the sources), and the loop runs over
# (tile, SOURCES sources) pairs, so that the pipeline (``tl.range``: iteration i + STAGES - 1's sources are
# copied into shared memory while iteration i's are reduced) carries on from one tile into the next; a
# tile's first iteration starts the softmax afresh and its last stores the outputs. Its time follows the
# instructions it issues more than its bytes in flight (Nsight: "not selected" the largest stall), so an
# iteration takes SOURCES sources (2 or 4): the accumulators are rescaled once for all of them.
@triton.jit(do_not_specialize=["N", "S", "G", "tiles_per_program"])
def _history_fwd_kernel(
    src_ptr, rms_ptr, qg_ptr, out0_ptr, rest_ptr, lse_ptr,
    N, S, G, stride_s, tiles_per_program,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, SOURCES: tl.constexpr, PTX: tl.constexpr,
):
    head = tl.program_id(1)
    first_tile = tl.program_id(0).to(tl.int64) * tiles_per_program
    tn = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_G)[None, :, None]
    ja = tl.arange(0, DA)[None, None, :]
    jb = tl.arange(0, BLOCK_DB)[None, None, :]
    col_a = head * DH + ja
    col_b = head * DH + DA + jb
    b_ok = jb < DB
    k_ok = k < G
    qg_a = tl.load(qg_ptr + k * D + col_a, mask=k_ok, other=0.0)  # [1, BLOCK_G, DA]
    qg_b = qg_a
    if HAS_B:
        qg_b = tl.load(qg_ptr + k * D + col_b, mask=k_ok & b_ok, other=0.0)
    rest_offs = (k.to(tl.int64) - 1) * N * D
    kg = tl.arange(0, BLOCK_G)[None, :]

    m = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    acc_a = tl.zeros([BLOCK_N, BLOCK_G, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_DB], tl.float32)  # (a placeholder without HAS_B)
    stride = tl.cast(stride_s, tl.int64)  # SOURCES * stride_s may pass 2^31
    chunks = tl.cdiv(S, SOURCES)
    for it in tl.range(0, tiles_per_program * chunks, num_stages=STAGES):
        t = it // chunks
        j = it - t * chunks
        s0 = j * SOURCES
        n = (first_tile + t) * BLOCK_N + tn  # [BLOCK_N]; past the last token: loads masked, nothing stored
        n_ok = n < N
        nn = n[:, None, None]
        offs_a = nn * D + col_a  # [BLOCK_N, 1, DA]
        offs_b = nn * D + col_b
        src = src_ptr + s0 * stride
        rms = rms_ptr + s0.to(tl.int64) * N + n
        # Source s0 + i exists for the tile's tokens below a limit that is 0 when it does not (a tensor
        # mask: it works the same in the compiler and the interpreter).
        x1a, x1b, z1 = _scored_source(src, rms, n_ok, offs_a, offs_b, b_ok, qg_a, qg_b, HAS_B)
        x2a, x2b, z2 = _scored_source(src + stride, rms + N, n < tl.where(s0 + 1 < S, N, 0), offs_a, offs_b,
                                      b_ok, qg_a, qg_b, HAS_B)
        # A tile's first iteration starts afresh: exp(-inf) = 0 clears the sums carried from the tile before.
        m = tl.where(j == 0, float("-inf"), m)
        m_new = tl.maximum(m, tl.maximum(z1, z2))
        if SOURCES == 4:
            x3a, x3b, z3 = _scored_source(src + 2 * stride, rms + 2 * N, n < tl.where(s0 + 2 < S, N, 0), offs_a,
                                          offs_b, b_ok, qg_a, qg_b, HAS_B)
            x4a, x4b, z4 = _scored_source(src + 3 * stride, rms + 3 * N, n < tl.where(s0 + 3 < S, N, 0), offs_a,
                                          offs_b, b_ok, qg_a, qg_b, HAS_B)
            m_new = tl.maximum(m_new, tl.maximum(z3, z4))
        # A padded token's scores are all -inf: its m stays -inf and exp(m - m_new) would be NaN.
        m_new = tl.where(n_ok[:, None], m_new, 0.0)
        alpha = ptx.exp(m - m_new, PTX)
        p1 = ptx.exp(z1 - m_new, PTX)
        p2 = ptx.exp(z2 - m_new, PTX)
        l = l * alpha + p1 + p2
        acc_a = acc_a * alpha[:, :, None] + p1[:, :, None] * x1a + p2[:, :, None] * x2a
        if HAS_B:
            acc_b = acc_b * alpha[:, :, None] + p1[:, :, None] * x1b + p2[:, :, None] * x2b
        if SOURCES == 4:
            p3 = ptx.exp(z3 - m_new, PTX)
            p4 = ptx.exp(z4 - m_new, PTX)
            l += p3 + p4
            # one fused multiply-add a term (written as a sum of products, the compiler would not chain them)
            acc_a = acc_a + p3[:, :, None] * x3a
            acc_a = acc_a + p4[:, :, None] * x4a
            if HAS_B:
                acc_b = acc_b + p3[:, :, None] * x3b
                acc_b = acc_b + p4[:, :, None] * x4b
        m = m_new
        if j == chunks - 1:
            inv_l = 1.0 / l[:, :, None]
            row_ok = n_ok[:, None, None]
            out_a = (acc_a * inv_l).to(out0_ptr.dtype.element_ty)
            tl.store(out0_ptr + offs_a + k * 0, out_a, mask=row_ok & (k == 0))
            tl.store(rest_ptr + rest_offs + offs_a, out_a, mask=row_ok & (k > 0) & k_ok)
            if HAS_B:
                out_b = (acc_b * inv_l).to(out0_ptr.dtype.element_ty)
                tl.store(out0_ptr + offs_b + k * 0, out_b, mask=row_ok & (k == 0) & b_ok)
                tl.store(rest_ptr + rest_offs + offs_b, out_b, mask=row_ok & (k > 0) & k_ok & b_ok)
            kn = kg * N * H + n[:, None] * H + head  # [BLOCK_N, BLOCK_G]
            tl.store(lse_ptr + kn, m + tl.log(l), mask=n_ok[:, None] & (kg < G))


def _history_config(kind: str, block_g: int, device: torch.device) -> tuple[int, dict]:
    if device.type == "cpu":
        block_n, _, stages, sources = config._INTERPRETER_CONFIG
        return block_n, {"STAGES": stages, "SOURCES": sources}
    block_n, warps, stages, sources = config.HISTORY_CONFIG[kind].get(block_g, config.HISTORY_CONFIG[kind][16])
    return block_n, {"num_warps": warps, "STAGES": stages, "SOURCES": sources}


def history_forward(sources: Tensor, rms: Tensor, qg: Tensor, num_heads: int, out: Tensor, rest: Tensor,
                    lse: Tensor) -> None:
    """``sites_forward`` for G > 1 sites, tiled by head: reads the sources' RMS from ``rms`` (S, N)."""
    S, N, d = sources.shape
    G = qg.shape[0]
    if N == 0:
        return
    block_g = _block_g(G)
    meta = head_meta(d, num_heads, has_b=True)
    if stacked_fits(S, N, block_g, meta):
        _history_stacked_forward(sources, rms, qg, meta, out, rest, lse)
        return
    if config.HISTORY_DOT_CONFIG is not None and products_fit(meta) \
            and S >= max(1, config.HISTORY_DOT_MIN_S[meta["HAS_B"]]):
        _history_dot_forward(sources, rms, qg, meta, out, rest, lse)
        return
    block_n, options = _history_config("fwd_split" if meta["HAS_B"] else "fwd", block_g, sources.device)
    meta.update(BLOCK_G=block_g, BLOCK_N=block_n, PTX=ptx.use_ptx(sources.device), **options)
    tiles = triton.cdiv(N, block_n)
    args = [sources, rms, qg, out, rest, lse, N, S, G, N * d, 1]
    if sources.device.type == "cpu":  # a few programs, so that tests walk a program's tiles and an idle tail
        programs = min(tiles, 3)
    elif (per_program := config.HISTORY_TILES if config.HISTORY_TILES is not None
            else by_width(config.HISTORY_TILES_BY_WIDTH, d)):
        programs = triton.cdiv(tiles, per_program)
    else:  # as many as fit on the GPU at once, shared among the heads
        programs = max(1, persistent_programs(_history_fwd_kernel, args, meta, sources.device, tiles * num_heads)
                       // num_heads)
    args[-1] = triton.cdiv(tiles, programs)
    launch(_history_fwd_kernel, (programs, num_heads), tuple(args), meta, sources.device)
