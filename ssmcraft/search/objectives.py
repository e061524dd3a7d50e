"""The search's only contact with the compiler.

``compile_objective`` is the single call into ``ssmcraft.compile``; everything else in
the search takes a ``compile_fn`` argument defaulting to it, so tests (and a search run
before the compiler exists) can substitute their own.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ssmcraft.errors import SpecError
from ssmcraft.search.space import objective_variants
from ssmcraft.search.spec import SearchSpec


def compile_objective(objective: dict) -> Any:
    """Compile an objective spec dict with ``ssmcraft.compile``; raises ``SpecError``
    (or its subclass ``DerivationError``) when the spec is invalid or does not derive."""
    import ssmcraft  # lazily: the compiler pulls in sympy and torch

    return ssmcraft.compile(objective)


def check_objectives(spec: SearchSpec, compile_fn: Callable[[dict], Any] = compile_objective
                     ) -> tuple[int, float]:
    """Compile every objective variant the space can select, before any trial runs.

    Returns (number of distinct variants, seconds taken). Raises ``SpecError`` naming the
    first variant the compiler rejects, how the space selects it, and the compiler's
    message.
    """
    start = time.perf_counter()
    n = 0
    for params, objective in objective_variants(spec):
        try:
            compile_fn(objective)
        except SpecError as e:
            how = ", ".join(f"{k}={v}" for k, v in params.items())
            raise SpecError(spec.source, "space.objective",
                            f"{objective.get('name', '?')} ({how}) is rejected by the compiler: {e}") from None
        n += 1
    return n, time.perf_counter() - start
