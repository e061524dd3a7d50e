"""General and nonlinear updates (``general`` / ``nonlinear`` IR kinds): a fused sequential
Triton kernel generated per objective, with a symbolically derived backward.

The update is an element expression ``S_t[i, j] = F(S_prev, inputs)`` with reductions over
the state (``ir.state_update``, ``ir.state_reductions``); for example the robust delta rule
``objectives/cauchy_delta.yaml``::

    _r0 = sum_m S_prev*k,   _r1 = sum_d (_r0 - x)**2
    S_t = (S_prev*_r1 + S_prev - _r0*beta*k + beta*k*x)/(_r1 + 1)

Kernels (one program per batch*head, the whole ``[K, V]`` state in registers, transposed as
in FLA; fp32 state and arithmetic, fp32/bf16 I/O):

forward  loop over t: load the step's leaves (inputs, params), evaluate the reductions and
         ``F``, the readout, store ``y``; for training, store the state every ``CHUNK`` steps.
backward chunks in reverse: recompute the chunk's states from its checkpoint into a
         per-program scratch buffer ``[CHUNK, K, V]``, then step back through them. The
         step's adjoint is derived here with ``ssmcraft.compiler.derive.gradient`` (reverse
         mode through reductions): with ``G`` the adjoint of ``S_t`` and ``DY`` of ``y_t``,

             L_ro = sum_i DY_i y_i(S_t, in)          L_F = sum_ij G_ij F_ij(S_prev, in)
             G   += dL_ro/dS_t;   d in += dL_ro/d in + dL_F/d in;   G <- dL_F/dS_prev

         and printed with the Triton printer (``ssmcraft.kernels.triton_printer``); the
         adjoint's sub-expressions that read no state (e.g. a Woodbury denominator) are
         computed once per step (``shared_factors``) instead of in every term.

Every leaf is laid out ``[B, T, H, n]`` (``[B, T, H]`` for scalars; params are expanded to that
form by autograd-aware ``expand``, so their gradients are reduced by autograd). The
generated source is readable and cached (``ssmcraft.compiler.cache``).

Row tiling: the grid is ``(B*H, NV)``, program ``(bh, iv)`` owning rows
``iv*BV .. iv*BV + BV - 1`` of the state. A general update may sum over rows, so it runs with
one block (``NV = 1``); a row-separable one (``rankr``, ``ssmcraft.kernels.rankr_row``) runs
several, and the gradients of leaves shared by the rows (over ``m`` or per head) are written
per row block (``[NV, ...]``) and summed on the host. Structured updates are lowered to their
element form (``ssmcraft.compiler.structure.element_form``), general ones give ``ir.state_update``.

Several states (``ir.states``, ``ir.state_updates``): one register tile, checkpoint, scratch
block and adjoint per state (``sp0, sp1, ...``), stacked ``[B, H, n, K, V]`` on the host. The
generator composes them with row tiling (scratch blocks ordered ``[B*H, NV, n]``), but
several-state updates are classified ``general`` and so run with one row block.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from ssmcraft.compiler import cache
from ssmcraft.compiler.derive import gradient
from ssmcraft.compiler.structure import element_form
from ssmcraft.compiler.symbolic import Algebra, Reduction
from ssmcraft.kernels.launch import launch
from ssmcraft.kernels.tuning import INTERPRET, buffer, cdiv, io_dtype, next_pow2

CHUNK = 32               # checkpoint interval of the backward (steps)
POISON = False           # tests: allocate outputs with NaN


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
    Fs = [sympy.sympify(F) for F in (ir.state_updates if several else (ir.state_update,))]
    L_ro = alg.reduce(DY * readout, d)
    L_F = sympy.Add(*(alg.reduce(alg.reduce(G * F, m), d) for G, F in zip(Gs, Fs)))
    dS_ros = [gradient(alg, L_ro, S) for S in Ss]
    dS_prevs = [gradient(alg, L_F, S_prev) for S_prev in S_prevs]
    din_ro = {n: gradient(alg, L_ro, s) for n, _, s in leaves}
    din_F = {n: gradient(alg, L_F, s) for n, _, s in leaves}
    return Step(alg, (d, m), S_prevs, Ss, Gs, DY, leaves, Fs, readout, dS_ros, din_ro, dS_prevs, din_F)


# ----------------------------------------------------------------------------------------
# code generation (kernels)
# ----------------------------------------------------------------------------------------

def _triton_code(expr, names) -> str:
    """``ssmcraft.kernels.triton_printer`` with sympy's parenthesising rule: its printer's
    ``parenthesize`` drops the parentheses of an operand of equal precedence when
    ``strict=False`` (``-b*x/(1 + y)`` printed as ``-b*x/1.0 + y``); sympy's rule wraps it."""
    from sympy.printing.precedence import precedence

    from ssmcraft.kernels.triton_printer import TritonPrinter

    class _Fixed(TritonPrinter):
        def parenthesize(self, item, level, strict=False):
            p = precedence(item)
            if p < level or (not strict and p <= level) or (isinstance(item, sympy.Number) and item.is_negative):
                return f"({self._print(item)})"
            return self._print(item)

    return _Fixed(names).doprint(sympy.sympify(expr))


class _Printer:
    """Prints element expressions as 2D Triton values over the ``[BK, BV]`` tile: d-indexed
    values are ``[1, BV]``, m-indexed ``[BK, 1]``, both ``[BK, BV]``, scalars scalars."""

    def __init__(self, step: Step):
        d, m = step.dims
        names = {d: "V_f", m: "K_f", step.DY.name: "dy"}
        for sfx, S_prev, S, G in zip(_suffixes(step), step.S_prevs, step.Ss, step.Gs):
            names.update({S_prev.name: f"sp{sfx}", S.name: f"st{sfx}", G.name: f"g{sfx}"})
        for n, _, s in step.leaves:
            names[s.name] = f"l_{n}"
        self._setup(step.alg, step.dims, names)

    def _setup(self, alg, dims, names: dict) -> None:
        """The printer's state: the algebra and (d, m) dims, symbol -> Triton variable names."""
        self.alg, self.dims, self.names = alg, dims, names
        self.done: set = set()
        self.rewrite: dict = {}      # expression -> the same in shared factors (``shared_factors``)

    def expr(self, e) -> str:
        e = self.rewrite.get(e, e)
        for s in sympy.sympify(e).free_symbols:
            if s in self.alg.reductions:
                self.names.setdefault(s.name, f"r_{s.name.lstrip('_')}")
        return _triton_code(e, self.names)

    def reductions(self, exprs, indent) -> list[str]:
        """Lines computing every reduction ``exprs`` use (inner first) not yet computed."""
        lines = []
        for e in exprs:
            for r in self.alg.reductions_in(e):
                if r.symbol in self.done:
                    continue
                self.done.add(r.symbol)
                self.names[r.symbol.name] = f"r_{r.symbol.name.lstrip('_')}"
                lines.append(f"{indent}{self.names[r.symbol.name]} = {self.reduce(r)}")
        return lines

    def reduce(self, r) -> str:
        """The Triton sum of reduction ``r`` over the tile (padding masked out)."""
        d, m = self.dims
        mask = "MASK" if {d, m} <= self.alg.dims_of(r.body) else "mask_k[:, None]" if r.over == m else "mask_v[None, :]"
        return f"tl.sum(tl.where({mask}, {self.expr(r.body)}, 0.0), axis={0 if r.over == m else 1}, keep_dims=True)"


def shared_factors(step: Step, pr: _Printer, indent: str) -> list[str]:
    """Lines computing the common sub-expressions of the backward step's adjoint that read no
    state (leaves and reductions of leaves only: e.g. a Woodbury denominator
    ``1 + r0 beta + r1 beta - r2^2 beta^2 + r0 r1 beta^2``), once per step, as ``c_<n>``; the
    printer then prints the adjoint's expressions (and the bodies of the reductions they still
    need) in terms of them (``pr.rewrite``). Without this, the symbolic adjoint repeats such a
    factor in every term over the whole ``[BK, BV]`` tile. Reductions already computed
    (``pr.done``: those of the update) keep their printed form."""
    alg = step.alg
    state = {*step.S_prevs, *step.Ss, *step.Gs, step.DY}
    ignore = state | {sym for sym, r in alg.reductions.items() if any(alg.depends_on(r.body, x) for x in state)}
    adjoint = [e for e in (*step.dS_ros, *step.din_ro.values(), *step.dS_prevs, *step.din_F.values())
               if sympy.sympify(e) != 0]
    bodies = [r.body for r in alg.reductions_in(sympy.Add(*adjoint)) if r.symbol not in pr.done]
    originals = [*adjoint, *bodies]
    temps, reduced = sympy.cse(originals, symbols=sympy.numbered_symbols("_cse"), ignore=tuple(ignore))
    if not temps:
        return []
    lines = pr.reductions([e for _, e in temps], indent)
    for i, (sym, e) in enumerate(temps):
        code = pr.expr(e)
        pr.names[sym.name] = f"c_{i}"
        lines.append(f"{indent}c_{i} = {code}")
    pr.rewrite = dict(zip(originals, reduced))
    return lines


def _suffixes(step: Step) -> list[str]:
    """Per-state suffix of the kernel's variables: ``sp``, ``st``, ``g`` with one state,
    ``sp0``, ``sp1``, ... with several."""
    return [""] if step.n_states == 1 else [str(i) for i in range(step.n_states)]


def _sbase(i: int, ns: int) -> str:
    """The (batch*head, state) index of a state tile: state i of ns, stacked after [B, H]."""
    return "i_bh.to(tl.int64)" if ns == 1 else f"(i_bh.to(tl.int64) * {ns} + {i})"


def _scr_block(i: int, ns: int) -> str:
    """The scratch block of state i of ns in program (batch*head, row block): blocks of
    ``CHUNK * BK * BV`` ordered [B*H, NV, ns]."""
    blk = "(i_bh.to(tl.int64) * tl.num_programs(1) + i_v)"
    return blk if ns == 1 else f"({blk} * {ns} + {i})"


def _leaf_load(name, ldims, step, indent) -> str:
    d, m = step.dims
    v = f"l_{name}"
    if tuple(ldims) == (d,):
        return f"{indent}{v} = tl.load(P_{name} + row * V + offs_v, mask=mask_v, other=0.).to(tl.float32)[None, :]"
    if tuple(ldims) == (m,):
        return f"{indent}{v} = tl.load(P_{name} + row * K + offs_k, mask=mask_k, other=0.).to(tl.float32)[:, None]"
    if not ldims:
        return f"{indent}{v} = tl.load(P_{name} + row).to(tl.float32)"
    # [d, m] leaf laid out [B, T, H, V, K]
    return (f"{indent}{v} = tl.load(P_{name} + row * V * K + offs_v[None, :] * K + offs_k[:, None], "
            f"mask=MASK, other=0.).to(tl.float32)")


def _leaf_store(name, ldims, step, value, indent) -> list[str]:
    d, m = step.dims
    if tuple(ldims) == (d,):
        return [f"{indent}tl.store(D_{name} + row * V + offs_v, tl.sum({value} + ZR, axis=0), mask=mask_v)"]
    if tuple(ldims) == (m,):       # shared by the rows: one partial sum per row block
        return [f"{indent}tl.store(D_{name} + i_v * NBT * K + row * K + offs_k, tl.sum({value} + ZC, axis=1), mask=mask_k)"]
    if not ldims:
        return [f"{indent}tl.store(D_{name} + i_v * NBT + row, tl.sum(tl.sum({value} + Z11, axis=1), axis=0))"]
    return [f"{indent}tl.store(D_{name} + row * V * K + offs_v[None, :] * K + offs_k[:, None], {value} + Z2, mask=MASK)"]


def kernel_source(ir, step: Step, header: str) -> str:
    """The Triton source (forward and backward kernels) of one general/nonlinear update."""
    pr = _Printer(step)
    leaf_ptrs = ", ".join(f"P_{n}" for n, _, _ in step.leaves)
    grad_ptrs = ", ".join(f"D_{n}" for n, _, _ in step.leaves)
    I1, I2 = " " * 8, " " * 12
    preamble = [
        "    i_bh = tl.program_id(0)",
        "    i_v = tl.program_id(1)",
        "    b = i_bh // H",
        "    h = i_bh % H",
        "    offs_v = i_v * BV + tl.arange(0, BV)",
        "    offs_k = tl.arange(0, BK)",
        "    mask_v = offs_v < V",
        "    mask_k = offs_k < K",
        "    MASK = mask_k[:, None] & mask_v[None, :]",
        "    tile = offs_k[:, None] * V + offs_v[None, :]",
        "    V_f = V * 1.0",
        "    K_f = K * 1.0",
        "    ZR = tl.zeros([1, BV], dtype=tl.float32)",
        "    ZC = tl.zeros([BK, 1], dtype=tl.float32)",
        "    Z2 = tl.zeros([BK, BV], dtype=tl.float32)",
        "    Z11 = tl.zeros([1, 1], dtype=tl.float32)",
    ]
    ns, sfx = step.n_states, _suffixes(step)
    states = list(zip(range(ns), sfx))
    F_codes = [pr.expr(F) for F in step.Fs]
    fwd_red_F = pr.reductions(step.Fs, I2)
    pr_ro = pr.reductions([step.readout], I2)
    fwd = [
        "@triton.jit",
        f"def fwd_kernel({leaf_ptrs}, S0, Y, ST, CK, T, H, V, K, NC,",
        "               BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr,",
        "               HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, STORE_CK: tl.constexpr):",
        '    """One program per (batch*head, block of BV rows): the state tile' + ("" if ns == 1 else f" (each of {ns})")
        + ', transposed [BK, BV], in registers."""',
        *preamble,
        *[f"    sp{x} = tl.zeros([BK, BV], dtype=tl.float32)" for _, x in states],
        "    if HAS_S0:",
        *[f"        sp{x} += tl.load(S0 + {_sbase(i, ns)} * K * V + tile, mask=MASK, other=0.).to(tl.float32)"
          for i, x in states],
        "    if STORE_CK:",
        *[f"        tl.store(CK + {_sbase(i, ns)} * NC * K * V + tile, sp{x}, mask=MASK)" for i, x in states],
        "    for t in range(0, T):",
        "        row = (b.to(tl.int64) * T + t) * H + h",
        *[_leaf_load(n, ld, step, I1) for n, ld, _ in step.leaves],
        *[line.replace(I2, I1, 1) for line in fwd_red_F],
        *[f"        st{x} = tl.where(MASK, {F_codes[i]} + Z2, 0.0)" for i, x in states],
        *[line.replace(I2, I1, 1) for line in pr_ro],
        f"        y = tl.sum({pr.expr(step.readout)} + ZR, axis=0)",
        "        tl.store(Y + row * V + offs_v, y.to(Y.dtype.element_ty), mask=mask_v)",
        *[f"        sp{x} = st{x}" for _, x in states],
        "        if STORE_CK:",
        "            if (t + 1) % CHUNK == 0:",
        "                if (t + 1) // CHUNK < NC:",
        *[f"                    tl.store(CK + ({_sbase(i, ns)} * NC + (t + 1) // CHUNK) * K * V + tile, sp{x}, mask=MASK)"
          for i, x in states],
        "    if STORE_ST:",
        *[f"        tl.store(ST + {_sbase(i, ns)} * K * V + tile, sp{x}, mask=MASK)" for i, x in states],
    ]
    # backward: fresh reduction bookkeeping (each loop body computes its own)
    pr.done = set()
    rec_red = pr.reductions(step.Fs, I2)
    pr.done = set()
    b_fwd = pr.reductions(step.Fs, I2)
    b_shared = shared_factors(step, pr, I2)
    b_ro = pr.reductions([step.readout], I2)
    b_a = pr.reductions([*step.dS_ros, *step.din_ro.values()], I2)
    b_b = pr.reductions([*step.dS_prevs, *step.din_F.values()], I2)
    grads = []
    for n, ld, s in step.leaves:
        parts = [e for e in (step.din_ro[n], step.din_F[n]) if e != 0]
        if not parts:
            grads.append((n, ld, "0.0"))
            continue
        grads.append((n, ld, " + ".join(f"({pr.expr(e)})" for e in parts)))
    if ns == 1:     # one state: the step's new value and adjoint replace the old ones in place
        recompute = [f"            sp = tl.where(MASK, {F_codes[0]} + Z2, 0.0)"]
        adjoint_back = [f"            g = tl.where(MASK, {pr.expr(step.dS_prevs[0])} + Z2, 0.0)"]
    else:           # several: every new value (adjoint) reads every old one, so two phases
        recompute = [*(f"            st{x} = tl.where(MASK, {F_codes[i]} + Z2, 0.0)" for i, x in states),
                     *(f"            sp{x} = st{x}" for _, x in states)]
        adjoint_back = [*(f"            gn{x} = tl.where(MASK, {pr.expr(step.dS_prevs[i])} + Z2, 0.0)" for i, x in states),
                        *(f"            g{x} = gn{x}" for _, x in states)]
    bwd = [
        "@triton.jit",
        f"def bwd_kernel({leaf_ptrs}, {grad_ptrs}, CK, SCR, DY, DHT, DS0, T, H, V, K, NC,",
        "               BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr,",
        "               HAS_DHT: tl.constexpr, STORE_DS0: tl.constexpr):",
        '    """Reverse sweep: per chunk, recompute the states into SCR, then step the adjoint back."""',
        *preamble,
        *[f"    g{x} = tl.zeros([BK, BV], dtype=tl.float32)" for _, x in states],
        "    if HAS_DHT:",
        *[f"        g{x} += tl.load(DHT + {_sbase(i, ns)} * K * V + tile, mask=MASK, other=0.).to(tl.float32)"
          for i, x in states],
        "    NBT = tl.num_programs(0).to(tl.int64) * T          # B*H*T: stride of a row block's partial gradients",
        *[f"    scr{x} = SCR + {_scr_block(i, ns)} * CHUNK * BK * BV + offs_k[:, None] * BV + tl.arange(0, BV)[None, :]"
          for i, x in states],
        "    for jc in range(0, NC):",
        "        ci = NC - 1 - jc",
        "        t0 = ci * CHUNK",
        "        t1 = tl.minimum(t0 + CHUNK, T)",
        *[f"        sp{x} = tl.load(CK + ({_sbase(i, ns)} * NC + ci) * K * V + tile, mask=MASK, other=0.)"
          for i, x in states],
        "        for t in range(t0, t1):",
        "            row = (b.to(tl.int64) * T + t) * H + h",
        *[_leaf_load(n, ld, step, I2) for n, ld, _ in step.leaves],
        *[f"            tl.store(scr{x} + (t - t0) * BK * BV, sp{x})" for _, x in states],
        *rec_red,
        *recompute,
        "        tl.debug_barrier()",
        "        for jt in range(0, t1 - t0):",
        "            t = t1 - 1 - jt",
        "            row = (b.to(tl.int64) * T + t) * H + h",
        *[_leaf_load(n, ld, step, I2) for n, ld, _ in step.leaves],
        "            dy = tl.load(DY + row * V + offs_v, mask=mask_v, other=0.).to(tl.float32)[None, :]",
        *[f"            sp{x} = tl.load(scr{x} + (t - t0) * BK * BV)" for _, x in states],
        *b_fwd,
        *b_shared,
        *[f"            st{x} = tl.where(MASK, {F_codes[i]} + Z2, 0.0)" for i, x in states],
        *b_ro,
        "            # readout adjoint: G += d(sum DY*y)/dS",
        *b_a,
        *[f"            g{x} = g{x} + tl.where(MASK, {pr.expr(step.dS_ros[i])} + Z2, 0.0)" for i, x in states],
        "            # transition adjoint: d(sum G*F)/d(inputs), then G <- d(sum G*F)/dS_prev",
        *b_b,
        *[line for n, ld, val in grads for line in _leaf_store(n, ld, step, val, I2)],
        *adjoint_back,
        "    if STORE_DS0:",
        *[f"        tl.store(DS0 + {_sbase(i, ns)} * K * V + tile, g{x}, mask=MASK)" for i, x in states],
    ]
    doc = "\n".join(["# " + header, "# Generated by ssmcraft (ssmcraft/kernels/general.py): edit the spec, not this file.",
                     f'"""Fused sequential kernels of {ir.spec_name!r} ({ir.kind}).', "",
                     *(f"    {S.name}_t[i,j] = {sympy.sstr(F)}" for S, F in zip(step.Ss, step.Fs)),
                     *(f"    {r.symbol.name} = sum_{r.over} {sympy.sstr(r.body)}" for r in step.alg.reductions_in(sympy.Add(*step.Fs))),
                     f"    y_t[i] = {sympy.sstr(step.readout)}", '"""'])
    return "\n".join([doc, "import triton", "import triton.language as tl", "", "", *fwd, "", "", *bwd]) + "\n"


_MODULES: dict = {}    # content hash of the element form -> (step, module, source)


def _module(ir):
    """(Step, generated module, source) of ``ir``'s fused kernels, cached by the content hash
    of its element form (``structure.element_form``, kept on the IR: ``UpdateIR.memo``), so
    that a structured IR and its element form (the rank-r family and the one-token decode
    family of one objective) share one derivation of the adjoint and one module."""
    ir = element_form(ir)
    key = ir.content_hash()
    if key not in _MODULES:
        step = build_step(ir)
        header = f"spec: {ir.spec_name} ({ir.source}); IR {key}"
        source = kernel_source(ir, step, header)
        mod = cache.load_generated(f"general_{ir.spec_name}", cache.key_for("general", source), source)
        _MODULES[key] = (step, mod, source)
    return _MODULES[key]


def generated_source(ir) -> str:
    """The generated kernels of ``ir`` (its element form); what ``ssmcraft derive SPEC --kernel`` prints."""
    return _module(ir)[2]


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _new(shape, device, dtype=torch.float32):
    return buffer(shape, device, dtype, POISON)


def _warps(BK, BV):
    n = BK * BV
    return 1 if INTERPRET else (4 if n <= 2048 else 8 if n <= 8192 else 16)


def _stacked(ir) -> tuple:
    """Several states travel stacked as one tensor [B, H, n, ...]; one state as [B, H, ...]."""
    return (len(ir.states),) if ir.states else ()


def _stack_states(ir, S0):
    """A tuple of per-state tensors [B, H, r, c] -> one [B, H, n, r, c] (None stays None)."""
    if S0 is None or not ir.states:
        return S0
    return torch.stack(tuple(S0), dim=2)


def _unstack_states(ir, S):
    return tuple(S.unbind(2)) if (S is not None and ir.states) else S


class _GeneralFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ir, shape, out_dtype, output_final_state, S0, *leaves):
        """shape: (B, T, H, K, V, BV), BV the rows per program (``next_power_of_2(V)``: one block)."""
        step, mod, _ = _module(ir)
        B, T, H, K, V, BV = shape
        dev = leaves[0].device
        BK, NV = next_pow2(K), cdiv(V, BV)
        NC = max(1, cdiv(T, CHUNK))
        ns = _stacked(ir)                  # () for one state, (n,) for n states stacked after [B, H]
        training = any(x.requires_grad for x in leaves) or (S0 is not None and S0.requires_grad)
        y = _new((B, T, H, V), dev, out_dtype)
        ST = _new((B, H, *ns, K, V), dev)
        CK = _new((B, H, *ns, NC, K, V), dev) if training else None
        d = torch.empty(1, device=dev)
        S0c = S0.transpose(-1, -2).contiguous().float() if S0 is not None else None    # [B, H, K, V]
        if T > 0:
            launch(mod.fwd_kernel, (B * H, NV), *leaves, S0c if S0c is not None else d, y, ST,
                   CK if CK is not None else d, T, H, V, K, NC, BV=BV, BK=BK, CHUNK=CHUNK, HAS_S0=S0c is not None,
                   STORE_ST=True, STORE_CK=CK is not None, num_warps=_warps(BK, BV))
        else:
            ST.copy_(S0c if S0c is not None else torch.zeros_like(ST))
        ctx.save_for_backward(CK, *leaves)
        ctx.ir, ctx.shape, ctx.has_s0 = ir, shape, S0 is not None
        ctx.s0_dtype = S0.dtype if S0 is not None else None
        return y, (ST.transpose(-1, -2) if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dST):
        CK, *leaves = ctx.saved_tensors
        step, mod, _ = _module(ctx.ir)
        B, T, H, K, V, BV = ctx.shape
        dev = leaves[0].device
        BK, NV = next_pow2(K), cdiv(V, BV)
        NC = max(1, cdiv(T, CHUNK))
        d_dim = ctx.ir.dims[0]
        shared = [d_dim not in dims for _, dims, _ in step.leaves]     # over m or per head: per row block
        grads = [_new((NV, *x.shape) if sh else x.shape, dev) for sh, x in zip(shared, leaves)]
        ns = _stacked(ctx.ir)
        DS0 = _new((B, H, *ns, K, V), dev) if ctx.has_s0 else None
        SCR = torch.empty(B * H * NV * (ns[0] if ns else 1) * CHUNK * BK * BV, device=dev, dtype=torch.float32)
        d = torch.empty(1, device=dev)
        dht = dST.transpose(-1, -2).contiguous() if dST is not None else None
        if dy is None:
            dy = torch.zeros(B, T, H, V, device=dev)
        if T > 0:
            launch(mod.bwd_kernel, (B * H, NV), *leaves, *grads, CK, SCR, dy.contiguous(),
                   dht if dht is not None else d, DS0 if DS0 is not None else d, T, H, V, K, NC, BV=BV, BK=BK,
                   CHUNK=CHUNK, HAS_DHT=dht is not None, STORE_DS0=DS0 is not None, num_warps=_warps(BK, BV))
        elif DS0 is not None:
            DS0.copy_(dht if dht is not None else torch.zeros_like(DS0))
        dS0 = DS0.transpose(-1, -2).to(ctx.s0_dtype) if DS0 is not None else None
        grads = [(g.sum(0) if NV > 1 else g[0]) if sh else g for sh, g in zip(shared, grads)]
        return (None, None, None, None, dS0, *[g.to(x.dtype) for g, x in zip(grads, leaves)])


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------

def general_scan(objective, tensors: dict, initial_state=None, output_final_state: bool = False):
    """Run the generated kernel of a general/nonlinear ``objective`` (CompiledObjective or
    library name) in FLA's layout.

    tensors: the spec's inputs and params, d-indexed ``[B, T, H, V]``, m-indexed
      ``[B, T, H, K]``, scalars ``[B, T, H]`` (params may be given in these expanded forms or of
      their declared shape / ``[H, *shape]``); fp32 or bf16.
    initial_state: ``[B, H, K, V]`` or None (several states: a tuple of them, declaration order).
    Returns ``(y [B, T, H, V]`` in the first input's dtype, ``S_T [B, H, K, V]`` fp32 (a tuple with
    several states) or None).
    """
    obj = objective
    if isinstance(objective, str):
        import ssmcraft
        obj = ssmcraft.compile(objective)
    ir = obj.ir
    d, m = ir.dims
    first = tensors[next(iter(ir.inputs))]
    B, T, H = first.shape[:3]
    K = V = None
    for n, dims in ir.inputs.items():
        for dim, s in zip(dims, tensors[n].shape[3:]):
            if dim == d:
                V = s
            else:
                K = s
    initial_state = _stack_states(ir, initial_state)
    if initial_state is not None:
        K, V = initial_state.shape[-2], initial_state.shape[-1]
    leaves = []
    for n, dims in list(ir.inputs.items()) + list(ir.params.items()):
        t = tensors[n]
        full = (B, T, H) + tuple(V if x == d else K for x in dims)
        if tuple(t.shape) != full:
            t = t.reshape((1, 1, t.shape[0] if t.dim() > len(dims) else 1) + t.shape[t.dim() - len(dims):])
            t = t.expand(full)
        leaves.append(t.contiguous())
    S0 = initial_state.transpose(-1, -2) if initial_state is not None else None
    out_dtype = io_dtype(first.dtype)
    y, S = _GeneralFunction.apply(ir, (B, T, H, K, V, next_pow2(V)), out_dtype, output_final_state,
                                  S0, *leaves)
    return y, _unstack_states(ir, S.transpose(-1, -2) if S is not None else None)


def row_sums(step: Step) -> list[str]:
    """The reductions over the rows (``d``) in the step, its readout and their adjoints, by name:
    with none, the rows are independent and the kernel may run row-tiled (``NV > 1``)."""
    exprs = [*step.Fs, step.readout, *step.dS_prevs, *step.dS_ros]
    return sorted({r.symbol.name for e in exprs for r in step.alg.reductions_in(e) if r.over == step.dims[0]})


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.kernels.triton_backend)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernel, else the reason."""
    if ir.kind not in ("general", "nonlinear"):
        return f"not a general/nonlinear update ({ir.kind})"
    if ir.minibatch:
        return (f"a mini-batch update (chunks of {ir.minibatch}, gradients at the state before the chunk) needs the "
                "chunk's starting state, which the kernel does not carry")
    if ir.state_shapes and not ir.inverses:
        return (f"states of several shapes ({', '.join(f'{x}: [{chr(44).join(ir.shape_of(x))}]' for x in ir.states)}) "
                "do not fit the kernel's one [K, V] tile per state")
    if ir.inverses:
        return (f"square states ({', '.join(x for x, _, _ in ir.inverses)}: [m, m], carried by their inverses) do not "
                "fit the kernel's one [K, V] tile per state")
    try:
        step, _, _ = _module(ir)
    except NotImplementedError as e:
        return f"cannot print the update for Triton: {e}"
    return None


def runner(obj, ir, lay, row_block=None):
    """A runner for one call signature (``lay`` from ``reference.validate``: sizes and dtypes) of
    the fused kernel of ``ir`` (``obj.ir``, or its element form for decode): the leaves go to the
    kernel as the caller's tensors, in their own dtype (params broadcast to ``[B, T, H, *]``), with no
    per-call validation or layout. ``row_block``: rows per program (None: all rows in one).
    Returns ``fn(inputs, params, initial_state, output_final_state) -> (y [B,T,H,d], S_T)``."""
    from ssmcraft.kernels.slots import CallSlots, NO_COMPUTED
    names = [*ir.inputs, *ir.params]
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    BV = row_block or next_pow2(d)
    out_dtype = io_dtype(lay.out_dtype)

    def fn(inputs, params, initial_state, output_final_state):
        cs = CallSlots(obj, {}, inputs, params, B, T, H, d, m, NO_COMPUTED)
        leaves = [cs.leaf(n).contiguous() for n in names]
        y, S = _GeneralFunction.apply(ir, (B, T, H, m, d, BV), out_dtype, output_final_state,
                                      _stack_states(ir, initial_state), *leaves)
        return y.to(lay.out_dtype), _unstack_states(ir, S)
    return fn


def prepare(obj, lay):
    """The family's runner for one call signature (see ``runner``; one row block)."""
    return runner(obj, obj.ir, lay)


def forward(obj, lay, co, output_final_state, row_block=None):
    """Family contract: the kernel computes everything from the layout's leaves (``co`` unused).
    ``row_block``: rows per program (a power of 2; None: all rows in one program).
    Returns (y [B, T, H, d] in lay.dtype, S_T [B, H, d, m] fp32 or None)."""
    ir = obj.ir
    d, m = ir.dims
    B, T, H, V, K = lay.B, lay.T, lay.H, lay.d, lay.m
    leaves = []
    for n, dims in list(ir.inputs.items()) + list(ir.params.items()):
        t = lay.env[n]                                           # [B|1, T|1, H|1, r, c]
        t = t.expand(B, T, H, t.shape[3], t.shape[4])
        if tuple(dims) == (d,):
            t = t.reshape(B, T, H, V)
        elif tuple(dims) == (m,):
            t = t.reshape(B, T, H, K)
        elif not dims:
            t = t.reshape(B, T, H)
        leaves.append(t.contiguous())
    BV = row_block or next_pow2(V)
    S0 = _stack_states(ir, lay.S0)
    y, S = _GeneralFunction.apply(ir, (B, T, H, K, V, BV), torch.float32, output_final_state, S0, *leaves)
    return y.to(lay.dtype), _unstack_states(ir, S)
