"""Storing the objective a mixer config names, so a run can be rebuilt (compiling it is
``ssmcraft.runtime.lookup.compile_objective``).

A run's resolved config embeds the objective's spec mapping (not only its name), so a
checkpoint loads even after the library file changed or on a machine without it.
"""
from __future__ import annotations

import copy
from typing import Any

from ssmcraft.errors import SsmcraftError


def spec_mapping(obj) -> dict[str, Any]:
    """The compiled objective's spec as a plain mapping (what ``compile`` accepts back)."""
    raw = getattr(obj.spec, "raw", None)
    if not raw:
        raise SsmcraftError(f"objective {obj.spec.name}: its spec mapping is not available to store")
    return copy.deepcopy(dict(raw))
