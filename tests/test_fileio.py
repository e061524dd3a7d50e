"""ssmcraft.fileio: a write replaces the file whole or not at all, and leaves no temporary file."""
from __future__ import annotations

import json
import os
import stat

import pytest

from ssmcraft import fileio


def test_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "run.json"
    target.write_text("old")
    fileio.write_json(target, {"b": 1, "a": [1.5, "x"]}, sort_keys=True)
    assert target.read_text() == '{\n  "a": [\n    1.5,\n    "x"\n  ],\n  "b": 1\n}\n'
    assert json.loads(target.read_text()) == {"a": [1.5, "x"], "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        fileio.write_bytes(target, b"new" * 1000)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]


def test_a_value_json_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    target = tmp_path / "metrics.json"
    with pytest.raises(ValueError):
        fileio.write_json(target, {"loss": float("nan")}, allow_nan=False)
    assert not any(tmp_path.iterdir())


def test_the_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        fileio.write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
