"""The sites' query gradients from every slot's ``dz * r`` at once (``query_grads``, ``_dqg_kernel``):
``dqg[s, c] = sum_n dzr[h(c), s, n] * x[n, c]``, a matrix product over tokens per head, on tensor cores (bf16
sources: ``dzr`` split into two bf16 parts) or in fp32, run once a step when the last slot's gradient is done."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..launch import device_index, head_meta, launch, num_sms, products_fit
from . import config


@triton.jit(do_not_specialize=["N", "n_sites", "n_slots", "K", "chunk"])
def _dqg_kernel(
    dzr_ptr, x_ptr, part_ptr, N, n_sites, n_slots, K, chunk,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, HAS_B: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, SPLIT_BF16: tl.constexpr,
):
    # Program (channel block, site block, token chunk): the query gradients of its sites on one block of a
    # head's channels, summed over every slot and the chunk's tokens, to part[chunk]. Slot j is read by
    # sites K j .. n_sites - 1 (S_j of them); its dz * r, (H, S_j, N), follows those of the slots before it
    # in ``dzr``. One loop walks (slot, token block) pairs, so that the pipeline runs across slots. A head
    # is one block (its DA channels and, with HAS_B, its rest: each block of dz * r loaded once for both)
    # or, when wide, BLOCKS blocks of DA channels.
    h = tl.program_id(0) // BLOCKS
    c0 = h * DH + (tl.program_id(0) % BLOCKS) * DA  # the block's first channel
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] sites
    s_ok = s < n_sites
    t0 = tl.program_id(2) * chunk
    t1 = tl.minimum(t0 + chunk, N)
    ja = tl.arange(0, DA)
    jb = tl.arange(0, BLOCK_DB)
    b_ok = jb < DB
    acc_a = tl.zeros([BLOCK_S, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_S, BLOCK_DB], tl.float32)  # (a placeholder without HAS_B)
    # slots that some site of the block reads: j <= (last site) / K
    slots = tl.minimum(n_slots, (tl.program_id(1) * BLOCK_S + BLOCK_S - 1) // K + 1)
    blocks = tl.cdiv(t1 - t0, BLOCK_K)
    for i in range(0, slots * blocks):
        j = i // blocks
        n = t0 + (i - j * blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = n < t1
        first = K * j
        before = j * n_sites - K * j * (j - 1) // 2  # sites read by slots 0 .. j - 1
        row = s - first  # the site's row in slot j's block; negative: the site does not read slot j
        block = (before.to(tl.int64) * H + h * (n_sites - first)) * N
        a = tl.load(dzr_ptr + block + row.to(tl.int64)[:, None] * N + n[None, :],
                    mask=(s_ok & (row >= 0))[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_K]
        x_rows = x_ptr + j.to(tl.int64) * N * D + n.to(tl.int64)[:, None] * D + c0
        xa = tl.load(x_rows + ja[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_K, DA]
        xb = xa
        if HAS_B:
            xb = tl.load(x_rows + DA + jb[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        if USE_DOT:
            if SPLIT_BF16:
                a_hi = a.to(tl.bfloat16)
                a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
                acc_a = tl.dot(a_lo, xa, tl.dot(a_hi, xa, acc_a))
                if HAS_B:
                    acc_b = tl.dot(a_lo, xb, tl.dot(a_hi, xb, acc_b))
            else:
                acc_a = tl.dot(a, xa.to(tl.float32), acc_a, input_precision="ieee")
                if HAS_B:
                    acc_b = tl.dot(a, xb.to(tl.float32), acc_b, input_precision="ieee")
        else:
            acc_a += tl.sum(a[:, :, None] * xa.to(tl.float32)[None, :, :], axis=1)
            if HAS_B:
                acc_b += tl.sum(a[:, :, None] * xb.to(tl.float32)[None, :, :], axis=1)
    out = part_ptr + tl.program_id(2).to(tl.int64) * n_sites * D + s.to(tl.int64)[:, None] * D + c0
    tl.store(out + ja[None, :], acc_a, mask=s_ok[:, None])
    if HAS_B:
        tl.store(out + DA + jb[None, :], acc_b, mask=s_ok[:, None] & b_ok[None, :])


def query_grads(dzr: Tensor, sources: Tensor, num_heads: int, n_sites: int, block: int) -> Tensor:
    """The sites' ``qg`` gradients (n_sites, d) fp32 from every slot at once: ``sources`` (slots, N, d)
    and, for each slot j in turn (read by sites ``block * j`` .. ``n_sites - 1``), its ``dz * r`` (H, S_j, N)
    packed one after the other in ``dzr`` (``dzr_rows``)."""
    n_slots, N, d = sources.shape
    if N == 0 or n_slots == 0:
        return torch.zeros((n_sites, d), dtype=torch.float32, device=sources.device)
    meta = {**head_meta(d, num_heads, has_b=True), "BLOCKS": 1}
    if meta["DA"] > 128 or not products_fit(meta):
        # a wide head (AttnRes: one head of d channels), or one with a part narrower than a matrix
        # product: blocks of the largest power of two dividing its width, at most 128
        width = d // num_heads
        meta.update(DA=min(128, width & -width), DB=0, BLOCK_DB=1, HAS_B=False)
        meta["BLOCKS"] = width // meta["DA"]
    use_dot = products_fit(meta)
    sites = max(16, triton.next_power_of_2(n_sites))
    if sources.device.type == "cpu":  # interpreter: two chunks, so that tests cover their sum
        block_s, block_k, chunks, options = min(sites, 64), 16, 2, {}
    else:
        max_s, block_k, warps, stages, per_sm = config.QUERY_GRAD_CONFIG
        block_s = min(sites, max_s)
        if not use_dot:  # elementwise products [sites, tokens, channels]: small blocks
            block_s, block_k = 16, 16
        programs = num_heads * meta["BLOCKS"] * triton.cdiv(n_sites, block_s)
        chunks = triton.cdiv(per_sm * num_sms(device_index(sources.device)), programs)
        options = {"num_warps": warps, "num_stages": stages}
    chunk = triton.cdiv(triton.cdiv(N, chunks), block_k) * block_k  # tokens a chunk, whole blocks
    chunks = triton.cdiv(N, chunk)
    part = torch.empty((chunks, n_sites, d), dtype=torch.float32, device=sources.device)
    meta.update(BLOCK_S=block_s, BLOCK_K=block_k, USE_DOT=use_dot, SPLIT_BF16=sources.dtype == torch.bfloat16,
                **options)
    grid = (num_heads * meta["BLOCKS"], triton.cdiv(n_sites, block_s), chunks)
    launch(_dqg_kernel, grid, (dzr, sources, part, N, n_sites, n_slots, block, chunk), meta, sources.device)
    return part.sum(0)
