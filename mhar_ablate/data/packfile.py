"""A corpus pack as a run reads it: the folder's manifest, its files and its tokens unpacked into the token
cache. ``pack.py`` writes packs; ``sources.py`` and ``tokenizer.py`` turn one into a source and its tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..console import bars_enabled
from ..errors import UsageError
from .cache import HashingWriter

PACK_MANIFEST = "mhar-corpus.json"
TOKENS_FILE = "tokens.bin.xz"
TOKENIZER_FILE = "tokenizer.json"
PACK_FORMAT = 1
XZ_PRESET = 6  # about 1.5x smaller than gzip on BPE ids; decompression (the GPU side) is fast at any preset
CARRY_LIMIT = 64 << 20  # what one call may carry to the lent GPU machine, the working tree included
CHUNK_TOKENS = 1 << 22


@dataclass(frozen=True)
class Pack:
    path: Path
    manifest: dict[str, Any]

    @property
    def tokenizer_kind(self) -> str:
        return self.manifest["tokenizer"]["kind"]


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / PACK_MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"data.source {path}: unreadable {PACK_MANIFEST} ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
        raise UsageError(f"data.source {path}: {PACK_MANIFEST} is not a corpus pack of format {PACK_FORMAT}")
    for name in [TOKENS_FILE] + ([TOKENIZER_FILE] if manifest["tokenizer"]["kind"] == "bpe" else []):
        if not (path / name).is_file():
            raise UsageError(f"data.source {path}: the pack lacks {name}")
    return manifest


def unpack_tokens(out: HashingWriter, pack: Pack, max_tokens: int | None) -> dict[str, Any]:
    """Write the pack's tokens (at most ``max_tokens``) into the token cache; the manifest's fields."""
    m = pack.manifest
    dtype = np.dtype(m["dtype"])
    limit = min(max_tokens or m["tokens"], m["tokens"]) * dtype.itemsize
    check = hashlib.sha256()
    written = 0
    try:
        with lzma.open(pack.path / TOKENS_FILE, "rb") as f, \
                tqdm(total=m["tokens"] * dtype.itemsize, desc=f"unpacking {pack.path.name}", unit="B",
                     unit_scale=True, delay=1.0, file=sys.stderr, dynamic_ncols=True, disable=not bars_enabled()) as bar:
            while chunk := f.read(CHUNK_TOKENS * dtype.itemsize):
                check.update(chunk)
                keep = chunk[: max(0, limit - written)]
                if keep:
                    out.write(keep)
                    written += len(keep)
                bar.update(len(chunk))
    except (lzma.LZMAError, EOFError) as e:
        raise UsageError(f"data.source {pack.path}: {TOKENS_FILE} is damaged ({e})") from None
    if check.hexdigest() != m["tokens_sha256"]:
        raise UsageError(f"data.source {pack.path}: {TOKENS_FILE} does not match its recorded hash")
    whole = written == m["tokens"] * dtype.itemsize
    return {"dtype": dtype.name, "tokens": written // dtype.itemsize,
            "documents": m["documents"] if whole else None, "text_bytes": m["text_bytes"] if whole else None,
            "label": f"{m['origin']['label']}, packed: {selection_words(m, written // dtype.itemsize)}"}


def selection_words(manifest: dict[str, Any], tokens: int) -> str:
    """How the pack took its tokens from the corpus, for labels: 'first N tokens' or 'N tokens in P pieces'."""
    sel = manifest.get("selection") or {"kind": "first"}
    if sel["kind"] == "spread":
        return f"{tokens:,} tokens in {sel['segments']:,} pieces spread over it (seed {sel['seed']})"
    return f"first {tokens:,} tokens"
