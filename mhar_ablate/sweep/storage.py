"""Where a study's Optuna records live, and how every process finds them again.

Three kinds of storage, each used for what it is made for:

- ``sqlite:///<output>/studies.db``: the default for one worker. SQLite has one writer at a time, so
  one process uses a given file: a second ``study`` command on it is told that the study is busy.
- ``journal://<output>/studies.journal``: Optuna's JournalStorage on an append-only file with a lock
  file, the default for several workers on one machine. It has no heartbeat: a worker that died is
  noticed by its process id (same host, process gone), which only holds on one machine.
- ``postgresql://...`` (any other SQLAlchemy URL): Optuna's RDBStorage with its heartbeat, for workers on
  several machines. A worker that dies stops beating; after the grace period the next worker that looks
  fails its trial and Optuna's retry callback queues a copy, which resumes from the run's checkpoint.

``<output>/storages.json`` records, per study, the storage it was created in (any password removed), so
a rerun or ``export`` without ``--storage`` finds it; the local SQLite file and journal are also
searched. Passwords for a recorded server come from ``PGPASSWORD`` or ``~/.pgpass`` (libpq's own).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from ..errors import UsageError

SQLITE_FILE = "studies.db"
JOURNAL_FILE = "studies.journal"
REGISTRY_FILE = "storages.json"
JOURNAL_SCHEME = "journal://"
RETRIES = 3  # times a trial whose worker died is queued again before it stays failed (a rerun retries it too)


def sqlite_url(output: Path) -> str:
    return f"sqlite:///{(output / SQLITE_FILE).resolve()}"


def journal_url(output: Path) -> str:
    return f"{JOURNAL_SCHEME}{(output / JOURNAL_FILE).resolve()}"


def kind(url: str) -> str:
    """sqlite | journal | server"""
    if url.startswith("sqlite"):
        return "sqlite"
    if url.startswith("journal:"):
        return "journal"
    return "server"


def is_local(url: str) -> bool:
    """Storages that only processes of one machine use: a dead worker is noticed by its process id."""
    return kind(url) != "server"


def driver_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 (what ``pip install 'mhar-ablate[postgres]'`` brings) whatever
    SQLAlchemy's default driver for the scheme is (psycopg2 before SQLAlchemy 2.1). An explicit
    ``postgresql+DRIVER://`` is left as given."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def without_password(url: str) -> str:
    """The URL to record in the output folder: never a password (libpq finds it in PGPASSWORD or ~/.pgpass)."""
    if kind(url) != "server":
        return url
    try:
        from sqlalchemy.engine import URL, make_url

        from ..redaction import without_secret_params

        u = make_url(url)  # URL.set(password=None) would keep the password: build the URL anew without it
        return URL.create(u.drivername, u.username, None, u.host, u.port, u.database,
                          without_secret_params(dict(u.query))).render_as_string(hide_password=False)
    except Exception:  # not a URL SQLAlchemy can parse: record nothing secret, only the scheme
        return url.split("://", 1)[0] + "://"


def journal_path(url: str) -> Path:
    return Path(url[len(JOURNAL_SCHEME):] if url.startswith(JOURNAL_SCHEME) else url.split(":", 1)[1])


def open_journal(url: str, create: bool):
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = journal_path(url)
    if not path.parent.is_dir():
        raise UsageError(f"storage folder does not exist: {path.parent}")
    if not create and not path.is_file():
        raise UsageError(f"no study journal at {path} (run `mhar-ablate study NAME --workers N` with this --output first)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except (ValueError, KeyError, TypeError, OSError) as e:  # a line that is not a journal record
        raise UsageError(f"{path} is not an Optuna journal (corrupt or not written by mhar-ablate): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def server_kwargs(heartbeat: int | None) -> dict[str, Any]:
    """Heartbeat settings for a database server: every ``heartbeat`` seconds a running trial's worker
    records that it is alive (a thread inside ``study.optimize``); a trial silent for three intervals is
    failed by the next worker that asks for one, and Optuna's retry callback queues a copy of it."""
    import optuna

    if not heartbeat:
        return {}
    retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    name = "heartbeat_stale_trial_callback"
    if retry_cls is None:  # Optuna < 4.9 names both the class and the argument "failed trial"
        retry_cls, name = optuna.storages.RetryFailedTrialCallback, "failed_trial_callback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental since Optuna 2.8, stable in use
        retry = retry_cls(max_retry=RETRIES, inherit_intermediate_values=True)
    return {"heartbeat_interval": int(heartbeat), "grace_period": 3 * int(heartbeat), name: retry}


def create_rdb(url: str, **kwargs):
    """RDBStorage, tolerating a concurrent first start: two workers creating Optuna's tables in a fresh
    database at the same moment make one of them fail on a unique constraint; the tables then exist."""
    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the heartbeat is marked experimental
                return optuna.storages.RDBStorage(driver_url(url), **kwargs)
        except (IntegrityError, ProgrammingError, OperationalError) as e:
            racing = any(s in str(e).lower() for s in ("unique", "already exists", "duplicate", "database is locked"))
            if not racing or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- finding a study


def _registry(output: Path) -> dict[str, str]:
    try:
        data = json.loads((output / REGISTRY_FILE).read_text())
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def record(output: Path, key: str, url: str) -> None:
    """Remember which storage holds study ``key`` (password removed), for reruns and ``export``.
    The caller holds ``output_lock`` (a second flock from this process would wait for itself)."""
    from ..io import write_json

    reg = _registry(output)
    value = _relative_to(output, url) or without_password(url)
    if reg.get(key) != value:
        reg[key] = value
        write_json(output / REGISTRY_FILE, reg)


def _local_path(url: str) -> Path:
    return journal_path(url) if kind(url) == "journal" else Path(url[len("sqlite:///"):])


def _relative_to(output: Path, url: str) -> str | None:
    """A storage file inside the output folder is recorded relative to it (``sqlite:studies.db``), so a
    copied or moved output folder finds its own database, never the original's."""
    if not is_local(url) or not (url.startswith("sqlite:///") or url.startswith(JOURNAL_SCHEME)):
        return None
    try:
        rel = _local_path(url).resolve().relative_to(output.resolve())
    except ValueError:
        return None
    return f"{kind(url)}:{rel.as_posix()}"


def recorded(output: Path, key: str) -> str | None:
    value = _registry(output).get(key)
    if value and value.startswith(("sqlite:", "journal:")) and not value.startswith(("sqlite:///", JOURNAL_SCHEME)):
        name, rel = value.split(":", 1)
        path = (output / rel).resolve()
        return f"sqlite:///{path}" if name == "sqlite" else f"{JOURNAL_SCHEME}{path}"
    if value and is_local(value) and not _local_path(value).exists():
        return None  # a local file that is gone (a moved output folder): search this folder instead
    return value


def local_candidates(output: Path) -> list[str]:
    """The storages in the output folder that exist, SQLite first."""
    out = []
    if (output / SQLITE_FILE).is_file():
        out.append(sqlite_url(output))
    if (output / JOURNAL_FILE).is_file():
        out.append(journal_url(output))
    return out


# --------------------------------------------------------------------------- locks


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """A short exclusive lock on the output folder around what must not interleave between processes
    of one machine: creating the database tables, creating a study, queueing its grid. (On a shared
    network folder the lock may be unavailable; PostgreSQL then orders concurrent starts itself.)"""
    output.mkdir(parents=True, exist_ok=True)
    fd = os.open(output / ".mhar-ablate.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
        yield
    finally:
        os.close(fd)  # closing releases the lock


def hold_exclusive(path: Path, what: str) -> int:
    """Hold a lock for this process's lifetime, or raise "busy" in one line if another process has it.
    Used for SQLite, which one process at a time can write. Returns the descriptor (kept open)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UsageError(f"{what} is busy: {holder} is running it with one worker on SQLite; wait for it to finish, "
                         "or stop it and run `study ... --workers N` (several workers share a journal)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"mhar-ablate pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return fd


# --------------------------------------------------------------------------- workers that died


def process_start(pid: int) -> str | None:
    """A process's start time (clock ticks after boot, from /proc): with the pid it names one process,
    so a pid reused by an unrelated program later is not taken for the worker. None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_attrs() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": process_start(pid)}


def owner_alive(attrs: dict[str, Any]) -> bool | None:
    """Whether the process recorded in a trial's attributes still runs: None if it ran on another host
    (only a heartbeat can tell then)."""
    if attrs.get("host") != socket.gethostname():
        return None
    pid = attrs.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = attrs.get("pid_start")
    return start is None or process_start(pid) in (None, start)


UNOWNED_GRACE_S = 120.0  # a RUNNING trial that never named its worker: popped by a process killed at once
COPY_GRACE_S = 10.0  # time a worker has to name itself on a retry copy it took (it does so at once)


def reap_dead(study, retry=None) -> list[int]:
    """Fail the RUNNING trials whose worker process on this host is gone, and queue a copy of each
    (Optuna's retry callback, the same one the heartbeat uses), so that another worker resumes the point
    from its checkpoint. Public API only: ``study.tell`` by trial number, ``study.add_trial`` through the
    callback. Returns the numbers of the trials reaped."""
    import datetime

    import optuna
    from optuna.trial import TrialState

    retry = retry or _retry_callback()
    reaped = []
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        age = (now - t.datetime_start).total_seconds() if t.datetime_start is not None else float("inf")
        if "failed_trial" in t.system_attrs and age < COPY_GRACE_S:
            continue  # a retry copy carries its dead predecessor's pid until the worker that took it writes its own
        alive = owner_alive(t.user_attrs)
        if alive is None and "pid" not in t.user_attrs:
            alive = age < UNOWNED_GRACE_S
        if alive is not False:
            continue
        try:
            frozen = study.tell(t.number, state=TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            continue  # another process reaped or finished it first
        retry(study, frozen)
        reaped.append(t.number)
    return reaped


def _retry_callback():
    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(max_retry=RETRIES, inherit_intermediate_values=True)


def fail_stale(study) -> None:
    """Optuna's own check for trials whose heartbeat stopped (a no-op without a heartbeat)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
