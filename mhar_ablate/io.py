"""Atomic file writes: a temporary file in the same folder, fsync, then rename (and fsync of the folder),
so a kill at any moment leaves either the old file or the new one, never half of one; a full disk, a
read-only folder or a file where a folder should be becomes one clear error. Exports, run results,
checkpoints and the data cache all write through here; a write killed before its rename leaves its
temporary, which ``remove_stale_temporaries`` removes when a run or study next starts on the folder.
Also the checks made before anything trains: that an output folder can be written, and that the disk
has room for what a run will write."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from .errors import UsageError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_NOT_A_FOLDER = (errno.ENOTDIR, errno.EEXIST)


def raise_if_no_space(e: OSError, path: Path) -> None:
    """A full disk, a read-only folder or a file in the way: one clear error instead of a traceback."""
    if e.errno in _NO_SPACE:
        raise UsageError(f"no space left on device while writing {path}") from None
    if e.errno in _NOT_WRITABLE:
        raise UsageError(f"cannot write {path}: {e.strerror} (a read-only folder?)") from None
    if e.errno in _NOT_A_FOLDER:
        raise UsageError(f"cannot write {path}: a file stands where a folder of that path should be") from None


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(path: str | Path, what: str = "--output") -> None:
    """``path`` is a folder this process can create files in, or can be created: checked by creating
    (and removing) a file, since permission bits say nothing for root or on a read-only mount."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {path} is a file, not a folder")
    probe = _existing_ancestor(path)
    if not probe.is_dir():
        raise UsageError(f"{what} {path}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".mhar-ablate-write-check-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be written ({e.strerror}): choose a writable folder") from None


def human_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def require_free_space(path: str | Path, needed: int, what: str) -> None:
    """One clear error when the disk that will hold ``path`` has less than ``needed`` bytes free."""
    probe = _existing_ancestor(Path(path))
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise UsageError(f"not enough free space for {what}: it needs about {human_bytes(needed)} on "
                         f"{probe}, which has {human_bytes(free)} free")


def _fsync_dir(folder: Path) -> None:
    # The rename itself must reach the disk too, or a power cut could bring back the old name.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def commit(tmp: Path, path: Path) -> None:
    """Make the finished file ``tmp`` (written by us or by a library) durable and rename it to ``path``;
    on failure ``tmp`` is removed and ``path`` keeps its old contents."""
    try:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        # Some libraries write owner-only files (safetensors: 0600); an output folder shared across users or
        # machines needs the mode every other file of ours gets.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise_if_no_space(e, path)
        raise


# The temporary ``atomic_writer`` makes for ``<folder>/<name>``: ``.<name>.`` + mkstemp's 8 random characters
# (lower-case letters, digits, underscore) + ``.tmp``. Nothing else is taken for one of ours.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")
# A temporary untouched this long has no live writer: a writer renames its file right after writing it
# (fsync, chmod, rename), and while it writes the file's modification time keeps moving.
STALE_TEMPORARY_S = 600.0


def remove_stale_temporaries(folder: str | Path, *, names: Collection[str] | None = None,
                             owned: Collection[str] = (), older_than: float = STALE_TEMPORARY_S) -> list[Path]:
    """Remove what writes killed between ``atomic_writer``'s temporary and its rename left in ``folder``
    (not its subfolders); return the files removed. The rule: a regular file (no link, no folder) whose name
    is ``atomic_writer``'s temporary name of a file ``<name>`` (``names``, where given, limits which), and
    either untouched for ``older_than`` seconds (no live writer, see ``STALE_TEMPORARY_S``) or of a name in
    ``owned``: files whose every writer holds a lock the caller holds now, so no other process writes one.
    A folder that cannot be read or written is left as it is (a read-only study still answers)."""
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        m = _TEMPORARY.fullmatch(entry.name)
        if m is None or (names is not None and m.group("name") not in names):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if m.group("name") not in owned and now - entry.stat(follow_symlinks=False).st_mtime < older_than:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


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
    """Strict JSON: NaN and infinities (a diverged run's loss) are written as the strings "nan",
    "inf" and "-inf", which ``float()`` reads back; JSON itself has no such numbers."""
    write_text(path, json.dumps(finite_json(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def finite_json(o: Any) -> Any:
    """``o`` with tensors and numpy scalars as Python numbers, paths as strings, and every non-finite
    float as its string."""
    if isinstance(o, dict):
        return {str(k): finite_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite_json(v) for v in o]
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item") and not isinstance(o, (str, bytes)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if o is None or isinstance(o, (str, int, float, bool)):
        return o
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
