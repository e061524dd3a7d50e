"""Content-addressed cache of generated source files.

A generated file's key hashes the IR, the compiler's own source and the torch/Triton
versions; the file is written atomically (temp file + rename) under the cache directory
(``$SSMCRAFT_CACHE`` or ``~/.cache/ssmcraft``) and imported under a module name derived
from the key, so ``sys.modules`` is the in-process cache. Triton reads a ``@triton.jit``
function's source from its file, which is why kernels are written out, not ``exec`` ed.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from ssmcraft.errors import SsmcraftError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    root = os.environ.get("SSMCRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ssmcraft")
    path = Path(root) / "generated"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SsmcraftError(f"cache folder {path}: {e.strerror or e} (set SSMCRAFT_CACHE to a writable folder)") from None
    return path


@functools.lru_cache(maxsize=1)
def toolchain_fingerprint() -> str:
    """Hash of the code generators' source and the torch/Triton versions."""
    h = hashlib.sha256()
    for folder in ("compiler", "kernels"):
        for f in sorted((PACKAGE_ROOT / folder).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    for dist in ("torch", "triton"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.hexdigest()


def key_for(*parts: str) -> str:
    h = hashlib.sha256(toolchain_fingerprint().encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:20]


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_generated(stem: str, key: str, source: str):
    """Write ``source`` (if not cached yet) as ``<stem>_<key>.py`` and import it."""
    name = f"ssmcraft_generated_{stem}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    path = cache_dir() / f"{stem}_{key}.py"
    if not path.exists() or path.read_text(encoding="utf-8") != source:
        try:
            write_atomic(path, source)
        except OSError as e:
            raise SsmcraftError(f"cache folder {path.parent}: cannot write {path.name}: {e.strerror or e} "
                                f"(set SSMCRAFT_CACHE to a writable folder)") from None
    return import_file(path, name)


def import_file(path: Path, name: str):
    """Import the Python file ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
