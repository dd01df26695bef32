"""Several processes for one run (``train.devices=N``), through Lightning's DDP strategy.

The calling process becomes rank 0 and starts ranks 1..N-1 itself (spawned, on a free loopback port),
with the environment Lightning reads for processes launched from outside (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``): Lightning then joins them into one DDP run (NCCL on GPUs, gloo on a CPU)
instead of re-executing the command line, which inside a study worker would start the study again.

What every rank must agree on, and how (one small all-reduce per step, no-ops on one process):
- the training clock: each rank times its own steps; the run's clock is the slowest rank's (``agree``),
  so the learning rate, the evaluations and the wall-clock stop are the same on every rank and all ranks
  stop on the same step;
- stopping on a signal: only rank 0 has the signal handler (the others ignore SIGINT/SIGTERM), and its
  request reaches the others through the same all-reduce, so a stop lands after the same step everywhere;
- a checkpoint: saving is collective in Lightning, so the "time to checkpoint" test is agreed too;
- a non-finite loss (``any_rank``): a rank that skipped its backward while others did not would hang DDP;
- pruning and the validation loss (``agree_eval``): rank 0 asks Optuna; the others follow.

Only rank 0 writes the run folder (config, TensorBoard, checkpoint, result); batch_size is the global
batch and each rank takes its slice of it, so a step and tokens/s mean the same at any N.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any, Callable

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK")


def world() -> tuple[int, int]:
    """(rank, number of ranks) of the running DDP group; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def env_rank() -> int:
    """This process's rank as launched (before the process group exists)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def inside_rank() -> bool:
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1


_HOST_GROUP = None  # a gloo group beside NCCL: host values are agreed without touching (or waiting for) a GPU


def _reduce(values: list[float], op: str) -> list[float]:
    import torch
    import torch.distributed as dist

    global _HOST_GROUP
    group = None
    if dist.get_backend() != "gloo":
        if _HOST_GROUP is None:  # created on every rank at the same first call, as new_group requires
            _HOST_GROUP = dist.new_group(backend="gloo")
        group = _HOST_GROUP
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t.tolist()


def agree(seconds: float, *flags: bool) -> tuple[float, tuple[bool, ...]]:
    """The slowest rank's training clock, and each flag set if any rank set it."""
    if world()[1] == 1:
        return seconds, tuple(bool(f) for f in flags)
    out = _reduce([seconds, *(1.0 if f else 0.0 for f in flags)], "max")
    return out[0], tuple(v > 0 for v in out[1:])


def any_rank(flag: bool) -> bool:
    if world()[1] == 1:
        return bool(flag)
    return _reduce([1.0 if flag else 0.0], "max")[0] > 0


def agree_eval(loss: float, prune: bool) -> tuple[float, bool]:
    """Rank 0's validation loss and pruning decision, on every rank."""
    rank, size = world()
    if size == 1:
        return loss, bool(prune)
    out = _reduce([loss if rank == 0 else 0.0, 1.0 if prune and rank == 0 else 0.0], "sum")
    return out[0], out[1] > 0


def sum_rows(values: list[float]) -> list[float]:
    """The element-wise sum of ``values`` over the ranks (each rank fills the rows it computed, zeros elsewhere)."""
    if world()[1] == 1:
        return list(values)
    return _reduce(values, "sum")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split_cores(n: int) -> list[tuple[int, ...] | None]:
    """Each rank's share of this process's cores (a study worker's own, or all of them)."""
    env = os.environ.get("MHAR_ABLATE_CORES")
    cores = [int(c) for c in env.split(",")] if env else sorted(os.sched_getaffinity(0))
    per = len(cores) // n
    if per == 0:
        return [None] * n
    return [tuple(cores[r * per:(r + 1) * per]) for r in range(n)]


def _pin(cores: tuple[int, ...] | None) -> None:
    if cores:
        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def _rank_main(rank: int, env: dict[str, str], cores, fn: Callable, args: tuple, kwargs: dict, results) -> None:
    """Ranks 1..N-1: the stop decision comes from rank 0, so signals are ignored here; the rank dies
    with its parent (rank 0) so that nothing hangs in a collective after a kill."""
    from ..processes import NotATerminal, die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    os.environ.update(env)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank)})
    _pin(cores)
    sys.stderr = NotATerminal(sys.stderr)
    result = fn(*args, **kwargs)
    results.put((rank, result["step"], result.get("weights_sum")))


def launch(n: int, fn: Callable[..., dict[str, Any]], args: tuple, rank0_kwargs: dict, helper_kwargs: dict) -> dict[str, Any]:
    """Run ``fn(*args)`` on ``n`` ranks; this process is rank 0 and returns its result, with each rank's
    final step (``rank_steps``) added. The environment and core affinity are restored afterwards."""
    import multiprocessing as mp

    import torch.distributed as dist

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n), "NODE_RANK": "0"}
    cores = _split_cores(n)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, env, cores[r], fn, args, helper_kwargs, results),
                         name=f"mhar-rank-{r}") for r in range(1, n)]
    for p in procs:
        p.start()
    saved = {k: os.environ.get(k) for k in (*ENV_KEYS, "MHAR_ABLATE_CORES")}
    affinity = os.sched_getaffinity(0)
    import torch

    threads = torch.get_num_threads()
    os.environ.update(env)
    os.environ.update({"LOCAL_RANK": "0", "RANK": "0"})
    _pin(cores[0])
    global _HOST_GROUP
    try:
        result = fn(*args, **rank0_kwargs)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        _HOST_GROUP = None
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    steps, sums = {0: result["step"]}, {0: result.pop("weights_sum", None)}
    while not results.empty():
        rank, steps[rank], sums[rank] = results.get()
    result["rank_steps"] = [steps.get(r) for r in range(n)]  # the same step on every rank, by construction
    result["rank_weight_sums"] = [sums.get(r) for r in range(n)]  # the same weights, as DDP keeps them
    failed = [r for r, p in enumerate(procs, start=1) if p.exitcode]
    if failed:
        raise RuntimeError(f"DDP rank(s) {failed} exited with codes {[procs[r - 1].exitcode for r in failed]}")
    return result
