"""Where a training process's GPU memory goes beyond PyTorch's caching allocator: at `paper100m` the study
runs recorded 21-22 GB reserved while nvidia-smi showed their process at about 70 GB (docs/results/README.md,
"`budget.yaml` — `paper100m` on `debian-en`").

Trains one run in this process exactly as `mhar-ablate train` does, while a thread samples, every
``--every`` seconds, the process's GPU memory as the driver counts it (nvidia-smi, a separate process, so
nothing is asked of CUDA during a graph capture) beside the allocator's reserved and allocated bytes (host
counters), with the phase the run is in (preparing and capturing the step, training, a periodic
evaluation, the final evaluation) and its step. Writes ``process-memory-ARM.csv`` under ``--out`` and
prints, per phase, the largest process use, the largest reserved and the largest gap between them, and
the first sample where the gap passes 2 GB.

    PYTHONPATH=$PWD python3 benchmarks/process_memory.py --out $OUT --steps 100 residual.kind=baseline \\
        --preset paper100m model.vocab_size=16384 data.source=outputs/pack-debian-en-48m data.tokenizer=bpe data.vocab_size=16384

needs a CUDA GPU and nvidia-smi.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MB = 1 << 20
GAP_NOTED = 2 << 30


def process_mib(pid: int) -> float | None:
    """This process's GPU memory in MiB as nvidia-smi lists it, or None where it is not listed."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return float(parts[1])
    return None


class Probe:
    """The run's phase and step, set by the patched methods below, and the samples taken."""

    def __init__(self) -> None:
        self.phase, self.step = "start", 0
        self.rows: list[dict] = []
        self.done = threading.Event()

    def during(self, phase: str, fn):
        def wrapped(*a, **kw):
            before = self.phase
            self.phase = phase
            try:
                return fn(*a, **kw)
            finally:
                self.phase = before if phase != "final evaluation" else "after"
        return wrapped

    def sample_forever(self, every: float) -> None:
        import torch

        pid, t0 = os.getpid(), time.perf_counter()
        while not self.done.is_set():
            used = process_mib(pid)
            self.rows.append({"t": round(time.perf_counter() - t0, 2), "phase": self.phase, "step": self.step,
                              "process_mib": used,
                              "reserved_mib": round(torch.cuda.memory_reserved() / MB, 1),
                              "allocated_mib": round(torch.cuda.memory_allocated() / MB, 1)})
            self.done.wait(every)


def patch(probe: Probe) -> None:
    from mhar_ablate.training import final_eval
    from mhar_ablate.training.module import LMModule
    from mhar_ablate.training.step import TrainStep

    TrainStep.prepare = probe.during("prepare and capture", TrainStep.prepare)
    LMModule.evaluate = probe.during("periodic evaluation", LMModule.evaluate)
    final_eval.evaluate = probe.during("final evaluation", final_eval.evaluate)
    train_step = LMModule.training_step

    def counted(self, batch, batch_idx):
        probe.phase, probe.step = "training", self.global_step
        return train_step(self, batch, batch_idx)

    LMModule.training_step = counted


def summarize(rows: list[dict]) -> list[str]:
    lines = ["| phase | samples | process GB (max) | reserved GB (max) | gap GB (max) | at step |", "|---|---|---|---|---|---|"]
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    for phase in phases:
        rs = [r for r in rows if r["phase"] == phase and r["process_mib"] is not None]
        if not rs:
            continue
        worst = max(rs, key=lambda r: r["process_mib"] - r["reserved_mib"])
        lines.append(f"| {phase} | {len(rs)} | {max(r['process_mib'] for r in rs) * MB / 1e9:.2f} | "
                     f"{max(r['reserved_mib'] for r in rs) * MB / 1e9:.2f} | "
                     f"{(worst['process_mib'] - worst['reserved_mib']) * MB / 1e9:.2f} | {worst['step']} |")
    first = next((r for r in rows if r["process_mib"] is not None
                  and (r["process_mib"] - r["reserved_mib"]) * MB > GAP_NOTED), None)
    lines.append("")
    lines.append("gap first over 2 GB: " + ("never" if first is None else
                 f"{first['t']} s, phase {first['phase']}, step {first['step']} "
                 f"(process {first['process_mib'] / 1024:.1f} GiB, reserved {first['reserved_mib'] / 1024:.1f} GiB)"))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--preset", default="paper100m")
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    args, overrides = p.parse_known_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: process_memory.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from mhar_ablate.cli import main as cli

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arm = "-".join(o.split("=", 1)[1] for o in overrides if o.startswith(("residual.kind=", "residual.heads="))) or "run"
    probe = Probe()
    patch(probe)
    sampler = threading.Thread(target=probe.sample_forever, args=(args.every,), daemon=True)
    sampler.start()
    try:
        code = cli(["train", "--output", str(out / f"train-{arm}"), "--preset", args.preset, "--steps", str(args.steps),
                    *overrides])
    finally:
        probe.done.set()
        sampler.join()
    with open(out / f"process-memory-{arm}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(probe.rows[0]) if probe.rows else ["t"])
        w.writeheader()
        w.writerows(probe.rows)
    print(f"## {arm}: {args.preset}, {args.steps} steps, train exit {code}, "
          f"peak allocated {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    print("\n".join(summarize(probe.rows)))
    return code


if __name__ == "__main__":
    sys.exit(main())
