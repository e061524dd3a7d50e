"""Content-addressed cache of generated source files.

A generated file's key hashes the IR, the compiler's own source and the torch/Triton
versions; the file is written atomically (temp file + rename) under the cache directory
(``$SSMCRAFT_CACHE`` or ``~/.cache/ssmcraft``) and imported under a module name derived
from the key, so ``sys.modules`` is the in-process cache. Triton reads a ``@triton.jit``
function's source through its file name, which is why kernels are written out. Every module is
checked (``safe_source.check``) before it is written or imported, and what runs is the checked
text itself (also what ``linecache`` serves for the file), never the file read back.
"""
from __future__ import annotations

import builtins
import functools
import hashlib
import importlib.metadata
import importlib.util
import linecache
import os
import sys
from pathlib import Path

from ssmcraft.compiler import safe_source
from ssmcraft.errors import SsmcraftError
from ssmcraft.fileio import write_text

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


def load_generated(stem: str, key: str, source: str):
    """Check ``source`` (``safe_source.check``), write it (if not cached yet) as ``<stem>_<key>.py``
    and import it. A cached file whose text is not ``source`` (``key`` hashes ``source``: the file
    was edited or torn) is rewritten from ``source``; the module is always compiled from the checked
    ``source`` itself, never from what is read back from the file."""
    name = f"ssmcraft_generated_{stem}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    safe_source.check(source, f"generated module {stem}")    # before anything is written
    path = cache_dir() / f"{stem}_{key}.py"
    if not _holds(path, source):
        try:
            write_text(path, source)
        except OSError as e:
            raise SsmcraftError(f"cache folder {path.parent}: cannot write {path.name}: {e.strerror or e} "
                                f"(set SSMCRAFT_CACHE to a writable folder)") from None
    return import_file(path, name, source, policy=None)   # checked above


def _holds(path: Path, source: str) -> bool:
    try:
        return path.read_bytes() == source.encode("utf-8")
    except OSError:
        return False


def import_file(path: Path, name: str, source: str, policy: safe_source.Policy | None = safe_source.GENERATED):
    """Import ``source``, the text written at ``path``, as module ``name`` (registered in
    ``sys.modules``) once it passes ``policy`` (``safe_source.check``; None only for text checked
    otherwise, as the export bundle is). The code run is compiled from ``source``, and ``linecache``
    serves ``source`` for ``path`` (Triton reads a kernel's text through it), so a file changed
    after the check is not what runs."""
    if policy is not None:
        safe_source.check(source, f"generated module {path.name}", policy)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    filename = str(path)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    sys.modules[name] = module
    try:
        exec(builtins.compile(source, filename, "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - checked text
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
