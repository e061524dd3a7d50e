"""The general family's generator: the fused sequential Triton kernels of a general or nonlinear
update (``general`` / ``nonlinear`` IR kinds), with a symbolically derived backward; the host
code that runs them is ``ssmcraft.ops.general.recurrent``.

The update is an element expression ``S_t[i, j] = F(S_prev, inputs)`` with reductions over
the state (``ir.state_update``, ``ir.state_reductions``); for example the robust delta rule
``objectives/cauchy_delta.yaml``::

    _r0 = sum_m S_prev*k,   _r1 = sum_d (_r0 - x)**2
    S_t = (S_prev*_r1 + S_prev - _r0*beta*k + beta*k*x)/(_r1 + 1)

Kernels (one program per batch*head and block of rows, the state tile ``[K, BV]`` in registers,
transposed as in FLA; fp32 state and arithmetic, fp32/bf16 I/O):

forward  loop over t: take the step's leaves (inputs, params), loaded one step ahead (and, on
         the GPU, prefetched into L2 ``PF`` steps ahead: the recurrence is latency-bound, and a
         load at the top of the step would start its dependency chain), evaluate the reductions
         and ``F``, the readout, store ``y``; for training, store the state every ``CHUNK`` steps.
backward chunks in reverse: recompute the chunk's states from its checkpoint into a
         per-program scratch buffer ``[CHUNK, K, V]``, then step back through them. The
         step's adjoint is derived here with ``ssmcraft.compiler.derive.gradient`` (reverse
         mode through reductions): with ``G`` the adjoint of ``S_t`` and ``DY`` of ``y_t``,

             L_ro = sum_i DY_i y_i(S_t, in)          L_F = sum_ij G_ij F_ij(S_prev, in)
             G   += dL_ro/dS_t;   d in += dL_ro/d in + dL_F/d in;   G <- dL_F/dS_prev

         with ``F`` first written as its monomials in the key-indexed symbols times simplified
         per-row coefficients (``collected``, ``_simplest``: a Newton step is ``S_prev + k c``,
         not the quotient ``(S_prev A B + k C)/(A B)``, whose derivative carries terms that cancel),
         and printed with the Triton printer (``ssmcraft.ops.codegen.triton_printer``); the
         adjoint's sub-expressions that read no tile (the leaves and the reductions the step
         has computed: a Woodbury denominator, a Newton step's ``sqrt(1 + r^2)``) are computed
         once per step on per-row values (``shared_factors``) instead of in every term, and each
         denominator among them is inverted once and multiplied by (``_reciprocals``).

Printing (``TilePrinter``): a value over the whole tile is written as a sum of monomials in
its key-indexed symbols (state, adjoint, keys) times coefficients that vary only per row
(``tile_terms``), so a Newton step's ``(S A B + k C)/(A B)`` costs one product and sum per
monomial over the tile, its quotient evaluated once per row; a sum over the keys is the
per-row coefficients times the sums of its monomials, each monomial's sum computed once per
step for every reduction that reads it (``reduction_lines``: a two-state adjoint's thirty
reductions read about eight distinct sums); a key-indexed gradient that adds several sums
over the rows takes one (``merged_key_grads``). The per-step instruction count is what a
row-tiled backward is bound by (``benchmarks/bench_general.py``; BENCHMARKS.md has the figures).

Leaves are loaded a step ahead as they lie in memory and converted to fp32 values over the tile
(``general_lines._leaf_take``) where the step reads them: a vector's conversion to the tile's layout
goes through shared memory and waits for its load, so at the load it would stall every step for the
memory's latency, and where it is read it waits on a load issued a step before.

Every leaf is laid out ``[B, T, H, n]`` (``[B, T, H]`` for scalars; params are expanded to that
form by autograd-aware ``expand``, so their gradients are reduced by autograd). The
generated source is readable and cached (``ssmcraft.compiler.cache``).

Row tiling: the grid is ``(B*H, NV)``, program ``(bh, iv)`` owning rows
``iv*BV .. iv*BV + BV - 1`` of the state. An update whose step or adjoint sums over the rows
(``recurrent.row_sums``: cauchy_delta's ``|S k - x|^2``) runs with one block (``NV = 1``); a
row-separable one (every row of every state reads only the same row of the states and per-row
or shared inputs: huber_longhorn's per-channel loss, momentum_longhorn's two states, the
``rankr`` fallback of ``ssmcraft.ops.rankr_row.recurrent``) runs several
(``recurrent.rows_per_program``), and the gradients of leaves shared by the rows (over ``m`` or
per head) are added by every row block into one buffer (``ATOMIC``; else written per row block,
``[NV, ...]``, and summed on the host: ``recurrent.ATOMIC_SUMS``). Structured updates
are lowered to their element form (``ssmcraft.compiler.structure.element_form``), general ones
give ``ir.state_update``.

Several states (``ir.states``, ``ir.state_updates``): one register tile, checkpoint, scratch
block and adjoint per state (``sp0, sp1, ...``), stacked ``[B, H, n, K, V]`` on the host, row
tiled as one state is (scratch blocks ordered ``[B*H, NV, n]``).

Mini-batch updates (``ir.minibatch``, ``ssmcraft.compiler.minibatch``): the update reads each state's
anchor ``_X_c`` (its value before the mini-batch) beside ``X_prev``. The forward carries the anchor
as a tile ``ac`` of its own, set to the running state at every ``MB``-th step of a sequence (so a
packed row's mini-batches count from each sequence's start) and stored in every checkpoint after the
states. The adjoint ``d(sum G F)/d anchor`` is derived as ``X_prev``'s is; the backward gathers it in
``ga`` over the mini-batch and adds it to ``X_prev``'s adjoint at the mini-batch's first step, where
the anchor is ``X_prev``. A step's anchor in the reverse sweep is read from the scratch: the state
before the mini-batch's first step, or, when the mini-batch began before the checkpoint, the
checkpoint's anchor, copied to a slot after the chunk's states (``scratch_slots``), so that no anchor
tile stays in registers through the sweep; any ``MB`` against any checkpoint interval.

Packed sequences (``VARLEN``, ``ssmcraft.ops.common.varlen``): program row ``b`` is sequence ``b``
of one packed row, its first row, length and first checkpoint loaded from ``CU``/``CO``
(``sequence_lines``); its states are row ``b`` of ``[N, H, ...]`` and the checkpoints of every sequence
lie together, ``[H, (n,) NC, K, V]``. Without it the kernels compile as they would without the flag.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ssmcraft.compiler import safe_source
from ssmcraft.compiler.derive import gradient
from ssmcraft.compiler.minibatch import anchor_name
from ssmcraft.compiler.structure import element_form
from ssmcraft.compiler.symbolic import Algebra, Reduction
from ssmcraft.ops.codegen.general_lines import (
    IN1, IN2, IN3, PREAMBLE, PREFETCH_L2, anchor_reset, checkpointed, ckbase, dy_load, first_loads,
    leaf_store, loads_ahead, n_checkpointed, partials_stride, prefetches, sbase, scr_block, scratch_slots, sequence_lines,
    suffixes)


# ----------------------------------------------------------------------------------------
# the step, symbolically
# ----------------------------------------------------------------------------------------

@dataclass
class Step:
    """The update, readout and their adjoints over one algebra (element expressions).

    One entry per state in the list fields (one state: lists of one); with several states
    ``L_F = sum_X sum_ij G_X F_X`` and each state's adjoint is ``d L_F / d X_prev``."""
    alg: Algebra
    dims: tuple
    S_prevs: list
    Ss: list
    Gs: list
    DY: sympy.Symbol
    leaves: list            # [(name, dims tuple, Symbol)] in a stable order
    Fs: list
    readout: sympy.Expr
    dS_ros: list            # d(sum DY*y)/dX per state
    din_ro: dict            # leaf -> d(sum DY*y)/d leaf
    dS_prevs: list          # d(sum_X G_X*F_X)/dX_prev per state
    din_F: dict             # leaf -> d(sum_X G_X*F_X)/d leaf
    anchors: list = field(default_factory=list)     # a mini-batch update's states before the chunk (``_X_c``)
    dAs: list = field(default_factory=list)         # d(sum_X G_X*F_X)/d anchor per state

    @property
    def n_states(self) -> int:
        return len(self.Ss)


def _symbols_of(ir) -> dict:
    out = {}
    exprs = [ir.state_update, *ir.state_updates, ir.readout, *(c.expr for c in ir.coefficients)]
    exprs += [r.body for r in (*ir.reductions, *ir.state_reductions, *ir.readout_reductions)]
    for e in exprs:
        if e is None:
            continue
        for s in sympy.sympify(e).free_symbols:
            out.setdefault(s.name, s)
    return out


def element_algebra(ir, reductions=()):
    """An ``Algebra`` over ``ir``'s dims (size symbols registered, ``reductions`` of the IR
    registered under their own symbols) and ``sym(name, dims)``: the IR's symbol of that name (a
    new real one if it has none) registered with its dims. New reductions are ``_r1000, ...``."""
    alg = Algebra(tuple(ir.dims))
    alg._count = 1000                       # new reductions never clash with the IR's
    syms = _symbols_of(ir)

    def sym(name, dims, **assume):
        s = syms.get(name) or sympy.Symbol(name, **(assume or {"real": True}))
        alg.symbol_dims[s] = frozenset(dims)
        syms[name] = s
        return s

    for dim in ir.dims:
        sym(dim, (), positive=True, integer=True)
    for r in reductions:
        s = sym(r.name, r.dims)
        alg.reductions[s] = Reduction(s, r.body, r.over, frozenset(r.dims))
        alg._keys[(r.body, r.over)] = s
    return alg, sym


def build_step(ir) -> Step:
    """Lower the IR of an update into one ``Algebra`` and derive the adjoints."""
    ir = element_form(ir)                   # structured (rank1/rankr): the element form of its slots
    d, m = ir.dims
    alg, sym = element_algebra(ir, (*ir.reductions, *ir.state_reductions, *ir.readout_reductions))
    several = bool(ir.states)
    S_prevs = [sym(f"{x}_prev" if several else "S_prev", (d, m)) for x in ir.state_names]
    Ss = [sym(x, (d, m)) for x in ir.state_names]
    Gs = [sym(f"_G{i}" if several else "_G", (d, m)) for i in range(len(Ss))]
    anchors = [sym(anchor_name(x), (d, m)) for x in ir.state_names] if ir.minibatch else []
    DY = sym("_DY", (d,))
    leaves = []
    for name, ldims in list(ir.inputs.items()) + list(ir.params.items()):
        leaves.append((name, tuple(ldims), sym(name, ldims)))
    # coefficients -> expressions in leaves and reductions
    by_name = ir.expanded_coefficients()

    def coef(slot, default):
        name = ir.slots.get(slot)
        return by_name[name] if name in by_name else default

    if ir.readout is not None:
        readout = sympy.sympify(ir.readout)
    else:
        readout = coef("oc", 1) * alg.reduce(Ss[0] * coef("oq", None), m) + coef("oh", 0)
    readout = alg.substitute(sympy.sympify(readout), {})
    # each update as S_prev + k * (a per-row quotient), not (S_prev A B + k C)/(A B): differentiated in the
    # quotient's form, the adjoint carries terms in sum_m G S_prev that cancel (a reduction and its
    # per-row algebra computed for nothing, and rounding that does not cancel)
    Fs = [collected(sympy.sympify(F), lambda s: m in alg.symbol_dims.get(s, frozenset()), _simplest)
          for F in (ir.state_updates if several else (ir.state_update,))]
    L_ro = alg.reduce(DY * readout, d)
    L_F = sympy.Add(*(alg.reduce(alg.reduce(G * F, m), d) for G, F in zip(Gs, Fs)))
    dS_ros = [gradient(alg, L_ro, S) for S in Ss]
    dS_prevs = [gradient(alg, L_F, S_prev) for S_prev in S_prevs]
    din_ro = {n: gradient(alg, L_ro, s) for n, _, s in leaves}
    din_F = {n: gradient(alg, L_F, s) for n, _, s in leaves}
    dAs = [gradient(alg, L_F, A) for A in anchors]
    return Step(alg, (d, m), S_prevs, Ss, Gs, DY, leaves, Fs, readout, dS_ros, din_ro, dS_prevs, din_F, anchors, dAs)


# ----------------------------------------------------------------------------------------
# code generation (kernels)
# ----------------------------------------------------------------------------------------

def _triton_code(expr, names) -> str:
    """``ssmcraft.ops.codegen.triton_printer`` with sympy's parenthesising rule: its printer's
    ``parenthesize`` drops the parentheses of an operand of equal precedence when
    ``strict=False`` (``-b*x/(1 + y)`` printed as ``-b*x/1.0 + y``); sympy's rule wraps it."""
    from sympy.printing.precedence import precedence

    from ssmcraft.ops.codegen.triton_printer import TritonPrinter

    class _Fixed(TritonPrinter):
        def parenthesize(self, item, level, strict=False):
            p = precedence(item)
            if p < level or (not strict and p <= level) or (isinstance(item, sympy.Number) and item.is_negative):
                return f"({self._print(item)})"
            return self._print(item)

    return _Fixed(names).doprint(sympy.sympify(expr))


class TilePrinter:
    """Prints element expressions as 2D Triton values over the ``[BK, BV]`` tile: d-indexed
    values are ``[1, BV]``, m-indexed ``[BK, 1]``, both ``[BK, BV]``, scalars scalars."""

    def __init__(self, step: Step):
        d, m = step.dims
        names = {d: "V_f", m: "K_f", step.DY.name: "dy"}
        for sfx, S_prev, S, G in zip(suffixes(step), step.S_prevs, step.Ss, step.Gs):
            names.update({S_prev.name: f"sp{sfx}", S.name: f"st{sfx}", G.name: f"g{sfx}"})
        for sfx, A in zip(suffixes(step), step.anchors):
            names[A.name] = f"ac{sfx}"
        for n, _, s in step.leaves:
            names[s.name] = f"l_{n}"
        self._setup(step.alg, step.dims, names)
        self.factor = True

    def _setup(self, alg, dims, names: dict) -> None:
        """The printer's state: the algebra and (d, m) dims, symbol -> Triton variable names."""
        self.alg, self.dims, self.names = alg, dims, names
        self.done: set = set()
        self.rewrite: dict = {}      # expression -> the same in shared factors (``shared_factors``)
        self.temp_dims: dict = {}    # shared factor's symbol -> the dims it varies over
        self.factor = False          # print tiles and reductions factored (``tile_terms``, ``reduction_lines``)
        self.msums: dict = {}        # (monomial, summed dim) -> the variable of its sum in this step
        self.n_msums = 0
        self.resum: dict = {}        # reduction -> its terms, summed keys first (``plan_resums``)
        self.skip: set = set()       # reductions that only a planned resum reads: never computed

    def dims_of(self, e) -> frozenset:
        """The dims ``e`` varies over (shared factors by their definitions)."""
        out = frozenset()
        for s in sympy.sympify(e).free_symbols:
            out |= self.temp_dims.get(s, self.alg.symbol_dims.get(s, frozenset()))
        return out

    def expr(self, e) -> str:
        e = self.rewrite.get(e, e)
        for s in sympy.sympify(e).free_symbols:
            if s in self.alg.reductions:
                self.names.setdefault(s.name, f"r_{s.name.lstrip('_')}")
        terms = self.tile_terms(e) if self.factor else None
        if terms is None:
            return _triton_code(e, self.names)
        return " + ".join(_triton_code(c, self.names) if mon == 1 else _triton_code(mon, self.names) if c == 1 else
                          f"{_triton_code(mon, self.names)}*({_triton_code(c, self.names)})" for mon, c in terms)

    def tile(self, e) -> str:
        """``e`` printed as a ``[BK, BV]`` value: broadcast against the zero tile ``Z2`` only where it
        does not vary over both dims (adding ``+0.0`` is not folded by the compiler: it costs one
        add per element of the tile in every step)."""
        d, m = self.dims
        code = self.expr(e)
        return code if {d, m} <= self.dims_of(self.rewrite.get(e, e)) else f"{code} + Z2"

    def tile_terms(self, e):
        """``e``, a value over the whole ``[BK, BV]`` tile, as ``[(monomial, coefficient)]``: the
        monomials in its key-indexed symbols (state, adjoint, keys, reductions over the rows),
        each coefficient free of them (values per row, per head), or None where ``e`` is not a
        polynomial in them or reads no tile. Printed as ``monomial*(coefficient)``, the
        coefficient is evaluated once per row on ``[1, BV]`` and the tile work is one product
        and sum per monomial; printed as sympy writes it, a quotient such as a Newton step's
        ``(sp*A*B + k*C)/(A*B)`` is evaluated over the whole tile, division included."""
        d, m = self.dims
        e = sympy.sympify(e)
        if not {d, m} <= self.dims_of(e):
            return None
        gens = {s for s in e.free_symbols if m in self.dims_of(s)}
        terms = _monomial_terms(e, gens)
        if terms is None or len(terms) > 8:
            return None
        return sorted(terms.items(), key=lambda mc: sympy.default_sort_key(mc[0]))


    def reductions(self, exprs, indent) -> list[str]:
        """Lines computing every reduction ``exprs`` use (inner first) not yet computed."""
        lines = []
        for e in exprs:
            for r in self.alg.reductions_in(e):
                if r.symbol in self.done or r.symbol in self.skip:
                    continue
                self.done.add(r.symbol)
                self.names[r.symbol.name] = f"r_{r.symbol.name.lstrip('_')}"
                if r.symbol in self.resum:
                    lines += self.resum_lines(r, self.names[r.symbol.name], indent)
                else:
                    lines += self.reduction_lines(r, self.names[r.symbol.name], indent)
        return lines

    def resum_lines(self, r, name: str, indent: str) -> list[str]:
        """Lines computing ``r = sum_m (sum_i a_i (sum_d B_i) + rest)`` (``plan_resums``) as
        ``sum_i sum_d (sum_m a_i B_i) + sum_m rest``: the inner sums over the keys are monomial sums
        (``reduction_lines``), and the sums over the rows are of per-row values, so no tile is
        summed across the rows."""
        d, m = self.dims
        lines, parts = [], []
        for mon, c in self.resum[r.symbol].items():
            inner = c if mon == 1 else c * self.rewrite.get(self.alg.reductions[mon].body, self.alg.reductions[mon].body)
            lines += self.reductions([inner], indent)
            var = f"u_{self.n_msums}"
            self.n_msums += 1
            lines += self.reduction_lines(Reduction(None, inner, m, frozenset()), var, indent)
            parts.append(var if mon == 1 else f"tl.sum(tl.where(mask_v[None, :], {var}, 0.0), axis=1, keep_dims=True)")
        return lines + [f"{indent}{name} = {' + '.join(parts)}"]

    def plan_resums(self, exprs) -> None:
        """Find the sums over the keys of values that are sums over the rows, ``sum_m (sum_i a_i
        (sum_d B_i) + rest)`` with ``a_i`` constant over the rows and no other expression reading
        the ``sum_d B_i``, and plan them summed keys first (``resum_lines``): a derived adjoint's
        gradient of a per-head leaf is such a double sum."""
        d, m = self.dims
        alg = self.alg
        reds = {r.symbol: r for e in exprs for r in alg.reductions_in(self.rewrite.get(e, e))}
        refs: dict = {}
        for e in [*(self.rewrite.get(e, e) for e in exprs), *(self.rewrite.get(r.body, r.body) for r in reds.values())]:
            for x in sympy.sympify(e).free_symbols & set(reds):
                refs[x] = refs.get(x, 0) + 1
        self.resum, self.skip = {}, set()
        for q, r in reds.items():
            body = sympy.sympify(self.rewrite.get(r.body, r.body))
            if r.over != m or q in self.done or d in self.dims_of(body):
                continue
            cands = {x for x in body.free_symbols if x in reds and reds[x].over == d and refs.get(x) == 1
                     and x not in self.done and x not in self.skip}
            terms = _monomial_terms(body, cands) if cands else None
            if terms is None or any(mon != 1 and (mon not in cands or d in self.dims_of(c)) for mon, c in terms.items()):
                continue
            self.resum[q] = terms
            self.skip |= {mon for mon in terms if mon != 1}

    def reduction_lines(self, r, name: str, indent: str) -> list[str]:
        """Lines computing reduction ``r`` as ``name``. Factored (``self.factor``): its body as
        monomials in the symbols that vary over the keys times per-row coefficients
        (``_monomial_terms``), so that it is ``sum_j c_j * (sum_m mon_j)``, and each monomial's sum is
        computed once per step for every reduction that needs it (``self.msums``): the derived
        adjoint of a several-state or Newton step has dozens of reductions over a handful of
        distinct monomials (``sum_m g k``, ``sum_m g S_prev``, ...)."""
        d, m = self.dims
        terms = None
        body = self.rewrite.get(r.body, r.body)
        if self.factor and r.over == m and {d, m} <= self.dims_of(body):     # a tile summed over the keys
            gens = {s for s in body.free_symbols if r.over in self.dims_of(s)}
            terms = _monomial_terms(body, gens)
        if terms is None or len(terms) > 8:
            return [f"{indent}{name} = {self.reduce(r)}"]
        lines, parts = [], []
        for mon, c in sorted(terms.items(), key=lambda mc: sympy.default_sort_key(mc[0])):
            if mon == 1:
                parts.append(f"{'K_f' if r.over == m else 'V_f'}*({self.expr(c)})")
                continue
            if (mon, r.over) not in self.msums:
                var = name if (len(terms) == 1 and c == 1) else f"s_{self.n_msums}"     # the sum is the reduction
                self.n_msums += var != name
                lines.append(f"{indent}{var} = {self.reduce(Reduction(None, mon, r.over, frozenset()))}")
                self.msums[(mon, r.over)] = var
            var = self.msums[(mon, r.over)]
            parts.append(var if c == 1 else f"{var}*({self.expr(c)})")
        return lines + ([f"{indent}{name} = {' + '.join(parts)}"] if parts != [name] else [])

    def forget(self, symbols=None) -> None:
        """Drop the monomial sums that read any of ``symbols`` (all of them with None): the
        values they summed change from here on."""
        self.msums = {k: v for k, v in self.msums.items()
                      if symbols is not None and not (k[0].free_symbols & set(symbols))}

    def reduce(self, r) -> str:
        """The Triton sum of reduction ``r`` over the tile (padding masked out)."""
        d, m = self.dims
        mask = "MASK" if {d, m} <= self.dims_of(r.body) else "mask_k[:, None]" if r.over == m else "mask_v[None, :]"
        return f"tl.sum(tl.where({mask}, {self.expr(r.body)}, 0.0), axis={0 if r.over == m else 1}, keep_dims=True)"


def _monomial_terms(e, gens: set):
    """``e`` as ``{monomial in gens: coefficient}``, expanding only over ``gens`` (coefficients
    keep their factored form: expanding them would cost more and lose precision), or None where
    ``e`` is not a polynomial of degree <= 3 in them."""
    if not (e.free_symbols & gens):
        return {sympy.Integer(1): e}
    if e in gens:
        return {e: sympy.Integer(1)}
    if isinstance(e, sympy.Add):
        out: dict = {}
        for a in e.args:
            t = _monomial_terms(a, gens)
            if t is None:
                return None
            for mon, c in t.items():
                out[mon] = out.get(mon, 0) + c
        return out
    if isinstance(e, sympy.Mul) or (isinstance(e, sympy.Pow) and e.exp.is_Integer and 1 < e.exp <= 3):
        factors = e.args if isinstance(e, sympy.Mul) else [e.base] * int(e.exp)
        out = {sympy.Integer(1): sympy.Integer(1)}
        for f in factors:
            t = _monomial_terms(f, gens)
            if t is None:
                return None
            nxt: dict = {}
            for m1, c1 in out.items():
                for m2, c2 in t.items():
                    mon = m1 * m2
                    if sum(int(f.exp) if f.is_Pow else 1 for f in sympy.Mul.make_args(mon) if f != 1) > 3:
                        return None
                    nxt[mon] = nxt.get(mon, 0) + c1 * c2
            out = nxt
        return out
    return None


def shared_factors(step: Step, pr: TilePrinter, indent: str) -> list[str]:
    """Lines computing the common sub-expressions of the backward step's update and adjoint that
    read no tile: leaves, reductions of leaves and the reductions the step has already computed
    (``pr.done``: those of the update, e.g. a Woodbury denominator
    ``1 + r0 beta + r1 beta - r2^2 beta^2 + r0 r1 beta^2`` or a Newton step's residual ``S k - x``),
    once per step, as ``c_<n>``, each denominator inverted once (``shared_lines``' reciprocals);
    the printer then prints the update, the adjoint's expressions and the bodies of the reductions
    they still need in terms of them (``pr.rewrite``). Without this, the symbolic adjoint repeats
    such a factor, and its division, in every term (huber_longhorn's adjoint reads its two per-row
    denominators in about fourteen places; ``benchmarks/sass_general.py`` counts the instructions)."""
    alg = step.alg
    state = {*step.S_prevs, *step.Ss, *step.Gs, *step.anchors, step.DY}
    ignore = state | {sym for sym, r in alg.reductions.items()
                      if sym not in pr.done and any(alg.depends_on(r.body, x) for x in state)}
    if pr.factor:      # factors that vary over the keys would hide the monomials ``tile_terms`` and the sums collect
        ignore |= {sym for sym, dims in alg.symbol_dims.items() if step.dims[1] in dims}
    adjoint = [e for e in (*step.Fs, *step.dS_ros, *step.din_ro.values(), *step.dS_prevs, *step.dAs,
                           *step.din_F.values()) if sympy.sympify(e) != 0]
    return shared_lines(pr, adjoint, indent, ignore, reciprocals=pr.factor)


def shared_lines(pr, exprs: list, indent: str, ignore=(), reciprocals: bool = False) -> list[str]:
    """Lines computing the common sub-expressions of ``exprs`` (and of the bodies of the
    reductions they read that ``pr`` has not printed yet) once, as ``c_<n>`` (``sympy.cse``; the
    symbols in ``ignore`` are never part of one); ``pr`` then prints ``exprs`` in terms of them
    (``pr.rewrite``). ``reciprocals``: every negative power of a base that reads nothing in
    ``ignore`` becomes a power of that base's reciprocal, computed once as ``c_<n>`` (``_reciprocals``):
    a Newton step's adjoint divides by the same two or three per-row values in a dozen places, and a
    division costs several times a product."""
    bodies = [r.body for r in pr.alg.reductions_in(sympy.Add(*exprs)) if r.symbol not in pr.done]
    originals = [*exprs, *bodies]
    inverses: dict = {}
    keyed = (lambda s: pr.dims[1] in pr.dims_of(s))
    work = _reciprocals([collected(e, keyed) for e in originals], set(ignore), inverses) if reciprocals else originals
    defs = list(inverses.values())
    temps, reduced = sympy.cse([*work, *(base for base, _ in defs)], symbols=sympy.numbered_symbols("_cse"),
                               ignore=tuple(ignore))
    temps += [(sym, 1 / base) for (_, sym), base in zip(defs, reduced[len(work):])]
    if not temps:
        return []
    lines = pr.reductions([e for _, e in temps], indent)
    for i, (sym, e) in enumerate(_in_order(temps)):
        code = pr.expr(e)
        pr.temp_dims[sym] = pr.dims_of(e)
        pr.names[sym.name] = f"c_{i}"
        lines.append(f"{indent}c_{i} = {code}")
    pr.rewrite = dict(zip(originals, reduced[:len(work)]))
    return lines


def collected(e, keyed, tidy=None):
    """``e`` as the sum of its monomials in the symbols ``keyed`` says vary over the keys times their
    coefficients (``_monomial_terms``) where it is such a polynomial: each coefficient is then one
    fraction, cancelled before its denominators become reciprocals (a Newton step's
    ``(S A B + k C)/(A B)`` is ``S + k C/(A B)``, not ``S A B rA rB``); ``tidy`` rewrites each
    coefficient."""
    e = sympy.sympify(e)
    gens = {s for s in e.free_symbols if keyed(s)}
    terms = _monomial_terms(e, gens) if gens else None
    if terms is None:
        return e
    return sympy.Add(*(mon * (tidy(c) if tidy else c) for mon, c in terms.items()))


def _simplest(c, most: int = 200):
    """``sympy.simplify(c)`` where it takes fewer operations and reads no function ``c`` does not
    (the printer prints what the spec's own functions need), else ``c``; coefficients over ``most``
    operations are left as they are (simplify's time grows fast with them). huber_longhorn's Newton
    coefficient ``(r0 b^2 r - b r D)/(sqrt(u) D)``, ``D = r0 b + u^(3/2)``, ``u = 1 + r^2``, is
    ``-b r u / D``: 29 operations to 15, and its derivatives shrink with it."""
    n = sympy.count_ops(c)
    if n == 0 or n > most:
        return c
    s = sympy.simplify(c)
    funcs = {type(f) for f in c.atoms(sympy.Function)}
    if sympy.count_ops(s) >= n or not {type(f) for f in s.atoms(sympy.Function)} <= funcs or s.has(sympy.Piecewise):
        return c
    return s


def _reciprocals(exprs: list, ignore: set, inverses: dict) -> list:
    """``exprs`` with each negative power ``b**-n`` (``b**(-n/2)``) of a base ``b`` that reads nothing in
    ``ignore`` written ``r**n`` with ``r`` a new symbol for ``1/b`` (``1/sqrt(b)``); ``inverses`` gets
    ``{inverted value: (base, r)}``, one symbol per distinct value, its base as rewritten."""
    def ready(e):
        return e.is_Pow and e.exp.is_Rational and e.exp < 0 and e.exp.q in (1, 2) and not (e.base.free_symbols & ignore)

    def invert(e):
        root = e.exp.q == 2
        value = sympy.sqrt(e.base) if root else e.base
        if value not in inverses:
            inverses[value] = (value, sympy.Symbol(f"_rcp{len(inverses)}", real=True))
        return inverses[value][1] ** (-e.exp.p if root else -e.exp)
    return [sympy.sympify(e).replace(ready, invert) for e in exprs]


def _in_order(temps: list) -> list:
    """``temps`` (symbol, definition) reordered so that each follows the temps its definition reads."""
    defs = dict(temps)
    out, seen = [], set()

    def visit(sym):
        if sym in seen:
            return
        seen.add(sym)
        for s in sorted(sympy.sympify(defs[sym]).free_symbols & set(defs), key=lambda x: x.name):
            visit(s)
        out.append((sym, defs[sym]))
    for sym, _ in temps:
        visit(sym)
    return out


def merged_key_grads(step: Step, pr: TilePrinter) -> dict:
    """``{leaf: (body, rest)}`` for the key-indexed leaves whose transition adjoint is
    ``sum_i a_i * (sum_d B_i) + rest`` with ``a_i`` constant over the rows and no other expression
    of the step reading those sums: the gradient is then ``sum_d (sum_i a_i B_i) + rest``, one
    sum over the rows (a cross-thread reduction of the tile) instead of one per term. Only the
    ``B_i`` that read a tile are merged: a per-row ``B_i``'s sum is a sum of per-row values, which
    merged would cost a product over the whole tile (``2 k sum_d B`` as ``sum_d 2 k B``). ``body``
    and ``rest`` are in the printer's shared factors (``pr.rewrite``)."""
    d, m = step.dims
    alg = step.alg
    keyed = [n for n, ld, _ in step.leaves if tuple(ld) == (m,) and step.din_F[n] != 0]
    if not keyed:
        return {}

    def used(exprs) -> set:
        return {r.symbol for e in exprs for r in alg.reductions_in(pr.rewrite.get(e, e))}
    out = {}
    for n in keyed:
        e = sympy.sympify(pr.rewrite.get(step.din_F[n], step.din_F[n]))
        others = [*step.dS_prevs, *step.dAs, *step.dS_ros, *step.din_ro.values(), step.readout,
                  *(step.din_F[x] for x, _, _ in step.leaves if x != n)]
        elsewhere = used(others) | pr.done | {r.symbol for x in e.free_symbols if x in alg.reductions
                                              for r in alg.reductions_in(alg.reductions[x].body)}
        cands = {x for x in e.free_symbols if x in alg.reductions and alg.reductions[x].over == d and x not in elsewhere
                 and m in pr.dims_of(pr.rewrite.get(alg.reductions[x].body, alg.reductions[x].body))}
        terms = _monomial_terms(e, cands) if len(cands) > 1 else None
        if terms is None or any(mon != 1 and (mon not in cands or d in pr.dims_of(c)) for mon, c in terms.items()):
            continue
        body = sympy.Add(*(c * pr.rewrite.get(alg.reductions[mon].body, alg.reductions[mon].body)
                           for mon, c in terms.items() if mon != 1))
        out[n] = (body, terms.get(sympy.Integer(1), sympy.Integer(0)))
    return out


def _forward_kernel(step: Step, pr: TilePrinter, leaf_ptrs: str, states: list, F_codes: list) -> list[str]:
    """The forward kernel's lines: the state tile in registers, stepped through T."""
    ns, I1, I2 = step.n_states, IN1, IN2
    nck = n_checkpointed(step)
    mb = bool(step.anchors)
    fwd_red_F = pr.reductions(step.Fs, I2)
    pr_ro = pr.reductions([step.readout], I2)
    return [
        "@triton.jit",
        f"def general_fwd_kernel({leaf_ptrs}, S0, Y, ST, CK, CU, CO, T, H, V, K, NC,",
        "               BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr,",
        "               HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, STORE_CK: tl.constexpr, PF: tl.constexpr,",
        "               EVEN: tl.constexpr, VARLEN: tl.constexpr" + (", MB: tl.constexpr):" if mb else "):"),
        '    """One program per (batch*head, block of BV rows): the state tile' + ("" if ns == 1 else f" (each of {ns})")
        + ', transposed [BK, BV], in registers.',
        *(['    MB: the mini-batch; ``ac`` is the state before the current mini-batch (reset at every MB-th step of a',
           '    sequence), checkpointed after the states.'] if mb else []),
        '    VARLEN: program row b is sequence b of a packed row."""',
        *PREAMBLE,
        *sequence_lines("    "),
        *[f"    sp{x} = tl.zeros([BK, BV], dtype=tl.float32)" for _, x in states],
        "    if HAS_S0:",
        *[f"        sp{x} += tl.load(S0 + {sbase(i, ns)} * K * V + tile, mask=MASK, other=0.).to(tl.float32)"
          for i, x in states],
        *[f"    ac{x} = sp{x}" for _, x in states if mb],
        "    if STORE_CK:",
        "        if (NC > 0) | (not VARLEN):     # an empty packed sequence has no checkpoint",
        *[f"            tl.store(CK + {ckbase(i, nck)} * K * V + tile, {v}, mask=MASK)" for i, v in checkpointed(step)],
        *first_loads(step, "    ", "bos * H + h"),
        "    for t in range(0, T):",
        "        row = (bos + t) * H + h",
        "        row_n = (bos + tl.minimum(t + 1, T - 1)) * H + h",
        *loads_ahead(step, I1, "row_n"),
        "        if PF > 0:",
        "            row_p = (bos + tl.minimum(t + PF, T - 1)) * H + h",
        *prefetches(step, I2, "row_p"),
        *anchor_reset(step, I1),
        *[line.replace(I2, I1, 1) for line in fwd_red_F],
        *[f"        st{x} = tl.where(MASK, {F_codes[i]}, 0.0)" for i, x in states],
        *[line.replace(I2, I1, 1) for line in pr_ro],
        f"        y = tl.sum({pr.expr(step.readout)} + ZR, axis=0)",
        "        tl.store(Y + row * V + offs_v, y.to(Y.dtype.element_ty), mask=mask_v)",
        *[f"        sp{x} = st{x}" for _, x in states],
        "        if STORE_CK:",
        "            if (t + 1) % CHUNK == 0:",
        "                if (t + 1) // CHUNK < NC:",
        *[f"                    tl.store(CK + ({ckbase(i, nck)} + (t + 1) // CHUNK) * K * V + tile, {v}, mask=MASK)"
          for i, v in checkpointed(step)],
        "    if STORE_ST:",
        *[f"        tl.store(ST + {sbase(i, ns)} * K * V + tile, sp{x}, mask=MASK)" for i, x in states],
    ]


def _leaf_grads(step: Step, pr: TilePrinter, merged: dict) -> list:
    """(name, dims, the code of its gradient at this step) per leaf: the readout's and the
    transition's terms (``merged_key_grads``' form where it applies)."""
    grads = []
    for n, ld, s in step.leaves:
        parts = [f"({pr.expr(e)})" for e in (step.din_ro[n], step.din_F[n] if n not in merged else 0) if e != 0]
        if n in merged:
            body, rest = merged[n]
            parts.append(f"tl.sum(tl.where(MASK, {pr.expr(body)}, 0.0), axis=1, keep_dims=True)")
            parts += [f"({pr.expr(rest)})"] if rest != 0 else []
        grads.append((n, ld, " + ".join(parts) if parts else "0.0"))
    return grads


def _step_back(step: Step, pr: TilePrinter, states: list, F_codes: list) -> tuple[list, list]:
    """The backward's lines that replace the state by its next value (the recompute pass) and the
    adjoint by its previous one (the reverse pass), a mini-batch's anchor adjoints included."""
    mb = bool(step.anchors)
    # a mini-batch's anchors take their adjoint first: it reads the adjoints that the step then replaces
    anchor_back = [f"            ga{x} = ga{x} + tl.where(MASK, {pr.tile(step.dAs[i])}, 0.0)" for i, x in states if mb]
    if step.n_states == 1:     # one state: the step's new value and adjoint replace the old ones in place
        recompute = [f"            sp = tl.where(MASK, {F_codes[0]}, 0.0)"]
        adjoint_back = [*anchor_back, f"            g = tl.where(MASK, {pr.tile(step.dS_prevs[0])}, 0.0)"]
    else:           # several: every new value (adjoint) reads every old one, so two phases
        recompute = [*(f"            st{x} = tl.where(MASK, {F_codes[i]}, 0.0)" for i, x in states),
                     *(f"            sp{x} = st{x}" for _, x in states)]
        adjoint_back = [*(f"            gn{x} = tl.where(MASK, {pr.tile(step.dS_prevs[i])}, 0.0)" for i, x in states),
                        *anchor_back, *(f"            g{x} = gn{x}" for _, x in states)]
    if mb:          # the chunk's first step read its anchor as S_prev: the anchor's adjoint joins S_prev's there
        adjoint_back += ["            first = (t % MB) == 0",
                         *(f"            g{x} = g{x} + tl.where(first, ga{x}, 0.0)" for _, x in states),
                         *(f"            ga{x} = tl.where(first, 0.0, ga{x})" for _, x in states)]
    return recompute, adjoint_back


def _backward_kernel(step: Step, pr: TilePrinter, leaf_ptrs: str, grad_ptrs: str, states: list,
                     F_codes: list) -> list[str]:
    """The backward kernel's lines: per chunk in reverse, recompute the states, then step the adjoint back."""
    ns, I1, I2 = step.n_states, IN1, IN2
    nck = n_checkpointed(step)
    mb = bool(step.anchors)
    # backward: fresh reduction bookkeeping (each loop body computes its own)
    pr.done = set()
    pr.forget()
    rec_red = pr.reductions(step.Fs, I2)
    pr.done = set()
    pr.forget()
    b_fwd = pr.reductions(step.Fs, I2)
    b_shared = shared_factors(step, pr, I2)
    b_ro = pr.reductions([step.readout], I2)
    b_a = pr.reductions([*step.dS_ros, *step.din_ro.values()], I2)
    pr.forget(step.Gs)             # the adjoint takes the readout's term before these
    merged = merged_key_grads(step, pr) if pr.factor else {}
    din_F = [e for n, _, _ in step.leaves if n not in merged for e in (step.din_F[n],)]
    b_exprs = [*step.dS_prevs, *step.dAs, *din_F, *(e for pair in merged.values() for e in pair)]
    if pr.factor:
        pr.plan_resums(b_exprs)
    b_b = pr.reductions(b_exprs, I2)
    grads = _leaf_grads(step, pr, merged)
    recompute, adjoint_back = _step_back(step, pr, states, F_codes)
    return [
        "@triton.jit",
        f"def general_bwd_kernel({leaf_ptrs}, {grad_ptrs}, CK, SCR, DY, DHT, DS0, CU, CO, T, H, V, K, NC,",
        "               BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr,",
        "               HAS_DHT: tl.constexpr, STORE_DS0: tl.constexpr, PF: tl.constexpr, EVEN: tl.constexpr,",
        "               VARLEN: tl.constexpr, ATOMIC: tl.constexpr" + (", MB: tl.constexpr):" if mb else "):"),
        '    """Reverse sweep: per chunk, recompute the states into SCR, then step the adjoint back.',
        *(['    MB: the mini-batch; a step reads its anchor ``ac`` from the scratch: the state before the',
           "    mini-batch's first step or, for a mini-batch begun before the chunk, the checkpoint's anchor;",
           "    ``ga``, the anchor's adjoint, gathers over the mini-batch and joins ``g`` at its first step."] if mb else []),
        '    VARLEN: program row b is sequence b of a packed row. ATOMIC: the row blocks add the gradients of',
        '    the leaves shared by the rows (over m, per head) into one buffer, else each stores its partial."""',
        *PREAMBLE,
        *[f"    g{x} = tl.zeros([BK, BV], dtype=tl.float32)" for _, x in states],
        *[f"    ga{x} = tl.zeros([BK, BV], dtype=tl.float32)" for _, x in states if mb],
        "    if HAS_DHT:",
        *[f"        g{x} += tl.load(DHT + {sbase(i, ns)} * K * V + tile, mask=MASK, other=0.).to(tl.float32)"
          for i, x in states],
        *partials_stride("    "),
        *sequence_lines("    "),
        *[f"    scr{x} = SCR + {scr_block(i, ns)} * {scratch_slots(step)} * BK * BV + offs_k[:, None] * BV + tl.arange(0, BV)[None, :]"
          for i, x in states],
        "    for jc in range(0, NC):",
        "        ci = NC - 1 - jc",
        "        t0 = ci * CHUNK",
        "        t1 = tl.minimum(t0 + CHUNK, T)",
        *[f"        sp{x} = tl.load(CK + ({ckbase(i, nck)} + ci) * K * V + tile, mask=MASK, other=0.)"
          for i, x in states],
        *[f"        ac{x} = tl.load(CK + ({ckbase(ns + i, nck)} + ci) * K * V + tile, mask=MASK, other=0.)"
          for i, x in states if mb],
        *[f"        tl.store(scr{x} + CHUNK * BK * BV, ac{x})      # the slot after the chunk's states" for _, x in states if mb],
        *first_loads(step, I1, "(bos + t0) * H + h"),
        "        for t in range(t0, t1):",
        "            row = (bos + t) * H + h",
        "            row_n = (bos + tl.minimum(t + 1, t1 - 1)) * H + h",
        *loads_ahead(step, I2, "row_n"),
        "            if PF > 0:     # the reverse sweep below reads DY at this step",
        f"{IN3}prefetch_l2(DY + row * V + offs_v)",
        *[f"            tl.store(scr{x} + (t - t0) * BK * BV, sp{x})" for _, x in states],
        *anchor_reset(step, I2),
        *rec_red,
        *recompute,
        "        tl.debug_barrier()",
        *first_loads(step, I1, "(bos + t1 - 1) * H + h"),
        dy_load(I1, "n_dy", "row_n"),
        *[f"        n_sp{x} = tl.load(scr{x} + (t1 - 1 - t0) * BK * BV)" for _, x in states],
        "        for jt in range(0, t1 - t0):",
        "            t = t1 - 1 - jt",
        "            row = (bos + t) * H + h",
        "            row_n = (bos + tl.maximum(t - 1, t0)) * H + h",
        *loads_ahead(step, I2, "row_n"),
        "            dy = n_dy.to(tl.float32)[None, :]",
        dy_load(I2, "n_dy", "row_n"),
        *[f"            sp{x} = n_sp{x}" for _, x in states],
        *[f"            n_sp{x} = tl.load(scr{x} + (tl.maximum(t - 1, t0) - t0) * BK * BV)" for _, x in states],
        "            if PF > 0:     # the previous chunk's steps: its recompute pass reads them next",
        "                row_p = (bos + tl.maximum(t - CHUNK, 0)) * H + h",
        *prefetches(step, IN3, "row_p", dy=True),
        *(["            jm = t - t % MB      # this mini-batch's first step",
           *(f"            ac{x} = tl.load(scr{x} + tl.where(jm >= t0, jm - t0, CHUNK) * BK * BV)" for _, x in states)]
          if mb else []),
        *b_fwd,
        *b_shared,
        *[f"            st{x} = tl.where(MASK, {pr.tile(step.Fs[i])}, 0.0)" for i, x in states],     # in the shared factors
        *b_ro,
        "            # readout adjoint: G += d(sum DY*y)/dS",
        *b_a,
        *[f"            g{x} = g{x} + tl.where(MASK, {pr.tile(step.dS_ros[i])}, 0.0)" for i, x in states],
        "            # transition adjoint: d(sum G*F)/d(inputs), then G <- d(sum G*F)/dS_prev",
        *b_b,
        *[line for n, ld, val in grads for line in leaf_store(n, ld, step, val, I2)],
        *adjoint_back,
        "    if STORE_DS0:",
        *[f"        tl.store(DS0 + {sbase(i, ns)} * K * V + tile, g{x}, mask=MASK)" for i, x in states],
    ]


def kernel_source(ir, step: Step, header: str) -> str:
    """The Triton source (forward and backward kernels) of one general/nonlinear update."""
    pr = TilePrinter(step)
    leaf_ptrs = ", ".join(f"P_{n}" for n, _, _ in step.leaves)
    grad_ptrs = ", ".join(f"D_{n}" for n, _, _ in step.leaves)
    states = list(zip(range(step.n_states), suffixes(step)))
    F_codes = [pr.tile(F) for F in step.Fs]
    fwd = _forward_kernel(step, pr, leaf_ptrs, states, F_codes)
    bwd = _backward_kernel(step, pr, leaf_ptrs, grad_ptrs, states, F_codes)
    doc = "\n".join([safe_source.comment(header), "# Generated by ssmcraft (ssmcraft/ops/codegen/general.py): edit the spec, not this file.",
                     safe_source.docstring("\n".join([
                         f"Fused sequential kernels of {ir.spec_name!r} ({ir.kind}).", "",
                         *(f"    {S.name}_t[i,j] = {sympy.sstr(F)}" for S, F in zip(step.Ss, step.Fs)),
                         *(f"    {r.symbol.name} = sum_{r.over} {sympy.sstr(r.body)}" for r in step.alg.reductions_in(sympy.Add(*step.Fs))),
                         f"    y_t[i] = {sympy.sstr(step.readout)}", ""]))])
    return "\n".join([doc, "import triton", "import triton.language as tl", "", "", *PREFETCH_L2, "", "", *fwd, "", "",
                      *bwd]) + "\n"
