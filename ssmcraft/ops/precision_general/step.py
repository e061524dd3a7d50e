"""Second-order learners whose memory step is not ``precision_rank1``'s rank-1 delta rule: the metric
compositions (``proximity: metric``) with two keys, a linear, Huber or Cauchy data term, an implicit
update or a per-channel step.

Every one of them keeps R's update free of S (``R_t = lam_t R_{t-1} + sum_i c_i k_i k_i^T``, one or
two keys, carried as P = R^-1), so the layer splits as ``precision_rank1`` splits RLS:

1. the gains, by ``precision_rank1``'s float64 precision kernels (``PrecisionFunction``). Two keys
   run as two tokens per step (two rank-1 Woodbury steps): ``(k1, lam, c1)`` then ``(k2, 1, c2)``,
   whose gains are ``h1 = R'^-1 k1`` (R' = lam R_{t-1} + c1 k1 k1^T) and ``h2 = R_t^-1 k2``;
   Sherman-Morrison turns them into what the step reads (``_gains``, float64):

       R_t^-1 k1 = h1 - c2 h2 (k2 . h1),        R_t^-1 k2 = h2,
       Q1 = (lam R_{t-1})^-1 k1 = h1 / (1 - c1 k1 . h1),
       Q2 = (lam R_{t-1})^-1 k2 = h2 / (1 - c2 k2 . h2) + c1 Q1 (h1 . k2);

2. S by a step that reads those gains as inputs, ``S_t = S_{t-1} - sum_i phi_i g_i^T``: an objective
   written here (``aux_spec``), derived by the compiler. With a per-head coefficient and a step
   linear in S it runs on ``rank1_chunk``'s chunked tensor-core kernels, as ``precision_rank1``'s
   memory does, or ``rankr_chunk``'s for two keys (its terms read the same S_{t-1}, as these do)
   (``chunked``); every other form (a nonlinear data term, a per-row step) on the ``general``
   family's generated sequential kernel of that objective. Either way the gains'
   gradients flow back into the precision kernels. The forms (``FORMS``), checked against the IR's
   own reference loop (``_probe``):

   - ``step`` (decay_explicit: the data term's gradient at S_{t-1}, preconditioned by the new R):
     ``phi_i = grad_i l(S_{t-1} k_i - x_i)``, ``g_i = R_t^-1 k_i``, for every data term l;
   - ``implicit_linear`` (``lam wsq(S - S_prev, R_prev)/2 - beta <S k_i, x_i>``, minimised):
     ``phi_i = -beta x_i``, ``g_i = Q_i``;
   - ``implicit_regression`` (``... + beta |S k_i - x_i|^2/2``, minimised): per row (beta per row or
     per head) ``M = beta (I + beta W)^-1``, W = K^T Q (n x n), and the step
     ``S_t = S_{t-1} - sum_ab M_ab (S_{t-1} k_a - x_a) Q_b^T``, read as
     ``S_{t-1} - sum_ac N_ac (S_{t-1} k_a - x_a) g_c^T`` with ``g = R_t^-1 k`` (Q = G (I + C W)) and
     ``N = M (I + W C)`` (C = diag(c_i)), whose entries stay bounded where Q and W grow without bound.

Why the general kernel for the other forms: it is the one kernel that runs all of them (nonlinear
data terms, per-row steps) from one generated objective; the per-row steps linear in S could run
row-tiled (``rank1_row``, ``rankr_row``) at the cost of matching each.

Numerics: the implicit forms' gains ``Q = h / (1 - c k . h)`` scale the float32 rounding of the
precision's gains by 1 / (1 - c k^T R_t^-1 k) = 1 + c k^T (lam R_{t-1})^-1 k, large where R has
forgotten k's direction; the implicit regression's step reads g and N, both bounded, not Q (one
key: ``N = b / (1 - c u + b u)``, u = k . g); the implicit linear step ``beta x Q^T`` keeps it: its
output and gradients carry the gains' float32
rounding times that factor (~1e-4 relative at forgetting factors in (0.2, 0.8) on 8-dim unit keys),
although the layer itself is well conditioned (its float64 reference moves by ~1e-7 when its inputs
are rounded to float32). The precision kernels returning P_{t-1} k (the gain before the update) in
float64 would remove it.

Shapes as the API carries them: inputs [B, T, H, n], states (R [B, H, m, m], S [B, H, d, m]).
Packed rows (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): B = 1, states [N, H, ...]; the precision
and either step kernel run each sequence from its own initial state (two keys: the offsets doubled).
"""
from __future__ import annotations

import itertools

import sympy
import torch

from ssmcraft.ops.common.tuning import IO_DTYPES, io_dtype, next_pow2
from ssmcraft.ops.common.varlen import offsets
from ssmcraft.ops.family import match_reason, probed_match
from ssmcraft.ops.general import recurrent as G
from ssmcraft.ops.precision_rank1 import chunk as P
from ssmcraft.ops.rank1_chunk.chunk import chunk_rank1
from ssmcraft.ops.rankr_chunk.chunk import CHUNK as RANKR_CHUNK, chunk_rankr

BACKEND_NAME = "precision-fp64"     # the runner adds the step's kernels: +rank1-chunk, +rankr-chunk or +general
FORMS = ("step", "implicit_linear", "implicit_regression")
DATA = ("regression", "linear", "huber", "cauchy")

# (data, per channel) -> the step's term for one gain: <S, phi g^T> with phi from coefficient c, residual r
_TERMS = {
    ("regression", False): "{c}*dot(S*{g}, {r})",
    ("regression", True): "dot(S*{g}, had({c}, {r}))",
    ("linear", False): "- {c}*dot(S*{g}, {x})",
    ("linear", True): "- dot(S*{g}, had({c}, {x}))",
    ("huber", False): "{c}*dot(S*{g}, {r})/sqrt(1 + sq({r}))",
    ("huber", True): "dot(S*{g}, had({c}, {r})/sqrt(ones(d) + had({r}, {r})))",
    ("cauchy", False): "{c}*dot(S*{g}, {r})/(1 + sq({r}))",
    ("cauchy", True): "dot(S*{g}, had({c}, {r})/(ones(d) + had({r}, {r})))",
}


def aux_spec(form: str, data: str, n: int, channel: bool) -> dict:
    """The memory's step as an objective over the gains ``g1..gn`` (inputs): ``S_t = S_prev - sum
    phi_i g_i^T`` written as the minimiser of ``sq(S - S_prev)/2 + <S, sum phi_i g_i^T>``. Its
    coefficients: ``beta`` (``step``, ``implicit_linear``) or ``a11, a12, a21, a22`` (N of
    ``implicit_regression``: ``S_t = S_prev - sum_ac N_ac r_a g_c^T``), per row when ``channel``."""
    step = {"shape": ["d"] if channel else []}
    inputs = {"q": {"shape": ["m"]}}
    for i in range(1, n + 1):
        inputs.update({f"k{i}": {"shape": ["m"]}, f"x{i}": {"shape": ["d"]}, f"g{i}": {"shape": ["m"]}})
    if form == "implicit_regression":
        terms = [(f"a{a}{b}", f"g{b}", a) for a in range(1, n + 1) for b in range(1, n + 1)]
        data = "regression"
    else:
        terms = [("beta", f"g{i}", i) for i in range(1, n + 1)]
    for c, _, _ in terms:
        inputs[c] = dict(step)
    used = sorted({i for _, _, i in terms}) if data != "linear" else []
    text = " + ".join(_TERMS[(data, channel)].format(c=c, g=g, r=f"r{i}", x=f"x{i}") for c, g, i in terms)
    return {"name": f"metric_{form}_{data}{n}{'_c' if channel else ''}"[:32],
            "summary": "the memory step of a metric composition, over its precision's gains",
            "state": {"S": ["d", "m"]}, "inputs": inputs,
            **({"let": {f"r{i}": f"S_prev*k{i} - x{i}" for i in used}} if used else {}),
            "objective": "sq(S - S_prev)/2 + " + text.replace("+ -", "-"), "update": "implicit", "output": "S*q"}


_AUX: dict = {}


def aux(form: str, data: str, n: int, channel: bool):
    """The derivation of ``aux_spec`` (once per process)."""
    key = (form, data, n, channel)
    if key not in _AUX:
        from ssmcraft.compiler.api import derive
        _AUX[key] = derive(aux_spec(*key))
    return _AUX[key]


# ----------------------------------------------------------------------------------------
# the gains
# ----------------------------------------------------------------------------------------

def _dot(a, b):
    return (a * b).sum(-1, keepdim=True)


def _gains(form, ks, cs, hs, beta):
    """(gains [g_1..g_n] [B, T, H, m], coefficients {aux name: tensor}) of the step from the precision's
    gains ``hs`` (module docstring), float64. ``cs``: R's weights [B, T, H, 1] (1 where None);
    ``beta`` [B, T, H] or [B, T, H, d]."""
    n = len(ks)
    G = [hs[0]] if n == 1 else [hs[0] - cs[1] * hs[1] * _dot(ks[1], hs[0]), hs[1]]      # R_t^-1 k_i
    if form == "step":
        return G, {"beta": beta}
    Q = [hs[0] / (1 - cs[0] * _dot(ks[0], hs[0]))]
    if n == 2:
        Q.append(hs[1] / (1 - cs[1] * _dot(ks[1], hs[1])) + cs[0] * Q[0] * _dot(hs[0], ks[1]))
    if form == "implicit_linear":
        return Q, {"beta": beta}
    # the write keys sum_b M_ab Q_b = sum_c N_ac g_c with N = M (I + W C) = b (I + b W)^-1 (I + W C):
    # bounded where W = K^T Q is large, so that the step reads well-scaled gains and coefficients
    b = beta if beta.dim() == 4 else beta[..., None]                   # [B, T, H, 1 | d]
    W = [[_dot(ks[a], Q[c]) for c in range(n)] for a in range(n)]       # [B, T, H, 1] each; symmetric
    if n == 1:
        N = {"a11": b * (1 + cs[0] * W[0][0]) / (1 + b * W[0][0])}
    else:        # (I + b W)^-1 by its adjugate, times I + W C
        det = (1 + b * W[0][0]) * (1 + b * W[1][1]) - b * b * W[0][1] * W[1][0]
        inv = [[(1 + b * W[1][1]) / det, -b * W[0][1] / det], [-b * W[1][0] / det, (1 + b * W[0][0]) / det]]
        IWC = [[(a == c) + W[a][c] * cs[c] for c in range(2)] for a in range(2)]
        N = {f"a{a + 1}{c + 1}": b * (inv[a][0] * IWC[0][c] + inv[a][1] * IWC[1][c])
             for a in range(2) for c in range(2)}
    return G, {k: (v if beta.dim() == 4 else v[..., 0]) for k, v in N.items()}


def _interleaved(ks, lam, cs):
    """The precision's token sequence: one token per key and step (module docstring), [B, n T, H, ...]."""
    if len(ks) == 1:
        return ks[0], lam, cs[0]
    B, T, H, m = ks[0].shape
    one = torch.ones_like(lam)
    c = [one if x is None else x for x in cs] if any(x is not None for x in cs) else None
    inter = lambda a, b: torch.stack([a, b], 2).reshape(B, 2 * T, H, *a.shape[3:])    # noqa: E731
    return inter(*ks), inter(lam, one), None if c is None else inter(*c)


def naive_precision(ks, lam, cs, R0):
    """The precision's gains by a solve per token (float64, the probe's): ([h_i] [B, T, H, m], R_T)
    (``R_T`` a callable, as ``kernel_precision``'s)."""
    R, hs = R0, [[] for _ in ks]
    for t in range(lam.shape[1]):
        for i, k in enumerate(ks):
            kt = k[:, t]
            c = 1.0 if cs[i] is None else cs[i][:, t, :, None]
            R = (lam[:, t, :, None, None] if i == 0 else 1.0) * R + (c * kt)[..., :, None] * kt[..., None, :]
            hs[i].append(torch.linalg.solve(R, kt))
    return [torch.stack(h, 1) for h in hs], lambda: R


def kernel_precision(ks, lam, cs, R0, cu=None):
    """The precision's gains by ``precision_rank1``'s float64 kernels: ([h_i] [B, T, H, m] float32, R_T
    float64, a callable: the final precision inverted only where the final state is asked); ``cu`` a
    packed row's offsets (ints, int32 tensor) (B = 1; R0 and R_T [N, H, m, m]) or None."""
    B, T, H, m = ks[0].shape
    n = len(ks)
    N = B if cu is None else len(cu[0]) - 1
    k, la, c = _interleaved([x.float() for x in ks], lam.float(), [None if x is None else x.float() for x in cs])
    p0 = torch.linalg.inv(R0.double())
    p0 = (0.5 * (p0 + p0.transpose(-1, -2))).expand(N, H, m, m).contiguous()
    g, pt = P.PrecisionFunction.apply(k.contiguous(), la.contiguous(), None if c is None else c.contiguous(), None,
                                      p0, None if cu is None else n * cu[1])
    hs = [g] if n == 1 else list(g.reshape(B, T, 2, H, m).unbind(2))
    return hs, lambda: torch.linalg.inv(pt)


# ----------------------------------------------------------------------------------------
# matching
# ----------------------------------------------------------------------------------------

def _structure(ir) -> dict:
    """R, S, the keys and R's weights, lam, q, and the candidate roles of the other inputs, read off
    the IR's structure; ValueError says what does not fit."""
    d, m = ir.dims
    R, _, terms, S, lam, q = P.covariance_and_memory(ir)
    if not 1 <= len(terms) <= 2 or any(u != v for _, u, v in terms):
        raise ValueError(f"{R} is not updated by one or two k k^T terms")
    ks = [P._leaf(ir, sympy.sympify(u), (m,)) for _, u, _ in terms]
    cs = [None if sympy.sympify(c) == 1 else P._leaf(ir, sympy.sympify(c), ()) for c, _, _ in terms]
    rest = [x for x in ir.inputs if x not in {*ks, lam, q}]
    weights = {c for c in cs if c}
    if any(tuple(ir.inputs[x]) not in ((d,), ()) for x in rest) or \
            len([x for x in rest if x not in weights]) not in (len(ks), len(ks) + 1):
        raise ValueError(f"inputs besides {len(ks)} key(s), a query, the forgetting factor and R's weights are "
                         f"not {len(ks)} target(s) over {d} and one step")
    return {"R": R, "S": S, "ks": ks, "cs": cs, "lam": lam, "q": q, "rest": rest, "r0": float(ir.inits[R])}


def _roles(ir, names):
    """Every assignment of the other inputs to the targets x_1..x_n (over d) and the step beta (an input
    of its own, or one of R's weights, as the preconditioned delta rule's beta is both)."""
    d = ir.dims[0]
    n = len(names["ks"])
    weights = {c for c in names["cs"] if c}
    for xs in itertools.permutations([x for x in names["rest"] if x not in weights], n):
        if all(tuple(ir.inputs[x]) == (d,) for x in xs):
            left = [x for x in names["rest"] if x not in xs and x not in weights]
            for beta in left or sorted(weights):
                yield list(xs), beta


def run(roles, get, R0, S0, output_final_state, precision, step, **packed):
    """The layer on tensors ``get(name)`` (API layout): ``precision(ks, lam, cs, R0) -> (hs, R_T)``,
    ``step(aux key, {aux input: tensor}, S0, output_final_state) -> (y, S_T)`` (``aux(*key)``'s
    update); ``packed``: ``cu=`` offsets of a packed row, passed to both. Returns (y, R_T, S_T)."""
    ks = [get(k) for k in roles["ks"]]
    cs = [None if c is None else get(c) for c in roles["cs"]]
    lam = get(roles["lam"])
    hs, RT = precision(ks, lam, cs, R0, **packed)
    f64 = lambda t: t.double()          # noqa: E731  (Sherman-Morrison's 1 - c k.h cancels in float32)
    gs, coef = _gains(roles["form"], [f64(k) for k in ks], [1.0 if c is None else f64(c)[..., None] for c in cs],
                      [f64(h) for h in hs], f64(get(roles["beta"])))
    ins = {"q": get(roles["q"])}
    for i, (k, x, g) in enumerate(zip(roles["ks"], roles["xs"], gs), 1):
        ins.update({f"k{i}": get(k), f"x{i}": get(x), f"g{i}": g})
    io = torch.float64 if ins["q"].dtype == torch.float64 else torch.float32
    ins.update({n: v.to(io) for n, v in coef.items()})
    ins.update({n: ins[n].to(io) for n in ins if n.startswith("g")})
    y, ST = step((roles["form"], roles["data"], len(ks), roles["channel"]), ins, S0, output_final_state, **packed)
    return y, (RT() if output_final_state else None), ST


def _loop(ir, module, vals: dict, S0):
    """``module``'s reference loop (float64) on the API-layout tensors ``vals`` of ``ir``'s inputs:
    (y, S_T)."""
    from ssmcraft.ops.common.reference import Layout, reference_loop
    d, m = ir.dims
    first = next(iter(vals.values()))
    B, T, H = first.shape[:3]
    D = next(t.shape[-1] for n, t in vals.items() if tuple(ir.inputs[n]) == (d,))
    M = next(t.shape[-1] for n, t in vals.items() if tuple(ir.inputs[n]) == (m,))
    env = {n: t.reshape(B, T, H, *((D, 1) if tuple(ir.inputs[n]) == (d,) else (1, M) if tuple(ir.inputs[n]) == (m,)
                                   else (1, 1))) for n, t in vals.items()}
    y, ST, _ = reference_loop(module, Layout(env, B, T, H, D, M, torch.float64, torch.float64, S0))
    return y, ST


def _reference_step(key, ins, S0, output_final_state):
    """The step's own reference loop (the probe's ``step``)."""
    der = aux(*key)
    return _loop(der.ir, der.module, ins, S0)


def _probe(ir, names) -> dict | str:
    """The IR's reference loop against ``run`` with a solve per token for the gains and the step's
    own reference loop, on a small float64 case, for every form, data term and assignment of roles:
    the first that agrees, or why none does."""
    from ssmcraft.compiler.api import generate_reference
    d, m = ir.dims
    B, T, H, D, M = 1, 5, 1, 3, 3
    gen = torch.Generator().manual_seed(0)
    val = {}
    for n, dims in ir.inputs.items():
        shape = (B, T, H, *(D if x == d else M for x in dims))
        val[n] = (torch.randn(*shape, generator=gen, dtype=torch.float64) if dims else
                  0.3 + 0.6 * torch.rand(*shape, generator=gen, dtype=torch.float64))
    A = torch.randn(B, H, M, M, generator=gen, dtype=torch.float64)
    R0, S0 = torch.eye(M, dtype=torch.float64) + 0.1 * A @ A.transpose(-1, -2), torch.randn(B, H, D, M, generator=gen,
                                                                                           dtype=torch.float64)
    y, ST = _loop(ir, generate_reference(ir)[0], val, tuple(R0 if x == names["R"] else S0 for x in ir.states))
    want = dict(zip(ir.states, ST))
    for (xs, beta), form, data in itertools.product(_roles(ir, names), FORMS, DATA):
        if form != "step" and data in ("huber", "cauchy") or form == "implicit_linear" and data != "linear" or \
                form == "implicit_regression" and data != "regression":
            continue
        roles = {**names, "xs": xs, "beta": beta, "form": form, "data": data, "channel": bool(ir.inputs[beta])}
        yn, Rn, Sn = run(roles, val.__getitem__, R0, S0, True, naive_precision, _reference_step)
        if all(torch.allclose(a, b, rtol=1e-9, atol=1e-9) for a, b in ((y, yn), (want[names["R"]], Rn),
                                                                       (want[names["S"]], Sn))):
            return {n: v for n, v in roles.items() if n != "rest"}
    return ("the memory's update is none of S_t = S - sum phi_i g_i^T with g_i = R_t^-1 k_i (a gradient step of a "
            "regression, linear, Huber or Cauchy data term) or the implicit regression / linear minimiser")


def match(ir) -> dict:
    """``_structure`` and ``_probe`` (once per IR); ValueError says why the family does not run it."""
    return probed_match(ir, "precision_general", _structure, _probe)


def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    if not ir.states or not ir.inverses:
        return f"{ir.spec_name}: no square state carried by its inverse"
    return match_reason(ir, match)


def supports_inputs(ir, inputs, mode) -> str | None:
    """``precision_rank1``'s limit on the key dimension (its float64 tiles)."""
    return P.supports_inputs(ir, inputs, mode)


def chunked(key) -> str | None:
    """The chunked family that runs the step of ``aux(*key)`` (``"rank1-chunk"``: one key,
    ``"rankr-chunk"``: two), or None (the general kernel): a per-head coefficient and a step linear in
    S, ``S_t = S - sum_i (S k_i - x_i) w_i^T`` or ``S + sum_i x_i w_i^T``."""
    form, data, n, channel = key
    if channel or data not in ("regression", "linear"):
        return None
    return "rank1-chunk" if n == 1 else "rankr-chunk"


def _writes(key, ins) -> list:
    """The write keys w_i of a chunked step (``chunked``): ``sum_c N_ic g_c`` (implicit regression), else
    ``beta g_i``; [B, T, H, m] each."""
    form, _, n, _ = key
    if form == "implicit_regression":
        return [sum(ins[f"a{a}{c}"][..., None] * ins[f"g{c}"] for c in range(1, n + 1)) for a in range(1, n + 1)]
    return [ins["beta"][..., None] * ins[f"g{a}"] for a in range(1, n + 1)]


def _kernel_step(key, ins, S0, output_final_state, cu=None):
    """The step on Triton: ``rank1_chunk`` / ``rankr_chunk``'s chunked kernels where ``chunked(key)``
    (insert = erase keys w_i, read keys k_i, step 1; 0 for a linear data term, which erases nothing),
    else the ``general`` family's generated kernel of ``aux(*key)``; ``cu`` (a packed row's offsets:
    ints, int32 tensor) runs either natively. (y [B, T, H, d], S_T [B, H, d, m] ([N, ...] packed)
    fp32 or None)."""
    x = ins["x1"]
    if chunked(key):
        n = key[2]
        # the step I - k w^T does not contract as DeltaNet's does (|w| of a few units for unit keys), so
        # its chunk tiles stored in 16 bits lose more than bf16 I/O does at long lengths: fp32 as for RLS
        mem = torch.float32 if P.MEMORY_FP32 else x.dtype
        x = x.to(mem)
        w = [t.to(mem) for t in _writes(key, ins)]
        q, ks = ins["q"].to(mem), [ins[f"k{i}"].to(mem) for i in range(1, n + 1)]
        c = (torch.zeros_like if key[1] == "linear" else torch.ones_like)(x[..., 0])
        h0 = None if S0 is None else S0.transpose(-1, -2)
        packed = None if cu is None else cu[1]
        if n == 1:
            o, ht = chunk_rank1(w[0], x, c, q, u=ks[0], initial_state=h0,
                                output_final_state=output_final_state, chunk_size=P.CHUNK, cu_seqlens=packed)
        else:
            o, ht = chunk_rankr(w, [ins[f"x{i}"].to(mem) for i in range(1, n + 1)], c, q, u=ks, initial_state=h0,
                                output_final_state=output_final_state, chunk_size=RANKR_CHUNK, cu_seqlens=packed)
        return o, None if ht is None else ht.transpose(-1, -2)
    ir = aux(*key).ir           # one state: the kernels' state is S itself (no stacking)
    B, T, H, V = x.shape
    K = ins["q"].shape[-1]
    leaves = [(ins[n] if ins[n].dtype in IO_DTYPES else ins[n].float()).contiguous() for n in ir.inputs]
    BV = G.rows_per_program(ir, V, K) or next_pow2(V)
    return G._GeneralFunction.apply(ir, (B, T, H, K, V, BV), io_dtype(x.dtype), output_final_state, cu,
                                    S0, *leaves)


def prepare(obj, lay):
    """The runner for one call signature: (y [B, T, H, d] in the call's output dtype, (states in the
    IR's order: R [B, H, m, m], S [B, H, d, m], fp32) or None)."""
    roles = match(obj.ir)
    order = obj.ir.states
    out_dtype = lay.out_dtype

    def fn(inputs, params, initial_state, output_final_state, cu_seqlens=None):
        get = lambda n: inputs[n] if inputs[n].dtype in IO_DTYPES else inputs[n].float()    # noqa: E731
        m = inputs[roles["ks"][0]].shape[-1]
        dev = inputs[roles["ks"][0]].device
        packed = {}
        if cu_seqlens is not None:      # checked against the inputs and the states ([N, ...]; R0 may be [m, m])
            ints = offsets(obj.name, cu_seqlens, inputs, tuple(t for t in initial_state or () if t.dim() == 4))
            packed["cu"] = (ints, cu_seqlens.to(device=dev, dtype=torch.int32))
        if initial_state is not None:
            st = dict(zip(order, initial_state))
            R0, S0 = st[roles["R"]], st[roles["S"]].float()
        else:           # R starts at r0 I (``init: {identity: r0}``), S at zero
            R0, S0 = roles["r0"] * torch.eye(m, device=dev, dtype=torch.float64), None
        y, RT, ST = run(roles, get, R0, S0, output_final_state, kernel_precision, _kernel_step, **packed)
        if not output_final_state:
            return y.to(out_dtype), None
        out = {roles["R"]: RT.float(), roles["S"]: ST}
        return y.to(out_dtype), tuple(out[x] for x in order)
    # what the backend name adds to the family's (``select._runner``): the kernels of the step
    fn.slots_path = chunked((roles["form"], roles["data"], len(roles["ks"]), roles["channel"])) or "general"
    return fn
