"""Compiling the objective a mixer config names, and storing it so a run can be rebuilt.

A run's resolved config embeds the objective's spec mapping (not only its name), so a
checkpoint loads even after the library file changed or on a machine without it.
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Mapping

from ssmcraft.errors import SsmcraftError

log = logging.getLogger(__name__)


def compile_objective(ref: Any):
    """``ssmcraft.compile(ref)``: ``ref`` a library name, path, YAML text or spec mapping."""
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
    if isinstance(ref, str) and _is_bare_name(ref):
        from ssmcraft.compiler.library import find_objective, library_names

        if find_objective(ref) is None:
            return f"unknown objective {ref!r}: not a file, and the library has {', '.join(library_names()) or 'no objectives'}"
    return None


def _is_bare_name(ref: str) -> bool:
    """A library name like ``longhorn`` (not YAML text, not an existing file)."""
    return "\n" not in ref and ":" not in ref and not Path(ref).exists()


def spec_mapping(obj) -> dict[str, Any]:
    """The compiled objective's spec as a plain mapping (what ``compile`` accepts back)."""
    raw = getattr(obj.spec, "raw", None)
    if not raw:
        raise SsmcraftError(f"objective {obj.spec.name}: its spec mapping is not available to store")
    return copy.deepcopy(dict(raw))
