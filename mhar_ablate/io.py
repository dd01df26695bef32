"""Atomic file writes: a temporary file in the same folder, fsync, then rename (and fsync of the folder),
so a kill at any moment leaves either the old file or the new one, never half of one; a full disk
becomes one clear error. Exports, run results, checkpoints and the data cache all write through here."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from .errors import UsageError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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


def commit(tmp: Path, path: Path) -> None:
    """Make the finished file ``tmp`` (written by us or by a library) durable and rename it to ``path``;
    on failure ``tmp`` is removed and ``path`` keeps its old contents."""
    try:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise_if_no_space(e, path)
        raise


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """Yield a file whose contents replace ``path`` in one rename once the block finishes without error."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep a cache shared through MHAR_ABLATE_CACHE private
        with os.fdopen(fd, "wb") as f:
            yield f
        commit(Path(tmp), path)
        tmp = None
    except OSError as e:
        raise_if_no_space(e, path)
        raise
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
