"""The comparison family (hc, mhc, denseformer, muddformer, delta) behind the registry: each variant trains,
is causal, reaches every parameter, starts as pre-norm where its paper's initialisation says so, and traces
under torch.compile; the registry drives configuration, labels, parameter groups and ``bench model``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mhar_ablate.cli import main
from mhar_ablate.config import build_config, from_dict
from mhar_ablate.model import Decoder, count_parameters, routing_overhead
from mhar_ablate.variants import RESIDUALS
from mhar_ablate.variants.mhc import sinkhorn
from mhar_ablate.training.run import arm_label

VOCAB = 64
# (id, overrides): every new kind with its defaults, and the settings that change its structure.
FAMILY = [
    ("hc", {"residual.kind": "hc"}),
    ("hc-static", {"residual.kind": "hc", "residual.hc.dynamic": "false", "residual.hc.rate": "2"}),
    ("mhc", {"residual.kind": "mhc"}),
    ("denseformer", {"residual.kind": "denseformer"}),
    ("denseformer-2x2", {"residual.kind": "denseformer", "residual.denseformer.dilation": "2",
                         "residual.denseformer.period": "2"}),
    ("muddformer", {"residual.kind": "muddformer"}),
    ("muddformer-oneway", {"residual.kind": "muddformer", "residual.muddformer.multiway": "false"}),
    ("delta", {"residual.kind": "delta"}),
    ("delta-block2", {"residual.kind": "delta", "residual.grouping": "block:2", "residual.heads": "4"}),
]
IDS = [f[0] for f in FAMILY]
# Kinds whose paper's initialisation is pre-norm at step 0 (mhc: with φ = 0 only, tested separately).
PRENORM = ["hc", "hc-static", "denseformer", "denseformer-2x2", "muddformer", "muddformer-oneway", "delta",
           "delta-block2"]


def _model(over: dict, seed: int = 0, **model) -> Decoder:
    cfg = build_config(overrides={"residual.backend": "reference", **over,
                                  **{f"model.{k}": str(v) for k, v in model.items()}})
    torch.manual_seed(seed)
    return Decoder(cfg.model, cfg.residual, VOCAB)


def _batch(seed: int = 0, B: int = 2, T: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _loss(model, x, y):
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def _opt(model):
    return torch.optim.AdamW(model.param_groups(0.1), lr=3e-3, betas=(0.9, 0.95))


@pytest.mark.parametrize("over", [f[1] for f in FAMILY], ids=IDS)
def test_trains(over):
    model = _model(over)
    opt = _opt(model)
    x, y = _batch(B=2, T=32)
    losses = []
    for _ in range(6):
        loss = _loss(model, x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05, losses  # a fixed batch: the loss must come down


@pytest.mark.parametrize("over", [f[1] for f in FAMILY], ids=IDS)
def test_causal_in_time(over):
    model = _model(over, seed=1).double().eval()
    # Move every routing and mixing parameter off its initialisation, so that no zero gate hides a leak.
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x, _ = _batch(seed=3, B=1, T=12)
    logits = model(x)
    x2 = x.clone()
    x2[0, 7] = (x[0, 7] + 1) % VOCAB
    logits2 = model(x2)
    torch.testing.assert_close(logits[:, :7], logits2[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(logits[:, 7:], logits2[:, 7:])


# Optimiser steps after which every parameter has a gradient. Zero-initialised parts open one after the
# other: dynamic HC's scales and MUDDFormer's W_1 after one step (their W / W_2 start at zero); delta's gate
# first, then its queries and null source, and its key gains only once the queries have moved.
STEPS_TO_REACH = {"delta": 2, "delta-block2": 2}


@pytest.mark.parametrize("over", [f[1] for f in FAMILY], ids=IDS)
def test_every_parameter_gets_a_gradient(over, request):
    name = request.node.callspec.id
    model = _model(over)
    opt = _opt(model)
    x, y = _batch()
    for _ in range(STEPS_TO_REACH.get(name, 1)):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _loss(model, x, y).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"no gradient: {dead}"


def _inputs(model, x):
    """Every sublayer's input (a tuple of three for a multiway attention site) and the logits."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for layer in model.sublayers]
    logits = model(x)
    for h in hooks:
        h.remove()
    return seen, logits


def _scale_norm_eps(base: Decoder, sublayers: float, final: float) -> None:
    """Pre-norm whose norms see their input ``scale`` times larger: RMSNorm(c·x) = RMSNorm(x) with eps / c²."""
    for layer in base.sublayers:
        layer.norm.eps /= sublayers ** 2
    base.norm.eps /= final ** 2


@pytest.mark.parametrize("name", PRENORM)
def test_paper_initialisation_is_prenorm_at_step_zero(name):
    over = dict(FAMILY)[name]
    model, base = _model(over), _model({"residual.kind": "baseline"})
    # One seed, one start: the variant draws its own random values aside (separate_rng).
    for (n, p), (nb, pb) in zip(model.sublayers.named_parameters(), base.sublayers.named_parameters()):
        assert torch.equal(p, pb), n
    x, _ = _batch(seed=5)
    with torch.no_grad():
        got, logits = _inputs(model.eval(), x)
        want, base_logits = _inputs(base.eval(), x)
        for site, (a, b) in enumerate(zip(got, want)):
            for t in (a if isinstance(a, tuple) else (a,)):  # each of Q, K, V's inputs is pre-norm's stream
                assert torch.equal(t, b), f"site {site}"
        if not name.startswith("hc"):
            assert torch.equal(logits, base_logits)
            return
        # HC sums its n equal streams for the output norm (§2.1): n times pre-norm's stream, which RMSNorm
        # removes except in its eps. Measured here (tiny activations, mean square ~5e-4) that is ~1e-3
        # relative; with the eps scaled to match, the logits agree to rounding (the sum of n equal values).
        n = model.residual.n
        assert not torch.allclose(logits, base_logits, rtol=1e-4, atol=0)
        _scale_norm_eps(base, 1, n)
        torch.testing.assert_close(logits, base(x), rtol=1e-5, atol=1e-6)


def test_mhc_without_its_dynamic_part_is_prenorm():
    """mHC's paper states no init for φ and b; the choice made (b = 0) is pre-norm once φ = 0, up to the
    norms' eps: each sublayer reads n/2 times the running sum (H_pre = 1/2), H_res averages equal streams,
    H_post = 1, and the output norm reads n times it. Not bitwise: sums of n equal streams round."""
    model, base = _model({"residual.kind": "mhc"}), _model({"residual.kind": "baseline"})
    n = model.residual.n
    _scale_norm_eps(base, n / 2, n)
    with torch.no_grad():
        model.residual.phi.zero_()
        x, _ = _batch(seed=6)
        got, logits = _inputs(model.eval(), x)
        want, base_logits = _inputs(base.eval(), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, n / 2 * b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, base_logits, rtol=1e-5, atol=1e-6)


def test_sinkhorn_is_doubly_stochastic():
    m = sinkhorn(torch.randn(50, 4, 4), 20)  # logits of unit spread (the gates keep them smaller)
    torch.testing.assert_close(m.sum(-2), torch.ones(50, 4))  # the last normalisation: exact up to rounding
    torch.testing.assert_close(m.sum(-1), torch.ones(50, 4), rtol=0, atol=1e-3)
    assert (m > 0).all()
    torch.testing.assert_close(sinkhorn(torch.zeros(4, 4), 20), torch.full((4, 4), 0.25))


def test_sinkhorn_backward_is_autograd_through_the_loop():
    def by_autograd(logits, iters):
        m = torch.softmax(logits, -1)
        m = m / m.sum(-2, keepdim=True)
        for _ in range(iters - 1):
            m = m / m.sum(-1, keepdim=True)
            m = m / m.sum(-2, keepdim=True)
        return m

    logits = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for iters in (1, 20):
        ours, = torch.autograd.grad(sinkhorn(logits, iters), logits, grad)
        want, = torch.autograd.grad(by_autograd(logits, iters), logits, grad)
        torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sinkhorn(logits, iters), by_autograd(logits, iters), rtol=1e-12, atol=1e-14)


def test_mhar_with_one_head_is_attnres():
    x, _ = _batch(seed=7)
    for query_init in ("zeros", "normal:0.5"):
        common = {"residual.query_init": query_init}
        mhar = _model({"residual.kind": "mhar", "residual.heads": "1", **common})
        attnres = _model({"residual.kind": "attnres", **common})
        for (n, p), (_, q) in zip(mhar.named_parameters(), attnres.named_parameters()):
            assert torch.equal(p, q), n
        assert torch.equal(mhar(x), attnres(x))


def test_every_kind_traces_into_one_graph():
    """torch.compile(fullgraph=True) refuses any graph break: each variant's forward is one graph (dynamo's
    eager backend: the tracing is what is tested here; inductor's kernels are compiled on a GPU by
    `mhar-ablate bench model`'s -compiled rows)."""
    x, y = _batch(B=1, T=8)
    for name in ("hc", "mhc", "denseformer", "muddformer", "delta"):
        model = _model(dict(FAMILY)[name], n_layers=2)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.testing.assert_close(loss, _loss(model, x, y), msg=name)
    torch._dynamo.reset()


def test_static_hc_under_compile_matches_eager(monkeypatch):
    """Under torch.compile static HC broadcasts its weights per token (hc.py, ``coefficients``): the loss and
    every parameter's gradient must be the eager path's (its 2-D weights and float32 matmul), both with the
    branch forced in eager code and through aot_eager (dynamo and AOT autograd's backward, no inductor)."""
    model = _model({"residual.kind": "hc", "residual.hc.dynamic": "false"}, seed=2, n_layers=2)
    with torch.no_grad():  # off the identity initialisation, so that every weight's gradient differs
        g = torch.Generator().manual_seed(4)
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    x, y = _batch(seed=8, B=2, T=8)

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fn(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want = loss_and_grads(model)
    H = torch.zeros(2, 8, model.residual.n, 4)
    assert model.residual.coefficients(H, 0)[0].dim() == 2
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        alpha, beta = model.residual.coefficients(H, 0)
        assert alpha.shape == (2, 8, 4, 5) and beta.shape == (2, 8, 4)
        forced = loss_and_grads(model)
    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    for got_loss, got in (forced, compiled):
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", [k for k in RESIDUALS if k != "baseline"])
def test_every_kind_builds_at_every_preset(kind):
    """The defaults fit every preset's shape: validation and construction (on the meta device)."""
    for preset in ("tiny", "small", "paper100m", "paper350m", "paper1b"):
        cfg = build_config(overrides={"model.preset": preset, "residual.kind": kind})
        assert count_parameters(cfg.model, cfg.residual, 4096) > 0


def test_parameter_overhead_counts_what_each_kind_adds():
    cfg = build_config(overrides={"model.preset": "paper350m", "residual.kind": "hc"})
    n, nb, pct = routing_overhead(cfg.model, cfg.residual)
    sites, d, r = 48, 1024, 4
    static = sites * (r * (r + 1) + r)
    dynamic = sites * (d * (r + 2) + 2)
    assert n - nb == static + dynamic
    assert pct == pytest.approx(100 * (static + dynamic) / nb)
    cfg = build_config(overrides={"model.preset": "paper350m", "residual.kind": "mhc"})
    n, nb, _ = routing_overhead(cfg.model, cfg.residual)
    assert n - nb == sites * (r * d * (2 * r + r * r) + 3 + 2 * r + r * r)
    cfg = build_config(overrides={"model.preset": "paper350m", "residual.kind": "muddformer"})
    n, nb, _ = routing_overhead(cfg.model, cfg.residual)
    per_block = []
    for i in range(24):
        ways = 1 if i == 23 else 4
        hidden = (ways * (i + 2) * (4 if i == 23 else 1) // 64 + 1) * 64
        per_block.append(d * hidden + hidden * ways * (i + 2) + ways * (i + 2))
    assert n - nb == sum(per_block)
    cfg = build_config(overrides={"model.preset": "tiny", "residual.kind": "denseformer",
                                  "residual.denseformer.dilation": "2"})
    n, nb, _ = routing_overhead(cfg.model, cfg.residual, VOCAB)
    assert n - nb == sum(i // 2 + 1 for i in range(1, 5))


@pytest.mark.parametrize("name", ["hc", "mhc", "denseformer", "muddformer", "delta"])
def test_static_and_routing_parts_take_no_weight_decay(name):
    model = _model(dict(FAMILY)[name])
    groups = {g["name"]: g for g in model.param_groups(0.1)}
    undecayed = {id(p) for p in model.residual.no_decay_parameters()}
    assert undecayed and {id(p) for p in groups["routing (no decay)"]["params"]} == undecayed
    assert groups["routing (no decay)"]["weight_decay"] == 0.0
    decayed = {id(p) for p in groups["decay"]["params"]}
    assert not undecayed & decayed
    if name == "hc":  # A_r is a matrix: by the default rule it would decay
        assert id(model.residual.static_alpha) in undecayed
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))


def test_labels_and_backends_come_from_the_registry():
    def label(**over):
        return arm_label(build_config(overrides={k.replace("__", "."): v for k, v in over.items()}))

    assert label(residual__kind="baseline") == "baseline"
    assert label(residual__kind="attnres") == "attnres"
    assert label(residual__kind="mhar", residual__grouping="block:4") == "mhar-h8-block:4"
    assert label(residual__kind="hc") == "hc-n4"
    assert label(residual__kind="hc", residual__hc__dynamic="false", residual__hc__rate="2") == "hc-n2-static"
    assert label(residual__kind="mhc") == "mhc-n4"
    assert label(residual__kind="denseformer", residual__denseformer__dilation="4",
                 residual__denseformer__period="2") == "denseformer-4x2"
    assert label(residual__kind="muddformer") == "muddformer"
    assert label(residual__kind="delta", residual__heads="4") == "delta-h4"
    labels = {RESIDUALS[k].label(build_config(overrides={"residual.kind": k}).residual) for k in RESIDUALS}
    assert len(labels) == len(RESIDUALS)
    assert RESIDUALS["hc"].backend_name(None, True) == "pytorch"
    assert RESIDUALS["baseline"].backend_name(None, True) == "none"
    assert {k for k, c in RESIDUALS.items() if c.depth_weights} == {"attnres", "mhar", "delta"}


def test_settings_load_nested_dotted_and_saved(tmp_path):
    path = tmp_path / "hc.yaml"
    path.write_text("residual:\n  kind: hc\n  hc:\n    rate: 2\n    dynamic: false\n")
    from mhar_ablate.config import load_yaml

    nested = build_config(config_file=str(path))
    dotted = build_config(overrides={"residual.kind": "hc", "residual.hc.rate": "2", "residual.hc.dynamic": "no"})
    study_style = build_config(base={"residual.kind": "hc", "residual.hc": {"rate": 2, "dynamic": False}})
    for cfg in (nested, dotted, study_style):
        assert (cfg.residual.settings().rate, cfg.residual.settings().dynamic) == (2, False)
    saved = nested.to_dict()
    assert saved["residual"]["hc"] == {"rate": 2, "dynamic": False}
    assert from_dict(saved).flat() == nested.flat() and nested.flat()["residual.hc.rate"] == 2
    assert load_yaml(path)  # the file itself is plain YAML
    # Kinds without settings of their own save what they always saved: older run folders load unchanged.
    old = {"model": {"preset": "tiny", "d_model": 64}, "residual": {"kind": "mhar", "heads": 4, "grouping": "full",
                                                                   "query_init": "zeros", "backend": "auto"}, "seed": 1}
    cfg = from_dict(old)
    assert cfg.residual.heads == 4 and set(cfg.to_dict()["residual"]) == set(old["residual"])


@pytest.mark.parametrize("argv,needle", [
    (["residual.kind=hc", "residual.hc.rat=2"], "residual.hc has rate, dynamic"),
    (["residual.kind=hc", "residual.hc.rate=two"], "expected int"),
    (["residual.kind=hc", "residual.hc.rate=0"], "at least 1"),
    (["residual.hyper.rate=2"], "kinds with settings of their own"),
    (["residual.hc=4"], "use residual.hc.NAME=value"),
    (["residual.kind=mhc", "residual.mhc.sinkhorn_iters=0"], "sinkhorn_iters"),
    (["residual.kind=denseformer", "residual.denseformer.period=5"], "larger than model.n_layers"),
])
def test_bad_settings_are_one_line_and_exit_2(argv, needle, capsys):
    assert main(["info", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_info_works_for_every_kind(capsys):
    for kind in RESIDUALS:
        assert main(["info", f"residual.kind={kind}"]) == 0
    out = capsys.readouterr().out
    assert "hc-n4 (rate=4, dynamic=True) parameters" in out and "muddformer (multiway=True)" in out


def test_bench_gives_every_kind_rows(tmp_path):
    from mhar_ablate.bench.variants import all_variants, select_variants

    names = [v.name for v in all_variants([None])]
    for kind in RESIDUALS:
        assert any(n.startswith(kind) for n in names), kind
    for old in ("baseline-eager", "mhar-full-fused-compiled", "attnres-block4-ref-eager", "mhar-block4-ref-compiled"):
        assert old in names  # the existing rows keep their names
    chosen = [v.name for v in select_variants("hc-*compiled,mhc-compiled", all_variants([None]))]
    assert chosen == ["baseline-compiled", "hc-compiled", "hc-static-compiled", "mhc-compiled"]
    out = tmp_path / "rows.json"
    variants = "hc-static-eager,delta-full-ref-eager"  # a kind's own settings, and routing heads
    assert main(["bench", "model", "--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup", "1",
                 "--no-split", "--variants", variants, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["baseline-eager", "delta-full-ref-eager", "hc-static-eager"]
    assert rows[2]["routing"] == "hc" and rows[1]["grouping"] == "full"
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)


def test_baselines_study_arms():
    from mhar_ablate.sweep.definition import StudyDefinition

    d = StudyDefinition.load("baselines")
    kinds = set()
    for arm in d.arms:
        for budget in ("steps", "wallclock"):
            cfg = d.arm_config(arm, 0, budget, {})
            kinds.add(cfg.residual.kind)
    assert kinds == {"baseline", "hc", "mhc", "denseformer", "muddformer", "attnres", "mhar"}
    cfg = d.arm_config("hc", 0, "steps", {})
    assert cfg.residual.settings().dynamic and cfg.residual.settings().rate == 4
    assert d.arm_config("mhar-h8", 0, "steps", {}).residual.resolved_heads() == 8
    assert set(d.budgets) == {"steps", "wallclock"}


def test_delta_fused_path_matches_reference():
    """delta routes through MHAR's fused path (the null source in the embedding's slot): same loss and
    gradients as the reference path, in fp32 (Triton's interpreter on CPU)."""
    import copy

    over = {"residual.kind": "delta", "residual.heads": "4",
            "residual.query_init": "normal:0.5"}
    ref = _model(over, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn=48)
    with torch.no_grad():  # open the gates and move the null source, so that every path carries gradient
        ref.residual.gate.normal_(0.0, 0.5)
        ref.residual.null.normal_(0.0, 0.1)
        ref.residual.key_weight.add_(0.3 * torch.randn_like(ref.residual.key_weight))
    fused = copy.deepcopy(ref)
    fused.residual.backend = "triton"
    x, y = _batch(seed=8, B=2, T=5)
    grads = []
    for model in (ref, fused):
        loss = _loss(model, x, y)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_r, g_r), (loss_f, g_f) = grads
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-5, atol=1e-6)
    for name, g in g_r.items():
        torch.testing.assert_close(g_f[name], g, rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    assert g_r["residual.null"].abs().sum() > 0 and g_r["residual.gate"].abs().sum() > 0
