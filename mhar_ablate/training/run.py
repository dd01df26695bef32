"""One training run, start to finish: a run folder (config, TensorBoard events, checkpoint, result),
the data, the Lightning Trainer, resume from the folder's own checkpoint, and a result that studies read.

A run folder holds ``config.yaml`` (the resolved configuration), ``tb/`` (TensorBoard), ``checkpoints/
last.ckpt`` (written atomically), ``result.json`` (status, the (step, seconds, tokens, loss) curve,
throughput, memory, parameters) and ``routing.png`` (the final depth weights of a routed model).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..config import RunConfig, from_dict
from ..errors import UsageError
from ..io import write_json, write_text
from ..model import routing_overhead
from . import distributed
from .budget import Budget
from .callbacks import BudgetCallback, ProgressBar
from .stop import StopRequest
from .module import LMModule

CHECKPOINT = Path("checkpoints") / "last.ckpt"


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
    (each kind's ``label`` in the registry, model/residual)."""
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
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"cannot read {run_dir / 'config.yaml'}: {e}") from None
    return from_dict(data)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint without unpickling arbitrary objects (``weights_only``): a tampered file is
    refused, never executed. An unreadable one is a clear error, not a traceback."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"checkpoint {path} cannot be loaded safely ({first[:160]}); "
                         "delete it to restart this run from the beginning") from None


def flops_per_token(cfg: RunConfig, params: int) -> float:
    """Training FLOPs per token as nanoGPT and PaLM count them: 6 per parameter, plus attention's scores
    and weighted sum, 12 * layers * heads * head_dim * sequence length."""
    head_dim = cfg.model.head_dim or cfg.model.d_model // cfg.model.n_heads
    attn = 12 * cfg.model.n_layers * cfg.model.n_heads * head_dim * cfg.model.seq_len
    return 6.0 * params + attn


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


def train_run(cfg: RunConfig, run_dir: Path, cache_dir: Path, *, resume: bool = False,
              on_eval: Callable[[int, float, float], bool] | None = None, log: Callable[[str], None] = print,
              title: str = "", stop: StopRequest | None = None, position: int = 0,
              log_evals: bool = True) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` (continuing its checkpoint if ``resume``); return the result dict.
    With ``train.devices`` > 1 this process becomes rank 0 of a DDP run and starts the other ranks."""
    from ..data import TokenDataModule

    if cfg.train.devices > 1 and not distributed.inside_rank():
        result = distributed.launch(
            cfg.train.devices, train_run, (cfg, run_dir, cache_dir),
            dict(resume=resume, on_eval=on_eval, log=log, title=title, stop=stop, position=position, log_evals=log_evals),
            dict(resume=resume, log=_quiet, log_evals=False))
        write_json(run_dir / "result.json", result)  # now with every rank's last step
        return result
    rank = distributed.env_rank() if cfg.train.devices > 1 else 0
    lead = rank == 0  # only rank 0 writes the run folder, logs and reports to Optuna

    quiet_lightning()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    # Data first: a bad data path fails before a run folder exists.
    dm = TokenDataModule(cfg.data, cfg.model.seq_len, cfg.train.batch_size, cfg.seed, cache_dir,
                         eval_batches=cfg.train.eval_batches)
    dm.rank, dm.world = rank, cfg.train.devices
    dm.prepare_data()
    dm.setup("fit")
    vocab = cfg.model.vocab_size or dm.vocab_size
    if vocab < dm.vocab_size:
        raise UsageError(f"model.vocab_size={vocab} is smaller than the tokenizer's {dm.vocab_size} tokens")
    ckpt = run_dir / CHECKPOINT
    if cfg.train.init and not (resume and ckpt.is_file()) and not Path(cfg.train.init).is_file():
        raise UsageError(f"train.init: no such file: {cfg.train.init}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = ckpt if resume and ckpt.is_file() else None
    if lead and (not resume or not (run_dir / "config.yaml").is_file()):
        write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.train.compile:
        use_compile_cache(cache_dir)
        # A study compiles one model after another in this process: without a reset, Dynamo's in-memory
        # cache would grow past its limit and fall back to eager; the on-disk cache keeps the reuse.
        torch._dynamo.reset()
    module = LMModule(cfg, vocab, autocast=autocast_for(cfg))
    params, base_params, overhead = routing_overhead(cfg.model, cfg.residual, vocab)
    dm.start_step = cfg.train.first_batch
    if ckpt_path is not None:
        # The data continue where the run stopped.
        dm.start_step += int(read_checkpoint(ckpt_path)["global_step"])
    elif cfg.train.init:
        from ..model.weights import load_initial, read_state_dict


        load_initial(module.model, read_state_dict(cfg.train.init), f"train.init={cfg.train.init}")

    budget = Budget(cfg.train.budget, cfg.train.steps, cfg.train.time)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    budget_cb = BudgetCallback(budget, cfg.train.eval_every, cfg.train.heatmap_every, dm.val_dataloader, ckpt,
                               tokens_per_step, flops_per_token(cfg, params), on_eval=on_eval if lead else None,
                               stop=stop if lead else None, log=log if log_evals and lead else None, title=title,
                               checkpoint_every=cfg.train.checkpoint_every, log_every=cfg.train.log_every)
    bar = ProgressBar(budget, budget_cb, desc=title.strip(" :") or "train", position=position)
    logger = TensorBoardLogger(str(run_dir), name="tb", version="", default_hp_metric=False) if lead else False
    ddp = cfg.train.devices > 1
    trainer = L.Trainer(
        # Precision and clipping are the step's own (autocast inside TrainStep, clipping before its update).
        # devices > 1: Lightning's DDP over the ranks that distributed.launch started (use_distributed_sampler
        # off: each rank slices the global batch itself).
        accelerator="auto", devices=cfg.train.devices, strategy="ddp" if ddp else "auto", use_distributed_sampler=False,
        precision="32-true", logger=logger, callbacks=[budget_cb, bar] if lead else [budget_cb],
        max_steps=cfg.train.steps if budget.kind == "steps" else -1, max_epochs=-1,
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1_000_000,
    )
    started = time.time()
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        # Lightning's own SIGTERM handler exits the process after the step (with status 0). Our handler saw
        # the same signal, so the budget callback has already checkpointed and marked the run interrupted.
        pass
    if budget_cb.status == "running":  # fit returned without our callback deciding: treat as interrupted
        budget_cb.status, budget_cb.reason = "interrupted", "training stopped early"

    result = {
        "status": budget_cb.status,
        "reason": budget_cb.reason,
        "arm": arm_label(cfg),
        "seed": cfg.seed,
        "budget": budget.kind,
        "step": trainer.global_step,
        "seconds": module.clock.elapsed,
        "tokens": trainer.global_step * tokens_per_step,
        "final_val_loss": budget_cb.curve[-1]["val_loss"] if budget_cb.curve else math.nan,
        "curve": budget_cb.curve,
        "tokens_per_s": (trainer.global_step * tokens_per_step / module.clock.elapsed) if module.clock.elapsed else None,
        "peak_mem_gb": budget_cb.peak_mem_gb,
        "params": params,
        "baseline_params": base_params,
        "param_overhead_pct": overhead,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "devices": cfg.train.devices,
        "routing_backend": _backend_name(cfg),
        "compiled": cfg.train.compile,
        "cuda_graph": bool(module.step and module.step.captured),  # which mode ran
        "step_note": module.step.note if module.step else None,
        "prepare_seconds": module.prepare_seconds,  # compile, warm-up and capture: outside the clock
        "eval_seconds": budget_cb.eval_seconds,
        "checkpoint_seconds": budget_cb.save_seconds,
        "wall_seconds": time.time() - started,
        "data": dm.describe(),
    }
    if cfg.train.devices > 1:  # DDP keeps the replicas equal: the launcher compares these across ranks
        result["weights_sum"] = float(sum(p.detach().double().sum() for p in module.parameters()))
    if not lead:
        _release(module, trainer)
        return result
    weights = module.model.residual.last_weights()
    if weights is not None:
        result["routing_weights"] = [w.tolist() for w in weights]
        _save_heatmap(run_dir, weights, arm_label(cfg))
    if budget_cb.status == "completed":
        logger.log_hyperparams(_hparams(cfg), {"hparams/final_val_loss": result["final_val_loss"],
                                               "hparams/tokens_per_s": result["tokens_per_s"] or 0.0})
    logger.finalize("success")
    write_json(run_dir / "result.json", result)
    _release(module, trainer)
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


def _hparams(cfg: RunConfig) -> dict[str, Any]:
    flat = cfg.flat()
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in flat.items()}


def _save_heatmap(run_dir: Path, weights, label: str) -> None:
    import io

    import matplotlib.pyplot as plt

    from ..io import write_bytes
    from ..reporting.heatmap import routing_figure

    fig = routing_figure(weights, f"{label}: final depth weights")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(run_dir / "routing.png", buf.getvalue())
