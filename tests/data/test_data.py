"""The data layer: fixed validation, seed-only training order, loading, the cache and its failure modes."""

from __future__ import annotations

import errno
import json
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mhar_ablate.config import DataConfig
from mhar_ablate.data import CACHE_ENV, TokenDataModule, load_corpus, stdlib_summary, validation_windows
from mhar_ablate.data import cache as cache_mod
from mhar_ablate.data import corpus as corpus_mod
from mhar_ablate.errors import UsageError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """No developer cache, and a fresh in-process memo, so each test reads what it wrote."""
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setattr(corpus_mod, "_LOADED", {})


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "\n"


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(20):
        (folder / f"doc{i:02d}.txt").write_text(words(i, 400))
    return folder


def module(folder: Path, cache: Path, seed: int = 0, batch_size: int = 4, seq_len: int = 16,
           **data) -> TokenDataModule:
    cfg = DataConfig(source=str(folder), **{"val_fraction": 0.1, **data})
    dm = TokenDataModule(cfg, seq_len=seq_len, batch_size=batch_size, seed=seed, cache_dir=cache, eval_batches=None)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def documents(cfg: DataConfig, cache: Path) -> list[str]:
    """The whole token stream decoded and cut at the byte tokenizer's end-of-document id."""
    c = load_corpus(cfg, cache)
    stream = np.concatenate([c.train, c.val])
    return c.tokenizer.decode(stream.tolist()).split("\0")[:-1]


def test_validation_is_identical_across_seeds_and_arms(text_folder, tmp_path):
    a = module(text_folder, tmp_path / "cache", seed=0, batch_size=4)
    b = module(text_folder, tmp_path / "cache", seed=123, batch_size=8)  # another arm's batch size
    assert np.array_equal(a.val_windows, b.val_windows)
    xa = torch.cat([x for x, _ in a.val_dataloader()])
    xb = torch.cat([x for x, _ in b.val_dataloader()])
    assert torch.equal(xa, xb) and xa.dtype == torch.int64
    # The windows come from the held-out tail, after every training token.
    corpus = a.corpus
    held_out = np.asarray(corpus.val, dtype=np.int64)
    for w in a.val_windows:
        assert any(np.array_equal(held_out[s:s + len(w)], w) for s in range(len(held_out) - len(w) + 1))
    assert corpus.info.train_tokens + corpus.info.val_tokens == corpus.info.tokens


def test_validation_windows_are_evenly_spaced_and_disjoint():
    w = validation_windows(np.arange(1000), seq_len=9, max_sequences=50)
    starts = w[:, 0]
    assert w.shape == (50, 10) and starts[0] == 0 and starts[-1] == 990
    assert np.all(np.diff(starts) >= 10)
    assert np.array_equal(w, starts[:, None] + np.arange(10))
    assert len(validation_windows(np.arange(1000), seq_len=9, max_sequences=500)) == 100


def test_val_dataloader_is_fixed_and_capped(text_folder, tmp_path):
    cfg = DataConfig(source=str(text_folder), val_fraction=0.1)
    dm = TokenDataModule(cfg, seq_len=16, batch_size=4, seed=0, cache_dir=tmp_path, eval_batches=2)
    dm.setup()
    batches = list(dm.val_dataloader())
    assert len(batches) == 2 and all(x.shape == (4, 16) for x, _ in batches)
    assert np.array_equal(dm.val_windows, validation_windows(dm.corpus.val, 16, 8))  # spread, not a prefix
    for (x, y), (x2, y2) in zip(batches, dm.val_dataloader(), strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_training_batch_depends_only_on_seed_and_step(text_folder, tmp_path):
    a = module(text_folder, tmp_path, seed=3)
    b = module(text_folder, tmp_path, seed=3, val_sequences=5)  # validation settings do not move training
    later_first = b.batch_at(5)
    for x, y in (a.batch_at(5), later_first):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(a.batch_at(5)[0], later_first[0]) and torch.equal(a.batch_at(5)[1], later_first[1])
    assert not torch.equal(a.batch_at(5)[0], a.batch_at(6)[0])
    assert not torch.equal(a.batch_at(5)[0], module(text_folder, tmp_path, seed=4).batch_at(5)[0])


def test_resume_at_start_step_sees_the_uninterrupted_batches(text_folder, tmp_path):
    whole = module(text_folder, tmp_path, seed=1)
    stream = iter(whole.train_dataloader())
    uninterrupted = [next(stream) for _ in range(7)]
    resumed = module(text_folder, tmp_path, seed=1)
    loader = resumed.train_dataloader()
    resumed.start_step = 4  # read when iteration starts, as after Lightning restores a checkpoint
    stream = iter(loader)
    for (x, y), (ux, uy) in zip((next(stream) for _ in range(3)), uninterrupted[4:], strict=True):
        assert torch.equal(x, ux) and torch.equal(y, uy)


def test_loads_every_file_kind_in_sorted_path_order(tmp_path):
    data = tmp_path / "mixed"
    (data / "sub").mkdir(parents=True)
    (data / ".hidden").mkdir()
    (data / "a.txt").write_text("plain text\nsecond line\n")
    (data / "b.md").write_text("# Title\n\nmarkdown body")
    (data / "c.jsonl").write_text('{"text": "json line one", "n": 0}\n{"text": "", "n": 1}\n'
                                  '{"text": "json line two", "n": 2}\n')
    (data / "d.json").write_text(json.dumps([{"text": "array one", "n": 1}, {"text": "array two", "n": 2}]))
    pd.DataFrame({"text": ["parquet one", None, "parquet two"]}).to_parquet(data / "e.parquet")
    (data / "notes.csv").write_text("text\nignored\n")
    (data / ".hidden" / "x.txt").write_text("ignored")
    (data / "sub" / "f.txt").write_text("nested")
    assert documents(DataConfig(source=str(data)), tmp_path / "cache") == [
        "plain text\nsecond line\n", "# Title\n\nmarkdown body", "json line one", "json line two",
        "array one", "array two", "parquet one", "parquet two", "nested"]
    assert documents(DataConfig(source=str(data / "c.jsonl")), tmp_path / "cache") == ["json line one", "json line two"]
    (tmp_path / "g.jsonl").write_text('{"body": "custom field"}\n')
    assert documents(DataConfig(source=str(tmp_path / "g.jsonl"), text_field="body"), tmp_path / "cache") == [
        "custom field"]
    capped = load_corpus(DataConfig(source=str(data), max_tokens=30), tmp_path / "cache")
    assert capped.info.tokens == 30 and capped.info.documents == 2


@pytest.mark.parametrize("files, source, message", [
    ({}, "missing", "no such file or folder"),
    ({}, "", "holds no .txt"),
    ({"notes/a.csv": "text\n"}, "", "holds no .txt"),
    ({"a.csv": "text\n"}, "a.csv", "unsupported file type"),
    ({"empty.txt": "", "sub/empty.md": ""}, "", "holds no text"),
    ({"e.jsonl": '{"text": ""}\n{"text": null}\n'}, "", "holds no text"),
    ({"w.jsonl": '{"body": "x"}\n'}, "", "no column 'text' \\(columns: body\\)"),
    ({"n.jsonl": '{"text": 5}\n'}, "", "column 'text' holds .*int.*, not text"),
    ({"b.jsonl": "not json\n"}, "", "cannot read its json files"),
    ({"a.jsonl": '{"text": "x"}\n', "b.jsonl": '{"text": "y", "n": 1}\n'}, "", "cannot read its json files"),
    ({"latin1.txt": b"caf\xe9"}, "", "cannot read its text files: 'utf-8' codec"),
])
def test_bad_sources_are_usage_errors_naming_the_path(tmp_path, files, source, message):
    folder = tmp_path / "in"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    source = folder / source
    with pytest.raises(UsageError, match=message) as e:
        load_corpus(DataConfig(source=str(source)), tmp_path / "cache")
    assert str(source) in str(e.value)
    left = [p.name for p in (tmp_path / "cache").glob("tokens/*") if not p.name.endswith(".lock")]
    assert not left, "a failed build left a cache file"


def test_a_corpus_smaller_than_a_window_says_how_many_tokens(tmp_path):
    (tmp_path / "small.txt").write_text("x" * 100)
    with pytest.raises(UsageError, match=r"training part has 91 tokens, fewer than one training sequence of 129"):
        module(tmp_path / "small.txt", tmp_path / "cache", seq_len=128)
    with pytest.raises(UsageError, match=r"held-out part .* has 10 of its 101 tokens.* needs at least 170 tokens"):
        module(tmp_path / "small.txt", tmp_path / "cache", seq_len=16)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "bad_manifest"])
def test_a_damaged_cache_is_rebuilt_not_trusted(text_folder, tmp_path, monkeypatch, damage):
    cfg = DataConfig(source=str(text_folder))
    first = load_corpus(cfg, tmp_path)
    expected = np.concatenate([first.train, first.val])
    path = first.info.path
    manifest = cache_mod.manifest_path(path)
    stale_tmp = path.with_name(f".{path.name}.killed.tmp")
    stale_tmp.write_bytes(b"half")  # what a killed builder leaves behind
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "no_manifest":
        manifest.unlink()
    else:
        manifest.write_text("{")
    monkeypatch.setattr(corpus_mod, "_LOADED", {})  # as a new process would
    again = load_corpus(cfg, tmp_path)
    assert not again.info.from_cache
    assert np.array_equal(np.concatenate([again.train, again.val]), expected)
    assert not stale_tmp.exists()
    assert load_corpus(cfg, tmp_path).info.from_cache


def test_bpe_round_trips_text_and_respects_the_vocabulary_size(tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    for i in range(30):
        (data / f"{i}.md").write_text(words(i, 300) + "naïve café — 日本語 🙂\n\tdef f(x):\n        return x\n")
    cfg = DataConfig(source=str(data), tokenizer="bpe", vocab_size=300)
    c = load_corpus(cfg, tmp_path / "cache")
    tok = c.tokenizer
    assert tok.vocab_size == 300 and c.train.dtype == np.uint16
    assert int(max(c.train.max(), c.val.max())) < 300
    for text in ("naïve café — 日本語 🙂\n\tdef f(x):", "unseen: ЖЩ ∑ \x01 ok", ""):
        assert tok.decode(tok.encode(text)) == text
    stream = np.concatenate([c.train, c.val]).tolist()
    first_doc = stream[:stream.index(tok.eos_id)]
    assert tok.decode(first_doc) == (data / "0.md").read_text()
    assert len(stream) < 0.5 * c.info.text_bytes  # merges were learned: fewer tokens than bytes
    corpus_mod._LOADED.clear()
    again = load_corpus(cfg, tmp_path / "cache")
    assert again.info.from_cache and again.tokenizer.sha256 == tok.sha256


def test_cache_env_var_overrides_the_cache_dir(text_folder, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared"))
    c = load_corpus(DataConfig(source=str(text_folder)), tmp_path / "output" / "cache")
    assert c.info.path.is_relative_to(tmp_path / "shared")
    assert not (tmp_path / "output").exists()


def test_no_space_left_is_a_usage_error_and_leaves_no_partial_cache(text_folder, tmp_path, monkeypatch):
    real_write = cache_mod.HashingWriter.write

    def write_half_then_fail(self, data: bytes) -> None:
        real_write(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_mod.HashingWriter, "write", write_half_then_fail)
    cfg = DataConfig(source=str(text_folder))
    with pytest.raises(UsageError, match=r"^no space left on device while writing .*tokens.*\.bin$"):
        load_corpus(cfg, tmp_path)
    assert [p.name for p in (tmp_path / "tokens").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setattr(corpus_mod, "_LOADED", {})
    assert not load_corpus(cfg, tmp_path).info.from_cache


def test_an_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    import datasets

    started = time.monotonic()
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match="hub:someone/some-data: the Hugging Face Hub is switched off"):
        load_corpus(DataConfig(source="hub:someone/some-data"), tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    with pytest.raises(UsageError, match=r"Hugging Face Hub at http://127\.0\.0\.1:9 is unreachable") as e:
        load_corpus(DataConfig(source="hub:someone/some-data"), tmp_path)
    assert str(e.value).startswith("data.source hub:someone/some-data: ")
    assert time.monotonic() - started < 10


def test_stdlib_corpus_builds_once_and_loads_fast(tmp_path, monkeypatch):
    cfg = DataConfig()
    cold = load_corpus(cfg, tmp_path)
    info = cold.info
    summary = stdlib_summary()
    assert not info.from_cache and info.label.startswith(f"stdlib corpus ({summary.python} standard library")
    assert info.documents == summary.files > 1000 and info.tokens == summary.byte_tokens > 10_000_000
    monkeypatch.setattr(corpus_mod, "_LOADED", {})  # as a new process would
    started = time.perf_counter()
    warm = load_corpus(cfg, tmp_path)
    assert time.perf_counter() - started < 1.0
    assert warm.info.from_cache
    assert np.array_equal(warm.train, cold.train) and np.array_equal(warm.val, cold.val)
    assert "M tokens" in warm.info.describe() and "byte tokenizer (vocab 256)" in warm.info.describe()


def test_editing_a_source_file_rebuilds_and_a_cache_inside_the_source_is_not_text(tmp_path):
    data = tmp_path / "src"
    data.mkdir()
    (data / "a.txt").write_text("first version")
    (data / "b.jsonl").write_text('{"text": "json one"}\n')
    cfg = DataConfig(source=str(data))
    assert documents(cfg, data / "cache") == ["first version", "json one"]
    corpus_mod._LOADED.clear()
    assert load_corpus(cfg, data / "cache").info.from_cache  # the cache's own .json files are not documents
    (data / "a.txt").write_text("second version")
    assert documents(cfg, data / "cache") == ["second version", "json one"]
