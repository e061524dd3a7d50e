"""Byte-level text corpus: deterministic loading, recorded hash, split, windows, errors."""
import builtins
import hashlib
import os
import time

import pytest
import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.tasks import build_task
from ssmcraft.tasks.corpus import load_corpus, stdlib_root
from ssmcraft.tasks.text import split_blocks


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_bytes(b"alpha text\n" * 50)
    (tmp_path / "b" / "c.py").write_bytes(b"print('c')\n" * 40)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    return tmp_path


def test_folder_corpus_is_deterministic_and_hashed(folder):
    a, b = load_corpus(str(folder)), load_corpus(str(folder))
    assert a.data == b.data and a.sha256 == b.sha256
    assert a.sha256 == hashlib.sha256(a.data).hexdigest()
    assert a.n_files == 2 and a.details["skipped_binary_files"] == 1
    assert a.data == (b"alpha text\n" * 50) + b"\n" + (b"print('c')\n" * 40)     # sorted by relative path
    d = a.describe()
    assert d["n_bytes"] == len(a.data) and d["kind"] == "directory"


def test_hash_changes_with_content(folder):
    before = load_corpus(str(folder)).sha256
    (folder / "a.txt").write_bytes(b"changed")
    assert load_corpus(str(folder)).sha256 != before


def test_stdlib_corpus_is_the_running_pythons_sources():
    t0 = time.perf_counter()
    c = load_corpus("stdlib")
    assert time.perf_counter() - t0 < 10
    assert c.kind == "stdlib" and c.n_files > 100 and c.n_bytes > 1_000_000
    assert (stdlib_root() / "os.py").read_bytes() in c.data
    assert c.details["root"] == os.path.dirname(os.path.realpath(os.__file__))


def test_missing_path_and_hf_without_datasets(monkeypatch, tmp_path):
    with pytest.raises(SsmcraftError, match="no such file or directory"):
        load_corpus(str(tmp_path / "nope"))
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(SsmcraftError, match="'datasets' package is not installed"):
        load_corpus("hf:some/dataset", cache_dir=tmp_path)


def test_split_is_interleaved_and_complete():
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    train, val = split_blocks(data, 0.25, 50)                   # every 4th block of 50 bytes is val
    assert train.numel() + val.numel() == 1000 and val.numel() == 250
    assert torch.equal(val[:50], data[150:200]) and torch.equal(val[50:100], data[350:400])


def test_text_task_windows_are_shifted_by_one(folder):
    task = build_task({"name": "text", "corpus": str(folder), "seq_len": 16, "val_fraction": 0.2,
                       "block_size": 64, "pack": False})
    g = torch.Generator().manual_seed(0)
    x, y = task.sample("train", 5, generator=g)
    assert x.shape == y.shape == (5, 16) and torch.equal(x[:, 1:], y[:, :-1])
    info = task.describe()
    assert info["corpus"]["sha256"] == load_corpus(str(folder)).sha256
    assert info["train_bytes"] + info["val_bytes"] == info["corpus"]["n_bytes"]
    v1 = task.fixed_batches("val", 2, 3, seed=7)
    v2 = task.fixed_batches("val", 2, 3, seed=7)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))
