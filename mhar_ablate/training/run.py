"""One training run, start to finish: a run folder (config, TensorBoard events, checkpoint, result),
the data, the Lightning Trainer, resume from the folder's own checkpoint, and a result that studies read.

A run folder holds ``config.yaml`` (the resolved configuration), the logger's files (TensorBoard's events
in the folder itself, so that TensorBoard names the run by its folder; ``metrics.csv`` for the csv logger;
``wandb/``; loggers.py), ``checkpoints/
last.ckpt`` (written atomically at every evaluation, every ``train.checkpoint_every`` seconds between
them, on a stop and at the end), ``result.json`` (status, the (step, seconds, tokens, loss) curve,
the final evaluation on the large held-out set with its standard error, throughput, memory, parameters,
the warm-up step kept off the clock and the early steps against the median one (``step_timing``),
the library versions) and ``routing.png`` (the final depth weights of a
routed model).

Continuing a folder (``resume``) never loses or rewrites a result: a finished run's ``result.json`` is
returned as it is, a checkpoint written at the end of the budget is turned into the result without
training, and anything else continues from the checkpoint (or from the start where there is none).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import threading
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import yaml
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..config import RunConfig, from_dict, unused_vocabulary
from ..console import log_line
from ..errors import UsageError
from ..io import human_bytes, remove_stale_temporaries, require_free_space, write_json, write_text
from ..model import routing_overhead
from ..provenance import describe_differences, differences, environment
from . import distributed
from ..model.flops import training_flops_per_token
from .budget import Budget, flops_budget_steps, format_seconds
from .callbacks import BudgetCallback, ProgressBar
from .loggers import log_final, make_logger, start_hparams
from .checkpoint import CHECKPOINT, RECORD, check_fits, checkpoint_bytes, identity, identity_differences, record_of, resume_point
from ..model.weights import read_checkpoint
from .module import LMModule
from .stop import StopNow, StopRequest

FINISHED = ("completed", "diverged", "pruned")  # a result that is never trained again


def quiet_lightning() -> None:
    """Lightning's banner lines and advice about worker counts drown the progress display."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in (".*does not have many workers.*", ".*val_dataloader.*", ".*validation_step.*",
                    ".*LeafSpec.*", ".*is an invalid version.*", ".*tensorboardX.*", ".*resuming from a checkpoint.*",
                    ".*Starting from v1.9.0.*", ".*number of training batches.*", ".*returned `None`.*",
                    ".*overridden `transfer_batch_to_device`.*"):
        warnings.filterwarnings("ignore", message=pattern)


def arm_label(cfg: RunConfig) -> str:
    """What an arm is, in a few characters: baseline, attnres, mhar-h8, mhar-h8-block:4, hc-n4, ...
    (each kind's ``label`` in the registry, variants/)."""
    from ..config import kind_class

    return kind_class(cfg.residual.kind).label(cfg.residual)


def new_run_dir(output: Path, cfg: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = output / "runs" / f"{stamp}-{arm_label(cfg).replace(':', '')}-s{cfg.seed}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    return run_dir


def find_run(output: Path, name: str) -> Path:
    for cand in (Path(name), output / "runs" / name, output / name):
        if (cand / "config.yaml").is_file():
            return cand
    raise UsageError(f"no run {name!r} under {output / 'runs'} (a run folder holds config.yaml)")


def load_run_config(run_dir: Path) -> RunConfig:
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {run_dir / 'config.yaml'}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{run_dir / 'config.yaml'} is not a run configuration")
    return from_dict(data)


def check_run_folder(run_dir: Path, cfg: RunConfig, ignore: tuple[str, ...] = ()) -> None:
    """A folder that already holds a run must hold this run (its ``config.yaml``), or continuing it
    would mix two runs; settings in ``ignore`` are not compared."""
    if not (run_dir / "config.yaml").is_file():
        return
    try:
        saved = identity(load_run_config(run_dir))
    except UsageError as e:
        raise UsageError(f"run folder {run_dir} holds an unreadable run ({e}); delete it to train this run afresh") from None
    diffs = identity_differences(saved, cfg, ignore)
    if diffs:
        raise UsageError(f"run folder {run_dir} holds another run ({', '.join(diffs[:4])}{' ...' if len(diffs) > 4 else ''}); "
                         "delete it, or use another --output folder")


def finished_result(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``result.json`` if it records a finished run (completed, diverged or pruned)."""
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("status") not in FINISHED:
        return None
    # Strict JSON holds a non-finite loss as its string ("nan", "inf"): back to the float it was.
    final = result.get("final_eval") if isinstance(result.get("final_eval"), dict) else {}
    for point in [result, final, *(p for p in result.get("curve") or [] if isinstance(p, dict))]:
        for key in ("final_val_loss", "val_loss", "seconds", "loss", "se"):
            if isinstance(point.get(key), str):
                try:
                    point[key] = float(point[key])
                except ValueError:
                    return None
    return result


def check_versions(record: dict[str, Any], path: Path) -> None:
    """A checkpoint continues only under the library versions it was written with."""
    diffs = differences(record.get("environment"), environment())
    if diffs:
        old, new = describe_differences(diffs)
        raise UsageError(f"checkpoint {path} was written under {old}; this environment has {new}: "
                         "rerun with --allow-version-change to continue it under these versions")


def resolve_flops_budget(cfg: RunConfig, vocab: int) -> None:
    """Under the flops budget, set ``train.steps`` to the steps ``train.flops`` buys this run (the count
    of ``model/flops.py`` at its tokens per step): the run's config.yaml then records them."""
    if cfg.train.budget == "flops":
        per_step = training_flops_per_token(cfg, vocab) * cfg.train.batch_size * cfg.model.seq_len
        cfg.train.steps = flops_budget_steps(cfg.train.flops, per_step)


def autocast_for(cfg: RunConfig) -> torch.dtype | None:
    """The autocast dtype of the run's steps (weights stay fp32): bf16 on CUDA unless asked otherwise."""
    p = cfg.train.precision
    if p == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else None
    return torch.bfloat16 if p == "bf16" else None


def use_compile_cache(cache_dir: Path) -> None:
    """Inductor's on-disk cache under the output's cache folder (unless the user named one), so that the
    seeds of an arm, other worker processes and later reruns reuse what the first run compiled."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir).resolve() / "inductor"))


class CheckpointRecord(L.Callback):
    """Writes the run's record into every checkpoint (see ``checkpoint.py``), and stops the run with
    one clear error when its folder disappears while it trains."""

    def __init__(self, cfg: RunConfig, budget_cb: BudgetCallback, run_dir: Path, watch_folder: bool = True):
        self.cfg, self.budget_cb, self.run_dir, self.watch_folder = cfg, budget_cb, run_dir, watch_folder
        self.saved_step: int | None = None  # the step of the last checkpoint this process wrote

    def setup(self, trainer: L.Trainer, module: LMModule, stage: str) -> None:
        # Through the module's hook, which Lightning calls for weights-only checkpoints too (a callback's
        # is skipped there): the completed run's last checkpoint is weights-only and must carry the record.
        module.checkpoint_record = lambda checkpoint: self._record(trainer, module, checkpoint)

    def _record(self, trainer: L.Trainer, module: LMModule, checkpoint: dict[str, Any]) -> None:
        weights = module.model.residual.last_weights()
        cb = self.budget_cb
        checkpoint[RECORD] = {
            "identity": identity(self.cfg), "arm": arm_label(self.cfg), "seed": self.cfg.seed,
            "status": cb.status, "reason": cb.reason, "seconds": module.clock.elapsed, "curve": list(cb.curve),
            "peak_mem_gb": cb.peak_mem_gb, "final_eval": cb.final_eval,
            "routing_weights": None if weights is None else [w.detach().float().cpu() for w in weights],
            "run_mode": _run_mode(module, cb), "environment": environment(), "saved_at": time.time(),
        }
        self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.watch_folder and not self.run_dir.is_dir():
            raise UsageError(_deleted(self.run_dir))


class DirectCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint straight into its file. Lightning's own serialises the whole state into memory
    and then writes that copy (its atomic save); BudgetCallback writes to a temporary name and renames it
    itself, so the copy cost only time (at ``paper350m`` most of a checkpoint's 17 s) and host memory."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("DirectCheckpointIO.save_checkpoint takes no storage_options")
        torch.save(checkpoint, path)


def _deleted(run_dir: Path) -> str:
    return f"run folder {run_dir} was deleted while it trained; rerun to train this run again from the start"


@contextlib.contextmanager
def _quiet_writer_threads(run_dir: Path):
    """TensorBoard writes from a thread of its own: if the run folder is deleted, that thread's
    traceback would be printed before the run stops with its one line; it is left out."""
    original = threading.excepthook

    def hook(args):
        if isinstance(args.exc_value, OSError) and not run_dir.is_dir():
            return
        original(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = original


def train_run(cfg: RunConfig, run_dir: Path, cache_dir: Path, *, resume: bool = False,
              on_eval: Callable[[int, float, float], bool] | None = None, log: Callable[[str], None] = log_line,
              title: str = "", stop: StopRequest | None = None, position: int = 0,
              log_evals: bool = True, allow_version_change: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (continuing what the folder holds if ``resume``); return the result dict.
    With ``train.devices`` > 1 this process becomes rank 0 of a DDP run and starts the other ranks."""
    stop = stop if stop is not None else StopRequest()
    if cfg.train.devices > 1 and not distributed.inside_rank():
        # A run that is already finished is answered here: no rank may return early while others train.
        done = _prepare(cfg, run_dir, cache_dir, resume, log, title, stop, allow_version_change, lead=True,
                        finished_only=True) if resume else None
        if isinstance(done, dict):
            return done
        result = distributed.launch(
            cfg.train.devices, train_run, (cfg, run_dir, cache_dir),
            dict(resume=resume, on_eval=on_eval, log=log, title=title, stop=stop, position=position, log_evals=log_evals,
                 allow_version_change=allow_version_change),
            dict(resume=resume, log=_quiet, log_evals=False, allow_version_change=allow_version_change))
        write_json(run_dir / "result.json", result)  # now with every rank's last step
        return result
    rank = distributed.env_rank() if cfg.train.devices > 1 else 0
    lead = rank == 0  # only rank 0 writes the run folder, logs and reports to Optuna

    prepared = _prepare(cfg, run_dir, cache_dir, resume, log, title, stop, allow_version_change, lead=lead, rank=rank)
    if isinstance(prepared, dict):
        return prepared
    dm, vocab, state, info = prepared
    ckpt = run_dir / CHECKPOINT
    budget, tokens_per_step = info["budget"], info["tokens_per_step"]
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.train.compile:
        use_compile_cache(cache_dir)
        # A study compiles one model after another in this process: without a reset, Dynamo's in-memory
        # cache would grow past its limit and fall back to eager; the on-disk cache keeps the reuse.
        torch._dynamo.reset()
    module = LMModule(cfg, vocab, autocast=autocast_for(cfg))
    dm.start_step = cfg.train.first_batch
    if state is not None:
        dm.start_step += resume_point(state)[0]  # the data continue where the run stopped
        del state  # Lightning reads the file itself; a GPU-sized state should not be held twice
    elif cfg.train.init:
        from ..model.weights import load_initial, read_state_dict

        load_initial(module.model, read_state_dict(cfg.train.init), f"train.init={cfg.train.init}")
    budget_cb = BudgetCallback(budget, cfg.train.eval_every, cfg.train.heatmap_every, dm.val_dataloader, ckpt,
                               tokens_per_step, info["flops_per_token"], on_eval=on_eval if lead else None,
                               stop=stop if lead else None, log=log if log_evals and lead else None, title=title,
                               checkpoint_every=cfg.train.checkpoint_every, log_every=cfg.train.log_every,
                               final_batches=dm.final_dataloader, seq_len=cfg.model.seq_len)
    ddp = cfg.train.devices > 1
    # Under DDP a rank that raised alone would leave the others waiting: the folder is only watched on one process.
    record_cb = CheckpointRecord(cfg, budget_cb, run_dir, watch_folder=not ddp)
    bar = ProgressBar(budget, budget_cb, desc=title.strip(" :") or "train", position=position)
    logger = make_logger(cfg, run_dir) if lead else False
    if lead:
        start_hparams(logger, cfg, arm_label(cfg))
    trainer = L.Trainer(
        # Precision and clipping are the step's own (autocast inside TrainStep, clipping before its update).
        # devices > 1: Lightning's DDP over the ranks that distributed.launch started (use_distributed_sampler
        # off: each rank slices the global batch itself).
        accelerator="auto", devices=cfg.train.devices, strategy="ddp" if ddp else "auto", use_distributed_sampler=False,
        precision="32-true", logger=logger, plugins=[DirectCheckpointIO()],
        callbacks=[record_cb, budget_cb, bar] if lead else [budget_cb],
        max_steps=budget.steps if budget.counts_steps else -1, max_epochs=-1,
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1_000_000,
    )
    ckpt_path = ckpt if ckpt.is_file() and resume else None
    try:
        with _quiet_writer_threads(run_dir):
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        # Lightning's own SIGTERM handler exits the process after the step (with status 0). Our handler saw
        # the same signal, so the budget callback has already checkpointed and marked the run interrupted.
        pass
    except StopNow:
        where = (f"the checkpoint at step {record_cb.saved_step}" if record_cb.saved_step is not None else
                 "its last checkpoint" if ckpt.is_file() else "the start (no checkpoint yet)")
        budget_cb.status, budget_cb.reason = "interrupted", f"stopped at once by a second SIGINT; resumes from {where}"
    except Exception:
        if not run_dir.is_dir():
            raise UsageError(_deleted(run_dir)) from None
        raise
    if not run_dir.is_dir():
        raise UsageError(_deleted(run_dir))
    if budget_cb.status == "running":  # fit returned without our callback deciding: treat as interrupted
        budget_cb.status, budget_cb.reason = "interrupted", "training stopped early"

    weights = module.model.residual.last_weights()
    result = _result(budget_cb.status, budget_cb.reason, trainer.global_step, module.clock.elapsed, budget_cb.curve,
                     budget_cb.peak_mem_gb, weights if lead else None, _run_mode(module, budget_cb),
                     final_eval=budget_cb.final_eval, **info)
    if cfg.train.devices > 1:  # DDP keeps the replicas equal: the launcher compares these across ranks
        result["weights_sum"] = float(sum(p.detach().double().sum() for p in module.parameters()))
    if not lead:
        _release(module, trainer)
        return result
    if weights is not None:
        _save_heatmap(run_dir, weights, arm_label(cfg))
    if budget_cb.status == "completed":
        log_final(logger, cfg, arm_label(cfg), result)
    logger.finalize("success")
    with stop.deferred():  # a second Ctrl-C waits until the result is whole
        write_json(run_dir / "result.json", result)
    _release(module, trainer)
    return result


def _prepare(cfg: RunConfig, run_dir: Path, cache_dir: Path, resume: bool, log, title: str, stop: StopRequest,
             allow_version_change: bool, *, lead: bool, rank: int = 0, finished_only: bool = False):
    """The data, and what the run folder holds: a finished run's result (returned as it is), a final
    checkpoint turned into the result, or (data module, vocabulary, checkpoint state, run facts) to train
    with. ``finished_only``: stop after the finished cases (None when there is something to train)."""
    from ..data import TokenDataModule

    quiet_lightning()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    # Data first: a bad data path fails before a run folder exists.
    dm = TokenDataModule(cfg.data, cfg.model.seq_len, cfg.train.batch_size, cfg.seed, cache_dir,
                         eval_batches=cfg.train.eval_batches, final_sequences=cfg.final_sequences())
    dm.rank, dm.world = rank, cfg.train.devices
    dm.prepare_data()
    dm.setup("fit")
    vocab = cfg.model.vocab_size or dm.vocab_size
    if vocab < dm.vocab_size:
        raise UsageError(f"model.vocab_size={vocab} is smaller than the tokenizer's {dm.vocab_size} tokens")
    if lead and (unused := unused_vocabulary(vocab, dm.vocab_size)):
        print(f"warning: {unused}", file=sys.stderr, flush=True)
    params, base_params, overhead = routing_overhead(cfg.model, cfg.residual, vocab)
    resolve_flops_budget(cfg, vocab)  # before the folder's run is compared with this one, or config.yaml written
    ckpt = run_dir / CHECKPOINT
    if cfg.train.init and not (resume and ckpt.is_file()) and not Path(cfg.train.init).is_file():
        raise UsageError(f"train.init: no such file: {cfg.train.init}")
    state: dict[str, Any] | None = None
    if lead:
        # What writes killed before their rename left here, once no live process can be writing it (the
        # rule: io.remove_stale_temporaries; a study's driver removes its runs' own at once, under its lock).
        remove_stale_temporaries(run_dir)
    if resume:
        if lead:
            check_run_folder(run_dir, cfg)
            previous = finished_result(run_dir)
            if previous is not None:  # finished before a kill or a rerun: the result stands as written
                log(f"{title}{run_dir} already holds a {previous['status']} run (step {previous.get('step')}); "
                    "nothing to train")
                return previous
        if ckpt.is_file():
            state = read_checkpoint(ckpt)
            if lead:
                check_fits(state, cfg, vocab, ckpt)
                if not allow_version_change:
                    check_versions(record_of(state), ckpt)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    per_token = training_flops_per_token(cfg, vocab)
    budget = Budget(cfg.train.budget, cfg.train.steps, cfg.train.time, cfg.train.flops, per_token * tokens_per_step)
    info = dict(cfg=cfg, budget=budget, tokens_per_step=tokens_per_step, params=params, flops_per_token=per_token,
                base_params=base_params, overhead=overhead, dm=dm, started=time.time())
    record = record_of(state) if state is not None else {}
    if lead and record.get("status") == "completed" and not distributed.inside_rank():
        step, seconds = resume_point(state)  # killed after its last checkpoint: the run is done
        log(f"{title}the checkpoint at step {step} is this run's end ({format_seconds(seconds)} trained); "
            "nothing left to train")
        return _finish_from_record(run_dir, record, step, seconds, stop, **info)
    if finished_only:
        return None
    if lead:
        size = checkpoint_bytes(params)
        require_free_space(run_dir, 2 * size - (ckpt.stat().st_size if state is not None else 0),
                           f"this run's checkpoints ({human_bytes(size)} each, two while one replaces the other)")
        earlier = (run_dir / "config.yaml").is_file()  # an earlier attempt at this run
        run_dir.mkdir(parents=True, exist_ok=True)
        if not earlier:
            write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if state is not None:
            step, seconds = resume_point(state)
            log(f"{title}resuming from the checkpoint at step {step} ({format_seconds(seconds)} trained); "
                "training after it is redone")
        elif resume and earlier:
            log(f"{title}no checkpoint in {run_dir} yet: training this run from the start")
    return dm, vocab, state, info


def _run_mode(module: LMModule, budget_cb: BudgetCallback) -> dict[str, Any]:
    """Which step mode ran, and the seconds spent outside the clock."""
    timing = module.clock.timing()
    return {"cuda_graph": bool(module.step and module.step.captured),
            "step_note": module.step.note if module.step else None,
            "prepare_seconds": module.prepare_seconds,  # compile, warm-up and capture
            "eval_seconds": budget_cb.eval_seconds, "checkpoint_seconds": budget_cb.save_seconds,
            # the first step of each process, trained but off the clock (budget.TrainingClock)
            "warmup_seconds": timing["warmup_seconds"], "warmup_steps": timing["warmup_steps"],
            "step_timing": {k: timing[k] for k in ("early_steps", "early_step_seconds", "median_step_seconds", "early_ratio")}}


def _result(status: str, reason: str, step: int, seconds: float, curve: list[dict[str, float]],
            peak_mem_gb: float | None, weights, run_mode: dict[str, Any], *, cfg: RunConfig, budget: Budget,
            tokens_per_step: int, params: int, flops_per_token: float, base_params: int, overhead: float, dm,
            started: float, final_eval: dict[str, Any] | None = None) -> dict[str, Any]:
    result = {
        "status": status,
        "reason": reason,
        "arm": arm_label(cfg),
        "seed": cfg.seed,
        "budget": budget.kind,
        "step": step,
        "seconds": seconds,
        "tokens": step * tokens_per_step,
        # Training FLOPs by model/flops.py's count: the flops budget's measure, and the export's FLOPs axis.
        "flops_per_token": flops_per_token,
        "flops": step * tokens_per_step * flops_per_token,
        "final_val_loss": curve[-1]["val_loss"] if curve else math.nan,
        "curve": curve,
        # Over the timed steps: the warm-up steps trained off the clock.
        "tokens_per_s": (max(step - int(run_mode.get("warmup_steps") or 0), 0) * tokens_per_step / seconds) if seconds else None,
        "peak_mem_gb": peak_mem_gb,
        # What the process holds from the allocator at the end (nvidia-smi shows this and the CUDA context):
        # above the peak when cached blocks or a graph's private pool are kept.
        "reserved_gb": torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else None,
        "params": params,
        "baseline_params": base_params,
        "param_overhead_pct": overhead,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "devices": cfg.train.devices,
        "routing_backend": _backend_name(cfg),
        "compiled": cfg.train.compile,
        **run_mode,  # cuda_graph, step_note, and the seconds of preparation, evaluations and checkpoints
        "wall_seconds": time.time() - started,
        # When the result was made (UTC): a file's mtime does not survive archives copied between machines.
        "finished_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "data": dm.describe(),
        "corpus": dm.corpus.info.provenance(),  # which corpus, release and tokenizer (hashes included)
        "environment": environment(),
    }
    # The final evaluation (final_eval.py): loss, standard error, sequences and tokens, seconds (outside the
    # clock), how many sequences were asked for (the held-out part may hold fewer), per-sequence losses.
    # None where the run did not complete (or was recorded before the final evaluation existed).
    result["final_eval"] = None if final_eval is None else {**final_eval, "asked": cfg.final_sequences()}
    if weights is not None:
        result["routing_weights"] = [w.tolist() for w in weights]
    return result


def _finish_from_record(run_dir: Path, record: dict[str, Any], step: int, seconds: float, stop: StopRequest,
                        **info) -> dict[str, Any]:
    """The result of a run whose final checkpoint was written but whose result was not (a kill in
    between): everything the result needs is in the checkpoint's record."""
    cfg = info["cfg"]
    weights = record.get("routing_weights")
    result = _result("completed", "", step, float(record.get("seconds", seconds)), list(record.get("curve") or []),
                     record.get("peak_mem_gb"), weights, dict(record.get("run_mode") or {}),
                     final_eval=record.get("final_eval"), **info)
    if weights is not None:
        _save_heatmap(run_dir, weights, arm_label(cfg))
    logger = make_logger(cfg, run_dir)
    log_final(logger, cfg, arm_label(cfg), result)
    logger.finalize("success")
    with stop.deferred():
        write_json(run_dir / "result.json", result)
    return result


def _release(module: LMModule, trainer: L.Trainer) -> None:
    """Free the run's GPU memory (a captured step holds its graph's memory pool) before a study's next run."""
    import gc

    module.step = None
    trainer.strategy.teardown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _quiet(msg: str) -> None:
    """The log of DDP ranks other than 0: rank 0 speaks for the run."""


def _backend_name(cfg: RunConfig) -> str:
    """What computes the routing (results' ``routing_backend``): none, pytorch, reference or triton."""
    from ..config import kind_class

    return kind_class(cfg.residual.kind).backend_name(cfg.residual, torch.cuda.is_available())


def _save_heatmap(run_dir: Path, weights, label: str) -> None:
    from ..io import write_bytes
    from .heatmap import routing_png

    write_bytes(run_dir / "routing.png", routing_png(weights, label))
