"""The fused routed path (residual.backend=triton, through Triton's interpreter on CPU) against the
reference path: same loss and every gradient, in fp32, on tiny models; checkpointing; saved memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mhar_ablate.config import build_config
from mhar_ablate.model import Decoder
from mhar_ablate.variants.fused import FusedState, plan_sites

VOCAB = 64


def _pair(kind="mhar", grouping="full", heads=None, d=32, layers=2, sites_per_pass=2):
    """A reference-path model and a fused-path copy with the same (non-trivial) weights."""
    over = {"residual.kind": kind, "residual.grouping": grouping, "residual.query_init": "normal:0.5",
            "residual.backend": "reference", "model.d_model": str(d), "model.n_layers": str(layers),
            "model.n_heads": "2", "model.n_kv_heads": "1", "model.ffn": "48"}
    if heads is not None:
        over["residual.heads"] = str(heads)
    cfg = build_config(overrides=over)
    torch.manual_seed(3)
    ref = Decoder(cfg.model, cfg.residual, VOCAB)
    with torch.no_grad():  # key gains away from 1, so that their gradients and the queries' differ
        ref.residual.key_weight.add_(0.3 * torch.randn_like(ref.residual.key_weight))
        for name, p in ref.named_parameters():  # and the norms' gains, which the fused path folds in
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    fused = copy.deepcopy(ref)
    fused.residual.backend = "triton"
    fused.residual.sites_per_pass = sites_per_pass
    return ref, fused


def _loss_and_grads(model, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(idx).view(-1, VOCAB), targets.view(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(ref, fused, idx=None, atol=2e-6):
    idx = torch.randint(0, VOCAB, (2, 5)) if idx is None else idx
    targets = torch.randint(0, VOCAB, idx.shape)
    loss_r, grads_r = _loss_and_grads(ref, idx, targets)
    loss_f, grads_f = _loss_and_grads(fused, idx, targets)
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-5, atol=1e-6)
    for name, g in grads_r.items():
        assert g.abs().sum() > 0 or name.startswith("residual.") or "norm" in name, name
        torch.testing.assert_close(grads_f[name], g, rtol=2e-4, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind,grouping,heads,d,layers,sites_per_pass", [
    ("mhar", "full", 4, 32, 2, 2),  # groups [0, 1], [2, 3], [4]: shared history, in-group merges, a lone site
    ("mhar", "full", 4, 48, 2, 3),  # head width 12 = 8 + 4 (the split tile), a group of three
    ("attnres", "full", None, 32, 2, 4),  # H = 1, one group of four then the final site
    ("mhar", "layer", 2, 32, 2, 4),  # block sources with a partial sum inside each block
    ("mhar", "block:2", 8, 32, 3, 2),  # the last block unfinished: the final site sees its partial sum
])
@pytest.mark.parametrize("fold", [False, True], ids=["norms-in-sublayers", "norms-folded"])
def test_fused_matches_reference_in_fp32(kind, grouping, heads, d, layers, sites_per_pass, fold, monkeypatch):
    from mhar_ablate.variants import fused

    monkeypatch.setattr(fused, "FOLD_NORMS", fold)
    ref, fused_model = _pair(kind, grouping, heads, d, layers, sites_per_pass)
    _assert_same(ref, fused_model)


@pytest.mark.parametrize("grouping", ["full", "block:2"])
@pytest.mark.parametrize("fold", [False, True], ids=["norms-in-sublayers", "norms-folded"])
def test_fused_matches_reference_with_output_gradients_copied(grouping, fold, monkeypatch):
    """The widths whose backward copies each site's output gradient into one buffer (``column.grads_in_place``
    False, d = 1280) rather than reading it where autograd left it, as these small widths do (folded, the
    output's gradient is made from the normed input's and written to the buffer, or over the normed one's)."""
    from mhar_ablate.kernels import column
    from mhar_ablate.variants import fused

    assert column.grads_in_place(32) and not column.grads_in_place(1280)
    monkeypatch.setattr(column, "GRADS_IN_PLACE", False)
    monkeypatch.setattr(fused, "FOLD_NORMS", fold)
    ref, fused = _pair("mhar", grouping, 4, 32, 3, 2)
    _assert_same(ref, fused)



@pytest.mark.parametrize("grouping,d", [("full", 48), ("block:2", 48), ("block:2", 32)])
@pytest.mark.parametrize("fold", [False, True], ids=["norms-in-sublayers", "norms-folded"])
def test_fused_matches_reference_with_the_merges_kernel(grouping, d, fold, monkeypatch):
    """The merges in their own kernel (``history._merge_fwd_kernel``, which the launch table takes at d = 1280)
    at a head width split 8 + 4 and a power of two: folded, it writes the pre-norm and keeps its statistics
    for the backward; in block grouping it keeps the partial sum's RMS too."""
    from mhar_ablate.kernels import history
    from mhar_ablate.variants import fused

    monkeypatch.setattr(history, "MERGE_CONFIG", {**history.MERGE_CONFIG, (d, 4): (4, 2)})
    monkeypatch.setattr(fused, "FOLD_NORMS", fold)
    ref, fused_model = _pair("mhar", grouping, 4, d, 3, 2)
    _assert_same(ref, fused_model)


def test_fused_matches_reference_with_group_passes(monkeypatch):
    """The backward by source with group passes (``kernels/column_group.py``, which the launch table takes
    from d = 1024 on): 8 layers, 17 slots, of which a group of five is summed in one pass."""
    from mhar_ablate.kernels import column

    monkeypatch.setattr(column, "GROUP_SLOTS", 16)
    monkeypatch.setattr(column, "GROUP_PASS_WEIGHT", 1.0)  # the byte model: a group at this small depth
    passes = column.slot_passes(17, 17, 1, column.pairs_slots(64), column.group_slots(64, 2))
    assert any(p.group is not None for p in passes)
    ref, fused = _pair("mhar", "full", 2, 64, 8, 4)
    # Eight layers deep the fp32 gradients differ by up to 5e-6 between two orders of summation (either way
    # the sublayers' norms are computed: 3e-6 with them in the sublayers).
    _assert_same(ref, fused, idx=torch.randint(0, VOCAB, (1, 4)), atol=1e-5)


@pytest.mark.parametrize("grouping", ["full", "block:2"])
def test_fused_matches_reference_with_stacked_shared_passes(grouping, monkeypatch):
    """The shared passes (groups of four sites) in the stacked products' form (several tokens' sources in a
    tile's rows, ``history.HISTORY_STACKED_CONFIG``), at a head width split 32 + 16."""
    from mhar_ablate.kernels import history

    monkeypatch.setattr(history, "HISTORY_STACKED_CONFIG", (32, 1, 3, 16))
    calls, real_launch = [], history.shared.launch

    def launch(kernel, grid, args, meta, device):
        calls.append(kernel.fn.__name__)
        real_launch(kernel, grid, args, meta, device)

    for form in (history.shared, history.shared_dot, history.shared_stacked):  # the shared pass's launches
        monkeypatch.setattr(form, "launch", launch)
    ref, fused_model = _pair("mhar", grouping, 2, 96, 3, 4)
    _assert_same(ref, fused_model)
    assert "_history_fwd_stacked_kernel" in calls and "_history_fwd_kernel" not in calls


@pytest.mark.parametrize("grouping", ["full", "block:2"])
def test_sublayer_norms_are_computed_in_the_routing_kernels(grouping, monkeypatch):
    """Folded (the model's ``fold_norms``, from ``fused.FOLD_NORMS`` when it is built), every sublayer's
    pre-norm runs inside the site's kernels (the merge's or its own row pass forward, the prologue backward),
    not as the sublayer's module; the final norm stays the head's. Switched off on the same model, the
    sublayers normalise their inputs themselves, with the same result."""
    from mhar_ablate.variants import fused
    from mhar_ablate.norm import RMSNorm

    monkeypatch.setattr(fused, "FOLD_NORMS", True)
    calls = []
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: calls.append(self) or forward(self, x))
    ref, model = _pair("mhar", grouping, 4, 32, 3, 2)
    idx = torch.randint(0, VOCAB, (2, 5))
    targets = torch.randint(0, VOCAB, idx.shape)
    folded = _loss_and_grads(model, idx, targets)
    modules = [m for m in calls if m is not model.norm and m.weight.shape[0] == 32]
    assert not modules  # (the attention's per-head QK-norms are narrower)
    model.residual.fold_norms = False
    calls.clear()
    unfolded = _loss_and_grads(model, idx, targets)
    assert len([m for m in calls if m is not model.norm and m.weight.shape[0] == 32]) == len(model.sublayers)
    torch.testing.assert_close(folded[0], unfolded[0], rtol=1e-5, atol=1e-6)
    for name, g in unfolded[1].items():
        torch.testing.assert_close(folded[1][name], g, rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


def test_norms_are_folded_by_default_where_the_grouping_was_measured_faster(monkeypatch):
    """``fused.FOLD_NORMS_BY_GROUPING``: block:K models (layer is block:1) fold their sublayers' pre-norms into
    the routing kernels, full ones not; ``FOLD_NORMS`` overrides it; kinds that cannot fold never do."""
    from mhar_ablate.variants import fused

    monkeypatch.setattr(fused, "FOLD_NORMS", None)
    built = {(kind, grouping): _pair(kind, grouping, 4 if kind == "mhar" else None)[0].residual.fold_norms
             for kind in ("mhar", "attnres") for grouping in ("full", "layer", "block:2")}
    assert built == {("mhar", "full"): False, ("mhar", "layer"): True, ("mhar", "block:2"): True,
                     ("attnres", "full"): False, ("attnres", "layer"): True, ("attnres", "block:2"): True}
    monkeypatch.setattr(fused, "FOLD_NORMS", False)
    assert not _pair("mhar", "block:2", 4)[0].residual.fold_norms
    monkeypatch.setattr(fused, "FOLD_NORMS", True)
    assert _pair("mhar", "full", 4)[0].residual.fold_norms
    assert not _pair("delta", "block:2", 4)[0].residual.fold_norms


def test_site_plans_cover_every_site_once_and_stay_inside_blocks():
    for sublayers, per_pass in ((1, 4), (4, 4), (6, 4), (2, 8)):
        plans = plan_sites(25, sublayers, per_pass)
        for s, p in enumerate(plans):
            assert p.start + p.k == s and 0 <= p.k < p.size <= per_pass
            assert plans[p.start].k == 0 and plans[p.start].size == p.size
            if sublayers > 1:  # a group never spans two blocks: one history for all its sites
                assert p.start // sublayers == s // sublayers and p.history == 1 + s // sublayers
            else:
                assert p.history == p.start + 1


def test_checkpointed_sublayers_give_the_same_gradients():
    ref, fused = _pair("mhar", "full", 4)
    for layer in fused.sublayers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward, **kw: checkpoint(_f, *a, use_reentrant=False, **kw)
    _assert_same(ref, fused)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_the_routing_itself_is_refused(reentrant):
    _, fused = _pair("mhar", "full", 4)
    read = fused.residual.read
    fused.residual.read = lambda state, site: checkpoint(read, state, site, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="checkpoint the sublayers only"):
        # reentrant: refused in forward (run without grad); non-reentrant: when backward recomputes it
        fused(torch.randint(0, VOCAB, (1, 4))).sum().backward()


def test_fused_path_saves_no_per_site_copies_of_the_history():
    """Saved for backward, beyond what the baseline saves: O(sites) tensors of (N, d), not O(sites^2)."""

    def saved_elements(model, idx):
        seen: dict[tuple[int, int], int] = {}

        def pack(t):
            seen[(t.untyped_storage().data_ptr(), t.numel())] = t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx).sum()
        return sum(seen.values())

    layers, d, idx = 6, 32, torch.randint(0, VOCAB, (1, 4))
    ref, fused = _pair("mhar", "full", 4, d, layers)
    base = Decoder(ref.cfg, build_config(overrides={"residual.kind": "baseline"}).residual, VOCAB)
    n_sites, tokens = 2 * layers + 1, idx.numel()
    extra_fused = saved_elements(fused, idx) - saved_elements(base, idx)
    extra_ref = saved_elements(ref, idx) - saved_elements(base, idx)
    # per site: its output (and a block's partial sum); the source buffer itself is not saved, it is kept
    assert extra_fused <= n_sites * (tokens * d + 4 * d)
    assert extra_ref > 3 * extra_fused  # the stacked reference grows with sites^2


def test_backend_choice():
    ref, fused = _pair("mhar", "full", 4)
    x0 = torch.zeros(1, 2, 32)
    assert not ref.residual.uses_fused(x0) and fused.residual.uses_fused(x0)
    ref.residual.backend = "auto"  # on CPU tensors auto is the reference path
    assert not ref.residual.uses_fused(x0)
    assert isinstance(fused.residual.start(x0), FusedState)
    with pytest.raises(ValueError, match="power of two"):
        cfg = build_config(overrides={"residual.heads": "3", "model.d_model": "48", "residual.backend": "triton"})
        Decoder(cfg.model, cfg.residual, VOCAB)


def test_recorded_depth_weights_match_the_reference():
    ref, fused = _pair("mhar", "block:2", 4, 32, 3)
    idx = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        ref.eval()(idx)
        fused.eval()(idx)
    for a, b in zip(ref.residual.last_weights(), fused.residual.last_weights()):
        torch.testing.assert_close(b, a)


def test_buffers_are_freed_after_backward():
    """The per-pass state (source buffer, gradient buffer, groups) lives exactly as long as the graph:
    freed by reference counting, with no cycle left for the garbage collector."""
    import weakref

    _, fused = _pair("mhar", "block:2", 4, 32, 3)
    states = []
    start = fused.residual.start
    fused.residual.start = lambda x0: states.append(start(x0)) or states[-1]
    fused(torch.randint(0, VOCAB, (1, 4))).sum().backward()
    ref = weakref.ref(states.pop())
    assert ref() is None


def test_buffers_are_freed_when_backward_ends_while_the_loss_lives():
    """A training loop keeps its loss tensor until the next step, and with it the autograd nodes that hold
    the pass's state: the buffers themselves are dropped when the backward ends, so that one pass's do not
    overlap the next's. A second backward through the same graph then says why it cannot run."""
    import weakref

    _, fused = _pair("mhar", "full", 4, 32, 3)
    states = []
    start = fused.residual.start
    fused.residual.start = lambda x0: states.append(start(x0)) or states[-1]
    loss = fused(torch.randint(0, VOCAB, (1, 4))).sum()
    state = states.pop()
    buffers = [weakref.ref(t) for t in (state.buffer, state.rms, state.lse)]
    del state
    loss.backward(retain_graph=True)
    assert all(ref() is None for ref in buffers)
    with pytest.raises(RuntimeError, match=r"second backward \(retain_graph=True\) needs residual.backend=reference"):
        loss.backward()


def test_wide_heads_share_passes_two_sites_at_most():
    """A head wider than the head-tiled pass takes (AttnRes at d > 256) would not fit its registers: such
    models route at most two sites a pass, whatever sites_per_pass asks."""
    from mhar_ablate.variants.fused import HEAD_TILED_MAX_WIDTH, ROW_PASS_MAX_SITES

    d = 2 * HEAD_TILED_MAX_WIDTH
    _, fused = _pair("attnres", "full", None, d, 2, sites_per_pass=4)
    state = fused.residual.start(torch.zeros(1, 2, d))
    assert max(p.size for p in state.plans) == ROW_PASS_MAX_SITES
    _, narrow = _pair("mhar", "full", 4, 32, 2, sites_per_pass=4)
    assert max(p.size for p in narrow.residual.start(torch.zeros(1, 2, 32)).plans) == 4


def test_compiled_loss_keeps_the_head_with_the_cross_entropy():
    # The fused path breaks the compiled graph at every read and write; the loss must still put the output
    # head and the cross-entropy in one graph, as an unbroken baseline has them (split, the loss's graph held
    # a second logits-sized tensor at the step's peak), and compute the same loss.
    from mhar_ablate.training.step import make_loss

    _, fused = _pair()
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    idx, targets = torch.randint(0, VOCAB, (2, 5)), torch.randint(0, VOCAB, (2, 5))
    compiled = torch.compile(make_loss(fused, None), backend=record)
    loss = compiled(idx, targets)
    torch._dynamo.reset()
    torch.testing.assert_close(loss, F.cross_entropy(fused(idx).view(-1, VOCAB), targets.view(-1)))
    assert len(graphs) > 2, "expected the fused path to break the graph"
    tail = [g for g in graphs if any("cross_entropy" in t for t in g)]
    assert len(tail) == 1 and any("function linear" in t for t in tail[0]), graphs


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_a_site_whose_input_reaches_no_loss_contributes_nothing(in_place, monkeypatch):
    """Site 1's input is read but not used (its sublayer's output is a function of site 0's input alone), so
    its backward never runs: the slots' passes must read zeros for it, whether they read the output gradients
    in place or copied, and every gradient matches the reference path's."""
    from mhar_ablate.kernels import column

    monkeypatch.setattr(column, "GRADS_IN_PLACE", in_place)
    ref, fused = _pair("mhar", "full", 4, 32, 2, 1)
    x0 = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(5))
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(6)) / 32 ** 0.5

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        embedded = x0.clone().requires_grad_(True)
        res = model.residual
        state = res.start(embedded)
        first = res.read(state, 0)
        for site in range(res.n_sites - 1):
            x = first if site == 0 else res.read(state, site)  # sites 1.. read and dropped
            res.write(state, site, torch.tanh((first if site == 1 else x) @ w))
        loss = (res.finish(state) ** 2).sum()
        loss.backward()
        return loss.detach(), embedded.grad, res.query.grad, res.key_weight.grad

    for got, want in zip(loss_and_grads(fused), loss_and_grads(ref)):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-6)
