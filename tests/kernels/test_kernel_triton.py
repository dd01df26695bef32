"""Tests of the fused Triton routing kernel (``mhar_ablate/kernels/mhar_triton.py``) on the CPU.

CPU tensors run the kernels through Triton's interpreter, in fp32, against the float64 oracle
(``kernels/reference.py``), which is itself checked once against SPEC.md's formula written out plainly.
The GPU side (bf16/fp16, large shapes, inductor) is ``tests/kernels/test_kernels_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mhar_ablate.kernels import mhar_triton
from mhar_ablate.kernels.reference import mhar_route_float64, mhar_route_reference
from mhar_ablate.ops import mhar_route

EPS = 1e-6


def make_inputs(S, B, T, d, seed, dtype=torch.float32):
    """Random non-zero inputs; sources of different scales so that the depth softmax is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 2.0, S, dtype=torch.float64).view(S, 1, 1, 1)
    sources = (torch.randn(S, B, T, d, generator=g, dtype=torch.float64) * scale + 0.1).to(dtype)
    query = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    key_weight = (1.0 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype)
    grad_out = torch.randn(B, T, d, generator=g, dtype=torch.float64).to(dtype)
    return sources, query, key_weight, grad_out


def run_with_grads(fn, sources, query, key_weight, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (sources, query, key_weight)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return out.detach(), grads


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected).norm().item()
    scale = expected.norm().item()
    # S = 1 makes the query/key-gain gradients exactly zero: compare against the grad_out scale then
    assert err <= tol * max(scale, 1e-3), f"{what}: |err| {err:.3e} vs |ref| {scale:.3e}"


SHAPES = [  # (S, B, T, d, H)
    (1, 1, 1, 16, 1),  # one source, one token
    (3, 2, 7, 48, 4),  # d not a power of two (head width 12), odd token count
    (5, 1, 9, 80, 8),  # head width 10
    (130, 1, 3, 32, 2),  # S past 129
    (4, 3, 5, 64, 32),  # H = 32, head width 2
    (3, 1, 4, 32, 32),  # head width 1
    (6, 1, 11, 96, 16),  # H = 16, head width 6
    (7, 2, 3, 40, 1),  # H = 1 (AttnRes), d = 40
    (3, 2, 5, 56, 8),  # head width 7 = 4 + 3: the rest block is padded and masked
    (2, 1, 29, 64, 8),  # 29 tokens: several forward tiles, several backward tiles per program
]


@pytest.mark.parametrize("S,B,T,d,H", SHAPES)
def test_forward_and_gradients_match_float64(S, B, T, d, H):
    sources, query, key_weight, grad_out = make_inputs(S, B, T, d, seed=S * 1000 + d + H)
    out, grads = run_with_grads(lambda s, q, g: mhar_route(s, q, g, H, backend="triton"),
                                sources, query, key_weight, grad_out)
    out64, grads64 = run_with_grads(lambda s, q, g: mhar_route_float64(s, q, g, H),
                                    sources.double(), query.double(), key_weight.double(), grad_out.double())
    assert out.dtype == torch.float32
    assert_close(out, out64, 1e-5, "output")
    for name, g, g64 in zip(("sources", "query", "key_weight"), grads, grads64):
        assert g.dtype == torch.float32, name
        assert_close(g, g64, 1e-5, f"grad {name}")


def test_oracle_is_the_spec_formula():
    """The oracle (the reference's block-diagonal matmul, in float64) against SPEC.md's formula written out
    per head, and the fp32 reference against the oracle."""
    S, B, T, d, H = 5, 2, 3, 48, 4
    sources, query, key_weight, _ = make_inputs(S, B, T, d, seed=1)
    x = sources.double()
    r = torch.rsqrt(x.pow(2).mean(-1) + EPS)
    v = x.view(S, B, T, H, d // H)
    a = ((v * (query.double() * key_weight.double()).view(H, d // H)).sum(-1) * r.unsqueeze(-1)).softmax(0)
    spec = (a.unsqueeze(-1) * v).sum(0).reshape(B, T, d)
    oracle = mhar_route_float64(sources, query, key_weight, H)
    assert oracle.dtype == torch.float64
    torch.testing.assert_close(oracle, spec, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mhar_route_reference(sources, query, key_weight, H), spec.float(), rtol=1e-5, atol=1e-5)


def test_reference_and_kernel_agree_in_fp32():
    sources, query, key_weight, grad_out = make_inputs(9, 1, 6, 64, seed=2)
    out, grads = run_with_grads(lambda s, q, g: mhar_route(s, q, g, 8, backend="triton"),
                                sources, query, key_weight, grad_out)
    ref, ref_grads = run_with_grads(lambda s, q, g: mhar_route(s, q, g, 8, backend="reference"),
                                    sources, query, key_weight, grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_query_and_key_gradients_keep_their_dtype():
    sources, query, key_weight, grad_out = make_inputs(3, 1, 5, 32, seed=3)
    out, (gs, gq, gk) = run_with_grads(lambda s, q, g: mhar_route(s, q, g, 4, backend="triton"),
                                       sources, query.double(), key_weight.to(torch.bfloat16), grad_out)
    assert (out.dtype, gs.dtype, gq.dtype, gk.dtype) == (torch.float32, torch.float32, torch.float64, torch.bfloat16)
    _, grads64 = run_with_grads(lambda s, q, g: mhar_route_float64(s, q, g, 4), sources.double(), query.double(),
                                key_weight.to(torch.bfloat16).double(), grad_out.double())
    assert_close(gq, grads64[1], 1e-5, "grad query")
    assert_close(gk.double(), grads64[2], 1e-2, "grad key_weight (bf16)")


def test_non_contiguous_inputs():
    S, B, T, d, H = 4, 2, 5, 48, 4
    sources, query, key_weight, grad_out = make_inputs(S, B, T, d, seed=4)
    # sources stored (B, S, T, d) and viewed as (S, B, T, d); query and key gain every other element
    strided_sources = sources.transpose(0, 1).contiguous().transpose(0, 1)
    strided_query = torch.stack([query, -query], -1).flatten()[::2]
    strided_key = torch.stack([key_weight, 3 * key_weight], -1).flatten()[::2]
    assert not strided_sources.is_contiguous() and not strided_query.is_contiguous()

    def strided_leaves_route(s, q, g):
        return mhar_route(s, q, g, H, backend="triton")

    leaves = [t.detach().requires_grad_() for t in (strided_sources, strided_query, strided_key)]
    out = strided_leaves_route(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_out, ref_grads = run_with_grads(strided_leaves_route, sources, query, key_weight, grad_out)
    assert torch.equal(out, ref_out)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


@pytest.mark.parametrize("bad", ["heads", "empty", "query", "key_weight"])
def test_value_errors(bad):
    sources, query, key_weight, _ = make_inputs(2, 1, 3, 48, seed=5)
    kwargs = dict(sources=sources, query=query, key_weight=key_weight, num_heads=4)
    if bad == "heads":
        kwargs["num_heads"] = 5
    elif bad == "empty":
        kwargs["sources"] = sources[:0]
    elif bad == "query":
        kwargs["query"] = query[:-1]
    else:
        kwargs["key_weight"] = torch.ones(47)
    with pytest.raises(ValueError, match={"heads": "num_heads", "empty": "S = 0"}.get(bad, bad)):
        mhar_route(**kwargs, backend="triton")


def test_no_tokens():
    sources, query, key_weight, _ = make_inputs(3, 2, 0, 32, seed=6)
    out, (gs, gq, gk) = run_with_grads(lambda s, q, g: mhar_route(s, q, g, 2, backend="triton"),
                                       sources, query, key_weight, torch.zeros(2, 0, 32))
    assert out.shape == (2, 0, 32) and gs.shape == sources.shape
    assert torch.equal(gq, torch.zeros_like(gq)) and torch.equal(gk, torch.zeros_like(gk))


def test_deterministic():
    sources, query, key_weight, grad_out = make_inputs(5, 3, 7, 64, seed=7)
    runs = [run_with_grads(lambda s, q, g: mhar_route(s, q, g, 8, backend="triton"),
                           sources, query, key_weight, grad_out) for _ in range(2)]
    (out_a, grads_a), (out_b, grads_b) = runs
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def test_backward_is_the_triton_kernel(monkeypatch):
    """The gradient comes from the Triton backward kernel, not from autograd through the reference."""
    import mhar_ablate.kernels.reference as reference
    import mhar_ablate.ops as ops

    def refuse(*args, **kwargs):
        raise AssertionError("the reference was called")

    for name in ("mhar_route_reference", "routing_weights", "routing_logits"):
        monkeypatch.setattr(reference, name, refuse)
    monkeypatch.setattr(ops, "mhar_route_reference", refuse)
    launched = []
    real_launch = mhar_triton.launch

    def spy(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(mhar_triton, "launch", spy)

    sources, query, key_weight, grad_out = make_inputs(3, 1, 5, 32, seed=8)
    leaves = [t.requires_grad_() for t in (sources, query, key_weight)]
    out = mhar_route(*leaves, 4, backend="triton")
    assert "mhar_ablate_route_fwd" in type(out.grad_fn).__name__
    assert launched == ["_mhar_fwd_kernel"]
    out.backward(grad_out)
    assert launched == ["_mhar_fwd_kernel", "_mhar_bwd_kernel"]
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)


def test_custom_ops_pass_opcheck():
    sources, query, key_weight, grad_out = make_inputs(3, 1, 5, 32, seed=9)
    leaves = [t.requires_grad_() for t in (sources, query, key_weight)]
    torch.library.opcheck(mhar_triton.route_fwd, (*leaves, 4, EPS))
    out, lse = mhar_triton.route_fwd(sources.detach(), query.detach(), key_weight.detach(), 4, EPS)
    torch.library.opcheck(mhar_triton.route_bwd, (grad_out, sources.detach(), query.detach(), key_weight.detach(),
                                                  out, lse, 4, EPS))


def test_torch_compile_traces_without_graph_break():
    """fullgraph=True fails on any graph break; aot_eager runs the fake kernels and the autograd formula
    (inductor would compile the same graph, but its CPU C++ build takes ~20 s here)."""
    sources, query, key_weight, grad_out = make_inputs(4, 2, 3, 32, seed=10)

    def loss(s, q, g):
        return (mhar_route(s, q, g, 4, backend="triton") * grad_out).sum() * 2

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    _, grads_c = run_with_grads(lambda s, q, g: compiled(s, q, g).reshape(1), sources, query, key_weight,
                                torch.ones(1))
    _, grads_e = run_with_grads(lambda s, q, g: loss(s, q, g).reshape(1), sources, query, key_weight,
                                torch.ones(1))
    for c, e in zip(grads_c, grads_e):
        assert torch.equal(c, e)


def test_runs_under_triton_interpret_env():
    """The usual way to interpret Triton (TRITON_INTERPRET=1 before triton is imported) gives the same
    kernel; run in a fresh interpreter since this process imported triton already."""
    script = textwrap.dedent("""
        import torch
        from mhar_ablate.kernels import mhar_triton
        from mhar_ablate.kernels.reference import mhar_route_float64
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(mhar_triton._mhar_fwd_kernel, InterpretedFunction)
        torch.manual_seed(0)
        s = torch.randn(3, 1, 5, 48, dtype=torch.float64)
        q, g, go = torch.randn(48, dtype=torch.float64), torch.randn(48, dtype=torch.float64), torch.randn(1, 5, 48)
        leaves = [t.float().requires_grad_() for t in (s, q, g)]
        out = mhar_triton.mhar_route_triton(*leaves, 4)
        out.backward(go)
        ref = [t.clone().requires_grad_() for t in (s, q, g)]
        o = mhar_route_float64(*ref, 4)
        o.backward(go.double())
        errs = [float((t.detach().double() - u).norm() / u.norm()) for t, u in zip([out] + [l.grad for l in leaves], [o] + [t.grad for t in ref])]
        print(max(errs))
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5
