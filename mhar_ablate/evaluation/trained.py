"""A trained run as a model to evaluate: the decoder with the weights of the run's checkpoint, in
evaluation mode on the chosen device, its tokenizer, and what identifies it (arm, seed, step).

A run's weights are its ``checkpoints/last.ckpt`` (read with ``weights_only``), which ``train`` keeps, or,
for a finished study trial whose checkpoint the study removed, the ``weights.safetensors`` it kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..data.tokenizer import Tokenizer
from ..errors import UsageError


@dataclass
class TrainedRun:
    run_dir: Path
    cfg: RunConfig
    model: torch.nn.Module  # a Decoder, in eval mode
    tokenizer: Tokenizer
    step: int  # the optimiser step of the weights
    status: str  # the run's result status, or the checkpoint's ("running" for a run still training)

    def describe(self) -> dict[str, Any]:
        from ..training.run import arm_label

        return {"run": str(self.run_dir), "arm": arm_label(self.cfg), "seed": self.cfg.seed, "step": self.step,
                "status": self.status, "seq_len": self.cfg.model.seq_len, "tokenizer": self.tokenizer.spec()}


def run_tokenizer(cfg: RunConfig, cache_dir: Path) -> Tokenizer:
    """The tokenizer the run trained with: bytes, a tokenizers file, or the cached BPE of its corpus
    (trained again, identically, where the cache was removed)."""
    from ..data.cache import cache_root, ensure_dir
    from ..data.sources import resolve_source
    from ..data.tokenizer import ByteTokenizer, load_tokenizer

    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    root = ensure_dir(cache_root(cache_dir))
    source = resolve_source(cfg.data, root) if cfg.data.tokenizer == "bpe" else None
    return load_tokenizer(cfg.data.tokenizer, cfg.data.vocab_size, source, root)


def require_weights(run_dir: Path) -> Path:
    """The run's checkpoint, else its kept final weights, or one line saying why there are none."""
    from ..training.checkpoint import CHECKPOINT, FINAL_WEIGHTS

    for path in (run_dir / CHECKPOINT, run_dir / FINAL_WEIGHTS):
        if path.is_file():
            return path
    raise UsageError(f"run {run_dir} has no weights to evaluate (neither {CHECKPOINT} nor {FINAL_WEIGHTS}; a study "
                     "run before this version removed finished trials' checkpoints unless run with --keep-checkpoints)")


def load_trained(run_dir: Path, cache_dir: Path, device: str | torch.device = "cpu") -> TrainedRun:
    """The run in ``run_dir`` with its checkpoint's weights; one clear error where it has none.
    ``cache_dir``: the output folder's cache, where a BPE run's tokenizer is kept."""
    from ..model import Decoder
    from ..model.weights import read_state_dict
    from ..training.checkpoint import FINAL_WEIGHTS, record_of
    from ..model.weights import read_checkpoint
    from ..training.run import finished_result, load_run_config

    cfg = load_run_config(run_dir)
    ckpt = require_weights(run_dir)
    result = finished_result(run_dir)
    weights = read_state_dict(ckpt)  # a checkpoint is mapped: its optimiser's moments are never read
    if ckpt.name == FINAL_WEIGHTS.name:  # kept only for a run whose result is recorded
        state, step = None, int((result or {}).get("step", -1))
    else:
        state = read_checkpoint(ckpt, mmap=True)
        step = int(state["global_step"])
    if "embed.weight" not in weights:
        raise UsageError(f"checkpoint {ckpt} holds no decoder weights")
    tokenizer = run_tokenizer(cfg, cache_dir)
    vocab = int(weights["embed.weight"].shape[0])
    if vocab < tokenizer.vocab_size:
        raise UsageError(f"checkpoint {ckpt} has {vocab} token embeddings, fewer than its tokenizer's {tokenizer.vocab_size}")
    model = Decoder(cfg.model, cfg.residual, vocab)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise UsageError(f"checkpoint {ckpt} does not fit the run's configuration ({str(e).splitlines()[0][:160]})") from None
    model.to(device).eval()
    status = result["status"] if result else str((record_of(state) if state else {}).get("status") or "running")
    return TrainedRun(run_dir, cfg, model, tokenizer, step, status)
