"""The decoder and its routed residual streams: the method's math, causality, and parameters."""

from __future__ import annotations

import pytest
import torch

from mhar_ablate.config import build_config
from mhar_ablate.errors import UsageError
from mhar_ablate.model import Decoder, count_parameters, routing_overhead
from mhar_ablate.model.transformer import Attention
from mhar_ablate.ops import mhar_route

GROUPINGS = ["full", "layer", "block:2", "block:3", "block:4"]


def attnres_by_hand(sources, q, g, eps=1e-6):
    """Single-head Attention Residuals written out source by source, independent of the package."""
    S = sources.shape[0]
    keys = [g * s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) for s in sources]
    logits = torch.stack([(k * q).sum(-1) for k in keys])  # (S, B, T)
    w = torch.exp(logits - logits.max(0).values)
    w = w / w.sum(0)
    return sum(w[i].unsqueeze(-1) * sources[i] for i in range(S))


def test_single_head_is_attnres():
    s = torch.randn(5, 2, 7, 24, dtype=torch.float64)
    q, g = torch.randn(24, dtype=torch.float64), torch.rand(24, dtype=torch.float64) + 0.5
    out = mhar_route(s, q, g, 1, backend="reference")
    torch.testing.assert_close(out, attnres_by_hand(s, q, g))


def test_heads_are_independent_softmaxes_over_full_d_rms():
    s = torch.randn(4, 1, 3, 32, dtype=torch.float64)
    q, g = torch.randn(32, dtype=torch.float64), torch.rand(32, dtype=torch.float64) + 0.5
    H, dh = 4, 8
    out = mhar_route(s, q, g, H, backend="reference")
    rms = torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6)  # over the full d, before the split
    for h in range(H):
        c = slice(h * dh, (h + 1) * dh)
        logits = ((s[..., c] / rms[..., :]) * g[c] * q[c]).sum(-1)
        w = logits.softmax(0)
        torch.testing.assert_close(out[..., c], (w.unsqueeze(-1) * s[..., c]).sum(0))


def test_zero_query_gives_uniform_mean():
    s = torch.randn(6, 2, 5, 16)
    out = mhar_route(s, torch.zeros(16), torch.rand(16), 4, backend="reference")
    torch.testing.assert_close(out, s.mean(0), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", [
    dict(sources=torch.randn(3, 2, 4, 10), num_heads=4),  # H does not divide d
    dict(sources=torch.randn(0, 2, 4, 8), num_heads=2),  # S = 0
    dict(sources=torch.randn(2, 4, 8), num_heads=2),  # not 4-D
    dict(sources=torch.randn(3, 2, 4, 8), num_heads=2, query=torch.zeros(7)),  # query shape
    dict(sources=torch.randn(3, 2, 4, 8), num_heads=2, key_weight=torch.zeros(8, 1)),  # key shape
    dict(sources=torch.randn(3, 2, 4, 8), num_heads=0),
    dict(sources=torch.randn(3, 2, 4, 8), num_heads=2, backend="cuda-magic"),
])
def test_route_rejects_bad_arguments(bad):
    d = bad["sources"].shape[-1] if bad["sources"].dim() else 8
    args = dict(query=torch.zeros(d), key_weight=torch.ones(d), backend="reference") | bad
    with pytest.raises(ValueError):
        mhar_route(args.pop("sources"), args.pop("query"), args.pop("key_weight"), args.pop("num_heads"), **args)


def _model(kind="mhar", grouping="full", heads=None, query_init="normal:0.5", vocab=64, **model):
    over = {"residual.kind": kind, "residual.grouping": grouping, "residual.query_init": query_init,
            "residual.backend": "reference"}
    if heads is not None:
        over["residual.heads"] = heads
    over.update({f"model.{k}": v for k, v in model.items()})
    cfg = build_config(overrides=over)
    torch.manual_seed(1)
    return Decoder(cfg.model, cfg.residual, vocab).double()


def _site_inputs(model, idx, perturb_site=None):
    """Every sublayer's input, optionally with one sublayer's output perturbed."""
    inputs, hooks = [], []
    for i, layer in enumerate(model.sublayers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach().clone())))
        if i == perturb_site:
            hooks.append(layer.register_forward_hook(lambda m, a, out: out + torch.randn_like(out)))
    model(idx)
    for h in hooks:
        h.remove()
    return inputs


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_sites_only_see_already_computed_sources(grouping):
    model = _model(grouping=grouping, n_layers=4).eval()
    idx = torch.randint(0, 64, (2, 9))
    clean = _site_inputs(model, idx)
    for j in range(len(model.sublayers)):
        torch.manual_seed(j)
        dirty = _site_inputs(model, idx, perturb_site=j)
        for i in range(j + 1):  # sites up to and including j read before j's output exists
            torch.testing.assert_close(dirty[i], clean[i], rtol=0, atol=0)
        if j + 1 < len(model.sublayers):  # and the next site does see it (routing is not a no-op)
            assert not torch.equal(dirty[j + 1], clean[j + 1])


@pytest.mark.parametrize("kind,grouping", [("baseline", "full"), ("attnres", "full"), ("mhar", "full"),
                                           ("mhar", "block:3")])
def test_model_is_causal_in_time(kind, grouping):
    model = _model(kind=kind, grouping=grouping).eval()
    idx = torch.randint(0, 64, (1, 12))
    logits = model(idx)
    idx2 = idx.clone()
    idx2[0, 7] = (idx[0, 7] + 1) % 64
    logits2 = model(idx2)
    torch.testing.assert_close(logits[:, :7], logits2[:, :7])
    assert not torch.allclose(logits[:, 7:], logits2[:, 7:])


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_source_counts_per_site(grouping):
    model = _model(grouping=grouping, n_layers=4)
    res = model.residual
    model.eval()
    model(torch.randint(0, 64, (1, 5)))
    per = {"full": 1, "layer": 2}.get(grouping) or 2 * int(grouping.split(":")[1])
    for site, w in enumerate(res.last_weights()):
        expected = 1 + site // per + (1 if site % per else 0)
        assert w.shape == (expected, res.num_heads)
        torch.testing.assert_close(w.sum(0), torch.ones(res.num_heads, dtype=w.dtype))
    assert len(res.last_weights()) == 2 * 4 + 1
    if grouping == "full":
        assert res.last_weights()[-1].shape[0] == 2 * 4 + 1


def test_recorded_depth_weights_are_the_mean_over_batch_and_positions():
    # Recorded a sequence at a time (to bound an evaluation's memory): the same as over the whole batch.
    from mhar_ablate.kernels.reference import routing_weights

    torch.manual_seed(0)
    model = _model(heads=4, query_init="normal:0.3", n_layers=2).eval()
    res = model.residual
    stacked = torch.randn(3, 5, 7, model.cfg.d_model)
    res.store_weights(2, stacked)
    whole = routing_weights(stacked, res.query[2], res.key_weight[2], res.num_heads, res.eps).mean(dim=(1, 2))
    torch.testing.assert_close(res._weights[2], whole)
    assert not torch.allclose(whole, torch.full_like(whole, 1 / 3))  # not the uniform mixture of a zero query


@pytest.mark.parametrize("query_init", ["zeros", "normal:0.3"])
def test_gradients_reach_every_routing_parameter(query_init):
    model = _model(heads=4, query_init=query_init)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    # Site 0 mixes a single source (the embedding): its softmax is constant, so it has no gradient.
    q, g = model.residual.query.grad[1:], model.residual.key_weight.grad[1:]
    assert (q.abs().sum(-1) > 0).all(), "every site with two or more sources gets a query gradient"
    if query_init != "zeros":  # with zero queries the key gains are exactly stationary: z = q . k = 0
        assert (g.abs().sum(-1) > 0).all()


def test_zero_query_init_starts_uniform():
    model = _model(query_init="zeros").eval()
    model(torch.randint(0, 64, (1, 6)))
    for w in model.residual.last_weights():
        torch.testing.assert_close(w, torch.full_like(w, 1.0 / w.shape[0]))


def test_routing_parameters_take_no_weight_decay():
    model = _model()
    groups = model.param_groups(0.1)
    routing = [gr for gr in groups if "routing" in gr["name"]]
    assert len(routing) == 1 and routing[0]["weight_decay"] == 0.0
    ids = {id(p) for p in routing[0]["params"]}
    assert ids == {id(model.residual.query), id(model.residual.key_weight)}
    decayed = {id(p) for gr in groups if gr["weight_decay"] > 0 for p in gr["params"]}
    assert not ids & decayed
    assert sum(len(gr["params"]) for gr in groups) == len(list(model.parameters()))


def test_baseline_is_the_plain_residual_sum():
    model = _model(kind="baseline").eval()
    inputs = []
    outputs = []
    for layer in model.sublayers:
        layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        layer.register_forward_hook(lambda m, a, o: outputs.append(o))
    idx = torch.randint(0, 64, (1, 5))
    model(idx)
    h = model.embed(idx)
    for x, out in zip(inputs, outputs):
        torch.testing.assert_close(x, h)
        h = h + out


def test_qwen3_attention_pieces_present():
    model = _model()
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    assert attn.n_kv < attn.n_heads  # grouped-query attention
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    assert not any("lm_head" in n for n, _ in model.named_parameters())
    # Tied: the output projection reads the embedding matrix. Token 7 is not in the input, so only
    # the output projection can see a change to its row.
    model.eval()
    idx = torch.tensor([[1, 2, 3]])
    before = model(idx)
    with torch.no_grad():
        model.embed.weight[7] += 1.0
    after = model(idx)
    assert not torch.allclose(before[..., 7], after[..., 7])
    torch.testing.assert_close(before[..., :7], after[..., :7])


def test_parameter_counts_on_meta_match_paper_overhead():
    for preset in ("paper100m", "paper350m", "paper1b"):
        cfg = build_config(overrides={"model.preset": preset, "residual.kind": "mhar"})
        n, nb, pct = routing_overhead(cfg.model, cfg.residual)
        assert n - nb == 2 * (2 * cfg.model.n_layers + 1) * cfg.model.d_model
        assert 0.01 < pct < 0.03  # the paper: about 0.02 %
    cfg = build_config(overrides={"model.preset": "paper1b", "residual.kind": "baseline"})
    assert 1.0e9 < count_parameters(cfg.model, cfg.residual) < 1.2e9


@pytest.mark.parametrize("override,needle", [
    ({"residual.heads": "5"}, "does not divide"),
    ({"residual.grouping": "block:0"}, "at least 1"),
    ({"residual.grouping": "block:9"}, "larger than"),
    ({"residual.grouping": "rows"}, "grouping"),
    ({"residual.kind": "hyper"}, "unknown residual.kind"),
    ({"residual.kind": "attnres", "residual.heads": "4"}, "single-head"),
    ({"residual.query_init": "normal:-1"}, "positive"),
    ({"model.d_modle": "64"}, "unknown config key"),
    ({"model.preset": "huge"}, "unknown config"),
    ({"train.time": "-5m"}, "positive"),
    ({"seed": "abc"}, "expected int"),
])
def test_bad_config_is_one_clear_error(override, needle):
    with pytest.raises(UsageError, match=needle):
        build_config(overrides=override)


def test_presets_fit_every_study_arm():
    cfg = build_config()
    assert cfg.model.d_model % 16 == 0 and cfg.model.n_layers % 4 == 0 and cfg.model.n_layers >= 4
    for h in (1, 2, 4, 8, 16):
        build_config(overrides={"residual.heads": str(h)})


def _plain_tied_loss(model, idx, targets):
    """The loss with the tied weight used twice the ordinary way (autograd adds its two gradients)."""
    w = model.embed.weight
    h = model.hidden(torch.nn.functional.embedding(idx, w))
    logits = torch.nn.functional.linear(model.norm(h), w)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("kind", ["baseline", "mhar"])
def test_tied_weight_gradient_is_lookup_plus_head(kind):
    """The one-node tie (embed_tokens) gives the tied weight the gradient of its two uses, repeated tokens
    included, and the loss make_loss trains on is the model's."""
    from mhar_ablate.training.step import make_loss

    model = _model(kind=kind)
    idx = torch.tensor([[3, 3, 5, 9, 3, 1, 5], [0, 3, 63, 63, 2, 2, 7]])
    targets = torch.randint(0, 64, idx.shape, generator=torch.Generator().manual_seed(0))
    _plain_tied_loss(model, idx, targets).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = make_loss(model, None)(idx, targets)
    loss.backward()
    logits = model(idx).float()
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-12, atol=1e-14, msg=n)


def test_tied_weight_gradient_of_lookup_alone():
    """Hidden states only (the head unused): the tied weight's gradient is the lookup's rows alone."""
    model = _model()
    idx = torch.tensor([[4, 4, 8]])
    x, _ = model.embed_tokens(idx)
    model.hidden(x).sum().backward()
    grad = model.embed.weight.grad
    assert set(grad.abs().sum(1).nonzero().flatten().tolist()) == {4, 8}


def test_tied_weight_takes_no_vocabulary_sized_sum():
    """Backward allocates one vocabulary-sized buffer for the tied weight (the head's gradient, into which
    the lookup's rows go), where two uses of a plain weight allocate three (the head's, the lookup's zeroed
    buffer, their sum)."""
    from torch.profiler import profile

    model = _model(vocab=4096)
    size = model.embed.weight.numel() * model.embed.weight.element_size()
    idx = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(0))

    def vocabulary_buffers(loss_fn) -> int:
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        with profile(profile_memory=True) as prof:
            loss.backward()
        # Allocations of the weight's size by an aten op (the enclosing ranges repeat the same bytes).
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_memory_usage == size
                   and not any(c.name.startswith("aten::") and c.cpu_memory_usage == size for c in e.cpu_children))

    assert vocabulary_buffers(lambda: _plain_tied_loss(model, idx, idx)) == 3
    assert vocabulary_buffers(lambda: torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())) == 1


def test_untied_and_no_grad_paths_use_the_weights_directly():
    model = _model(tie_embeddings=False)
    idx = torch.tensor([[1, 2]])
    x, w = model.embed_tokens(idx)
    assert w is model.lm_head.weight and x.grad_fn is not None and "TiedEmbedding" not in type(x.grad_fn).__name__
    with torch.no_grad():
        x, w = _model().embed_tokens(idx)
    assert x.grad_fn is None


@pytest.mark.parametrize("backend,node", [("triton", "TiedEmbeddingBackward"), ("reference", "EmbeddingBackward0")])
def test_compiled_model_ties_in_one_node_only_where_it_breaks_the_graph(backend, node):
    """Compiled, the fused path is several graphs anyway and takes the one-node tie; a model that compiles
    into one graph (here the reference path) keeps the plain lookup, whose gradient sum the compiler fuses."""
    cfg = build_config(overrides={"model.preset": "tiny", "residual.kind": "mhar", "residual.backend": backend})
    model = Decoder(cfg.model, cfg.residual, 64)
    torch._dynamo.reset()
    x, _ = torch.compile(model.embed_tokens, backend="eager")(torch.tensor([[1, 2, 3]]))
    torch._dynamo.reset()
    assert type(x.grad_fn).__name__ == node
