"""Fill Inductor's on-disk cache for several models at once, before a timed GPU run reads it.

Compiling is CPU work and a timed run must have the machine to itself, so the compiles of a GPU call are
done first, side by side in separate processes (``--jobs``), each a short run of the exact shape the timed
run will train; the timed runs then find their graphs in ``TORCHINDUCTOR_CACHE_DIR`` (which the caller
sets, and which `train`/`study` keep when it is set) and spend seconds, not minutes, in ``torch.compile``.
Nothing these warm-up runs measure is reported.

Jobs:
  --bench PRESET:VARIANTS   `bench model --preset PRESET --variants VARIANTS --steps 1 --warmup 1`
                            (each variant its own process, the baselines first and alone: every other
                            job times one too; the compiled step is the one `train` runs)
  --study NAME              a 2-step `train` of every arm of studies/NAME.yaml (seed 0), with --preset and
                            the trailing key=value overrides the study call will be given

    python3 benchmarks/warm_compile.py --jobs 4 --bench paper350m:baseline-compiled,mhar-full-fused-compiled \\
        --study budget --preset paper350m train.compile=true train.batch_size=8

Prints one line per job (seconds, exit code); each job's output goes to --log-dir.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def bench_jobs(spec: str) -> list[list[str]]:
    preset, _, variants = spec.partition(":")
    return [[sys.executable, "-m", "mhar_ablate", "bench", "model", "--preset", preset, "--variants", v,
             "--steps", "1", "--warmup", "1", "--no-split"] for v in variants.split(",") if v]


def study_jobs(name: str, preset: str | None, overrides: list[str], scratch: Path) -> list[list[str]]:
    from mhar_ablate.sweep.definition import StudyDefinition

    d = StudyDefinition.load(name)
    over = dict(o.split("=", 1) for o in overrides)
    jobs = []
    for arm in d.arms:
        # The arm's own config, seed 0, as the study builds it; only the length differs (2 steps).
        cfg = {**d.fixed, **d.arms[arm], **over, "train.budget": "steps", "train.steps": 2, "train.eval_every": 1}
        if preset:
            cfg["model.preset"] = preset
        jobs.append([sys.executable, "-m", "mhar_ablate", "train", "--output", str(scratch / arm),
                     *(f"{k}={v}" for k, v in cfg.items())])
    return jobs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", action="append", default=[], metavar="PRESET:VARIANTS")
    p.add_argument("--study", action="append", default=[], metavar="NAME")
    p.add_argument("--preset", help="preset of the --study jobs")
    p.add_argument("--jobs", type=int, default=4, help="processes at once (each holds a model on the GPU)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 4) // 4),
                   help="Inductor compile threads per process")
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        print("warm_compile: set TORCHINDUCTOR_CACHE_DIR to the cache the timed runs will read", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="warm-compile-"))
    bench = [j for spec in args.bench for j in bench_jobs(spec)]
    # `bench model` adds the baseline to every variant it times: the baselines compile first, alone, so
    # that the other jobs find them in the cache instead of each compiling its own copy side by side.
    first = [j for j in bench if j[8].startswith("baseline")]
    jobs = first + [j for j in bench if j not in first]
    jobs += [j for name in args.study for j in study_jobs(name, args.preset, args.overrides, scratch)]
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(args.threads)}
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)

    running: set[subprocess.Popen] = set()
    stopping = False

    def run(i_job):
        i, job = i_job
        t0 = time.perf_counter()
        if stopping:
            return i, None, 0.0
        with open(logs / "warm.log", "a") as f:
            proc = subprocess.Popen(job, stdout=f, stderr=subprocess.STDOUT, env=env)
            running.add(proc)
            rc = proc.wait()
            running.discard(proc)
        return i, rc, time.perf_counter() - t0

    t0 = time.perf_counter()
    bad = 0
    pool = ThreadPoolExecutor(args.jobs)
    try:
        for wave in (list(enumerate(jobs))[:len(first)], list(enumerate(jobs))[len(first):]):
            for i, rc, s in pool.map(run, wave):
                print(f"warm {s:6.1f} s  rc {rc}  {' '.join(jobs[i][3:9])}", flush=True)
                bad += rc != 0
    except KeyboardInterrupt:  # the caller's time is up: the timed runs compile what is missing themselves
        stopping = True
        for proc in list(running):
            proc.kill()
        print(f"warm: stopped after {time.perf_counter() - t0:.0f} s", flush=True)
        pool.shutdown(wait=True, cancel_futures=True)
        return 1
    pool.shutdown()
    print(f"warm: {len(jobs)} jobs in {time.perf_counter() - t0:.0f} s, {bad} failed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
