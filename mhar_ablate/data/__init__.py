"""Data for training runs: corpora, tokenisers, the token cache and the Lightning data module.

``load_corpus(cfg, cache_dir)`` gives the (train, val) token streams without Lightning;
``TokenDataModule`` serves them as batches; ``stdlib_summary()`` describes the default corpus.
"""

from .cache import CACHE_ENV, cache_root
from .corpus import Corpus, CorpusInfo, fitting_windows, load_corpus
from .sampling import train_batch, validation_windows
from .sources import StdlibSummary, stdlib_files, stdlib_summary
from .tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer

__all__ = [
    "CACHE_ENV", "BpeTokenizer", "ByteTokenizer", "Corpus", "CorpusInfo", "StdlibSummary", "TokenDataModule",
    "Tokenizer", "cache_root", "fitting_windows", "load_corpus", "stdlib_files", "stdlib_summary", "train_batch", "validation_windows",
]


def __getattr__(name: str):
    # The data module pulls in Lightning (seconds of imports); load it only when a run needs it.
    if name == "TokenDataModule":
        from .datamodule import TokenDataModule

        return TokenDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
