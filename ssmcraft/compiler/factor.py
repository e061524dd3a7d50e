"""Stage 4a: reductions over one state dimension whose body also varies over the other one,
split into sums of smaller reductions.

The implicit minimiser of a regression on several keys sums over ``m`` bodies such as
``k (beta k x + beta k2 x2)``: a ``[d]`` value per token whose body spans ``[d, m]``. Every factor
that varies only over ``d`` can leave the sum: ``beta x sum_m k^2 + beta x2 sum_m k k2``, two
``m``-sums of ``m``-vectors (here both are reductions the update already has). Code generated
from the IR then never builds a ``[d, m]`` tile per token (``ssmcraft.ops.codegen.prologue`` tiles
many tokens per program when no reduction spans both dimensions), and the coefficients simplify
further once their reductions are shared (the Woodbury input term of a two-key regression
loses the terms that cancelled only inside the sums).

A reduction is rewritten only when *every* term of its expanded body leaves a smaller reduction
(fewer free dimensions than the original): a body with a genuinely two-dimensional part (the state,
a ``[d, m]`` param) gains nothing from the split and is kept as it is; so is a reduction over
a square matrix (a metric). The rewrite is exact algebra (distribution of the sum over the body's
terms); the tests check it numerically against the unfactored update. The structure stage applies
it to every per-token coefficient (``structure._Builder``) and records what it rewrote in the
IR (``UpdateIR.factored``, printed by ``ssmcraft derive``).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ssmcraft.compiler.symbolic import Algebra


@dataclass(frozen=True)
class Factoring:
    """``sum_over body`` rewritten as ``expr`` (over smaller reductions)."""
    body: sympy.Expr
    over: str
    expr: sympy.Expr


def split_terms(alg: Algebra, body, over: str):
    """``body`` as ``[(outer, inner), ...]`` with ``sum_over body = sum outer * sum_over inner``:
    the expanded terms grouped by their factors that vary over ``over`` (``inner``); None when some
    term has no such factor (its sum would be a size times the term, not a reduction)."""
    groups: dict = {}
    for term in sympy.Add.make_args(sympy.expand(body, power_exp=False, log=False, deep=False)):
        inner, outer = [], []
        for f in sympy.Mul.make_args(term):
            (inner if over in alg.dims_of(f) else outer).append(f)
        if not inner:
            return None
        key = sympy.Mul(*inner)
        groups[key] = groups.get(key, 0) + sympy.Mul(*outer)
    return [(outer, inner) for inner, outer in groups.items()]


def factor_sums(alg: Algebra, e, per_token: bool = False) -> tuple[sympy.Expr, list[Factoring]]:
    """``e`` with every reduction it reads (directly or through others) factored where the module
    docstring says, and the rewrites made (inner reductions first). With ``per_token``, a sum that
    leaves no dimension (one value per token, ``sum_m (k + k2)^2``) is split too, into the sums of
    its monomials (``k.k + 2 k.k2 + k2.k2``): reductions are hash-consed by body, so code generated
    from several such sums computes each product of keys once (``ssmcraft.ops.codegen.prologue``)."""
    e = sympy.sympify(e)
    sub: dict = {}
    done: list[Factoring] = []
    for r in alg.reductions_in(e):
        if r.metric is not None or not (r.dims or per_token):
            continue
        body = r.body.xreplace(sub)
        groups = split_terms(alg, body, r.over)
        if groups is None or any(r.dims and not (alg.dims_of(inner) - {r.over}) < r.dims for _, inner in groups):
            if body != r.body:          # an inner reduction was rewritten: this one reads the new form
                sub[r.symbol] = alg.reduce(body, r.over)
            continue
        expr = sympy.Add(*(outer * alg.reduce(inner, r.over) for outer, inner in groups))
        sub[r.symbol] = expr
        done.append(Factoring(r.body, r.over, expr))
    return (e.xreplace(sub) if sub else e), done
