"""Stage 4b: several states whose joint update is one rank-1 step of an extrapolated state.

A ``general`` several-state IR (``structure.classify_states``) gives each new state as an element
expression in the previous ones. This stage recognises the block form, row by row::

    U      = sum_b e_b X_b,prev                         (the extrapolated state)
    z      = U u                                        (one functional per row)
    X_a,t  = sum_b A_ab X_b,prev + w_a (p q^T - c z v^T)
    y      = oc ((sum_a r_a X_a,t) oq) + oh             (one query over the states)

with ``A_ab, e_b, w_a, r_a, c, p, oc, oh`` per row or per head and ``u, v, q, oq`` over the columns:
the erase coefficients of ``X_b,prev`` in ``X_a,t`` form a rank-1 matrix ``C_ab = w_a c e_b``
over the states, all along one ``u`` and one ``v``, and every state receives the same innovation
``p q^T - c z v^T`` scaled by ``w_a``. Longhorn with momentum (``objectives/momentum_longhorn.yaml``)
is ``U = S_prev + mu D_prev``, ``S = U - eps (U k - x) k^T``, ``D = S - S_prev``: one reduction
per row and step however many states, which the row-tiled kernels of
``ssmcraft/ops/block_rank1_row/`` run (the element form of the same update nests two).

``attach(so, ir)`` returns the IR with the form's coefficients and slots (``a{a}{b} e{b} w{a} ro{a}
c u v p q oc oq oh``, state indices in declaration order) and ``UpdateIR.block`` set; the kind, the element updates and the readout stay, so every other consumer of the IR sees
it as before. ``find`` says why an update has no such form; ``block_rank1(ir)`` reads the form
back.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from ssmcraft.compiler.derive import NotAffine, NotRowSeparable, affine
from ssmcraft.compiler.ir import UpdateIR


@dataclass(frozen=True)
class BlockRank1:
    ir: UpdateIR             # the IR, carrying the form's coefficients and slots

    @property
    def n_states(self) -> int:
        return len(self.ir.states)


def attach(so, ir: UpdateIR, updates=None) -> UpdateIR:
    """``ir`` with the block form's coefficients and slots when it has the form, else unchanged
    (``updates``: as ``find``)."""
    found = find(so, ir, updates)
    return found if isinstance(found, UpdateIR) else ir


def block_rank1(ir: UpdateIR) -> BlockRank1 | str:
    """The block form an IR carries (``attach``), or why it carries none."""
    if not ir.block:
        return "no block rank-1 form (not several states updated by one rank-1 step of an extrapolated state)"
    return BlockRank1(ir)


def _simplify(e):
    from ssmcraft.compiler.structure import simplify
    return simplify(e)


def _common_factor(xs) -> sympy.Expr:
    """The product of the factors (powers of a base, of one sign) that every one of ``xs`` has,
    each at its smallest power: ``eps mu`` and ``eps g`` give ``eps``."""
    dicts = [sympy.factor(x).as_powers_dict() for x in xs]
    out = sympy.Integer(1)
    for base, exp in dicts[0].items():
        if base.is_number:
            continue
        exps = [d.get(base) for d in dicts]
        if any(x is None for x in exps) or not (all(x > 0 for x in exps) or all(x < 0 for x in exps)):
            continue
        out *= base ** (min(exps) if exps[0] > 0 else max(exps))
    return out


def find(so, ir: UpdateIR, updates=None) -> UpdateIR | str:
    """The IR with the block form's slots, from the symbolic objective ``so`` of ``ir`` and its
    composed updates ``((name, F), ...)`` over ``so``'s symbols (``updates.derive_updates``; derived
    again when None: the IR's own are renumbered), or why the update has no such form."""
    if not ir.states or ir.kind != "general":
        return "not a several-state update that is linear in the states"
    if ir.state_shapes or ir.minibatch or ir.hidden:
        return "states of several shapes, square states or a mini-batch step"
    if updates is None:
        from ssmcraft.compiler.updates import derive_updates
        updates = derive_updates(so)
    alg = so.algebra
    prevs = [so.lowering.state_of(x)[1] for x in ir.states]
    news = [so.lowering.state_of(x)[0] for x in ir.states]
    parts = _decompose(alg, ir, [F for _, F in updates], prevs)
    if isinstance(parts, str):
        return parts
    A, erase, gammas = parts
    form = _rank1(alg, ir.dims, len(prevs), erase, gammas)
    if isinstance(form, str):
        return form
    readout = _readout(alg, so.output, news, *ir.dims)
    if isinstance(readout, str):
        return readout
    return _with_slots(alg, ir, A, form, readout, (*prevs, *news))


def _decompose(alg, ir, Fs, prevs):
    """(A, erase, gammas) of the updates ``Fs``: ``X_a,t = sum_b A_ab X_b,prev + sum beta (X_b,prev w)
    + gamma_a`` with ``erase`` the ``(a, b, beta, w)``, or why they are not of that form."""
    row, col = ir.dims
    n = len(prevs)
    A = [[0] * n for _ in range(n)]
    erase: list = []
    gammas = []
    try:
        for a, F in enumerate(Fs):
            rest = sympy.sympify(F)
            for b, P in enumerate(prevs):
                parts = affine(alg, rest, P)
                A[a][b] = parts.alpha
                erase += [(a, b, beta, w) for beta, w in parts.terms]
                rest = parts.gamma
            gammas.append(rest)
    except (NotAffine, NotRowSeparable) as e:
        return f"not linear and row-separable in the states ({e})"
    for a in range(n):
        for b in range(n):
            if col in alg.dims_of(A[a][b]):
                return f"the transition of {ir.states[b]} in {ir.states[a]} varies over {col}"
    if any(alg.depends_on(g, P) for g in gammas for P in prevs):
        return "an input term depends on the states"
    if not erase:
        return "no erase term (a decay: the diagonal families run it)"
    return A, erase, gammas


def _rank1(alg, dims, n, erase, gammas):
    """(u, v, c, e, w, p, q) of erase terms that are ``w_a c e_b (X_b,prev u) v^T`` and inputs
    ``w_a p q^T``, or why they are not."""
    from ssmcraft.compiler.structure import split_dims
    row, col = dims
    # one functional u and one write direction v for every (a, b)
    u, v = min((w for *_, w in erase), key=sympy.count_ops), None
    C = [[sympy.Integer(0)] * n for _ in range(n)]
    for a, b, beta, w in erase:
        if row in alg.dims_of(w):
            return "a key varies over the rows"
        ratio = _simplify(w / u)
        if col in alg.dims_of(ratio):
            return "the states are read along more than one key (not rank 1)"
        split = split_dims(alg, -beta * ratio, row, col)
        if split is None:
            return "an erase coefficient does not split into a row factor times a key"
        if v is None:
            v = split[1]
        r = _simplify(split[1] / v)
        if col in alg.dims_of(r):
            return "the erase writes along more than one key (not rank 1)"
        C[a][b] = C[a][b] + split[0] * r
    C = [[_simplify(x) for x in line] for line in C]
    # C = w c e^T: c the factors common to the first erasing state's row, e that row over c
    a0 = next(a for a in range(n) if any(x != 0 for x in C[a]))
    c = _common_factor([x for x in C[a0] if x != 0])
    e = [_simplify(C[a0][b] / c) for b in range(n)]
    b1 = min((b for b in range(n) if e[b] != 0), key=lambda b: sympy.count_ops(e[b]))
    w = [_simplify(C[a][b1] / (c * e[b1])) for a in range(n)]
    if any(_simplify(C[a][b] - w[a] * c * e[b]) != 0 for a in range(n) for b in range(n)):
        return "the erase coefficients over the states are not of rank 1 (no single extrapolated state)"
    if any(col in alg.dims_of(x) for x in (*e, *w)):
        return f"a state weight varies over {col}"
    # the input term: w_a p q^T
    p = q = None
    g0 = _simplify(gammas[a0])
    if g0 != 0:
        pq = split_dims(alg, g0, row, col)
        if pq is None:
            return "the input term does not factor as p q^T"
        p, q = pq
    if any(_simplify(gammas[a] - w[a] * g0) != 0 for a in range(n)):
        return "the states receive different input terms (not one innovation)"
    return u, v, c, e, w, p, q


def _with_slots(alg, ir, A, form, readout, states):
    """The IR with the form's coefficients and slots, named and CSE'd as every structured IR's."""
    from ssmcraft.compiler.structure import _Builder, _reduction_irs, renumber
    u, v, c, e, w, p, q = form
    r, oc, oq, oh = readout
    n = len(e)
    bld = _Builder(alg, ir.dims, factor=False)
    for a in range(n):
        for b in range(n):
            bld.add(f"a{a}{b}", A[a][b], reuse=False)
    for b in range(n):
        bld.add(f"e{b}", e[b], reuse=False)
    for a in range(n):
        bld.add(f"w{a}", w[a], reuse=False)
    for a in range(n):
        bld.add(f"ro{a}", r[a], reuse=False)
    bld.add("c", c)
    bld.add("u", u, reuse=False)
    bld.add("v", v, reuse=False)
    if p is not None:
        bld.add("p", p)
        bld.add("q", q, reuse=False)
    bld.add("oc", oc)
    bld.add("oq", oq, reuse=False)
    if oh != 0:
        bld.add("oh", oh)
    coefficients, reductions = bld.build()
    if any(alg.depends_on(red.body, X) for red in reductions for X in states):
        return "a coefficient reads the state"
    return renumber(replace(ir, coefficients=tuple(coefficients), slots=dict(bld.slots),
                            reductions=_reduction_irs(reductions, ir.dims), block=True))


def _readout(alg, output, news, row, col):
    """(r, oc, oq, oh) of a readout ``oc ((sum_a r_a X_a,t) oq) + oh`` (one query over the states),
    or why it has not that form."""
    from ssmcraft.compiler.structure import split_dims
    rest = sympy.sympify(output)
    ocs, oq = [], None
    try:
        for X in news:
            if not alg.depends_on(rest, X):
                ocs.append(sympy.Integer(0))
                continue
            parts = affine(alg, rest, X)
            split = split_dims(alg, parts.terms[0][0], row, col) if len(parts.terms) == 1 else None
            if parts.alpha != 0 or split is None or split[1] != 1 or row in alg.dims_of(parts.terms[0][1]):
                return "the readout is not of the form oc (X oq) + oh"
            w = parts.terms[0][1]
            oq = w if oq is None else oq
            ratio = _simplify(w / oq)
            if col in alg.dims_of(ratio):
                return "the readout reads the states along more than one query"
            ocs.append(_simplify(split[0] * ratio))
            rest = parts.gamma
    except (NotAffine, NotRowSeparable):
        return "the readout is not linear in the states"
    if oq is None:
        return "the readout reads no state"
    if any(alg.depends_on(rest, X) for X in news):
        return "the readout is not of the form oc (X oq) + oh"
    oc = _common_factor([x for x in ocs if x != 0])
    return [_simplify(x / oc) for x in ocs], oc, oq, rest


def describe(ir: UpdateIR, why: str | None = None) -> list[str]:
    """Printable lines of the form an IR carries (``ssmcraft derive``); ``why``: ``find``'s reason
    where it carries none."""
    form = block_rank1(ir)
    if isinstance(form, str):
        return [f"block rank-1 form: none ({why or form})"]
    n = form.n_states
    ex = ir.expanded_coefficients()

    def s(slot):
        key = ir.slots.get(slot)
        return sympy.sstr(ex[key]) if key is not None else "0"
    names = ir.states
    U = " + ".join(f"({s(f'e{b}')})*{names[b]}_prev" for b in range(n) if s(f"e{b}") != "0")
    lines = ["block rank-1 form (one erase of an extrapolated state U; ssmcraft/compiler/blockrank1.py):",
             f"  U = {U}",
             f"  z = sum_m U*({s('u')})",
             f"  R = ({s('p')})*({s('q')}) - ({s('c')})*z*({s('v')})"]
    for a in range(n):
        lin = " + ".join(f"({s(f'a{a}{b}')})*{names[b]}_prev" for b in range(n) if s(f"a{a}{b}") != "0")
        lines.append(f"  {names[a]}_t = {lin or '0'} + ({s(f'w{a}')})*R")
    oh = f" + {s('oh')}" if "oh" in ir.slots else ""
    read = " + ".join(f"({s(f'ro{a}')})*{names[a]}" for a in range(n) if s(f"ro{a}") != "0")
    lines.append(f"  y = ({s('oc')})*sum_m ({read})*({s('oq')}){oh}")
    return lines
