"""Atomic file writes: every file ssmcraft writes for a reader (a run's JSON, a checkpoint, the
compile cache, weights, a leaderboard) goes through here.

The data goes to a temporary file beside the target, which is then renamed over it
(``os.replace``), so a reader, or a run resumed after a kill, sees the old file or the new one,
never half of one. The temporary name is unique to the writer (process and a random part), so
two threads or processes writing the same target do not share one; it is created with
``open(..., "x")``, so the file's mode follows the umask like any other file. A failed write
removes its temporary file and re-raises the ``OSError``. ``file_sha256`` is the hash a written
file is recorded and later checked by.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file beside it, then a rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path, data: Any, **dumps) -> None:
    """Write ``data`` as JSON (indented by 2, a final newline) to ``path`` atomically; ``dumps``:
    further ``json.dumps`` options (``sort_keys``, ``default``, ``allow_nan``)."""
    write_text(path, json.dumps(data, indent=2, **dumps) + "\n")


def file_sha256(path) -> str:
    """sha256 of a file's bytes, read in blocks (weights may be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
