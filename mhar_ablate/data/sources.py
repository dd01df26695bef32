"""Where text comes from: the Python standard library, a corpus built from registry packages (debian-en),
local files read with ``datasets``, a packed corpus folder, or the Hub.

A ``Source`` says what a corpus is (its identity, which keys the cache) without reading it, and yields
its documents, in a fixed order, only when a cache has to be built. ``datasets`` is imported only then,
because importing it costs about a second and a warm cache never needs it.
"""

from __future__ import annotations

import itertools
import os
import platform
import re
import socket
import sys
import sysconfig
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config import DataConfig
from ..errors import UsageError
from ..io import raise_if_no_space
from .cache import digest
from .packfile import PACK_MANIFEST, Pack, read_manifest, selection_words

# Which `datasets` builder reads each supported file type; text builders give one document per file.
BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Third-party packages are not part of the standard library (virtual environments are skipped by their
# pyvenv.cfg); __pycache__ holds no sources and is only pruned to save time.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
HUB_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Source:
    """A corpus before it is read: its identity (the cache key), its name, and a way to read it."""

    name: str  # as the user wrote it in data.source, for messages
    slug: str  # a short, file-name-safe name for cache files
    identity: dict[str, Any]  # everything about the source that changes its text
    label_format: str  # formatted with ``documents=`` once the number of documents is known
    documents: Callable[[], Iterator[str]]  # non-empty documents in a fixed order
    size_hint: int | None  # bytes of input, to spread the tokenizer's training sample; None: unknown
    count_hint: int | None  # number of inputs (files), for the progress bar; None: unknown
    version: str = ""  # which release of the text, for the run's provenance (a Python, a package set)
    parts: tuple[dict[str, str], ...] = ()  # registry packages ({package, version, licence}) it was built from
    pack: Any = None  # a packed corpus (pack.Pack) whose tokens and tokenizer are read instead of text

    @property
    def sha256(self) -> str:
        """A hash of the source's identity: equal hashes, equal text."""
        return digest(self.identity)

    def label(self, documents: int) -> str:
        return self.label_format.format(documents=documents)


def resolve_source(cfg: DataConfig, cache_root: Path) -> Source:
    """The source ``cfg.source`` names; ``cache_root`` is skipped when walking a folder that holds it."""
    if cfg.source == "stdlib":
        return stdlib_source()
    from .debian import RECIPES

    if cfg.source in RECIPES:
        return recipe_source(RECIPES[cfg.source], cache_root)
    if (Path(cfg.source) / PACK_MANIFEST).is_file():
        return packed_source(Path(cfg.source))
    if cfg.source.startswith("hub:"):
        return hub_source(cfg.source[len("hub:"):], cfg.text_field, cache_root / "datasets")
    return local_source(Path(cfg.source), cfg.text_field, cache_root / "datasets", exclude=cache_root)


def _literal(text: str) -> str:
    """``text`` escaped for use inside a ``label_format``."""
    return text.replace("{", "{{").replace("}", "}}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:48] or "data"


def _files_identity(root: Path, files: list[Path]) -> str:
    stats = [(p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]]
    return digest(stats)


def read_utf8(path: Path) -> str | None:
    """The file's text, or None when it is not valid UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


# --------------------------------------------------------------------------- the standard library


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Every ``.py`` file of the running Python's standard library, tests included, in sorted path order."""
    root = stdlib_root()
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs
                   if d not in STDLIB_EXCLUDED_DIRS and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_documents(files: list[Path]) -> Iterator[str]:
    for path in files:
        text = read_utf8(path)
        if text:
            yield text


def _python_name() -> str:
    return f"{platform.python_implementation()} {platform.python_version()}".replace("CPython ", "Python ")


def stdlib_source() -> Source:
    root = stdlib_root()
    files = stdlib_files()
    identity = {"kind": "stdlib", "python": sys.version, "root": str(root), "files": _files_identity(root, files)}
    return Source(
        name="stdlib",
        slug="stdlib",
        identity=identity,
        label_format=f"stdlib corpus ({_python_name()} standard library, {{documents:,}} files)",
        documents=partial(_stdlib_documents, files),
        size_hint=sum(p.stat().st_size for p in files),
        count_hint=len(files),
        version=_python_name(),
    )


@dataclass(frozen=True)
class StdlibSummary:
    """What the default corpus is on this machine, for the CLI and the README."""

    python: str
    root: Path
    files: int  # documents: non-empty .py files that are valid UTF-8
    not_utf8: int  # .py files skipped because they are not valid UTF-8
    empty: int  # empty .py files, which hold no document
    bytes: int  # UTF-8 bytes of text in the documents

    @property
    def byte_tokens(self) -> int:
        """Tokens with the byte tokenizer: one per byte plus one end-of-document token per file."""
        return self.bytes + self.files


def stdlib_summary() -> StdlibSummary:
    files = not_utf8 = empty = size = 0
    for path in stdlib_files():
        text = read_utf8(path)
        if text is None:
            not_utf8 += 1
        elif not text:
            empty += 1
        else:
            files += 1
            size += len(text.encode("utf-8"))
    return StdlibSummary(_python_name(), stdlib_root(), files, not_utf8, empty, size)


# --------------------------------------------------------------------------- local files via `datasets`


def _supported(path: Path) -> bool:
    return path.suffix.lower() in BUILDERS


def _list_files(path: Path, exclude: Path) -> list[Path]:
    kinds = ", ".join(BUILDERS)
    if path.is_file():
        if not _supported(path):
            raise UsageError(f"data.source {path}: unsupported file type {path.suffix or '(none)'}; use {kinds}")
        return [path]
    if not path.is_dir():
        raise UsageError(f"data.source: no such file or folder: {path}")
    skip = exclude.resolve()
    found: list[Path] = []
    for folder, dirs, files in os.walk(path):
        # Hidden folders (.git, .venv) and our own cache are not the user's text.
        dirs[:] = [d for d in dirs if not d.startswith(".") and Path(folder, d).resolve() != skip]
        found.extend(Path(folder, f) for f in files if not f.startswith(".") and _supported(Path(f)))
    if not found:
        raise UsageError(f"data.source {path}: the folder holds no {kinds} files")
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence `datasets`' own bars and logs while it reads: our progress bar and errors say enough."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _load_files(builder: str, files: list[Path], datasets_cache: Path, where: Path) -> Any:
    import datasets

    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        with _quiet_datasets():
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                         cache_dir=str(datasets_cache), **options)
    except datasets.exceptions.DatasetsError as e:
        cause = e.__cause__ or e
        if isinstance(cause, OSError):
            raise_if_no_space(cause, datasets_cache)
        reason = " ".join(str(cause).split())[:300] or type(cause).__name__
        if isinstance(cause, datasets.table.CastError):
            reason += " (files read together must have the same columns)"
        raise UsageError(f"data.source {where}: cannot read its {builder} files: {reason}") from None
    except OSError as e:
        raise_if_no_space(e, datasets_cache)
        raise


def _check_text_column(ds: Any, column: str, where: Path | str) -> None:
    import datasets

    feature = ds.features.get(column)
    if feature is None:
        raise UsageError(f"data.source {where}: no column {column!r} (columns: {', '.join(ds.column_names)}); "
                         "set data.text_field")
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise UsageError(f"data.source {where}: column {column!r} holds {feature}, not text; set data.text_field")


def _file_documents(files: list[Path], text_field: str, datasets_cache: Path, where: Path) -> Iterator[str]:
    # Consecutive files of one kind are read together, which keeps sorted path order across kinds.
    for builder, group in itertools.groupby(files, key=lambda p: BUILDERS[p.suffix.lower()]):
        ds = _load_files(builder, list(group), datasets_cache, where)
        column = "text" if builder == "text" else text_field
        _check_text_column(ds, column, where)
        for batch in ds.iter(batch_size=1024):
            yield from (text for text in batch[column] if text)


def local_source(path: Path, text_field: str, datasets_cache: Path, exclude: Path) -> Source:
    files = _list_files(path, exclude)
    root = path if path.is_dir() else path.parent
    only_text = all(BUILDERS[p.suffix.lower()] == "text" for p in files)
    identity = {"kind": "files", "path": str(path.resolve()), "text_field": text_field,
                "files": _files_identity(root, files)}
    return Source(
        name=str(path),
        slug=_slug(path.resolve().stem),
        identity=identity,
        label_format=f"{_literal(str(path))} ({{documents:,}} documents)",
        documents=partial(_file_documents, files, text_field, datasets_cache, path),
        size_hint=sum(p.stat().st_size for p in files),
        count_hint=len(files) if only_text else None,
        version=f"files {identity['files'][:12]}",
    )


# --------------------------------------------------------------------------- the Hub


def _check_hub_reachable(where: str) -> None:
    """Fail in seconds, not after `datasets`' minute of retries, when the Hub cannot be reached."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        raise UsageError(f"data.source {where}: the Hugging Face Hub is switched off "
                         "(HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set); use data.source=stdlib or a local path")
    endpoint = os.environ.get("HF_ENDPOINT") or datasets.config.HF_ENDPOINT
    url = urlparse(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    target = urlparse(proxy) if proxy and not urllib.request.proxy_bypass(url.hostname or "") else url
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as e:
        raise UsageError(f"data.source {where}: the Hugging Face Hub at {endpoint} is unreachable "
                         f"({e.strerror or e}); use data.source=stdlib or a local path") from None


def _hub_documents(name: str, config: str | None, text_field: str, datasets_cache: Path,
                   where: str) -> Iterator[str]:
    import datasets

    _check_hub_reachable(where)
    try:
        with _quiet_datasets():
            # Streaming reads only as much as max_tokens needs; our token cache keeps the result.
            ds = datasets.load_dataset(name, config, split="train", streaming=True, cache_dir=str(datasets_cache))
    except (datasets.exceptions.DatasetsError, ConnectionError, FileNotFoundError, ValueError) as e:
        raise UsageError(f"data.source {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    for row in ds:
        if text_field not in row:
            raise UsageError(f"data.source {where}: no column {text_field!r} (columns: {', '.join(row)}); "
                             "set data.text_field")
        text = row[text_field]
        if isinstance(text, str) and text:
            yield text


def hub_source(spec: str, text_field: str, datasets_cache: Path) -> Source:
    """``hub:NAME`` or ``hub:NAME:CONFIG``, the ``train`` split; identified by name, so a cache works offline."""
    name, _, config = spec.partition(":")
    where = f"hub:{spec}"
    if not name:
        raise UsageError("data.source=hub:NAME needs a dataset name, e.g. hub:roneneldan/TinyStories")
    return Source(
        name=where,
        slug=_slug(f"hub-{name}-{config}" if config else f"hub-{name}"),
        identity={"kind": "hub", "name": name, "config": config or None, "text_field": text_field},
        label_format=f"hub dataset {_literal(spec)} ({{documents:,}} documents)",
        documents=partial(_hub_documents, name, config or None, text_field, datasets_cache, where),
        size_hint=None,
        count_hint=None,
        version=f"hub {name}" + (f":{config}" if config else ""),
    )


# --------------------------------------------------------------------------- a registry recipe (debian-en)


def recipe_source(recipe: Any, cache_root: Path) -> Source:
    """A corpus assembled from registry packages (debian.py): built on first use, then read from the cache."""
    from .debian import build_recipe, recipe_documents

    manifest = build_recipe(cache_root, recipe)
    return Source(
        name=recipe.name,
        slug=recipe.name,
        identity={"kind": "recipe", "name": recipe.name, "recipe": manifest["recipe"], "text": manifest["sha256"]},
        label_format=f"{recipe.name} corpus ({len(manifest['parts'])} Debian packages, {{documents:,}} documents)",
        documents=partial(recipe_documents, cache_root, recipe),
        size_hint=manifest["text_bytes"],
        count_hint=manifest["documents"],
        version=f"{recipe.name} recipe {manifest['recipe'][:12]}, text {manifest['sha256'][:12]}",
        parts=tuple({k: p[k] for k in ("package", "version", "licence")} for p in manifest["parts"]),
    )


def _no_text() -> Any:
    raise UsageError("a packed corpus holds tokens, not text")


def packed_source(path: Path) -> Any:
    manifest = read_manifest(path)
    origin = manifest["origin"]
    return Source(
        name=str(path),
        slug=_slug(f"packed-{origin['source']}"),
        identity={"kind": "packed", "tokens_sha256": manifest["tokens_sha256"], "tokenizer": manifest["tokenizer"]},
        label_format=_literal(f"{origin['label']}, packed: {selection_words(manifest, manifest['tokens'])}") + " ({documents:,} documents)",
        documents=_no_text,
        size_hint=None,
        count_hint=None,
        version=origin["version"],
        parts=tuple(origin.get("parts") or ()),
        pack=Pack(path, manifest),
    )
