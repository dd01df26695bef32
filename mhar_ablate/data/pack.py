"""A built corpus packed into a small folder that a machine without network reads as ``data.source=FOLDER``.

The folder holds N tokens of the cached token stream (its first N, cut at a document's end, or N
spread over the whole stream with ``--spread``), compressed with xz, the tokenizer's own file and ``mhar-corpus.json`` (what the corpus is, where it came from, the
hashes). Reading it decompresses the tokens once into that machine's token cache; the BPE is the
packed file, never trained again, so ids and the recorded tokenizer hash are the ones of the source.

    mhar-ablate pack OUT --source debian-en --tokenizer bpe --vocab-size 16384 --tokens 24M --spread 2000
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..console import bars_enabled
from ..errors import UsageError
from ..io import write_json
from .corpus import load_corpus
from .packfile import CARRY_LIMIT, CHUNK_TOKENS, PACK_FORMAT, PACK_MANIFEST, TOKENIZER_FILE, TOKENS_FILE, XZ_PRESET

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
    for start in tqdm(range(0, len(tokens), CHUNK_TOKENS), desc="counting text", delay=1.0, file=sys.stderr,
                      disable=not bars_enabled()):
        piece = tokens[start:start + CHUNK_TOKENS]
        total += len(tokenizer.decode(piece[piece != tokenizer.eos_id]).encode("utf-8"))
    return total


def _spread(stream: np.ndarray, n: int, segments: int, eos: int, seed: int) -> np.ndarray:
    """``n`` tokens drawn from the whole stream: the first ``n // segments`` of each of ``segments`` equal
    parts, each piece ended by ``eos``, the pieces in a seeded random order. The first N tokens of a corpus
    built package by package hold its first packages only; a spread pack holds every package in its share,
    and its held-out tail is a mixture like its training part."""
    if segments < 1:
        raise UsageError(f"--spread must be at least 1, got {segments}")
    each = n // segments - 1  # room for the end-of-document id closing each piece
    if each < 1:
        raise UsageError(f"--tokens {n:,} is too few for --spread {segments}: ask for more tokens or fewer parts")
    starts = (np.arange(segments, dtype=np.int64) * len(stream)) // segments
    pieces = []
    for start in starts:
        piece = np.asarray(stream[start:start + each])
        pieces.append(piece if piece[-1] == eos else np.append(piece, np.array([eos], dtype=stream.dtype)))
    order = np.random.default_rng(seed).permutation(segments)
    return np.concatenate([pieces[i] for i in order])


def pack_corpus(cfg: Any, cache_dir: Path, out: Path, tokens: int | None, spread: int = 0,
                seed: int = 0) -> dict[str, Any]:
    """Pack the first ``tokens`` tokens (all: None) of ``cfg``'s corpus into the folder ``out``; with
    ``spread`` > 0, that many pieces spread over the whole corpus instead (``_spread``)."""
    if cfg.tokenizer not in ("byte", "bpe"):
        raise UsageError("pack: data.tokenizer must be byte or bpe (a tokenizer.json file can be carried as it is)")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"pack: {out} exists and is not empty")
    corpus = load_corpus(cfg, cache_dir)
    info = corpus.info
    stream = np.memmap(info.path, dtype=corpus.train.dtype, mode="r")
    if spread and tokens is not None and tokens < len(stream):
        subset = _spread(stream, tokens, spread, corpus.tokenizer.eos_id, seed)
        selection = {"kind": "spread", "segments": spread, "seed": seed}
    else:
        subset = np.ascontiguousarray(stream[:_cut(stream, tokens, corpus.tokenizer.eos_id)])
        selection = {"kind": "first"}
    n = len(subset)
    out.mkdir(parents=True, exist_ok=True)
    raw = subset.tobytes()
    with lzma.open(out / TOKENS_FILE, "wb", preset=XZ_PRESET) as f:
        for start in tqdm(range(0, len(raw), 1 << 24), desc=f"compressing {n:,} tokens", delay=1.0, file=sys.stderr,
                          disable=not bars_enabled()):
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
        "selection": selection,
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


def add_pack_arguments(ap: argparse.ArgumentParser) -> None:
    """The pack's options, shared by ``mhar-ablate pack`` and ``python -m mhar_ablate.data.pack``."""
    from ..config import DataConfig

    ap.add_argument("out", type=Path, help="the folder to write (must be new or empty)")
    ap.add_argument("--source", default="debian-en", help="data.source of the corpus to pack (default debian-en)")
    ap.add_argument("--tokenizer", default="bpe", help="byte | bpe (default bpe)")
    ap.add_argument("--vocab-size", type=int, default=DataConfig.vocab_size)
    ap.add_argument("--tokens", default=None, help="pack only N tokens (e.g. 24M); default all")
    ap.add_argument("--spread", type=int, default=0, metavar="PARTS",
                    help="take the tokens as PARTS pieces spread over the whole corpus, in a seeded random order "
                         "(default 0: the first N tokens, cut at a document's end)")
    ap.add_argument("--seed", type=int, default=0, help="the order of --spread's pieces (default 0)")


def pack_from_args(args: argparse.Namespace, cache_dir: Path) -> int:
    """Build (or read from the cache) the corpus and write the pack; its summary line; raises UsageError."""
    from ..config import DataConfig

    cfg = DataConfig(source=args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    cfg.validate()
    m = pack_corpus(cfg, cache_dir, args.out, _count(args.tokens) if args.tokens else None,
                    spread=args.spread, seed=args.seed)
    size = folder_bytes(args.out)
    print(f"packed {m['tokens']:,} tokens ({m['documents']:,} documents, {m['text_bytes'] / 1e6:.1f} MB of text) "
          f"into {args.out}: {size / 2**20:.1f} MiB")
    if size > CARRY_LIMIT:
        print(f"warning: {size / 2**20:.1f} MiB is over the {CARRY_LIMIT >> 20} MiB one call can carry; "
              "pack fewer --tokens", file=sys.stderr)
    print(f"train on it with: data.source={args.out} data.tokenizer={args.tokenizer}"
          + (f" data.vocab_size={args.vocab_size}" if args.tokenizer == "bpe" else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhar_ablate.data.pack", description=__doc__.split("\n\n")[0])
    add_pack_arguments(ap)
    ap.add_argument("--cache", type=Path, default=Path("outputs/cache"),
                    help="the data cache (default outputs/cache; $MHAR_ABLATE_CACHE wins)")
    args = ap.parse_args(argv)
    try:
        return pack_from_args(args, args.cache)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
