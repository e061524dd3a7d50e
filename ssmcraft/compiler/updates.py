"""Stage 3, assembled: the update a spec's ``update:`` and ``approximation:`` ask for, from the
derivations (``derive``: implicit, explicit, Newton; ``metric``: a square state as the metric of
the proximity, carried by its inverse; ``minibatch``: gradients at the chunk's start), one state
at a time for several states (block-coordinate, in declaration order).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ssmcraft.compiler.derive import OR_NEWTON, USE_EXPLICIT, explicit_update, implicit_update, newton_update
from ssmcraft.compiler.metric import has_metric, metric_update, square_update
from ssmcraft.compiler.minibatch import minibatch_update
from ssmcraft.compiler.symbolic import Algebra, SymbolicObjective
from ssmcraft.errors import DerivationError


def derive_update(so: SymbolicObjective) -> sympy.Expr:
    """The update F(S_prev) that the spec's ``update:`` asks for (element form)."""
    if has_metric(so):                  # a square state as the metric of the proximity
        return metric_update(so)
    if so.spec.minibatch:               # gradients at the chunk's start: ssmcraft.compiler.minibatch
        return minibatch_update(so)
    if so.spec.update == "implicit":
        return implicit_update(so)
    if so.spec.update == "newton":
        return newton_update(so)
    return explicit_update(so)


@dataclass(frozen=True)
class _StateView:
    """The part of a ``Lowering`` the single-state derivations read, for one of several states."""
    alg: Algebra
    state: sympy.Symbol
    state_prev: sympy.Symbol
    others: tuple = ()      # the other [d, m]-like states: (name, new, previous) (a mini-batch's anchors)


def state_view(so: SymbolicObjective, index: int) -> SymbolicObjective:
    """State ``index`` of a several-state objective as a single-state one: its own loss, update and
    approximation, every other state (new or previous value) a constant symbol."""
    from dataclasses import replace
    spec = so.spec
    name = spec.states[index]
    view_spec = replace(spec, state=name, objective=spec.objectives[index], update=spec.updates[index],
                        approximation=spec.approximations[index], states=(), objectives=(), updates=(),
                        approximations=(), shapes=(), inits=())
    new, prev = so.lowering.state_of(name)
    others = tuple((x, *so.lowering.state_of(x)) for x in spec.states if x != name and x not in spec.square_states())
    return SymbolicObjective(view_spec, _StateView(so.algebra, new, prev, others), so.losses[index][1], so.output)


def derive_stages(so: SymbolicObjective) -> tuple:
    """Several states, block-coordinate (Gauss-Seidel) in declaration order: per state
    ``(name, F)`` with ``F`` that state's own update (implicit minimiser or explicit step of its
    loss), reading the earlier states' new values and every ``X_prev``. Errors name
    ``objective.X``. (Every state's approximation is exact: the spec stage refuses the diagonal one.)"""
    spec = so.spec
    out = []
    for i, name in enumerate(spec.states):
        if name in spec.square_states():       # carried by its inverse: ssmcraft.compiler.metric
            out.append((name, square_update(so, name, f"objective.{name}")))
            continue
        try:
            out.append((name, derive_update(state_view(so, i))))
        except DerivationError as e:
            key = f"objective.{name}" if e.key == "objective" else e.key
            problem = e.problem.replace(f" {OR_NEWTON}", "").replace(USE_EXPLICIT, f"use update.{name}: explicit")
            raise DerivationError(e.source, key, problem) from None
    return tuple(out)


def compose_stages(so: SymbolicObjective, stages) -> tuple:
    """The stages' updates with every earlier state's new value replaced by its own update, so
    that each is an element expression in the previous states and the inputs only."""
    alg = so.algebra
    done: dict = {}
    out = []
    for name, F in stages:
        if not isinstance(F, sympy.Expr):      # a square state's update (metric.SquareUpdate): its
            out.append((name, F))               # inverse is computed first, read by name
            continue
        F = alg.substitute(F, done) if done else F
        done[so.lowering.state_of(name)[0]] = F
        out.append((name, F))
    return tuple(out)


def derive_updates(so: SymbolicObjective) -> tuple:
    """Several states: ``((name, F(previous states)), ...)`` in declaration order."""
    return compose_stages(so, derive_stages(so))
