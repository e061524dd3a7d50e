"""Stage 5 (reference): the PyTorch source of the recurrence, printed from the IR.

The generated module is readable and self-contained (it imports only torch) and has:
``coefficients(env, d, m)`` (per-token coefficients, vectorisable over any leading
shape), ``step(S, env, co, d, m)`` (one step of the recurrence) and
``readout(S, env, co, d, m)``. ``ssmcraft.ops.common.reference`` lays tensors out and runs
the loop. Triton sources are printed by ``ssmcraft.ops`` from the same IR.
"""
from __future__ import annotations

import sympy

from ssmcraft.compiler import safe_source
from ssmcraft.compiler.ir import UpdateIR
from ssmcraft.compiler.printing import torch_code



def update_formula(ir: UpdateIR) -> str:
    """The update in math notation (one line per equation)."""
    S = ir.state
    c = ir.coefficient
    B = "p q^T" if "p" in ir.slots else "B"
    if ir.input_slots():
        B = " + ".join(f"{s} v{s[1]}^T" for s in ir.input_slots())
    a = c("a")
    decay = f"{S}_prev" if a is not None and a.expr == 1 else f"a . {S}_prev"
    if ir.states:
        upd = "\n".join(_inverse_formula(ir, x) if x in dict((y, 0) for y, _, _ in ir.inverses) else
                        f"{x}_t[{element_index(ir, x)}] = " + sympy.sstr(e) for x, e in zip(ir.states, ir.state_updates))
    elif ir.kind in ("scalar_decay", "diagonal_decay"):
        upd = f"{S}_t = {decay} + {B}"
    elif ir.kind == "rank1":
        upd = f"{S}_t = {decay} - c . ({S}_prev u) v^T + {B}"
    elif ir.kind == "rankr":
        erase = " + ".join(f"c{s[1]}{s[2]} . ({S}_prev u{s[2]}) v{s[1]}^T" for s in ir.erase_slots())
        upd = f"{S}_t = {decay} - ({erase}) + {B}"
    else:
        upd = f"{S}_t[i,j] = " + sympy.sstr(ir.state_update)
    if ir.readout is None:
        oh = " + oh" if "oh" in ir.slots else ""
        out = f"y_t = oc . ({S}_t oq){oh}"
    else:
        out = "y_t[i] = " + sympy.sstr(ir.readout)
    return f"{upd}\n{out}"


def element_index(spec_or_ir, x: str) -> str:
    """The indices of one element of state ``x``: ``i,j`` over (d, m), ``a`` for the first hidden
    dimension (``b``, ... for more), in its declared order."""
    letters = dict(zip(spec_or_ir.axes(), ("i", "j", "a", "b", "c")))
    return ",".join(letters[n] for n in spec_or_ir.shape_of(x))


def _inverse_formula(ir: UpdateIR, x: str) -> str:
    """A square state's update and its carried inverse, in math notation (``ir.inverses``)."""
    from ssmcraft.compiler.metric import inverse_name
    _, a, terms = next(t for t in ir.inverses if t[0] == x)
    P = inverse_name(x)
    U = ", ".join(f"{sympy.sstr(c)}*{sympy.sstr(u)}" for c, u, _ in terms)
    V = ", ".join(sympy.sstr(v) for _, _, v in terms)
    low = " + ".join(f"{sympy.sstr(c)} ({sympy.sstr(u)}) ({sympy.sstr(v)})^T" for c, u, v in terms)
    return (f"{x}_t = {sympy.sstr(a)} {x}_prev + {low}, carried by its inverse:\n"
            f"{P} = ({P}_prev - {P}_prev U (a I + V^T {P}_prev U)^-1 V^T {P}_prev) / a,  a = {sympy.sstr(a)}, "
            f"U = [{U}], V = [{V}]")


def coefficient_lines(ir: UpdateIR) -> list[str]:
    """Math-notation lines for the reductions and coefficients (for docs and `derive`)."""
    lines = []
    for r in (*ir.reductions, *ir.state_reductions, *ir.readout_reductions):
        if r.metric is not None:
            lines.append(f"{r.name} = ({sympy.sstr(r.body)}) @ {r.metric}   (a row vector over {r.over} times the matrix)")
            continue
        lines.append(f"{r.name} = sum_{r.over} {sympy.sstr(r.body)}")
    for co in ir.coefficients:
        dims = f"[{', '.join(co.dims)}]" if co.dims else "[]"
        lines.append(f"{co.name} {dims} = {sympy.sstr(co.expr)}")
    return lines


def _reduction_code(r, dims) -> str:
    if r.metric is not None:        # the row vector body (over the key axis) times the square matrix
        return f"    {r.name} = torch.matmul(({torch_code(r.body)}) + torch.zeros_like({r.metric}[..., :1, :]), {r.metric})"
    axis = dims.index(r.over) - len(dims)         # one tensor axis per dimension, in ``ir.axes()`` order
    return f"    {r.name} = ({torch_code(r.body)}).sum({axis}, keepdim=True)"



def _reads(ir: UpdateIR, exprs) -> set:
    """The names of the state reductions ``exprs`` read, through one another."""
    bodies = {r.name: r.body for r in ir.state_reductions}
    want: set = set()
    stack = [s.name for e in exprs for s in sympy.sympify(e).free_symbols]
    while stack:
        n = stack.pop()
        if n in bodies and n not in want:
            want.add(n)
            stack += [s.name for s in bodies[n].free_symbols]
    return want


def _inverse_lines(ir: UpdateIR) -> tuple[list[str], set]:
    """The step's lines that update every square state's inverse (``ir.inverses``), after the
    reductions they read (input-only; returned so that they are not printed twice)."""
    from ssmcraft.compiler.metric import inverse_name
    exprs = [e for _, a, terms in ir.inverses for e in (a, *(x for t in terms for x in t))]
    first = _reads(ir, exprs)
    lines = [_reduction_code(r, ir.axes()) for r in ir.state_reductions if r.name in first]
    for x, a, terms in ir.inverses:
        lines += _woodbury_lines(inverse_name(x), x, a, terms)
    return lines, first


def _woodbury_lines(X: str, x: str, a, terms) -> list[str]:
    """Statements of ``X = (X_prev - W^T M W) / a``, the inverse of ``a x_prev + sum_r c_r v_r v_r^T``
    (Woodbury; Sherman-Morrison for one term; ``ssmcraft.compiler.metric`` shows every term has this
    form with ``c_r >= 0``, ``a > 0``): ``V = [v_r]`` ``[..., r, m]``, ``W = V X_prev``,
    ``M = C (a I + W V^T C)^-1`` with ``C = diag(c_r)``, symmetric in exact arithmetic. ``X_prev``,
    ``M`` and ``W^T M W`` are each symmetrised: an asymmetric rounding error of the inverse grows as
    1 / a per token (so would the antisymmetric part of its gradient), a symmetric one does not.
    Inline (no helper function: an export wraps the module in a class namespace)."""
    row, shape = f"{X}_prev[..., :1, :]", f"{X}_prev[..., :1, :].shape"
    V = ", ".join(f"torch.broadcast_to(({torch_code(v)}) + 0 * {row}, {shape})" for _, _, v in terms)
    C = ", ".join(f"torch.broadcast_to(({torch_code(c)}) + 0 * {row}[..., :1], {row}[..., :1].shape)"
                  for c, _, _ in terms)
    eye = f"torch.eye({len(terms)}, dtype={X}_prev.dtype, device={X}_prev.device)"
    return [f"    # {x}_t = a {x}_prev + sum_r c_r v_r v_r^T, carried by its inverse {X} (Woodbury, symmetric)",
            f"    {X}_sym = 0.5 * ({X}_prev + {X}_prev.transpose(-1, -2))",
            f"    {X}_V = torch.cat([{V}], -2)",
            f"    {X}_C = torch.cat([{C}], -1) * {eye}",
            f"    {X}_a = ({torch_code(a)}) + 0 * {row}[..., :1]",
            f"    {X}_W = {X}_V @ {X}_sym",
            f"    {X}_M = torch.linalg.solve({X}_a * {eye} + {X}_W @ {X}_V.transpose(-1, -2) @ {X}_C, {X}_C, left=False)",
            f"    {X}_M = 0.5 * ({X}_M + {X}_M.transpose(-1, -2))",
            f"    {X}_D = {X}_W.transpose(-1, -2) @ {X}_M @ {X}_W",
            f"    {X} = ({X}_sym - 0.5 * ({X}_D + {X}_D.transpose(-1, -2))) / {X}_a"]


def _unpack(names) -> list[str]:
    return [f"    {n} = env[{n!r}]" for n in names]


def slot_leaves(ir: UpdateIR, name: str) -> list[str]:
    """The inputs and params that coefficient ``name`` needs (through other coefficients and
    reductions), in declaration order."""
    coefs = {c.name: c.expr for c in ir.coefficients}
    reds = {r.name: r.body for r in ir.reductions}
    want: set = set()

    def visit(sym_name):
        if sym_name in want:
            return
        want.add(sym_name)
        body = coefs.get(sym_name, reds.get(sym_name))
        for s in () if body is None else body.free_symbols:
            visit(s.name)
    visit(name)
    return [n for n in (*ir.inputs, *ir.params) if n in want]


def _multi_state_step(ir: UpdateIR, names) -> list[str]:
    """``step`` of a several-state update: a tuple of previous states -> a tuple of new ones."""
    d, m = ir.dims
    if ir.inverses:
        return _square_step(ir, names)
    prevs = [f"{x}_prev" for x in ir.states]
    news = ", ".join(f"({torch_code(e)}) + 0 * {p}" for e, p in zip(ir.state_updates, prevs))
    from ssmcraft.compiler.minibatch import anchor_name
    anchors = [anchor_name(x) for x in ir.states]
    return [f"STATES = {tuple(ir.states)!r}",
            *_shapes_header(ir),
            *(_minibatch_lines(ir, names) if ir.minibatch else []),
            "",
            "",
            f"def step(prev, env, co, {d}, {m}{', anchors' if ir.minibatch else ''}):",
            f'    """One step: the previous states ({", ".join(prevs)}) -> the new ones, in order'
            + (" (anchors: their values before the chunk)." if ir.minibatch else ".") + '"""',
            f"    {', '.join(prevs)}, = prev",
            *([f"    {', '.join(anchors)}, = anchors"] if ir.minibatch else []),
            *_unpack(names),
            *[_reduction_code(r, ir.axes()) for r in ir.state_reductions],
            f"    return ({news},)"]


def _shapes_header(ir: UpdateIR) -> list[str]:
    """The constants of states of several shapes (none with one shape): what the runtime needs to
    lay them out (``ssmcraft.ops.common.reference``)."""
    if not ir.state_shapes:
        return []
    return [f"SHAPES = {dict((x, tuple(ir.shape_of(x))) for x in ir.states)!r}",
            f"INVERTED = {tuple(x for x, _, _ in ir.inverses)!r}  # square states: the step carries their inverses",
            f"IDENTITY_INIT = {dict(ir.inits)!r}  # state -> c: its initial value is c times the (rectangular) identity",
            f"AXES = {ir.axes()!r}  # one tensor axis per dimension, in this order",
            f"HIDDEN = {dict(ir.hidden)!r}  # hidden dimension -> (factor, base): size factor * size(base)"]


def _square_step(ir: UpdateIR, names) -> list[str]:
    """``step`` with square states (``ir.inverses``): each carried by its inverse ``_inv_X``, updated
    first (Woodbury), then the [d, m] states in declaration order reading it by name."""
    from ssmcraft.compiler.metric import inverse_name
    d, m = ir.dims
    square = [x for x, _, _ in ir.inverses]
    carried = {x: inverse_name(x) if x in square else x for x in ir.states}
    prevs = [f"{carried[x]}_prev" for x in ir.states]
    news = ", ".join(carried[x] if x in square else f"({torch_code(e)}) + 0 * {p}"
                     for x, e, p in zip(ir.states, ir.state_updates, prevs))
    inverse, first = _inverse_lines(ir)
    shapes = ", ".join(f"{carried[x]}_prev [..., {', '.join(ir.shape_of(x))}]" for x in ir.states)
    return [f"STATES = {tuple(ir.states)!r}",
            *_shapes_header(ir),
            "",
            "",
            f"def step(prev, env, co, {d}, {m}):",
            f'    """One step: the previous states ({shapes}; the square ones as their inverses) -> the new ones."""',
            f"    {', '.join(prevs)}, = prev",
            # the step in the inverses' dtype (float64: ``reference._initial``), its inputs cast once so
            # that their gradients sum there too (the update's terms cancel at the covariance's scale)
            *[f"{line}.to({prevs[0]}.dtype)" for line in _unpack(names)],
            *inverse,
            *[_reduction_code(r, ir.axes()) for r in ir.state_reductions if r.name not in first],
            f"    return ({news},)"]


def _minibatch_lines(ir: UpdateIR, names) -> list[str]:
    """A several-state mini-batch's chunk size and chunk decays (``ssmcraft.compiler.minibatch``)."""
    d, m = ir.dims
    out = [f"MINIBATCH = {ir.minibatch}  # tokens per chunk; gradients at the states before the chunk"]
    if ir.minibatch_decay is not None:
        reds = _reads(ir, list(ir.minibatch_decay))
        out += ["", "",
                f"def minibatch_decay(env, co, {d}, {m}):",
                '    """Per state a of step = a . X_prev + G(anchors): the chunk\'s states are one scan over G."""',
                *_unpack(names),
                *[_reduction_code(r, ir.axes()) for r in ir.state_reductions if r.name in reds],
                f"    return ({', '.join(torch_code(a) for a in ir.minibatch_decay)},)"]
    return out


def _minibatch_head(ir: UpdateIR, names) -> list[str]:
    """A mini-batch update's chunk size, its chunk decay (when it has one) and the head of ``step``,
    which also takes the state before the chunk (``ssmcraft.compiler.minibatch``)."""
    from ssmcraft.compiler.minibatch import ANCHOR
    d, m = ir.dims
    S = ir.state
    out = [f"MINIBATCH = {ir.minibatch}  # tokens per chunk; gradients at the state before the chunk ({ANCHOR})", ""]
    if ir.minibatch_decay is not None:
        reds = _reads(ir, [ir.minibatch_decay])
        out += ["",
                f"def minibatch_decay(env, co, {d}, {m}):",
                f'    """a of step = a . {S}_prev + G({ANCHOR}): the chunk\'s states are one scan over G."""',
                *_unpack(names),
                *[_reduction_code(r, ir.axes()) for r in ir.state_reductions if r.name in reds],
                f"    return {torch_code(ir.minibatch_decay)}", "", ""]
    return out + [f"def step({S}_prev, env, co, {d}, {m}, {ANCHOR}):",
                  f'    """One step: {S}_prev [..., {d}, {m}] and the state before the chunk {ANCHOR} -> {S}_t."""']


def reference_source(ir: UpdateIR, header: str) -> str:
    """Python source of the reference module for ``ir``."""
    d, m = ir.dims
    S = ir.state
    names = [*ir.inputs, *ir.params]
    slot_dict = ", ".join(f"{slot!r}: {name}" for slot, name in ir.slots.items())
    doc = "\n".join("    " + line for line in [*update_formula(ir).splitlines(), "", *coefficient_lines(ir)])
    out = [
        safe_source.comment(header),
        "# Generated by ssmcraft: edit the spec, not this file.",
        safe_source.docstring("\n".join([
            f"Reference recurrence of {ir.spec_name!r} ({ir.kind}; update: {ir.update}, approximation: {ir.approximation}).",
            "",
            doc,
            "",
            f"Tensors are laid out for broadcasting: [{d}]-indexed values as [..., {d}, 1], [{m}]-indexed",
            f"as [..., 1, {m}], [{d}, {m}] as [..., {d}, {m}] and per-head scalars as [..., 1, 1].",
            ""])),
        "import math",
        "",
        "import torch",
        "import torch.nn.functional as F",
        "",
        f"KIND = {ir.kind!r}",
        f"DIMS = {tuple(ir.dims)!r}",
        f"INPUTS = {dict(ir.inputs)!r}",
        f"PARAMS = {dict(ir.params)!r}",
        f"SLOTS = {dict(ir.slots)!r}",
        "",
        "",
        f"def coefficients(env, {d}, {m}):",
        '    """Per-token coefficients (any leading shape) from inputs and params."""',
        *_unpack(names),
        *[_reduction_code(r, ir.axes()) for r in ir.reductions],
        *[f"    {c.name} = {torch_code(c.expr)}" for c in ir.coefficients],
        f"    return {{{slot_dict}}}",
        "",
        "",
    ]
    if ir.states:
        out += _multi_state_step(ir, names)
    else:
        out += _minibatch_head(ir, names) if ir.minibatch else [
                f"def step({S}_prev, env, co, {d}, {m}):",
                f'    """One step: {S}_prev [..., {d}, {m}] -> {S}_t."""']
    body = []
    if ir.states:
        pass
    elif ir.kind in ("scalar_decay", "diagonal_decay", "rank1", "rankr"):
        a = ir.coefficient("a")
        decay = f"{S}_prev" if a.expr == 1 else f"co['a'] * {S}_prev"
        if ir.input_slots():
            inp = " + ".join(f"co['{s}'] * co['v{s[1]}']" for s in ir.input_slots())
        else:
            inp = "co['p'] * co['q']" if "p" in ir.slots else "co['B']"
        if ir.kind == "rank1":
            body.append(f"    erase = co['c'] * ({S}_prev * co['u']).sum(-1, keepdim=True) * co['v']")
            body.append(f"    return {decay} - erase + {inp}")
        elif ir.kind == "rankr":
            for l in range(ir.ranks()[0]):
                body.append(f"    phi{l} = ({S}_prev * co['u{l}']).sum(-1, keepdim=True)")
            erase = " + ".join(f"co['{s}'] * phi{s[2]} * co['v{s[1]}']" for s in ir.erase_slots())
            body.append(f"    erase = {erase}")
            body.append(f"    return {decay} - erase + {inp}")
        else:
            body.append(f"    return {decay} + {inp}")
    else:
        body += _unpack(names)
        body.append(f"    S_prev = {S}_prev" if S != "S" else "")
        body += [_reduction_code(r, ir.axes()) for r in ir.state_reductions]
        body.append(f"    return ({torch_code(ir.state_update)}) + 0 * {S}_prev")
    out += [b for b in body if b]
    out += [
        "",
        "",
    ]
    if ir.states:
        out += [f"def readout(states, env, co, {d}, {m}):",
                f'    """The output y [..., {d}, 1] read from the new states ({", ".join(ir.states)}), each [..., {d}, {m}]."""',
                f"    {', '.join(ir.states)}, = states"]
        # a state over the rows d (a square one is [m, m]); every other axis sliced to one
        S = next(x for x in ir.states if ir.shape_of(x)[0] == ir.dims[0])
        S = f"{S}[..., {', '.join([':1'] * (len(ir.axes()) - 1))}]"
    else:
        out += [f"def readout({S}, env, co, {d}, {m}):",
                f'    """The output y [..., {d}, 1] read from the new state {S} [..., {d}, {m}]."""']
    if ir.readout is None:
        oh = " + co['oh']" if "oh" in ir.slots else ""
        out.append(f"    return co['oc'] * ({S} * co['oq']).sum(-1, keepdim=True){oh}")
    else:
        out += _unpack(names)
        out += [_reduction_code(r, ir.axes()) for r in ir.readout_reductions]
        out.append(f"    return ({torch_code(ir.readout)}) + 0 * {S if ir.states else S + '[..., :1]'}")
    return "\n".join(out) + "\n"
