"""The fused path's kernels against the float64 oracle, through Triton's interpreter in fp32:
the head-tiled shared forward pass (``kernels/history.py``: outputs and log-sum-exps of G sites over one
history, in both its forms) and the backward by source (``kernels/column.py``: each slot's gradient and the query
gradients, from the sites that read it), over awkward shapes (head widths split 8 + 4, token counts that
are not a multiple of the tile, a padded site count, a single source) and every tile size and prefetch
depth the launch table can choose."""

from __future__ import annotations

import pytest
import torch

from mhar_ablate.kernels import column, history
from mhar_ablate.kernels.reference import mhar_route_float64, query_grads_float64, routing_logsumexp_float64

EPS = 1e-6


def _route(src, qg_k, H):
    """The oracle's output (N, d) and log-sum-exps (H, N) of one site with fused query row ``qg_k``."""
    S, N, d = src.shape
    ones = torch.ones(d, dtype=torch.float64)
    out = mhar_route_float64(src.view(S, 1, N, d), qg_k, ones, H, EPS).view(N, d)
    lse = routing_logsumexp_float64(src.view(S, 1, N, d), qg_k, ones, H, EPS).view(N, H).t()
    return out, lse


def _inputs(S, N, d, G, seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(S, N, d, generator=gen) * (1 + torch.rand(S, N, 1, generator=gen))
    qg = torch.randn(G, d, generator=gen)
    grad_out = torch.randn(G, N, d, generator=gen)
    return src, qg, grad_out


def _rms(src):
    return torch.rsqrt(src.pow(2).mean(-1) + EPS)


@pytest.mark.parametrize("S,N,d,H,G", [
    (5, 7, 48, 4, 3),  # head width 12 = 8 + 4; 7 tokens in tiles of 2 or 4; 3 sites padded to 4
    (1, 5, 32, 8, 2),  # one source, head width 4
    (4, 6, 64, 2, 4),
])
@pytest.mark.parametrize("block_n,stages,sources", [(1, 1, 2), (2, 2, 4), (4, 3, 2)])
def test_shared_pass_matches_the_reference(monkeypatch, S, N, d, H, G, block_n, stages, sources):
    """The reductions' form against the reference for token tiles that leave the last one part-filled and
    source counts that leave an iteration's last sources missing (2 or 4 sources an iteration)."""
    monkeypatch.setattr(history, "_INTERPRETER_CONFIG", (block_n, 1, stages, sources))
    monkeypatch.setattr(history, "HISTORY_DOT_CONFIG", None)
    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", None)  # the table's form for few sources
    _check_shared_pass(S, N, d, H, G)


@pytest.mark.parametrize("S,N,d,H,G", [
    (5, 7, 64, 2, 4),  # head width 32
    (33, 5, 96, 2, 3),  # head width 48 = 32 + 16; 33 sources: three tiles of 16, the last with one source
    (20, 4, 160, 1, 5),  # one head of 160 = 128 + 32
    (1, 3, 32, 2, 2),  # one source
    (6, 3, 64, 2, 9),  # nine sites: each half of the products' rows is 16 wide
])
@pytest.mark.parametrize("tokens,max_s", [(3, 16), (2, 32)])
def test_shared_pass_products_match_the_reference(monkeypatch, S, N, d, H, G, tokens, max_s):
    """The matrix products' form: tiles of 16 sources (a running softmax over several) or one tile of up to
    32, a program's tokens leaving the last program part-filled, and the sites' padding."""
    monkeypatch.setattr(history, "_INTERPRETER_DOT_CONFIG", (tokens, 1, 1, max_s))
    monkeypatch.setattr(history, "HISTORY_DOT_MIN_S", (0, 0))
    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", None)
    _check_shared_pass(S, N, d, H, G)


@pytest.mark.parametrize("S,N,d,H,G", [
    (5, 7, 96, 2, 3),  # head width 48 = 32 + 16; two tokens of 8 rows a tile, the last tile overlapping
    (3, 9, 64, 2, 4),  # four tokens of 4 rows a tile: nine tokens in three tiles, two programs
    (1, 5, 160, 1, 4),  # one source; one head of 160 = 128 + 32
    (2, 11, 64, 2, 2),  # two sites: eight tokens of 2 rows a tile
    (8, 6, 64, 2, 9),  # nine sites padded to 16: one token a tile
    (12, 5, 96, 2, 4),  # 12 sources: two tokens of 16 rows in a tile of 32 (another form with tiles of 16)
    (2, 5, 64, 2, 2),  # fewer tokens than a tile holds: another form instead
])
@pytest.mark.parametrize("tiles,rows", [(1, 16), (2, 16), (2, 32)])
def test_shared_pass_stacked_products_match_the_reference(monkeypatch, S, N, d, H, G, tiles, rows):
    """The products' form with several tokens' sources in one tile's rows: block-diagonal weights, each
    (site, token) its own softmax over its rows, the padded rows and sites masked, a program's tiles, the
    last tile ending at the last token (it overlaps the one before and writes the same values again)."""
    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", (32, 1, 3, rows))
    monkeypatch.setattr(history, "_INTERPRETER_STACKED_TILES", tiles)
    block_g = history.common._block_g(G)
    tokens, per_token = history.stacked_tile(S, block_g, rows)
    assert tokens * per_token == rows and tokens * block_g <= 16 and per_token >= S
    calls, real_launch = [], history.shared.launch

    def launch(kernel, grid, args, meta, device):
        calls.append(kernel)
        real_launch(kernel, grid, args, meta, device)

    for form in (history.shared, history.shared_dot, history.shared_stacked):  # the shared pass's launches
        monkeypatch.setattr(form, "launch", launch)
    _check_shared_pass(S, N, d, H, G)
    stacked = history.shared_stacked._history_fwd_stacked_kernel
    assert len(calls) == 1 and (calls[0] is stacked) == (S <= rows // 2 and N >= tokens)


def _check_shared_pass(S, N, d, H, G):
    src, qg, _ = _inputs(S, N, d, G, seed=S * 100 + N)
    refs = [_route(src.double(), qg[k].double(), H) for k in range(G)]
    out0 = torch.full((N, d), float("nan"))
    rest = torch.full((G - 1, N, d), float("nan"))
    lse = torch.full((G, N, H), float("nan"))
    history.history_forward(src, _rms(src), qg, H, out0, rest, lse)
    torch.testing.assert_close(out0, refs[0][0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, torch.stack([o for o, _ in refs[1:]]).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.stack([l.t() for _, l in refs]).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slots,N,d,H,n_sites,block", [
    (4, 37, 96, 2, 4, 1),  # head width 48 = 32 + 16: matrix products over both parts
    (4, 21, 64, 2, 14, 4),  # block:4, slot j read by sites 4 j ..
    (3, 9, 48, 4, 3, 1),  # head width 12: the product without matrix products
    (70, 5, 32, 1, 70, 1),  # 70 sites: two blocks of sites
    (2, 9, 384, 1, 2, 1),  # one head of 384 channels: three blocks of 128
])
def test_query_grads_match_the_reference(slots, N, d, H, n_sites, block):
    """Every slot's share of the query gradients in one launch, summed over slots and over the two token
    chunks the interpreter splits the tokens into."""
    gen = torch.Generator().manual_seed(slots + N)
    sources = torch.randn(slots, N, d, generator=gen)
    dzr = torch.randn(column.dzr_rows(slots, n_sites, block) * H * N, generator=gen)
    got = column.query_grads(dzr, sources, H, n_sites, block)
    torch.testing.assert_close(got, query_grads_float64(dzr, sources, H, n_sites, block).float(), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("S,N,d,H", [
    (4, 7, 48, 4),  # head width 12 = 8 + 4: query gradients without matrix products (blocks under 16)
    (3, 5, 64, 2),  # head width 32: the matrix-product path for the query gradients
    (1, 3, 32, 8),  # one site, head width 4
])
@pytest.mark.parametrize("config", [(1, 4, 0), (2, 4, 0), (2, 4, 2)], ids=["row", "row-pair", "pipelined"])
def test_backward_by_source_matches_autograd(S, N, d, H, config, monkeypatch):
    """Sites k = 0..S-1 read sources 0..k (full grouping): each source's gradient from the sites that read
    it, and the query gradients summed over sources, against autograd of the reference; for each of the
    column kernel's forms (one token a program or two, loaded a site ahead; a tile through the
    shared-memory pipeline), with token counts that leave a pair or a tile part-filled."""
    monkeypatch.setattr(column, "COLUMN_CONFIG", config)
    src, qg, grad_out = _inputs(S, N, d, S, seed=11 * S + d)
    src64 = src.double().requires_grad_(True)
    qg64 = qg.double().requires_grad_(True)
    outs, lses = zip(*(_route(src64[:k + 1], qg64[k], H) for k in range(S)))
    loss = sum((o * g.double()).sum() for o, g in zip(outs, grad_out))
    dsrc_ref, dqg_ref = torch.autograd.grad(loss, (src64, qg64))
    out = torch.stack(outs).detach().float()
    lse = torch.stack([l.t() for l in lses]).detach().float().contiguous()
    delta = torch.einsum("knhc,knhc->knh", grad_out.view(S, N, H, -1), out.view(S, N, H, -1)).contiguous()
    rms = _rms(src)
    dqg = torch.zeros(S, d)
    for j in range(S):
        dx, part = column.column_backward(src[j], rms[j], grad_out[j:], lse[j:], delta[j:], qg[j:], H)
        torch.testing.assert_close(dx, dsrc_ref[j].float(), rtol=1e-4, atol=1e-4)
        dqg[j:] += part
    torch.testing.assert_close(dqg, dqg_ref.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_sites,block,N,d,H", [
    (5, 1, 7, 48, 4),  # head width 12 = 8 + 4; 5 slots: two two-slot passes and slot 4 alone
    (4, 1, 5, 64, 2),  # 4 slots: slot 3 takes slot 2, slot 1 takes slot 0
    (10, 4, 6, 32, 2),  # block:4, 3 slots: slot 1 takes slot 0, whose own pass reads sites 0..3
])
@pytest.mark.parametrize("config", [(1, 4, 0), (2, 4, 2)], ids=["row", "pipelined"])
def test_two_slot_passes_match_autograd(n_sites, block, N, d, H, config, monkeypatch):
    """A step's backward by source as ``slot_passes`` plans it (odd slots' passes carrying the even slot
    below's sums, each even slot finishing from the carry): every slot's gradient, and the query gradients
    from the dz * r the passes left, against autograd of the reference (site s reads slots 0 .. s // block);
    with the prefetching kernel (one token a program) and the pipelined one (two-token tiles)."""
    monkeypatch.setattr(column, "COLUMN_CONFIG", config)
    monkeypatch.setattr(column, "TWO_SLOT_CONFIG", config)
    slots = (n_sites - 1) // block + 1
    passes = column.slot_passes(slots, n_sites, block, two_slots=True)
    assert [p.slot for p in passes] == list(reversed(range(slots)))
    assert sum(p.low for p in passes) == slots // 2 == sum(p.carried for p in passes)
    _assert_planned_passes(passes, N, d, H, n_sites, block, seed=n_sites * 10 + d)


def _assert_planned_passes(passes, N, d, H, n_sites, block, seed) -> None:
    """Run a step's backward by source as ``passes`` plan it, carries and dz * r starting as NaN: every
    slot's gradient and the query gradients against autograd of the reference (site s reads slots
    0 .. s // block)."""
    slots = (n_sites - 1) // block + 1
    src, qg, grad_out = _inputs(slots, N, d, n_sites, seed=seed)
    src64 = src.double().requires_grad_(True)
    qg64 = qg.double().requires_grad_(True)
    outs, lses = zip(*(_route(src64[:s // block + 1], qg64[s], H) for s in range(n_sites)))
    loss = sum((o * g.double()).sum() for o, g in zip(outs, grad_out))
    dsrc_ref, dqg_ref = torch.autograd.grad(loss, (src64, qg64))
    lse = torch.stack([l.t() for l in lses]).detach().float().contiguous()
    delta = torch.einsum("knhc,knhc->knh", grad_out.view(n_sites, N, H, -1),
                         torch.stack(outs).detach().float().view(n_sites, N, H, -1)).contiguous()
    rms = _rms(src)
    dzr = torch.full((column.dzr_rows(slots, n_sites, block) * H * N,), float("nan"))
    rows = column.carry_rows(passes)
    carry = column.Carry(torch.full((rows, N, d), float("nan")), torch.full((rows, N, H), float("nan")))
    # Each site's output gradient a tensor of its own, wherever the allocator put it, as in training.
    held = [g.clone() for g in grad_out]
    grads = column.GradRows.of(held, base=src)
    for p in passes:
        dx = column.run_pass(p, src, rms, grads, lse, delta, qg, H, block, dzr, carry)
        torch.testing.assert_close(dx, dsrc_ref[p.slot].float(), rtol=1e-4, atol=1e-4)
    dqg = column.query_grads(dzr, src, H, n_sites, block)
    torch.testing.assert_close(dqg, dqg_ref.float(), rtol=1e-4, atol=1e-4)


def test_a_carried_slot_whose_pass_above_did_not_run_reads_every_site():
    """``carried=False`` (the two-slot pass above it never ran): the slot's pass takes all its sites and
    ignores whatever the carry holds."""
    S, N, d, H = 3, 4, 32, 2
    src, qg, grad_out = _inputs(2, N, d, S, seed=5)
    lse = torch.randn(S, N, H)
    delta = torch.randn(S, N, H)
    rms = _rms(src)
    truth, _ = column.slot_grad(src[0], rms[0], grad_out, lse, delta, qg, H)
    dzr = torch.empty(column.dzr_rows(2, S, 1) * H * N)
    carry = column.Carry(torch.full((1, N, d), 1e3), torch.full((1, N, H), 1e3))
    (low, carried) = column.slot_passes(2, S, 1, two_slots=True)
    assert low.low and carried.carried
    got = column.run_pass(carried, src, rms, grad_out, lse, delta, qg, H, 1, dzr, carry, carried=False)
    torch.testing.assert_close(got, truth)


def _pairs_read(passes, n_sites, block):
    """The (site, slot) pairs each planned pass sums, checking that every carried pass finds its carry: left
    by an earlier pass and not overwritten since."""
    read, rows = [], {}  # rows: carry row -> the slot whose sums it holds
    for p in passes:
        if p.group is not None:
            top = p.group.stop - 1
            read += [(s, j) for s in range(block * top, n_sites) for j in p.group]
            rows = {j - p.group.start: j for j in p.group}
        if p.carried:
            assert rows.get(p.carry_row) == p.slot, (p, rows)
            del rows[p.carry_row]
        read += [(s, p.slot) for s in p.sites]
        if p.low:
            read += [(s, p.slot - 1) for s in p.sites]
            rows[0] = p.slot - 1
    return read


@pytest.mark.parametrize("weight", [1.0, 2.0])
@pytest.mark.parametrize("n_slots,n_sites,block", [(49, 49, 1), (73, 73, 1), (25, 25, 1), (7, 49, 8), (13, 49, 4),
                                                   (5, 5, 1), (17, 33, 2)])
def test_planned_passes_sum_every_site_slot_pair_once(n_slots, n_sites, block, weight, monkeypatch):
    """Whatever the plan (one slot a pass, two, or groups), each site's share of each slot it reads is summed
    exactly once, in passes that go down the slots as autograd does, each reading only sites whose output
    gradients are known by then (those that read the slot); with groups the plan moves no more bytes than
    the two-slot plan by the planner's byte model, whatever weight it gives a group pass's bytes."""
    monkeypatch.setattr(column, "GROUP_PASS_WEIGHT", weight)
    def cost(passes):
        total = 0
        for p in passes:
            if p.group is not None:  # the group pass: its slots and sites read, a carry written a slot
                total += n_sites - block * p.slot + len(p.group) * (1 + column.CARRY_UNITS)
            total += len(p.sites) + 2 + (column.CARRY_UNITS if p.carried else 0) + (1 + column.CARRY_UNITS) * p.low
        return total

    want = sorted((s, j) for j in range(n_slots) for s in range(block * j, n_sites))
    plans = [column.slot_passes(n_slots, n_sites, block, two) for two in (False, True)]
    plans += [column.slot_passes(n_slots, n_sites, block, two, 16) for two in (False, True)]
    for passes in plans:
        assert [p.slot for p in passes] == list(reversed(range(n_slots)))
        assert all(min(p.sites, default=n_sites) >= block * p.slot for p in passes)
        assert sorted(_pairs_read(passes, n_sites, block)) == want
    assert cost(plans[3]) <= cost(plans[1])
    if n_slots >= (17 if weight == 1.0 else 49):  # a heavier group pass pays only where more sites read it
        assert any(p.group is not None for p in plans[3])


@pytest.mark.parametrize("n_sites,block,N,d,H", [
    (17, 1, 3, 64, 2),  # head width 32; a group of 5 slots
    (17, 1, 6, 96, 2),  # head width 48 = 32 + 16; 6 tokens, a program's four and a last two
    (49, 4, 3, 64, 2),  # block:2 sites, 13 slots: a group of 5 over 33 sites, in tiles of 16
])
def test_group_passes_match_autograd(n_sites, block, N, d, H, monkeypatch):
    """A step's backward by source planned with group passes (``column_group``: a group's slots summed over
    the sites that read its top slot, then each slot finished from its carry by its own pass): every slot's
    gradient and the query gradients, against autograd of the reference."""
    monkeypatch.setattr(column, "GROUP_SLOTS", 16)
    monkeypatch.setattr(column, "GROUP_PASS_WEIGHT", 1.0)  # the byte model: groups at these small shapes
    slots = (n_sites - 1) // block + 1
    passes = column.slot_passes(slots, n_sites, block, True, column.group_slots(d, H, block))
    assert any(p.group is not None for p in passes)
    _assert_planned_passes(passes, N, d, H, n_sites, block, seed=n_sites * 3 + d)


def test_launch_table_takes_groups_for_full_grouping_from_d_1024():
    """Group passes where they were measured faster: ``full`` grouping at d = 1024 and 1280; not at d = 512,
    not for ``block:K``, not for heads too narrow for the products or too wide for the registers (AttnRes)."""
    assert column.group_slots(1024, 8) == column.group_slots(1280, 8) == 16
    assert column.group_slots(512, 8) == 0
    assert column.group_slots(1024, 8, block=8) == 0
    assert column.group_slots(1024, 128) == 0  # heads of width 8
    assert column.group_slots(1024, 1) == column.group_slots(2048, 8) == 0  # heads of width 1024 and 256


def test_a_group_slot_whose_group_pass_did_not_run_reads_every_site(monkeypatch):
    """``carried=False`` for a slot below a group's top (its group pass never ran): its own pass takes every
    site that reads it and ignores the carry."""
    monkeypatch.setattr(column, "GROUP_SLOTS", 16)
    monkeypatch.setattr(column, "GROUP_PASS_WEIGHT", 1.0)
    n, N, d, H = 17, 3, 64, 2
    src, qg, grad_out = _inputs(n, N, d, n, seed=9)
    lse = torch.randn(n, N, H)
    delta = torch.randn(n, N, H)
    rms = _rms(src)
    passes = column.slot_passes(n, n, 1, True, column.group_slots(d, H))
    below = next(p for p in passes if p.carried and p.group is None and p.carry_row > 0)
    truth, _ = column.slot_grad(src[below.slot], rms[below.slot], grad_out[below.slot:], lse[below.slot:],
                                delta[below.slot:], qg[below.slot:], H)
    dzr = torch.empty(column.dzr_rows(n, n, 1) * H * N)
    carry = column.Carry(torch.full((16, N, d), 1e3), torch.full((16, N, H), 1e3))
    got = column.run_pass(below, src, rms, grad_out, lse, delta, qg, H, 1, dzr, carry, carried=False)
    torch.testing.assert_close(got, truth)


def test_write_slot_stores_the_row_and_its_rms():
    """Several tokens a program (40 channels padded to 64: 32 tokens), the last program part-filled."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 40, generator=gen) * 3
    slot = torch.full((37, 40), float("nan"))
    rms = torch.full((37,), float("nan"))
    history.write_slot(x, slot, rms, EPS)
    torch.testing.assert_close(slot, x)
    torch.testing.assert_close(rms, _rms(x))


def _merge_kernel_at(monkeypatch, d, H, on: bool):
    """Merges at (d, H) in the merges' kernel (``on``, launched as at d = 1280) or in the row kernel."""
    table = {k: v for k, v in history.MERGE_CONFIG.items() if k != (d, H)}
    monkeypatch.setattr(history, "MERGE_CONFIG", {**table, (d, H): (4, 2)} if on else table)


@pytest.mark.parametrize("E", [1, 2, 4, 5])  # the merges' kernel takes up to history.MERGE_MAX_S = 4 sources
@pytest.mark.parametrize("with_rms", [True, False], ids=["rms", "rows"])
@pytest.mark.parametrize("d,H", [(48, 4), (32, 2)])  # head width 12 = 8 + 4, and a power of two
@pytest.mark.parametrize("merge_kernel", [True, False], ids=["merge-kernel", "row-kernel"])
def test_a_sites_merge_with_its_extra_sources_matches_the_reference(monkeypatch, E, with_rms, d, H, merge_kernel):
    """A site's partial state over a history, merged with the E sources it reads beyond it (their RMS
    statistics given, or reduced from the rows), equals one pass over all of them; in the merges' kernel,
    7 tokens on three persistent programs leave the last one a token past the end."""
    _merge_kernel_at(monkeypatch, d, H, merge_kernel)
    S, N = 3, 7
    src, qg, _ = _inputs(S + E, N, d, 1, seed=E * 10 + d)
    state, lse = torch.full((N, d), float("nan")), torch.full((1, N, H), float("nan"))
    history.sites_forward(src[:S], qg, H, EPS, state, None, lse, rms=_rms(src[:S]))
    merged = torch.full((N, d), float("nan"))
    history.sites_forward(src[S:], qg, H, EPS, merged, None, lse, init=state.unsqueeze(0),
                          rms=_rms(src[S:]) if with_rms else None)
    out, ref_lse = _route(src.double(), qg[0].double(), H)
    torch.testing.assert_close(merged, out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0], ref_lse.t().float(), rtol=1e-5, atol=1e-5)


def test_write_slot_adds_a_blocks_last_output():
    """A block's slot is its partial sum plus its last output, added in the pass that writes the slot."""
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, 9, 40, generator=gen)
    slot, rms = torch.full((9, 40), float("nan")), torch.full((9,), float("nan"))
    history.write_slot(x, slot, rms, EPS, addend=y)
    torch.testing.assert_close(slot, x + y, rtol=0, atol=0)
    torch.testing.assert_close(rms, _rms(x + y))


@pytest.mark.parametrize("d,H", [(48, 4), (32, 2)])  # head width 12 = 8 + 4, and a power of two
@pytest.mark.parametrize("merge_kernel", [True, False], ids=["merge-kernel", "row-kernel"])
def test_a_site_routes_the_sum_it_makes_and_writes_it(monkeypatch, d, H, merge_kernel):
    """A site reading a block's partial sum and the block's last output routes their sum (made in its own
    pass, written for the sites after it) exactly as if the sum had been made first."""
    _merge_kernel_at(monkeypatch, d, H, merge_kernel)
    N = 5
    src, qg, _ = _inputs(3, N, d, 1, seed=d)
    state = torch.randn(1, N, d, generator=torch.Generator().manual_seed(1))
    lse0 = torch.randn(1, N, H)
    want, want_lse = torch.empty(N, d), lse0.clone()
    history.sites_forward((src[0] + src[1]).unsqueeze(0), qg, H, EPS, want, None, want_lse, init=state)
    got, got_lse, summed = torch.empty(N, d), lse0.clone(), torch.full((N, d), float("nan"))
    history.sites_forward(src[:1], qg, H, EPS, got, None, got_lse, init=state, addend=src[1], sum_out=summed)
    torch.testing.assert_close(summed, src[0] + src[1], rtol=0, atol=0)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)
    with pytest.raises(ValueError, match="one source"):
        history.sites_forward(src[:2], qg, H, EPS, got, None, got_lse, addend=src[1], sum_out=summed)


@pytest.mark.parametrize("d,H", [(48, 4), (32, 2)])
@pytest.mark.parametrize("merge_kernel", [True, False], ids=["merge-kernel", "row-kernel"])
def test_a_partial_sums_statistics_are_kept_for_the_backward(monkeypatch, d, H, merge_kernel):
    """A site that reduces its block partial sum's RMS statistic from the row (the sum it makes, here) writes
    it to ``rms_out`` and nothing beyond (7 tokens on three persistent programs in the merges' kernel); the
    backward that reads it instead of reducing the row again gives the same gradients."""
    _merge_kernel_at(monkeypatch, d, H, merge_kernel)
    N = 7
    src, qg, grad_out = _inputs(2, N, d, 1, seed=d + 1)
    state = torch.randn(1, N, d, generator=torch.Generator().manual_seed(5))
    out, lse, summed = torch.empty(N, d), torch.randn(1, N, H), torch.empty(N, d)
    kept = torch.full((2, N), float("nan"))
    history.sites_forward(src[:1], qg, H, EPS, out, None, lse, init=state, addend=src[1], sum_out=summed,
                          rms_out=kept[:1])
    torch.testing.assert_close(kept[0], _rms(src[0] + src[1]))
    assert kept[1].isnan().all()
    grads = []
    for rms in (None, kept[:1], 1.5 * kept[:1]):  # (the last: the statistic is read, not reduced again)
        got, dqg = torch.full((1, N, d), float("nan")), torch.zeros(1, d)
        history.sites_backward(summed.unsqueeze(0), got, None, qg, H, EPS, grad_out, lse, torch.empty(1, N, H),
                               out=out, dqg=dqg, rms=rms)
        grads.append((got, dqg))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(grads[2][0], grads[0][0], rtol=1e-2)
    with pytest.raises(ValueError, match="rms_out"):
        history.sites_forward(src[:1], qg, H, EPS, out, None, lse, init=state, rms=kept[:1], rms_out=kept[1:])


@pytest.mark.parametrize("in_place", [False, True], ids=["base", "in-place"])
def test_sites_backward_adds_a_base_and_sums_the_query_gradients(in_place):
    """The partial sum's gradient is this site's share plus the one the later sums passed back (a separate
    tensor, or the output itself); the site's query-row gradient is added into the step's row."""
    N, d, H = 7, 48, 4
    src, qg, grad_out = _inputs(1, N, d, 1, seed=9)
    out = torch.randn(N, d, generator=torch.Generator().manual_seed(2))
    lse = torch.randn(1, N, H)
    plain, delta = torch.empty(1, N, d), torch.empty(1, N, H)
    table, copy = torch.full((3,), -1, dtype=torch.int64), torch.full((1, N, d), float("nan"))
    parts = history.sites_backward(src, plain, None, qg, H, EPS, grad_out, lse, delta, out=out, grad_copy=copy,
                                   record=(table[1:2], 123456789))
    assert table.tolist() == [-1, 123456789, -1]  # where the site's output gradient lies, and nothing else
    assert torch.equal(copy, grad_out)  # or its copy, for the widths that copy it
    base = torch.randn(1, N, d, generator=torch.Generator().manual_seed(3))
    got = base.clone() if in_place else torch.full((1, N, d), float("nan"))
    dqg = torch.randn(1, d, generator=torch.Generator().manual_seed(4))
    start = dqg.clone()
    assert history.sites_backward(src, got, got if in_place else base, qg, H, EPS, grad_out, lse, delta.clone(),
                                  out=out, dqg=dqg) is None
    torch.testing.assert_close(got, plain + base)
    torch.testing.assert_close(dqg, start + parts.sum(0)[:1])


@pytest.mark.parametrize("P,G,d", [(1, 1, 5), (9, 2, 40), (13, 3, 16)])
def test_add_row_sums_adds_every_program_row(P, G, d):
    """Row counts and widths that are not a multiple of the tile; the output rows strided (a slice of the
    step's (sites, d) rows)."""
    gen = torch.Generator().manual_seed(P * d)
    parts = torch.randn(P, G + 1, d, generator=gen)[:, :G]
    rows = torch.randn(2 * G, d, generator=gen)
    out, between = rows[::2], rows[1::2].clone()
    want = out + parts.sum(0)
    history.add_row_sums(parts, out)
    torch.testing.assert_close(out, want)
    assert torch.equal(rows[1::2], between)  # the rows between are not touched
    with pytest.raises(ValueError, match="add_row_sums"):
        history.add_row_sums(parts.double(), out)
