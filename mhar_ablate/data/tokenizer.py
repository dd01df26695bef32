"""Tokenisers: raw bytes (256 ids, nothing to train), a byte-level BPE trained locally and cached, and a
given ``tokenizer.json`` file (``data.tokenizer=PATH``: a converted model's own tokenizer).

Both turn text into ids and back and end every document with ``eos_id``. The BPE is trained with the
`tokenizers` library on a bounded, evenly spread sample of the source (a few seconds on two cores) and
cached as its JSON file, verified like every other cache file.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..console import bars_enabled
from ..errors import UsageError
from .cache import CACHE_FORMAT, HashingWriter, digest, exclusive, file_sha256, read_artifact, write_artifact
from .packfile import TOKENIZER_FILE, Pack
from .sources import Source

EOS = "<|endoftext|>"
# Enough text for a stable vocabulary of a few thousand merges, small enough to train in seconds.
BPE_SAMPLE_CHARS = 8 << 20


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def spec(self) -> dict[str, Any]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id."""
    return np.dtype(np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as ids. NUL (id 0), which text practically never contains, ends each document."""

    name = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # A window can start or end inside a multi-byte character; show that as U+FFFD, don't fail.
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def spec(self) -> dict[str, Any]:
        return {"kind": "byte"}


class BpeTokenizer:
    """A trained byte-level BPE (`tokenizers.Tokenizer`) with ``<|endoftext|>`` as its end of document."""

    name = "bpe"

    def __init__(self, tok: Any, sha256: str, path: Path | None = None):
        self._tok = tok
        self.sha256 = sha256
        self.path = path  # the tokenizer's file (what a pack carries)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = tok.token_to_id(EOS)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips character offsets, which we never use: about twice as fast.
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def spec(self) -> dict[str, Any]:
        return {"kind": "bpe", "vocab_size": self.vocab_size, "sha256": self.sha256}


def training_sample(documents: Iterator[str], size_hint: int | None, budget: int = BPE_SAMPLE_CHARS) -> list[str]:
    """About ``budget`` characters of documents, every k-th one so that the sample spans the whole source."""
    stride = max(1, -(-size_hint // budget)) if size_hint else 1
    sample: list[str] = []
    size = 0
    for text in itertools.islice(documents, 0, None, stride):
        sample.append(text)
        size += len(text)
        if size >= budget:
            break
    return sample


def _train_bpe(out: HashingWriter, source: Source, vocab_size: int) -> dict[str, Any]:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers


    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=bars_enabled())
    tok.train_from_iterator(training_sample(source.documents(), source.size_hint), trainer)
    out.write(tok.to_str().encode("utf-8"))
    return {}


def load_bpe(source: Source, vocab_size: int, root: Path) -> BpeTokenizer:
    """The BPE for ``source`` with at most ``vocab_size`` tokens, trained once and then read from the cache."""
    import tokenizers

    key = digest({"format": CACHE_FORMAT, "source": source.identity, "vocab_size": vocab_size,
                  "sample_chars": BPE_SAMPLE_CHARS, "tokenizers": tokenizers.__version__})
    path = root / "tokenizers" / f"{source.slug}-bpe{vocab_size}-{key[:16]}.json"
    manifest = read_artifact(path)
    if manifest is None:
        with exclusive(path):
            manifest = read_artifact(path) or write_artifact(path, lambda out: _train_bpe(out, source, vocab_size))
    return BpeTokenizer(tokenizers.Tokenizer.from_file(str(path)), manifest["sha256"], path)


class FileTokenizer(BpeTokenizer):
    """A `tokenizers` file given by path. Its end of document is ``<|endoftext|>`` (what Qwen3's tokenizer
    and this package's BPE both have); the file's SHA-256 is part of the token cache's key."""

    name = "file"

    def __init__(self, path: Path):
        import tokenizers


        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise UsageError(f"data.tokenizer={path}: not a tokenizers file ({str(e).splitlines()[0][:120]})") from None
        if tok.token_to_id(EOS) is None:
            raise UsageError(f"data.tokenizer={path}: has no {EOS} token to end documents with")
        super().__init__(tok, file_sha256(path), path)

    def spec(self) -> dict[str, Any]:
        return {"kind": "file", "vocab_size": self.vocab_size, "sha256": self.sha256}


def load_tokenizer(kind: str, vocab_size: int, source: Source | None, root: Path) -> Tokenizer:
    if source is not None and source.pack is not None and kind in ("byte", "bpe"):
        return pack_tokenizer(source.pack, kind, vocab_size)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return load_bpe(source, vocab_size, root)
    return FileTokenizer(Path(kind))


def pack_tokenizer(pack: Pack, kind: str, vocab_size: int) -> Any:
    """The pack's own tokenizer, after checking that the run asks for the one it was packed with."""
    packed = pack.manifest["tokenizer"]
    if kind != packed["kind"]:
        raise UsageError(f"data.source {pack.path}: packed with data.tokenizer={packed['kind']}, "
                         f"not {kind}; set data.tokenizer={packed['kind']}")
    if kind == "byte":
        return ByteTokenizer()
    if vocab_size != packed["vocab_requested"]:
        raise UsageError(f"data.source {pack.path}: packed with data.vocab_size={packed['vocab_requested']}, "
                         f"not {vocab_size}")
    import tokenizers

    path = pack.path / TOKENIZER_FILE
    sha = file_sha256(path)
    if sha != packed["sha256"]:
        raise UsageError(f"data.source {pack.path}: {TOKENIZER_FILE} does not match its recorded hash")
    return BpeTokenizer(tokenizers.Tokenizer.from_file(str(path)), sha, path)
