"""Text corpora as one byte string, with provenance (byte count, sha256, file count).

Sources:

- ``"stdlib"``: the ``.py`` files of the running Python's standard library (the directory
  holding ``os.__file__``), without its regression-test package ``test/``, without
  ``site-packages``/``dist-packages`` and ``__pycache__``. ~14.4 MB on CPython 3.11.7;
  other builds differ, which is why every run records the byte count and hash.
- a file path: that file; a directory: every file under it matching ``glob`` (default all),
  sorted by relative path, skipping files with a NUL byte in their first 8 KiB (binary; the
  number skipped is reported);
- ``"hf:NAME"``: a Hugging Face dataset's ``text_field`` column (needs the ``datasets``
  package and network; the bytes are cached under the cache directory keyed by a hash of
  the request, since a download is slow).

Files are joined with one ``\\n`` between them, in sorted order, so the bytes (and their
hash) depend only on the files' contents and relative paths. ``Corpus.starts`` keeps where each
document (file, or dataset row) begins, so that a task can pack documents with their boundaries. Reading the local sources
takes well under a second, so they are not cached.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssmcraft.errors import SsmcraftError
from ssmcraft.fileio import write_bytes, write_text

log = logging.getLogger(__name__)

STDLIB_EXCLUDE_TOP = {"test", "site-packages", "dist-packages"}
ALWAYS_EXCLUDE = {"__pycache__", ".git", ".hg", ".svn"}


@dataclass
class Corpus:
    """A corpus's bytes and where they came from."""

    data: bytes
    source: str
    kind: str                      # "stdlib" | "file" | "directory" | "hf"
    n_files: int
    sha256: str
    details: dict[str, Any] = field(default_factory=dict)
    starts: list[int] | None = field(default_factory=lambda: [0])    # where each document begins (None: unknown)

    @property
    def n_bytes(self) -> int:
        return len(self.data)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "n_files": self.n_files,
                "n_bytes": self.n_bytes, "sha256": self.sha256, **self.details}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ssmcraft`` or ``~/.cache/ssmcraft``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ssmcraft"


def stdlib_root() -> Path:
    """The directory of the running Python's standard library (where ``os.py`` lives)."""
    return Path(os.__file__).resolve().parent


def list_files(root: Path, glob: str = "*", exclude_top: set[str] = frozenset()) -> list[Path]:
    """Regular files under ``root`` whose name matches ``glob``, sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == root
        dirnames[:] = [d for d in dirnames if d not in ALWAYS_EXCLUDE and not (top and d in exclude_top)]
        for name in filenames:
            if fnmatch.fnmatch(name, glob):
                path = Path(dirpath) / name
                if path.is_file():
                    found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _join(paths: list[Path], skip_binary: bool) -> tuple[bytes, int, int, list[int]]:
    """(the files' bytes joined by newlines, how many, how many binary ones were skipped, where each
    begins in the joined bytes)."""
    parts, skipped = [], 0
    for path in paths:
        data = path.read_bytes()
        if skip_binary and b"\x00" in data[:8192]:
            skipped += 1
            continue
        parts.append(data)
    return b"\n".join(parts), len(parts), skipped, _starts(parts)


def _starts(parts: list[bytes]) -> list[int]:
    """Where each of ``parts`` begins once they are joined with one byte between them."""
    out, at = [], 0
    for p in parts:
        out.append(at)
        at += len(p) + 1
    return out


def load_corpus(source: str = "stdlib", glob: str = "*", max_bytes: int | None = None,
                hf_split: str = "train", hf_text_field: str = "text",
                cache_dir: str | Path | None = None) -> Corpus:
    """Load a corpus; see the module docstring for ``source``. ``max_bytes`` keeps a prefix."""
    t0 = time.perf_counter()
    if source == "stdlib":
        root = stdlib_root()
        data, n, skipped, starts = _join(list_files(root, "*.py", STDLIB_EXCLUDE_TOP), skip_binary=False)
        kind, label, details = "stdlib", f"stdlib:{root}", {"root": str(root)}
    elif source.startswith("hf:"):
        data, n, starts = _load_hf(source[3:], hf_split, hf_text_field, max_bytes, cache_dir)
        kind, label, details, skipped = "hf", source, {"split": hf_split, "text_field": hf_text_field}, 0
    else:
        path = Path(source).expanduser()
        if path.is_file():
            data, n, skipped, starts = path.read_bytes(), 1, 0, [0]
            kind = "file"
        elif path.is_dir():
            data, n, skipped, starts = _join(list_files(path, glob), skip_binary=True)
            kind = "directory"
        else:
            raise SsmcraftError(f"corpus {source!r}: no such file or directory "
                                "(use 'stdlib', a path, or 'hf:DATASET' for a Hugging Face dataset)")
        label, details = str(path.resolve()), {"glob": glob} if kind == "directory" else {}
    if max_bytes is not None:
        data = data[: int(max_bytes)]
        starts = None if starts is None else [s for s in starts if s < len(data)]
        details["max_bytes"] = int(max_bytes)
    if skipped:
        details["skipped_binary_files"] = skipped
        log.info("corpus %s: skipped %d binary files", label, skipped)
    if not data:
        raise SsmcraftError(f"corpus {label}: no text found")
    sha = hashlib.sha256(data).hexdigest()
    details["load_seconds"] = round(time.perf_counter() - t0, 3)
    log.info("corpus %s: %d files, %d bytes, sha256 %s (%.2f s)", label, n, len(data), sha[:12],
             details["load_seconds"])
    return Corpus(data, label, kind, n, sha, details, starts)


def _load_hf(name: str, split: str, text_field: str, max_bytes: int | None,
             cache_dir: str | Path | None) -> tuple[bytes, int, list[int] | None]:
    """A Hugging Face dataset's text as bytes (documents joined by newlines), how many documents and
    where each begins (None from a cache written without them); cached."""
    key = hashlib.sha256(json.dumps([name, split, text_field, max_bytes]).encode()).hexdigest()[:24]
    cache = Path(cache_dir or default_cache_dir()) / "corpus" / f"hf-{key}.bin"
    meta = cache.with_suffix(".json")
    if cache.exists() and meta.exists():
        log.info("corpus hf:%s: read from cache %s", name, cache)
        saved = json.loads(meta.read_text())
        starts = None if "starts" not in saved else [int(s) for s in saved["starts"]]    # None: an older cache
        return cache.read_bytes(), int(saved["n_documents"]), starts
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError:
        raise SsmcraftError(f"corpus hf:{name}: the 'datasets' package is not installed "
                            "(pip install datasets), and it needs network access") from None
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
        parts, total, n = [], 0, 0
        for row in ds:
            if text_field not in row:
                raise SsmcraftError(f"corpus hf:{name}: no field {text_field!r}; fields: {', '.join(row)}")
            text = str(row[text_field]).encode("utf-8")
            parts.append(text)
            total, n = total + len(text) + 1, n + 1
            if max_bytes is not None and total >= max_bytes:
                break
    except SsmcraftError:
        raise
    except Exception as e:  # network, missing dataset, auth: one clear line
        raise SsmcraftError(f"corpus hf:{name}: could not load the dataset ({type(e).__name__}: {e})") from None
    data = b"\n".join(parts)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(cache, data)
    starts = _starts(parts)
    write_text(meta, json.dumps({"name": name, "split": split, "text_field": text_field, "n_documents": n,
                                 "starts": starts}))
    return data, n, starts
