"""English text that Debian's archive ships, assembled into one corpus (``data.source=debian-en``).

No single package of a registry this package can reach holds 100M tokens of English prose, so the
corpus is a fixed recipe of Debian packages: public-domain books (two Bibles, three commentaries),
dictionaries with definitions (GCIDE, WordNet, FOLDOC, the Jargon File, Bierce), fortunes, and manuals
written as prose (the Linux kernel's, Python's, PostgreSQL's, Perl's, Git's, GIMP's, the Debian
Administrator's Handbook, ...). docs/corpora.md lists every part with its licence and size.

Building fetches each package with ``apt-get download`` (the ordinary client; nothing else touches the
network), reads the ``.deb`` in Python (an ``ar`` archive holding a tar), extracts and cleans the text
of the files its part names, and caches the result per package, verified like every cache file. A
killed build resumes at the next package; a finished one is read from the cache, offline.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import html
import io
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..console import bars_enabled
from ..errors import UsageError
from ..io import raise_if_no_space, write_json
from .cache import CACHE_FORMAT, HashingWriter, digest, ensure_dir, exclusive, read_artifact, write_artifact

# Bump when extraction or cleaning changes: it keys every cached text of this module.
RECIPE_FORMAT = 2
SEPARATOR = "\x00"  # ends each document in a cached text file; cleaning removes NUL from the text
MIN_DOCUMENT_CHARS = 200  # navigation pages, stubs and empty index pages hold less than this
CHUNK_CHARS = 64 << 10  # entries of a dictionary or lines of WordNet are grouped into documents of this size
DOWNLOAD_TIMEOUT_S = 900


@dataclass(frozen=True)
class Part:
    """One Debian package of a recipe: how its files become documents, and which files."""

    package: str
    kind: str  # html | text | pod | dictd | wordnet | sword | fortune
    include: tuple[str, ...]  # fnmatch patterns on member paths inside the package ("*" crosses "/")
    licence: str
    exclude: tuple[str, ...] = ()
    what: str = ""


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    parts: tuple[Part, ...]

    def key(self) -> str:
        return digest({"format": RECIPE_FORMAT, "cache": CACHE_FORMAT, "name": self.name,
                       "parts": [p.__dict__ for p in self.parts]})


_DOC = "usr/share/doc/"
DEBIAN_EN = Recipe(
    name="debian-en",
    description="English prose from Debian 12 packages: public-domain books, dictionaries, prose manuals",
    parts=(
        # Public-domain books (SWORD modules).
        Part("sword-text-kjv", "sword", ("usr/share/sword/*",), "public domain", what="King James Bible"),
        Part("sword-text-web", "sword", ("usr/share/sword/*",), "public domain", what="World English Bible"),
        Part("sword-comm-mhcc", "sword", ("usr/share/sword/*",), "public domain",
             what="Matthew Henry's Concise Commentary"),
        Part("sword-comm-tdavid", "sword", ("usr/share/sword/*",), "public domain",
             what="Spurgeon's Treasury of David"),
        Part("sword-comm-scofield", "sword", ("usr/share/sword/*",), "public domain",
             what="Scofield Reference Notes (1917)"),
        # Dictionaries with definitions.
        Part("dict-gcide", "dictd", ("usr/share/dictd/*.dict.dz",), "GPL-3+",
             what="GNU Collaborative International Dictionary of English (Webster 1913 based)"),
        Part("wordnet-base", "wordnet", ("usr/share/wordnet/data.*",), "WordNet 3.0 licence (BSD-like)",
             what="WordNet 3.0 glosses"),
        Part("dict-foldoc", "dictd", ("usr/share/dictd/*.dict.dz",), "GPL-2+",
             what="Free On-line Dictionary of Computing"),
        Part("dict-jargon", "dictd", ("usr/share/dictd/*.dict.dz",), "public domain", what="The Jargon File 4.4.7"),
        Part("dict-devil", "dictd", ("usr/share/dictd/*.dict.dz",), "public domain",
             what="Bierce, The Devil's Dictionary"),
        Part("fortunes", "fortune", ("usr/share/games/fortunes/*",), "BSD-4-clause and others (see copyright)",
             exclude=("*.dat", "*.u8"), what="fortune cookies"),
        # Manuals written as prose.
        Part("linux-doc-6.1", "text", (_DOC + "linux-doc-6.1/Documentation/*.rst.gz",
                                       _DOC + "linux-doc-6.1/Documentation/*.txt.gz"), "GPL-2",
             what="Linux kernel documentation (reST sources)"),
        Part("python3.11-doc", "text", (_DOC + "python3.11/html/_sources/*.txt",), "PSF-2.0",
             what="Python 3.11 documentation (reST sources)"),
        Part("debian-handbook", "html", (_DOC + "debian-handbook/html/en-US/*.html",), "GPL-2+ or CC-BY-SA-3.0",
             what="The Debian Administrator's Handbook"),
        Part("debian-reference-en", "html", ("*.html",), "GPL-2+", what="Debian Reference"),
        Part("gimp-help-en", "html", ("usr/share/gimp/2.0/help/en/*.html",), "GFDL-1.2+", what="GIMP manual"),
        Part("postgresql-doc-15", "html", ("*.html",), "PostgreSQL licence", what="PostgreSQL 15 manual"),
        Part("perl-doc", "pod", ("*.pod", "*.pod.gz"), "GPL-1+ or Artistic", what="Perl 5.36 documentation"),
        Part("git-doc", "text", (_DOC + "git-doc/*.txt",), "GPL-2", what="Git manual pages and guides (AsciiDoc)"),
        Part("python-django-doc", "html", ("*.html",), "BSD-3-clause", exclude=("*/_modules/*", "*genindex*"),
             what="Django 3.2 documentation"),
        Part("rust-doc", "html", tuple(f"{_DOC}rust-doc/html/{book}/*.html" for book in (
            "book", "reference", "nomicon", "rust-by-example", "edition-guide", "cargo", "rustc", "rustdoc",
            "embedded-book", "unstable-book", "error-index.html")), "MIT or Apache-2.0",
             exclude=("*/print.html", "*/toc.html"), what="Rust books (not the API reference)"),
        Part("octave-doc", "html", ("*.html",), "GPL-3+", what="GNU Octave manual"),
        Part("lilypond-doc-html", "html", ("*.html",), "GFDL-1.3+", exclude=("*.??.html", "*.??_??.html"),
             what="LilyPond manuals (English pages)"),
        Part("libreoffice-help-en-us", "html", ("*.html",), "MPL-2.0", what="LibreOffice help"),
        Part("python-scipy-doc", "html", ("*.html",), "BSD-3-clause", exclude=("*/_modules/*", "*genindex*"),
             what="SciPy 1.10 documentation"),
        Part("openjdk-17-doc", "html", ("*.html",), "GPL-2 with Classpath exception",
             exclude=("*-summary.html", "*index-files*", "*/class-use/*", "*-tree.html"),
             what="Java 17 API documentation"),
    ),
)
RECIPES = {r.name: r for r in (DEBIAN_EN,)}


# --------------------------------------------------------------------------- cleaning

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u200b\ufeff]")
_SPACES = re.compile(r"[ \t\xa0]+")
_BLANKS = re.compile(r"\n{3,}")


def clean(text: str) -> str:
    """Normalised text: NFC, Unix newlines, no control characters, single spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = _CONTROL.sub("", text)
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


class _HtmlText(HTMLParser):
    """The visible text of an HTML page: no script, style, head or navigation; blocks on their own lines."""

    SKIP = frozenset({"script", "style", "head", "nav", "noscript", "svg", "button", "form"})
    BLOCK = frozenset({"p", "div", "br", "li", "ul", "ol", "tr", "table", "pre", "blockquote", "dd", "dt", "dl",
                       "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "header", "footer", "hr", "td",
                       "th", "caption", "figure", "figcaption"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip = 0
        self.pre = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.out.append("\n")
            self.pre += tag == "pre"

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.out.append("\n")
            self.pre -= tag == "pre" and self.pre > 0

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.out.append(data if self.pre else data.replace("\n", " "))


def html_text(raw: str) -> str:
    parser = _HtmlText()
    parser.feed(raw)
    parser.close()
    return clean("".join(parser.out))


_POD_COMMAND = re.compile(r"^=(?:head\d|item|over|back|pod|cut|encoding|for|begin|end)\b ?", re.M)
_POD_CODE = re.compile(r"[BICFSLEXZ]<<+\s(.*?)\s>>+|[BICFSLEXZ]<([^<>]*)>", re.S)
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def pod_text(raw: str) -> str:
    """POD with its commands and formatting codes removed (``B<bold>`` → ``bold``, ``L<text|link>`` → text)."""
    text = _POD_COMMAND.sub("", raw)

    def code(m: re.Match) -> str:
        body = m.group(1) if m.group(1) is not None else m.group(2)
        letter = m.group(0)[0]
        if letter == "E":
            return _POD_ENTITIES.get(body, html.unescape(f"&{body};"))
        if letter in "XZ":
            return ""
        return body.split("|", 1)[0] if letter == "L" else body

    for _ in range(4):  # codes nest (B<C<x>>); each pass removes the innermost level
        text, n = _POD_CODE.subn(code, text)
        if not n:
            break
    return clean(text)


_MARKUP = re.compile(r"<[^<>]*>")


def markup_text(raw: str) -> str:
    """Text with XML-ish markup removed (SWORD's OSIS, ThML and GBF)."""
    return clean(html.unescape(_MARKUP.sub(" ", raw)))


def chunks(pieces: Iterable[str], size: int = CHUNK_CHARS) -> Iterator[str]:
    """Consecutive pieces joined (blank line between) into documents of about ``size`` characters."""
    batch: list[str] = []
    total = 0
    for piece in pieces:
        batch.append(piece)
        total += len(piece)
        if total >= size:
            yield "\n\n".join(batch)
            batch, total = [], 0
    if batch:
        yield "\n\n".join(batch)


# --------------------------------------------------------------------------- reading a .deb

def _ar_members(data: bytes, where: str) -> dict[str, bytes]:
    if not data.startswith(b"!<arch>\n"):
        raise UsageError(f"{where}: not a Debian package (no ar header)")
    members: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise UsageError(f"{where}: corrupt ar member header") from None
        members[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    return members


def _open_tar(name: str, blob: bytes, where: str) -> tarfile.TarFile:
    # Debian's archive compresses with xz (some old packages gzip); Python reads both without a dependency.
    try:
        return tarfile.open(fileobj=io.BytesIO(blob), mode="r:*")
    except tarfile.ReadError:
        raise UsageError(f"{where}: cannot read its {name} (only xz, gzip and bzip2 are supported)") from None


def _tar_of(members: dict[str, bytes], prefix: str, where: str) -> tarfile.TarFile:
    for name, blob in members.items():
        if name.startswith(prefix):
            return _open_tar(name, blob, where)
    raise UsageError(f"{where}: no {prefix}* member")


def deb_version(path: Path) -> str:
    """The package's Version field, read from its control archive."""
    members = _ar_members(path.read_bytes(), str(path))
    with _tar_of(members, "control.tar", str(path)) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.lstrip("./") == "control":
                control = tar.extractfile(m).read().decode("utf-8", "replace")
                found = re.search(r"^Version:\s*(\S+)", control, re.M)
                if found:
                    return found.group(1)
    raise UsageError(f"{path}: its control file has no Version")


def deb_files(path: Path, part: Part) -> Iterator[tuple[str, bytes]]:
    """(member path, bytes) of the regular files of the package that ``part`` names, in sorted path order."""
    members = _ar_members(path.read_bytes(), str(path))
    with _tar_of(members, "data.tar", str(path)) as tar:
        chosen = [m for m in tar.getmembers() if m.isfile() and _wanted(m.name.lstrip("./"), part)]
        for m in sorted(chosen, key=lambda m: m.name):
            yield m.name.lstrip("./"), tar.extractfile(m).read()


def _wanted(name: str, part: Part) -> bool:
    return (any(fnmatch.fnmatchcase(name, p) for p in part.include)
            and not any(fnmatch.fnmatchcase(name, p) for p in part.exclude))


def _decoded(name: str, blob: bytes) -> tuple[str, str]:
    """The file's name without ``.gz`` and its text (UTF-8, else Latin-1, which never fails)."""
    if name.endswith(".gz") or name.endswith(".dz"):
        blob = gzip.decompress(blob)
        name = name[:-3]
    try:
        return name, blob.decode("utf-8")
    except UnicodeDecodeError:
        return name, blob.decode("latin-1")


# --------------------------------------------------------------------------- documents of each kind

def _per_file(convert: Callable[[str], str]) -> Callable[[list[tuple[str, bytes]]], Iterator[str]]:
    def documents(files: list[tuple[str, bytes]]) -> Iterator[str]:
        for name, blob in files:
            yield convert(_decoded(name, blob)[1])
    return documents


def _dictd_documents(files: list[tuple[str, bytes]]) -> Iterator[str]:
    """A dictd ``.dict.dz``: entries in the order of the dictionary, grouped into documents; its own
    header entries (00-database-*) are dropped."""
    for name, blob in files:
        text = _decoded(name, blob)[1]
        entries = (clean(e) for e in re.split(r"\n(?=\S)", text))
        yield from chunks(e for e in entries if e and not e.startswith("00-database") and not e.startswith("00database"))


def _wordnet_documents(files: list[tuple[str, bytes]]) -> Iterator[str]:
    """WordNet's data.noun/verb/adj/adv as ``word, word: gloss`` lines (the licence header is skipped)."""
    for name, blob in files:
        if name.rsplit(".", 1)[-1] not in ("noun", "verb", "adj", "adv"):
            continue
        lines = []
        for line in _decoded(name, blob)[1].splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            cols = fields.split()
            count = int(cols[3], 16)
            words = [cols[4 + 2 * i].replace("_", " ") for i in range(count)]
            words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]
            lines.append(f"{', '.join(words)}: {gloss.strip()}")
        yield from chunks(lines)


def _fortune_documents(files: list[tuple[str, bytes]]) -> Iterator[str]:
    for name, blob in files:
        yield "\n\n".join(clean(f) for f in _decoded(name, blob)[1].split("\n%\n") if f.strip())


def _sword_documents(files: list[tuple[str, bytes]]) -> Iterator[str]:
    """A SWORD zText/zCom module: each compressed block (a book or a chapter) is one document, its
    entries (verses, comments) split by the verse index and freed of markup."""
    by_name = dict(files)
    conf = next((blob.decode("utf-8", "replace") for name, blob in files if name.endswith(".conf")), "")
    if re.search(r"^CompressType=(?!ZIP)", conf, re.M):
        raise UsageError(f"SWORD module {files[0][0]}: only ZIP-compressed modules are supported")
    for name in sorted(by_name):
        if not re.search(r"/(ot|nt)\.[bc]zs$", name):
            continue
        stem = name[:-1]
        index, data, verses = by_name[name], by_name[stem + "z"], by_name.get(stem + "v", b"")
        blocks = [zlib.decompress(data[off:off + size]) for off, size, _ in struct.iter_unpack("<III", index)]
        entries: list[list[str]] = [[] for _ in blocks]
        seen: set[tuple[int, int, int]] = set()  # a comment on a range of verses is linked from each of them
        for block, start, size in _verse_index(verses, blocks, name):
            if size and (block, start, size) not in seen:
                seen.add((block, start, size))
                entry = markup_text(blocks[block][start:start + size].decode("utf-8", "replace"))
                if entry:
                    entries[block].append(entry)
        for block in entries:
            if block:
                yield "\n".join(block)


def _verse_index(verses: bytes, blocks: list[bytes], where: str) -> list[tuple[int, int, int]]:
    """(block, start, size) of each entry. Entries are 10 bytes (32-bit block and start, 16-bit size) or,
    in some modules of the "4" drivers, 12 (a 32-bit size); the ModDrv field does not tell reliably
    (MHCC says zCom4 and has 10), so the layout whose every entry lies inside its block is taken."""
    for fmt in ("<IIH", "<III"):
        width = struct.calcsize(fmt)
        if len(verses) % width:
            continue
        entries = list(struct.iter_unpack(fmt, verses))
        if all(not size or (block < len(blocks) and start + size <= len(blocks[block]))
               for block, start, size in entries):
            return entries
    raise UsageError(f"SWORD module {where}: its verse index fits neither known layout")


KINDS: dict[str, Callable[[list[tuple[str, bytes]]], Iterator[str]]] = {
    "html": _per_file(html_text),
    "text": _per_file(clean),
    "pod": _per_file(pod_text),
    "dictd": _dictd_documents,
    "wordnet": _wordnet_documents,
    "fortune": _fortune_documents,
    "sword": _sword_documents,
}


def part_documents(deb: Path, part: Part) -> Iterator[str]:
    """The cleaned documents of ``part`` in ``deb``: long enough, each once."""
    seen: set[bytes] = set()
    for text in KINDS[part.kind](list(deb_files(deb, part))):
        text = text.replace(SEPARATOR, "")
        if len(text) < MIN_DOCUMENT_CHARS:
            continue
        key = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        if key not in seen:
            seen.add(key)
            yield text


# --------------------------------------------------------------------------- fetching and caching

def apt_download(package: str, dest: Path) -> Path:
    """``apt-get download PACKAGE`` into a fresh folder under ``dest``; the .deb it wrote."""
    apt = shutil.which("apt-get")
    if apt is None:
        raise UsageError("data.source=debian-en needs Debian's apt-get to fetch its packages, and it is not "
                         "installed; build it on a Debian machine and pack it (mhar-ablate corpus pack)")
    work = Path(tempfile.mkdtemp(prefix=f".{package}.", dir=ensure_dir(dest)))
    try:
        try:
            done = subprocess.run([apt, "download", package], cwd=work, capture_output=True, text=True,
                                  timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UsageError(f"data.source=debian-en: apt-get download {package} took over "
                             f"{DOWNLOAD_TIMEOUT_S} s (no network?)") from None
        debs = sorted(work.glob("*.deb"))
        if done.returncode or not debs:
            lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
            reason = lines[-1].strip() if lines else f"exit code {done.returncode}"
            hint = " (run apt-get update first?)" if "Unable to locate" in reason or "no installation candidate" \
                in reason else ""
            raise UsageError(f"data.source=debian-en: apt-get download {package} failed: {reason[:200]}{hint}")
        return debs[0]
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


# The download step, replaceable in tests (which build a fake package instead of reaching a registry).
DOWNLOAD: Callable[[str, Path], Path] = apt_download


def _write_part(out: HashingWriter, deb: Path, part: Part, version: str, deb_sha: str) -> dict[str, Any]:
    documents = text_bytes = 0
    for text in part_documents(deb, part):
        data = (text + SEPARATOR).encode("utf-8")
        out.write(data)
        documents += 1
        text_bytes += len(data) - 1
    return {"package": part.package, "version": version, "deb_sha256": deb_sha, "licence": part.licence,
            "documents": documents, "text_bytes": text_bytes}


def _part_path(root: Path, recipe: Recipe, part: Part) -> Path:
    key = digest({"recipe": recipe.key(), "part": part.__dict__})
    return root / "corpora" / recipe.name / "text" / f"{part.package}-{key[:16]}.txt"


def build_part(root: Path, recipe: Recipe, part: Part) -> dict[str, Any]:
    """The cached text of one package (its manifest), fetching and extracting it if not cached yet."""
    path = _part_path(root, recipe, part)
    manifest = read_artifact(path)
    if manifest is not None:
        return manifest
    with exclusive(path):
        manifest = read_artifact(path)
        if manifest is not None:
            return manifest
        debs = root / "corpora" / recipe.name / "debs"
        deb = DOWNLOAD(part.package, debs)
        try:
            from .cache import file_sha256

            version = deb_version(deb)
            try:
                return write_artifact(path, lambda out: _write_part(out, deb, part, version, file_sha256(deb)))
            except OSError as e:
                raise_if_no_space(e, path)
                raise
        finally:
            # The text is what is kept: a package is fetched again only if its text is lost.
            shutil.rmtree(deb.parent, ignore_errors=True)


def corpus_manifest_path(root: Path, recipe: Recipe) -> Path:
    return root / "corpora" / recipe.name / f"{recipe.name}-{recipe.key()[:16]}.json"


def build_recipe(root: Path, recipe: Recipe) -> dict[str, Any]:
    """Every part's text, built where missing; the corpus manifest (parts, versions, hashes, sizes)."""
    path = corpus_manifest_path(root, recipe)
    try:
        manifest = json.loads(path.read_text())
        if all(read_artifact_fast(root, recipe, p, manifest) for p in recipe.parts):
            return manifest
    except (OSError, ValueError):
        pass
    parts = []
    with tqdm(recipe.parts, desc=f"building {recipe.name}", unit=" packages", file=sys.stderr,
              dynamic_ncols=True, disable=not bars_enabled()) as bar:
        for part in bar:
            bar.set_postfix_str(part.package)
            parts.append(build_part(root, recipe, part))
    manifest = {
        "name": recipe.name, "recipe": recipe.key(), "description": recipe.description,
        "parts": [{k: m[k] for k in ("package", "version", "licence", "documents", "text_bytes", "sha256",
                                     "deb_sha256")} for m in parts],
        "documents": sum(m["documents"] for m in parts), "text_bytes": sum(m["text_bytes"] for m in parts),
    }
    manifest["sha256"] = digest(manifest["parts"])
    write_json(path, manifest)
    return manifest


def read_artifact_fast(root: Path, recipe: Recipe, part: Part, manifest: dict[str, Any]) -> bool:
    """Whether ``part``'s cached text is there with the size the corpus manifest recorded (hashing every
    text on each load would cost seconds; the token cache built from them is verified in full)."""
    path = _part_path(root, recipe, part)
    recorded = {p["package"]: p for p in manifest.get("parts", [])}.get(part.package)
    try:
        part_manifest = json.loads(path.with_name(path.name + ".manifest.json").read_text())
        return (recorded is not None and part_manifest.get("sha256") == recorded["sha256"]
                and path.stat().st_size == part_manifest.get("bytes"))
    except (OSError, ValueError):
        return False


def recipe_documents(root: Path, recipe: Recipe) -> Iterator[str]:
    """The documents of every part, in recipe order, read back from the cached texts."""
    for part in recipe.parts:
        path = _part_path(root, recipe, part)
        with open(path, encoding="utf-8", newline="") as f:
            rest = ""
            while block := f.read(1 << 22):
                pieces = (rest + block).split(SEPARATOR)
                rest = pieces.pop()
                yield from pieces
            if rest:
                yield rest
