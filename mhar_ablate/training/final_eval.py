"""The final evaluation: every completed run ends with one evaluation on a large fixed held-out set
(``data.final_sequences`` windows, the same for every arm and seed), precise enough for gaps of a few
thousandths of a nat, which the periodic evaluations (at most ``train.eval_batches`` batches) are not.

The unit of the statistics is the **sequence**: a run's loss on the set is the mean over sequences of
each sequence's mean next-token loss (every sequence has ``seq_len`` targets, so this equals the mean
over tokens), and its standard error is the standard deviation of the per-sequence losses over the
square root of their number. Per-token losses would understate it badly: the tokens of one sequence
share their document and their context, so they are far from independent (a sequence of code is easy
or hard as a whole). Sequences are spread evenly over the held-out part, as far apart as its size
allows; where it holds few documents, neighbouring sequences still share one, and the standard error
reads as a lower bound (docs/benchmarks.md, "Final evaluation", measures how much).

Arms are compared on the same sequences, so the evaluation's noise in a difference between two runs is
the standard error of the per-sequence differences (``paired_se``), much smaller than either run's own:
a sequence hard for one model is hard for the other. Runs evaluate outside the training clock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from . import distributed

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# torch is imported where a model is evaluated: `export` uses the statistics below without it (seconds of imports).


def summarize(losses: Sequence[float], seq_len: int) -> dict[str, Any]:
    """Loss, standard error and size of a final evaluation from its per-sequence losses."""
    n = len(losses)
    mean = statistics.fmean(losses) if n else math.nan
    se = statistics.stdev(losses) / math.sqrt(n) if n > 1 else math.nan
    return {"loss": mean, "se": se, "sequences": n, "tokens": n * seq_len}


def paired_se(a: Sequence[float], b: Sequence[float]) -> float:
    """Standard error of the mean per-sequence difference ``a - b`` of two runs on the same sequences;
    nan unless both hold the same number (> 1) of sequences."""
    if len(a) != len(b) or len(a) < 2:
        return math.nan
    return statistics.stdev([x - y for x, y in zip(a, b)]) / math.sqrt(len(a))


def sequence_losses(model: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Each row's mean next-token cross-entropy, shape (batch,), in float32."""
    import torch.nn.functional as F

    logits = model(x)
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return per_token.view(y.shape).mean(dim=1)


def evaluate(model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]], device: torch.device,
             autocast: Callable[[], Any], seq_len: int) -> dict[str, Any]:
    """Run the final evaluation: the summary (``summarize``), its seconds, and the per-sequence losses
    (``sequence_losses``, rounded to 6 decimals: a difference of 1e-6 nats is far below any gap). Under
    DDP each rank evaluates every ``world``-th batch and the ranks share their rows, so every rank
    returns the whole set's result."""
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        rank, world = distributed.world()
        was_training = model.training
        model.eval()
        rows: list[float] = []
        for k, (x, y) in enumerate(batches):
            if k % world == rank:
                with autocast():
                    values = sequence_losses(model, x.to(device), y.to(device))
                rows.extend(values.double().tolist())
            else:
                rows.extend([0.0] * len(x))
        model.train(was_training)
        if world > 1:  # every rank holds zeros where another rank evaluated: summing gives every row once
            rows = distributed.sum_rows(rows)
    rows = [round(v, 6) for v in rows]
    result = summarize(rows, seq_len)
    result["seconds"] = time.perf_counter() - t0
    result["sequence_losses"] = rows
    return result


def shortfall(val_fraction: float, held_out_tokens: int, total_tokens: int, seq_len: int, asked: int) -> str | None:
    """One line where the held-out part holds fewer final-evaluation sequences than asked (the set is then
    all it holds, and its standard error larger than the default size was chosen for), saying what would
    hold them; None where it holds them (or the final evaluation is off)."""
    window = seq_len + 1
    held = held_out_tokens // window
    if asked <= 0 or held >= asked:
        return None
    need = asked * window / max(total_tokens, 1)
    fix = (f"data.val_fraction={math.ceil(need * 100) / 100:g} would hold them" if need < 0.5 else
           "the corpus is too small to hold them (data.val_fraction stays under 0.5)")
    return (f"final evaluation: {asked:,} sequences asked (data.final_sequences), the held-out part "
            f"(data.val_fraction={val_fraction:g}) holds {held:,} windows of {window:,} tokens: every run is scored on "
            f"those {held:,}; {fix}")


def describe(final: dict[str, Any]) -> str:
    """One line for the run's log."""
    return (f"final evaluation: loss {final['loss']:.4f} ± {final['se']:.4f} (standard error) over "
            f"{final['sequences']:,} sequences ({final['tokens']:,} tokens), {final['seconds']:.1f} s")
