"""Timing of the fused routing op (``mhar_route``, backend ``"triton"``) on a GPU. Its correctness (fp32, bf16,
fp16 against the float64 oracle, odd shapes, offsets past 2^31, determinism, torch.compile) is
``tests/kernels/test_kernels_gpu.py``: run that first.

Sections (``--sections``, comma-separated, run in this order):

* ``copy``: the device-to-device copy bandwidth, the ceiling the minimum bytes are measured against.
* ``diag``: where small-S time goes: the kernels replayed from a CUDA graph, launched from Python, and the
  op through ``mhar_route`` + autograd, with the host time to issue one forward+backward.
* ``sweep``: forward / backward launch configurations at d = 1024 and 1280 (H = 8, S = 49, 32k tokens),
  each compared with the default configuration's result before it is timed.
* ``table``: forward and forward+backward time of the kernel, the eager reference, ``torch.compile`` of the
  reference and, at H = 1, Liger-Kernel's ``liger_attn_res`` when it is importable.

Times are medians of ``triton.testing.do_bench``. Minimum bytes: forward reads S sources and writes the
output, (S + 1)·N·d·size; backward reads S sources and the output gradient and writes S source gradients,
(2S + 1)·N·d·size. Run from the repository root:

    PYTHONPATH=$PWD python3 -m pytest -q tests/kernels/test_kernels_gpu.py
    PYTHONPATH=$PWD python3 benchmarks/bench_route.py --sections copy,table --out /tmp/bench

Liger-Kernel (``liger_kernel``, optional) is timed at H = 1 when importable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import triton
import triton.testing

from mhar_ablate.kernels import launch, mhar_triton
from mhar_ablate.kernels.reference import mhar_route_reference
from mhar_ablate.ops import mhar_route

DEV = "cuda"
EPS = 1e-6
T0 = time.time()
LOG = None


def log(msg: str = "") -> None:
    print(msg, flush=True)
    if LOG is not None:
        LOG.write(msg + "\n")
        LOG.flush()


def record(kind: str, **fields) -> None:
    if LOG is not None:
        with open(os.path.join(ARGS.out, "results.jsonl"), "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")


def elapsed() -> float:
    return time.time() - T0


def bench(fn, rep=100, warmup=25) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def inputs(S, N, d, dtype, seed, requires_grad=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = torch.linspace(0.5, 2.0, S, device=DEV).view(S, 1, 1, 1)
    src = (torch.randn(S, 1, N, d, device=DEV, generator=g) * scale + 0.1).to(dtype)
    q = torch.randn(d, device=DEV, generator=g) * (2.0 / (d / 8) ** 0.5)
    w = 1.0 + 0.5 * torch.randn(d, device=DEV, generator=g)
    gout = torch.randn(1, N, d, device=DEV, generator=g).to(dtype)
    if requires_grad:
        src, q, w = (t.requires_grad_() for t in (src, q, w))
    return src, q, w, gout


def rel(a, b) -> float:
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


LIGER_TOL = 1.5e-2  # relative L2 difference from the reference (bf16) under which Liger is timed


# ----------------------------------------------------------------------------------------------------------
def _copy_ms(n: int) -> float:
    a = torch.randn(n // 2, device=DEV).to(torch.bfloat16).repeat(2)
    b = torch.empty_like(a)
    return bench(lambda: b.copy_(a))


def section_copy() -> float:
    n = 1 << 31  # 4 GiB of bf16 each way
    ms = _copy_ms(n)
    torch.cuda.empty_cache()
    bw = 2 * n * 2 / ms / 1e9
    log(f"== copy: {2 * n * 2 / 1e9:.2f} GB moved in {ms:.3f} ms = {bw:.2f} TB/s")
    record("copy", ms=ms, tbps=bw)
    return bw


# ----------------------------------------------------------------------------------------------------------
SWEEP = {  # d: (forward configs, backward configs), the last round of tuning (docs/kernel-notes.md)
    1024: ([{"BLOCK_N": 1, "num_warps": 4}, {"BLOCK_N": 1, "num_warps": 4, "maxnreg": 40},
            {"BLOCK_N": 2, "num_warps": 8}],
           [{"BLOCK_N": 1, "num_warps": 4}, {"BLOCK_N": 1, "num_warps": 4, "maxnreg": 56},
            {"BLOCK_N": 2, "num_warps": 8}]),
    1280: ([{"BLOCK_N": 1, "num_warps": 4}, {"BLOCK_N": 1, "num_warps": 4, "maxnreg": 56},
            {"BLOCK_N": 1, "num_warps": 8}, {"BLOCK_N": 2, "num_warps": 8}],
           [{"BLOCK_N": 1, "num_warps": 4}, {"BLOCK_N": 1, "num_warps": 4, "maxnreg": 96},
            {"BLOCK_N": 1, "num_warps": 4, "maxnreg": 88}, {"BLOCK_N": 1, "num_warps": 8},
            {"BLOCK_N": 2, "num_warps": 8}]),
}
ADOPTED: dict[int, tuple[dict, dict]] = {}


def _sweep_d(d: int, fwd_cfgs: list[dict], bwd_cfgs: list[dict], copy_bw: float) -> list[dict | None]:
    """Time the configurations at one d; the fastest forward and backward configuration (None if none ran)."""
    S, N, H = 49, 32768, 8
    src, q, w, gout = inputs(S, N, d, torch.bfloat16, seed=9)
    out0, lse0 = mhar_triton.forward(src, q, w, H, EPS, config=dict(fwd_cfgs[0]))
    ds0 = mhar_triton.backward(gout, src, q, w, out0, lse0, H, EPS, config=dict(bwd_cfgs[0]))[0]
    fwd_bytes = (S + 1) * N * d * 2
    bwd_bytes = (2 * S + 1) * N * d * 2
    best = []
    for kind, cfgs, nbytes in (("fwd", fwd_cfgs, fwd_bytes), ("bwd", bwd_cfgs, bwd_bytes)):
        res = []
        for cfg in cfgs:
            try:
                if kind == "fwd":
                    def fn(cfg=cfg):
                        return mhar_triton.forward(src, q, w, H, EPS, config=dict(cfg))
                    err = rel(fn()[0], out0)
                else:
                    def fn(cfg=cfg):
                        return mhar_triton.backward(gout, src, q, w, out0, lse0, H, EPS, config=dict(cfg))
                    err = rel(fn()[0], ds0)
                ms = bench(fn, rep=100, warmup=10)
                res.append((ms, json.dumps(cfg)))
                log(f"  d={d} {kind} {ms:.3f} ms {nbytes / ms / 1e9:.2f} TB/s "
                    f"({100 * nbytes / ms / 1e9 / copy_bw:.0f}% copy) err {err:.0e} {cfg}")
                record("sweep_" + kind, d=d, ms=ms, err=err, **cfg)
            except Exception as e:  # a config that does not compile is just skipped
                log(f"  d={d} {kind} {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
        best.append(json.loads(min(res)[1]) if res else None)
    return best


def section_sweep(copy_bw: float) -> None:
    """A few launch configurations at d = 1024 and 1280 (H = 8, S = 49, 32k tokens); with --adopt-sweep
    the fastest of each becomes the configuration the table runs with."""
    log("== sweep (bf16, H=8, S=49, 32768 tokens): ms, TB/s on minimum bytes")
    for d, (fwd_cfgs, bwd_cfgs) in SWEEP.items():
        best = _sweep_d(d, fwd_cfgs, bwd_cfgs, copy_bw)
        torch.cuda.empty_cache()
        resident = {k[3]: v for k, v in launch.RESIDENT.items()}
        log(f"  resident backward programs per SM by config: {sorted(set(resident.values()))}")
        if ARGS.adopt_sweep and None not in best:
            ADOPTED[d] = (best[0], best[1])
            log(f"  d={d}: table runs with fwd {best[0]}, bwd {best[1]}")
    if ADOPTED:
        fwd_default, bwd_default = mhar_triton.forward_config, mhar_triton.backward_config
        mhar_triton.forward_config = lambda d, h, dev: dict(ADOPTED[d][0]) if d in ADOPTED else fwd_default(d, h, dev)
        mhar_triton.backward_config = lambda d, h, dev: dict(ADOPTED[d][1]) if d in ADOPTED else bwd_default(d, h, dev)


# ----------------------------------------------------------------------------------------------------------
def _diag_s(S: int, H: int, N: int, d: int) -> dict:
    src, q, w, gout = inputs(S, N, d, torch.bfloat16, seed=11)

    def kernels():
        o, l = mhar_triton.forward(src, q, w, H, EPS)
        return mhar_triton.backward(gout, src, q, w, o, l, H, EPS)

    kernels()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels()
    t_graph = bench(graph.replay)
    t_python = bench(kernels)
    leaves = [t.detach().requires_grad_() for t in (src, q, w)]

    def full():
        return torch.autograd.grad(mhar_route(*leaves, H, backend="triton"), leaves, gout)

    t_full = bench(full)
    full()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        full()
    t_issue = (time.perf_counter() - t) / 20 * 1e3
    torch.cuda.synchronize()
    return {"graph": t_graph, "python": t_python, "autograd": t_full, "host_issue": t_issue}


def section_diag() -> None:
    """Where small-S time goes: the kernels replayed from a CUDA graph (device time only), the same calls
    launched from Python, the op through autograd, and the host time to issue one forward+backward."""
    log("== overhead (bf16, d=1024, H=8, 32768 tokens; ms): graph replay of the kernels | kernels from "
        "Python | through mhar_route + autograd | host time to issue one fwd+bwd")
    H, N, d = 8, 32768, 1024
    for S in (2, 9, 49):
        r = _diag_s(S, H, N, d)
        torch.cuda.empty_cache()
        floor = (3 * S + 2) * N * d * 2 / ARGS_COPY_BW[0] / 1e9
        log(f"  S={S:2d}: floor {floor:.3f} | graph {r['graph']:.3f} | python {r['python']:.3f} | autograd "
            f"{r['autograd']:.3f} | host issue {r['host_issue']:.3f}")
        record("diag", S=S, floor=floor, **r)


ARGS_COPY_BW = [4.25]


# ----------------------------------------------------------------------------------------------------------
def try_liger():
    try:
        from liger_kernel.transformers.functional import liger_attn_res  # optional benchmark dependency
        return liger_attn_res
    except Exception as e:
        log(f"Liger-Kernel not importable ({type(e).__name__}: {e}); H=1 rows without it")
        return None


def time_impl(route, src, q, w, gout, with_bwd=True):
    """(fwd ms, fwd+bwd ms) of ``route(src, q, w)``."""
    f = bench(lambda: route(src, q, w))
    fb = None
    if with_bwd:
        leaves = [t.detach().requires_grad_() for t in (src, q, w)]
        fb = bench(lambda: torch.autograd.grad(route(*leaves), leaves, gout))
    return f, fb


def section_table(copy_bw: float) -> None:
    log(f"== table (bf16; ms; BW = minimum bytes / time; x = speed-up of the kernel; copy {copy_bw:.2f} TB/s)")
    rows = []
    # (d, tokens, H, S, what besides the kernel: e = eager reference, c = torch.compile, l = Liger), most
    # important first: the time budget cuts the tail, and the compiles are the slow part
    plan = [(1024, 32768, 8, 49, "ec")] + [(1024, 32768, 1, S, "el") for S in (2, 9, 25, 49)]
    plan += [(1280, 16384, 8, S, "e") for S in (2, 9, 25, 49, 73)] + [(1280, 32768, 8, 49, "e")]
    plan += [(1024, 32768, 8, S, "ec") for S in (2, 9, 25, 73)] + [(1280, 16384, 8, 49, "c")]
    if ARGS.quick_table:  # the headline rows only, the kernel alone
        plan = [(1024, 32768, 8, 49, ""), (1280, 16384, 8, 49, ""), (1024, 32768, 8, 9, "")]
    liger = try_liger()
    done = {}
    for d, N, H, S, what in plan:
        if elapsed() > ARGS.budget:
            log("budget reached, table stopped")
            break
        src, q, w, gout = inputs(S, N, d, torch.bfloat16, seed=S + d)
        gout = gout.view(1, N, d)
        fb_bytes, f_bytes = (3 * S + 2) * N * d * 2, (S + 1) * N * d * 2
        key = (d, N, H, S)
        row = done.get(key) or {"d": d, "tokens": N, "H": H, "S": S, "floor_fwd": f_bytes / copy_bw / 1e9,
                                "floor_fb": fb_bytes / copy_bw / 1e9}
        if "ours_fwd" not in row:
            row["ours_fwd"], row["ours_fb"] = time_impl(lambda s, a, b: mhar_route(s, a, b, H, backend="triton"),
                                                        src, q, w, gout)
        if "e" in what:
            try:
                row["eager_fwd"], row["eager_fb"] = time_impl(lambda s, a, b: mhar_route_reference(s, a, b, H),
                                                              src, q, w, gout)
            except torch.OutOfMemoryError:
                log(f"  eager reference out of memory at S={S} d={d}")
            torch.cuda.empty_cache()
        if "c" in what and not ARGS.no_compile:
            torch._dynamo.reset()
            compiled = torch.compile(mhar_route_reference, dynamic=False)
            try:
                t = time.time()
                row["compile_fwd"], row["compile_fb"] = time_impl(lambda s, a, b: compiled(s, a, b, H), src, q, w, gout)
                log(f"  (torch.compile: {time.time() - t:.0f}s including compilation)")
            except Exception as e:
                log(f"  torch.compile failed at S={S} d={d}: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()
        if "l" in what and liger is not None:
            try:
                v = src.view(S, 1, N, d)
                lo = liger(v, q, w)
                row["liger_err"] = rel(lo, mhar_route_reference(v, q, w, 1))
                if row["liger_err"] < LIGER_TOL:
                    row["liger_fwd"], row["liger_fb"] = time_impl(lambda s, a, b: liger(s, a, b), v, q, w, gout)
                else:
                    log(f"  liger output differs from the reference at S={S}: {row['liger_err']:.1e}; not timed")
            except Exception as e:
                log(f"  liger failed at S={S}: {type(e).__name__}: {str(e)[:200]}")
        if key not in done:
            rows.append(row)
        done[key] = row
        record("table", **row)
        log(fmt_row(row, copy_bw))
        del src, q, w, gout
        torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r["H"] == 1, r["d"], r["tokens"], r["S"]))
    log("")
    log("== summary table")
    log("| d | tokens | H | S | floor fwd | kernel fwd | BW fwd | eager fwd | compile fwd | other fwd | "
        "floor f+b | kernel f+b | BW f+b | eager f+b | compile f+b | other f+b |")
    for row in rows:
        log(fmt_md(row, copy_bw))


def _ms(x):
    return "–" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _x(base, ours):
    return "" if base is None or ours is None else f" ({base / ours:.1f}×)"


def fmt_row(r, copy_bw):
    return (f"d={r['d']} N={r['tokens']} H={r['H']} S={r['S']:2d}: fwd {_ms(r['ours_fwd'])} "
            f"({100 * r['floor_fwd'] / r['ours_fwd']:.0f}% floor) eager {_ms(r.get('eager_fwd'))} "
            f"compile {_ms(r.get('compile_fwd'))} liger {_ms(r.get('liger_fwd'))} | f+b {_ms(r['ours_fb'])} "
            f"({100 * r['floor_fb'] / r['ours_fb']:.0f}% floor) eager {_ms(r.get('eager_fb'))} "
            f"compile {_ms(r.get('compile_fb'))} liger {_ms(r.get('liger_fb'))}")


def fmt_md(r, copy_bw):
    bw_f = r["floor_fwd"] * copy_bw / r["ours_fwd"]
    bw_fb = r["floor_fb"] * copy_bw / r["ours_fb"]
    other_f = _ms(r.get("liger_fwd")) + _x(r.get("liger_fwd"), r["ours_fwd"]) if "liger_fwd" in r else "–"
    other_fb = _ms(r.get("liger_fb")) + _x(r.get("liger_fb"), r["ours_fb"]) if "liger_fb" in r else "–"
    return (f"| {r['d']} | {r['tokens']} | {r['H']} | {r['S']} | {_ms(r['floor_fwd'])} | {_ms(r['ours_fwd'])} | "
            f"{bw_f:.2f} TB/s ({100 * bw_f / copy_bw:.0f}%) | {_ms(r.get('eager_fwd'))}{_x(r.get('eager_fwd'), r['ours_fwd'])} | "
            f"{_ms(r.get('compile_fwd'))}{_x(r.get('compile_fwd'), r['ours_fwd'])} | {other_f} | "
            f"{_ms(r['floor_fb'])} | {_ms(r['ours_fb'])} | {bw_fb:.2f} TB/s ({100 * bw_fb / copy_bw:.0f}%) | "
            f"{_ms(r.get('eager_fb'))}{_x(r.get('eager_fb'), r['ours_fb'])} | "
            f"{_ms(r.get('compile_fb'))}{_x(r.get('compile_fb'), r['ours_fb'])} | {other_fb} |")


# ----------------------------------------------------------------------------------------------------------
def main() -> int:
    global ARGS, LOG
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="copy,table")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--budget", type=float, default=540.0, help="seconds; stop timing sections after this")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument("--quick-table", action="store_true", help="only the headline rows, kernel only")
    p.add_argument("--adopt-sweep", action="store_true", help="time the table with the sweep's fastest configs")
    p.add_argument("--copy-bw", type=float, default=None, help="TB/s; measured by the copy section otherwise")
    ARGS = p.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    LOG = open(os.path.join(ARGS.out, "bench.log"), "a")
    sections = ARGS.sections.split(",")
    log(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{time.strftime('%Y-%m-%d %H:%M')} | {' '.join(sys.argv)}")
    unknown = sorted(set(sections) - {"copy", "diag", "sweep", "table"})
    if unknown:
        log(f"unknown section(s) {', '.join(unknown)}: the correctness check is tests/kernels/test_kernels_gpu.py now")
        return 2
    copy_bw = ARGS.copy_bw or 4.25
    if "copy" in sections:
        copy_bw = section_copy()
    ARGS_COPY_BW[0] = copy_bw
    if "diag" in sections:
        try:
            section_diag()
        except Exception:
            log("diag failed:\n" + traceback.format_exc())
    if "sweep" in sections:
        section_sweep(copy_bw)
    if "table" in sections:
        section_table(copy_bw)
    log(f"done in {elapsed():.0f}s")
    return 0


ARGS = None
if __name__ == "__main__":
    sys.exit(main())
