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

         and printed with the Triton printer (``ssmcraft.kernels.triton_printer``).

Every leaf is laid out ``[B, T, H, n]`` (``[B, T, H]`` for scalars; params are expanded to that
form by autograd-aware ``expand``, so their gradients are reduced by autograd). The
generated source is readable and cached (``ssmcraft.compiler.cache``).

Row tiling: the grid is ``(B*H, NV)``, program ``(bh, iv)`` owning rows
``iv*BV .. iv*BV + BV - 1`` of the state. A general update may sum over rows, so it runs with
one block (``NV = 1``); a row-separable one (``rankr``, ``ssmcraft.kernels.rankr_row``) runs
several, and the gradients of leaves shared by the rows (over ``m`` or per head) are written
per row block (``[NV, ...]``) and summed on the host. Structured updates are given by their
slots (``slot_update``), general ones by ``ir.state_update``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import sympy
import torch
import triton

from ssmcraft.compiler import cache
from ssmcraft.compiler.derive import gradient
from ssmcraft.compiler.symbolic import Algebra, Reduction

CHUNK = 32               # checkpoint interval of the backward (steps)
POISON = False           # tests: allocate outputs with NaN


# ----------------------------------------------------------------------------------------
# the step, symbolically
# ----------------------------------------------------------------------------------------

@dataclass
class Step:
    """The update, readout and their adjoints over one algebra (element expressions)."""
    alg: Algebra
    dims: tuple
    S_prev: sympy.Symbol
    S: sympy.Symbol
    G: sympy.Symbol
    DY: sympy.Symbol
    leaves: list            # [(name, dims tuple, Symbol)] in a stable order
    F: sympy.Expr
    readout: sympy.Expr
    dS_ro: sympy.Expr       # d(sum DY*y)/dS
    din_ro: dict            # leaf -> d(sum DY*y)/d leaf
    dS_prev: sympy.Expr     # d(sum G*F)/dS_prev
    din_F: dict             # leaf -> d(sum G*F)/d leaf


def _symbols_of(ir) -> dict:
    out = {}
    exprs = [ir.state_update, ir.readout, *(c.expr for c in ir.coefficients)]
    exprs += [r.body for r in (*ir.reductions, *ir.state_reductions, *ir.readout_reductions)]
    for e in exprs:
        if e is None:
            continue
        for s in sympy.sympify(e).free_symbols:
            out.setdefault(s.name, s)
    return out


def slot_update(ir, alg: Algebra, coef, S_prev) -> sympy.Expr:
    """The element form of a structured update from its slots: ``a . S_prev - sum c_rl (S_prev u_l) v_r + B``
    (one erase term ``c (S_prev u) v`` for ``rank1``, the ``c{r}{l}`` slots for ``rankr``)."""
    m = ir.dims[1]
    erase = [("c", "u", "v")] if ir.kind == "rank1" else [(s, f"u{s[2]}", f"v{s[1]}") for s in ir.erase_slots()]
    F = coef("a", 1) * S_prev
    for c, u, v in erase:
        F -= coef(c, 0) * alg.reduce(S_prev * coef(u, None), m) * coef(v, None)
    if ir.input_slots():
        return F + sum(coef(s, None) * coef(f"v{s[1]}", None) for s in ir.input_slots())
    return F + (coef("p", None) * coef("q", None) if "p" in ir.slots else coef("B", 0))


def build_step(ir) -> Step:
    """Lower the IR of an update into one ``Algebra`` and derive the adjoints."""
    d, m = ir.dims
    alg = Algebra(tuple(ir.dims))
    alg._count = 1000                       # new reductions: _r1000, ... (never clash with the IR's)
    syms = _symbols_of(ir)

    def sym(name, dims, **assume):
        s = syms.get(name) or sympy.Symbol(name, **(assume or {"real": True}))
        alg.symbol_dims[s] = frozenset(dims)
        syms[name] = s
        return s

    for dim in (d, m):
        sym(dim, (), positive=True, integer=True)
    S_prev = sym("S_prev", (d, m))
    S = sym(ir.state, (d, m))
    G = sym("_G", (d, m))
    DY = sym("_DY", (d,))
    leaves = []
    for name, ldims in list(ir.inputs.items()) + list(ir.params.items()):
        leaves.append((name, tuple(ldims), sym(name, ldims)))
    for r in (*ir.reductions, *ir.state_reductions, *ir.readout_reductions):
        s = sym(r.name, r.dims)
        alg.reductions[s] = Reduction(s, r.body, r.over, frozenset(r.dims))
        alg._keys[(r.body, r.over)] = s
    # coefficients -> expressions in leaves and reductions
    sub, by_name = {}, {}
    for c in ir.coefficients:
        e = sympy.sympify(c.expr).xreplace(sub)
        sub[sympy.Symbol(c.name, real=True)] = e
        by_name[c.name] = e

    def coef(slot, default):
        name = ir.slots.get(slot)
        return by_name[name] if name in by_name else default

    if ir.readout is not None:
        readout = sympy.sympify(ir.readout)
    else:
        readout = coef("oc", 1) * alg.reduce(S * coef("oq", None), m) + coef("oh", 0)
    readout = alg.substitute(sympy.sympify(readout), {})
    F = sympy.sympify(ir.state_update) if ir.state_update is not None else slot_update(ir, alg, coef, S_prev)
    L_ro = alg.reduce(DY * readout, d)
    L_F = alg.reduce(alg.reduce(G * F, m), d)
    dS_ro = gradient(alg, L_ro, S)
    dS_prev = gradient(alg, L_F, S_prev)
    din_ro = {n: gradient(alg, L_ro, s) for n, _, s in leaves}
    din_F = {n: gradient(alg, L_F, s) for n, _, s in leaves}
    return Step(alg, (d, m), S_prev, S, G, DY, leaves, F, readout, dS_ro, din_ro, dS_prev, din_F)


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
        self._code = _triton_code
        d, m = step.dims
        self.names = {d: "V_f", m: "K_f", step.S_prev.name: "sp", step.S.name: "st", step.G.name: "g",
                      step.DY.name: "dy"}
        for n, _, s in step.leaves:
            self.names[s.name] = f"l_{n}"
        self.step = step
        self.done: set = set()

    def expr(self, e) -> str:
        for s in sympy.sympify(e).free_symbols:
            if s in self.step.alg.reductions:
                self.names.setdefault(s.name, f"r_{s.name.lstrip('_')}")
        return self._code(e, self.names)

    def reductions(self, exprs, indent) -> list[str]:
        """Lines computing every reduction ``exprs`` use (inner first) not yet computed."""
        alg = self.step.alg
        d, m = self.step.dims
        lines = []
        for e in exprs:
            for r in alg.reductions_in(e):
                if r.symbol in self.done:
                    continue
                self.done.add(r.symbol)
                self.names[r.symbol.name] = f"r_{r.symbol.name.lstrip('_')}"
                axis = 0 if r.over == m else 1
                body_dims = alg.dims_of(r.body)
                mask = "MASK" if {d, m} <= body_dims else "mask_k[:, None]" if r.over == m else "mask_v[None, :]"
                lines.append(f"{indent}{self.names[r.symbol.name]} = tl.sum(tl.where({mask}, {self.expr(r.body)}, 0.0), "
                             f"axis={axis}, keep_dims=True)")
        return lines


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
    F_code = pr.expr(step.F)
    fwd_red_F = pr.reductions([step.F], I2)
    pr_ro = pr.reductions([step.readout], I2)
    fwd = [
        "@triton.jit",
        f"def fwd_kernel({leaf_ptrs}, S0, Y, ST, CK, T, H, V, K, NC,",
        "               BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr,",
        "               HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, STORE_CK: tl.constexpr):",
        '    """One program per (batch*head, block of BV rows): the state tile, transposed [BK, BV], in registers."""',
        *preamble,
        "    sp = tl.zeros([BK, BV], dtype=tl.float32)",
        "    if HAS_S0:",
        "        sp += tl.load(S0 + i_bh.to(tl.int64) * K * V + tile, mask=MASK, other=0.).to(tl.float32)",
        "    if STORE_CK:",
        "        tl.store(CK + i_bh.to(tl.int64) * NC * K * V + tile, sp, mask=MASK)",
        "    for t in range(0, T):",
        "        row = (b.to(tl.int64) * T + t) * H + h",
        *[_leaf_load(n, ld, step, I1) for n, ld, _ in step.leaves],
        *[line.replace(I2, I1, 1) for line in fwd_red_F],
        f"        st = tl.where(MASK, {F_code} + Z2, 0.0)",
        *[line.replace(I2, I1, 1) for line in pr_ro],
        f"        y = tl.sum({pr.expr(step.readout)} + ZR, axis=0)",
        "        tl.store(Y + row * V + offs_v, y.to(Y.dtype.element_ty), mask=mask_v)",
        "        sp = st",
        "        if STORE_CK:",
        "            if (t + 1) % CHUNK == 0:",
        "                if (t + 1) // CHUNK < NC:",
        "                    tl.store(CK + (i_bh.to(tl.int64) * NC + (t + 1) // CHUNK) * K * V + tile, sp, mask=MASK)",
        "    if STORE_ST:",
        "        tl.store(ST + i_bh.to(tl.int64) * K * V + tile, sp, mask=MASK)",
    ]
    # backward: fresh reduction bookkeeping (each loop body computes its own)
    pr.done = set()
    rec_red = pr.reductions([step.F], I2)
    pr.done = set()
    b_fwd = pr.reductions([step.F], I2)
    b_ro = pr.reductions([step.readout], I2)
    b_a = pr.reductions([step.dS_ro, *step.din_ro.values()], I2)
    b_b = pr.reductions([step.dS_prev, *step.din_F.values()], I2)
    grads = []
    for n, ld, s in step.leaves:
        parts = [e for e in (step.din_ro[n], step.din_F[n]) if e != 0]
        if not parts:
            grads.append((n, ld, "0.0"))
            continue
        grads.append((n, ld, " + ".join(f"({pr.expr(e)})" for e in parts)))
    bwd = [
        "@triton.jit",
        f"def bwd_kernel({leaf_ptrs}, {grad_ptrs}, CK, SCR, DY, DHT, DS0, T, H, V, K, NC,",
        "               BV: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr,",
        "               HAS_DHT: tl.constexpr, STORE_DS0: tl.constexpr):",
        '    """Reverse sweep: per chunk, recompute the states into SCR, then step the adjoint back."""',
        *preamble,
        "    g = tl.zeros([BK, BV], dtype=tl.float32)",
        "    if HAS_DHT:",
        "        g += tl.load(DHT + i_bh.to(tl.int64) * K * V + tile, mask=MASK, other=0.).to(tl.float32)",
        "    NBT = tl.num_programs(0).to(tl.int64) * T          # B*H*T: stride of a row block's partial gradients",
        "    scr = SCR + (i_bh.to(tl.int64) * tl.num_programs(1) + i_v) * CHUNK * BK * BV + offs_k[:, None] * BV + tl.arange(0, BV)[None, :]",
        "    for jc in range(0, NC):",
        "        ci = NC - 1 - jc",
        "        t0 = ci * CHUNK",
        "        t1 = tl.minimum(t0 + CHUNK, T)",
        "        sp = tl.load(CK + (i_bh.to(tl.int64) * NC + ci) * K * V + tile, mask=MASK, other=0.)",
        "        for t in range(t0, t1):",
        "            row = (b.to(tl.int64) * T + t) * H + h",
        *[_leaf_load(n, ld, step, I2) for n, ld, _ in step.leaves],
        "            tl.store(scr + (t - t0) * BK * BV, sp)",
        *rec_red,
        f"            sp = tl.where(MASK, {F_code} + Z2, 0.0)",
        "        tl.debug_barrier()",
        "        for jt in range(0, t1 - t0):",
        "            t = t1 - 1 - jt",
        "            row = (b.to(tl.int64) * T + t) * H + h",
        *[_leaf_load(n, ld, step, I2) for n, ld, _ in step.leaves],
        "            dy = tl.load(DY + row * V + offs_v, mask=mask_v, other=0.).to(tl.float32)[None, :]",
        "            sp = tl.load(scr + (t - t0) * BK * BV)",
        *b_fwd,
        f"            st = tl.where(MASK, {F_code} + Z2, 0.0)",
        *b_ro,
        "            # readout adjoint: G += d(sum DY*y)/dS",
        *b_a,
        f"            g = g + tl.where(MASK, {pr.expr(step.dS_ro)} + Z2, 0.0)",
        "            # transition adjoint: d(sum G*F)/d(inputs), then G <- d(sum G*F)/dS_prev",
        *b_b,
        *[line for n, ld, val in grads for line in _leaf_store(n, ld, step, val, I2)],
        f"            g = tl.where(MASK, {pr.expr(step.dS_prev)} + Z2, 0.0)",
        "    if STORE_DS0:",
        "        tl.store(DS0 + i_bh.to(tl.int64) * K * V + tile, g, mask=MASK)",
    ]
    doc = "\n".join(["# " + header, "# Generated by ssmcraft (ssmcraft/kernels/general.py): edit the spec, not this file.",
                     f'"""Fused sequential kernels of {ir.spec_name!r} ({ir.kind}).', "",
                     f"    S_t[i,j] = {sympy.sstr(step.F)}",
                     *(f"    {r.symbol.name} = sum_{r.over} {sympy.sstr(r.body)}" for r in step.alg.reductions_in(step.F)),
                     f"    y_t[i] = {sympy.sstr(step.readout)}", '"""'])
    return "\n".join([doc, "import triton", "import triton.language as tl", "", "", *fwd, "", "", *bwd]) + "\n"


_MODULES: dict = {}


def _module(ir):
    key = ir.content_hash()
    if key not in _MODULES:
        step = build_step(ir)
        header = f"spec: {ir.spec_name} ({ir.source}); IR {key}"
        source = kernel_source(ir, step, header)
        mod = cache.load_generated(f"general_{ir.spec_name}", cache.key_for("general", source), source)
        _MODULES[key] = (step, mod, source)
    return _MODULES[key]


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _new(shape, device, dtype=torch.float32):
    if POISON:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def _warps(BK, BV):
    n = BK * BV
    return 1 if _interpreting() else (4 if n <= 2048 else 8 if n <= 8192 else 16)


class _GeneralFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ir, shape, out_dtype, output_final_state, S0, *leaves):
        """shape: (B, T, H, K, V, BV), BV the rows per program (``next_power_of_2(V)``: one block)."""
        step, mod, _ = _module(ir)
        B, T, H, K, V, BV = shape
        dev = leaves[0].device
        BK, NV = triton.next_power_of_2(K), triton.cdiv(V, BV)
        NC = max(1, triton.cdiv(T, CHUNK))
        training = any(x.requires_grad for x in leaves) or (S0 is not None and S0.requires_grad)
        y = _new((B, T, H, V), dev, out_dtype)
        ST = _new((B, H, K, V), dev)
        CK = _new((B, H, NC, K, V), dev) if training else None
        d = torch.empty(1, device=dev)
        S0c = S0.transpose(-1, -2).contiguous().float() if S0 is not None else None    # [B, H, K, V]
        if T > 0:
            mod.fwd_kernel[(B * H, NV)](*leaves, S0c if S0c is not None else d, y, ST, CK if CK is not None else d,
                                     T, H, V, K, NC, BV=BV, BK=BK, CHUNK=CHUNK, HAS_S0=S0c is not None,
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
        BK, NV = triton.next_power_of_2(K), triton.cdiv(V, BV)
        NC = max(1, triton.cdiv(T, CHUNK))
        d_dim = ctx.ir.dims[0]
        shared = [d_dim not in dims for _, dims, _ in step.leaves]     # over m or per head: per row block
        grads = [_new((NV, *x.shape) if sh else x.shape, dev) for sh, x in zip(shared, leaves)]
        DS0 = _new((B, H, K, V), dev) if ctx.has_s0 else None
        SCR = torch.empty(B * H * NV * CHUNK * BK * BV, device=dev, dtype=torch.float32)
        d = torch.empty(1, device=dev)
        dht = dST.transpose(-1, -2).contiguous() if dST is not None else None
        if dy is None:
            dy = torch.zeros(B, T, H, V, device=dev)
        if T > 0:
            mod.bwd_kernel[(B * H, NV)](*leaves, *grads, CK, SCR, dy.contiguous(), dht if dht is not None else d,
                                     DS0 if DS0 is not None else d, T, H, V, K, NC, BV=BV, BK=BK, CHUNK=CHUNK,
                                     HAS_DHT=dht is not None, STORE_DS0=DS0 is not None, num_warps=_warps(BK, BV))
        elif DS0 is not None:
            DS0.copy_(dht if dht is not None else torch.zeros_like(DS0))
        dS0 = DS0.transpose(-1, -2).to(ctx.s0_dtype) if DS0 is not None else None
        grads = [g.sum(0) if sh else g for sh, g in zip(shared, grads)]
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
    initial_state: ``[B, H, K, V]`` or None.
    Returns ``(y [B, T, H, V]`` in the first input's dtype, ``S_T [B, H, K, V]`` fp32 or None).
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
    if initial_state is not None:
        K, V = initial_state.shape[2], initial_state.shape[3]
    leaves = []
    for n, dims in list(ir.inputs.items()) + list(ir.params.items()):
        t = tensors[n]
        full = (B, T, H) + tuple(V if x == d else K for x in dims)
        if tuple(t.shape) != full:
            t = t.reshape((1, 1, t.shape[0] if t.dim() > len(dims) else 1) + t.shape[t.dim() - len(dims):])
            t = t.expand(full)
        leaves.append(t.contiguous())
    S0 = initial_state.transpose(-1, -2) if initial_state is not None else None
    out_dtype = first.dtype if first.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    y, S = _GeneralFunction.apply(ir, (B, T, H, K, V, triton.next_power_of_2(V)), out_dtype, output_final_state, S0, *leaves)
    return y, (S.transpose(-1, -2) if S is not None else None)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.kernels.triton_backend)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if ``ir`` runs on this family's kernel, else the reason."""
    if ir.kind not in ("general", "nonlinear"):
        return f"not a general/nonlinear update ({ir.kind})"
    try:
        step, _, _ = _module(ir)
    except NotImplementedError as e:
        return f"cannot print the update for Triton: {e}"
    return None


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
    BV = row_block or triton.next_power_of_2(V)
    y, S = _GeneralFunction.apply(ir, (B, T, H, K, V, BV), torch.float32, output_final_state, lay.S0, *leaves)
    return y.to(lay.dtype), S
