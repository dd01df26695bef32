"""Weights in and out of the decoder without unpickling: safetensors files and this package's
checkpoints (read with ``weights_only``), and the rule by which a run starts from weights it did not
train (``train.init``, ``mhar-ablate convert``).

A safetensors file this package writes (a run's ``weights.safetensors``, an ``export-hf`` folder's) names
what it holds in its metadata (``weights_metadata``): the run's resolved config (config.yaml's text),
the vocabulary size, the tokenizer, the package version and the step, so the file alone can be loaded
(``load_decoder``). A file without that metadata (written before it existed, or by another tool) reads as
before: ``read_state_dict`` never needs it, and ``load_decoder`` then takes the config.yaml beside it.
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
# Metadata keys of the safetensors files this package writes (safetensors metadata is str -> str).
META = "mhar_ablate."
META_CONFIG, META_VOCAB, META_TOKENIZER, META_VERSION, META_STEP = (
    f"{META}{k}" for k in ("config", "vocab_size", "tokenizer", "version", "step"))


def weights_metadata(config_yaml: str, vocab_size: int, tokenizer: dict[str, Any], step: int | None) -> dict[str, str]:
    """The metadata of a weights file: ``format: pt`` (what transformers expects of a PyTorch file), the
    run's config as the YAML of its config.yaml, the vocabulary size, the tokenizer as JSON, this package's
    version and the optimiser step of the weights (where known)."""
    import json

    from .. import __version__

    meta = {"format": "pt", META_CONFIG: config_yaml, META_VOCAB: str(int(vocab_size)),
            META_TOKENIZER: json.dumps(tokenizer, sort_keys=True), META_VERSION: __version__}
    if step is not None:
        meta[META_STEP] = str(int(step))
    return meta


def read_weights_metadata(path: str | Path) -> dict[str, Any]:
    """What ``weights_metadata`` wrote, decoded: ``config`` (a mapping), ``vocab_size``, ``tokenizer``,
    ``version``, ``step``; ``{}`` for a file without it (an older file, or another tool's)."""
    import json

    import yaml
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:160]})") from None
    if META_CONFIG not in raw:
        return {}
    try:
        out: dict[str, Any] = {"config": yaml.safe_load(raw[META_CONFIG]), "version": raw.get(META_VERSION),
                               "tokenizer": json.loads(raw.get(META_TOKENIZER) or "null"),
                               "vocab_size": int(raw[META_VOCAB]) if META_VOCAB in raw else None,
                               "step": int(raw[META_STEP]) if META_STEP in raw else None}
    except (yaml.YAMLError, ValueError) as e:
        raise UsageError(f"{path}: its mhar_ablate metadata is not readable ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(out["config"], dict):
        raise UsageError(f"{path}: its mhar_ablate.config metadata is not a run configuration")
    return out


def model_config_of(data: dict[str, Any], where: str):
    """The model and residual sections of a saved run config (config.yaml's mapping), checked; the data
    and training sections are not read, so a model whose corpus or tokenizer file is elsewhere still loads."""
    from ..config import RunConfig, apply

    if not isinstance(data.get("model"), dict) or not isinstance(data.get("residual", {}), dict):
        raise UsageError(f"{where}: not a run configuration (no model section)")
    cfg = RunConfig()
    model = dict(data["model"])
    preset = model.pop("preset", cfg.model.preset)  # a label: the shape is the keys themselves
    apply(cfg, {"model": model, "residual": data.get("residual", {})}, where)
    cfg.model.preset = str(preset)
    cfg.model.validate()
    cfg.residual.validate(cfg.model)
    return cfg.model, cfg.residual


def load_decoder(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """A ``Decoder`` in evaluation mode with the weights of ``path``: a safetensors file this package wrote
    (its metadata names the config), or a folder holding ``config.yaml`` and ``weights.safetensors`` (a run's
    kept weights, an ``export-hf`` folder of a routed run). A file without metadata takes the config.yaml
    beside it (or that of the run folder it sits in)."""
    import yaml

    from .transformer import Decoder

    p = Path(path)
    if p.is_dir():
        p = p / "weights.safetensors"
    if not p.is_file():
        raise UsageError(f"{path}: no weights.safetensors there")
    meta = read_weights_metadata(p) if p.suffix == ".safetensors" else {}
    data = meta.get("config")
    if data is None:
        for folder in (p.parent, p.parent.parent):  # beside it, or a checkpoint's run folder
            if (folder / "config.yaml").is_file():
                data = yaml.safe_load((folder / "config.yaml").read_text())
                break
        else:
            raise UsageError(f"{p}: no config in its metadata and no config.yaml beside it")
    model_cfg, residual = model_config_of(data if isinstance(data, dict) else {}, str(p))
    state = read_state_dict(p)
    if "embed.weight" not in state:
        raise UsageError(f"{p}: holds no decoder weights (no embed.weight)")
    model = Decoder(model_cfg, residual, int(state["embed.weight"].shape[0]))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise UsageError(f"{p}: does not fit its configuration ({str(e).splitlines()[0][:160]})") from None
    return model.to(device).eval()


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
