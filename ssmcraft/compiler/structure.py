"""Stage 4: classify the derived update and build the IR.

The update ``F(S_prev)`` is decomposed as affine in ``S_prev`` (``derive.affine``):
no row functional -> a (scalar or elementwise) decay; one functional whose weight splits
into a row factor times a column vector -> identity-minus-rank-1 (``rank1``); anything
else linear -> ``general``; not affine -> ``nonlinear``. ``approximation: diagonal``
keeps the transition's diagonal ``a + beta * w`` (Longhorn's ``1 - eps k^2``) and the
input term. The per-token coefficients are simplified, named and CSE'd here.
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ssmcraft.compiler.derive import NotAffine, NotRowSeparable, affine, derive_update, derive_updates, is_affine
from ssmcraft.compiler.ir import Coefficient, ReductionIR, UpdateIR
from ssmcraft.compiler.symbolic import Algebra, SymbolicObjective
from ssmcraft.errors import DerivationError


def simplify(e) -> sympy.Expr:
    """Cheap canonical simplification for per-token coefficients (rational functions)."""
    e = sympy.cancel(sympy.together(sympy.sympify(e)))
    factored = sympy.factor(e)
    return factored if sympy.count_ops(factored) <= sympy.count_ops(e) else sympy.factor_terms(e)


def split_dims(alg: Algebra, e, row: str, col: str):
    """Split a product ``e`` into (row part incl. scalars, column part), or None."""
    rowp, colp = [], []
    for f in sympy.Mul.make_args(sympy.factor(e)):
        dims = alg.dims_of(f)
        if col not in dims:
            rowp.append(f)
        elif row not in dims:
            colp.append(f)
        else:
            return None
    return sympy.Mul(*rowp), sympy.Mul(*colp)


def _ordered(dims, order) -> tuple[str, ...]:
    return tuple(d for d in order if d in dims)


class _Builder:
    """Collects named coefficients, expressing later ones through earlier ones when shorter."""

    def __init__(self, alg: Algebra, order):
        self.alg, self.order = alg, order
        self.named: list[tuple[str, sympy.Expr]] = []
        self.slots: dict = {}

    def add(self, slot: str, expr, *, reuse: bool = True):
        expr = simplify(expr)
        if reuse:
            for name, value in self.named:
                if value.is_Symbol or value.is_number:
                    continue
                ratio = simplify(expr / value)
                if sympy.count_ops(ratio) < sympy.count_ops(expr) and ratio != 0:
                    expr = sympy.Symbol(name, real=True) * ratio
                    break
        name = f"_{slot}"
        self.named.append((name, expr))
        self.slots[slot] = name
        return sympy.Symbol(name, real=True)

    def build(self):
        """CSE the coefficients; return (coefficients, reductions used), both in order."""
        names = [n for n, _ in self.named]
        exprs = [e for _, e in self.named]
        temps, reduced = sympy.cse(exprs, symbols=sympy.numbered_symbols("_t", real=True), order="none")
        dims_table = dict(self.alg.symbol_dims)
        out = []

        def dims_of(e):
            ds = frozenset()
            for s in e.free_symbols:
                ds |= dims_table.get(s, frozenset())
            return ds

        pending = [(sym, value) for sym, value in temps]
        pending += [(sympy.Symbol(name, real=True), value) for name, value in zip(names, reduced)]
        defined, emitted = {sym for sym, _ in pending}, set()
        while pending:   # emit in dependency order (a CSE temp may use a named coefficient)
            ready = [(sym, value) for sym, value in pending if (value.free_symbols & defined) <= emitted]
            if not ready:
                raise AssertionError(f"cyclic coefficients: {pending}")
            for sym, value in ready:
                dims_table[sym] = dims_of(value)
                out.append(Coefficient(sym.name, value, _ordered(dims_table[sym], self.order)))
                emitted.add(sym)
            pending = [item for item in pending if item[0] not in emitted]
        reductions = []
        for c in out:
            for r in self.alg.reductions_in(c.expr):
                if r not in reductions:
                    reductions.append(r)
        return out, reductions


def _reduction_irs(reductions, order):
    return tuple(ReductionIR(r.symbol.name, r.body, r.over, _ordered(r.dims, order)) for r in reductions)


def classify(so: SymbolicObjective, F: sympy.Expr) -> UpdateIR:
    """Build the IR of update ``F`` (element form in S_prev) for the spec of ``so``."""
    spec, alg = so.spec, so.algebra
    row, col = spec.dims
    S, S_prev = so.lowering.state, so.lowering.state_prev
    common = dict(
        spec_name=spec.name, source=spec.source, dims=spec.dims, state=spec.state,
        inputs={k: v.shape for k, v in spec.inputs.items()},
        params={k: v.shape for k, v in spec.params.items()},
        update=spec.update, approximation=spec.approximation,
    )
    b = _Builder(alg, spec.dims)
    try:
        parts = affine(alg, F, S_prev)
        kind = None
    except NotAffine:
        parts, kind = None, "nonlinear"
    except NotRowSeparable:
        parts, kind = None, "general" if is_affine(alg, F, S_prev) else "nonlinear"

    if spec.approximation == "diagonal":
        if parts is None:
            raise DerivationError(spec.source, "approximation", f"the diagonal approximation needs a linear, "
                                  f"row-separable transition; this update is {kind}")
        a_expr = parts.alpha
        split = [split_dims(alg, -beta, row, col) for beta, _ in parts.terms]
        if len(parts.terms) == 1 and split[0] is not None:
            c = b.add("c", split[0][0])
            a_expr = parts.alpha - c * split[0][1] * parts.terms[0][1]
        else:
            a_expr = parts.alpha + sum(beta * w for beta, w in parts.terms)
        b.add("a", a_expr, reuse=False)
        kind = "scalar_decay" if not alg.dims_of(simplify(a_expr)) else "diagonal_decay"
        gamma = parts.gamma
    elif parts is not None:
        gamma = parts.gamma
        if not parts.terms:
            kind = "scalar_decay" if not alg.dims_of(simplify(parts.alpha)) else "diagonal_decay"
            b.add("a", parts.alpha, reuse=False)
        elif len(parts.terms) == 1:
            beta, w = parts.terms[0]
            split = split_dims(alg, -beta, row, col)
            if split is not None and row not in alg.dims_of(w):
                kind = "rank1"
                b.add("c", split[0])
                b.add("a", parts.alpha, reuse=False)
                b.add("u", w, reuse=False)
                b.add("v", split[1], reuse=False)
            else:
                kind = "general"
        else:
            kind = "general"

    if kind in ("scalar_decay", "diagonal_decay", "rank1"):
        pq = split_dims(alg, gamma, row, col)
        if pq is not None:
            b.add("p", pq[0])
            b.add("q", pq[1], reuse=False)
        else:
            b.add("B", gamma)

    # readout y = oc . (S oq) + oh
    readout, readout_reductions = None, ()
    try:
        out = affine(alg, so.output, S)
        split = split_dims(alg, out.terms[0][0], row, col) if len(out.terms) == 1 else None
        structured = out.alpha == 0 and split is not None and split[1] == 1 and row not in alg.dims_of(out.terms[0][1])
    except (NotAffine, NotRowSeparable):
        structured = False
    if structured:
        b.add("oc", split[0])
        b.add("oq", out.terms[0][1], reuse=False)
        if out.gamma != 0:
            b.add("oh", out.gamma)
    else:
        readout = so.output
        readout_reductions = _reduction_irs(alg.reductions_in(readout), spec.dims)

    coefficients, reductions = b.build()
    state_update, state_reductions = None, ()
    if kind in ("general", "nonlinear"):
        state_update = sympy.factor_terms(sympy.cancel(F))
        state_reductions = _reduction_irs(alg.reductions_in(F), spec.dims)
    for r in reductions:
        if alg.depends_on(r.body, S) or alg.depends_on(r.body, S_prev):
            raise AssertionError(f"coefficient reduction {r.symbol} depends on the state")
    ir = UpdateIR(kind=kind, reductions=_reduction_irs(reductions, spec.dims), coefficients=tuple(coefficients),
                  slots=dict(b.slots), state_reductions=state_reductions, state_update=state_update,
                  readout=readout, readout_reductions=readout_reductions, **common)
    return renumber(ir)


def renumber(ir: UpdateIR) -> UpdateIR:
    """Rename reductions to _r0, _r1, ... in order of use (stable names, stable hashes)."""
    groups = (ir.reductions, ir.state_reductions, ir.readout_reductions)
    names = list(dict.fromkeys(r.name for group in groups for r in group))
    new = {old: f"_r{i}" for i, old in enumerate(names)}

    def ren(e):
        if e is None:
            return None
        return e.xreplace({s: sympy.Symbol(new[s.name], **s.assumptions0) for s in e.free_symbols if s.name in new})

    def ren_group(group):
        return tuple(ReductionIR(new[r.name], ren(r.body), r.over, r.dims) for r in group)

    return replace(ir, reductions=ren_group(ir.reductions), state_reductions=ren_group(ir.state_reductions),
                   readout_reductions=ren_group(ir.readout_reductions),
                   coefficients=tuple(Coefficient(c.name, ren(c.expr), c.dims) for c in ir.coefficients),
                   state_update=ren(ir.state_update), readout=ren(ir.readout),
                   state_updates=tuple(ren(e) for e in ir.state_updates))


def is_linear_in(alg: Algebra, exprs, variables) -> bool:
    """Whether every expression is jointly affine in the matrix ``variables``: affine in each
    one, and still affine when all are replaced by one matrix ``Z`` (a product of two of them
    would become quadratic in ``Z``)."""
    Z = alg.symbol("_Z_joint", tuple(alg.dims), real=True)
    for e in exprs:
        if not all(is_affine(alg, e, v) for v in variables):
            return False
        if not is_affine(alg, alg.substitute(e, {v: Z for v in variables}), Z):
            return False
    return True


def classify_states(so: SymbolicObjective, updates) -> UpdateIR:
    """The IR of a several-state update ``((name, F), ...)`` (each ``F`` in the previous states):
    ``general`` when the joint recurrence is linear in the previous states, else ``nonlinear``;
    the readout is element-wise over the new states."""
    spec, alg = so.spec, so.algebra
    prevs = [so.lowering.state_of(x)[1] for x in spec.states]
    Fs = [F for _, F in updates]
    kind = "general" if is_linear_in(alg, Fs, prevs) else "nonlinear"
    state_reductions = []
    for F in Fs:
        for r in alg.reductions_in(F):
            if r not in state_reductions:
                state_reductions.append(r)
    ir = UpdateIR(spec_name=spec.name, source=spec.source, dims=spec.dims, state=spec.state,
                  inputs={k: v.shape for k, v in spec.inputs.items()},
                  params={k: v.shape for k, v in spec.params.items()},
                  update=spec.update, approximation=spec.approximation, kind=kind,
                  state_reductions=_reduction_irs(state_reductions, spec.dims),
                  readout=so.output, readout_reductions=_reduction_irs(alg.reductions_in(so.output), spec.dims),
                  states=tuple(spec.states), state_updates=tuple(sympy.factor_terms(sympy.cancel(F)) for F in Fs))
    return renumber(ir)


def build_ir(so: SymbolicObjective) -> UpdateIR:
    """Stages 3 and 4: derive the update and classify it."""
    if so.spec.states:
        return classify_states(so, derive_updates(so))
    return classify(so, derive_update(so))


def element_form(ir: UpdateIR) -> UpdateIR:
    """A structured update (decay or rank-1) rewritten element-wise, as a ``general`` IR: the
    same recurrence, with ``S_t[i, j]`` one expression in ``S_prev``, the leaves and reductions
    (``a S_prev - c (S_prev u) v + p q``, coefficients substituted). The fused one-token
    (decode) kernel is generated from it (``ssmcraft.kernels.decode``). General and nonlinear
    IRs are returned unchanged."""
    if ir.kind in ("general", "nonlinear"):
        return ir
    row, col = ir.dims
    expanded: dict = {}
    for c in ir.coefficients:
        expanded[c.name] = sympy.sympify(c.expr).xreplace(
            {sympy.Symbol(n, real=True): e for n, e in expanded.items()})

    def slot(name, default=None):
        key = ir.slots.get(name)
        return expanded[key] if key is not None else default
    S_prev = sympy.Symbol("S_prev", real=True)
    F = slot("a", 1) * S_prev
    F += slot("p") * slot("q") if "p" in ir.slots else slot("B")
    state_reductions = ()
    if ir.kind == "rank1":
        erase = sympy.Symbol("_rS", real=True)
        state_reductions = (ReductionIR("_rS", S_prev * slot("u"), col, (row,)),)
        F -= slot("c") * erase * slot("v")
    return replace(ir, kind="general", state_update=F, state_reductions=state_reductions,
                   spec_name=ir.spec_name + "_elem")
