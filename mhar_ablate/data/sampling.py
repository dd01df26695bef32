"""Which token windows form a batch.

Training batch ``step`` is ``batch_size`` random windows of the training part drawn from a generator
seeded with ``(seed, step)`` alone, so any batch can be recomputed without replaying the ones before
it (a resumed run sees exactly what an uninterrupted one would). Validation windows are fixed: evenly
spaced, non-overlapping windows of the held-out part, independent of the seed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def train_window_starts(seed: int, step: int, batch_size: int, n_tokens: int, window: int) -> np.ndarray:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    # SeedSequence takes non-negative entropy only; the modulus keeps negative seeds distinct and valid.
    rng = np.random.default_rng([seed % 2**64, step])
    return rng.integers(0, n_tokens - window + 1, size=batch_size)


def gather(tokens: np.ndarray, starts: np.ndarray, window: int) -> np.ndarray:
    """Rows ``tokens[s : s + window]`` for each start, as int64 (what embeddings and losses take)."""
    return np.asarray(tokens[starts[:, None] + np.arange(window)], dtype=np.int64)


def split_xy(windows: np.ndarray) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets of windows of ``seq_len + 1`` tokens."""
    t = torch.from_numpy(windows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def train_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
    starts = train_window_starts(seed, step, batch_size, len(tokens), seq_len + 1)
    return split_xy(gather(tokens, starts, seq_len + 1))


def validation_windows(val_tokens: np.ndarray, seq_len: int, max_sequences: int) -> np.ndarray:
    """Up to ``max_sequences`` non-overlapping windows of ``seq_len + 1`` tokens spread evenly over the part.

    Starts are ``floor(linspace(0, n - window, count))`` with ``count <= n // window``, so consecutive
    starts are at least one window apart.
    """
    window = seq_len + 1
    count = min(max_sequences, len(val_tokens) // window)
    starts = np.linspace(0, len(val_tokens) - window, count).astype(np.int64)
    return gather(val_tokens, starts, window)
