"""Square states: a state ``X: [m, m]`` used as the metric of another state's proximity.

Recursive least squares minimises ``lam * tr((S - S_prev) R_prev (S - S_prev)^T) + |S k - x|^2``
(``lam*wsq(S - S_prev, R_prev) + sq(S*k - x)`` in the spec language) while the key covariance
``R`` accumulates ``R = lam R_prev + k k^T``. Neither fits the element form of
``ssmcraft.compiler.symbolic`` (an element of an [m, m] matrix has two indices over one
dimension), so the square parts are kept as placeholders and derived here:

- a square state's own loss is ``sum_i c_i sq(a_i X + E_i)`` (an isotropic quadratic: ``sq`` of a
  square expression with state terms), minimised in closed form,
  ``X_t = -(sum_i c_i a_i E_i) / (sum_i c_i a_i^2) = alpha X_prev + sum_r c_r u_r v_r^T``;
- a square state is read only as a metric, through its inverse: the runtime carries
  ``P = X^-1`` and updates it by Woodbury (Sherman-Morrison for one term),
  ``P_t = (P - P U (alpha I + V^T P U)^-1 V^T P) / alpha`` (``U = [c_r u_r]``, ``V = [v_r]``),
  after showing ``X`` stays symmetric positive definite (identity times c > 0 at the start,
  ``alpha > 0`` and every term ``c_r v_r v_r^T`` with ``c_r >= 0``);
- a [d, m] state whose loss holds ``c * wsq(v1 S + v0, X)`` and otherwise terms with a low-rank
  column Hessian (``sum_r beta_r w_r^T``, no elementwise curvature) has the row system
  ``s (K X + sum_r beta_r w_r^T) = -(b0 X + gamma)`` with ``K = 2 c v1^2``; times ``P / K`` on the
  right it is ``s + sum_r (w_r . s) b_r = y`` with ``b_r = beta_r P / K``,
  ``y = -b0 / K - gamma P / K``, solved by Woodbury over the ``w_r`` like any low-rank row system.
  ``gamma P`` is a *metric reduction*: a row vector times the square matrix ``P``
  (``Algebra.reduce(..., metric=P)``), which the generated code computes as ``v @ P``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ssmcraft.compiler.symbolic import MetricTerm, Reduction, _holders, _linear_in
from ssmcraft.errors import DerivationError, SpecError


@dataclass(frozen=True)
class SquareUpdate:
    """A square state's derived update ``X_t = alpha X_prev + sum_r c_r u_r v_r^T`` (``u_r, v_r``
    element expressions over the key dimension, ``alpha, c_r`` per-token scalars), carried by its
    inverse (``inverse_name``)."""
    state: str
    alpha: sympy.Expr
    terms: tuple          # ((c, u, v), ...)

    def show(self) -> str:
        outer = " + ".join(f"({sympy.sstr(c)}) outer({sympy.sstr(u)}, {sympy.sstr(v)})" for c, u, v in self.terms)
        return f"{sympy.sstr(self.alpha)}*{self.state}_prev" + (f" + {outer}" if outer else "")


def inverse_name(X: sympy.Symbol | str) -> str:
    """The generated code's name of a square state's inverse (``_inv_R``, ``_inv_R_prev``): a
    leading underscore, which no spec name has."""
    return f"_inv_{X if isinstance(X, str) else X.name}"


def square_update(so, name: str, key: str) -> SquareUpdate:
    """The closed-form minimiser of a square state's loss ``sum_i c_i sq(a_i X + E_i)``."""
    spec, alg, low = so.spec, so.algebra, so.lowering
    X, X_prev = low.square[name]
    loss = so.losses[spec.states.index(name)][1]

    def fail(problem):
        raise DerivationError(spec.source, key, problem)
    coefs, _ = _linear_in(loss, _holders(alg, loss, alg.square_norms), "sq() of a square expression", fail)
    den, E = sympy.Integer(0), []               # E: (weight, term) of the sum_i c_i a_i E_i
    for p, c in coefs.items():
        a = sum((t[1] for t in alg.square_norms[p].states() if t[2] == X), sympy.Integer(0))
        den += c * a ** 2
        E += [(c * a, t) for t in alg.square_norms[p].terms if not (t[0] == "state" and t[2] == X)]
    from ssmcraft.compiler.derive import _shown
    if not _shown(den, "positive"):
        fail(f"cannot show the loss is strictly convex in {name}: the weight of sq({name} ...), "
             f"{sympy.sstr(den)}, is not known to be positive")
    alpha, terms = sympy.Integer(0), []
    for w, t in E:
        if t[0] == "diag":
            fail(f"{name} changes by a diagonal term diag(...); its inverse has no closed-form update "
                 "(Sherman-Morrison/Woodbury need low-rank changes: outer(u, v))")
        if t[0] == "state":
            if t[2] != X_prev:
                fail(f"the loss of {name} reads another square state ({t[2].name}); it may read {name}_prev")
            alpha += -w * t[1] / den
        else:
            terms.append((-w / den, t[1], t[2]))
    others = [s for x in spec.state_names() if x not in low.square for s in low.state_of(x)]
    for e in (alpha, *(e for term in terms for e in term)):
        hit = next((s for s in others if alg.depends_on(e, s)), None)
        if hit is not None:
            fail(f"the loss of the square state {name} reads {hit.name}; it may read only the inputs, the "
                 f"params and {name}_prev")
    return _symmetric_psd(spec, alg, name, key, sympy.factor_terms(sympy.cancel(alpha)), terms, fail)


def _symmetric_psd(spec, alg, name, key, alpha, terms, fail) -> SquareUpdate:
    """The update with each term written ``c v v^T``, after showing the tracked state stays
    symmetric positive definite (its inverse, the metric, exists): initial value c I with c > 0,
    ``alpha > 0``, every ``c >= 0``; and at most ``MAX_RANK`` terms (the Woodbury inverse)."""
    from ssmcraft.compiler.derive import MAX_RANK, _shown
    col = spec.dims[1]
    init = spec.init_of(name)
    if init is None or init <= 0:
        fail(f"{name} is a metric, carried by its inverse, so it must start positive definite: declare "
             f"{name}: {{shape: [{col}, {col}], init: {{identity: c}}}} with c > 0")
    if not _shown(alpha, "positive"):
        fail(f"cannot show {name} stays positive definite: its decay {sympy.sstr(alpha)} is not known to be "
             "positive (declare the inputs in it positive or bounded)")
    if len(terms) > MAX_RANK:
        fail(f"{name} changes by {len(terms)} outer products; its inverse is updated in closed form for at most "
             f"{MAX_RANK} (Woodbury)")
    out = []
    for c, u, v in terms:
        ratio = sympy.factor_terms(sympy.cancel(c * u / v))
        if alg.dims_of(ratio):
            fail(f"{name} changes by outer({sympy.sstr(u)}, {sympy.sstr(v)}), which is not symmetric; a metric "
                 "must stay symmetric (outer(u, u))")
        if not _shown(ratio, "nonnegative"):
            fail(f"cannot show {name} stays positive definite: the weight {sympy.sstr(ratio)} of its outer product "
                 f"of {sympy.sstr(v)} is not known to be non-negative")
        out.append((ratio, v, v))
    return SquareUpdate(name, alpha, tuple(out))


def has_metric(so) -> bool:
    """Whether a (single-state view of a) loss reads a square state as a metric."""
    return bool(_holders(so.algebra, so.loss, so.algebra.metrics))


def metric_update(so):
    """The implicit minimiser of a [d, m] state's loss with a metric proximity ``c wsq(V, X)``
    (module docstring), an element expression reading ``X``'s inverse through metric reductions."""
    from ssmcraft.compiler.derive import (NotAffine, NotRowSeparable, _column_free_factors, _psd, _shown,
                                         _simplify, affine, gradient)
    spec, alg = so.spec, so.algebra
    S, rows_cols = so.lowering.state, spec.dims
    col = rows_cols[1]

    def fail(problem):
        raise DerivationError(spec.source, "objective", problem)
    if spec.update != "implicit":
        fail(f"a metric proximity wsq(V, X) needs update: implicit (the minimiser is solved with X's inverse, "
             f"which is what the runtime carries); got {spec.update}")
    holders = _holders(alg, so.loss, alg.metrics)
    coefs, rest = _linear_in(so.loss, holders, "wsq(V, X) with a square state X", fail)
    K, b0, X = sympy.Integer(0), sympy.Integer(0), None
    for p, c in coefs.items():
        t = alg.metrics[p]
        if alg.depends_on(c, S):
            fail("the weight of wsq(V, X) depends on the state")
        if X is not None and t.X != X:
            fail(f"the loss has two metrics ({X.name} and {t.X.name}); one square state per proximity")
        X = t.X
        v1 = sympy.diff(t.V, S)
        v0 = sympy.expand(t.V).xreplace({S: 0})
        if alg.dims_of(v1) or alg.depends_on(v1, S) or alg.depends_on(v0, S):
            fail(f"wsq(V, {X.name}) needs V = a*{spec.state} + (terms free of {spec.state}) with a scalar a")
        K += 2 * c * t.coef * v1 ** 2
        b0 += 2 * c * t.coef * v1 * v0
    if not _shown(K, "positive"):
        fail(f"cannot show the metric proximity's weight {sympy.sstr(K)} is positive")
    try:
        parts = affine(alg, gradient(alg, rest, S), S)
    except (NotAffine, NotRowSeparable) as e:
        fail(f"besides the metric proximity the loss must be quadratic and row-separable in {spec.state} ({e})")
    if _simplify(parts.alpha) != 0:
        fail(f"besides the metric proximity wsq(V, {X.name}) the loss curves every element of {spec.state} "
             f"(elementwise coefficient {sympy.sstr(_simplify(parts.alpha))}); (K {X.name} + diag)^-1 has no "
             f"closed form from {X.name}'s inverse: fold that term into the metric")
    R = len(parts.terms)
    from ssmcraft.compiler.derive import MAX_RANK
    if R > MAX_RANK:
        fail(f"the normal equations have a rank-{R} part besides the metric; at most {MAX_RANK} (Woodbury)")
    if R:
        G = _column_free_factors(alg, parts.terms, col)
        ok, minor = (False, "not of the form W^T G W") if G is None else _psd(G)
        if not ok:
            fail(f"cannot show the loss is convex in {spec.state}: its low-rank part, {minor}")
    P = sympy.Symbol(inverse_name(X), real=True)
    y = -b0 / K - alg.reduce(parts.gamma, col, metric=P) / K
    bs = [alg.reduce(beta, col, metric=P) / K for beta, _ in parts.terms]
    if not R:
        return y
    u = sympy.Matrix([alg.reduce(_simplify(y * w), col) for _, w in parts.terms])
    A = sympy.eye(R) + sympy.Matrix(R, R, lambda r, l: alg.reduce(parts.terms[r][1] * bs[l], col))
    if R == 1:
        return y - u[0] * bs[0] / A[0, 0]
    det = sympy.expand(A.det(method="berkowitz"))
    z = A.adjugate(method="berkowitz") * u
    return y - sum(sympy.expand(z[r]) * bs[r] for r in range(R)) / det


def show(alg, e) -> str:
    """``e`` with explicit sums (``Algebra.expand``) and the square placeholders written out:
    ``sq(R - lam*R_prev - outer(k, k))``, ``wsq(V, lam*R_prev)``; a ``SquareUpdate`` as its formula."""
    if isinstance(e, SquareUpdate):
        return e.show()
    text = lambda x: sympy.sstr(alg.expand(x))     # noqa: E731
    sub = {}
    for p in sympy.sympify(e).free_symbols:
        if p in alg.square_norms:
            sub[p] = sympy.Symbol(f"sq({_show_square(alg.square_norms[p], text)})")
        elif p in alg.metrics:
            t = alg.metrics[p]
            sub[p] = sympy.Symbol(f"wsq({text(t.V)}, {sympy.sstr(t.coef * t.X)})")
    return text(sympy.sympify(e).xreplace(sub))


def _show_square(sq, text) -> str:
    parts = []
    for t in sq.terms:
        if t[0] == "state":
            parts.append(sympy.sstr(t[1] * t[2]))
        elif t[0] == "outer":
            parts.append(f"outer({text(t[1])}, {text(t[2])})")
        else:
            parts.append(f"diag({text(t[1])})")
    return " + ".join(parts)
