"""Stage 3: derive the update ``S_t = F(S_prev)`` from the symbolic objective.

- ``gradient``: reverse-mode differentiation of the element-form loss with respect to one
  element of the state, through reductions (the adjoint of a reduction summed over the
  dimensions it does not carry becomes a new reduction). Term by term, so none of sympy's
  MatrixSymbol ``diff`` bugs apply.
- ``affine``: split an element expression that is affine in a matrix variable ``V`` into
  ``alpha * V + sum_r beta_r * (V w_r)_row + gamma``: the elementwise part, the row
  functionals ``(V w)_i = sum_j V_ij w_ij`` and the constant. Raises ``NotAffine`` or
  ``NotRowSeparable`` otherwise.
- ``implicit``: solve grad L(S) = 0 row by row. The row system
  ``s (diag(alpha) + sum_r beta_r w_r^T) = -gamma`` (diagonal plus rank r <= 4) is solved in
  closed form: Sherman-Morrison for r = 1, Woodbury with an r x r inverse (adjugate over
  determinant, over named reductions) for r = 2..4. Convexity: ``alpha > 0`` and the low-rank
  part written as ``W^T G W`` with ``G`` (row factors) positive semidefinite, every principal
  minor of its symmetric part shown non-negative by sympy.
- ``explicit``: one gradient step from ``S_prev``.
- ``newton``: one Newton step from ``S_prev``: the gradient linearised at ``S_prev``
  (``grad L(S_prev) + H(S_prev)[D] = 0``, the Hessian-vector product by reverse mode through
  ``sum G . grad L``) is affine in the step ``D`` and solved by the same row solver, so
  the Hessian at ``S_prev`` must be shown positive definite. On a quadratic loss it equals
  ``implicit``; on a non-quadratic one (e.g. pseudo-Huber regression) it is a robust implicit
  step and the recurrence is nonlinear.
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
    for s in sorted(loss.free_symbols, key=str):    # by name: the new reductions' numbering is the same every run
        if s == var:
            push(var, sympy.diff(loss, var), frozenset())
        elif s in alg.reductions and alg.depends_on(alg.reductions[s].body, var):
            push(s, sympy.diff(loss, s), frozenset())
    for r in reversed(order):           # outer reductions first: their adjoints are complete
        a = adj.pop(r.symbol, 0)
        if a == 0:
            continue
        body_dims = r.dims | {r.over}
        for s in sorted(r.body.free_symbols, key=str):
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
        """``sum_j V_ij w_ij`` as (row factors of w) * a functional symbol, so that ``lam_i k_j``
        and ``k_j`` give one functional (a Newton step on a row-weighted objective)."""
        row_factors = [f for f in sympy.Mul.make_args(w) if alg.dims_of(f) == {rows}]
        outer = sympy.Mul(*row_factors)
        w = sympy.Mul(*[f for f in sympy.Mul.make_args(w) if f not in row_factors])
        for sym, w0 in functionals.items():
            if sympy.cancel(w0 - w) == 0:
                return outer * sym
        sym = sympy.Symbol(f"_phi{len(functionals)}", real=True)
        functionals[sym] = w
        return outer * sym

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


def _forms(e):
    """Equivalent forms of ``e`` for sympy's sign queries, cheapest first (lazily): expanding
    ``(r - x)**2 + 1`` hides that it is positive, so unexpanded forms come before the
    canonical one, and ``sympy.simplify`` (which rebuilds such squares) comes last."""
    together = sympy.together(e)
    yield from (e, together, sympy.factor_terms(together))
    yield _simplify(e)
    yield sympy.factor(_simplify(e))
    yield sympy.simplify(e)


def _shown(e, sign: str) -> bool:
    """Whether sympy shows ``e`` positive / nonnegative in one of its forms."""
    return any(getattr(f, f"is_{sign}") is True for f in _forms(e))


def _shortest(e):
    return min(_forms(e), key=sympy.count_ops)


MAX_RANK = 4      # the largest low-rank part solved in closed form (an r x r inverse)


def _not_quadratic(so: SymbolicObjective, e: Exception) -> DerivationError:
    """The refusal when the gradient (linearised, for newton) is not affine or not row-separable."""
    spec, alg = so.spec, so.algebra
    src = spec.source
    if isinstance(e, NotRowSeparable) and is_affine(alg, gradient(alg, so.loss, so.lowering.state), so.lowering.state):
        return DerivationError(src, "objective", f"the objective couples the rows of {spec.state} ({e}); "
                               f"the {spec.update} update needs a row-separable objective; {USE_EXPLICIT}")
    if spec.update == "newton":
        return DerivationError(src, "objective", f"the Hessian of the objective couples the rows of {spec.state} "
                               f"({e}); one Newton step needs a row-separable Hessian; {USE_EXPLICIT}")
    return DerivationError(src, "objective", "the objective is not quadratic in "
                           f"{spec.state}, so it has no closed-form minimiser; {USE_EXPLICIT} {OR_NEWTON}")


USE_EXPLICIT = "use update: explicit"                        # the refusals' advice (derive_stages words it
OR_NEWTON = "(or update: newton for one Newton step)"       # per state: several states have no newton)


def _column_free_factors(alg: Algebra, terms, col: str):
    """``G`` with ``beta_r = sum_l G[r][l] w_l`` and every ``G[r][l]`` free of the column dimension,
    or None. Found by evaluating at R points of the column symbols, then verified symbolically."""
    R = len(terms)
    single = [[0] * R for _ in range(R)]      # first: every beta_r a multiple of one w_l (kept unexpanded)
    for r, (beta, _) in enumerate(terms):
        l = next((l for l, (_, w) in enumerate(terms) if col not in alg.dims_of(_simplify(beta / w))), None)
        if l is None:
            break
        single[r][l] = sympy.factor_terms(sympy.together(beta / terms[l][1]))
    else:
        return single
    col_syms = sorted((s for t in terms for e in t for s in e.free_symbols if col in alg.symbol_dims.get(s, ())),
                      key=lambda s: s.name)
    col_syms = list(dict.fromkeys(col_syms))
    for attempt in range(3):
        def at(e, p):
            # symbol i at point p: (i + 2)**(p + 1 + attempt) / (p + 2), Vandermonde-like (generic)
            return e.xreplace({s: sympy.Rational((i + 2) ** (p + 1 + attempt), p + 2) for i, s in enumerate(col_syms)})
        Wp = sympy.Matrix(R, R, lambda p, l: at(terms[l][1], p))
        if Wp.det() == 0:
            continue
        G = []
        for beta, _ in terms:
            sol = Wp.LUsolve(sympy.Matrix([at(beta, p) for p in range(R)]))
            G.append([_simplify(g) for g in sol])
        if all(_simplify(beta - sum(G[r][l] * terms[l][1] for l in range(R))) == 0 for r, (beta, _) in enumerate(terms)):
            return G
    return None


def _psd(G) -> tuple[bool, str]:
    """Whether the symmetric part of ``G`` is shown positive semidefinite (every principal minor
    non-negative); else the first minor sympy cannot sign."""
    from itertools import combinations
    R = len(G)
    Gs = sympy.Matrix(R, R, lambda r, l: (G[r][l] + G[l][r]) / 2)
    sizes = [1] if Gs.is_diagonal() else range(1, R + 1)    # a diagonal G: its entries suffice
    for size in sizes:
        for idx in combinations(range(R), size):
            minor = Gs.extract(list(idx), list(idx)).det(method="berkowitz")
            if not _shown(minor, "nonnegative"):
                known = "is negative" if _shown(minor, "negative") else "is not known to be non-negative"
                return False, f"{sympy.sstr(_shortest(minor))}, {known}"
    return True, ""


def solve_rows(so: SymbolicObjective, parts: Affine, what: str, simplify=_simplify) -> sympy.Expr:
    """Solve the row system ``alpha . s + sum_r beta_r (w_r . s) + gamma = 0`` for ``s`` (element
    form), after showing it is positive definite. ``what`` names the matrix in refusals;
    ``simplify`` is applied to the bodies of the sums it forms (the default cancels, which
    expands polynomials: a Newton step keeps ``(r - x)**2 + 1`` whole instead)."""
    spec, alg = so.spec, so.algebra
    src = spec.source
    alpha = _simplify(parts.alpha)
    if alpha == 0 and not parts.terms:
        raise DerivationError(src, "objective", f"the objective is linear in {spec.state}: it has no minimiser "
                              "(add a proximity term such as sq(S - S_prev)/2)")
    if not _shown(parts.alpha, "positive"):
        raise DerivationError(src, "objective", f"cannot show {what} is strictly convex in {spec.state}: "
                              f"the coefficient of its quadratic part, {sympy.sstr(alg.expand(alpha))}, is not known to be "
                              "positive (declare the inputs or params in it positive)")
    R = len(parts.terms)
    if R > MAX_RANK:
        raise DerivationError(src, "objective", f"the normal equations have a rank-{R} part; ssmcraft solves "
                              f"diagonal plus rank <= {MAX_RANK} in closed form (Woodbury); {USE_EXPLICIT}")
    gamma = parts.gamma
    cols = spec.dims[1]
    if not parts.terms:
        return -gamma / alpha
    if R == 1:
        beta, w = parts.terms[0]
        if not _shown(beta / w, "nonnegative"):
            raise DerivationError(src, "objective", f"cannot show {what} is convex in {spec.state}: "
                                  f"the weight of its rank-1 part, {sympy.sstr(alg.expand(_shortest(w / beta)))}, is not known to be "
                                  "non-negative (declare it positive)")
        # row system s (diag(alpha) + w beta^T) = -gamma, solved by Sherman-Morrison
        y = -gamma / alpha
        num = alg.reduce(simplify(y * w), cols)
        den = 1 + alg.reduce(simplify(w * beta / alpha), cols)
        return y - num * (beta / alpha) / den
    G = _column_free_factors(alg, parts.terms, cols)
    if G is None:
        raise DerivationError(src, "objective", f"cannot show {what} is convex in {spec.state}: its rank-{R} "
                              "part is not of the form W^T G W with G free of the column dimension")
    ok, minor = _psd(G)
    if not ok:
        raise DerivationError(src, "objective", f"cannot show {what} is convex in {spec.state}: a principal "
                              f"minor of the weights of its rank-{R} part, {minor} (declare the inputs in it positive)")
    # Woodbury: y = -gamma/alpha, M_rl = sum_j w_rj beta_lj / alpha_j, z = (I + M)^-1 W y,
    # s = y - sum_r z_r beta_r / alpha; the inverse as adjugate / determinant over named sums
    y = -gamma / alpha
    u = sympy.Matrix([alg.reduce(simplify(y * w), cols) for _, w in parts.terms])
    A = sympy.eye(R) + sympy.Matrix(R, R, lambda r, l: alg.reduce(simplify(parts.terms[r][1] * parts.terms[l][0] / alpha), cols))
    det = sympy.expand(A.det(method="berkowitz"))
    z = A.adjugate(method="berkowitz") * u
    return y - sum(sympy.expand(z[r]) * parts.terms[r][0] for r in range(R)) / (alpha * det)


def implicit_update(so: SymbolicObjective) -> sympy.Expr:
    """Closed-form minimiser of the objective in S, as an element expression in S_prev."""
    alg = so.algebra
    S = so.lowering.state
    g = gradient(alg, so.loss, S)
    try:
        parts = affine(alg, g, S)
    except (NotAffine, NotRowSeparable) as e:
        raise _not_quadratic(so, e) from None
    return solve_rows(so, parts, "the objective")


def newton_update(so: SymbolicObjective) -> sympy.Expr:
    """One Newton step from S_prev: ``S_prev + D`` with ``grad L(S_prev) + H(S_prev)[D] = 0``."""
    alg = so.algebra
    S, S_prev = so.lowering.state, so.lowering.state_prev
    rows, cols = so.spec.dims
    g = gradient(alg, so.loss, S)
    D = alg.symbol(D_SYMBOL, (rows, cols), real=True)
    return newton_solve(so, alg.substitute(g + hessian_vector(alg, g, S, D), {S: S_prev}), D)


D_SYMBOL = "_D"       # the Newton step's unknown


def hessian_vector(alg: Algebra, g, S, D) -> sympy.Expr:
    """``H(S)[D]``, the Hessian-vector product of the loss whose gradient is ``g``: reverse mode
    through ``sum G . D``."""
    rows, cols = alg.dims
    return gradient(alg, alg.reduce(alg.reduce(g * D, cols), rows), S)


def newton_solve(so: SymbolicObjective, linear, D) -> sympy.Expr:
    """``S_prev + D`` with ``linear`` (the gradient linearised in the step ``D``) = 0, solved row by
    row after showing its matrix positive definite."""
    alg, S_prev = so.algebra, so.lowering.state_prev
    try:
        parts = affine(alg, linear, D)
    except (NotAffine, NotRowSeparable) as e:
        raise _not_quadratic(so, e) from None
    # the linearised coefficients are small: sympy.simplify folds rho'' (e.g. 1/sqrt(u) - r**2/u**(3/2)
    # into 1/u**(3/2)) where cancel() would expand u = (r - x)**2 + 1
    parts = Affine(sympy.simplify(parts.alpha), tuple((sympy.simplify(b), sympy.simplify(w)) for b, w in parts.terms),
                   sympy.simplify(parts.gamma))
    return S_prev + solve_rows(so, parts, "the Hessian of the objective at S_prev (one Newton step)",
                               simplify=sympy.factor_terms)


def explicit_update(so: SymbolicObjective) -> sympy.Expr:
    """One gradient step from S_prev: S_prev - grad L(S_prev)."""
    alg = so.algebra
    S, S_prev = so.lowering.state, so.lowering.state_prev
    g = gradient(alg, so.loss, S)
    return S_prev - alg.substitute(g, {S: S_prev})
