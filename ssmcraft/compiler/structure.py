"""Stage 4: classify the derived update and build the IR.

The update ``F(S_prev)`` is decomposed as affine in ``S_prev`` (``derive.affine``):
no row functional -> a (scalar or elementwise) decay; one functional whose weight splits
into a row factor times a column vector -> identity-minus-rank-1 (``rank1``); up to
``MAX_RANK`` functionals over column vectors whose weights are sums of row factors times
at most ``MAX_RANK`` column vectors -> ``rankr`` (several keys, Woodbury updates); anything
else linear -> ``general``; not affine -> ``nonlinear``. ``approximation: diagonal``
keeps the transition's diagonal ``a + beta * w`` (Longhorn's ``1 - eps k^2``) and the
input term. The per-token coefficients are simplified, named and CSE'd here.
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ssmcraft.compiler.factor import factor_sums
from ssmcraft.compiler.updates import derive_update, derive_updates
from ssmcraft.compiler.derive import (MAX_RANK, NotAffine, NotRowSeparable, affine,
                                     is_affine)
from ssmcraft.compiler.ir import Coefficient, ReductionIR, UpdateIR
from ssmcraft.compiler.metric import inverse_name
from ssmcraft.compiler.symbolic import Algebra, SymbolicObjective
from ssmcraft.errors import DerivationError


LARGE = 150      # operations: above this a coefficient is not simplified nor reused (multivariate
                 # gcds and factoring of a rank-4 Woodbury coefficient take minutes)


def simplify(e) -> sympy.Expr:
    """Cheap canonical simplification for per-token coefficients (rational functions); a large
    one (a rank-3/4 Woodbury coefficient, already a ratio of polynomials) is kept as it is."""
    e = sympy.sympify(e)
    if sympy.count_ops(e) > LARGE:
        return e
    e = sympy.cancel(sympy.together(e))
    factored = sympy.factor(e)
    return factored if sympy.count_ops(factored) <= sympy.count_ops(e) else sympy.factor_terms(e)


def split_dims(alg: Algebra, e, row: str, col: str, factor: bool = True):
    """Split a product ``e`` into (row part incl. scalars, column part), or None. ``factor=False``
    (the terms of an expanded sum) tries the product as it is before factoring it."""
    rowp, colp = [], []
    for f in sympy.Mul.make_args(sympy.factor(e) if factor else e):
        dims = alg.dims_of(f)
        if col not in dims:
            rowp.append(f)
        elif row not in dims:
            colp.append(f)
        else:
            return None if factor else split_dims(alg, e, row, col)
    return sympy.Mul(*rowp), sympy.Mul(*colp)


def by_column(alg: Algebra, e, vs: list, row: str, col: str, grow: bool = True):
    """``e`` as ``sum_r f_r v_r`` with row factors ``f_r`` and column vectors ``v_r`` in ``vs``
    (appended to it when ``grow``): {r: f_r}, or None if some term does not split."""
    num, den = sympy.fraction(sympy.together(e))
    # a weighted proximity divides by a column vector; a Woodbury determinant is column-free
    # (and too large to factor quickly)
    den_split = (den, 1) if col not in alg.dims_of(den) else split_dims(alg, den, row, col)
    if den_split is None:
        return None
    den, den_col = den_split
    out: dict = {}
    for term in sympy.Add.make_args(sympy.expand(num)):
        split = split_dims(alg, term, row, col, factor=False)
        if split is None:
            return None
        rowp, colp = split[0], split[1] / den_col
        idx = next((i for i, v in enumerate(vs) if v == colp), None)
        if idx is None:
            if not grow:
                return None
            vs.append(colp)
            idx = len(vs) - 1
        out[idx] = out.get(idx, 0) + rowp
    return {i: c / den for i, c in out.items()}


def merge_proportional(alg: Algebra, terms, col: str) -> tuple:
    """Terms ``beta_l (S_prev w_l)`` with ``w_l`` a column-constant multiple of an earlier ``w``
    folded into that one (``alpha k`` and ``k`` are one functional, e.g. a Newton step on Gated
    Longhorn)."""
    kept: list = []
    for beta, w in terms:
        for i, (beta0, w0) in enumerate(kept):
            ratio = simplify(w / w0)
            if col not in alg.dims_of(ratio):
                kept[i] = (beta0 + beta * ratio, w0)
                break
        else:
            kept.append((beta, w))
    return tuple(kept)


def low_rank(alg: Algebra, terms, row: str, col: str):
    """Write ``sum_l beta_l (S_prev u_l)`` as ``-sum_{r,l} C[r][l] (S_prev u_l) v_r`` with column
    vectors ``u_l, v_r`` and row factors ``C[r][l]`` (0 where absent): (us, vs, C), or None when
    some ``u`` varies over rows, some weight does not split, or more than ``MAX_RANK`` vectors."""
    us = [w for _, w in terms]
    if len(us) > MAX_RANK or any(row in alg.dims_of(u) for u in us):
        return None
    vs: list = []
    columns = []                             # per l: {v index: row factor}
    for beta, _ in terms:
        by_v = by_column(alg, -beta, vs, row, col)
        if by_v is None:
            return None
        columns.append(by_v)
    if len(vs) > MAX_RANK:
        return None
    C = [[columns[l].get(r, 0) for l in range(len(us))] for r in range(len(vs))]
    return us, vs, C


def _ordered(dims, order) -> tuple[str, ...]:
    return tuple(d for d in order if d in dims)


class _Builder:
    """Collects named coefficients, expressing later ones through earlier ones when shorter; with
    ``factor``, their reductions factored first (``ssmcraft.compiler.factor``, kept in ``factored``)."""

    def __init__(self, alg: Algebra, order, factor: bool = True):
        self.alg, self.order, self.factor = alg, order, factor
        self.named: list[tuple[str, sympy.Expr]] = []
        self.slots: dict = {}
        self.factored: list = []

    def add(self, slot: str, expr, *, reuse: bool = True, if_nonzero: bool = False):
        if self.factor:
            expr, done = factor_sums(self.alg, expr)
            self.factored += [f for f in done if f not in self.factored]
        expr = simplify(expr)
        if if_nonzero and expr == 0:      # a term that vanishes gets no slot
            return
        if reuse and sympy.count_ops(expr) <= LARGE:
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
    order = (*order, *sorted({d for r in reductions for d in r.dims} - set(order)))    # hidden dims last
    return tuple(ReductionIR(r.symbol.name, r.body, r.over, _ordered(r.dims, order),
                             **({"metric": r.metric.name} if r.metric is not None else {})) for r in reductions)


def _rankr_slots(alg, b: "_Builder", parts, lr, row: str, col: str) -> None:
    """The ``rankr`` slots: row factors ``c{r}{l}``, decay ``a``, keys ``u{l}``, ``v{r}`` and the
    input term over the same column vectors, ``B = sum_r p_r v_r^T`` (no ``[d, m]`` tensor) where
    it lies in their span, else a ``B`` slot."""
    us, vs, C = lr
    for r in range(len(vs)):
        for l in range(len(us)):
            b.add(f"c{r}{l}", C[r][l], if_nonzero=True)
    b.add("a", parts.alpha, reuse=False)
    for l, u in enumerate(us):
        b.add(f"u{l}", u, reuse=False)
    for r, v in enumerate(vs):
        b.add(f"v{r}", v, reuse=False)
    inputs = by_column(alg, parts.gamma, vs, row, col, grow=False) if parts.gamma != 0 else {}
    if inputs is not None:
        for r, f in sorted(inputs.items()):
            b.add(f"p{r}", f, if_nonzero=True)
    else:
        b.add("B", parts.gamma)


def _readout_slots(so: SymbolicObjective, b: "_Builder") -> tuple:
    """The readout ``y = oc . (S oq) + oh`` as slots where it has that form (``(None, ())``), else
    the element readout and its reductions."""
    alg, spec = so.algebra, so.spec
    row, col = spec.dims
    try:
        out = affine(alg, so.output, so.lowering.state)
        split = split_dims(alg, out.terms[0][0], row, col) if len(out.terms) == 1 else None
        structured = out.alpha == 0 and split is not None and split[1] == 1 and row not in alg.dims_of(out.terms[0][1])
    except (NotAffine, NotRowSeparable):
        structured = False
    if not structured:
        return so.output, _reduction_irs(alg.reductions_in(so.output), spec.dims)
    b.add("oc", split[0])
    b.add("oq", out.terms[0][1], reuse=False)
    if out.gamma != 0:
        b.add("oh", out.gamma)
    return None, ()


def classify(so: SymbolicObjective, F: sympy.Expr, factor: bool = True) -> UpdateIR:
    """Build the IR of update ``F`` (element form in S_prev) for the spec of ``so``; ``factor=False``
    keeps the coefficients' reductions as derived (the tests' unfactored form)."""
    if so.spec.minibatch:
        return classify_minibatch(so, F)
    spec, alg = so.spec, so.algebra
    row, col = spec.dims
    S, S_prev = so.lowering.state, so.lowering.state_prev
    common = dict(
        spec_name=spec.name, source=spec.source, dims=spec.dims, state=spec.state,
        inputs={k: v.shape for k, v in spec.inputs.items()},
        params={k: v.shape for k, v in spec.params.items()},
        update=spec.update, approximation=spec.approximation,
    )
    b = _Builder(alg, spec.dims, factor)
    try:
        parts = affine(alg, F, S_prev)
        if len(parts.terms) > 1:
            parts = replace(parts, terms=merge_proportional(alg, parts.terms, col))
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
        if kind == "general":
            lr = low_rank(alg, parts.terms, row, col)
            if lr is not None:
                kind = "rankr"
                _rankr_slots(alg, b, parts, lr, row, col)

    if kind in ("scalar_decay", "diagonal_decay", "rank1"):
        pq = split_dims(alg, gamma, row, col)
        if pq is not None:
            b.add("p", pq[0])
            b.add("q", pq[1], reuse=False)
        else:
            b.add("B", gamma)

    readout, readout_reductions = _readout_slots(so, b)

    coefficients, reductions = b.build()
    state_update, state_reductions = None, ()
    if kind in ("general", "nonlinear"):
        state_update = sympy.factor_terms(sympy.cancel(F))
        if spec.update == "newton":    # cancel() expands (r - x)**2 + 1 under square roots
            state_update = min((state_update, sympy.factor_terms(sympy.together(F))), key=sympy.count_ops)
        state_reductions = _reduction_irs(alg.reductions_in(F), spec.dims)
    for r in reductions:
        if alg.depends_on(r.body, S) or alg.depends_on(r.body, S_prev):
            raise AssertionError(f"coefficient reduction {r.symbol} depends on the state")
    ir = UpdateIR(kind=kind, reductions=_reduction_irs(reductions, spec.dims), coefficients=tuple(coefficients),
                  slots=dict(b.slots), state_reductions=state_reductions, state_update=state_update,
                  readout=readout, readout_reductions=readout_reductions,
                  factored=tuple(b.factored),
                  **common)
    return renumber(ir)


def classify_minibatch(so: SymbolicObjective, F) -> UpdateIR:
    """The IR of a mini-batch update ``F(S_prev, _S_c)`` (``ssmcraft.compiler.minibatch``): element-wise,
    ``general`` when jointly linear in the previous state and the anchor, else ``nonlinear``, with the
    chunk's decay when the update is ``a . S_prev + G(_S_c)``."""
    from ssmcraft.compiler.minibatch import anchor, chunk_decay
    spec, alg = so.spec, so.algebra
    S_prev = so.lowering.state_prev
    kind = "general" if is_linear_in(alg, [F], [S_prev, anchor(alg)]) else "nonlinear"
    update = sympy.factor_terms(sympy.cancel(F))
    if spec.update == "newton":    # cancel() expands (r - x)**2 + 1 under square roots
        update = min((update, sympy.factor_terms(sympy.together(F))), key=sympy.count_ops)
    decay = chunk_decay(alg, F, S_prev)
    ir = UpdateIR(spec_name=spec.name, source=spec.source, dims=spec.dims, state=spec.state,
                  inputs={k: v.shape for k, v in spec.inputs.items()},
                  params={k: v.shape for k, v in spec.params.items()},
                  update=spec.update, approximation=spec.approximation, kind=kind,
                  state_reductions=_reduction_irs(alg.reductions_in(sympy.Add(F, decay or 0)), spec.dims),
                  state_update=update, readout=so.output,
                  readout_reductions=_reduction_irs(alg.reductions_in(so.output), spec.dims),
                  minibatch=spec.minibatch, minibatch_decay=decay)
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
        return tuple(ReductionIR(new[r.name], ren(r.body), r.over, r.dims, r.metric) for r in group)

    return replace(ir, reductions=ren_group(ir.reductions), state_reductions=ren_group(ir.state_reductions),
                   readout_reductions=ren_group(ir.readout_reductions),
                   coefficients=tuple(Coefficient(c.name, ren(c.expr), c.dims) for c in ir.coefficients),
                   state_update=ren(ir.state_update), readout=ren(ir.readout),
                   minibatch_decay=(tuple(ren(a) for a in ir.minibatch_decay) if isinstance(ir.minibatch_decay, tuple)
                                    else ren(ir.minibatch_decay)),
                   state_updates=tuple(ren(e) for e in ir.state_updates),
                   inverses=tuple((x, ren(a), tuple(tuple(ren(e) for e in t) for t in terms))
                                  for x, a, terms in ir.inverses),
                   factored=tuple(replace(f, body=ren(f.body), expr=ren(f.expr)) for f in ir.factored))


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
    square = spec.square_states()
    prevs = [so.lowering.state_of(x)[1] for x in spec.states if x not in square]
    inverses = tuple((x, F.alpha, F.terms) for x, F in updates if x in square)
    updates = tuple((x, sympy.Symbol(inverse_name(x), real=True) if x in square else F) for x, F in updates)
    Fs = [F for x, F in updates if x not in square]
    # a tracked inverse's update is rational in its previous value: the joint recurrence is nonlinear
    # (states over hidden dimensions: a deep memory, nonlinear in its weights)
    kind = "general" if not spec.shapes and is_linear_in(alg, Fs, prevs) else "nonlinear"
    state_reductions = []
    for F in [e for _, a, terms in inverses for e in (a, *(x for t in terms for x in t))] + Fs:
        for r in alg.reductions_in(F):
            if r not in state_reductions:
                state_reductions.append(r)
    ir = UpdateIR(spec_name=spec.name, source=spec.source, dims=spec.dims, state=spec.state,
                  inputs={k: v.shape for k, v in spec.inputs.items()},
                  params={k: v.shape for k, v in spec.params.items()},
                  update=spec.update, approximation=spec.approximation, kind=kind,
                  state_reductions=_reduction_irs(state_reductions, spec.dims),
                  readout=so.output, readout_reductions=_reduction_irs(alg.reductions_in(so.output), spec.dims),
                  states=tuple(spec.states),
                  state_updates=tuple(F if x in square else sympy.factor_terms(sympy.cancel(F)) for x, F in updates),
                  **(_square_fields(spec, inverses, alg) if spec.shapes else {}),
                  **(_minibatch_fields(so, updates) if spec.minibatch else {}))
    return renumber(ir)


def _minibatch_fields(so: SymbolicObjective, updates) -> dict:
    """A several-state mini-batch: C, and the chunk decays ``(a_X, ...)`` when every update is
    ``a_X . X_prev + G_X(anchors)`` with no other state's previous value in it (None otherwise)."""
    from ssmcraft.compiler.minibatch import anchor, chunk_decay
    alg, spec = so.algebra, so.spec
    prevs = {x: so.lowering.state_of(x)[1] for x in spec.states}
    anchors = [anchor(alg, x, so.lowering.state_of(x)[0]) for x in spec.states]
    decays = []
    for x, F in updates:
        others = [p for y, p in prevs.items() if y != x]
        a = None if any(alg.depends_on(F, p) for p in others) else chunk_decay(alg, F, prevs[x], anchors)
        decays.append(a)
    return {"minibatch": spec.minibatch, "minibatch_decay": None if any(a is None for a in decays) else tuple(decays)}


def _square_fields(spec, inverses, alg) -> dict:
    """The IR fields of square states (``UpdateIR.state_shapes``), their updates' vectors simplified."""
    return {"state_shapes": {x: spec.shape_of(x) for x in spec.states},
            "hidden": {h: (factor, base) for h, factor, base in spec.hidden},
            "inits": {x: spec.init_of(x) for x in spec.states if spec.init_of(x) is not None},
            "inverses": tuple((x, simplify(a), tuple((simplify(c), u, v) for c, u, v in terms))
                              for x, a, terms in inverses)}


def build_ir(so: SymbolicObjective, factor: bool = True) -> UpdateIR:
    """Stages 3 and 4: derive the update and classify it (``factor``: as ``classify``)."""
    if so.spec.states:
        return classify_states(so, derive_updates(so))
    return classify(so, derive_update(so), factor)


def element_form(ir: UpdateIR) -> UpdateIR:
    """A structured update (decay, rank-1 or rank-r) rewritten element-wise, as a ``general``
    IR: the same recurrence, with ``S_t[i, j]`` one expression in ``S_prev``, the leaves and
    reductions (``a S_prev - sum_rl c_rl (S_prev u_l) v_r + B``, coefficients substituted; one
    erase ``c (S_prev u) v`` for rank-1, ``B = p q`` or ``sum_r p_r v_r`` by the slots). The
    fused one-token (decode) kernel and the row-tiled rank-r kernel are generated from it
    (``ssmcraft.ops.decode.step``, ``ssmcraft.ops.general.recurrent``). General and nonlinear IRs are
    returned unchanged. Computed once per IR object and kept on it (``UpdateIR.memo``)."""
    if ir.kind in ("general", "nonlinear"):
        return ir
    return ir.memo("element_form", lambda: _element_form(ir))


def _element_form(ir: UpdateIR) -> UpdateIR:
    row, col = ir.dims
    expanded = ir.expanded_coefficients()

    def slot(name, default=None):
        key = ir.slots.get(name)
        return expanded[key] if key is not None else default
    S_prev = sympy.Symbol("S_prev", real=True)
    F = slot("a", 1) * S_prev
    if ir.input_slots():
        F += sum(slot(p) * slot(f"v{p[1]}") for p in ir.input_slots())
    else:
        F += slot("p") * slot("q") if "p" in ir.slots else slot("B")
    if ir.kind == "rank1":
        erase = [("c", "u", "v")]
    elif ir.kind == "rankr":
        erase = [(c, f"u{c[2]}", f"v{c[1]}") for c in ir.erase_slots()]
    else:
        erase = []
    reductions: dict = {}           # u slot -> ReductionIR of S_prev u (one per key, shared by the v's)
    for c, u, v in erase:
        if u not in reductions:
            reductions[u] = ReductionIR(f"_rS{u[1:]}", S_prev * slot(u), col, (row,))
        F -= slot(c) * sympy.Symbol(reductions[u].name, real=True) * slot(v)
    return replace(ir, kind="general", state_update=F, state_reductions=tuple(reductions.values()),
                   spec_name=ir.spec_name + "_elem")
