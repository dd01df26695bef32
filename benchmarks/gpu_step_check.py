"""GPU check of the training step (issue: GPU step): does `train` run at the speed `bench model` measures for
the same step, without host syncs, and does a captured run train what an uncaptured one does?

Stages (``--stages``, comma-separated, run in the order given; each writes its rows as soon as it has them):

- ``syncs``: one TrainStep per variant at the small preset under ``torch.cuda.set_sync_debug_mode``: the
  number of synchronising calls in 5 steps, captured and uncaptured (the captured step must have none).
- ``curves``: `train` at the small preset, 120 steps, seed 0, with and without ``train.cuda_graph``; the
  validation curves must agree within bf16 noise (``--curve-tol``, relative), or the check FAILS.
- ``speed``: for each ``--presets`` entry and each variant: ``bench model --cuda-graph`` (graph-replayed
  rows) and a `train` run of the same shape (8 sequences, the preset's length, the paper vocabulary),
  compiled or not (``--compile``); tokens/s of both and their ratio (target >= 0.95).

Usage on the device (the package on PYTHONPATH):
    python benchmarks/gpu_step_check.py --out $OUT --stages syncs,curves,speed --presets small,paper100m
The table is printed last; rows are also in $OUT/step_check.json, every command's output in $OUT/*.log.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HEADS = 8  # bench model's default --heads


def train_overrides(name: str) -> list[str]:
    """`train` overrides for the `bench model` variant NAME (its name less -eager/-compiled): the same model."""
    from mhar_ablate.bench.variants import all_variants

    v = next((v for v in all_variants([None]) if v.name == f"{name}-eager"), None)
    if v is None:
        raise SystemExit(f"unknown variant {name!r}: {', '.join(x.name[:-6] for x in all_variants([None]) if not x.compiled)}")
    return [f"{k}={val}" for k, val in v.overrides(HEADS).items()]


VARIANTS = {name: train_overrides(name) for name in ("baseline", "mhar-full-fused", "mhar-block4-fused")}
PAPER_VOCAB = 151_936
BATCH = 8
TRAIN_STEPS = {"small": 300, "paper100m": 60, "paper350m": 60, "paper1b": 40}


def log_run(cmd: list[str], log: Path) -> int:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        f.write(f"[rc {rc}, {time.perf_counter() - t0:.1f} s]\n")
    return rc


def stage_syncs(rows: list[dict]) -> None:
    import torch

    from mhar_ablate.config import OptimConfig, build_config
    from mhar_ablate.model import Decoder
    from mhar_ablate.training.step import TrainStep, make_loss, make_optimizer

    dev = torch.device("cuda")
    for name, over in VARIANTS.items():
        for graph in (False, True):
            cfg = build_config(overrides=dict(o.split("=", 1) for o in over + ["model.preset=small"]))
            torch.manual_seed(0)
            with dev:
                model = Decoder(cfg.model, cfg.residual, 4096)
            step = TrainStep(model, make_optimizer(model, OptimConfig(), dev), make_loss(model, None), grad_clip=1.0,
                             autocast=torch.bfloat16, device=dev, cuda_graph=graph)
            x = torch.randint(0, 4096, (BATCH, cfg.model.seq_len), device=dev)
            step.prepare(x, x)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    outs = []
                    for i in range(5):
                        step.set_lr(1e-3 * (i + 1))
                        outs.append(step(x, x))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
            where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
            finite = all(math.isfinite(v) for o in outs for v in o.tolist())
            rows.append({"stage": "syncs", "variant": name, "captured": step.captured, "syncs": len(syncs),
                         "where": where[:6], "finite": finite,
                         "ok": finite and (len(syncs) == 0 or not graph) and step.captured == graph})
            print(json.dumps(rows[-1]), flush=True)


def _sync_places(name: str, steps: int, work: Path) -> tuple[dict[str, int], dict]:
    import torch

    from mhar_ablate.config import build_config
    from mhar_ablate.training.run import train_run

    cfg = build_config(overrides=dict(o.split("=", 1) for o in VARIANTS[name] + [
        "model.preset=small", f"train.steps={steps}", "train.log_every=1000", "train.eval_every=2",
        "train.batch_size=8", "train.eval_batches=1"]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = train_run(cfg, work / f"loop-{name}-{steps}", work / "cache", log=lambda s: None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    places: dict[str, int] = {}
    for w in seen:
        if "synchroniz" in str(w.message).lower():
            key = f"{Path(w.filename).name}:{w.lineno}"
            places[key] = places.get(key, 0) + 1
    return places, r


def stage_loop_syncs(rows: list[dict], work: Path) -> None:
    """Synchronising calls in whole `train` runs (Lightning's loop included), by place, in a run of 40 and
    one of 120 steps: a place whose count grows with the steps stalls during training; the others are the
    fixed costs of a run (evaluations, the checkpoint, preparing the step, tearing down)."""
    for name in ("baseline", "mhar-full-fused"):
        short, _ = _sync_places(name, 40, work)
        long, r = _sync_places(name, 120, work)
        growing = {k: (short.get(k, 0), v) for k, v in long.items() if v > short.get(k, 0)}
        rows.append({"stage": "syncs", "variant": f"{name} (train loop)", "captured": r.get("cuda_graph"),
                     "syncs": sum(v for _, v in growing.values()),
                     "where": [f"{k} {a}->{b}" for k, (a, b) in growing.items()]
                     or [f"fixed: {k} x{v}" for k, v in sorted(long.items(), key=lambda kv: -kv[1])][:6],
                     "ok": not growing and bool(r.get("cuda_graph"))})
        print(json.dumps(rows[-1]), flush=True)


def train_cmd(out: Path, preset: str, over: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "mhar_ablate", "train", "--preset", preset, "--output", str(out), *over, *extra]


def read_result(out: Path, since: float = 0.0) -> dict | None:
    """The newest run's result under ``out`` written after ``since`` (a time.time())."""
    found = [p for p in glob.glob(str(out / "runs" / "*" / "result.json")) if os.path.getmtime(p) >= since]
    return json.loads(Path(max(found, key=os.path.getmtime)).read_text()) if found else None


def stage_curves(rows: list[dict], args, work: Path, logs: Path) -> None:
    """Captured against uncaptured, same seed: their difference must be within the run's own noise, measured
    as the difference that a rounding-sized change makes (the learning rate times 1 + 1e-5), since a few
    hundred bf16 steps amplify any change of summation order."""
    for name in ("baseline", "mhar-full-fused"):
        curves = {}
        for label, extra in (("captured", ["train.cuda_graph=true"]), ("uncaptured", ["train.cuda_graph=false"]),
                             ("nudged", ["train.cuda_graph=true", "optim.lr=0.00300003"])):
            out = work / f"curve-{name}-{label}"
            rc = log_run(train_cmd(out, "small", VARIANTS[name], ["--budget", "steps", "--steps", "120",
                                                                  "train.eval_every=6", "train.batch_size=8",
                                                                  "seed=0", *extra]), logs / "curves.log")
            r = read_result(out) or {}
            curves[label] = r.get("curve", []), r.get("cuda_graph"), rc

        def worst(a, b):
            d = [abs(p["val_loss"] - q["val_loss"]) / abs(q["val_loss"]) for p, q in zip(a, b)]
            return max(d) if d and len(a) == len(b) else math.inf

        (a, ga, ra), (b, gb, rb), (c, _, rc) = curves["captured"], curves["uncaptured"], curves["nudged"]
        diff, noise = worst(a, b), worst(a, c)
        rows.append({"stage": "curves", "variant": name, "captured_mode": ga, "uncaptured_mode": gb,
                     "points": len(a), "worst_rel_diff": diff, "noise_rel_diff": noise,
                     "last_captured": a and a[-1]["val_loss"], "last_uncaptured": b and b[-1]["val_loss"],
                     "ok": ra == rb == rc == 0 and ga is True and gb is False and len(a) > 2
                     and diff <= max(3 * noise, args.curve_tol)})
        save(rows, args)
        print(json.dumps(rows[-1]), flush=True)


def stage_speed(rows: list[dict], args, work: Path, logs: Path) -> None:
    for preset in args.presets.split(","):
        seq = None
        mode = "compiled" if args.compile else "eager"
        bench_json = work / f"bench-{preset}-{mode}.json"
        chosen = {k: VARIANTS.get(k) or train_overrides(k) for k in args.variants.split(",")}
        names = ",".join(f"{v}-{mode}" for v in chosen)
        log_run([sys.executable, "-m", "mhar_ablate", "bench", "model", "--preset", preset, "--variants", names,
                 "--cuda-graph", "--no-split", "--steps", "10", "--warmup", "3", "--json", str(bench_json)],
                logs / f"bench-{preset}.log")
        bench = json.loads(bench_json.read_text()) if bench_json.exists() else []
        for name, over in chosen.items():
            graph_row = next((r for r in bench if r["variant"] == f"{name}-{mode}-graph"), {})
            plain_row = next((r for r in bench if r["variant"] == f"{name}-{mode}"), {})
            seq = graph_row.get("seq") or seq
            out = work / "speed"  # one output for every run: its data cache is built once
            extra = ["--budget", "steps", "--steps", str(TRAIN_STEPS.get(preset, 60)), f"train.batch_size={BATCH}",
                     f"model.vocab_size={PAPER_VOCAB}", f"train.compile={'true' if args.compile else 'false'}",
                     "train.eval_every=1", "train.eval_batches=1"]  # one eval (and checkpoint) at the end
            since = time.time()
            rc = log_run(train_cmd(out, preset, over, extra), logs / f"train-{preset}.log")
            r = read_result(out, since) or {}
            bt, tt = graph_row.get("tokens_per_s"), r.get("tokens_per_s")
            rows.append({"stage": "speed", "preset": preset, "variant": name, "mode": mode,
                         "bench_graph_tokens_per_s": bt, "bench_launch_tokens_per_s": plain_row.get("tokens_per_s"),
                         "train_tokens_per_s": tt, "train_over_bench": (tt / bt) if bt and tt else None,
                         "bench_peak_gb": graph_row.get("peak_gb"), "train_peak_gb": r.get("peak_mem_gb"),
                         "train_cuda_graph": r.get("cuda_graph"), "train_prepare_s": r.get("prepare_seconds"),
                         "train_status": r.get("status"), "rc": rc,
                         # where a run's time outside its training clock goes (the call's budget, not the ratio)
                         "train_eval_s": r.get("eval_seconds"), "train_checkpoint_s": r.get("checkpoint_seconds"),
                         "train_wall_s": round(time.time() - since, 1),
                         "ok": bool(bt and tt and tt / bt >= 0.95 and r.get("cuda_graph"))})
            save(rows, args)
            print(json.dumps(rows[-1]), flush=True)


def save(rows: list[dict], args) -> None:
    (Path(args.out) / "step_check.json").write_text(json.dumps(rows, indent=1) + "\n")


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["stage"] == "syncs":
            what = "syncs growing with steps" if "loop" in r["variant"] else "syncs in 5 steps"
            lines.append(f"syncs  {r['variant']:<18} captured={r['captured']!s:<5} {what}: {r['syncs']:<3} "
                         f"{'ok' if r['ok'] else 'FAIL'} {' '.join(r['where'])}")
        elif r["stage"] == "curves":
            lines.append(f"curves {r['variant']:<18} {r['points']} evals, worst relative val-loss diff "
                         f"{r['worst_rel_diff']:.2e}, noise {r.get('noise_rel_diff', math.nan):.2e} "
                         f"(last {r['last_captured']} vs {r['last_uncaptured']}): "
                         f"{'ok' if r['ok'] else 'FAIL'}")
        else:
            f = lambda v: f"{v:,.0f}" if v else "-"  # noqa: E731
            ratio = f"{r['train_over_bench']:.3f}" if r["train_over_bench"] else "-"
            lines.append(f"speed  {r['preset']:<9} {r['variant']:<18} {r['mode']:<8} bench graph {f(r['bench_graph_tokens_per_s']):>10} "
                         f"launch {f(r['bench_launch_tokens_per_s']):>10}  train {f(r['train_tokens_per_s']):>10}  "
                         f"train/bench {ratio}  peak {r['bench_peak_gb']}/{r['train_peak_gb']} GB  "
                         f"prepare {r['train_prepare_s'] and round(r['train_prepare_s'], 1)} s  "
                         f"wall {r.get('train_wall_s')} s (eval {r.get('train_eval_s') and round(r['train_eval_s'], 1)} s, "
                         f"checkpoints {r.get('train_checkpoint_s') and round(r['train_checkpoint_s'], 1)} s)  "
                         f"{'ok' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-step-check"))
    p.add_argument("--stages", default="syncs,curves,speed")
    p.add_argument("--presets", default="small")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="speed stage: bench model variant names less -eager/-compiled, e.g. hc,mhc,delta-full-fused")
    p.add_argument("--compile", action="store_true", help="speed stage: compiled model (bench and train)")
    p.add_argument("--curve-tol", type=float, default=2e-3,
                   help="relative val-loss difference always accepted, whatever the measured noise")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("STEP_CHECK_WORK", "/tmp/step-check"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    summary = out / "step_check.json"
    if summary.exists():
        rows = json.loads(summary.read_text())
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            if stage == "syncs":
                stage_syncs(rows)
            elif stage == "loop_syncs":
                stage_loop_syncs(rows, work)
            elif stage == "curves":
                stage_curves(rows, args, work, out)
            elif stage == "speed":
                stage_speed(rows, args, work, out)
            else:
                raise SystemExit(f"unknown stage {stage}")
        except Exception as e:  # the other stages still run; the table says what broke
            import traceback

            traceback.print_exc()
            rows.append({"stage": "syncs", "variant": f"{stage} stage", "captured": None, "syncs": -1,
                         "where": [f"{type(e).__name__}: {e}"[:200]], "ok": False})
        print(f"[{stage}: {time.perf_counter() - t0:.0f} s]", flush=True)
        summary.write_text(json.dumps(rows, indent=1) + "\n")
    print()
    print(table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
