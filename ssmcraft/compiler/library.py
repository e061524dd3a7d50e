"""Where the objective library and the shipped specs live.

In a source checkout they are the top-level ``objectives/`` and ``specs/`` folders; an
installed ssmcraft carries the same files as package data under ``ssmcraft/data/``.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def roots(kind: str) -> list[Path]:
    """Folders holding ``kind`` ("objectives" or "specs"), checkout first."""
    return [p for p in (_PACKAGE.parent / kind, _PACKAGE / "data" / kind) if p.is_dir()]


def find_objective(name: str, extra: Path | None = None) -> Path | None:
    """The objective file for ``name`` (``longhorn`` or ``longhorn.yaml``) in ``extra`` (a
    folder of the caller's own objectives, searched first) or the library, or None."""
    stem = Path(name).name
    if not stem.endswith((".yaml", ".yml")):
        stem += ".yaml"
    for root in ([extra] if extra is not None else []) + roots("objectives"):
        try:
            if (root / stem).is_file():
                return root / stem
        except (OSError, ValueError):   # a name too long for the file system, a NUL byte
            return None
    return None


def library_names(extra: Path | None = None) -> list[str]:
    """Every objective name available: ``extra``'s (a folder of the caller's own) and the library's."""
    names = set()
    for root in ([extra] if extra is not None else []) + roots("objectives"):
        names |= {p.stem for p in root.glob("*.yaml")}
    return sorted(names)
