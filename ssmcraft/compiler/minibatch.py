"""``approximation: {minibatch: C}``: explicit (or Newton) steps whose data gradients are taken at
the state before the chunk, as TTT and Titans train nonlinear memories in parallel.

Tokens t = 0..T-1 fall in chunks j of C tokens (t = jC..jC+C-1; the last one may be shorter).
``S_c`` is the state before chunk j (the initial state for j = 0). The loss splits into the
terms that read ``S_prev`` (proximity, retention: stepped at the running state ``S_{t-1}``, as
Titans' decay is) and the rest, the data loss (its gradient, and for Newton its Hessian, taken
at ``S_c``):

- explicit: ``S_t = S_{t-1} - grad L_ret(S_{t-1}) - grad L_data(S_c)``; for DeltaNet
  ``S_t = S_c - sum_{tau = jC..t} beta_tau (S_c k_tau - x_tau) k_tau^T``;
- newton: ``S_t = S_{t-1} + D`` with ``grad L_ret(S_{t-1}) + H_ret(S_{t-1}) D + grad L_data(S_c) +
  H_data(S_c) D = 0``, solved row by row like one Newton step.

The update reads ``S_prev`` and the anchor symbol ``_S_c``. When it is ``a . S_prev + G(S_c)``
with an elementwise ``a`` free of ``S_c`` (every explicit step whose retention is a decay, and
Newton with a plain proximity), the states of a chunk are one scan over ``G`` computed for all its
tokens at once (``UpdateIR.minibatch_decay``; ``ssmcraft.ops.common.reference.minibatch``).
"""
from __future__ import annotations

import sympy

from ssmcraft.errors import DerivationError

def anchor_name(state: str) -> str:
    """The generated code's name of a state's value before the chunk (``_S_c``; no spec name has a
    leading underscore)."""
    return f"_{state}_c"


ANCHOR = anchor_name("S")


def split_loss(alg, loss, S_prev) -> tuple:
    """(terms that read S_prev, the rest): the loss's additive terms, multiplication distributed."""
    ret, data = [], []
    for term in sympy.Add.make_args(sympy.expand_mul(loss)):
        (ret if alg.depends_on(term, S_prev) else data).append(term)
    return sympy.Add(*ret), sympy.Add(*data)


def anchor(alg, state: str = "S", like=None):
    """The symbol of a state's value before the chunk (element form over the dimensions of ``like``,
    the state's symbol; the state dims by default)."""
    name = anchor_name(state)
    existing = next((s for s in alg.symbol_dims if s.name == name), None)
    dims = alg.symbol_dims[like] if like is not None else alg.dims
    return existing if existing is not None else alg.symbol(name, dims, real=True)


def minibatch_update(so) -> sympy.Expr:
    """The update of one token within a chunk, in ``S_prev`` and the anchor ``_S_c`` (module docstring)."""
    from ssmcraft.compiler.derive import D_SYMBOL, gradient, hessian_vector, newton_solve
    spec, alg = so.spec, so.algebra
    S, S_prev = so.lowering.state, so.lowering.state_prev
    Sc = anchor(alg, spec.state, S)
    # the data loss at the chunk's start: this state at its anchor, and so every other state (several
    # states: the memory's other weights, new or previous value, at theirs)
    at_start = {S: Sc}
    for name, new, prev in getattr(so.lowering, "others", ()):
        at_start[new] = at_start[prev] = anchor(alg, name, new)
    ret, data = split_loss(alg, so.loss, S_prev)
    if data == 0 or not alg.depends_on(data, S):
        raise DerivationError(spec.source, "approximation.minibatch", "every term of the objective that depends "
                              f"on {spec.state} also reads S_prev; a mini-batch takes the data loss's gradient at the "
                              "chunk's start, and this objective has none")
    g_ret, g_data = gradient(alg, ret, S), gradient(alg, data, S)
    if spec.update == "explicit":
        return S_prev - alg.substitute(g_ret, {S: S_prev}) - alg.substitute(g_data, at_start)
    D = alg.symbol(D_SYMBOL, spec.dims, real=True)
    linear = (alg.substitute(g_ret + hessian_vector(alg, g_ret, S, D), {S: S_prev})
              + alg.substitute(g_data + hessian_vector(alg, g_data, S, D), at_start))
    return newton_solve(so, linear, D)


def chunk_decay(alg, F, S_prev, anchors=None):
    """``a`` when ``F = a . S_prev + G`` with ``a`` elementwise and free of the anchors (the chunk's
    states are then one scan), else None. ``F`` is tested with ``S_prev`` as a free symbol: an update
    that also reads another state's previous value (not its anchor) is not of that form."""
    from ssmcraft.compiler.derive import NotAffine, NotRowSeparable, affine, is_affine
    anchors = anchors if anchors is not None else [anchor(alg)]
    if alg.dims_of(S_prev) != frozenset(alg.dims):          # affine() splits over (d, m) rows: test directly
        a = sympy.diff(F, S_prev)
        ok = is_affine(alg, F, S_prev) and not alg.depends_on(a, S_prev)
        G = F - a * S_prev
        if not ok or alg.depends_on(G, S_prev) or any(alg.depends_on(a, x) for x in anchors):
            return None
        return sympy.factor_terms(sympy.cancel(a))
    try:
        parts = affine(alg, F, S_prev)
    except (NotAffine, NotRowSeparable):
        return None
    if parts.terms or any(alg.depends_on(parts.alpha, x) for x in anchors):
        return None
    return sympy.factor_terms(sympy.cancel(parts.alpha))
