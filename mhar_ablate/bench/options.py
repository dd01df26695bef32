"""The values of ``bench``'s list options (``--sites-per-pass``, ``--fold-norms``, ``--stacked-config``) and
the device a bench runs on."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:  # annotations only
    import torch


def add_shared_options(m: argparse.ArgumentParser) -> None:
    """The options ``bench model`` and ``bench infer`` share, with the same meaning and defaults."""
    m.add_argument("--preset", default="paper350m", help="model preset from configs/ (default: paper350m)")
    m.add_argument("--heads", type=int, default=8, help="routing heads of the mhar and delta variants (default 8)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu for a small smoke run of the command itself")
    m.add_argument("--debug", action="store_true", help="show tracebacks")


def sites_per_pass(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sites-per-pass takes positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"--sites-per-pass takes positive integers, got {text!r}")
    return values


def fold_norms_option(text: str | None) -> list[bool | None]:
    if text is None:
        return [None]
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("on", "off") for v in values):
        raise UsageError(f"--fold-norms takes on, off or both (off,on), got {text!r}")
    return [v == "on" for v in dict.fromkeys(values)]


def stacked_configs(text: str | None) -> list[str | None]:
    """``--stacked-config``: "off" or "TOKENS,WARPS,STAGES,ROWS" per row, as ``kernel_forms`` takes them."""
    if text is None:
        return [None]
    out = []
    for item in (t.strip().replace(" ", "") for t in text.split(";")):
        if item == "off":
            out.append(item)
            continue
        try:
            values = [int(v) for v in item.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) < 1 or values[3] not in (16, 32):
            raise UsageError(f"--stacked-config takes off or TOKENS,WARPS,STAGES,ROWS (positive, ROWS 16 or 32), "
                             f"';'-separated, got {item!r}")
        out.append(",".join(map(str, values)))
    return list(dict.fromkeys(out))


def bench_device(args: argparse.Namespace, command: str) -> "torch.device":
    """The device a bench command measures: --device, or one clear line where it asks for a missing GPU."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{command} measures a GPU and this machine has none (torch sees no CUDA device); "
                         "--device cpu runs a small smoke test of the command instead")
    return torch.device(args.device)

