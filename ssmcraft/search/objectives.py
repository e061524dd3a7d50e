"""Checking, before any trial, that the objectives a search space can select derive.

The search compiles through ``compile_fn`` arguments defaulting to
``ssmcraft.runtime.lookup.compile_objective``, so tests can substitute their own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ssmcraft.errors import SpecError
from ssmcraft.runtime.lookup import compile_objective
from ssmcraft.search.space import OBJECTIVE_PARAM, objective_variants
from ssmcraft.search.spec import SearchSpec


@dataclass(frozen=True)
class VariantCheck:
    """What ``check_objectives`` found: ``derive`` of ``total`` distinct variants derive;
    ``underivable``: one line per composed variant the compiler refuses (its name, how the
    space selects it, the compiler's reason)."""
    total: int
    seconds: float
    underivable: tuple[str, ...] = ()

    @property
    def derive(self) -> int:
        return self.total - len(self.underivable)

    def summary(self) -> str:
        if not self.underivable:
            return f"all {self.total} variants of the space derive (checked in {self.seconds:.1f} s)"
        return (f"{self.derive} of {self.total} variants of the space derive (checked in {self.seconds:.1f} s); "
                f"{len(self.underivable)} composed variants do not derive with this compiler: a trial that "
                f"draws one is recorded as failed with the compiler's reason, e.g. {self.underivable[0]}")


def check_objectives(spec: SearchSpec, compile_fn: Callable[[dict], Any] = compile_objective) -> VariantCheck:
    """Compile every objective variant the space can select, before any trial runs.

    A library or file objective the compiler rejects is an error in the spec: raises
    ``SpecError`` naming it, how the space selects it, and the compiler's message. A composed
    variant the compiler rejects is not (a composition's terms multiply: some products need
    a derivation this compiler does not have yet, e.g. a closed form for a non-quadratic
    loss); it is listed in ``underivable``, and a trial that draws it fails with the reason.
    Raises when no variant at all derives.
    """
    start = time.perf_counter()
    total, bad = 0, []
    for params, objective in objective_variants(spec):
        total += 1
        try:
            compile_fn(objective)
        except SpecError as e:
            what = f"{objective.get('name', '?')} ({', '.join(f'{k}={v}' for k, v in params.items())})"
            if spec.option(params[OBJECTIVE_PARAM]).kind != "compose":
                raise SpecError(spec.source, "space.objective", f"{what} is rejected by the compiler: {e}") from None
            bad.append(f"{what}: {e}")
    if bad and len(bad) == total:
        raise SpecError(spec.source, "space.objective", f"no objective of the space derives; first: {bad[0]}")
    return VariantCheck(total, time.perf_counter() - start, tuple(bad))
