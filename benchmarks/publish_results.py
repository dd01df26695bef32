"""Copy a finished study's evidence into ``docs/results/NAME/BUDGET/``: what the evidence issue asks to
commit, laid out the same way for every study.

    python3 benchmarks/publish_results.py heads --output /tmp/gpu-study --budgets steps,wallclock \
        --command "bash benchmarks/gpu_study.sh heads wallclock 560 --preset small" --dest docs/results

Per budget it runs ``mhar-ablate export NAME --budget B --format md`` (the table and its plots), then writes
into ``DEST/NAME/B/``:
- ``table.md`` and the export's plots (loss against steps, time and FLOPs, each arm's gap to the baseline
  along the steps or, under the wall-clock budget, the training time; speed-up to target);
- ``routing-best-mhar.png``: the routing heatmap of the MHAR run with the lowest final-set loss;
- ``runs.md``: one row per run (arm, seed, steps, seconds, tokens/s, peak memory, step mode, losses), and
  each arm's throughput spread over its seeds;
- ``provenance.md``: the commands given, and what the runs recorded (package version and commit, device,
  torch/triton/lightning, the dates their results were written).
The study's own folder is only read; ``DEST/NAME/B`` is replaced.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from mhar_ablate.bench.model import cell, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect_runs import KEYS  # noqa: E402  (the per-run figures docs/benchmarks.md quotes)

PLOTS = ("loss_vs_steps.png", "loss_vs_time.png", "loss_vs_flops.png", "gap_vs_steps.png", "gap_vs_time.png",
         "speedup_to_target.png")


def runs_of(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*/result.json")):
        r = json.loads(path.read_text())
        row = {k: r.get(k) for k in KEYS}
        row["final_eval_loss"] = (r.get("final_eval") or {}).get("loss")
        row["environment"] = r.get("environment") or {}
        # Results record when they were made; older ones only have the file's time (which an archive's
        # round trip between machines may have moved).
        row["written"] = r.get("finished_at") or datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC")
        row["folder"] = path.parent
        row["routing_weights"] = r.get("routing_weights")
        out.append(row)
    return out


def best_mhar(runs: list[dict]) -> dict | None:
    """The completed MHAR run (arm label mhar-...) with the lowest final-set loss (else final val loss),
    among those with a heatmap: its routing.png, or the final depth weights its result.json recorded."""
    def loss(r):
        return r["final_eval_loss"] if r["final_eval_loss"] is not None else r["final_val_loss"]

    mhar = [r for r in runs if str(r["arm"]).startswith("mhar") and r["status"] == "completed"
            and loss(r) is not None and ((r["folder"] / "routing.png").is_file() or r.get("routing_weights"))]
    return min(mhar, key=loss) if mhar else None


def write_heatmap(run: dict, path: Path) -> None:
    """The run's routing.png; where a study folder travelled without its images (benchmarks/gpu_evidence.sh's
    state archive), drawn again from the weights in its result.json, as training drew it."""
    if (run["folder"] / "routing.png").is_file():
        shutil.copy2(run["folder"] / "routing.png", path)
        return
    import torch

    from mhar_ablate.training.heatmap import routing_png

    path.write_bytes(routing_png([torch.tensor(w) for w in run["routing_weights"]], run["arm"]))


def runs_table(runs: list[dict]) -> str:
    rows = sorted(runs, key=lambda r: (str(r["arm"]), r["seed"] or 0))
    table = markdown_table(
        ["arm", "seed", "status", "steps", "seconds", "tokens/s", "peak GB", "CUDA graph", "compiled",
         "final val loss", "final-set loss", "wall s"],
        [[str(r["arm"]), str(r["seed"]), str(r["status"]), cell(r["step"], "d"), cell(r["seconds"], ".1f"),
          cell(r["tokens_per_s"], ",.0f"), cell(r["peak_mem_gb"], ".1f"), str(r["cuda_graph"]), str(r["compiled"]),
          cell(r["final_val_loss"], ".4f"), cell(r["final_eval_loss"], ".4f"), cell(r["wall_seconds"], ".0f")]
         for r in rows])
    speeds: dict[str, list[float]] = {}
    for r in rows:
        if r["tokens_per_s"]:
            speeds.setdefault(str(r["arm"]), []).append(float(r["tokens_per_s"]))
    spread = markdown_table(
        ["arm", "runs", "min tokens/s", "max tokens/s", "spread %"],
        [[arm, str(len(v)), f"{min(v):,.0f}", f"{max(v):,.0f}", f"{100 * (max(v) - min(v)) / min(v):.2f}"]
         for arm, v in speeds.items()])
    return f"{table}\n\nThroughput over each arm's seeds:\n\n{spread}\n"


def provenance(runs: list[dict], commands: list[str], name: str, budget: str) -> str:
    def distinct(get):
        return sorted({str(v) for v in map(get, runs) if v not in (None, "")})

    env = [r["environment"] for r in runs]
    lines = [f"# {name}, {budget} budget: provenance", "", "Commands:", "", "```", *commands, "```", ""]
    facts = {
        "runs": str(len(runs)),
        "device": ", ".join(distinct(lambda r: r["device"])),
        "mhar-ablate": ", ".join(distinct(lambda r: r["environment"].get("mhar-ablate"))),
        "git commit": ", ".join(f"{c[:12]}" + (" (dirty)" if any(e.get("git_commit") == c and e.get("git_dirty")
                                                               for e in env) else "")
                                for c in distinct(lambda r: r["environment"].get("git_commit"))),
        **{k: ", ".join(distinct(lambda r, k=k: r["environment"].get(k))) for k in ("torch", "triton", "lightning",
                                                                              "optuna", "python")},
        "results written": " to ".join(dict.fromkeys([min(r["written"] for r in runs), max(r["written"] for r in runs)])),
    }
    lines += [f"- {k}: {v or '–'}" for k, v in facts.items()]
    return "\n".join(lines) + "\n"


def publish(name: str, output: Path, budget: str, dest: Path, commands: list[str]) -> Path:
    folder = output / "studies" / name / budget
    runs = runs_of(folder)
    if not runs:
        raise SystemExit(f"publish_results: no finished runs in {folder}")
    done = subprocess.run([sys.executable, "-m", "mhar_ablate", "export", name, "--budget", budget, "--output",
                           str(output), "--format", "md"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"publish_results: export {name} --budget {budget} failed: "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    target = dest / name / budget
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copy2(folder / "table.md", target / "table.md")
    # The study's own curve over its design choice (``heads_curve.png``: loss against H), where it has one.
    for plot in [*PLOTS, *sorted(f.name for f in folder.glob("*_curve.png"))]:
        if (folder / plot).is_file():
            shutil.copy2(folder / plot, target / plot)
    best = best_mhar(runs)
    if best is not None:
        write_heatmap(best, target / "routing-best-mhar.png")
    (target / "runs.md").write_text(
        f"# {name}, {budget} budget: runs\n\n"
        + (f"Routing heatmap (`routing-best-mhar.png`): {best['folder'].name}.\n\n" if best else "")
        + runs_table(runs))
    (target / "provenance.md").write_text(provenance(runs, commands, name, budget))
    return target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="the study (studies/NAME.yaml)")
    p.add_argument("--output", required=True, type=Path, help="the folder the study trained into")
    p.add_argument("--budgets", help="comma-separated (default: every budget the study folder has)")
    p.add_argument("--dest", default=Path("docs/results"), type=Path)
    p.add_argument("--command", action="append", default=[], help="a command that ran the study (repeatable)")
    args = p.parse_args()
    base = args.output / "studies" / args.name
    budgets = args.budgets.split(",") if args.budgets else sorted(d.name for d in base.glob("*") if d.is_dir())
    if not budgets:
        raise SystemExit(f"publish_results: {base} holds no budget folders")
    for b in budgets:
        print(publish(args.name, args.output, b, args.dest, args.command or ["(not given)"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
