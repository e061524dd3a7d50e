"""Compiling the objective a caller names: the one ``compile_objective`` that layers, training,
the search and the studies call.

``ref`` is a library name, a path, YAML text or a spec mapping. A bare name the library does not
have is one line listing the library (``unknown_objective``) instead of the compiler's path
error. The compiler and torch are imported on the first call, so a module that only passes this
function along (the search coordinator, a trial function shipped to a worker) stays light.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from ssmcraft.compiler.library import find_objective, library_names
from ssmcraft.errors import SsmcraftError

log = logging.getLogger(__name__)


def compile_objective(ref: Any):
    """``ssmcraft.compile(ref)``: ``ref`` a library name, path, YAML text or spec mapping. Raises
    ``SpecError`` (or ``DerivationError``) for a spec that is invalid or does not derive."""
    from ssmcraft.runtime.objective import compile as compile_

    why = unknown_objective(ref)
    if why is not None:
        raise SsmcraftError(why)
    obj = compile_(dict(ref) if isinstance(ref, Mapping) else ref)
    log.info("compiled objective %s (structure %s)", obj.spec.name, getattr(obj, "structure_kind", "?"))
    return obj


def unknown_objective(ref: Any) -> str | None:
    """Why ``ref`` names no objective: a bare name (not YAML text, not an existing file) that the
    library does not have; else None (compiling says what else is wrong)."""
    if isinstance(ref, str) and _is_bare_name(ref) and find_objective(ref) is None:
        return f"unknown objective {ref!r}: not a file, and the library has {', '.join(library_names()) or 'no objectives'}"
    return None


def _is_bare_name(ref: str) -> bool:
    """A library name like ``longhorn`` (not YAML text, not an existing file)."""
    return "\n" not in ref and ":" not in ref and not Path(ref).exists()
