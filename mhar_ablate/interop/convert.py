"""``mhar-ablate convert``: attach MHAR's delta form (SPEC.md, "continued pretraining") to a trained
pre-norm decoder, so that the converted model computes exactly what the original did, and write it as a
new run folder at step 0 that ``train --resume`` continues.

Sources, read without unpickling anything:
- a ``baseline`` run folder of this package (its ``checkpoints/last.ckpt``, ``weights_only``), or that
  checkpoint file itself; the continuation reads on in the source's data stream (``train.first_batch``);
- a local Hugging Face Qwen3 folder: ``config.json`` (``model_type: qwen3``) and ``*.safetensors``
  (one file or shards). Names map one to one onto this decoder's (``HF_NAMES``); a tensor that does
  not map, a missing one or a shape that does not fit is refused.

The new folder holds ``config.yaml`` (``residual.kind=delta``, H heads, the layers grouped into N blocks,
``train.init`` naming its ``init.safetensors``) and ``init.safetensors`` (the converted model's fp32
weights). Before writing, the converted model's logits are compared with the unconverted decoder's on
random tokens: they must be equal exactly (delta's gate is 0, so every sublayer sees the pre-norm stream).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import RunConfig, build_config, flatten, load_yaml
from ..errors import UsageError

INIT_FILE = "init.safetensors"
# The model keys a conversion takes from its source; the user may set only the training length.
SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab_size", "rope_theta",
              "norm_eps", "tie_embeddings")
# Set by convert itself from --heads and --blocks.
OWN_KEYS = ("residual.kind", "residual.heads", "residual.grouping", "train.init")
HF_SEQ_LEN_CAP = 2048  # a Hugging Face source's default model.seq_len: min(max_position_embeddings, this)

# Hugging Face Qwen3 tensor names -> this decoder's (layer i: attention sublayer 2i, MLP sublayer 2i + 1).
HF_NAMES = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "sublayers.{a}.norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight", "sublayers.{a}.{1}.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "sublayers.{m}.norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "sublayers.{m}.{1}.weight"),
]


@dataclass
class Source:
    what: str  # one line for the user
    model: dict[str, Any]  # ModelConfig fields
    state: dict[str, Tensor]  # this decoder's names
    # A package source's data, optim and train sections: its continuation trains as it did (tokenizer,
    # corpus, batches, evaluations, schedule) unless told otherwise.
    sections: dict[str, dict[str, Any]] | None = None
    tokenizer: Path | None = None  # a Hugging Face folder's tokenizer.json
    steps: int = 0  # optimiser steps the source trained (a package source), where its data stream stopped


def read_source(path: str | Path) -> Source:
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return read_hf(p)
    if p.is_dir() and (p / "config.yaml").is_file():
        return read_package(p, p / "checkpoints" / "last.ckpt")
    if p.is_file() and (p.parent.parent / "config.yaml").is_file():
        return read_package(p.parent.parent, p)
    raise UsageError(f"convert: {path} is neither a run folder of this package (config.yaml), one of its checkpoints, "
                     "nor a Hugging Face Qwen3 folder (config.json and *.safetensors)")


def read_package(run_dir: Path, ckpt: Path) -> Source:
    from ..model.weights import RESIDUAL_PREFIX
    from ..training.run import load_run_config
    from ..model.weights import read_checkpoint

    cfg = load_run_config(run_dir)
    if cfg.residual.kind != "baseline":
        raise UsageError(f"convert: {run_dir} is a residual.kind={cfg.residual.kind} run; convert starts from a "
                         "baseline (pre-norm) model")
    if not ckpt.is_file():
        raise UsageError(f"convert: {run_dir} has no checkpoint ({ckpt}): train it first")
    raw = read_checkpoint(ckpt)
    sd = raw.get("state_dict") if isinstance(raw, dict) else None
    if not isinstance(sd, dict) or "model.embed.weight" not in sd:
        raise UsageError(f"convert: {ckpt} is not a checkpoint of this package (no model.embed.weight)")
    state = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.") and isinstance(v, Tensor)}
    if any(k.startswith(RESIDUAL_PREFIX) for k in state):
        raise UsageError(f"convert: {ckpt} holds routing parameters: not a baseline model")
    model = dataclasses.asdict(cfg.model)
    model["vocab_size"] = int(state["embed.weight"].shape[0])
    # Where the source's data stream stopped (a source that was itself a continuation started later).
    steps = cfg.train.first_batch + int(raw.get("global_step", 0))
    return Source(f"{run_dir} (baseline, {cfg.model.n_layers} layers, d {cfg.model.d_model}, step {steps})",
                  model, state, steps=steps,
                  sections={k: dataclasses.asdict(getattr(cfg, k)) for k in ("data", "optim", "train")})


def _hf_refuse(folder: Path, why: str) -> UsageError:
    return UsageError(f"convert: {folder} is not a Qwen3-style decoder this package can hold: {why}")


def read_hf(folder: Path) -> Source:
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"convert: cannot read {folder / 'config.json'}: {e}") from None
    if not isinstance(hf, dict) or hf.get("model_type") != "qwen3":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise _hf_refuse(folder, f"model_type is {kind!r}, not 'qwen3'")
    if hf.get("hidden_act", "silu") != "silu":
        raise _hf_refuse(folder, f"hidden_act={hf['hidden_act']!r} (the MLP here is SwiGLU)")
    if hf.get("attention_bias"):
        raise _hf_refuse(folder, "attention_bias=true (the projections here have no bias)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise _hf_refuse(folder, "sliding-window attention (every layer here attends causally to all tokens)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _hf_refuse(folder, f"rope_type={rope.get('rope_type', rope.get('type'))!r} (only default RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    try:
        d, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        model = {"d_model": d, "n_layers": int(hf["num_hidden_layers"]), "n_heads": n_heads,
                 "n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
                 "head_dim": int(hf.get("head_dim") or d // n_heads), "ffn": int(hf["intermediate_size"]),
                 "vocab_size": int(hf["vocab_size"]), "rope_theta": float(theta),
                 "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
                 "seq_len": min(int(hf.get("max_position_embeddings", HF_SEQ_LEN_CAP)), HF_SEQ_LEN_CAP),
                 "preset": f"hf:{folder.name}"}
    except (KeyError, TypeError, ValueError) as e:
        raise _hf_refuse(folder, f"config.json lacks or mangles {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"convert: {folder} has no *.safetensors weights (only safetensors are read)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw: dict[str, Tensor] = {}
    for f in files:
        try:
            raw.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise UsageError(f"convert: {f} is not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None
    state = map_hf_names(raw, folder)
    # A tied checkpoint (save_pretrained) has no lm_head.weight; when the flag says tied, transformers
    # itself would ignore a stored one and use the embedding.
    model["tie_embeddings"] = bool(hf.get("tie_word_embeddings", "lm_head.weight" not in state))
    if model["tie_embeddings"]:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise _hf_refuse(folder, "tie_word_embeddings=false but there is no lm_head.weight")
    tok = folder / "tokenizer.json"
    what = (f"{folder} (Hugging Face Qwen3, {model['n_layers']} layers, d {d}, vocab {model['vocab_size']:,}, "
            f"{'tied' if model['tie_embeddings'] else 'untied'} embeddings)")
    return Source(what, model, state, tokenizer=tok if tok.is_file() else None)


def map_hf_names(raw: dict[str, Tensor], folder: Path) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in raw.items():
        for pattern, target in HF_NAMES:
            m = re.fullmatch(pattern, name)
            if m:
                groups = m.groups()
                i = int(groups[0]) if groups else 0
                out[target.format(*groups, a=2 * i, m=2 * i + 1)] = t
                break
        else:
            raise _hf_refuse(folder, f"unexpected tensor {name!r}")
    return out


def _user_keys(config_file: str | None, overrides: dict[str, Any]) -> set[str]:
    keys = set(overrides)
    if config_file:
        keys |= set(flatten(load_yaml(config_file)))
    return keys


def converted_config(src: Source, heads: int, blocks: int, config_file: str | None,
                     overrides: dict[str, Any]) -> RunConfig:
    """The continuation's configuration: the source's shape, delta with H heads over N blocks, the
    user's data and training settings (a package source's data section underneath them)."""
    n_layers = src.model["n_layers"]
    if not 1 <= blocks <= n_layers or n_layers % blocks:
        raise UsageError(f"convert: --blocks {blocks} must divide the source's {n_layers} layers")
    user = _user_keys(config_file, overrides)
    clash = sorted(k for k in user if k in OWN_KEYS or (k.startswith("model.") and k != "model.seq_len"))
    if clash:
        raise UsageError(f"convert: {', '.join(clash)} come from the source and --heads/--blocks; "
                         "only model.seq_len of the model may be set")
    base: dict[str, Any] = {}
    if src.sections is not None:
        for section, values in src.sections.items():
            base.update({f"{section}.{k}": v for k, v in values.items() if f"{section}.{k}" not in OWN_KEYS})
        base["train.first_batch"] = src.steps
    if src.tokenizer is not None and "data.tokenizer" not in user:
        base["data.tokenizer"] = str(src.tokenizer.resolve())
    base.update({"residual.kind": "delta", "residual.heads": heads,
                 "residual.grouping": f"block:{n_layers // blocks}"})
    # The shape keys go in before validation so that heads and blocks are checked against the source.
    base.update({f"model.{k}": v for k, v in src.model.items() if k in SHAPE_KEYS})
    if "model.seq_len" not in user and "seq_len" in src.model:
        base["model.seq_len"] = src.model["seq_len"]
    try:
        cfg = build_config(config_file, overrides, base=base)
    except UsageError as e:
        raise UsageError(f"convert: {e}") from None
    cfg.model.preset = src.model.get("preset") or "tiny"  # a label only: the shape is the source's
    vocab = tokenizer_vocab(cfg)
    if vocab > src.model["vocab_size"]:
        raise UsageError(f"convert: the tokenizer ({cfg.data.tokenizer}) has {vocab:,} tokens, more than the source's "
                         f"{src.model['vocab_size']:,} embeddings; name a fitting one with data.tokenizer=PATH/tokenizer.json")
    return cfg


def tokenizer_vocab(cfg: RunConfig) -> int:
    """The configured tokenizer's vocabulary (an upper bound for a BPE not yet trained)."""
    if cfg.data.tokenizer == "byte":
        return 256
    if cfg.data.tokenizer == "bpe":
        return cfg.data.vocab_size
    from ..data.tokenizer import FileTokenizer

    return FileTokenizer(Path(cfg.data.tokenizer)).vocab_size


def build_converted(cfg: RunConfig, state: dict[str, Tensor], where: str):
    """The delta model holding ``state``, and the largest logit difference to the same weights run as a
    pre-norm (baseline) decoder on random tokens (0.0 when the conversion is exact)."""
    from ..model import Decoder
    from ..variants.baseline import BaselineResidual
    from ..model.weights import load_initial

    torch.manual_seed(cfg.seed)
    model = Decoder(cfg.model, cfg.residual, cfg.model.vocab_size)
    load_initial(model, state, where)
    model.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, min(16, cfg.model.seq_len)), generator=g)
    with torch.no_grad():
        converted = model(idx)
        delta, model.residual = model.residual, BaselineResidual()
        original = model(idx)
        model.residual = delta
    return model, (converted - original).abs().max().item()


def convert(source: str, heads: int, blocks: int, output: Path, config_file: str | None,
            overrides: dict[str, Any], log=print) -> Path:
    from safetensors.torch import save_file

    from ..io import commit, write_text
    from ..training.run import new_run_dir

    import yaml

    src = read_source(source)
    log(f"source: {src.what}")
    cfg = converted_config(src, heads, blocks, config_file, overrides)
    model, diff = build_converted(cfg, src.state, f"convert: {source}")
    if diff != 0.0:  # a bug, not bad input: the delta form must start as the original
        raise RuntimeError(f"the converted model's logits differ from the source's by {diff:g}")
    log(f"converted: delta, {heads} routing heads, {cfg.model.n_layers} layers in {blocks} blocks "
        f"(residual.grouping={cfg.residual.grouping}); logits equal the source's on random tokens (max |diff| = 0)")
    run_dir = new_run_dir(output, cfg)
    run_dir.mkdir(parents=True)
    if cfg.data.tokenizer == str(src.tokenizer.resolve() if src.tokenizer else ""):
        # The run keeps its own copy: the source folder may move or go away.
        shutil.copyfile(src.tokenizer, run_dir / "tokenizer.json")
        cfg.data.tokenizer = str((run_dir / "tokenizer.json").resolve())
    init = run_dir / INIT_FILE
    tmp = run_dir / f".{INIT_FILE}.tmp"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    commit(tmp, init)
    cfg.train.init = str(init.resolve())
    write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return run_dir
