"""The compiler's pipeline as functions: spec -> symbolic objective -> IR -> reference module.

The stages are pure functions (``load_spec``, ``symbolic_objective``, ``build_ir``,
``reference_source``); :func:`derive` chains them and loads the generated reference module from
the content-addressed cache. ``ssmcraft.compile`` (``ssmcraft.runtime.objective``) wraps a
:class:`Derivation` with the calls researchers use; the kernel families take a derivation where
they need an objective's IR and spec without the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import sympy

from ssmcraft.compiler import blockrank1, cache
from ssmcraft.compiler.codegen import reference_source
from ssmcraft.compiler.ir import Coefficient, UpdateIR
from ssmcraft.compiler.spec import Spec, load_spec
from ssmcraft.compiler.structure import build_ir
from ssmcraft.compiler.symbolic import SymbolicObjective, symbolic_objective
from ssmcraft.errors import SsmcraftError


@dataclass
class Derivation:
    """What the compiler makes of one spec: the spec, its symbolic objective, the IR and the
    generated reference module (``module``, imported from ``source``)."""
    spec: Spec
    ir: UpdateIR
    symbolic: SymbolicObjective | None
    module: object = field(repr=False)
    source: str = field(repr=False)

    @property
    def name(self) -> str:
        return self.spec.name


def generate_reference(ir: UpdateIR):
    """Write (or find) and import the reference module of ``ir``."""
    header = f"spec: {ir.spec_name} ({ir.source}); IR {ir.content_hash()}"
    source = reference_source(ir, header)
    key = cache.key_for("reference", source)
    return cache.load_generated(f"ref_{ir.spec_name}", key, source), source


def from_ir(spec: Spec, ir: UpdateIR, symbolic: SymbolicObjective | None = None) -> Derivation:
    module, source = generate_reference(ir)
    return Derivation(spec, ir, symbolic, module, source)


def derive(spec: str | Path | Mapping | Spec) -> Derivation:
    """Derive an objective spec (a path, a library name, YAML text, a mapping or a ``Spec``)."""
    s = spec if isinstance(spec, Spec) else load_spec(spec)
    so = symbolic_objective(s)
    return from_ir(s, blockrank1.attach(so, build_ir(so)), so)


def mitigate(ir: UpdateIR, retention: float, insertion: float) -> UpdateIR:
    """The IR with the decay coefficient raised to ``retention`` and the input term scaled."""
    if ir.kind not in ("scalar_decay", "diagonal_decay", "rank1", "rankr"):
        raise SsmcraftError(f"{ir.spec_name}: retention/insertion scaling needs a decay and an additive "
                            f"input term; this objective's update is {ir.kind}")
    coefs = {c.name: c for c in ir.coefficients}
    if retention != 1.0:
        a = coefs[ir.slots["a"]]
        if a.expr == 1:
            what = ("identity minus a rank-1 erase" if ir.kind == "rank1" else
                    "identity minus a low-rank erase" if ir.kind == "rankr" else
                    "the identity: the state sums every write and forgets nothing")
            raise SsmcraftError(f"{ir.spec_name}: this objective has no decay to scale (its transition is "
                                f"{what}); retention scaling applies to decays")
        r = sympy.Float(retention)
        scaled = a.expr ** r if a.expr.is_positive else sympy.sign(a.expr) * sympy.Abs(a.expr) ** r
        coefs[a.name] = Coefficient(a.name, scaled, a.dims)
    if insertion != 1.0:
        for slot in [ir.slots[s] for s in ir.input_slots()] or [ir.slots.get("p") or ir.slots["B"]]:
            c = coefs[slot]
            coefs[slot] = Coefficient(c.name, sympy.Float(insertion) * c.expr, c.dims)
    tag = f"_ret{retention:g}_ins{insertion:g}".replace(".", "p").replace("-", "m")
    return replace(ir, coefficients=tuple(coefs[c.name] for c in ir.coefficients), spec_name=ir.spec_name + tag)
