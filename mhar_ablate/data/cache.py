"""The data cache on disk: where it lives, and files that are either complete and verified or absent.

Every cached file (a token array, a trained tokenizer) is written to a temporary file in its own
folder, fsynced and renamed into place, and only then gets a small JSON manifest with its length and
SHA-256. A reader trusts a file only when its manifest exists and matches, so a kill at any moment, a
truncated file or a lost manifest leads to a rebuild, never to training on half a corpus.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import UsageError
from ..io import atomic_writer, raise_if_no_space, write_json

# Bump when the layout or meaning of cached files changes; it is part of every cache key and manifest.
CACHE_FORMAT = 1
CACHE_ENV = "MHAR_ABLATE_CACHE"


def cache_root(cache_dir: str | Path) -> Path:
    """``$MHAR_ABLATE_CACHE`` if set, else ``cache_dir`` (the trainer passes ``<output>/cache``)."""
    return Path(os.environ.get(CACHE_ENV) or cache_dir)


def ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise_if_no_space(e, path)
        raise UsageError(f"cannot create cache folder {path}: {e.strerror}") from None
    return path


def digest(obj: Any) -> str:
    """A stable hex key for a JSON-able description of everything that changes a cached file."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class HashingWriter:
    """A write-only view of a file that keeps the byte count and SHA-256 of what went through it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".manifest.json")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_artifact(path: Path) -> dict[str, Any] | None:
    """The manifest of ``path`` if the file is complete and unchanged since it was written, else None."""
    try:
        manifest = json.loads(manifest_path(path).read_text())
        size = path.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT or manifest.get("bytes") != size:
        return None
    return manifest if file_sha256(path) == manifest.get("sha256") else None


def write_artifact(path: Path, fill: Callable[[HashingWriter], dict[str, Any]]) -> dict[str, Any]:
    """Write ``path`` with ``fill`` (which returns extra manifest fields), then its manifest; return that."""
    # Drop the old manifest first so that it can never vouch for a file being rewritten.
    manifest_path(path).unlink(missing_ok=True)
    with atomic_writer(path) as f:
        out = HashingWriter(f)
        extra = fill(out)
    manifest = {**extra, "format": CACHE_FORMAT, "bytes": out.size, "sha256": out.hexdigest()}
    write_json(manifest_path(path), manifest)
    return manifest


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for building ``path``, so parallel trials build a cache file once.

    Under the lock no one else is writing ``path``, so temporary files left by a killed builder are
    removed here.
    """
    ensure_dir(path.parent)
    lock = path.with_name(path.name + ".lock")
    try:
        f = open(lock, "ab")
    except OSError as e:
        raise_if_no_space(e, lock)
        raise
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        yield
