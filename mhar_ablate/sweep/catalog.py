"""Where a study lives: its storage URL and folder, opening a stored study, checking that it is readable and
compatible with this invocation, and finding the studies of a name for ``export``, ``eval`` and
``tensorboard``. Paths in the database are relative to the output folder, so a copied or moved output
folder is self-contained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import __version__
from . import storage as st
from ..config import BUDGETS
from ..errors import UsageError
from ..provenance import describe_differences, differences, environment
from ..redaction import redact, register
from .definition import STUDY_FORMAT, StudyRun


# --------------------------------------------------------------------------- storage


def storage_url(output: Path, storage: str | None) -> str:
    if storage:
        return storage
    return st.sqlite_url(output)


def study_folder(output: Path, study, name: str) -> Path:
    """Where a study's runs and exports live: always under ``output`` (the folder recorded in the
    database is not trusted, so exporting a copied study cannot write into the original)."""
    attrs = study.user_attrs
    recorded, budget = str(attrs.get("study") or ""), str(attrs.get("budget") or "")
    safe = lambda part: bool(part) and Path(part).name == part and part not in (".", "..")
    return output / "studies" / (recorded if safe(recorded) else Path(name).stem) / (budget if safe(budget) else "")


def under_output(output: Path, recorded: str | None, default: Path) -> Path:
    """A run folder recorded in the database: relative to the output folder (an absolute one, written
    before paths were relative, may point into another copy of the study and is not used)."""
    if recorded and not Path(recorded).is_absolute() and ".." not in Path(recorded).parts:
        return output / recorded
    return default


def open_storage(url: str, create: bool, heartbeat: int | None = None):
    """An Optuna storage, or one clear UsageError for a missing folder, a corrupt file or a dead server.
    ``heartbeat`` (seconds) applies to database servers only: see ``storage.server_kwargs``."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    register(url)  # from here on its secrets are masked everywhere, library log lines included
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if st.kind(url) == "journal":
        return st.open_journal(url, create)
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if not create and not path.is_file():
            raise UsageError(f"no study database at {path} (run `mhar-ablate study NAME` with this --output first)")
        if not path.parent.is_dir():
            raise UsageError(f"storage folder does not exist: {path.parent}")
        if path.is_file() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise UsageError(f"{path} is not an SQLite database (corrupt or not written by mhar-ablate)")
    try:
        return st.create_rdb(url, **(st.server_kwargs(heartbeat) if st.kind(url) == "server" else {}))
    except (SQLAlchemyError, RuntimeError, ValueError, ImportError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = " (pip install 'mhar-ablate[postgres]' brings the PostgreSQL driver)" if isinstance(e, ImportError) else ""
        raise UsageError(f"cannot open study storage {redact(url)}: {redact(msg)}{hint}") from None


def check_readable(study, url: str) -> None:
    """Every attribute and trial of ``study`` can be read: a database edited by hand or damaged is one
    clear error, here, not a traceback in the middle of a run or an export."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        _ = study.user_attrs
        for t in study.get_trials(deepcopy=False):
            _ = t.user_attrs, t.params
    except (ValueError, TypeError, KeyError, AttributeError, SQLAlchemyError) as e:
        raise corrupt(study.study_name, url, e) from None


def corrupt(name: str, url: str, e: Exception) -> UsageError:
    first = (str(e).splitlines() or [type(e).__name__])[0][:160]
    return UsageError(f"study {name} in {redact(url)} cannot be read: an attribute or a trial is corrupt "
                      f"({redact(first)}); restore the database from a copy, or use another --output folder")


def check_compatible(study, fingerprint: str | None, key: str, seeds: int | None = None) -> None:
    attrs = study.user_attrs
    fmt = attrs.get("format")
    if fmt is not None and fmt != STUDY_FORMAT:
        raise UsageError(f"study {key} was written by mhar-ablate {attrs.get('version', '?')} (study format {fmt}); "
                         f"this is {__version__} (format {STUDY_FORMAT}): use a new --output folder")
    if fingerprint and attrs.get("fingerprint") not in (None, fingerprint):
        raise UsageError(f"study {key} already exists in this output folder with a different configuration; "
                         "rerun with the same options, or use another --output folder")
    stored = attrs.get("seeds")
    if seeds is not None and stored is not None and seeds < stored and study.get_trials(deepcopy=False):
        # More seeds grow the grid (points.py); fewer would leave trained seeds out of its tables.
        raise UsageError(f"study {key} was run with {stored} seed(s) per arm; --seeds {seeds} would drop some: "
                         f"rerun with --seeds {stored} or more, or use another --output folder")


def check_environment(study, sr: "StudyRun") -> list[tuple[str, Any, Any]]:
    """Refuse to continue a study under other library versions than it ran with, unless allowed;
    return the differences (empty when none)."""
    diffs = differences(study.user_attrs.get("environment"), environment())
    if diffs and not sr.allow_version_change:
        old, new = describe_differences(diffs)
        raise UsageError(f"study {sr.key} was run under {old}; this environment has {new}: rerun with "
                         "--allow-version-change to continue it under these versions (each trial records its own), "
                         "or use another --output folder")
    return diffs


def _has_study(url: str, key: str) -> bool:
    import optuna

    try:
        return key in {s.study_name for s in optuna.get_all_study_summaries(open_storage(url, create=False),
                                                                             include_best_trial=False)}
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot read study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None


def find_storage(output: Path, key: str, given: str | None) -> str | None:
    """The storage that holds study ``key``: ``--storage`` when given; else the one recorded in the
    output folder when the study was created; else a local SQLite file or journal that has it."""
    if given:
        return given
    recorded = st.recorded(output, key)
    if recorded:
        return recorded
    for url in st.local_candidates(output):
        if _has_study(url, key):
            return url
    return None


def choose_storage(sr: "StudyRun", workers: int) -> str:
    """Where this run's study lives: the existing one if any, else SQLite for one worker and the
    journal for several (SQLite serves one writer at a time). Called under the output lock."""
    url = find_storage(sr.output, sr.key, sr.storage)
    if url is None:
        url = st.journal_url(sr.output) if workers > 1 else st.sqlite_url(sr.output)
    if workers > 1 and st.kind(url) == "sqlite":
        where = "--storage" if sr.storage else f"{sr.output / st.SQLITE_FILE}"
        raise UsageError(f"study {sr.key} is in SQLite ({where}), which one worker writes at a time: run it without "
                         "--workers, or give --storage postgresql://... (several workers on one machine use a journal "
                         "file when the study is new)")
    return url


def load_studies(output: Path, name: str, budget: str | None, storage: str | None) -> list[Any]:
    """The Optuna studies of ``name`` in ``output`` (one per budget that was run), wherever the workers
    kept them: ``--storage`` if given, else the storage recorded in the output folder, else a local
    SQLite file or journal that holds them."""
    import optuna

    budgets = [budget] if budget else list(BUDGETS)
    if not storage and not st.local_candidates(output) and not any(st.recorded(output, f"{name}-{b}") for b in budgets):
        open_storage(st.sqlite_url(output), create=False)  # raises: no study database here
    found, names = [], set()
    for b in budgets:
        key = f"{name}-{b}"
        url = find_storage(output, key, storage)
        if url is None:
            continue
        st_obj = open_storage(url, create=False)
        try:
            have = {s.study_name for s in optuna.get_all_study_summaries(st_obj, include_best_trial=False)}
        except json.JSONDecodeError as e:  # an attribute that is not JSON
            raise corrupt(key, url, e) from None
        except Exception as e:
            raise UsageError(f"cannot read study storage {redact(url)}: {redact(str(e).splitlines()[0])}") from None
        names |= have
        if key in have:
            found.append(optuna.load_study(study_name=key, storage=st_obj))
    if not found:
        for url in st.local_candidates(output):
            try:
                names |= {s.study_name for s in optuna.get_all_study_summaries(open_storage(url, create=False),
                                                                               include_best_trial=False)}
            except Exception:
                pass
        have = sorted({n.rsplit("-", 1)[0] for n in names if "-tune-" not in n})
        raise UsageError(f"no study {name!r}{' with --budget ' + budget if budget else ''} in {output}"
                         + (f" (found: {', '.join(have)})" if have else " (run `mhar-ablate study NAME` first)"))
    for s in found:
        check_readable(s, find_storage(output, s.study_name, storage) or "")
        check_compatible(s, None, s.study_name)
    return found
