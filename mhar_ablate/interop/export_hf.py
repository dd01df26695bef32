"""``mhar-ablate export-hf RUN OUT``: a trained run as a folder another program can load.

A ``baseline`` run (``residual.kind=baseline``: the plain pre-norm decoder) becomes a Hugging Face
``transformers`` Qwen3 folder: ``config.json`` (``Qwen3ForCausalLM``) and ``model.safetensors`` (fp32,
Qwen3's tensor names), which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads to the same logits as
this package's ``Decoder``, plus the tokenizer where transformers can express it (``tokenizer.json`` and
``tokenizer_config.json`` for ``AutoTokenizer``: the run's BPE or tokenizer file as it is, the byte
tokenizer as a byte-level BPE without merges whose ids are the UTF-8 bytes). The weight names are those
of ``mhar-ablate convert``'s import (``convert.HF_NAMES``) read backwards, and the export maps them forward
again before writing: a name that does not come back to itself is a bug, not a file. Whatever Qwen3 cannot
express is refused with one line, never approximated: a model key this exporter does not know, a tensor
with no Qwen3 name (a bias), a missing QK-norm, an output matrix that does not match
``model.tie_embeddings``.

A routed run (mhar, attnres, delta, hc, ...) has no transformers architecture: it is written as this
package's ``weights.safetensors`` (its metadata names the config) with the run's ``config.yaml``, and the
command prints how to load it (``mhar_ablate.model.weights.load_decoder``).

RUN is a run folder (or its name under ``--output/runs``) or a study's run folder
(``--output/studies/STUDY/BUDGET/ARM-sSEED``, whose kept ``weights.safetensors`` it reads when the
checkpoint is gone). OUT must not exist or be an empty folder; it is written into a temporary folder beside
it and renamed into place, so it is never seen half-written. Only safetensors and JSON are needed:
transformers is not imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from torch import Tensor

from ..errors import UsageError
from .convert import HF_NAMES, map_hf_names

WEIGHTS = "model.safetensors"  # transformers' name for a single-file checkpoint
ROUTED_WEIGHTS = "weights.safetensors"  # this package's name (model/weights.py, load_decoder)
# The ModelConfig keys and how Qwen3's config.json holds each; a key not here (one added to the decoder
# later) is refused until this exporter knows its Qwen3 form.
EXPRESSED = {"preset": None, "d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "ffn": "intermediate_size", "seq_len": "max_position_embeddings", "vocab_size": "vocab_size",
             "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}


def _refuse(run: Path, why: str) -> UsageError:
    return UsageError(f"export-hf: {run} cannot be written as a transformers Qwen3 model: {why}")


# ------------------------------------------------------------------ names: the import's mapping backwards

def _inverse_names() -> list[tuple[re.Pattern, str, str | None]]:
    """(this decoder's name as a regex, the Qwen3 name as a format string, which sublayer: "a" attention,
    "m" MLP or None) for each of ``HF_NAMES``' entries."""
    out = []
    for pattern, target in HF_NAMES:
        groups = re.findall(r"\(([^()]*)\)", pattern)
        counter = iter(range(len(groups)))
        hf = re.sub(r"\([^()]*\)", lambda m: "{%d}" % next(counter), pattern).replace("\\.", ".")
        if "\\" in hf:  # HF_NAMES holds plain names with groups; anything else needs its own inversion here
            raise RuntimeError(f"cannot invert the import's name pattern {pattern!r}")
        regex, which = "", None
        for piece in re.split(r"(\{[a-z0-9]+\})", target):
            if piece in ("{a}", "{m}"):
                which = piece[1]
                regex += r"(?P<site>\d+)"
            elif re.fullmatch(r"\{\d+\}", piece):
                regex += f"(?P<g{piece[1:-1]}>{groups[int(piece[1:-1])]})"
            else:
                regex += re.escape(piece)
        out.append((re.compile(regex), hf, which))
    return out


def hf_name(name: str) -> str | None:
    """The Qwen3 name of this decoder's tensor ``name`` (None: Qwen3 has no place for it)."""
    for regex, hf, which in _inverse_names():
        m = regex.fullmatch(name)
        if not m:
            continue
        if which is None:
            return hf
        site = int(m.group("site"))
        if site % 2 != (0 if which == "a" else 1):  # attention sublayers are even, MLPs odd
            continue
        extra = {int(k[1:]): v for k, v in m.groupdict().items() if k.startswith("g")}
        return hf.format(*[str(site // 2) if i == 0 else extra[i] for i in range(1 + len(extra))])
    return None


def to_hf_state(state: dict[str, Tensor], run: Path) -> dict[str, Tensor]:
    """``state`` under Qwen3's names, checked against the import: mapped back, every name is itself."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        hf = hf_name(name)
        if hf is None:
            raise _refuse(run, f"its tensor {name!r} has no place in Qwen3 (its layers have no bias, no routing)")
        out[hf] = t.detach().to(torch.float32).contiguous()
    back = map_hf_names(out, run)
    if set(back) != set(state) or any(back[k] is not out[hf_name(k)] for k in state):
        raise RuntimeError("the export's names do not map back onto the decoder's through convert.HF_NAMES")
    return out


# ------------------------------------------------------------------ the run

def _run_config(run: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"export-hf: cannot read {run / 'config.yaml'}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"export-hf: {run / 'config.yaml'} is not a run configuration")
    return data


def _weights(run: Path) -> tuple[Path, dict[str, Tensor], int | None]:
    """(the file, the decoder's tensors, the step) of the run's checkpoint, else its kept weights."""
    from ..evaluation.trained import require_weights
    from ..model.weights import read_checkpoint, read_state_dict, read_weights_metadata

    path = require_weights(run)
    state = read_state_dict(path)
    if "embed.weight" not in state:
        raise UsageError(f"export-hf: {path} holds no decoder weights")
    if path.suffix == ".safetensors":
        step = read_weights_metadata(path).get("step")
        if step is None:
            try:
                step = json.loads((run / "result.json").read_text()).get("step")
            except (OSError, ValueError, AttributeError):
                step = None
    else:
        step = int(read_checkpoint(path, mmap=True)["global_step"])
    return path, state, step


def qwen3_config(model: Any, vocab: int, eos_id: int | None, run: Path) -> dict[str, Any]:
    """config.json of the Qwen3 that computes what this decoder computes, or one line why none does."""
    from ..config import ModelConfig

    unknown = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in EXPRESSED]
    if unknown:
        raise _refuse(run, f"model.{unknown[0]}={getattr(model, unknown[0])!r} has no Qwen3 form this exporter knows")
    if not (model.rope_theta > 0 and model.norm_eps > 0):
        raise _refuse(run, f"rope_theta={model.rope_theta} and norm_eps={model.norm_eps} must be positive")
    head_dim = model.head_dim or model.d_model // model.n_heads
    theta = float(model.rope_theta)
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab, "hidden_size": model.d_model, "intermediate_size": model.ffn,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": model.seq_len, "rms_norm_eps": float(model.norm_eps),
        # Default RoPE at theta: both spellings, transformers 4's (rope_theta) and 5's (rope_parameters).
        "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": bool(model.tie_embeddings),
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": model.n_layers, "layer_types": ["full_attention"] * model.n_layers,
        "initializer_range": 0.02, "use_cache": True, "dtype": "float32", "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": eos_id,
    }


def check_expressible(model: Any, state: dict[str, Tensor], run: Path) -> None:
    """The weights are those of the Qwen3 that ``model`` names: every tensor a Qwen3 of this shape has
    (QK-norm gains included), none it lacks (a bias), the output matrix as ``tie_embeddings`` says."""
    from ..config import ResidualConfig
    from ..model import Decoder

    tied = "lm_head.weight" not in state
    if tied != bool(model.tie_embeddings):
        raise _refuse(run, f"model.tie_embeddings={model.tie_embeddings} but the weights "
                           f"{'lack' if tied else 'hold'} a separate lm_head.weight")
    with torch.device("meta"):
        expected = Decoder(model, ResidualConfig(kind="baseline"), int(state["embed.weight"].shape[0])).state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        what = "QK-norm gain" if "q_norm" in missing[0] or "k_norm" in missing[0] else "tensor"
        raise _refuse(run, f"its weights lack the {what} {missing[0]}")
    for k, v in state.items():
        if k not in expected:
            raise _refuse(run, f"its tensor {k!r} has no place in Qwen3 (no bias, no routing)")
        if tuple(v.shape) != tuple(expected[k].shape):
            raise _refuse(run, f"{k} has shape {tuple(v.shape)}, its config says {tuple(expected[k].shape)}")


# ------------------------------------------------------------------ the tokenizer

def byte_tokenizer_json() -> str:
    """The byte tokenizer as a `tokenizers` file: a byte-level BPE with no merges over the 256 byte symbols,
    each symbol's id its byte, so that encoding is ``list(text.encode("utf-8"))`` and decoding its inverse."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbol = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes (GPT-2's map)
    table = _bytes_to_unicode()
    assert set(table.values()) == set(symbol)
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer applies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def _cache_dir(run: Path, output: Path) -> Path:
    """The output folder's cache that holds the run's BPE: --output's, else that of a folder above the run."""
    for folder in (output, *run.resolve().parents):
        if (folder / "cache").is_dir():
            return folder / "cache"
    return output / "cache"


def tokenizer_files(saved: dict[str, Any], run: Path, output: Path, seq_len: int) -> tuple[dict[str, str], int | None, str]:
    """(file name -> text, the end-of-document id, one line on what was written or what is missing) for the
    tokenizer of the run whose config.yaml holds ``saved``."""
    from ..data.tokenizer import EOS

    data = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    kind = str(data.get("tokenizer", "byte"))
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
            "clean_up_tokenization_spaces": False}
    if kind == "byte":
        # No special token: id 0 (NUL) ends a document, as in training; config.json names it eos_token_id.
        return ({"tokenizer.json": byte_tokenizer_json(), "tokenizer_config.json": json.dumps(base, indent=2)}, 0,
                "tokenizer: the byte tokenizer (ids are UTF-8 bytes; id 0, NUL, ends a document)")
    try:
        if kind == "bpe":
            from ..config import from_dict
            from ..evaluation.trained import run_tokenizer

            tok = run_tokenizer(from_dict(data_only(saved)), _cache_dir(run, output))
            text = tok._tok.to_str()  # the `tokenizers` object the run trained with, as its JSON file
        else:
            text = Path(kind).read_text(encoding="utf-8")
            from tokenizers import Tokenizer

            Tokenizer.from_str(text)
    except Exception as e:  # UsageError, OSError, and the bare Exception tokenizers raises for a bad file
        return {}, None, (f"tokenizer: not written ({kind}: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}); "
                          "the model folder loads without it")
    from tokenizers import Tokenizer

    eos = Tokenizer.from_str(text).token_to_id(EOS)
    config = {**base, "eos_token": EOS} if eos is not None else base
    return ({"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2)}, eos,
            f"tokenizer: {'the BPE the run trained' if kind == 'bpe' else kind} as tokenizer.json (AutoTokenizer loads it)")


def data_only(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config reduced to what rebuilding its tokenizer reads (data, model, seed): a routing kind's
    settings or a moved train.init file does not stop the tokenizer from being found."""
    return {"model": data.get("model", {}), "data": data.get("data", {}), "seed": data.get("seed", 0),
            "residual": {"kind": "baseline"}}


# ------------------------------------------------------------------ writing

def _check_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"export-hf: {out} exists and is a file; name a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"export-hf: {out} exists and is not empty; name a new folder (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UsageError(f"export-hf: the folder {out.parent} does not exist")


def _write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a temporary folder beside ``out``, which is then renamed to ``out`` (over an empty one)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes 0600: the folder is meant to be shared
        if out.is_dir():
            out.rmdir()  # empty (checked): a folder made for the export
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_hf(run_name: str, out: str | Path, output: Path, log: Callable[[str], None] = print) -> Path:
    """Write RUN into OUT (see the module's description); returns OUT."""
    from safetensors.torch import save_file

    from ..model.weights import model_config_of, weights_metadata
    from ..training.checkpoint import tokenizer_description
    from ..training.run import find_run

    run = find_run(output, run_name)
    out = Path(out)
    _check_target(out)
    data = _run_config(run)
    model, residual = model_config_of(data, str(run / "config.yaml"))
    path, state, step = _weights(run)
    vocab = int(state["embed.weight"].shape[0])
    config_text = (run / "config.yaml").read_text()
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    meta = weights_metadata(config_text, vocab, tokenizer_description(section), step)
    at = f"step {step}" if step is not None else "its last step"

    if residual.kind != "baseline":
        files, _, tok_line = tokenizer_files(data, run, output, model.seq_len)

        def write_routed(tmp: Path) -> None:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / ROUTED_WEIGHTS), metadata=meta)
            (tmp / "config.yaml").write_text(config_text)
            for name, text in files.items():
                (tmp / name).write_text(text, encoding="utf-8")

        _write_atomically(out, write_routed)
        log(f"exported: {out} ({ROUTED_WEIGHTS}, config.yaml; residual.kind={residual.kind}, {at}, vocab {vocab:,}); "
            f"{tok_line}")
        log(f"transformers has no residual.kind={residual.kind} architecture; load it with this package: "
            f"python -c \"from mhar_ablate.model.weights import load_decoder; model = load_decoder({str(out)!r})\"")
        return out

    check_expressible(model, state, run)
    files, eos, tok_line = tokenizer_files(data, run, output, model.seq_len)
    config = qwen3_config(model, vocab, eos, run)
    hf_state = to_hf_state(state, run)

    def write_qwen3(tmp: Path) -> None:
        save_file(hf_state, str(tmp / WEIGHTS), metadata=meta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if eos is not None:
            (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")

    _write_atomically(out, write_qwen3)
    log(f"exported: {out} (transformers Qwen3ForCausalLM: config.json, {WEIGHTS}; {at}, vocab {vocab:,}, "
        f"{'tied' if model.tie_embeddings else 'untied'} embeddings); {tok_line}")
    log(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
        + (f" and AutoTokenizer.from_pretrained({str(out)!r})" if files else ""))
    return out
