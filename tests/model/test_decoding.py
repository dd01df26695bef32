"""Cached decoding: a prompt into the KV cache and then one token at a time gives the logits of the full
forward over the whole sequence, for every residual kind (fp32, tiny preset, routing parameters moved off
their identity-like start), on the reference and the fused routing path; greedy generation with the cache
gives the tokens of generation without it; ``bench infer`` runs end to end on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from mhar_ablate.cli import main
from mhar_ablate.config import build_config
from mhar_ablate.model import Decoder
from mhar_ablate.variants import RESIDUALS

VOCAB = 64
# fp32: the cached path adds the same terms in other orders (one-row matrix products, the grouped-query
# decode attention); 1e-4 is some hundred times its rounding here and far below what a wrong source,
# position or mask does (logits off by 0.01 to 1).
TOL = dict(rtol=1e-4, atol=1e-4)
KINDS = [
    ("baseline", {"residual.kind": "baseline"}),
    ("attnres", {"residual.kind": "attnres"}),
    ("mhar", {"residual.kind": "mhar"}),
    ("mhar-block2", {"residual.kind": "mhar", "residual.grouping": "block:2", "residual.heads": "4"}),
    ("delta", {"residual.kind": "delta"}),
    ("delta-block2", {"residual.kind": "delta", "residual.grouping": "block:2", "residual.heads": "4"}),
    ("hc", {"residual.kind": "hc"}),
    ("hc-static", {"residual.kind": "hc", "residual.hc.dynamic": "false"}),
    ("mhc", {"residual.kind": "mhc"}),
    ("denseformer-2x2", {"residual.kind": "denseformer", "residual.denseformer.dilation": "2",
                         "residual.denseformer.period": "2"}),
    ("denseformer", {"residual.kind": "denseformer"}),
    ("muddformer", {"residual.kind": "muddformer"}),
    ("muddformer-oneway", {"residual.kind": "muddformer", "residual.muddformer.multiway": "false"}),
]


def _model(over: dict, **model) -> Decoder:
    cfg = build_config(overrides={"model.preset": "tiny", "residual.backend": "reference", **over,
                                  **{f"model.{k}": str(v) for k, v in model.items()}})
    torch.manual_seed(0)
    m = Decoder(cfg.model, cfg.residual, VOCAB).eval()
    with torch.no_grad():  # off the start where most kinds are pre-norm: every mixing weight matters
        for p in m.residual.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if hasattr(m.residual, "record"):
        m.residual.record = False
    return m


def _cached_logits(model: Decoder, idx: torch.Tensor, chunks: list[int], static_after: int | None = None) -> torch.Tensor:
    """Logits of ``idx`` fed into one cache in pieces of the given lengths; with ``static_after`` the cache
    turns static (the CUDA-graph decode's fixed shapes) after that many pieces."""
    cache = model.new_cache(idx.shape[0], idx.shape[1] + 3)  # room to spare: static steps attend to all of it
    out, start = [], 0
    for i, n in enumerate(chunks):
        if i == static_after:
            cache.make_static()
        out.append(model(idx[:, start:start + n], cache))
        start += n
    if static_after is None:
        assert cache.length == start
    else:
        assert cache.position.item() == start
    return torch.cat(out, dim=1)


def test_every_registered_kind_is_tested():
    assert {over["residual.kind"] for _, over in KINDS} == set(RESIDUALS)


@pytest.mark.parametrize("over", [k[1] for k in KINDS], ids=[k[0] for k in KINDS])
def test_prefill_then_decode_gives_the_full_forward_logits(over):
    model = _model(over)
    idx = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(idx)
        # a prompt of 5, then 7 single tokens; and a prompt in two pieces (new tokens after cached ones)
        torch.testing.assert_close(_cached_logits(model, idx, [5] + [1] * 7), full, **TOL)
        torch.testing.assert_close(_cached_logits(model, idx, [3, 6, 1, 1, 1]), full, **TOL)
        torch.testing.assert_close(model(idx[:, :7], model.new_cache(2), last_only=True), full[:, 6:7], **TOL)
        # static after the prompt: the position on the device, every step over the whole (masked) cache
        torch.testing.assert_close(_cached_logits(model, idx, [5] + [1] * 7, static_after=1), full, **TOL)


@pytest.mark.parametrize("over", [k[1] for k in KINDS], ids=[k[0] for k in KINDS])
def test_greedy_generation_with_the_cache_equals_generation_without(over):
    model = _model(over)
    prompt = torch.randint(0, VOCAB, (2, 4))
    cached = model.generate(prompt, 8)
    assert cached.shape == (2, 12) and torch.equal(cached[:, :4], prompt)
    assert torch.equal(cached, model.generate(prompt, 8, use_cache=False))


@pytest.mark.parametrize("kind,grouping,heads", [
    ("mhar", "full", 4), ("mhar", "block:2", 4), ("attnres", "full", 1), ("delta", "full", 4)])
def test_fused_path_decodes_one_token_at_a_time(kind, grouping, heads):
    """The fused path's kernels (Triton's interpreter here) at T = 1 and one sequence (N = 1), against the
    reference path's full forward."""
    over = {"residual.kind": kind, "residual.grouping": grouping, "residual.heads": str(heads)}
    model = _model(over, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn=48)
    idx = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        full = model(idx)
        model.residual.backend = "triton"
        model.residual.sites_per_pass = 2
        cached = _cached_logits(model, idx, [3, 1, 1, 1])
    torch.testing.assert_close(cached, full, **TOL)


def test_cache_and_position_limits_are_errors():
    model = _model({"residual.kind": "mhar"})
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="longer than the cache's 4 positions"):
            model(torch.zeros(1, 2, dtype=torch.long), cache)
        assert cache.length == 3  # a refused step leaves the cache as it was
        long = model.new_cache(1, 200)
        long.length = 127
        with pytest.raises(ValueError, match="sequence of 129 tokens is longer than model.seq_len=128"):
            model(torch.zeros(1, 2, dtype=torch.long), long)


def test_bench_infer_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "infer.json"
    code = main(["bench", "infer", "--device", "cpu", "--preset", "tiny", "--variants", "mhar-full-ref,muddformer",
                 "--batch", "1,3", "--repeats", "1", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["batch"]) for r in rows] == [
        ("baseline", 1), ("baseline", 3), ("mhar-full-ref", 1), ("mhar-full-ref", 3), ("muddformer", 1), ("muddformer", 3)]
    for r in rows:
        assert r["status"] == "ok" and r["preset"] == "tiny" and r["dtype"] == "float32"
        assert r["prefill_tokens"] == 16 and r["decode_context"] == 12 and r["new_tokens"] == 4
        assert r["prefill_tokens_per_s"] > 0 and r["decode_ms_per_token"] > 0
        assert r["graph_status"] is None and r["decode_graph_ms_per_token"] is None  # no --cuda-graph
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] / r["decode_ms_per_token"] * 1e3, abs=0.06)  # rounded to 0.1
        # tiny: 4 layers x (keys, values) x 2 heads x 16 positions x 16 channels x 4 bytes per sequence
        assert r["kv_cache_mb"] == round(r["batch"] * 4 * 2 * 2 * 16 * 16 * 4 / 1e6, 3)
    assert rows[0]["prefill_ratio_to_baseline"] == 1.0 and rows[1]["decode_latency_ratio_to_baseline"] == 1.0
    assert rows[2]["routing"] == "mhar" and rows[2]["heads"] == 8 and rows[2]["grouping"] == "full"
    assert "| muddformer | 3 |" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("argv,needle", [
    (["--batch", "0"], "--batch takes positive integers"),
    (["--new-tokens", "16"], "--new-tokens must be between 1 and --seq - 1"),
    (["--variants", "hyper-*"], "matches no variant"),
    (["--seq", "500"], "--seq must be between 2 and the preset's seq_len 128"),
    (["--cuda-graph"], "--cuda-graph needs a GPU"),
])
def test_bench_infer_bad_input_is_one_line(argv, needle, capsys):
    assert main(["bench", "infer", "--device", "cpu", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_bench_infer_refuses_without_a_gpu(capsys):
    assert main(["bench", "infer", "--preset", "tiny"]) == 2
    assert "--device cpu" in capsys.readouterr().err
