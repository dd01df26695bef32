"""The routing kernels on a GPU, in fp32, bf16 and fp16, against the float64 oracle (``kernels/reference.py``):
the routing op (``mhar_triton``), the fused path's kernels (``history``, ``column``), the fused path itself
(``model/residual/fused.py``) and mHC's Sinkhorn-Knopp (``sinkhorn``, fp32), forward and backward, over
awkward shapes: head widths that are not powers of two (12, 10, 160 = 128 + 32 as at ``paper1b``), token
counts that are no multiple of a tile, S = 1 and S past 128, offsets past 2^31 elements, ``block:K``
groupings. Every output the kernels write is poisoned (NaN) first, so that an element they leave unwritten
fails. Skipped without CUDA; on the CPU the interpreter tests (``test_kernel_triton.py``,
``test_history_kernels.py``, ``test_fused_path.py``, ``test_sinkhorn_kernel.py``) cover fp32.

    PYTHONPATH=$PWD python3 -m pytest -q tests/kernels/test_kernels_gpu.py

Tolerances are relative L2 errors against the oracle evaluated on the inputs as rounded to the dtype, so
they measure the kernels' own arithmetic and output rounding. Where the plain reference can run in the same
dtype, the kernel may also be up to twice as far off as it is (its own rounding sets the scale).
"""

from __future__ import annotations

import pytest
import torch

from mhar_ablate.kernels.reference import mhar_route_float64, mhar_route_reference, routing_logsumexp_float64
from mhar_ablate.ops import mhar_route

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU kernel tests need a CUDA device")

DEVICE = "cuda"
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative L2 error allowed against the float64 oracle. Measured on the H200 (2026-12-01): fp32 <= 8e-7,
# bf16 <= 7e-3 (the query gradients: the backward's delta uses the output as stored), fp16 <= 1.2e-3.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Log-sum-exps are fp32 whatever the sources' dtype: only the kernels' fp32 accumulation differs.
LSE_TOL = 5e-5


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if not torch.isfinite(actual).all():
        return float("inf")
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def poison() -> None:
    """Fill the allocator's free blocks with NaN, so that any output element a kernel does not write shows.
    Large tensors come from the large pool, small ones (under 1 MB) from 2 MB segments: both are filled."""
    if torch.device(DEVICE).type != "cuda":
        return
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    big = torch.empty(min(int(free * 0.5), 24 << 30) // 4, device=DEVICE).fill_(float("nan"))
    small = [torch.empty(1 << 17, device=DEVICE).fill_(float("nan")) for _ in range(64)]  # 512 KB each
    torch.cuda.synchronize()
    del big, small


def nan_like(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def randn(gen, *shape, scale=1.0, shift=0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE) * scale + shift


def fwd_bwd(fn, grad_out, *inputs):
    """(output, gradient of every input) of ``fn(*inputs)`` for the output gradient ``grad_out``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


# ----------------------------------------------------------------------------------------------------------
# The routing op, mhar_route(backend="triton")
# ----------------------------------------------------------------------------------------------------------

ROUTE_SHAPES = [  # S, B, T, d, H, sources stored (B, S, T, d) and viewed as (S, B, T, d)
    (1, 1, 1, 64, 1, False),  # one source, one token: query and key gradients exactly zero
    (2, 3, 37, 48, 4, True),  # head width 12 = 8 + 4, odd token count
    (5, 1, 333, 80, 8, False),  # head width 10 = 8 + 2
    (9, 2, 1001, 1024, 8, True),  # paper350m width, tokens no multiple of a tile
    (130, 1, 65, 256, 32, False),  # S past 128, head width 8
    (25, 2, 777, 1280, 8, True),  # paper1b: head width 160 = 128 + 32
    (7, 1, 129, 1024, 1, False),  # AttnRes (H = 1), one head of 1024
    (3, 1, 17, 32, 32, False),  # head width 1
]


def route_inputs(S, B, T, d, H, dtype, seed, strided=False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.linspace(0.5, 2.0, S, device=DEVICE).view(S, 1, 1, 1)  # a depth softmax far from uniform
    sources = (randn(gen, S, B, T, d) * scale + 0.1).to(dtype)
    if strided:
        sources = sources.transpose(0, 1).contiguous().transpose(0, 1)
        assert not sources.is_contiguous()
    query = randn(gen, d, scale=2.0 / (d / 8) ** 0.5)
    key_weight = randn(gen, d, scale=0.5, shift=1.0)
    grad_out = randn(gen, B, T, d).to(dtype)
    return sources, query, key_weight, grad_out


@dtypes
@pytest.mark.parametrize("S,B,T,d,H,strided", ROUTE_SHAPES, ids=lambda v: str(v))
def test_route_matches_float64(dtype, S, B, T, d, H, strided):
    sources, query, key_weight, grad_out = route_inputs(S, B, T, d, H, dtype, seed=S * 1000 + d + H, strided=strided)
    truth = fwd_bwd(lambda s, q, w: mhar_route_float64(s, q, w, H), grad_out.double(),
                    sources.double(), query.double(), key_weight.double())
    same_dtype = fwd_bwd(lambda s, q, w: mhar_route_reference(s, q, w, H), grad_out, sources, query, key_weight)
    poison()
    got = fwd_bwd(lambda s, q, w: mhar_route(s, q, w, H, backend="triton"), grad_out, sources, query, key_weight)
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32, torch.float32]
    names = ("output", "grad sources", "grad query", "grad key_weight")
    for i, (name, g, t, r) in enumerate(zip(names, got, truth, same_dtype)):
        if S == 1 and i >= 2:  # exactly zero: judged on the output gradient's scale
            err = g.abs().max().item() / grad_out.float().abs().max().item()
            assert err <= TOL[dtype], f"{name}: {err:.2e}"
            continue
        err, ref_err = rel_err(g, t), rel_err(r, t)
        assert err <= max(TOL[dtype], 2 * ref_err), f"{name}: {err:.2e} (reference in {dtype_id(dtype)}: {ref_err:.2e})"


def test_route_offsets_past_2_31_elements_and_determinism():
    """S = 73 sources of 32k tokens x 1024 channels (2.4e9 elements) in bf16, against the fp32 reference
    in token chunks; two runs bitwise equal."""
    S, N, d, H = 73, 32768, 1024, 8
    sources, query, key_weight, grad_out = route_inputs(S, 1, N, d, H, torch.bfloat16, seed=7)
    poison()
    got = fwd_bwd(lambda s, q, w: mhar_route(s, q, w, H, backend="triton"), grad_out, sources, query, key_weight)
    sq = {"out": 0.0, "out_ref": 0.0, "ds": 0.0, "ds_ref": 0.0}
    dq_ref, dw_ref = torch.zeros_like(query), torch.zeros_like(key_weight)
    for c in range(0, N, 4096):
        rows = slice(c, c + 4096)
        r_out, r_ds, r_dq, r_dw = fwd_bwd(lambda s, q, w: mhar_route_reference(s, q, w, H), grad_out[:, rows],
                                          sources[:, :, rows], query, key_weight)
        sq["out"] += (got[0][:, rows].double() - r_out.double()).pow(2).sum().item()
        sq["out_ref"] += r_out.double().pow(2).sum().item()
        sq["ds"] += (got[1][:, :, rows].double() - r_ds.double()).pow(2).sum().item()
        sq["ds_ref"] += r_ds.double().pow(2).sum().item()
        dq_ref += r_dq
        dw_ref += r_dw
    errs = {"output": (sq["out"] / sq["out_ref"]) ** 0.5, "grad sources": (sq["ds"] / sq["ds_ref"]) ** 0.5,
            "grad query": rel_err(got[2], dq_ref), "grad key_weight": rel_err(got[3], dw_ref)}
    assert all(e <= TOL[torch.bfloat16] for e in errs.values()), errs
    again = fwd_bwd(lambda s, q, w: mhar_route(s, q, w, H, backend="triton"), grad_out, sources, query, key_weight)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_route_compiles_without_graph_break_and_matches_eager():
    """torch.compile (inductor, fullgraph=True) over a function calling the op: bitwise the eager result."""
    sources, query, key_weight, grad_out = route_inputs(9, 1, 2048, 1024, 8, torch.bfloat16, seed=8)

    def f(s, q, w):
        return mhar_route(s, q, w, 8, backend="triton") * 2.0

    torch._dynamo.reset()
    compiled = fwd_bwd(torch.compile(f, fullgraph=True), grad_out, sources, query, key_weight)
    eager = fwd_bwd(f, grad_out, sources, query, key_weight)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


# ----------------------------------------------------------------------------------------------------------
# The fused path's kernels (history.py, column.py)
# ----------------------------------------------------------------------------------------------------------


def site_inputs(S, N, d, G, dtype, seed):
    """Sources (S, N, d) in ``dtype`` of different scales, G fused query rows (fp32), G output gradients."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    src = (randn(gen, S, N, d) * (1 + torch.rand(S, N, 1, generator=gen, device=DEVICE))).to(dtype)
    qg = randn(gen, G, d, scale=2.0 / (d / 8) ** 0.5)
    grad_out = randn(gen, G, N, d).to(dtype)
    return src, qg, grad_out


def oracle_site(src, qg_k, H):
    """One site's float64 output (N, d) and log-sum-exps (N, H) over ``src`` (S, N, d)."""
    S, N, d = src.shape
    ones = torch.ones(d, dtype=torch.float64, device=src.device)
    view = src.double().reshape(S, 1, N, d)
    out = mhar_route_float64(view, qg_k, ones, H, EPS).view(N, d)
    return out, routing_logsumexp_float64(view, qg_k, ones, H, EPS).view(N, H)


def rms_of(src):
    return torch.rsqrt(src.double().pow(2).mean(-1) + EPS).float()


def assert_qg_grad(dqg, truth, src, grad_out, dtype) -> None:
    """Query-row gradients within TOL; with one source they vanish exactly, and are judged on the scale of
    what they are made of instead."""
    if src.shape[0] == 1:
        scale = grad_out.float().abs().max().item() * src.float().abs().max().item()
        assert dqg.abs().max().item() <= TOL[dtype] * scale, "grad qg of a single source"
    else:
        assert rel_err(dqg, truth) <= TOL[dtype], f"grad qg: {rel_err(dqg, truth):.2e}"


def backward_truth(src, qg, grad_out, H, block):
    """Sites s = 0 .. len(qg) - 1 reading slots 0 .. s // block of ``src``: autograd of the oracle for the
    loss sum_s <out_s, grad_out_s>, the slots' and query rows' float64 gradients, and the statistics the
    forward leaves for the backward (log-sum-exps and deltas, (sites, N, H) fp32)."""
    n_sites, N, d = grad_out.shape
    src64 = src.double().requires_grad_(True)
    qg64 = qg.double().requires_grad_(True)
    outs, lses = zip(*(oracle_site(src64[:s // block + 1], qg64[s], H) for s in range(n_sites)))
    loss = sum((o * g.double()).sum() for o, g in zip(outs, grad_out))
    dsrc64, dqg64 = torch.autograd.grad(loss, (src64, qg64))
    lse = torch.stack(lses).detach().float().contiguous()
    delta = torch.einsum("knhc,knhc->knh", grad_out.double().view(n_sites, N, H, -1),
                         torch.stack(outs).detach().view(n_sites, N, H, -1)).float().contiguous()
    return dsrc64, dqg64, lse, delta


HISTORY_SHAPES = [  # S, N, d, H, G
    (5, 77, 1280, 8, 4),  # head width 160 = 128 + 32
    (1, 5, 48, 4, 3),  # one source, head width 12, three sites padded to four
    (33, 19, 1024, 8, 8),
    (6, 40, 512, 8, 2),
    (73, 21, 1280, 8, 4),  # paper1b's longest pass: running softmax over tiles, with the split head
    (3, 45, 1024, 8, 4),  # block:4's early passes: the stacked form's four tokens a tile
    (8, 29, 1280, 8, 4),  # two tokens of eight sources a tile, with the split head
]


# The shared pass's forms: the reductions' (2 or 4 sources an iteration, whatever the launch table picks); the
# matrix products' (TOKENS, WARPS, STAGES, MAX_S: tiles of 16 sources, so that S = 33 and 73 take the running
# softmax over several tiles; 32 and 64, one tile for most S; a program's tokens leaving the last program
# part-filled; "table": the launch table's own); and the stacked products' (TOKENS, WARPS, STAGES, ROWS: several
# tokens' sources in a tile's rows, at S <= ROWS / 2 where heads fit ``tl.dot``; other passes take the table's
# forms).
HISTORY_FORMS = [("reductions", 2), ("reductions", 4), ("dot", (16, 1, 3, 16)), ("dot", "table"),
                 ("dot", (5, 1, 2, 64)), ("stacked", (32, 1, 3, 16)), ("stacked", (12, 1, 2, 32))]


@dtypes
@pytest.mark.parametrize("S,N,d,H,G", HISTORY_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("form", HISTORY_FORMS, ids=lambda v: f"{v[0]}-{v[1]}")
def test_history_forward_matches_float64(dtype, S, N, d, H, G, form, monkeypatch):
    from mhar_ablate.kernels import history

    kind, config = form
    # each form forced: the stacked one only where asked (the table would take it for few sources)
    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", config if kind == "stacked" else None)
    if kind == "reductions":
        table = {k: {g: (*cfg[:3], config) for g, cfg in by_g.items()} for k, by_g in history.HISTORY_CONFIG.items()}
        monkeypatch.setattr(history, "HISTORY_CONFIG", table)
        monkeypatch.setattr(history, "HISTORY_DOT_CONFIG", None)
    elif kind == "dot":
        if config != "table":
            monkeypatch.setattr(history, "HISTORY_DOT_CONFIG", config)
        monkeypatch.setattr(history, "HISTORY_DOT_MIN_S", (0, 0))
    src, qg, _ = site_inputs(S, N, d, G, dtype, seed=S * 100 + N)
    truth = [oracle_site(src, qg[k], H) for k in range(G)]
    out0, rest, lse = nan_like((N, d), dtype), nan_like((G - 1, N, d), dtype), nan_like((G, N, H), torch.float32)
    history.history_forward(src, rms_of(src), qg, H, out0, rest, lse)
    outs = torch.cat([out0.unsqueeze(0), rest])
    for k, (out_k, lse_k) in enumerate(truth):
        assert rel_err(outs[k], out_k) <= TOL[dtype], f"site {k}: {rel_err(outs[k], out_k):.2e}"
        assert rel_err(lse[k], lse_k) <= LSE_TOL, f"site {k} lse: {rel_err(lse[k], lse_k):.2e}"


def test_ptx_forms_match_the_portable_ones():
    """kernels/ptx.py's inline PTX against what the interpreter runs: exp with flush-to-zero (exact zeros
    for -inf and below 2^-126, else within ex2.approx's error), and a masked fp32 store from a reduction's
    layout (every element written once where the mask holds, none elsewhere)."""
    import triton
    import triton.language as tl

    from mhar_ablate.kernels import ptx

    @triton.jit
    def kernel(x_ptr, exp_ptr, rows_ptr, N, C: tl.constexpr, PTX: tl.constexpr):
        n = tl.arange(0, 16)
        c = tl.arange(0, C)
        x = tl.load(x_ptr + n[:, None] * C + c[None, :], mask=(n < N)[:, None], other=0.0)
        tl.store(exp_ptr + n[:, None] * C + c[None, :], ptx.exp(x, PTX), mask=(n < N)[:, None])
        ptx.store_f32(rows_ptr + n[:, None], tl.sum(x, axis=1)[:, None], (n < N)[:, None], PTX)

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(16, 64, generator=gen, device=DEVICE) * 30
    x[0, :4] = torch.tensor([float("-inf"), -200.0, -87.0, 0.0])
    results = {}
    for form in (True, False):
        e, rows = torch.full_like(x, float("nan")), torch.full((16,), float("nan"), device=DEVICE)
        kernel[(1,)](x, e, rows, 13, C=64, PTX=form, num_warps=4)
        results[form] = (e, rows)
    (e, rows), (e_ref, rows_ref) = results[True], results[False]
    assert e[0, 0] == 0 and e[0, 1] == 0 and e[0, 3] == 1
    torch.testing.assert_close(e[:13], e_ref[:13], rtol=2e-6, atol=1.2e-38)
    assert torch.isnan(e[13:]).all()
    torch.testing.assert_close(rows[:13], x[:13].sum(1), rtol=1e-5, atol=1e-4)
    assert torch.isnan(rows[13:]).all() and torch.equal(rows[:13], rows_ref[:13])


SITES_SHAPES = [  # S history, S extra, N, d, H, G
    (4, 3, 37, 1280, 8, 2),
    (1, 1, 5, 48, 4, 1),
    (6, 2, 70, 1024, 8, 1),
]


@dtypes
@pytest.mark.parametrize("S,E,N,d,H,G", SITES_SHAPES, ids=lambda v: str(v))
def test_sites_forward_and_its_merge_match_float64(dtype, S, E, N, d, H, G):
    """A row pass over a history (RMS statistics given, then reduced from the rows), then each site's
    merge with E more sources from that partial state: the oracle over all S + E sources."""
    from mhar_ablate.kernels import history

    src, qg, _ = site_inputs(S + E, N, d, G, dtype, seed=S * 10 + E + d)
    for rms in (rms_of(src[:S]), None):
        out0, lse = nan_like((N, d), dtype), nan_like((G, N, H), torch.float32)
        rest = nan_like((G - 1, N, d), dtype) if G > 1 else None
        history.sites_forward(src[:S], qg, H, EPS, out0, rest, lse, rms=rms)
        partial = out0.unsqueeze(0) if rest is None else torch.cat([out0.unsqueeze(0), rest])
        for k in range(G):
            out_k, lse_k = oracle_site(src[:S], qg[k], H)
            assert rel_err(partial[k], out_k) <= TOL[dtype], f"site {k}"
            assert rel_err(lse[k], lse_k) <= LSE_TOL, f"site {k} lse"
    for k in range(G):  # the merge, one site at a time, as the fused path runs it
        merged, lse_k = nan_like((N, d), dtype), lse[k:k + 1].clone()
        history.sites_forward(src[S:], qg[k:k + 1], H, EPS, merged, None, lse_k, init=partial[k:k + 1],
                              rms=rms_of(src[S:]))
        out_all, lse_all = oracle_site(src, qg[k], H)
        # the partial state enters rounded to the dtype: one more rounding than a single pass
        assert rel_err(merged, out_all) <= 2 * TOL[dtype], f"merged site {k}: {rel_err(merged, out_all):.2e}"
        assert rel_err(lse_k[0], lse_all) <= LSE_TOL, f"merged site {k} lse"


@dtypes
@pytest.mark.parametrize("S,N,d,H", [(3, 37, 1280, 8), (1, 5, 48, 4), (0, 9, 1024, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("accumulate", ["write", "in-place", "base"])
def test_sites_backward_matches_float64(dtype, S, N, d, H, accumulate):
    """One site over S sources (the per-site mode, or a block's partial sum): the sources' gradients
    written, or added to a base (the gradient a block's later sums passed back: in place, or another
    tensor), its delta from its output, its output gradient's offset recorded, its query-row gradient
    (returned as partial sums, and added into a row)."""
    from mhar_ablate.kernels import history

    src, qg, grad_out = site_inputs(max(S, 1), N, d, 1, dtype, seed=S + N + d)
    src = src[:S]
    src64 = src.double().requires_grad_(True)
    qg64 = qg.double().requires_grad_(True)
    if S:
        out64, lse64 = oracle_site(src64, qg64[0], H)
        dsrc64, dqg64 = torch.autograd.grad((out64 * grad_out[0].double()).sum(), (src64, qg64))
    else:  # no sources here: only the prologue (delta and the output gradient's offset) runs
        out64 = randn(torch.Generator(device=DEVICE).manual_seed(1), N, d).double()
        lse64 = torch.zeros(N, H, device=DEVICE)
    out = out64.detach().to(dtype)
    prev = randn(torch.Generator(device=DEVICE).manual_seed(2), S, N, d).to(dtype)
    grad_src = prev.clone() if accumulate == "in-place" else nan_like((S, N, d), dtype)
    base = {"write": None, "in-place": grad_src, "base": prev}[accumulate]
    delta, table = nan_like((1, N, H), torch.float32), torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    lse = lse64.detach().float().unsqueeze(0).contiguous()
    if S:  # the query-row gradient added into a row, as the fused path takes it
        row = torch.zeros(1, d, device=DEVICE)  # (that it adds: tests/kernels/test_history_kernels.py)
        history.sites_backward(src, torch.empty_like(src), None, qg, H, EPS, grad_out, lse, delta.clone(),
                               out=out, dqg=row)
        assert_qg_grad(row, dqg64, src, grad_out, dtype)
    copy = nan_like((1, N, d), dtype)
    parts = history.sites_backward(src, grad_src, base, qg, H, EPS, grad_out, lse, delta, out=out, grad_copy=copy,
                                   record=(table[1:2], -(1 << 40) - 8))
    assert table.tolist() == [-1, -(1 << 40) - 8, -1]
    assert torch.equal(copy, grad_out)
    delta_truth = (grad_out[0].double() * out.double()).view(N, H, -1).sum(-1)
    assert rel_err(delta[0], delta_truth) <= LSE_TOL
    if not S:
        assert parts is None
        return
    expected = dsrc64 + (prev.double() if base is not None else 0)
    assert rel_err(grad_src, expected) <= TOL[dtype], f"grad sources: {rel_err(grad_src, expected):.2e}"
    assert_qg_grad(parts.sum(0)[:1], dqg64, src, grad_out, dtype)


@dtypes
@pytest.mark.parametrize("S,N,d,H", [(4, 37, 1280, 8), (5, 19, 48, 4), (9, 70, 1024, 8), (1, 3, 256, 1)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("config", [None, (1, 4, 0), (2, 4, 0), (1, 2, 4)], ids=["table", "row", "row-pair", "pipelined"])
def test_column_backward_matches_float64(dtype, S, N, d, H, config, monkeypatch):
    """Sites k = 0..S-1 read sources 0..k (``full`` grouping): each source's gradient in one pass over the
    sites that read it, and the sites' query-row gradients, against autograd of the oracle; with the
    launch table's configuration for d and with each form of the column kernel."""
    from mhar_ablate.kernels import column

    monkeypatch.setattr(column, "COLUMN_CONFIG", config)
    src, qg, grad_out = site_inputs(S, N, d, S, dtype, seed=11 * S + d)
    dsrc64, dqg64, lse, delta = backward_truth(src, qg, grad_out, H, 1)
    rms = rms_of(src)
    dqg = torch.zeros(S, d, device=DEVICE)
    for j in range(S):
        poison()
        dx, part = column.column_backward(src[j], rms[j], grad_out[j:], lse[j:], delta[j:], qg[j:], H)
        assert dx.dtype == dtype
        assert rel_err(dx, dsrc64[j]) <= TOL[dtype], f"slot {j}: {rel_err(dx, dsrc64[j]):.2e}"
        dqg[j:] += part
    assert_qg_grad(dqg, dqg64, src, grad_out, dtype)


@dtypes
@pytest.mark.parametrize("n_sites,block,N,d,H", [(5, 1, 37, 1280, 8), (9, 1, 70, 1024, 8), (10, 4, 19, 512, 8),
                                                 (4, 1, 5, 48, 4), (4, 1, 24, 1024, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("config", [None, (1, 4, 0), (1, 2, 4), (2, 2, 3)],
                         ids=["table", "row", "pipelined", "pipelined-pair"])
def test_two_slot_passes_match_float64(dtype, n_sites, block, N, d, H, config, monkeypatch):
    """A step's backward by source as ``slot_passes`` plans it (two slots a pass, the lower one finished
    from the carry by its own pass over the sites only it reads): each slot's gradient and, from the dz * r
    the passes left, the query gradients, against autograd of the oracle; site s reads slots 0 .. s // block.
    With the table's configuration (which at d = 1280 takes one slot a pass) and with each form forced."""
    from mhar_ablate.kernels import column

    monkeypatch.setattr(column, "TWO_SLOT_CONFIG", config)
    if config is not None and config[0] == 1:
        monkeypatch.setattr(column, "COLUMN_CONFIG", config)
    slots = (n_sites - 1) // block + 1
    assert_planned_passes(column.slot_passes(slots, n_sites, block, column.pairs_slots(d)), dtype, N, d, H,
                          n_sites, block, seed=n_sites * 13 + d)


def assert_planned_passes(passes, dtype, N, d, H, n_sites, block, seed) -> None:
    """Run a step's backward by source as ``passes`` plan it, every output poisoned first: each slot's
    gradient and the query gradients from the dz * r the passes left, within TOL of autograd of the oracle
    (site s reads slots 0 .. s // block)."""
    from mhar_ablate.kernels import column

    slots = (n_sites - 1) // block + 1
    src, qg, grad_out = site_inputs(slots, N, d, n_sites, dtype, seed=seed)
    dsrc64, dqg64, lse, delta = backward_truth(src, qg, grad_out, H, block)
    rms = rms_of(src)
    dzr = nan_like((column.dzr_rows(slots, n_sites, block) * H * N,), torch.float32)
    rows = column.carry_rows(passes)
    carry = column.Carry(nan_like((rows, N, d), torch.float32), nan_like((rows, N, H), torch.float32))
    # Each site's output gradient a tensor of its own, wherever the allocator put it, as in training.
    held = [g.clone() for g in grad_out]
    grads = column.GradRows.of(held, base=src)
    for p in passes:
        poison()
        dx = column.run_pass(p, src, rms, grads, lse, delta, qg, H, block, dzr, carry)
        assert dx.dtype == dtype
        assert rel_err(dx, dsrc64[p.slot]) <= TOL[dtype], f"slot {p.slot}: {rel_err(dx, dsrc64[p.slot]):.2e}"
    assert_qg_grad(column.query_grads(dzr, src, H, n_sites, block), dqg64, src, grad_out, dtype)


GROUP_SHAPES = [  # n_sites, block, N, d, H: slot j read by sites block * j ..; the plan's groups in comments
    (17, 1, 37, 1280, 8),  # head width 160 = 128 + 32: a group of 5
    (25, 1, 70, 1024, 8),  # groups of 6 and 7
    (49, 8, 19, 1024, 8),  # block:4 at paper350m's depth: a group of 3 over 33 sites
    (73, 1, 20, 512, 8),  # paper1b's depth: seven groups, the lowest over 62 sites
]


@dtypes
@pytest.mark.parametrize("n_sites,block,N,d,H", GROUP_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("config", [None, (16, 4, 2, 16), (7, 8, 3, 32), (8, 4, 2, 64, 1)],
                         ids=["table", "16-site-tiles", "7-tokens", "none-held"])
def test_group_passes_match_float64(dtype, n_sites, block, N, d, H, config, monkeypatch):
    """A step's backward by source as ``slot_passes`` plans it with group passes (``column_group``: a group's
    slots summed over the sites that read its top slot, each slot finished from its carry by its own pass):
    each slot's gradient and the query gradients, against autograd of the oracle; with the table's
    configuration (which holds several tokens' dz * r to store them together), with sites in tiles of 16
    (several tiles a pass), 7 tokens a program, or each token's dz * r stored alone."""
    from mhar_ablate.kernels import column, column_group

    monkeypatch.setattr(column, "GROUP_SLOTS", 16)  # (the launch table takes none at d = 512)
    monkeypatch.setattr(column, "GROUP_PASS_WEIGHT", 1.0)  # the byte model's plan: the groups in the comments
    if config is not None:
        monkeypatch.setattr(column_group, "GROUP_CONFIG", config)
    slots = (n_sites - 1) // block + 1
    passes = column.slot_passes(slots, n_sites, block, column.pairs_slots(d), column.group_slots(d, H, block))
    assert any(p.group is not None for p in passes)
    assert_planned_passes(passes, dtype, N, d, H, n_sites, block, seed=n_sites * 7 + d)


@dtypes
def test_paper350m_plan_matches_float64(dtype):
    """The plan a step of ``full`` takes at paper350m's depth and width (49 sites, d = 1024, the launch
    tables and the planner's weight as committed: groups of 13 and 10 slots, pairs below), on few tokens."""
    from mhar_ablate.kernels import column

    n_sites, block, N, d, H = 49, 1, 20, 1024, 8
    passes = column.slot_passes(n_sites, n_sites, block, column.pairs_slots(d), column.group_slots(d, H, block))
    assert sorted(len(p.group) for p in passes if p.group is not None) == [10, 13]
    assert_planned_passes(passes, dtype, N, d, H, n_sites, block, seed=350)


QUERY_SHAPES = [  # slots, N, d, H, sites, block (slot j read by sites block * j ..)
    (6, 37, 1280, 8, 6, 1),  # head width 160 = 128 + 32
    (5, 50, 1024, 8, 17, 4),
    (3, 20, 48, 4, 3, 1),  # head width 12: the product without tensor cores
    (40, 33, 512, 8, 40, 1),
    (3, 40, 1280, 1, 3, 1),  # AttnRes: one head of 1280 channels, in blocks of 128
    (4, 24, 1024, 1, 4, 1),
]


@dtypes
@pytest.mark.parametrize("slots,N,d,H,n_sites,block", QUERY_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("config", [None, (16, 16, 4, 2, 4)], ids=["table", "16-site-blocks"])
def test_query_grads_match_float64(dtype, slots, N, d, H, n_sites, block, config, monkeypatch):
    """Every slot's share of the query gradients in one launch, against the oracle; with the table's
    blocks and with blocks of 16 sites (several a launch) and 16 tokens split in chunks."""
    from mhar_ablate.kernels import column
    from mhar_ablate.kernels.reference import query_grads_float64

    if config is not None:
        monkeypatch.setattr(column, "QUERY_GRAD_CONFIG", config)
    gen = torch.Generator(device=DEVICE).manual_seed(slots * 7 + d)
    sources = randn(gen, slots, N, d).to(dtype)
    dzr = randn(gen, column.dzr_rows(slots, n_sites, block) * H * N)
    poison()
    got = column.query_grads(dzr, sources, H, n_sites, block)
    truth = query_grads_float64(dzr, sources, H, n_sites, block)
    assert rel_err(got, truth) <= TOL[dtype], f"{rel_err(got, truth):.2e}"


@dtypes
@pytest.mark.parametrize("tokens", [None, (1, 4), (8, 4)], ids=["table", "1-token", "8-tokens"])
def test_write_slot_stores_the_row_and_the_rms_of_what_it_stored(dtype, tokens, monkeypatch):
    from mhar_ablate.kernels import history

    monkeypatch.setattr(history, "WRITE_SLOT_CONFIG", tokens)
    for d in (1280, 512):
        x = randn(torch.Generator(device=DEVICE).manual_seed(3), 37, d, scale=3.0)
        slot, rms = nan_like((37, d), dtype), nan_like((37,), torch.float32)
        history.write_slot(x, slot, rms, EPS)
        assert torch.equal(slot, x.to(dtype))
        assert rel_err(rms, rms_of(x.to(dtype))) <= 1e-6
        # a block's slot: its partial sum plus its last output, rounded once as torch adds them
        a, b = x.to(dtype), randn(torch.Generator(device=DEVICE).manual_seed(4), 37, d).to(dtype)
        history.write_slot(a, slot, rms, EPS, addend=b)
        assert torch.equal(slot, a + b)
        assert rel_err(rms, rms_of(a + b)) <= 1e-6


@dtypes
@pytest.mark.parametrize("d,H", [(1280, 8), (1024, 8), (48, 4)], ids=lambda v: str(v))
def test_a_site_makes_the_partial_sum_it_reads(dtype, d, H):
    """A block's partial sum made in the pass of the first site that reads it: the sum written exactly as
    torch adds in the dtype, and the site's output and log-sum-exps as if it had read that sum."""
    from mhar_ablate.kernels import history

    N = 37
    gen = torch.Generator(device=DEVICE).manual_seed(d)
    a, b = (randn(gen, N, d).to(dtype) for _ in range(2))
    state, qg = randn(gen, 1, N, d).to(dtype), randn(gen, 1, d)
    lse0 = randn(gen, 1, N, H)
    want, want_lse = nan_like((N, d), dtype), lse0.clone()
    history.sites_forward((a + b).unsqueeze(0), qg, H, EPS, want, None, want_lse, init=state)
    got, got_lse, summed = nan_like((N, d), dtype), lse0.clone(), nan_like((N, d), dtype)
    history.sites_forward(a.unsqueeze(0), qg, H, EPS, got, None, got_lse, init=state, addend=b, sum_out=summed)
    assert torch.equal(summed, a + b)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("P,G,d", [(1056, 1, 1024), (792, 1, 1280), (1000, 2, 520), (3, 1, 8)], ids=lambda v: str(v))
def test_add_row_sums_matches_torch(P, G, d):
    """The persistent backward's partial sums added into the step's query-gradient rows (strided)."""
    from mhar_ablate.kernels import history

    gen = torch.Generator(device=DEVICE).manual_seed(P)
    parts = randn(gen, P, G + 1, d)[:, :G]
    rows = randn(gen, 2 * G, d)
    between, want = rows[1::2].clone(), rows[::2].double() + parts.double().sum(0)
    history.add_row_sums(parts, rows[::2])
    assert rel_err(rows[::2], want) <= 1e-6
    assert torch.equal(rows[1::2], between)


# ----------------------------------------------------------------------------------------------------------
# The fused path end to end: a stack of routing sites (model/residual/fused.py against the reference path)
# ----------------------------------------------------------------------------------------------------------


def routed_stack(grouping: str, d: int, layers: int, heads: int, backend: str, spp: int):
    from mhar_ablate.config import build_config
    from mhar_ablate.variants import build_residual

    over = {"model.d_model": str(d), "model.n_layers": str(layers), "model.n_heads": "8", "model.n_kv_heads": "4",
            "model.ffn": str(4 * d), "residual.kind": "mhar" if heads > 1 else "attnres",
            "residual.grouping": grouping, "residual.backend": backend, "residual.query_init": "normal:0.5"}
    if heads > 1:
        over["residual.heads"] = str(heads)
    cfg = build_config(overrides=over)
    torch.manual_seed(0)
    res = build_residual(cfg.residual, cfg.model).to(DEVICE)
    with torch.no_grad():  # key gains away from 1, so that their gradients and the queries' differ
        res.key_weight.add_(0.3 * torch.randn_like(res.key_weight))
    res.record = False
    res.sites_per_pass = spp
    return res


def stack_grads(res, layers: int, x0: torch.Tensor, probe: torch.Tensor, dtype: torch.dtype,
                norms: bool = False) -> dict:
    """Loss and gradients of a stack whose sublayers are contracting per-channel affine maps (so that no
    channel grows with depth and low-precision runs stay comparable with the float64 one). With ``norms``
    each sublayer first takes its input through the decoder's RMSNorm (gains away from 1), which the fused
    path computes in its own kernels (``read_with_norm``)."""
    from mhar_ablate.norm import RMSNorm

    gen = torch.Generator(device=DEVICE).manual_seed(4)
    d = x0.shape[-1]
    scale = (0.5 * torch.tanh(randn(gen, 2 * layers, d))).to(dtype).requires_grad_(True)
    shift = randn(gen, 2 * layers, d).to(dtype)
    gains = (1 + 0.3 * randn(gen, 2 * layers, d)).to(torch.float64 if dtype == torch.float64 else torch.float32)
    modules = []
    for site in range(2 * layers):
        modules.append(RMSNorm(d, 1e-6).to(DEVICE, gains.dtype))
        with torch.no_grad():
            modules[-1].weight.copy_(gains[site])
    x0 = x0.to(dtype).requires_grad_(True)
    res.zero_grad(set_to_none=True)
    state = res.start(x0)
    for site in range(2 * layers):
        if norms:  # the norm's output in the stack's dtype, as autocast hands it to a sublayer's matrices
            x, h = res.read_with_norm(state, site, modules[site])
            h = (modules[site](x) if h is None else h).to(dtype)
        else:
            h = res.read(state, site)
        res.write(state, site, (h * scale[site] + shift[site]).to(dtype))
    loss = (res.finish(state).double() * probe).sum()
    loss.backward()
    out = {"loss": loss.detach(), "x0": x0.grad, "scale": scale.grad, "query": res.query.grad,
           "key_weight": res.key_weight.grad}
    if norms:
        out["gains"] = torch.stack([m.weight.grad for m in modules])
    return out


@dtypes
@pytest.mark.parametrize("grouping,spp,d,heads", [("full", 1, 1280, 8), ("full", 4, 1280, 8), ("block:2", 4, 1280, 8),
                                                   ("full", 4, 256, 1)], ids=lambda v: str(v))
def test_fused_path_matches_float64(dtype, grouping, spp, d, heads):
    """Loss and gradients (embedding, sublayers, queries, key gains) of the fused path in ``dtype`` against
    the reference path in float64, no further off than the reference path in the same dtype (x3, or TOL)."""
    layers, tokens = 5, 67
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x0, probe = randn(gen, 1, tokens, d), randn(gen, 1, tokens, d).double()
    truth = stack_grads(routed_stack(grouping, d, layers, heads, "reference", spp).double(), layers, x0, probe,
                        torch.float64)
    ref = stack_grads(routed_stack(grouping, d, layers, heads, "reference", spp), layers, x0, probe, dtype)
    poison()
    fused = stack_grads(routed_stack(grouping, d, layers, heads, "triton", spp), layers, x0, probe, dtype)
    for name, t in truth.items():
        err, ref_err = rel_err(fused[name], t), rel_err(ref[name], t)
        assert err <= max(3 * ref_err, TOL[dtype]), f"{name}: {err:.2e} (reference in {dtype_id(dtype)}: {ref_err:.2e})"


@dtypes
@pytest.mark.parametrize("grouping,spp,d,heads", [("full", 4, 1280, 8), ("block:2", 4, 1280, 8), ("full", 4, 1024, 8),
                                                   ("block:2", 4, 1024, 8), ("full", 2, 256, 1)], ids=lambda v: str(v))
def test_fused_path_with_sublayer_norms_matches_float64(dtype, grouping, spp, d, heads, monkeypatch):
    """The same with each sublayer's RMSNorm folded into the sites' kernels (the merges', the lone sites' row
    pass, the prologues' backward), the output gradients copied (d = 1280) or made in place (d = 1024): the
    norms' gains' gradients too."""
    from mhar_ablate.variants import fused

    monkeypatch.setattr(fused, "FOLD_NORMS", True)
    layers, tokens = 5, 67
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x0, probe = randn(gen, 1, tokens, d), randn(gen, 1, tokens, d).double()
    truth = stack_grads(routed_stack(grouping, d, layers, heads, "reference", spp).double(), layers, x0, probe,
                        torch.float64, norms=True)
    ref = stack_grads(routed_stack(grouping, d, layers, heads, "reference", spp), layers, x0, probe, dtype, norms=True)
    poison()
    fused = stack_grads(routed_stack(grouping, d, layers, heads, "triton", spp), layers, x0, probe, dtype, norms=True)
    for name, t in truth.items():
        err, ref_err = rel_err(fused[name], t), rel_err(ref[name], t)
        assert err <= max(3 * ref_err, TOL[dtype]), f"{name}: {err:.2e} (reference in {dtype_id(dtype)}: {ref_err:.2e})"


# ----------------------------------------------------------------------------------------------------------
# mHC's Sinkhorn-Knopp (kernels/sinkhorn.py), through mhc.sinkhorn on CUDA tensors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spread", [1.0, 5.0])
def test_sinkhorn_matches_float64(spread):
    """A site's H_res at paper350m's token count (N = 8192, n = 4, t_max = 20) in fp32, forward and backward,
    against ``_Sinkhorn`` (``sinkhorn_reference``) in float64; no further off than it is in fp32 (x2, or
    TOL)."""
    from mhar_ablate.variants.mhc import sinkhorn, sinkhorn_reference

    gen = torch.Generator(device=DEVICE).manual_seed(int(spread))
    logits, grad = randn(gen, 2, 4096, 4, 4, scale=spread), randn(gen, 2, 4096, 4, 4)
    truth = fwd_bwd(lambda x: sinkhorn_reference(x, 20), grad.double(), logits.double())
    same_dtype = fwd_bwd(lambda x: sinkhorn_reference(x, 20), grad, logits)
    poison()
    got = fwd_bwd(lambda x: sinkhorn(x, 20), grad, logits)
    for name, g, t, r in zip(("output", "grad logits"), got, truth, same_dtype):
        assert g.dtype == torch.float32
        err, ref_err = rel_err(g, t), rel_err(r, t)
        assert err <= max(TOL[torch.float32], 2 * ref_err), f"{name}: {err:.2e} (reference in fp32: {ref_err:.2e})"
