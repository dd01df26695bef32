"""The Lightning data module: the corpus's training stream and fixed validation batches for one run.

Training is an endless stream in which batch ``i`` depends only on ``(seed, i)``; it starts at
``start_step``, which the trainer sets when resuming. Validation is the same list of batches for every
arm and seed of a study that shares the data config, ``seq_len`` and the ``eval_batches`` cap. The
final evaluation set (``final_sequences`` windows, evaluated once at a run's end) is likewise a function
of the held-out part, ``seq_len`` and its size only: never of the seed or the arm.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import lightning
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..config import DataConfig
from .corpus import Corpus, fitting_windows, load_corpus
from .sampling import split_xy, train_batch, validation_windows
from .tokenizer import Tokenizer

_NOT_SET_UP = "TokenDataModule: call setup() first"


class _TrainStream(IterableDataset):
    """Batches ``start_step, start_step + 1, ...`` of a module, forever; ``start_step`` is read on iteration."""

    def __init__(self, module: TokenDataModule):
        self._module = module

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        step = self._module.start_step
        m = self._module
        while True:
            x, y = m.batch_at(step)
            if m.world > 1:  # DDP: this rank's rows of the global batch, so the ranks together see all of it
                rows = slice(m.rank * len(x) // m.world, (m.rank + 1) * len(x) // m.world)
                x, y = x[rows], y[rows]
            yield x, y
            step += 1


class _ValBatches(Dataset):
    def __init__(self, windows: np.ndarray, batch_size: int):
        self._windows = windows
        self._batch_size = batch_size

    def __len__(self) -> int:
        return math.ceil(len(self._windows) / self._batch_size)

    def __getitem__(self, k: int) -> tuple[Tensor, Tensor]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        return split_xy(self._windows[k * self._batch_size:(k + 1) * self._batch_size])


class TokenDataModule(lightning.LightningDataModule):
    """Token windows of ``seq_len + 1`` tokens from ``cfg``'s corpus, as (x, y) int64 batches."""

    def __init__(self, cfg: DataConfig, seq_len: int, batch_size: int, seed: int, cache_dir: str | Path,
                 eval_batches: int | None = None, final_sequences: int = 0):
        super().__init__()
        if seq_len < 1 or batch_size < 1 or (eval_batches is not None and eval_batches < 1):
            raise ValueError(f"seq_len, batch_size and eval_batches must be positive, "
                             f"got {seq_len}, {batch_size}, {eval_batches}")
        self.cfg = cfg
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.cache_dir = Path(cache_dir)
        self.eval_batches = eval_batches
        self.final_sequences = final_sequences
        self.start_step = 0
        self.rank, self.world = 0, 1  # set by a DDP run: which slice of each global batch this process trains on
        self._corpus: Corpus | None = None
        self._val: np.ndarray | None = None
        self._final: np.ndarray | None = None

    # A run calls both hooks before it builds the model, and Lightning calls them again in fit: the corpus
    # (each load resolves its source again, every file of the stdlib stat'ed) and the windows are set up once.
    def prepare_data(self) -> None:
        if self._corpus is None:
            load_corpus(self.cfg, self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self._corpus is not None:
            return
        corpus = load_corpus(self.cfg, self.cache_dir)
        count = self.cfg.val_sequences
        if self.eval_batches is not None:
            # Fewer windows, still spread over the whole held-out part rather than bunched at its start.
            count = min(count, self.eval_batches * self.batch_size)
        self._corpus, self._val = corpus, fitting_windows(self.cfg, corpus, self.seq_len, count)
        # Evenly spaced over the whole held-out part (as far apart as its size allows, so that neighbouring
        # sequences share as little of a document as possible); capped by the windows it holds.
        self._final = validation_windows(corpus.val, self.seq_len, self.final_sequences)

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            raise RuntimeError(_NOT_SET_UP)
        return self._corpus

    @property
    def tokenizer(self) -> Tokenizer:
        return self.corpus.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.corpus.tokenizer.vocab_size

    @property
    def num_tokens(self) -> int:
        """Tokens in the training part."""
        return len(self.corpus.train)

    @property
    def val_windows(self) -> np.ndarray:
        """The validation windows (after the ``eval_batches`` cap), shape (n, seq_len + 1), int64."""
        if self._val is None:
            raise RuntimeError(_NOT_SET_UP)
        return self._val

    @property
    def final_windows(self) -> np.ndarray:
        """The final evaluation set, shape (n, seq_len + 1), int64; n = 0 when it is switched off."""
        if self._final is None:
            raise RuntimeError(_NOT_SET_UP)
        return self._final

    def batch_at(self, step: int) -> tuple[Tensor, Tensor]:
        """Training batch number ``step`` (0-based): a function of ``(seed, step)`` only."""
        return train_batch(self.corpus.train, self.seed, step, self.batch_size, self.seq_len)

    def train_dataloader(self) -> DataLoader:
        # Pinned batches on a GPU machine: a copy from pageable memory would wait for the GPU to finish
        # the steps queued before it, and the host could never run ahead of the device.
        return DataLoader(_TrainStream(self), batch_size=None, num_workers=0, pin_memory=torch.cuda.is_available())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_ValBatches(self.val_windows, self.batch_size), batch_size=None, shuffle=False,
                          num_workers=0)

    def final_dataloader(self) -> DataLoader:
        """The final evaluation set in batches of ``batch_size`` sequences, in order."""
        return DataLoader(_ValBatches(self.final_windows, self.batch_size), batch_size=None, shuffle=False,
                          num_workers=0)

    def describe(self) -> str:
        return f"{self.corpus.info.describe()}, {len(self.val_windows)} validation sequences of {self.seq_len + 1}"
