"""A built corpus packed into a small folder that a machine without network reads as ``data.source=FOLDER``.

The folder holds the first N tokens of the cached token stream (cut at a document's end), compressed
with xz, the tokenizer's own file and ``mhar-corpus.json`` (what the corpus is, where it came from, the
hashes). Reading it decompresses the tokens once into that machine's token cache; the BPE is the
packed file, never trained again, so ids and the recorded tokenizer hash are the ones of the source.

    python -m mhar_ablate.data.pack OUT --source debian-en --tokenizer bpe --vocab-size 16384 --tokens 24M
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import UsageError
from ..io import write_json
from .cache import HashingWriter, file_sha256

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


def _read_manifest(path: Path) -> dict[str, Any]:
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


def _no_text() -> Any:
    raise UsageError("a packed corpus holds tokens, not text")


def packed_source(path: Path) -> Any:
    from .sources import Source, _literal, _slug

    manifest = _read_manifest(path)
    origin = manifest["origin"]
    return Source(
        name=str(path),
        slug=_slug(f"packed-{origin['source']}"),
        identity={"kind": "packed", "tokens_sha256": manifest["tokens_sha256"], "tokenizer": manifest["tokenizer"]},
        label_format=_literal(f"{origin['label']}, packed: first {manifest['tokens']:,} tokens") + " ({documents:,} documents)",
        documents=_no_text,
        size_hint=None,
        count_hint=None,
        version=origin["version"],
        parts=tuple(origin.get("parts") or ()),
        pack=Pack(path, manifest),
    )


def pack_tokenizer(pack: Pack, kind: str, vocab_size: int) -> Any:
    """The pack's own tokenizer, after checking that the run asks for the one it was packed with."""
    from .tokenizer import BpeTokenizer, ByteTokenizer

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
                     unit_scale=True, delay=1.0, file=sys.stderr, dynamic_ncols=True) as bar:
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
            "label": f"{m['origin']['label']}, packed: first {written // dtype.itemsize:,} tokens"}


def _cut(tokens: np.ndarray, n: int | None, eos: int) -> int:
    """The length of the longest prefix of at most ``n`` tokens that ends with a document's end."""
    if n is None or n >= len(tokens):
        return len(tokens)
    ends = np.flatnonzero(tokens[:n] == eos)
    if not len(ends):
        raise UsageError(f"--tokens {n:,} holds no whole document; ask for more")
    return int(ends[-1]) + 1


def _text_bytes(tokens: np.ndarray, tokenizer: Any) -> int:
    """UTF-8 bytes of the text the tokens stand for (their end-of-document ids left out)."""
    if tokenizer.name == "byte":
        return int(np.count_nonzero(tokens != tokenizer.eos_id))
    total = 0
    for start in tqdm(range(0, len(tokens), CHUNK_TOKENS), desc="counting text", delay=1.0, file=sys.stderr):
        piece = tokens[start:start + CHUNK_TOKENS]
        total += len(tokenizer.decode(piece[piece != tokenizer.eos_id]).encode("utf-8"))
    return total


def pack_corpus(cfg: Any, cache_dir: Path, out: Path, tokens: int | None) -> dict[str, Any]:
    """Pack the first ``tokens`` tokens (all: None) of ``cfg``'s corpus into the folder ``out``."""
    from .corpus import load_corpus

    if cfg.tokenizer not in ("byte", "bpe"):
        raise UsageError("pack: data.tokenizer must be byte or bpe (a tokenizer.json file can be carried as it is)")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"pack: {out} exists and is not empty")
    corpus = load_corpus(cfg, cache_dir)
    info = corpus.info
    stream = np.memmap(info.path, dtype=corpus.train.dtype, mode="r")
    n = _cut(stream, tokens, corpus.tokenizer.eos_id)
    subset = np.ascontiguousarray(stream[:n])
    out.mkdir(parents=True, exist_ok=True)
    raw = subset.tobytes()
    with lzma.open(out / TOKENS_FILE, "wb", preset=XZ_PRESET) as f:
        for start in tqdm(range(0, len(raw), 1 << 24), desc=f"compressing {n:,} tokens", delay=1.0, file=sys.stderr):
            f.write(raw[start:start + (1 << 24)])
    tok = corpus.tokenizer
    spec = {"kind": tok.name, "vocab_size": tok.vocab_size, "vocab_requested": cfg.vocab_size, "sha256": None}
    if tok.name == "bpe":
        shutil.copyfile(tok.path, out / TOKENIZER_FILE)
        spec["sha256"] = tok.sha256
    prov = info.provenance()
    manifest = {
        "format": PACK_FORMAT,
        "origin": {"source": prov["source"], "sha256": prov["source_sha256"], "version": prov["source_version"],
                   "parts": prov["source_parts"], "label": info.label, "tokens": info.tokens,
                   "documents": info.documents, "text_bytes": info.text_bytes},
        "tokens": n,
        "documents": int(np.count_nonzero(subset == tok.eos_id)),
        "text_bytes": _text_bytes(subset, tok),
        "dtype": subset.dtype.name,
        "tokens_sha256": hashlib.sha256(raw).hexdigest(),
        "compressed_bytes": (out / TOKENS_FILE).stat().st_size,
        "tokenizer": spec,
    }
    write_json(out / PACK_MANIFEST, manifest)
    return manifest


def _count(text: str) -> int:
    scale = {"k": 10**3, "M": 10**6, "B": 10**9}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise UsageError(f"--tokens: not a count: {text!r} (e.g. 24000000 or 24M)") from None


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    from ..config import DataConfig

    ap = argparse.ArgumentParser(prog="python -m mhar_ablate.data.pack", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (must be new or empty)")
    ap.add_argument("--source", default="debian-en", help="data.source of the corpus to pack (default debian-en)")
    ap.add_argument("--tokenizer", default="bpe", help="byte | bpe (default bpe)")
    ap.add_argument("--vocab-size", type=int, default=DataConfig.vocab_size)
    ap.add_argument("--tokens", default=None, help="pack only the first N tokens (e.g. 24M); default all")
    ap.add_argument("--cache", type=Path, default=Path("outputs/cache"),
                    help="the data cache (default outputs/cache; $MHAR_ABLATE_CACHE wins)")
    args = ap.parse_args(argv)
    try:
        cfg = DataConfig(source=args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
        cfg.validate()
        m = pack_corpus(cfg, args.cache, args.out, _count(args.tokens) if args.tokens else None)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = folder_bytes(args.out)
    print(f"packed {m['tokens']:,} tokens ({m['documents']:,} documents, {m['text_bytes'] / 1e6:.1f} MB of text) "
          f"into {args.out}: {size / 2**20:.1f} MiB")
    if size > CARRY_LIMIT:
        print(f"warning: {size / 2**20:.1f} MiB is over the {CARRY_LIMIT >> 20} MiB one call can carry; "
              "pack fewer --tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
