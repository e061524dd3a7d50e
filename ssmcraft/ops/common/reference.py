"""The PyTorch runtime of a generated reference module: layouts, the per-step loop, a
vectorised CPU path and the state-space tools that evaluation needs.

Shapes (docs/design.md, "The Python API"): inputs ``[B, T, H, n]`` (``[B, T, H]`` for a
per-head scalar), params of their declared shape or ``[H, *shape]``, state
``[B, H, d, m]``, output ``[B, T, H, d]``. Internally every tensor is laid out as
``[B, T, H, r, c]`` with ``r = d or 1`` and ``c = m or 1`` so that generated element
expressions broadcast (see ``ssmcraft.compiler.codegen``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ssmcraft.errors import SsmcraftError

SCAN_CHUNK = 64


@dataclass
class Layout:
    env: dict            # name -> [B|1, T|1, H|1, r, c]
    B: int
    T: int
    H: int
    d: int
    m: int
    dtype: torch.dtype   # compute dtype (float32 or float64)
    out_dtype: torch.dtype
    S0: torch.Tensor | tuple | None     # a tuple of [B, H, d, m] (declaration order) with several states
    hidden: dict | None = None          # hidden dimension -> size (a deep memory): one more axis each


def _fail(msg: str):
    raise SsmcraftError(msg)


def constant_param(decl, shape, device, what: str, dtype=torch.float32) -> torch.Tensor:
    """A param a call did not pass: its constant init (``zeros``, ``ones``, ``{constant: c}``) as a
    ``shape`` tensor. A random init, or no declaration (``decl`` None), raises ``SsmcraftError``
    naming ``what`` (e.g. ``"longhorn: param 'A'"``)."""
    init = None if decl is None else decl.init
    if init == "zeros" or init == "ones" or (isinstance(init, dict) and "constant" in init):
        value = 0.0 if init == "zeros" else 1.0 if init == "ones" else init["constant"]
        return torch.full(list(shape), float(value), dtype=dtype, device=device)
    _fail(f"{what} has {'no declaration' if decl is None else f'a random init ({init})'}; pass it in params")


def layout(ir, spec, inputs: dict, params: dict | None, initial_state) -> Layout:
    """Validate and lay out the inputs, params and initial state of one call."""
    if not isinstance(inputs, dict):
        _fail(f"{spec.name}: inputs must be a dict of tensors, got {type(inputs).__name__}")
    unknown = sorted(set(inputs) - set(ir.inputs))
    if unknown:
        _fail(f"{spec.name}: unknown input {unknown[0]!r}; the spec declares {', '.join(ir.inputs)}")
    missing = [n for n in ir.inputs if n not in inputs]
    if missing:
        _fail(f"{spec.name}: missing input {missing[0]!r}")
    params = dict(params or {})
    unknown = sorted(set(params) - set(ir.params))
    if unknown:
        _fail(f"{spec.name}: unknown param {unknown[0]!r}; the spec declares {', '.join(ir.params) or 'none'}")
    sizes: dict = {}
    dims = ir.dims

    def note(dim, n, what):
        if sizes.setdefault(dim, n) != n:
            _fail(f"{spec.name}: {what} has {dim} = {n}, but another tensor has {dim} = {sizes[dim]}")

    bth = None
    dtypes = []
    for name, idims in ir.inputs.items():
        t = inputs[name]
        if not isinstance(t, torch.Tensor):
            _fail(f"{spec.name}: input {name!r} must be a tensor")
        want = 3 + len(idims)
        if t.dim() != want:
            shape = "[B, T, H]" if not idims else f"[B, T, H, {idims[0]}]"
            _fail(f"{spec.name}: input {name!r} must be {shape}, got shape {list(t.shape)}")
        if bth is None:
            bth = tuple(t.shape[:3])
        elif tuple(t.shape[:3]) != bth:
            _fail(f"{spec.name}: input {name!r} has [B, T, H] = {list(t.shape[:3])}, expected {list(bth)}")
        for dim, n in zip(idims, t.shape[3:]):
            note(dim, n, f"input {name!r}")
        dtypes.append(t.dtype)
    B, T, H = bth
    for name, pdims in ir.params.items():
        if name not in params:
            continue
        t = params[name]
        if not isinstance(t, torch.Tensor):
            t = params[name] = torch.as_tensor(t)
        if t.dim() == len(pdims) + 1:
            if t.shape[0] not in (1, H):
                _fail(f"{spec.name}: param {name!r} has {t.shape[0]} heads, the inputs have H = {H}")
        elif t.dim() != len(pdims):
            _fail(f"{spec.name}: param {name!r} must have shape [{', '.join(pdims)}] or [H, {', '.join(pdims)}], got {list(t.shape)}")
        for dim, n in zip(pdims, t.shape[t.dim() - len(pdims):]):
            note(dim, n, f"param {name!r}")
    for what, t, (r, c) in _initial_states(ir, spec, initial_state):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:2]) != (B, H):
            _fail(f"{spec.name}: {what} must be [B, H, {r}, {c}] = [{B}, {H}, ...], got "
                  f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        note(r, t.shape[2], what)
        note(c, t.shape[3], what)
    for dim in dims:
        if dim not in sizes:
            _fail(f"{spec.name}: cannot tell the size of dimension {dim!r} from the tensors given (pass initial_state)")
    hidden = hidden_sizes(ir, sizes)
    for h, n in hidden.items():
        note(h, n, f"hidden dimension {h} (its rule)")
    axes = (*dims, *hidden)
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    out_dtype = dtypes[0] if dtypes[0].is_floating_point else dtype

    def shape5(idims, lead):        # one axis per dimension (``axes``): [..., d|1, m|1, hidden...]
        return (*lead, *(sizes[a] if a in idims else 1 for a in axes))

    env = {}
    for name, idims in ir.inputs.items():
        env[name] = inputs[name].to(dtype).reshape(shape5(idims, (B, T, H)))
    for name, pdims in ir.params.items():
        if name not in params:
            t = constant_param(spec.params[name], [sizes[d] for d in pdims], inputs[next(iter(ir.inputs))].device,
                               f"{spec.name}: param {name!r}", dtype)
        else:
            t = params[name].to(dtype)
        heads = t.shape[0] if t.dim() == len(pdims) + 1 else 1
        env[name] = t.reshape(shape5(pdims, (1, 1, heads)))
    S0 = None
    if initial_state is not None:
        S0 = tuple(t.to(dtype) for t in initial_state) if ir.states else initial_state.to(dtype)
    return Layout(env, B, T, H, sizes[dims[0]], sizes[dims[1]], dtype, out_dtype, S0, hidden or None)


def hidden_sizes(ir, sizes: dict) -> dict:
    """Each hidden dimension's size (``factor * size(base)``, or ``factor``) from the sizes known."""
    out = {}
    for h, (factor, base) in (getattr(ir, "hidden", None) or {}).items():
        out[h] = factor * sizes[base] if base is not None else factor
    return out


def states(S) -> tuple:
    """A call's state(s) as a tuple: () for None, the tuple of several states, or (S,)."""
    if S is None:
        return ()
    return tuple(S) if isinstance(S, (tuple, list)) else (S,)


def like(S0, flat: tuple):
    """The states ``flat`` in the form a call gave ``S0``: a tuple where it was a tuple or list, else
    the one tensor (None for none). The inverse of ``states``."""
    return tuple(flat) if isinstance(S0, (tuple, list)) else (flat[0] if flat else None)


def validate(ir, spec, inputs: dict, params: dict | None, initial_state) -> Layout:
    """``layout``'s checks and sizes without touching data: the tensors are replaced by meta
    tensors of the same shape and dtype (no copies). Its ``env`` holds meta tensors."""
    def meta(t, dtype=None):
        if not isinstance(t, torch.Tensor):
            t = torch.as_tensor(t)
        return torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")
    if not isinstance(inputs, dict):
        return layout(ir, spec, inputs, params, initial_state)      # raises the usual error
    meta_in = {k: meta(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    meta_p = {k: meta(v, torch.float32) for k, v in (params or {}).items()}
    meta_s = like(initial_state, tuple(meta(t) for t in states(initial_state)))
    return layout(ir, spec, meta_in, meta_p, meta_s)


def _initial_states(ir, spec, initial_state) -> list:
    """[(what, tensor)] of the initial state(s); several states take a tuple in declaration order."""
    if initial_state is None:
        return []
    if not ir.states:
        return [("initial_state", initial_state, ir.dims)]
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != len(ir.states):
        _fail(f"{spec.name}: initial_state must be a tuple of {len(ir.states)} tensors, one per state "
              f"({', '.join(ir.states)}), got {type(initial_state).__name__}"
              + (f" of {len(initial_state)}" if isinstance(initial_state, (tuple, list)) else ""))
    return [(f"initial_state[{i}] ({x})", t, ir.shape_of(x)) for i, (x, t) in enumerate(zip(ir.states, initial_state))]


def state_shapes(ir, B: int, H: int, d: int, m: int) -> dict:
    """Every state's shape, in declaration order: ``[B, H, d, m]``, or ``[B, H, m, m]`` for a
    square state. Works on the IR and on the export's view of its JSON form."""
    size = dict(zip(ir.dims, (d, m)))
    size.update(hidden_sizes(ir, size))
    return {x: (B, H, *(size[n] for n in ir.shape_of(x))) for x in ir.state_names}


def initial_states(ir, B: int, H: int, d: int, m: int, device=None, dtype=None):
    """The initial state(s) of a call with no ``initial_state``: zero, or c times the identity for a
    state declared ``init: {identity: c}``; a tuple with several states."""
    out = []
    for x, shape in state_shapes(ir, B, H, d, m).items():
        S = torch.zeros(shape, device=device, dtype=dtype)
        if x in ir.inits:
            S = S + ir.inits[x] * torch.eye(shape[-2], shape[-1], device=device, dtype=dtype)
        out.append(S)
    return tuple(out) if ir.states else out[0]


def traced_state(ir) -> str:
    """The state a trace follows: with several states the last declared one that the output
    reads (momentum Longhorn's S, not its step D), so that state statistics describe the
    memory that is read. Works on the IR and on its JSON form (expressions as text)."""
    names = ir.state_names
    if not ir.states:
        return names[0]
    exprs = [ir.readout, *(r.body for r in ir.readout_reductions)]
    read = {w for e in exprs for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(e))}
    return [x for x in names if x in read][-1]


def empty_trace(S, lay: Layout) -> torch.Tensor:
    """A trace with no time points, [B, 0, H, d, m], in the (first) state's dtype and device."""
    first = S[0] if isinstance(S, tuple) else S
    return first.new_zeros(lay.B, 0, lay.H, lay.d, lay.m)


def n_states(module) -> int:
    """How many states a generated reference module carries."""
    return len(getattr(module, "STATES", ())) or 1


def _sizes(module, lay: Layout) -> list:
    """Each state's shape as the step carries it (after [B, H]): [d, m], or [m, m] for a square state;
    over hidden dimensions one axis per dimension (``module.AXES``), 1 where the state has none."""
    shapes = getattr(module, "SHAPES", None)
    if shapes is None:
        return [(lay.d, lay.m)] * n_states(module)
    size = _axis_sizes(module, lay)
    if lay.hidden:
        return [tuple(size[a] if a in shapes[x] else 1 for a in module.AXES) for x in module.STATES]
    return [tuple(size[n] for n in shapes[x]) for x in module.STATES]


def _axis_sizes(module, lay: Layout) -> dict:
    return {**dict(zip(module.DIMS, (lay.d, lay.m))), **(lay.hidden or {})}


def _to_axes(module, lay: Layout, x: str, S):
    """A state as declared, [B, H, r, c], laid out over every axis (hidden dimensions): [B, H, *axes]."""
    r, c = module.SHAPES[x]
    if module.AXES.index(r) > module.AXES.index(c):
        S = S.transpose(-1, -2)
    return S.reshape(S.shape[0], S.shape[1], *_sizes(module, lay)[module.STATES.index(x)])


def _from_axes(module, lay: Layout, x: str, S):
    """The inverse of ``_to_axes``: [B, H, *axes] -> [B, H, r, c] as declared."""
    r, c = module.SHAPES[x]
    size = _axis_sizes(module, lay)
    first, second = sorted((r, c), key=module.AXES.index)
    S = S.reshape(S.shape[0], S.shape[1], size[first], size[second])
    return S.transpose(-1, -2) if first != r else S


def output(y, lay: Layout):
    """A readout [..., d, 1] (or [..., d, 1, ..., 1], one axis per dimension) as [..., d]: the first
    element of every axis after d (a readout coefficient may broadcast over them)."""
    return y[(..., *([0] * (1 + len(lay.hidden or ()))))]


def expand_state(S, lay: Layout, module=None):
    """A step's result broadcast to [B, H, d, m] (each state of a tuple; [B, H, m, m] for a square
    state of ``module``)."""
    if isinstance(S, tuple):
        sizes = _sizes(module, lay) if module is not None else [(lay.d, lay.m)] * len(S)
        return tuple(x.expand(lay.B, lay.H, *shape) for x, shape in zip(S, sizes))
    return S.expand(lay.B, lay.H, lay.d, lay.m)


def at(value, t: int):
    """Slice time step ``t`` of a laid-out tensor (size-1 time axes broadcast)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 5:
        return value
    return value[:, t if value.shape[1] > 1 else 0]


def _initial(lay: Layout, device, count: int = 1, module=None):
    """The initial state, or a tuple of ``count`` states when the module has several; with square
    states (``module.INVERTED``) as the step carries them: their inverses, in float64 and exactly
    symmetric (the inverse of an ill-conditioned covariance drifts in float32, as its Triton kernels
    in ``ssmcraft.ops.precision_rank1`` say)."""
    inverted = getattr(module, "INVERTED", ())
    if inverted:
        return tuple(_symmetric(torch.linalg.inv(S.double())) if x in inverted else S
                     for x, S in zip(module.STATES, declared_initial(module, lay, device)))
    if lay.hidden:
        return tuple(_to_axes(module, lay, x, S) for x, S in zip(module.STATES, declared_initial(module, lay, device)))
    if lay.S0 is not None:
        return lay.S0
    zeros = [torch.zeros(lay.B, lay.H, lay.d, lay.m, dtype=lay.dtype, device=device) for _ in range(count)]
    return tuple(zeros) if count > 1 else zeros[0]


def declared_initial(module, lay: Layout, device) -> tuple:
    """The initial states of a module with square states, as declared: the call's, else zero, or c
    times the identity where the spec says ``init: {identity: c}``."""
    if lay.S0 is not None:
        return tuple(lay.S0)
    out = []
    size = _axis_sizes(module, lay)
    for x in module.STATES:
        r, c = (size[n] for n in module.SHAPES[x])
        if x in module.IDENTITY_INIT:       # c I, rectangular for a deep memory's weights
            eye = torch.eye(r, c, dtype=lay.dtype, device=device) * module.IDENTITY_INIT[x]
            out.append(eye.expand(lay.B, lay.H, r, c).clone())
        else:
            out.append(torch.zeros(lay.B, lay.H, r, c, dtype=lay.dtype, device=device))
    return tuple(out)


def _symmetric(P):
    return 0.5 * (P + P.transpose(-1, -2))


def declared(module, S, lay: Layout | None = None):
    """The final states as declared: a square state's carried inverse inverted back (the step of a
    module with square states runs in float64: every state back in the layout's dtype), a state over
    hidden dimensions laid out [B, H, r, c] again."""
    if lay is not None and lay.hidden:
        return tuple(_from_axes(module, lay, x, t) for x, t in zip(module.STATES, S))
    inverted = getattr(module, "INVERTED", ())
    if not inverted:
        return S
    return tuple((torch.linalg.inv(x) if name in inverted else x).to(x.dtype if lay is None else lay.dtype)
                 for name, x in zip(module.STATES, S))


def _device(lay: Layout):
    return next(iter(lay.env.values())).device


def reference_loop(module, lay: Layout, *, every: int | None = None, traced: int = 0):
    """The literal recurrence: coefficients, step and readout at each t.

    Returns (y [B, T, H, d], S_T [B, H, d, m] (a tuple with several states),
    states [B, T//every, H, d, m] or None); with several states ``traced`` picks the state traced.
    """
    d, m = lay.d, lay.m
    S = _initial(lay, _device(lay), n_states(module), module)
    C = getattr(module, "MINIBATCH", 0)
    S_c = S             # a mini-batch step's anchor: the state before the current chunk
    ys, states = [], []
    for t in range(lay.T):
        env_t = {k: at(v, t) for k, v in lay.env.items()}
        co = module.coefficients(env_t, d, m)
        if C:       # a mini-batch step also reads the state before its chunk
            S_c = S if t % C == 0 else S_c
            S = expand_state(module.step(S, env_t, co, d, m, S_c), lay, module)
        else:
            S = expand_state(module.step(S, env_t, co, d, m), lay, module)
        ys.append(output(module.readout(S, env_t, co, d, m), lay))
        if every and (t + 1) % every == 0:
            states.append(declared(module, S, lay)[traced] if isinstance(S, tuple) else S)
    y = torch.stack(ys, dim=1) if ys else torch.zeros(lay.B, 0, lay.H, d, dtype=lay.dtype, device=_device(lay))
    st = torch.stack(states, dim=1) if states else None
    return y, declared(module, S, lay), st


def _scan(A: torch.Tensor, Bt: torch.Tensor) -> torch.Tensor:
    """Inclusive scan of S_t = A_t S_{t-1} + B_t over dim 1 (Hillis-Steele, log T passes)."""
    T = A.shape[1]
    off = 1
    while off < T:
        A_prev = torch.cat([torch.ones_like(A[:, :off]), A[:, :-off]], dim=1)
        B_prev = torch.cat([torch.zeros_like(Bt[:, :off]), Bt[:, :-off]], dim=1)
        Bt = A * B_prev + Bt
        A = A * A_prev
        off *= 2
    return Bt


def _full(value, lay: Layout) -> torch.Tensor:
    """A slot value (tensor or python number) broadcast to [B, T, H, d, m]."""
    t = (value.to(dtype=lay.dtype, device=_device(lay)) if isinstance(value, torch.Tensor)   # a number: filled on
         else torch.full((), float(value), dtype=lay.dtype, device=_device(lay)))      # the device (CUDA graphs)
    return t.expand(lay.B, lay.T, lay.H, lay.d, lay.m)


def diagonal_states(module, lay: Layout, co: dict) -> torch.Tensor:
    """All states [B, T, H, d, m] of a (scalar or elementwise) decay recurrence, chunked scan."""
    full = (lay.B, lay.T, lay.H, lay.d, lay.m)
    A = _full(co["a"], lay)
    Bt = _full(co["p"] * co["q"] if "p" in co else co["B"], lay)
    S = _initial(lay, _device(lay))
    out = []
    for s in range(0, lay.T, SCAN_CHUNK):
        Ac, Bc = A[:, s:s + SCAN_CHUNK], Bt[:, s:s + SCAN_CHUNK].clone()
        Bc[:, 0] = Bc[:, 0] + Ac[:, 0] * S
        states = _scan(Ac, Bc)
        out.append(states)
        S = states[:, -1]
    return torch.cat(out, dim=1) if out else A.new_zeros(full)


def vectorised(module, ir, lay: Layout, valid: torch.Tensor | None = None):
    """The fastest PyTorch path: coefficients for all t at once, then the recurrence.

    For the decay classes on a GPU the recurrence is a chunked parallel scan; on a CPU (and
    for the other classes) it is a loop over the precomputed coefficients, because the scan
    does O(T log T) work and a CPU has no parallelism to spend it on. ``valid`` (bool ``[B, T]``,
    the loop; not for a mini-batch update): a step where it is False leaves the state as it was, so
    that rows padded past their end (``ssmcraft.runtime.packed``) end in their own final state;
    the outputs there mean nothing.

    Returns (y [B, T, H, d], S_T [B, H, d, m]).
    """
    d, m = lay.d, lay.m
    co = module.coefficients(lay.env, d, m)
    if lay.T == 0 or getattr(module, "MINIBATCH", 0):
        return reference_loop(module, lay)[:2] if lay.T == 0 else minibatch(module, lay, co)
    if ir.kind in ("scalar_decay", "diagonal_decay") and _device(lay).type == "cuda" and valid is None:
        states = diagonal_states(module, lay, co)
        y = module.readout(states, lay.env, co, d, m)[..., 0]
        return y.expand(lay.B, lay.T, lay.H, d), states[:, -1]
    S = _initial(lay, _device(lay), n_states(module), module)
    needs_env = ir.kind in ("general", "nonlinear") or ir.readout is not None
    ys = []
    for t in range(lay.T):
        co_t = {k: at(v, t) for k, v in co.items()}
        env_t = {k: at(v, t) for k, v in lay.env.items()} if needs_env else None
        new = expand_state(module.step(S, env_t, co_t, d, m), lay, module)
        S = new if valid is None else _keep(new, S, valid[:, t])
        ys.append(output(module.readout(S, env_t, co_t, d, m), lay))
    return torch.stack(ys, dim=1), declared(module, S, lay)


def _keep(new, old, mask: torch.Tensor):
    """``new`` in the rows where ``mask`` [B] holds, else ``old`` (each state of a tuple)."""
    if isinstance(new, tuple):
        return tuple(_keep(a, b, mask) for a, b in zip(new, old))
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


def _chunk(value, s: int, e: int):
    """Time steps s..e-1 of a laid-out tensor (size-1 time axes broadcast)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 5 or value.shape[1] == 1:
        return value
    return value[:, s:e]


def minibatch(module, lay: Layout, co: dict):
    """A mini-batch update (``approximation: {minibatch: C}``), chunk by chunk, each chunk in parallel
    when the update is ``a . S_prev + G(S_c)`` (``module.minibatch_decay``; per state with several):
    ``G`` for every token of the chunk at once (the step at ``S_prev = 0``), then the states as one scan
    ``S_t = a_t S_{t-1} + G_t`` from the state before the chunk (a cumulative sum when ``a = 1``), and
    every output at once. Otherwise the chunk's tokens run one by one, each from the chunk's start.

    Returns (y [B, T, H, d], S_T [B, H, d, m], or the tuple of states as declared)."""
    d, m, C = lay.d, lay.m, module.MINIBATCH
    decay = getattr(module, "minibatch_decay", None)
    several = hasattr(module, "STATES")
    S = _initial(lay, _device(lay), n_states(module), module)
    ys = []
    for s in range(0, lay.T, C):
        e = min(s + C, lay.T)
        env_c = {k: _chunk(v, s, e) for k, v in lay.env.items()}
        co_c = {k: _chunk(v, s, e) for k, v in co.items()}
        if decay is None:
            start, steps = S, []
            for t in range(e - s):
                env_t, co_t = ({k: at(v, t) for k, v in x.items()} for x in (env_c, co_c))
                S = expand_state(module.step(S, env_t, co_t, d, m, start), lay, module)
                steps.append(S)
            states = tuple(torch.stack(x, dim=1) for x in zip(*steps)) if several else torch.stack(steps, dim=1)
        else:
            flat = S if several else (S,)
            S_c = tuple(x[:, None] for x in flat)
            G = module.step(tuple(torch.zeros_like(x) for x in S_c) if several else torch.zeros_like(S_c[0]),
                            env_c, co_c, d, m, S_c if several else S_c[0])
            a = decay(env_c, co_c, d, m)
            out = tuple(_chunk_scan(g, x, ax, lay) for g, x, ax in zip(G if several else (G,), S_c, a if several else (a,)))
            states = out if several else out[0]
        ys.append(output(module.readout(states, env_c, co_c, d, m), lay).expand(lay.B, e - s, lay.H, d))
        S = tuple(x[:, -1] for x in states) if several else states[:, -1]
    return torch.cat(ys, dim=1), declared(module, S, lay) if several else S


def _chunk_scan(G, S_c, a, lay: Layout):
    """The states ``S_t = a_t S_{t-1} + G_t`` of one chunk from ``S_c`` [B, 1, H, ...], over dim 1."""
    G = G.expand(S_c.shape[0], G.shape[1], *S_c.shape[2:])
    if not isinstance(a, torch.Tensor) and float(a) == 1.0:
        return S_c + torch.cumsum(G, dim=1)
    A = (a if isinstance(a, torch.Tensor) else torch.full((), float(a), dtype=lay.dtype, device=_device(lay))).expand(G.shape)
    return _scan(A, torch.cat([G[:, :1] + A[:, :1] * S_c, G[:, 1:]], dim=1))


def sliding_window(module, ir, lay: Layout, window: int) -> torch.Tensor:
    """Outputs [B, T, H, d] read from the state of the last ``window`` tokens only.

    For ``S_t = a_t . S_{t-1} + B_t`` the window state is
    ``S_t - (a_{t-w+1} ... a_t) . S_{t-w}`` (Stuffed Mamba's state-difference window).
    """
    if ir.kind not in ("scalar_decay", "diagonal_decay"):
        raise SsmcraftError(f"{ir.spec_name}: the state-difference sliding window needs a weighted-sum "
                            f"recurrence (scalar or elementwise decay); this objective is {ir.kind}")
    if window < 1:
        raise SsmcraftError(f"window must be >= 1, got {window}")
    d, m = lay.d, lay.m
    co = module.coefficients(lay.env, d, m)
    states = diagonal_states(module, lay, co)
    A = _full(co["a"], lay)
    if bool((A <= 0).any()):
        raise SsmcraftError(f"{ir.spec_name}: the decay is not positive everywhere on these inputs; "
                            "the window product needs log(a)")
    logcum = torch.cumsum(torch.log(A.double()), dim=1)
    if lay.T > window:
        decay = torch.exp(logcum[:, window:] - logcum[:, :-window]).to(states.dtype)
        windowed = states.clone()
        windowed[:, window:] = states[:, window:] - decay * states[:, :-window]
        states = windowed
    return module.readout(states, lay.env, co, d, m)[..., 0].expand(lay.B, lay.T, lay.H, d)
