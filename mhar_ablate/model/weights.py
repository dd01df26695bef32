"""Weights in and out of the decoder without unpickling: safetensors files and this package's
checkpoints (read with ``weights_only``), and the rule by which a run starts from weights it did not
train (``train.init``, ``mhar-ablate convert``).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UsageError

RESIDUAL_PREFIX = "residual."


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The decoder's tensors in ``path``, named as ``Decoder.state_dict()`` names them.

    ``.safetensors``: the file's tensors as they are. Anything else is read as a checkpoint of this
    package (a Lightning checkpoint whose ``state_dict`` holds the module's ``model.*`` tensors)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise UsageError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:160]})") from None
    ckpt = read_checkpoint(path, mmap=True)  # mapped: the optimiser's moments are never read
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not any(k.startswith("model.") for k in state):
        raise UsageError(f"{path}: not a checkpoint of this package (no model.* tensors in its state_dict)")
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.") and isinstance(v, Tensor)}


def load_initial(model: nn.Module, state: dict[str, Tensor], where: str) -> None:
    """Copy ``state`` into ``model``: every non-routing parameter must be there with its exact shape;
    routing (``residual.*``) tensors that ``state`` lacks keep the kind's initial values; any tensor the
    model has no place for is an error (a source of another shape or kind is refused, not half-loaded)."""
    own = model.state_dict()
    extra = sorted(set(state) - set(own))
    if extra:
        raise UsageError(f"{where}: has tensors this model has no place for ({', '.join(extra[:3])}"
                         f"{', ...' if len(extra) > 3 else ''}): another kind or shape")
    missing = sorted(k for k in own if k not in state and not k.startswith(RESIDUAL_PREFIX))
    if missing:
        raise UsageError(f"{where}: lacks {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise UsageError(f"{where}: {k} has shape {tuple(v.shape)}, the model needs {tuple(own[k].shape)}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)  # to the model's dtype (fp32): a bf16 source converts exactly


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def read_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint without unpickling arbitrary objects (``weights_only``): a tampered file is
    refused, never executed. An unreadable one is a clear error, not a traceback. ``mmap`` maps the
    tensors instead of reading them (a check of a multi-GB checkpoint then costs little).

    A training run replaces its checkpoint by renaming a new file over it, and another process may read it
    meanwhile (a study's workers check the checkpoints of the points still to train). ``torch.load`` with
    ``mmap`` opens the file by name twice, so a replacement between the two reads one file's header against
    the other's size: a read that fails while the file was replaced is tried again."""
    for attempt in range(3):
        before = _file_id(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, KeyError) as e:
            if attempt < 2 and before is not None and _file_id(path) not in (None, before):
                continue
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"checkpoint {path} cannot be loaded safely ({first[:160]}); "
                             "delete it to restart this run from the beginning") from None
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict) or "global_step" not in state:
        raise UsageError(f"checkpoint {path} is not a checkpoint of an mhar-ablate run; "
                         "delete it to restart this run from the beginning")
    return state
