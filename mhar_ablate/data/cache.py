"""The data cache on disk: where it lives, and files that are either complete and verified or absent.

Every cached file (a token array, a trained tokenizer) is written to a temporary file in its own
folder, fsynced and renamed into place, and only then gets a small JSON manifest with its length and
SHA-256. A reader trusts a file only when its manifest exists and matches, so a kill at any moment, a
truncated file or a lost manifest leads to a rebuild, never to training on half a corpus.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import UsageError

# Bump when the layout or meaning of cached files changes; it is part of every cache key and manifest.
CACHE_FORMAT = 1
CACHE_ENV = "MHAR_ABLATE_CACHE"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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


def raise_if_no_space(e: OSError, path: Path) -> None:
    if e.errno in _NO_SPACE:
        raise UsageError(f"no space left on device while writing {path}") from None


def _fsync_dir(folder: Path) -> None:
    # The rename itself must reach the disk too, or a power cut could bring back the old name.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """Yield a file whose contents replace ``path`` in one rename once the block finishes without error."""
    ensure_dir(path.parent)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep a cache shared through MHAR_ABLATE_CACHE private
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        _fsync_dir(path.parent)
    except OSError as e:
        raise_if_no_space(e, path)
        raise
    finally:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    with atomic_writer(path) as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True).encode())


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
    write_json_atomic(manifest_path(path), manifest)
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
