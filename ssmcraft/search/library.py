"""Finding an objective spec for the search space: a library name (``longhorn``, from
``ssmcraft.compiler.library``), a name from the spec's own ``objectives_dir``, or a YAML
path relative to the search spec. A failed lookup says where it looked."""
from __future__ import annotations

from pathlib import Path

from ssmcraft import yamlsafe
from ssmcraft.compiler import library as compiler_library
from ssmcraft.errors import SpecError, one_line
from ssmcraft.errors import quote as shown


def is_path(ref: str) -> bool:
    """A reference is a path (not a library name) when it names a YAML file."""
    return ref.endswith((".yaml", ".yml"))


def resolve_objective(ref: str, base: Path, extra: Path | None = None,
                      source: str = "<spec>", key: str = "objective") -> Path:
    """Path of the objective spec ``ref``: a YAML path relative to ``base`` (the search
    spec's folder), else a name in ``extra`` (``objectives_dir``) or the library."""
    if is_path(ref):
        try:
            path = (base / ref).resolve()
        except (OSError, ValueError) as e:  # a NUL byte, a loop of links
            raise SpecError(source, key, f"objective file {shown(ref)}: not a usable path ({one_line(e)})") from None
        if not _is_file(path):
            raise SpecError(source, key, f"objective file {shown(ref)} not found (looked at {path})")
        return path
    path = compiler_library.find_objective(ref, extra)
    if path is None:
        where = [str(extra)] if extra is not None else []
        where += [str(r) for r in compiler_library.roots("objectives")]
        raise SpecError(source, key, f"unknown objective {shown(ref)}; known ({', '.join(where) or 'no library'}): "
                                     f"{', '.join(compiler_library.library_names(extra)) or 'none'}")
    return path


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):   # a name too long for the file system, a NUL byte
        return False


def load_objective(path: Path) -> dict:
    """The objective spec dict stored in ``path`` (``yamlsafe``; the compiler validates it)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise SpecError(str(path), "", f"cannot read: {getattr(e, 'strerror', None) or one_line(e)}") from None
    data = yamlsafe.load(text, str(path))
    if not isinstance(data, dict):
        raise SpecError(str(path), "", "an objective spec must be a mapping")
    return data
