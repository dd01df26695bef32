"""Tests of mHC's Sinkhorn-Knopp kernels (``mhar_ablate/kernels/sinkhorn.py``) on the CPU.

CPU tensors run the kernels through Triton's interpreter, in fp32, against ``_Sinkhorn``
(``mhc.sinkhorn_reference``), forward and backward, over sizes n that are and are not powers of two, one
and several iterations, token counts of one program and of several with a partial last one; and both
kernels compiled ahead of time for the H200 (sm_90), which needs triton's NVIDIA backend but no GPU. The
GPU run is ``tests/kernels/test_kernels_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from mhar_ablate.kernels import sinkhorn as kernel
from mhar_ablate.variants import mhc

TOL = 1e-5  # relative L2 error; measured <= 3e-7 here


def inputs(N, n, spread, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, n, n, generator=g) * spread, torch.randn(N, n, n, generator=g)


def fwd_bwd(fn, logits, grad, iters):
    leaf = logits.detach().clone().requires_grad_()
    out = fn(leaf, iters)
    return out.detach(), torch.autograd.grad(out, leaf, grad)[0]


def assert_close(actual, expected, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).norm().item()
    # n = 1: the output is exactly 1 and the gradient exactly 0; judged on the upstream gradient's scale then
    assert err <= TOL * max(expected.double().norm().item(), 1.0), f"{what}: |err| {err:.3e}"


CASES = [(7, n, iters, spread) for n in (1, 3, 4, 5) for iters in (1, 2, 20) for spread in (1.0, 5.0)] + [
    (1, 3, 20, 5.0),  # one token, n not a power of two
    (130, 4, 20, 5.0),  # several programs, the last one partial
    (130, 5, 2, 1.0),
]


@pytest.mark.parametrize("N,n,iters,spread", CASES, ids=lambda v: str(v))
def test_matches_reference(N, n, iters, spread):
    logits, grad = inputs(N, n, spread, seed=N * 100 + n * 10 + iters)
    got = fwd_bwd(kernel.sinkhorn_triton, logits, grad, iters)
    ref = fwd_bwd(mhc.sinkhorn_reference, logits, grad, iters)
    assert_close(got[0], ref[0], "output")
    assert_close(got[1], ref[1], "grad logits")


def test_leading_dims_and_non_contiguous_logits():
    """(B, T, n, n) logits sliced out of a wider projection, as mHC's maps make them."""
    z = torch.randn(2, 9, 8 + 16) * 3
    logits = z[..., 8:].unflatten(-1, (4, 4))
    assert not logits.is_contiguous()
    grad = torch.randn(2, 9, 4, 4).transpose(-1, -2)  # a non-contiguous upstream gradient too
    got = fwd_bwd(kernel.sinkhorn_triton, logits, grad, 20)
    ref = fwd_bwd(mhc.sinkhorn_reference, logits, grad, 20)
    assert_close(got[0], ref[0], "output")
    assert_close(got[1], ref[1], "grad logits")


def test_doubly_stochastic():
    out = kernel.sinkhorn_triton(torch.randn(5, 4, 4), 20)
    assert torch.allclose(out.sum(-2), torch.ones(5, 4), atol=1e-6)  # columns: the last normalisation
    assert torch.allclose(out.sum(-1), torch.ones(5, 4), atol=1e-3)


def test_no_tokens():
    logits = torch.randn(0, 4, 4, requires_grad=True)
    out = kernel.sinkhorn_triton(logits, 20)
    out.sum().backward()
    assert out.shape == (0, 4, 4) and logits.grad.shape == (0, 4, 4)


def test_custom_ops_pass_opcheck():
    logits, grad = inputs(3, 3, 2.0, seed=1)
    torch.library.opcheck(kernel.sinkhorn_fwd, (logits.requires_grad_(), 2))
    torch.library.opcheck(kernel.sinkhorn_bwd, (grad, logits.detach(), 2))


def test_torch_compile_one_node_each_way_without_graph_break():
    """fullgraph=True fails on any graph break; the AOT graphs hold the op once forward and once backward
    and no division (the loop is not unrolled); the values are the eager op's."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = [str(node.target) for node in gm.graph.nodes]
            return make_boxed_func(gm.forward)
        return compiler

    logits, grad = inputs(7, 4, 2.0, seed=2)
    weight = torch.randn(4, 4)

    def f(x, iters):
        return kernel.sinkhorn_triton(x * 2.0, iters) * weight

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    got, eager = fwd_bwd(compiled, logits, grad, 20), fwd_bwd(f, logits, grad, 20)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    assert [t for t in graphs["fw"] if "sinkhorn" in t] == ["mhar_ablate.sinkhorn_fwd.default"]
    assert [t for t in graphs["bw"] if "sinkhorn" in t] == ["mhar_ablate.sinkhorn_bwd.default"]
    assert not any("div" in t for t in graphs["fw"] + graphs["bw"])


def _ptxas_available() -> bool:
    import os

    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


# Compiles both kernels for sm_90 in a fresh process: once the interpreter has run in a process, triton's
# language functions stay patched for it and ahead-of-time compilation there fails.
_COMPILE_FOR_SM90 = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mhar_ablate.kernels import sinkhorn as kernel

for n in (4, 5):
    meta = kernel._meta(n, torch.device("cuda"))
    warps = meta.pop("num_warps")
    for fn, pointers in ((kernel._sinkhorn_fwd_kernel, ("x_ptr", "out_ptr")),
                         (kernel._sinkhorn_bwd_kernel, ("x_ptr", "dy_ptr", "dx_ptr"))):
        signature = {**{p: "*fp32" for p in pointers}, "N": "i32", "iters": "i32", **{c: "constexpr" for c in meta}}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=meta),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], (fn.__name__, n)
"""


@pytest.mark.skipif(not _ptxas_available(), reason="triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_the_h200_without_a_gpu(tmp_path):
    """The interpreter runs the kernels' Python, not their lowering: compiling them ahead of time for sm_90
    (the H200), with the launch configuration the GPU uses (``_meta``; n = 5 pads to 8), catches here what
    only a GPU run would otherwise show (an op or a layout the backend rejects)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}  # compiled afresh
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
