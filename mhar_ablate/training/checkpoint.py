"""A run's checkpoint as data: read safely, checked against the run that wants to continue it, and
what it records about its run (kept free of Lightning, so that a study can check every grid point's
checkpoint before the first trial trains).

Besides Lightning's own keys, every checkpoint holds a record under ``RECORD`` (written by the run's
``CheckpointRecord`` callback): the run's identity (its configuration), the status the run had when the
checkpoint was written (``completed`` for the checkpoint written at the end of the budget), the training
seconds and curve it had reached, its peak memory, the final routing weights, and the versions it
ran under. A checkpoint whose record says ``completed`` is a finished run: a rerun rebuilds the result
from it without training. That one is weights-only (no optimiser state: nothing resumes from it); every
other checkpoint holds everything a resumed run needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..errors import UsageError

CHECKPOINT = Path("checkpoints") / "last.ckpt"
# A finished study trial keeps only its model's weights (fp32, no optimiser moments: about a sixth of the
# checkpoint), so that `eval` and later analyses can load what it trained.
FINAL_WEIGHTS = Path("weights.safetensors")
RECORD = "mhar_ablate"
# Settings that change how a run is executed or logged, not what it computes: a checkpoint carries
# over between them.
NOT_IDENTITY = ("train.threads", "train.checkpoint_every", "train.heatmap_every", "train.log_every", "train.compile",
                "train.cuda_graph", "residual.backend", "train.logger")


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What makes two runs the same run: every setting except those in ``NOT_IDENTITY``, and under the
    flops budget ``train.steps``, which follows from ``train.flops`` and the shape (a run folder written
    before its steps were resolved, by ``convert``, is still this run)."""
    skip = NOT_IDENTITY + (("train.steps",) if cfg.train.budget == "flops" else ())
    return {k: v for k, v in cfg.flat().items() if k not in skip}


def identity_differences(recorded: dict[str, Any], cfg: RunConfig, ignore: tuple[str, ...] = ()) -> list[str]:
    """``key: recorded -> this run's`` for each setting both know that differs (a key one of them lacks
    comes from another package version and is not compared)."""
    mine = identity(cfg)
    return [f"{k}={recorded[k]} (this run: {mine[k]})" for k in recorded
            if k in mine and k not in ignore and recorded[k] != mine[k]]


def record_of(state: dict[str, Any]) -> dict[str, Any]:
    record = state.get(RECORD)
    return record if isinstance(record, dict) else {}


def check_fits(state: dict[str, Any], cfg: RunConfig, vocab: int, path: Path, ignore: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint that was written by another run (another arm, seed or budget) or whose
    weights do not fit this run's model, before Lightning tries to load it."""
    record = record_of(state)
    if isinstance(record.get("identity"), dict):
        diffs = identity_differences(record["identity"], cfg, ignore)
        if diffs:
            who = f" (arm {record['arm']!r}, seed {record.get('seed')})" if record.get("arm") else ""
            raise UsageError(f"checkpoint {path} was written by another run{who}: {', '.join(diffs[:4])}"
                             f"{' ...' if len(diffs) > 4 else ''}; delete it to restart this run from the beginning")
    from ..model import Decoder

    with torch.device("meta"):
        expected = {f"model.{k}": tuple(v.shape) for k, v in Decoder(cfg.model, cfg.residual, vocab).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state["state_dict"].items() if k.startswith("model.") and hasattr(v, "shape")}
    problems = [f"missing {k}" for k in expected if k not in found]
    problems += [f"unexpected {k}" for k in found if k not in expected]
    problems += [f"{k} has shape {list(found[k])}, this model {list(expected[k])}" for k in expected
                 if k in found and found[k] != expected[k]]
    if problems:
        raise UsageError(f"checkpoint {path} does not fit this run's model ({'; '.join(problems[:3])}"
                         f"{' ...' if len(problems) > 3 else ''}): it belongs to another configuration; "
                         "delete it to restart this run from the beginning")


def resume_point(state: dict[str, Any]) -> tuple[int, float]:
    """(optimiser steps, training seconds) a checkpoint continues from."""
    return int(state["global_step"]), float(state.get("training_clock", 0.0))


def checkpoint_bytes(params: int) -> int:
    """About what one checkpoint of a model with ``params`` parameters takes on disk: fp32 weights and
    AdamW's two fp32 moments (12 bytes a parameter), plus a little for everything else."""
    return 12 * params + (1 << 20)


def tokenizer_description(data: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer of a run's data section (config.yaml's ``data`` mapping), as a weights file's
    metadata names it: bytes, the BPE trained on the run's corpus, or a tokenizer file (with its SHA-256)."""
    kind = str(data.get("tokenizer", "byte"))
    if kind == "byte":
        return {"kind": "byte", "vocab_size": 256, "eos_id": 0}
    if kind == "bpe":
        return {"kind": "bpe", "vocab_size": data.get("vocab_size"), "trained_on": data.get("source")}
    from ..data.cache import file_sha256

    path = Path(kind)
    return {"kind": "file", "path": kind, "sha256": file_sha256(path) if path.is_file() else None}


def final_weights_metadata(run_dir: Path, vocab: int) -> dict[str, str] | None:
    """``weights_metadata`` for ``run_dir``: its config.yaml as written, its tokenizer, its result's step
    (None where the folder has no readable config.yaml: the weights are still kept)."""
    import json

    import yaml

    from ..model.weights import weights_metadata

    try:
        text = (run_dir / "config.yaml").read_text()
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        step = json.loads((run_dir / "result.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        step = None
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    return weights_metadata(text, vocab, tokenizer_description(section),
                            step if isinstance(step, int) else None)


def save_final_weights(run_dir: Path) -> Path | None:
    """Write the decoder weights of ``run_dir``'s checkpoint to ``FINAL_WEIGHTS`` (atomically), with the
    run's config, vocabulary, tokenizer and step in its metadata (``final_weights_metadata``); None where
    the run has no checkpoint. The run's step is its ``result.json``'s, which is written before this."""
    from safetensors.torch import save_file

    from ..io import commit
    from ..model.weights import read_state_dict

    ckpt, dest = run_dir / CHECKPOINT, run_dir / FINAL_WEIGHTS
    if not ckpt.is_file():
        return None
    tmp = dest.with_name(f".{dest.name}.tmp")
    state = read_state_dict(ckpt)
    meta = final_weights_metadata(run_dir, int(state["embed.weight"].shape[0])) if "embed.weight" in state else None
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=meta)
    commit(tmp, dest)
    return dest
