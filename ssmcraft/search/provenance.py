"""What code ran a trial: package version, ``git describe`` of a source checkout, and a
hash of the package's own source (which holds even when neither of the others does)."""
from __future__ import annotations

import hashlib
import subprocess
from importlib import metadata
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # .../ssmcraft


def source_hash(root: Path = _PACKAGE) -> str:
    """sha256 over the relative paths and contents of every ``.py`` file under ``root``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def git_describe(root: Path = _PACKAGE.parent) -> str | None:
    """``git describe --always --dirty --tags`` of the checkout ssmcraft runs from, or
    None when it is not a git checkout (an installed package) or has no commit yet."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def package_version() -> str | None:
    try:
        return metadata.version("ssmcraft")
    except metadata.PackageNotFoundError:
        return None


def code_version() -> dict:
    """{"package": version or None, "git": describe or None, "source_sha256": hash}."""
    return {"package": package_version(), "git": git_describe(), "source_sha256": source_hash()}
