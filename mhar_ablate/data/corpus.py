"""A corpus as one token stream: built once into the cache, memory-mapped after, split into train and val.

The stream is every document's ids followed by the tokenizer's end-of-document id, in the source's
fixed order, cut at ``max_tokens``. The held-out validation part is its tail (``val_fraction`` of it),
so it never overlaps the training part and does not depend on the seed or the model.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from ..config import DataConfig
from ..console import bars_enabled
from ..errors import UsageError
from .cache import CACHE_FORMAT, HashingWriter, cache_root, digest, ensure_dir, exclusive, manifest_path, read_artifact, write_artifact
from .packfile import unpack_tokens
from .sources import Source, resolve_source
from .tokenizer import Tokenizer, load_tokenizer, token_dtype

# Documents are tokenised in batches of about this many characters, so that BPE can use every core.
ENCODE_BATCH_CHARS = 1 << 20


def human_count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


@dataclass(frozen=True)
class CorpusInfo:
    """What was loaded, for the CLI, the run's result and the README."""

    label: str  # e.g. "stdlib corpus (Python 3.11.7 standard library, 1,786 files)"
    documents: int  # -1: unknown (a packed corpus cut by data.max_tokens)
    text_bytes: int  # UTF-8 bytes of the documents' text; -1: unknown, as for documents
    tokens: int  # the whole stream, end-of-document ids included
    train_tokens: int
    val_tokens: int  # the held-out tail
    tokenizer: str  # byte | bpe
    vocab_size: int
    path: Path  # the cached token file
    from_cache: bool  # False when this call tokenised the source
    source: str = ""  # data.source's corpus (for a pack: the corpus it was packed from)
    source_sha256: str = ""  # hash of the source's identity: equal hashes, equal text
    source_version: str = ""  # which release of the text (a Python, a recipe and its text's hash)
    source_parts: tuple[dict[str, str], ...] = ()  # registry packages it was built from, with versions
    packed: dict[str, Any] | None = None  # for a packed corpus: its folder, token count and hash
    tokenizer_sha256: str | None = None  # the BPE or tokenizer file's hash; None for bytes
    token_sha256: str = ""  # the cached token stream's hash

    def provenance(self) -> dict[str, Any]:
        """What the run's result records of its data: which corpus, which release, which tokenizer."""
        return {"source": self.source, "source_sha256": self.source_sha256, "source_version": self.source_version,
                "source_parts": [dict(p) for p in self.source_parts], "packed": self.packed, "label": self.label,
                "documents": self.documents, "text_bytes": self.text_bytes, "tokens": self.tokens,
                "train_tokens": self.train_tokens, "val_tokens": self.val_tokens,
                "tokenizer": {"kind": self.tokenizer, "vocab_size": self.vocab_size, "sha256": self.tokenizer_sha256},
                "token_file_sha256": self.token_sha256}

    def describe(self) -> str:
        return (f"{self.label}: {human_count(self.tokens)} tokens ({human_count(self.train_tokens)} train, "
                f"{human_count(self.val_tokens)} held out), {self.tokenizer} tokenizer (vocab {self.vocab_size:,})")


class Corpus(NamedTuple):
    train: np.ndarray  # read-only memory map, dtype the smallest unsigned type that holds the vocabulary
    val: np.ndarray
    tokenizer: Tokenizer
    info: CorpusInfo


@dataclass(frozen=True)
class _Loaded:
    stamp: tuple[int, ...]
    tokens: np.ndarray
    manifest: dict[str, Any]


# A study runs many trials in one process: each token file is mapped and verified once per process.
_LOADED: dict[Path, _Loaded] = {}


def _stamp(path: Path) -> tuple[int, ...]:
    """Changes whenever the token file or its manifest is replaced, truncated or removed."""
    out: list[int] = []
    for p in (path, manifest_path(path)):
        try:
            st = p.stat()
        except FileNotFoundError:
            return ()
        out += [st.st_ino, st.st_size, st.st_mtime_ns]
    return tuple(out)


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= ENCODE_BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_tokens(out: HashingWriter, source: Source, tokenizer: Tokenizer, max_tokens: int | None) -> dict[str, Any]:
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    limit = max_tokens or sys.maxsize
    tokens = documents = text_bytes = 0
    with tqdm(total=source.count_hint, desc=f"tokenising {source.name}", unit=" docs", delay=1.0,
              file=sys.stderr, dynamic_ncols=True, disable=not bars_enabled()) as bar:
        for batch in _batches(source.documents()):
            pieces = []
            for text, ids in zip(batch, tokenizer.encode_batch(batch), strict=True):
                piece = np.concatenate([ids.astype(dtype, copy=False), eos])[: limit - tokens]
                pieces.append(piece)
                tokens += len(piece)
                documents += 1
                text_bytes += len(text.encode("utf-8"))
                if tokens >= limit:
                    break
            out.write(np.concatenate(pieces).tobytes())
            bar.update(len(pieces))
            if tokens >= limit:
                break
        bar.total = bar.n  # the hint counts inputs, some of which (empty, not UTF-8) hold no document
    if tokens == 0:
        raise UsageError(f"data.source {source.name} holds no text")
    return {"dtype": dtype.name, "tokens": tokens, "documents": documents, "text_bytes": text_bytes,
            "label": source.label(documents)}


def _load_tokens(path: Path, source: Source, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[_Loaded, bool]:
    """The token stream at ``path``, building it first if the cache lacks a verified copy; and whether cached."""
    loaded = _LOADED.get(path)
    if loaded is not None and loaded.stamp == _stamp(path):
        return loaded, True
    manifest = read_artifact(path)
    from_cache = manifest is not None
    if manifest is None:
        with exclusive(path):
            # Another process may have built it while we waited for the lock.
            manifest = read_artifact(path)
            from_cache = manifest is not None
            if manifest is None:
                if source.pack is not None:
                    fill = partial(unpack_tokens, pack=source.pack, max_tokens=max_tokens)
                else:
                    fill = partial(_write_tokens, source=source, tokenizer=tokenizer, max_tokens=max_tokens)
                manifest = write_artifact(path, fill)
    tokens = np.memmap(path, dtype=np.dtype(manifest["dtype"]), mode="r", shape=(manifest["tokens"],))
    loaded = _Loaded(_stamp(path), tokens, manifest)
    _LOADED[path] = loaded
    return loaded, from_cache


def token_path(root: Path, source: Source, tokenizer: Tokenizer, max_tokens: int | None) -> Path:
    """The cache file for this stream; its name's key covers everything that changes the tokens."""
    key = digest({"format": CACHE_FORMAT, "source": source.identity, "tokenizer": tokenizer.spec(),
                  "max_tokens": max_tokens})
    vocab = "" if tokenizer.name == "byte" else str(tokenizer.vocab_size)
    return root / "tokens" / f"{source.slug}-{tokenizer.name}{vocab}-{key[:16]}.bin"


def load_corpus(cfg: DataConfig, cache_dir: str | Path) -> Corpus:
    """Tokens of ``cfg.source`` split into (train, val), with the tokenizer and a description.

    The cache root is ``$MHAR_ABLATE_CACHE`` if set, else ``cache_dir``. The first call builds the
    cache (seconds for the stdlib corpus); later calls map it, and repeated calls in one process reuse
    the mapping.
    """
    root = ensure_dir(cache_root(cache_dir))
    source = resolve_source(cfg, root)
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.vocab_size, source, root)
    path = token_path(root, source, tokenizer, cfg.max_tokens)
    loaded, from_cache = _load_tokens(path, source, tokenizer, cfg.max_tokens)
    tokens = loaded.tokens
    split = len(tokens) - int(len(tokens) * cfg.val_fraction)
    info = CorpusInfo(
        label=loaded.manifest["label"],
        documents=loaded.manifest["documents"] if loaded.manifest["documents"] is not None else -1,
        text_bytes=loaded.manifest["text_bytes"] if loaded.manifest["text_bytes"] is not None else -1,
        tokens=len(tokens),
        train_tokens=split,
        val_tokens=len(tokens) - split,
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        path=path,
        from_cache=from_cache,
        **_provenance(source),
        tokenizer_sha256=getattr(tokenizer, "sha256", None),
        token_sha256=loaded.manifest["sha256"],
    )
    return Corpus(tokens[:split], tokens[split:], tokenizer, info)


def _provenance(source: Source) -> dict[str, Any]:
    if source.pack is None:
        return {"source": source.name, "source_sha256": source.sha256, "source_version": source.version,
                "source_parts": source.parts}
    m = source.pack.manifest
    return {"source": m["origin"]["source"], "source_sha256": m["origin"]["sha256"],
            "source_version": source.version, "source_parts": source.parts,
            "packed": {"path": str(source.pack.path), "tokens": m["tokens"], "tokens_sha256": m["tokens_sha256"],
                       "of_tokens": m["origin"]["tokens"], "selection": m.get("selection") or {"kind": "first"}}}


def fitting_windows(cfg: DataConfig, corpus: Corpus, seq_len: int, count: int) -> np.ndarray:
    """The validation windows of ``corpus``, after checking that it holds at least one training and one
    validation sequence: a corpus too small for the model is bad input, said before anything trains."""
    from .sampling import validation_windows

    window = seq_len + 1
    if len(corpus.train) < window:
        raise UsageError(f"data.source {cfg.source}: its training part has {len(corpus.train):,} tokens, "
                         f"fewer than one training sequence of {window:,} (model.seq_len + 1); "
                         "use more text or a shorter model.seq_len")
    val = validation_windows(corpus.val, seq_len, count)
    if not len(val):
        needed = _tokens_needed(window, cfg.val_fraction)
        raise UsageError(f"data.source {cfg.source}: its held-out part (data.val_fraction={cfg.val_fraction}) "
                         f"has {len(corpus.val):,} of its {corpus.info.tokens:,} tokens, fewer than one validation "
                         f"sequence of {window:,}; it needs at least {needed:,} tokens")
    return val


def _tokens_needed(window: int, val_fraction: float) -> int:
    """The smallest corpus whose held-out tail (``int(n * val_fraction)`` tokens) holds one window."""
    n = math.floor(window / val_fraction)
    while int(n * val_fraction) < window:
        n += 1
    return n
