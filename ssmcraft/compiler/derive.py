"""Stage 3: derive the update ``S_t = F(S_prev)`` from the symbolic objective.

- ``gradient``: reverse-mode differentiation of the element-form loss with respect to one
  element of the state, through reductions (the adjoint of a reduction summed over the
  dimensions it does not carry becomes a new reduction). Term by term, so none of sympy's
  MatrixSymbol ``diff`` bugs apply.
- ``affine``: split an element expression that is affine in a matrix variable ``V`` into
  ``alpha * V + sum_r beta_r * (V w_r)_row + gamma``: the elementwise part, the row
  functionals ``(V w)_i = sum_j V_ij w_ij`` and the constant. Raises ``NotAffine`` or
  ``NotRowSeparable`` otherwise.
- ``implicit``: solve grad L(S) = 0 row by row. The row system is diagonal plus at most
  one rank-1 term and is solved in closed form (Sherman-Morrison).
- ``explicit``: one gradient step from ``S_prev``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ssmcraft.compiler.symbolic import Algebra, SymbolicObjective
from ssmcraft.errors import DerivationError


class NotAffine(Exception):
    """The expression is not affine in the variable (the message says where)."""


class NotRowSeparable(Exception):
    """The expression couples rows of the state (a sum over the row dimension)."""


def gradient(alg: Algebra, loss: sympy.Expr, var: sympy.Symbol) -> sympy.Expr:
    """d loss / d var_ij as an element expression over both state dimensions."""
    full = alg.symbol_dims[var]
    adj: dict = {}       # reduction symbol -> adjoint (element expression over its dims)
    grad = sympy.Integer(0)

    def push(target, contribution, from_dims):
        """Add a contribution living on `from_dims` to `target`'s adjoint (summing the rest)."""
        nonlocal grad
        if contribution == 0:
            return
        target_dims = full if target == var else alg.reductions[target].dims
        for dim in sorted(from_dims - target_dims):
            contribution = alg.reduce(contribution, dim)
        if target == var:
            grad += contribution
        else:
            adj[target] = adj.get(target, 0) + contribution

    order = [r for r in alg.reductions_in(loss) if alg.depends_on(r.body, var)]
    for s in loss.free_symbols:
        if s == var:
            push(var, sympy.diff(loss, var), frozenset())
        elif s in alg.reductions and alg.depends_on(alg.reductions[s].body, var):
            push(s, sympy.diff(loss, s), frozenset())
    for r in reversed(order):           # outer reductions first: their adjoints are complete
        a = adj.pop(r.symbol, 0)
        if a == 0:
            continue
        body_dims = r.dims | {r.over}
        for s in r.body.free_symbols:
            if s == var:
                push(var, a * sympy.diff(r.body, var), body_dims)
            elif s in alg.reductions and alg.depends_on(alg.reductions[s].body, var):
                push(s, a * sympy.diff(r.body, s), body_dims)
    return grad


@dataclass(frozen=True)
class Affine:
    """``expr = alpha * V + sum_r beta_r * phi_r + gamma`` with ``phi_r = sum_j V_ij w_r``."""
    alpha: sympy.Expr
    terms: tuple          # ((beta, w), ...)
    gamma: sympy.Expr


def affine(alg: Algebra, expr: sympy.Expr, var: sympy.Symbol) -> Affine:
    """Decompose ``expr`` (element form) as affine in the matrix variable ``var``."""
    rows, cols = alg.dims
    functionals: dict = {}   # placeholder symbol -> weight w

    def functional(w):
        for sym, w0 in functionals.items():
            if sympy.cancel(w0 - w) == 0:
                return sym
        sym = sympy.Symbol(f"_phi{len(functionals)}", real=True)
        functionals[sym] = w
        return sym

    def normalise(e):
        """Replace var-dependent reductions by combinations of row functionals."""
        sub = {}
        for r in alg.reductions_in(e):
            if not alg.depends_on(r.body, var):
                continue
            body = r.body.xreplace(sub)
            if r.over == rows:
                raise NotRowSeparable(f"a sum over {rows} of an expression of {var}")
            parts = split(body)
            total = alg.reduce(parts.gamma, r.over)
            if parts.alpha != 0:
                total += functional(parts.alpha)
            for beta, phi in parts.terms:
                total += phi * alg.reduce(beta, r.over)
            sub[r.symbol] = total
        return e.xreplace(sub)

    def split(e):
        """Affine split of an expression already free of var-dependent reductions."""
        variables = [var, *functionals]
        alpha = sympy.diff(e, var)
        coeffs = [(sympy.diff(e, phi), phi) for phi in functionals]
        for c in [alpha, *(c for c, _ in coeffs)]:
            if any(v in c.free_symbols for v in variables):
                raise NotAffine(f"the expression is not affine in {var}")
        gamma = e.xreplace({v: 0 for v in variables})
        return Affine(alpha, tuple((c, phi) for c, phi in coeffs if c != 0), gamma)

    e = normalise(sympy.sympify(expr))
    parts = split(e)
    if alg.dims_of(parts.alpha) - {rows, cols}:
        raise NotAffine("unexpected dimensions")
    return Affine(parts.alpha, tuple((beta, functionals[phi]) for beta, phi in parts.terms), parts.gamma)


def is_affine(alg: Algebra, expr: sympy.Expr, var: sympy.Symbol) -> bool:
    """Whether ``expr`` is affine in ``var``, through reductions over any dimension."""
    expr = sympy.sympify(expr)
    dependent = [s for s in expr.free_symbols if s in alg.reductions and alg.depends_on(alg.reductions[s].body, var)]
    variables = {var, *dependent}
    for v in variables:
        if v in expr.free_symbols and sympy.diff(expr, v).free_symbols & variables:
            return False
    return all(is_affine(alg, alg.reductions[r].body, var) for r in dependent)


def _simplify(e):
    return sympy.factor_terms(sympy.cancel(sympy.together(e)))


def implicit_update(so: SymbolicObjective) -> sympy.Expr:
    """Closed-form minimiser of the objective in S, as an element expression in S_prev."""
    spec, alg = so.spec, so.algebra
    S = so.lowering.state
    src = spec.source
    g = gradient(alg, so.loss, S)
    try:
        parts = affine(alg, g, S)
    except NotAffine:
        raise DerivationError(src, "objective", "the objective is not quadratic in "
                              f"{spec.state}, so it has no closed-form minimiser; use update: explicit") from None
    except NotRowSeparable as e:
        if not is_affine(alg, g, S):
            raise DerivationError(src, "objective", "the objective is not quadratic in "
                                  f"{spec.state}, so it has no closed-form minimiser; use update: explicit") from None
        raise DerivationError(src, "objective", f"the objective couples the rows of {spec.state} ({e}); "
                              "the implicit update needs a row-separable objective; use update: explicit") from None
    alpha = _simplify(parts.alpha)
    if alpha == 0 and not parts.terms:
        raise DerivationError(src, "objective", f"the objective is linear in {spec.state}: it has no minimiser "
                              "(add a proximity term such as sq(S - S_prev)/2)")
    if alpha.is_positive is not True:
        raise DerivationError(src, "objective", f"cannot show the objective is strictly convex in {spec.state}: "
                              f"the coefficient of its quadratic part, {sympy.sstr(alpha)}, is not known to be "
                              "positive (declare the inputs or params in it positive)")
    if len(parts.terms) > 1:
        raise DerivationError(src, "objective", f"the normal equations have a rank-{len(parts.terms)} part "
                              "(Woodbury), which ssmcraft does not solve in closed form yet; use update: explicit")
    gamma = parts.gamma
    cols = spec.dims[1]
    if not parts.terms:
        return -gamma / alpha
    beta, w = parts.terms[0]
    ratio = _simplify(beta / w)
    if ratio.is_nonnegative is not True:
        raise DerivationError(src, "objective", f"cannot show the objective is convex in {spec.state}: "
                              f"the weight of its rank-1 part, {sympy.sstr(ratio)}, is not known to be "
                              "non-negative (declare it positive)")
    # row system s (diag(alpha) + w beta^T) = -gamma, solved by Sherman-Morrison
    y = -gamma / alpha
    num = alg.reduce(_simplify(y * w), cols)
    den = 1 + alg.reduce(_simplify(w * beta / alpha), cols)
    return y - num * (beta / alpha) / den


def explicit_update(so: SymbolicObjective) -> sympy.Expr:
    """One gradient step from S_prev: S_prev - grad L(S_prev)."""
    alg = so.algebra
    S, S_prev = so.lowering.state, so.lowering.state_prev
    g = gradient(alg, so.loss, S)
    return S_prev - alg.substitute(g, {S: S_prev})


def derive_update(so: SymbolicObjective) -> sympy.Expr:
    """The update F(S_prev) that the spec's ``update:`` asks for (element form)."""
    if so.spec.update == "implicit":
        return implicit_update(so)
    return explicit_update(so)


@dataclass(frozen=True)
class _StateView:
    """The part of a ``Lowering`` the single-state derivations read, for one of several states."""
    alg: Algebra
    state: sympy.Symbol
    state_prev: sympy.Symbol


def state_view(so: SymbolicObjective, index: int) -> SymbolicObjective:
    """State ``index`` of a several-state objective as a single-state one: its own loss, update and
    approximation, every other state (new or previous value) a constant symbol."""
    from dataclasses import replace
    spec = so.spec
    name = spec.states[index]
    view_spec = replace(spec, state=name, objective=spec.objectives[index], update=spec.updates[index],
                        approximation=spec.approximations[index], states=(), objectives=(), updates=(),
                        approximations=())
    new, prev = so.lowering.state_of(name)
    return SymbolicObjective(view_spec, _StateView(so.algebra, new, prev), so.losses[index][1], so.output)


def derive_stages(so: SymbolicObjective) -> tuple:
    """Several states, block-coordinate (Gauss-Seidel) in declaration order: per state
    ``(name, F)`` with ``F`` that state's own update (implicit minimiser or explicit step of its
    loss), reading the earlier states' new values and every ``X_prev``. Errors name
    ``objective.X`` (or ``approximation.X``)."""
    spec = so.spec
    out = []
    for i, name in enumerate(spec.states):
        if spec.approximations[i] != "exact":
            raise DerivationError(spec.source, f"approximation.{name}", "the diagonal approximation is not "
                                  "supported with several states (their update is classified general or nonlinear)")
        try:
            out.append((name, derive_update(state_view(so, i))))
        except DerivationError as e:
            key = f"objective.{name}" if e.key == "objective" else e.key
            raise DerivationError(e.source, key, e.problem) from None
    return tuple(out)


def compose_stages(so: SymbolicObjective, stages) -> tuple:
    """The stages' updates with every earlier state's new value replaced by its own update, so
    that each is an element expression in the previous states and the inputs only."""
    alg = so.algebra
    done: dict = {}
    out = []
    for name, F in stages:
        F = alg.substitute(F, done) if done else F
        done[so.lowering.state_of(name)[0]] = F
        out.append((name, F))
    return tuple(out)


def derive_updates(so: SymbolicObjective) -> tuple:
    """Several states: ``((name, F(previous states)), ...)`` in declaration order."""
    return compose_stages(so, derive_stages(so))
