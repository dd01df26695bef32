"""The debian-en corpus pipeline on a fake Debian package built here: download (mocked), extraction,
cleaning, caching, the BPE's cache, the pack for an offline machine, and what a run records."""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import stat
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from mhar_ablate.config import DataConfig
from mhar_ablate.data import debian, load_corpus
from mhar_ablate.data import corpus as corpus_module
from mhar_ablate.data.debian import Part, Recipe
from mhar_ablate.data.pack import main as pack_main
from mhar_ablate.data.pack import pack_corpus
from mhar_ablate.errors import UsageError

PROSE = ("The quick brown fox jumps over the lazy dog while the patient reader follows every line of this "
         "sentence, which with the next one is long enough to count as a document of natural English prose. "
         "A second sentence adds the words that a document needs before the cleaner keeps it.")


def _tar(files: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_deb(path: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A Debian package as dpkg-deb writes it: an ar archive of debian-binary, control and data tars."""
    control = f"Package: {package}\nVersion: {version}\nArchitecture: all\n".encode()
    members = [("debian-binary", b"2.0\n"), ("control.tar.gz", _tar({"control": control}, "w:gz")),
               ("data.tar.xz", _tar(files, "w:xz"))]
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    path.write_bytes(bytes(out))
    return path


def sword_module(verses: list[str]) -> dict[str, bytes]:
    """A zText module of one block: the .bzs block index, the zlib block and the .bzv verse index."""
    text = "".join(f"<verse>{v}</verse>" for v in verses).encode()
    block = zlib.compress(text)
    index = struct.pack("<III", 0, len(block), len(text))
    entries, pos = [struct.pack("<IIH", 0, 0, 0)], 0  # an empty introduction entry, as modules have
    for v in verses:
        size = len(f"<verse>{v}</verse>".encode())
        entries.append(struct.pack("<IIH", 0, pos, size))
        pos += size
    base = "usr/share/sword/modules/texts/ztext/fake/"
    return {"usr/share/sword/mods.d/fake.conf": b"[Fake]\nModDrv=zText\nCompressType=ZIP\n",
            base + "nt.bzs": index, base + "nt.bzz": block, base + "nt.bzv": b"".join(entries)}


FAKE_FILES = {
    "fake-html": {
        "usr/share/doc/fake/a.html": (f"<html><head><title>T</title><script>var x = 1;</script></head><body>"
                                      f"<nav>Prev Next</nav><h1>Title</h1><p>{PROSE}</p><p>{PROSE}&amp; more</p>"
                                      f"</body></html>").encode(),
        "usr/share/doc/fake/short.html": b"<p>too short</p>",
        "usr/share/doc/fake/copy.html": (f"<html><body><h1>Title</h1><p>{PROSE}</p><p>{PROSE}&amp; more</p>"
                                         f"</body></html>").encode(),  # same text as a.html: kept once
        "usr/share/doc/fake/fr.fr.html": f"<p>{PROSE}</p>".encode(),  # excluded
    },
    "fake-text": {"usr/share/doc/fake/guide.rst.gz": gzip.compress(f"Guide\r\n=====\r\n\r\n\r\n\r\n{PROSE}\x07".encode())},
    "fake-pod": {"usr/share/perl/pod/perlfake.pod": f"=head1 NAME\n\nB<perlfake> - I<fake> C<L<docs|perlfunc>>\n\n{PROSE}\n\n=cut\n".encode()},
    "fake-dict": {"usr/share/dictd/fake.dict.dz": gzip.compress(
        f"00-database-info\n  header\nfox\n  {PROSE}\ndog\n  {PROSE}\n".encode())},
    "fake-wordnet": {"usr/share/wordnet/data.noun": (
        b"  1 This software and database is being provided\n"
        b"00001740 03 n 02 entity 0 thing(a) 0 000 | " + PROSE.encode() + b"\n")},
    "fake-sword": sword_module([PROSE, "And the second verse " + PROSE]),
}

FAKE = Recipe("debian-en", "a fake recipe for tests", (
    Part("fake-html", "html", ("usr/share/doc/fake/*.html",), "public domain", exclude=("*.??.html",)),
    Part("fake-text", "text", ("*.rst.gz",), "GPL-2"),
    Part("fake-pod", "pod", ("*.pod",), "Artistic"),
    Part("fake-dict", "dictd", ("*.dict.dz",), "GPL-3+"),
    Part("fake-wordnet", "wordnet", ("usr/share/wordnet/data.*",), "WordNet"),
    Part("fake-sword", "sword", ("usr/share/sword/*",), "public domain"),
))


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """debian-en is the fake recipe; its download writes the fake package and counts the calls."""
    calls: list[str] = []

    def download(package: str, dest: Path) -> Path:
        calls.append(package)
        folder = dest / f".{package}.dl"
        folder.mkdir(parents=True)
        return make_deb(folder / f"{package}_1.0-1_all.deb", package, "1.0-1", FAKE_FILES[package])

    monkeypatch.setattr(debian, "DOWNLOAD", download)
    monkeypatch.setitem(debian.RECIPES, "debian-en", FAKE)
    monkeypatch.delenv("MHAR_ABLATE_CACHE", raising=False)
    corpus_module._LOADED.clear()
    return calls


def test_cleaning():
    assert debian.clean("a\r\n\r\n\r\n\r\nb\x07  c\ufeff ") == "a\n\nb c"
    text = debian.html_text("<head><style>x{}</style></head><p>one\ntwo</p><script>no()</script><pre>a\n b</pre>")
    assert text == "one two\n\na\nb"
    assert debian.pod_text("=head1 NAME\n\nB<bold> I<C<code>> L<text|link> E<lt>x E<gt>\n=cut") == \
        "NAME\n\nbold code text <x >"
    assert debian.markup_text("<w lemma='x'>In</w> the &amp; <note>beginning</note>") == "In the & beginning"


def test_build_extracts_cleans_and_caches(tmp_path, fake_registry):
    cfg = DataConfig(source="debian-en", tokenizer="bpe", vocab_size=300)
    cfg.validate()  # debian-en is a known source name, not a path
    first = load_corpus(cfg, tmp_path / "cache")
    assert fake_registry == [p.package for p in FAKE.parts]
    docs = list(debian.recipe_documents(tmp_path / "cache", FAKE))
    html, text, pod, dict1, word, sword = docs
    assert html.startswith("Title\n\nThe quick") and "var x" not in html and "Prev" not in html and "& more" in html
    assert text.startswith("Guide\n=====\n\nThe quick") and "\x07" not in text
    assert pod.startswith("NAME\n\nperlfake - fake docs\n\nThe quick")
    assert dict1.startswith("fox\nThe quick") and "00-database" not in dict1 and "\ndog\nThe quick" in dict1
    assert word.startswith("entity, thing: The quick") and "software" not in word
    assert sword == PROSE.strip() + "\nAnd the second verse " + PROSE.strip()

    info = first.info
    assert not info.from_cache and info.documents == 6 and info.tokenizer == "bpe"
    assert info.tokens == len(first.train) + len(first.val)
    assert first.tokenizer.decode(first.train[: first.train.tolist().index(first.tokenizer.eos_id)]) == html
    prov = info.provenance()
    assert prov["source"] == "debian-en" and prov["tokens"] == info.tokens and prov["packed"] is None
    assert [p["version"] for p in prov["source_parts"]] == ["1.0-1"] * 6
    assert prov["source_parts"][0] == {"package": "fake-html", "version": "1.0-1", "licence": "public domain"}
    assert prov["tokenizer"]["kind"] == "bpe" and len(prov["tokenizer"]["sha256"]) == 64
    assert prov["source_sha256"] and "recipe" in prov["source_version"]
    json.dumps(prov)  # goes into result.json as it is
    assert list((tmp_path / "cache" / "tokenizers").glob("debian-en-bpe300-*.json"))
    assert not list((tmp_path / "cache").rglob("*.deb"))  # the text is kept, not the packages

    corpus_module._LOADED.clear()
    again = load_corpus(cfg, tmp_path / "cache")
    assert again.info.from_cache and fake_registry == [p.package for p in FAKE.parts]  # nothing fetched again
    assert again.info.provenance() == {**prov}
    assert again.tokenizer.sha256 == first.tokenizer.sha256


def test_build_resumes_after_a_failure(tmp_path, fake_registry, monkeypatch):
    real = debian.DOWNLOAD

    def failing(package: str, dest: Path) -> Path:
        if package == "fake-wordnet":
            raise UsageError("data.source=debian-en: apt-get download fake-wordnet failed: no network")
        return real(package, dest)

    monkeypatch.setattr(debian, "DOWNLOAD", failing)
    with pytest.raises(UsageError, match="no network"):
        load_corpus(DataConfig(source="debian-en"), tmp_path / "cache")
    assert fake_registry == ["fake-html", "fake-text", "fake-pod", "fake-dict"]
    monkeypatch.setattr(debian, "DOWNLOAD", real)
    load_corpus(DataConfig(source="debian-en"), tmp_path / "cache")
    assert fake_registry[4:] == ["fake-wordnet", "fake-sword"]  # the packages done before are not fetched again


def test_missing_client_and_failed_download(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="needs Debian's apt-get .* not installed"):
        debian.apt_download("dict-gcide", tmp_path / "debs")
    apt = tmp_path / "apt-get"
    apt.write_text("#!/bin/sh\necho 'Reading package lists...'\necho 'E: Unable to locate package nope' >&2\nexit 100\n")
    apt.chmod(apt.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(UsageError) as e:
        debian.apt_download("nope", tmp_path / "debs")
    assert str(e.value) == ("data.source=debian-en: apt-get download nope failed: E: Unable to locate package nope "
                            "(run apt-get update first?)")
    assert "\n" not in str(e.value)
    assert not [p for p in (tmp_path / "debs").iterdir()]  # no half-downloaded folder is left


def test_not_a_deb(tmp_path):
    bad = tmp_path / "x.deb"
    bad.write_bytes(b"hello")
    with pytest.raises(UsageError, match="not a Debian package"):
        list(debian.deb_files(bad, FAKE.parts[0]))


def test_pack_is_read_offline_with_its_tokenizer(tmp_path, fake_registry, monkeypatch, capsys):
    cfg = DataConfig(source="debian-en", tokenizer="bpe", vocab_size=300)
    built = load_corpus(cfg, tmp_path / "cache")
    assert "\r" not in capsys.readouterr().err  # off a terminal the build draws no bar frames into the log
    stream = np.concatenate([built.train, built.val])
    out = tmp_path / "pack"
    m = pack_corpus(cfg, tmp_path / "cache", out, tokens=len(stream) - 5)
    eos = built.tokenizer.eos_id
    assert m["tokens"] < len(stream) - 5 and stream[m["tokens"] - 1] == eos  # cut at a document's end
    assert m["documents"] == 5 and sorted(os.listdir(out)) == ["mhar-corpus.json", "tokenizer.json", "tokens.bin.xz"]
    assert np.array_equal(np.frombuffer(lzma.decompress((out / "tokens.bin.xz").read_bytes()), dtype=stream.dtype),
                          stream[: m["tokens"]])

    # Another machine: no registry, an empty cache; the pack is all it has.
    monkeypatch.setattr(debian, "DOWNLOAD", lambda *a: pytest.fail("a pack must not fetch anything"))
    corpus_module._LOADED.clear()
    packed_cfg = DataConfig(source=str(out), tokenizer="bpe", vocab_size=300)
    packed_cfg.validate()
    got = load_corpus(packed_cfg, tmp_path / "gpu-cache")
    assert np.array_equal(np.concatenate([got.train, got.val]), stream[: m["tokens"]])
    assert got.tokenizer.sha256 == built.tokenizer.sha256 and got.info.documents == 5
    prov = got.info.provenance()
    assert prov["source"] == "debian-en" and prov["source_sha256"] == built.info.provenance()["source_sha256"]
    assert prov["packed"]["tokens"] == m["tokens"] and prov["packed"]["of_tokens"] == len(stream)
    assert prov["tokenizer"] == built.info.provenance()["tokenizer"]
    with pytest.raises(UsageError, match="packed with data.tokenizer=bpe, not byte"):
        load_corpus(DataConfig(source=str(out), tokenizer="byte"), tmp_path / "gpu-cache")
    with pytest.raises(UsageError, match="packed with data.vocab_size=300, not 4096"):
        load_corpus(DataConfig(source=str(out), tokenizer="bpe"), tmp_path / "gpu-cache")
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(UsageError, match="does not match its recorded hash"):
        load_corpus(packed_cfg, tmp_path / "other-cache")


def test_spread_pack_draws_from_every_part_of_the_corpus(tmp_path, fake_registry):
    """A spread pack holds pieces from the whole stream (its first packages and its last), each closed by
    the end-of-document id, in the seeded order; the same seed packs the same tokens."""
    cfg = DataConfig(source="debian-en", tokenizer="bpe", vocab_size=300)
    built = load_corpus(cfg, tmp_path / "cache")
    stream = np.concatenate([built.train, built.val])
    eos = built.tokenizer.eos_id
    n = len(stream) // 2
    m = pack_corpus(cfg, tmp_path / "cache", tmp_path / "a", tokens=n, spread=4, seed=1)
    got = np.frombuffer(lzma.decompress((tmp_path / "a" / "tokens.bin.xz").read_bytes()), dtype=stream.dtype)
    assert m["selection"] == {"kind": "spread", "segments": 4, "seed": 1} and m["tokens"] == len(got) <= n
    pieces = np.split(got, np.flatnonzero(got == eos) + 1)[:-1]
    each = n // 4 - 1
    starts = [(i * len(stream)) // 4 for i in range(4)]
    # Every part's first tokens are in the pack, so the corpus's last package is in it too.
    for start in starts:
        head = stream[start:start + min(8, each)]
        assert any(np.array_equal(p[:len(head)], head) for p in pieces)
    again = pack_corpus(cfg, tmp_path / "cache", tmp_path / "b", tokens=n, spread=4, seed=1)
    assert again["tokens_sha256"] == m["tokens_sha256"]
    with pytest.raises(UsageError, match="too few for --spread"):
        pack_corpus(cfg, tmp_path / "cache", tmp_path / "c", tokens=8, spread=8)


def test_pack_command_errors(tmp_path, capsys, fake_registry):
    assert pack_main([str(tmp_path / "p"), "--tokens", "lots", "--cache", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == "error: --tokens: not a count: 'lots' (e.g. 24000000 or 24M)\n"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert pack_main([str(tmp_path / "full"), "--tokenizer", "byte", "--cache", str(tmp_path / "c")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert pack_main([str(tmp_path / "ok"), "--tokenizer", "byte", "--cache", str(tmp_path / "c")]) == 0
    assert "packed " in capsys.readouterr().out


def test_pack_command_of_the_cli_writes_a_spread_pack_under_its_output(tmp_path, capsys, fake_registry):
    from mhar_ablate.cli import main

    out = tmp_path / "pack"
    assert main(["pack", str(out), "--tokenizer", "byte", "--tokens", "2k", "--spread", "3",
                 "--output", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert f"train on it with: data.source={out} data.tokenizer=byte" in printed
    manifest = json.loads((out / "mhar-corpus.json").read_text())
    assert manifest["selection"]["kind"] == "spread" and (tmp_path / "o" / "cache").is_dir()
    assert main(["pack", str(out), "--tokenizer", "byte", "--output", str(tmp_path / "o")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_run_provenance_records_machine_and_diff():
    from mhar_ablate.provenance import environment

    env = environment()
    assert set(env["machine"]) == {"hostname", "cpu", "cpu_cores", "gpus", "cuda_driver"}
    assert env["machine"]["cpu_cores"] == os.cpu_count()
    if env["git_dirty"]:
        assert len(env["git_diff_sha256"]) == 64
    else:
        assert env["git_diff_sha256"] is None
