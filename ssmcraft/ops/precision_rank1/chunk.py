"""Second-order learners whose precision does not read the memory: recursive least squares
(``objectives/rls.yaml``) and the preconditioned delta rule (``objectives/precond_delta.yaml``).

The family, with per-head ``lam`` (forgetting), ``beta`` (the covariance's weight) and ``eta``
(the memory's step) per token; RLS: beta = eta = 1, the preconditioned delta rule: beta = eta:

    R_t = lam_t R_{t-1} + beta_t k_t k_t^T          (the key covariance, [m, m]; carried as P = R^-1)
    g_t = eta_t R_t^{-1} k_t = eta_t P_{t-1} k_t / (lam_t + beta_t k_t^T P_{t-1} k_t)
    S_t = S_{t-1} - (S_{t-1} k_t - x_t) g_t^T,      y_t = S_t q_t

R (and so g) never reads S, so the layer splits in two:

1. the gains g, chunked (``precision_fwd_kernel``, one program per (batch, head), sequential over
   chunks of at most ``PCHUNK`` tokens, P = R^-1 [m, m] in float64, read back between chunks from the
   program's slot of its output). Within a chunk from P_c, with Gamma_t = prod_{s <= t} lam_s (s from
   the chunk's first token), R_t = Gamma_t (R_c + sum_{tau <= t} (beta_tau / Gamma_tau) k_tau k_tau^T):
   the chunk's C rank-1 updates are one C x C system

       A = diag(Gamma / beta) + K P_c K^T = L L^T  (Cholesky),   V = L^-1 K P_c,

   whose row t is the sequential recurrence's w_t = P_{t-1} k_t rescaled (L_tt^2 = Gamma_{t-1} s_t
   / beta_t: the pivots are the Sherman-Morrison denominators), so that

       G = diag(eta / (beta diag(L))) V,    P_{c+1} = (P_c - V^T V) / Gamma_C   (Woodbury, rank C).

   ``precision_bwd_kernel`` runs the adjoint in reverse, rebuilding every P_c from the next one and
   the stored V (P_c = Gamma_C P_{c+1} + V^T V), the Cholesky factor's through L^-T Phi(L^T dL) L^-1
   (Phi: the lower triangle, the diagonal halved).
   That walk is the sequential form (``PARALLEL = False``). The default, parallel form
   (``parallel.py``) cuts each sequence into segments of ``SEGMENT`` tokens, takes every segment's
   first covariance R_j from one weighted sum of the segments' k k^T terms (R is linear across
   segments), inverts each (Cholesky, float64), and runs the same two kernels on the segments as the
   sequences of a packed row, each from its own P_j = R_j^-1: every (segment, head) a program. It is
   also the more accurate at long lengths (``parallel.py`` has the figures): a precision chained over
   a whole sequence accumulates every chunk's rounding, an inverse per segment does not;
2. S: a rank-1 update with read key k and erase/insert key g, through ``rank1_chunk``'s chunked
   tensor-core function (``chunk_rank1(v=g, p=x, c=1, oq=q, u=k)``, the merged form: insert key =
   erase key), in fp32 whatever the I/O dtype (``MEMORY_FP32``). Unlike DeltaNet's step (I - beta k
   k^T, a contraction), I - k g^T contracts only in R's norm: |g| = |R^-1 k| is 3-10 for unit keys
   under lam ~ 0.88, and a chunk's inverse M = (I + strict_lower(K G^T))^-1 and W = M K, which the
   chunked function stores in its I/O dtype, amplify bf16 rounding. At T = 1029, d = m = 64 (PyTorch
   float64 with the bf16 kernels' roundings replayed) y is off by 1.0e-2 with only the inputs
   rounded, still 1.0e-2 with g rounded too, 2.3e-2 with M, 1.6e-2 with W, 2.9e-2 with every stored
   tile (gradients up to 7.3e-2 on the GPU, dk). In fp32 only the inputs' rounding remains.

Why float64 for P: with forgetting (lam < 1) the directions of R that recent keys do not fill
decay towards 0, so R's condition number reaches ~1e6 at m = 64 within tens of tokens, and the
inverse's update amplifies each step's rounding by it: float32 P drifts by ~1e-2 relative (lam's
gradient by up to 1e-1), although the layer itself is well conditioned (the float64 reference moves
by ~1e-8 when its inputs are rounded to float32). In float64 the drift is ~1e-10. The chunk keeps
every product in float64 (Hopper's fp64 tensor cores). A chunk's rounding is at P_c's scale and
P_{c+1} divides it by Gamma_C, so a chunk ends before its Gamma falls below ``GAMMA_MIN`` (0.01; a
token alone is a chunk when its lam is below that): under strong forgetting the chunks shorten
towards the token-by-token recurrence, whose accuracy they keep (within ~5x on keys that refill R
every few tokens, where chunks of 16 regardless lose 3-5 more digits or meet a negative pivot).
With lam = sigmoid(N(2, 1)) a chunk holds ~16 tokens.

Shapes: k, q [B, T, H, m]; x [B, T, H, d]; lam, beta, eta [B, T, H]; states (R [B, H, m, m], S
[B, H, d, m]) as the API carries them. I/O in float32, bfloat16 or float16 (the precision reads
fp32 copies of k, lam, beta, eta, the memory's step fp32 copies of g, x, q, k); P, V, L, L^-1 in
float64, g in float32.

Packed rows (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): B = 1 and N sequences laid end to end,
states ``[N, H, ...]``. The sequential form runs one program per (sequence, head) over that
sequence's tokens, from its own P0 to its own final P; the parallel form cuts each sequence into its
own segments (the first at its first token, R from its own R0); the memory S is ``chunk_rank1``'s
packed call (``cu_seqlens``).
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.chunked import key_size_reason, key_sizes
from ssmcraft.ops.family import match_reason, probed_match
from ssmcraft.ops.common.varlen import offsets
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import IO_DTYPES, buffer, io_dtype, pow2
from ssmcraft.ops.precision_rank1.parallel import CovarianceFunction, inverse, segments
from ssmcraft.ops.precision_rank1.kernels import precision_bwd_kernel, precision_fwd_kernel
from ssmcraft.ops.rank1_chunk.chunk import chunk_rank1

POISON = False                      # tests: fill every buffer with NaN before the kernels write it
PARALLEL = True                     # the parallel form (``parallel.py``); False: one program walks the chunks
SEGMENT = 32                        # the parallel form's segment (tokens): one inverse, then chained chunks
MEMORY_FP32 = True                  # the memory's chunked step in fp32 whatever the I/O dtype (``_memory``)
BACKEND_NAME = "precision-fp64+rank1-chunk"
CHUNK = 16                          # chunk size of the rank-1 part (fp32 tiles: 64 spills)
PCHUNK = 16                         # the precision's longest chunk (its Cholesky runs column by column)
GAMMA_MIN = 0.01                    # a precision chunk ends before its forgetting Gamma falls below this
MAX_K = 64                          # the largest key dimension (``supports_sizes``)


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _starts(rows: int, cols: int, device) -> torch.Tensor:
    """The forward's record of its chunks (int32 ``[N * H, T + 2]``), poisoned with -1 as ``POISON`` asks."""
    if POISON:
        return torch.full((rows, cols), -1, device=device, dtype=torch.int32)
    return torch.empty(rows, cols, device=device, dtype=torch.int32)


class PrecisionFunction(torch.autograd.Function):
    """(k [B, T, H, K], lam [B, T, H], beta [B, T, H] | None, eta [B, T, H] | None, P0 [N, H, K, K]
    float64, cu int32 [N + 1] offsets of a packed row (B = 1) | None (N = B), the longest sequence's
    length | None (= T), from_r) -> (g [B, T, H, K] float32, P_T [N, H, K, K] float64). ``from_r``:
    the fifth input is the initial covariance R0 instead, inverted here (``parallel.inverse``), and
    its gradient is R0's (the backward kernel's ``DR``)."""

    @staticmethod
    def forward(ctx, k, lam, beta, eta, p0, cu=None, longest=None, from_r=False):
        B, T, H, K = k.shape
        N = p0.shape[0]
        dev = k.device
        TS = (T if longest is None else longest) + 2        # a program's chunk starts, its length, its count
        train = any(ctx.needs_input_grad[:5])
        g = _empty(B, T, H, K, device=dev, dtype=torch.float32)
        v, lc, li, starts = ((_empty(B, T, H, K, device=dev, dtype=torch.float64),
                              *(_empty(B, T, H, PCHUNK, device=dev, dtype=torch.float64) for _ in range(2)),
                              _starts(N * H, TS, dev)) if train else (g, g, g, g))
        pt = _empty(N, H, K, K, device=dev, dtype=torch.float64)
        if from_r:
            p0 = inverse(p0)
        launch(precision_fwd_kernel, (N * H,), k=k, lam=lam, beta=lam if beta is None else beta,
               eta=lam if eta is None else eta, p0=p0, g=g, v=v, lc=lc, li=li, starts=starts, pt=pt,
               cu=g if cu is None else cu, T=T, TS=TS, H=H, K=K, BK=pow2(K), BC=PCHUNK, TAU=GAMMA_MIN,
               HAS_BETA=beta is not None, HAS_ETA=eta is not None, STORE=train, VARLEN=cu is not None)
        ctx.set_materialize_grads(False)
        ctx.cu, ctx.ts, ctx.from_r = cu, TS, from_r
        if train:
            ctx.save_for_backward(k, lam, beta, eta, v, lc, li, starts, pt)
        return g, pt

    @staticmethod
    def backward(ctx, dg, dpt):
        k, lam, beta, eta, v, lc, li, starts, pt = ctx.saved_tensors
        B, T, H, K = k.shape
        N = pt.shape[0]
        dev = k.device
        dg = torch.zeros(B, T, H, K, device=dev, dtype=torch.float32) if dg is None else dg.contiguous()
        dk = _empty(*k.shape, device=dev, dtype=k.dtype)
        dlam = _empty(*lam.shape, device=dev, dtype=lam.dtype)
        dbeta = _empty(*beta.shape, device=dev, dtype=beta.dtype) if beta is not None else dlam
        deta = _empty(*eta.shape, device=dev, dtype=eta.dtype) if eta is not None else dlam
        dp0 = _empty(N, H, K, K, device=dev, dtype=torch.float64)
        launch(precision_bwd_kernel, (N * H,), k=k, lam=lam, beta=lam if beta is None else beta,
               eta=lam if eta is None else eta, v=v, lc=lc, li=li, starts=starts, pt=pt, dg=dg,
               dpt=dg if dpt is None else (0.5 * (dpt + dpt.transpose(-1, -2))).contiguous(),
               dk=dk, dlam=dlam, dbeta=dbeta, deta=deta, dp0=dp0, cu=dk if ctx.cu is None else ctx.cu, T=T, TS=ctx.ts, H=H, K=K,
               BK=pow2(K), BC=PCHUNK, HAS_BETA=beta is not None, HAS_ETA=eta is not None, HAS_DPT=dpt is not None,
               VARLEN=ctx.cu is not None, DR=ctx.from_r)
        return (dk, dlam, (dbeta if beta is not None else None), (deta if eta is not None else None), dp0, None, None,
                None)


def form() -> str:
    """Which form of the precision runs (``PARALLEL``), for a benchmark's table."""
    return f"parallel (segments of {SEGMENT} tokens)" if PARALLEL else "sequential"


def _precision(k, lam, beta, eta, R0, cu, N):
    """The gains and the final covariance: (g [B, T, H, K] float32, R_T [N, H, K, K] float64) from
    fp32 k, lam, beta, eta and R0 (float64, [K, K] or [N, H, K, K]); ``cu`` the packed row's offsets
    (Python ints) or None. ``PARALLEL`` picks the form."""
    B, T, H, K = k.shape
    R0 = 0.5 * (R0 + R0.transpose(-1, -2))
    if not PARALLEL:
        p0 = torch.linalg.inv(R0)
        p0 = (0.5 * (p0 + p0.transpose(-1, -2))).expand(N, H, K, K).contiguous()    # exactly symmetric (kernels)
        g, pt = PrecisionFunction.apply(k, lam, beta, eta, p0, None if cu is None else
                                        torch.tensor(cu, device=k.device, dtype=torch.int32))
        return g, torch.linalg.inv(pt)
    cu = [i * T for i in range(B + 1)] if cu is None else cu
    starts, first = segments(cu, SEGMENT)
    flat = lambda t: None if t is None else t.reshape(B * T, *t.shape[2:])        # noqa: E731
    i32 = lambda v: torch.tensor(v, device=k.device, dtype=torch.int32)          # noqa: E731
    Rs, RT = CovarianceFunction.apply(flat(k), flat(lam), flat(beta), R0.expand(N, H, K, K).contiguous(), i32(cu),
                                      i32(first), len(starts) - 1, SEGMENT, POISON)
    RT = 0.5 * (RT + RT.transpose(-1, -2))
    if len(starts) == 1:                # no token at all: no segment, nothing to launch
        return k.new_zeros(B, T, H, K), RT
    row = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])      # noqa: E731
    g, _ = PrecisionFunction.apply(row(k), row(lam), row(beta), row(eta), Rs, i32(starts), SEGMENT, True)
    return g.view(B, T, H, K), RT


def _memory(g, x, q, k, S0, output_final_state: bool, chunk_size: int, cu_seqlens):
    """S through ``chunk_rank1`` (insert = erase key g, read key k, step 1): (o [B, T, H, d],
    S_T [N, H, K=m, V=d] (the kernels' layout) or None); ``cu_seqlens`` a packed row, run natively."""
    ones = torch.ones(x.shape[:3], device=k.device, dtype=x.dtype)
    return chunk_rank1(g, x, ones, q, u=k, initial_state=S0, output_final_state=output_final_state,
                       chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def precision_rank1(k, x, q, lam, *, beta=None, eta=None, initial_state=None, output_final_state: bool = False,
                    chunk_size: int = CHUNK, cu_seqlens=None):
    """The layer of the module docstring.

    Args:
        k: key [B, T, H, m]; x: target [B, T, H, d]; q: query [B, T, H, m].
        lam: forgetting factor [B, T, H] in (0, 1]; beta: the covariance's weight of k k^T [B, T, H]
            or None (= 1); eta: the memory's step [B, T, H] or None (= 1). RLS: both 1; the
            preconditioned delta rule: both its beta.
        initial_state: (R0, S0) or None (= (I, 0)): R0 [B, H, m, m] (or [m, m]) symmetric positive
            definite or None (= I), S0 [B, H, d, m] or None (= 0).
        output_final_state: also return (R_T, S_T) (fp32).
        chunk_size: the rank-1 part's chunk, 16, 32 or 64.
        cu_seqlens: int32/int64 offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, checked by ``ssmcraft.ops.common.varlen.offsets``); states are then
            [N, H, ...] (R0 may stay [m, m]).
    Returns:
        y [B, T, H, d] in x's dtype, (R_T, S_T) or None.
    """
    B, T, H, K = k.shape
    dt = x.dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"precision_rank1: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    R0, S0 = (None, None) if initial_state is None else initial_state
    cu = None
    if cu_seqlens is not None:          # R0 of [m, m] is every sequence's: only [N, H, ...] states are checked
        cu = offsets("precision_rank1", cu_seqlens, {"k": k},
                     tuple(t for t in (R0, S0) if t is not None and t.dim() == 4))
    N = B if cu is None else len(cu) - 1
    R0 = torch.eye(K, device=k.device, dtype=torch.float64) if R0 is None else R0.double()
    # every input in fp32: Triton 3.6 gives an fp64 product that reads a value converted from 16 bits
    # a packed operand layout that its fp64 tensor-core lowering rejects ("fp64 don't support largeK MMA")
    head = lambda t: None if t is None else t.float().contiguous()     # noqa: E731
    kf = head(k)
    g, RT = _precision(kf, head(lam), head(beta), head(eta), R0, cu, N)
    mem = torch.float32 if MEMORY_FP32 else dt
    o, ht = _memory(g.to(mem), x.to(mem), q.to(mem), kf if MEMORY_FP32 else k, None if S0 is None else
                    S0.transpose(-1, -2), output_final_state, chunk_size, cu_seqlens)
    o = o.to(dt)
    if not output_final_state:
        return o, None
    return o, (RT.float(), ht.transpose(-1, -2))


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def _leaf(ir, e, dims):
    import sympy
    if isinstance(e, sympy.Symbol) and e.name in ir.inputs and tuple(ir.inputs[e.name]) == dims:
        return e.name
    raise ValueError(f"{e} is not an input of dims {dims}")


def covariance_and_memory(ir) -> tuple:
    """(R, its forgetting factor's expression alpha, its terms ((c, u, v): + c u v^T), S, the forgetting
    factor's input lam, the readout's query q) of a layer with one square state R [m, m] carried by its
    inverse from a multiple of the identity, and one memory S [d, m] read out as S q; ValueError says
    what does not fit."""
    import sympy
    d, m = ir.dims
    if len(ir.states) != 2 or len(ir.inverses) != 1 or ir.params or ir.minibatch or ir.hidden:
        raise ValueError("not one square state carried by its inverse plus one memory")
    R, alpha, terms = ir.inverses[0]
    S = next(x for x in ir.states if x != R)
    if tuple(ir.shape_of(R)) != (m, m) or tuple(ir.shape_of(S)) != (d, m):
        raise ValueError(f"states {R} {ir.shape_of(R)}, {S} {ir.shape_of(S)}")
    if R not in ir.inits:
        raise ValueError(f"{R} does not start at a multiple of the identity")
    lam = _leaf(ir, sympy.sympify(alpha), ())
    if len(ir.readout_reductions) != 1 or ir.readout != sympy.Symbol(ir.readout_reductions[0].name, real=True):
        raise ValueError("the readout is not S q")
    q = _leaf(ir, sympy.cancel(ir.readout_reductions[0].body / sympy.Symbol(S, real=True)), (m,))
    return R, alpha, terms, S, lam, q


def _structure(ir) -> dict:
    """Input names (k, x, q, lam, beta | None), state names, R's initial scale and the candidates
    for the memory's step ``eta`` (None = 1, or a per-head input), read off the IR's structure;
    ValueError says what does not fit. The S update itself is checked by ``_probe``."""
    import sympy
    d, m = ir.dims
    R, alpha, terms, S, lam, q = covariance_and_memory(ir)
    if len(terms) != 1 or terms[0][1] != terms[0][2]:
        raise ValueError(f"{R} is not updated by one k k^T term")
    c, key, _ = terms[0]
    k = _leaf(ir, sympy.sympify(key), (m,))
    beta = None if sympy.sympify(c) == 1 else _leaf(ir, sympy.sympify(c), ())
    xs = [n for n, dims in ir.inputs.items() if tuple(dims) == (d,)]
    if len(xs) != 1:
        raise ValueError(f"not one target over {d}")
    heads = [n for n, dims in ir.inputs.items() if tuple(dims) == () and n != lam]
    if set(ir.inputs) != {k, q, lam, xs[0], *heads}:
        raise ValueError("inputs besides a key, a query, a target and per-head factors")
    return {"k": k, "x": xs[0], "q": q, "lam": lam, "beta": beta, "R": R, "S": S, "r0": float(ir.inits[R]),
            "heads": heads}


def _probe(ir, names) -> dict | str:
    """The IR's reference loop against the naive twin on a small float64 case, for each candidate
    step ``eta`` (1, then each per-head input): the names with the ``eta`` that agrees, or why none does."""
    from ssmcraft.compiler.api import generate_reference
    from ssmcraft.ops.common.reference import Layout, reference_loop
    from ssmcraft.ops.precision_rank1.naive import naive_precision_rank1
    d, m = ir.dims
    B, T, H, D, M = 1, 5, 1, 2, 3
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)     # noqa: E731
    val = {names["k"]: r(B, T, H, M), names["q"]: r(B, T, H, M), names["x"]: r(B, T, H, D),
           names["lam"]: 0.5 + 0.4 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)}
    for n in names["heads"]:
        val[n] = 0.2 + 0.6 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    A = r(B, H, M, M)
    R0, S0 = torch.eye(M, dtype=torch.float64) + A @ A.transpose(-1, -2) * 0.1, r(B, H, D, M)
    env = {n: t.reshape(B, T, H, *((D, 1) if tuple(ir.inputs[n]) == (d,) else (1, M) if tuple(ir.inputs[n]) == (m,)
                                   else (1, 1))) for n, t in val.items()}
    module, _ = generate_reference(ir)
    y, ST, _ = reference_loop(module, Layout(env, B, T, H, D, M, torch.float64, torch.float64,
                                             tuple(R0 if x == names["R"] else S0 for x in ir.states)))
    got = dict(zip(ir.states, ST))
    for eta in (None, *names["heads"]):
        yn, Rn, Sn = naive_precision_rank1(val[names["k"]], val[names["x"]], val[names["q"]], val[names["lam"]],
                                           val.get(names["beta"]), val.get(eta), R0, S0)
        if all(torch.allclose(a, b, rtol=1e-9, atol=1e-9) for a, b in ((y, yn), (got[names["R"]], Rn),
                                                                       (got[names["S"]], Sn))):
            return {**{n: v for n, v in names.items() if n != "heads"}, "eta": eta}
    return ("the update is not R_t = lam R + beta k k^T, S_t = S - (S k - x)(eta R_t^-1 k)^T with eta 1 or "
            "a per-head input")


def match(ir) -> dict:
    """``_structure`` and ``_probe`` (once per IR); ValueError says why the family does not run it."""
    return probed_match(ir, "precision_rank1", _structure, _probe)


def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    if not ir.states or not ir.inverses:
        return f"{ir.spec_name}: no square state carried by its inverse"
    return match_reason(ir, match)


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """Refuse a key dimension past ``MAX_K``: at K = 128 the backward's float64 [K, K] tiles need
    291 KB of shared memory (sm_90, ptxas), more than an H100 or H200 SM has (228 KB)."""
    return key_size_reason(ir, sizes, MAX_K)


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    return supports_sizes(ir, key_sizes(ir, inputs), mode)


def _run(names, get, initial_state, output_final_state, io, cu_seqlens=None):
    """The family on tensors ``get(name)`` in the API layout; states in the IR's order (``names["order"]``)."""
    k = get(names["k"])
    if initial_state is not None:
        st = dict(zip(names["order"], initial_state))
        R0, S0 = st[names["R"]], st[names["S"]].to(torch.float32)
    else:           # R starts at r0 I (``init: {identity: r0}``), S at zero
        R0, S0 = names["r0"] * torch.eye(k.shape[-1], device=k.device, dtype=torch.float64), None
    y, fin = precision_rank1(k.to(io), get(names["x"]).to(io), get(names["q"]).to(io),
                             get(names["lam"]), beta=None if names["beta"] is None else get(names["beta"]),
                             eta=None if names["eta"] is None else get(names["eta"]),
                             initial_state=(R0, S0), output_final_state=output_final_state, chunk_size=CHUNK,
                             cu_seqlens=cu_seqlens)
    if fin is None:
        return y, None
    out = {names["R"]: fin[0], names["S"]: fin[1]}
    return y, tuple(out[x] for x in names["order"])


def forward(obj, lay, co, output_final_state):
    """Run the family on a reference layout: (y [B, T, H, d] in lay.dtype, (states) fp32 or None)."""
    names = dict(match(obj.ir), order=obj.ir.states)
    io = io_dtype(lay.out_dtype)
    B, T, H = lay.B, lay.T, lay.H

    def get(n):
        t = lay.env[n]
        return t.reshape(B, T, H) if not obj.ir.inputs[n] else t.reshape(B, T, H, -1)
    y, S = _run(names, get, lay.S0, output_final_state, io)
    return y.to(lay.dtype), S


def prepare(obj, lay):
    """The runner for one call signature: the caller's inputs go to the kernels as they are; a packed
    call (``cu_seqlens=``) runs as the module docstring says."""
    names = dict(match(obj.ir), order=obj.ir.states)
    io = io_dtype(lay.out_dtype)
    out_dtype = lay.out_dtype

    def run(inputs, params, initial_state, output_final_state, cu_seqlens=None):
        get = lambda n: inputs[n] if inputs[n].dtype in IO_DTYPES else inputs[n].float()    # noqa: E731
        y, S = _run(names, get, initial_state, output_final_state, io, cu_seqlens)
        return y.to(out_dtype), S
    return run

