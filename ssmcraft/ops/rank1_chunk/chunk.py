"""Chunked identity-minus-rank-1 recurrences with a per-head step (DeltaNet, Gated DeltaNet).

The family (``rank1`` IR, per-head step ``c`` and per-head decay ``a``):

    S_t = a_t S_{t-1} - c_t (S_{t-1} u_t) v_t^T + p_t q_t^T        S [d, m] = "V x K"
    y_t = S_t oq_t

Kernels keep the transpose ``H = S^T`` ([K, V], FLA's layout):

    H_t = a_t H_{t-1} - c_t v_t (u_t^T H_{t-1}) + q_t p_t^T,        o_t = H_t^T oq_t

DeltaNet: u = v = q = k, c = beta, p = beta x, a = 1.  Gated DeltaNet: a = alpha, c = alpha beta.
An optional per-head scale ``ps`` of p is fused (p = ps x), so DeltaNet's beta x costs no pass;
``C_MODE`` reads c as its own tensor, as ps itself (DeltaNet: one gradient, summed in the kernel)
or as a ps (Gated DeltaNet: formed in the kernels), so neither runs a PyTorch op around the kernels.

Algorithm (WY / UT transform, per chunk of BT tokens, local index t, state H0 at the chunk's
start; g_t = sum_{r<=t} log a_r within the chunk, gp_t = g_{t-1}, Gamma[t,s] = e^{g_t-g_s}):

    A  = strict_lower( c_t (u_t . v_s) e^{gp_t - g_s} )     [BT, BT]
    M  = (I + A)^{-1}          unit lower triangular; three levels of block forward substitution
                               (4, 16, 64) written as tensor-core products (``ops.common.solvers``)
    W  = M diag(c e^{gp}) U                                  [BT, K]
    Up = M P                 if q == v (merged: the insert and erase keys coincide)
       = -M B P              otherwise, B = strict_lower( c_t (u_t . q_s) e^{gp_t - g_s} )
    Psi = Up - W H0                                          [BT, V]  ("v_new" in FLA)
    O   = diag(e^g) OQ H0 + L Psi (+ Lq P)                   L = tril(OQ V^T o Gamma), Lq with Q
    H_C = e^{g_last} H0 + Vbar^T Psi (+ Qbar^T P)            Vbar = diag(e^{g_last - g}) V

Kernels, top to bottom: ``rank1_chunk_prep_kernel`` (parallel over chunks: A, M, W, Up, L), the
sequential ``rank1_chunk_fwd_state_kernel`` (state across chunks, outputs, and for training the chunk
states and Psi), ``rank1_chunk_bwd_state_kernel`` (reverse recurrence of dH, dPsi) and ``rank1_chunk_bwd_grad_kernel``
(parallel over chunks: every input's gradient, the WY backward, the decay's gradient through
the reverse cumulative sum of d g; with a decay, in the chunks holding one below e^-3, also what
only the WY backward has of its decay factors' coefficients, in fp32 buffers of [BT] per row) and
``rank1_chunk_bwd_da_kernel`` (in those chunks only, d a rewritten term by term from them, the
readout's products taken again over value blocks). Nothing of size [B, T, K, V]
is stored: the forward of a training step keeps the chunk states [B, H, NT, K, V] (T / BT times smaller) and Psi, so the
backward does not rerun the sequential forward (FLA recomputes both).

Backward, per chunk with dO and dH_C (gradient at the chunk's end):
    dPsi = L^T dO + Vbar dH_C,   dH0 = e^{g_last} dH_C + (e^g OQ)^T dO - W^T dPsi
    dW = -dPsi H0^T,  dP = M^T dPsi (merged),  dM = dPsi P^T + dW (diag(c e^{gp}) U)^T,
    dA = -M^T dM M^T (strict lower), then u, v, c, g through A's and W's entries, and
    d log a_r = sum_{t>=r} dg_t + sum_{t>r} dgp_t.

Shapes (kernel level, FLA layout): v, u, q, oq [B, T, H, K]; p [B, T, H, V]; c, a [B, T, H];
initial_state / final state [B, H, K, V] (fp32); output [B, T, H, V]. I/O in float32,
bfloat16 or float16; the state and every reduction in float32. Takes a >= 0: log a is floored at -80
(``common.tiles.log_decay``: log 0 = -inf made every within-chunk sum NaN), and in a chunk holding a
decay below e^-3 the decay's gradient is taken term by term, each factor's coefficient times the
product of the other decays in its span (``tiles.pair_decay_grad``), not as d log a / a, which has
lost its digits there and is NaN at a = 0.
Measured figures: BENCHMARKS.md, "Rank-1 per head (chunked)".
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.chunked import (_key_block, _value_block, _per_head, _split_p, key_size_reason, key_sizes,
                                         rank1_chunk_reason)
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.readout import finish_laid_out
from ssmcraft.ops.common.rows import packed_args, packed_chunks, sequences
from ssmcraft.ops.common.tuning import INTERPRET, IO_DTYPES, buffer, cdiv, dot_precision, io_dtype
from ssmcraft.ops.rank1_chunk.kernels import (C_GIVEN, C_IS_A_PS, C_IS_PS, rank1_chunk_bwd_da_kernel,
                                              rank1_chunk_bwd_grad_kernel, rank1_chunk_bwd_state_kernel,
                                              rank1_chunk_fwd_state_kernel, rank1_chunk_prep_kernel)

INTERPRET_BV: int | None = None     # value-block size under the interpreter (tests set it small)
POISON = False                      # tests: fill every buffer with NaN before the kernels write it
CHUNK = 64                          # chunk size used by ``forward``
# the largest key dimension: with a key block of 256 the kernels outgrow sm_90's shared memory per block
# in bf16 too, whose value block cannot go below 64 (``chunked._block_floor``): DeltaNet's gradient
# kernel needs 278528 bytes of 232448 (``benchmarks/compile_sm90.py --shape 1,67,1,256,256``)
MAX_K = 128
BACKEND_NAME = "rank1-chunk"
# benchmarks: False skips the exact decay gradient (the coefficients' stores in the chunks holding a tiny
# decay and ``rank1_chunk_bwd_da_kernel``: their cost; wrong gradients where a decay is tiny)
EXACT_DECAY_GRAD = True


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------

def _bv(V: int, dtype, K: int) -> int:
    """Value block of the parallel kernels (and of the sequential ones under the interpreter)."""
    return _value_block(V, dtype, INTERPRET_BV, K)


def _launch_opts(V: int, dtype, K: int) -> dict:
    """Config chosen by rule under the interpreter (multi-config autotune fails there)."""
    return {"BV": _bv(V, dtype, K)} if INTERPRET else {}


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _empty_like(t):
    return _empty(*t.shape, device=t.device, dtype=t.dtype)


def _c_mode(c, a, ps) -> int:
    """``C_MODE`` of a call: c None means c = a ps (both given), c that is ps the same tensor."""
    if c is None:
        if a is None or ps is None:
            raise ValueError("chunk_rank1: c = None stands for c = a * ps and needs both a and ps")
        return C_IS_A_PS.value
    return C_IS_PS.value if ps is c else C_GIVEN.value


def _operands(v, u, q, ps, c, a):
    """``(u, q, ps, c, a)`` as the kernels take them: the tensor, or a stand-in for a pointer the
    constexprs leave unread (u or q that is v; ps, a, or c where ``C_IS_A_PS`` forms it)."""
    cc = a if c is None else c
    return (v if u is None else u, v if q is None else q, cc if ps is None else ps, cc,
            cc if a is None else a)


def _fwd(v, u, q, p, ps, oq, c, a, h0, output_final_state, store_states, c_mode, BT, R, packed=None):
    """R: terms per token (``ssmcraft.ops.rankr_chunk``): v, u, p, c, ps hold ``T * R`` term rows,
    oq and a ``T`` token rows (``kernels``' docstring); 1 for the rank-1 family. ``packed``: the
    ``Chunks`` (of ``BT / R`` tokens) of a packed row (B = 1, N sequences, states ``[N, H, K, V]``),
    else None (N = B)."""
    B, TR, H, K = v.shape
    T = oq.shape[1]
    V = p.shape[-1]
    dt = p.dtype
    dev = p.device
    N, NT, seq = sequences(B, T, BT // R, packed, v)
    BK = _key_block(K, dt)
    general = q is not None
    has_a = a is not None
    has_ps = ps is not None
    uu, qq, pss, cc, aa = _operands(v, u, q, ps, c, a)
    prec = dot_precision(dt)
    M = _empty(B, TR, H, BT, device=dev, dtype=dt)
    L = _empty(B, T, H, BT, device=dev, dtype=dt)
    Lq = _empty(B, T, H, BT, device=dev, dtype=dt) if general else L
    W = _empty(B, TR, H, K, device=dev, dtype=dt)
    Up = _empty(B, TR, H, V, device=dev, dtype=dt)
    g = _empty(B, T, H, device=dev, dtype=torch.float32) if has_a else cc
    launch(rank1_chunk_prep_kernel, (NT, B * H),
           u=uu, v=v, q=qq, p=p, ps=pss, oq=oq, c=cc, a=aa, M=M, W=W, Up=Up, L=L, Lq=Lq, g=g, T=T, H=H, K=K, V=V,
           BT=BT, BK=BK, BV=_bv(V, dt, K), HAS_A=has_a, GENERAL=general, HAS_PS=has_ps, C_MODE=c_mode, PREC=prec, R=R,
           **packed_args(seq, "cu", "ci"))
    o = _empty(B, T, H, V, device=dev, dtype=dt)
    hs = _empty(B, H, NT, K, V, device=dev, dtype=dt) if store_states else o
    psi = _empty(B, TR, H, V, device=dev, dtype=dt) if store_states else o
    ht = _empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else o
    # no h0 or no final state: a flag, not a zero state filled and read or a state written unread
    launch(rank1_chunk_fwd_state_kernel, lambda meta: (cdiv(V, meta["BV"]), N * H),
           v=v, q=qq, p=p, ps=pss, oq=oq, W=W, Up=Up, L=L, Lq=Lq, g=g, h0=o if h0 is None else h0, o=o, hs=hs, psi=psi,
           ht=ht, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, HAS_A=has_a, GENERAL=general, HAS_PS=has_ps, WRITE_O=True,
           STORE_H=store_states, HAS_H0=h0 is not None, STORE_HT=output_final_state, PREC=prec, R=R,
           **packed_args(seq, "cu", "co"), **_launch_opts(V, dt, K))
    saved = (M, L, Lq, W, g, hs, psi)
    return o, (ht if output_final_state else None), saved


def _bwd(v, u, q, p, ps, oq, c, a, saved, do, dht, need_dh0, c_mode, BT, R, packed=None):
    B, TR, H, K = v.shape
    T = oq.shape[1]
    V = p.shape[-1]
    dt = p.dtype
    N, NT, seq = sequences(B, T, BT // R, packed, v)
    BK = _key_block(K, dt)
    general = q is not None
    has_a = a is not None
    M, L, Lq, W, g, hs, psi = saved
    prec = dot_precision(dt)
    do = do.contiguous().to(dt)
    dhs = _empty_like(hs)
    dpsi = _empty_like(psi)
    dh0 = _empty(N, H, K, V, device=v.device, dtype=torch.float32) if need_dh0 else dhs
    has_dht = dht is not None
    launch(rank1_chunk_bwd_state_kernel, lambda meta: (cdiv(V, meta["BV"]), N * H),
           v=v, oq=oq, W=W, L=L, g=g, do=do, dht=dht.contiguous().float() if has_dht else do, dhs=dhs, dpsi=dpsi,
           dh0=dh0, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, HAS_A=has_a, HAS_DHT=has_dht, STORE_DH0=need_dh0,
           PREC=prec, R=R, **packed_args(seq, "cu", "co"), **_launch_opts(V, dt, K))
    uu, qq, pss, cc, aa = _operands(v, u, q, ps, c, a)
    dv = _empty_like(v)
    du = _empty_like(v) if u is not None else dv
    dq = _empty_like(v) if general else dv
    dp = _empty_like(p)
    doq = _empty_like(oq)
    has_ps = ps is not None
    want_dps = has_ps and c_mode != C_IS_PS.value      # c is ps: its one gradient is dc
    da = _empty_like(a) if has_a else None
    dc = _empty_like(c) if c is not None else da       # c = a ps: no dc (never written)
    dps = _empty_like(ps) if want_dps else dc
    exact = has_a and EXACT_DECAY_GRAD
    # what the exact decay gradient takes from the WY backward, written in the chunks holding a tiny decay
    f32 = dict(device=v.device, dtype=torch.float32)
    xp, xw = (_empty(B, TR, H, BT, **f32), _empty(B, TR, H, 3, **f32)) if exact else (dv, dv)
    xb, xq = (_empty(B, TR, H, BT, **f32), _empty(B, T, H, BT, **f32)) if exact and general else (dv, dv)
    args = dict(u=uu, v=v, q=qq, p=p, ps=pss, oq=oq, c=cc, a=aa, g=g, M=M, L=L, Lq=Lq, hs=hs, dhs=dhs, psi=psi,
                dpsi=dpsi, do=do, du=du, dv=dv, dq=dq, dp=dp, dps=dps, doq=doq, dc=dc, da=da if has_a else dc, xp=xp,
                xb=xb, xq=xq, xw=xw, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=_bv(V, dt, K), HAS_A=has_a,
                GENERAL=general, U_IS_V=u is None, HAS_PS=has_ps, C_MODE=c_mode, PREC=prec, R=R, EXACT=exact,
                **packed_args(seq, "cu", "ci"))
    launch(rank1_chunk_bwd_grad_kernel, (NT, B * H), **args)
    if exact:   # d a rewritten term by term in the chunks holding a tiny decay
        launch(rank1_chunk_bwd_da_kernel, (NT, B * H), u=uu, v=v, q=qq, oq=oq, a=a, g=g, hs=hs, dhs=dhs, psi=psi,
               do=do, xp=xp, xb=xb, xq=xq, xw=xw, da=da, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=_bv(V, dt, K),
               GENERAL=general, U_IS_V=u is None, C_MODE=c_mode, PREC=prec, R=R, **packed_args(seq, "cu", "ci"))
    return (dv, du if u is not None else None, dq if general else None, dp, dps if want_dps else None, doq,
            dc if c is not None else None, da, dh0 if need_dh0 else None)


# ----------------------------------------------------------------------------------------
# autograd Function
# ----------------------------------------------------------------------------------------

class Rank1ChunkFunction(torch.autograd.Function):
    """(v, u|None, q|None, p, ps|None, oq, c|None, a|None, h0|None) -> (o, ht|None);
    u/q None mean "= v", ps None means 1, c per ``c_mode`` (``_c_mode``); ``group``: terms per
    token R (v, u, p, c, ps in ``T * R`` term rows; ``ssmcraft.ops.rankr_chunk``), 1 for rank-1;
    ``packed``: the ``Chunks`` of a packed row (``_fwd``) or None."""

    @staticmethod
    def forward(ctx, v, u, q, p, ps, oq, c, a, h0, c_mode, output_final_state, chunk_size, group, packed=None):
        train = any(ctx.needs_input_grad[:9])
        ctx.c_mode = c_mode
        ctx.group = group
        ctx.set_materialize_grads(False)     # an unused output's gradient stays None: no zero tensor read
        ctx.packed = packed
        o, ht, saved = _fwd(v, u, q, p, ps, oq, c, a, h0, output_final_state, train, c_mode, chunk_size, group, packed)
        if train:
            ctx.save_for_backward(v, u, q, p, ps, oq, c, a, *saved)
        ctx.chunk_size = chunk_size
        ctx.need_dh0 = h0 is not None and ctx.needs_input_grad[8]
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        v, u, q, p, ps, oq, c, a, *saved = ctx.saved_tensors
        if do is None:
            do = p.new_zeros(*oq.shape[:3], p.shape[-1])
        grads = _bwd(v, u, q, p, ps, oq, c, a, saved, do, dht, ctx.need_dh0, ctx.c_mode, ctx.chunk_size, ctx.group,
                     ctx.packed)
        return (*grads, None, None, None, None, None)


# ----------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------


def as_operand(t, shape, dtype):
    """``t`` as a contiguous ``shape`` tensor in ``dtype`` (None stays None). No op, and no autograd
    node, where it already is one."""
    if t is None:
        return None
    if t.shape != shape:
        t = t.expand(*shape)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def chunk_rank1(v, p, c, oq, *, u=None, q=None, a=None, ps=None, initial_state=None,
                output_final_state: bool = False, chunk_size: int = 64, cu_seqlens=None):
    """H_t = a_t H_{t-1} - c_t v_t (u_t^T H_{t-1}) + q_t (ps_t p_t)^T;  o_t = H_t^T oq_t.

    Args:
        v:  erase key [B, T, H, K] (also u and q where those are None).
        p:  inserted value [B, T, H, V].
        ps: per-head scale of p [B, T, H] or None (= 1); fused, so that e.g. DeltaNet's
            beta x costs no extra pass.
        c:  per-head step [B, T, H], or None for c = a ps (Gated DeltaNet's alpha beta: the
            product is taken in the kernels and its gradient goes to a and ps). c, a and ps are
            read in their own dtype (fp32, bf16 or fp16) and their gradients written in it; c
            that is ps, one tensor (DeltaNet's beta), is read once and gets one gradient.
        oq: readout key [B, T, H, K].
        u:  read key of the erase [B, T, H, K] or None (= v).
        q:  insert key [B, T, H, K] or None (= v: the merged delta-rule form).
        a:  per-head decay [B, T, H], > 0, or None (= 1).
        initial_state: [B, H, K, V] (any float dtype; kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: 16, 32 or 64.
        cu_seqlens: int32/int64 offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, checked by ``ssmcraft.ops.common.varlen.offsets``); initial and final states
            are then [N, H, K, V], every sequence starts from its own, and no chunk straddles two
            sequences: the result equals N separate calls.
    Returns:
        o [B, T, H, V] in p's dtype, final state [B, H, K, V] ([N, H, K, V] packed) fp32 or None.
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    dt = p.dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"chunk_rank1: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    B, T, H, K = v.shape
    V = p.shape[-1]
    c_mode = _c_mode(c, a, ps)      # refused at every length; ``hc`` below is ``hps`` exactly when c is ps
    packed = packed_chunks("chunk_rank1", cu_seqlens, v, initial_state, chunk_size)
    if T == 0:
        N = B if packed is None else packed.N
        o = p.new_zeros(B, 0, H, V)
        S = initial_state.float() if initial_state is not None else p.new_zeros(N, H, K, V, dtype=torch.float32)
        return o, (S if output_final_state else None)

    prep = (lambda t, shape, dtype=dt: as_operand(t, shape, dtype))
    kshape, hshape = (B, T, H, K), (B, T, H)
    head = (lambda t: None if t is None else prep(t, hshape, io_dtype(t.dtype)))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    hps = head(ps)
    hc = hps if c is ps else head(c)      # one tensor stays one (C_IS_PS) whatever prep does to it
    o, ht = Rank1ChunkFunction.apply(prep(v, kshape), prep(u, kshape), prep(q, kshape), prep(p, (B, T, H, V)),
                                     hps, prep(oq, kshape), hc, head(a), h0,
                                     c_mode, output_final_state, chunk_size, 1, packed)
    return o, ht


def delta_rule(q, k, x, beta, alpha=None, *, initial_state=None, output_final_state: bool = False,
               chunk_size: int = 64, cu_seqlens=None):
    """(Gated) DeltaNet in FLA's convention: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t x_t^T
    (state [K, V]), o_t = S_t^T q_t.  q, k [B, T, H, K]; x [B, T, H, V]; beta, alpha [B, T, H];
    initial_state [B, H, K, V] ([N, H, K, V] with ``cu_seqlens``, as ``chunk_rank1``).
    Returns o [B, T, H, V], final state [B, H, K, V] fp32 or None."""
    return chunk_rank1(k, x, beta if alpha is None else None, q, a=alpha, ps=beta, initial_state=initial_state,
                       output_final_state=output_final_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not (a decay per head, or none)."""
    return rank1_chunk_reason(ir, (None, ()), "per head ()")


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """Refuse a key dimension past ``MAX_K`` (the kernels' shared memory)."""
    return key_size_reason(ir, sizes, MAX_K, "the kernels' tiles outgrow sm_90's shared memory")


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    return supports_sizes(ir, key_sizes(ir, inputs), mode)


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients (see ssmcraft.ops.common.reference.layout).

    co: slot -> tensor [B|1, T|1, H|1, r, c] or number. Returns (y [B, T, H, d] in lay.dtype,
    S_T [B, H, d, m] fp32 or None); autograd reaches every slot tensor and lay.S0.
    """
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    io = io_dtype(lay.out_dtype)
    dev = next(t for t in co.values() if isinstance(t, torch.Tensor)).device

    def key(x):
        return x.expand(B, T, H, 1, m).reshape(B, T, H, m)
    v = key(co["v"])
    u = None if co["u"] is co["v"] else key(co["u"])
    q = None if co["q"] is co["v"] else key(co["q"])
    oq = key(co["oq"])
    ps = None
    split = _split_p(obj.ir)
    if split is not None:           # p = s x with s per head, x a (d,) input: scale fused in the kernel
        ps, p = _per_head(lay.env[split[0]], B, T, H, dev), lay.env[split[1]]
    else:
        p = co["p"]
        p = p if isinstance(p, torch.Tensor) else torch.full((), float(p), device=dev)   # no host copy
    p = p.expand(B, T, H, d, 1).reshape(B, T, H, d)
    c = _per_head(co["c"], B, T, H, dev)
    a = _per_head(co.get("a", 1), B, T, H, dev, one_is_none=True)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    o, ht = chunk_rank1(v, p.to(io), c, oq, u=u, q=q, a=a, ps=ps, initial_state=h0,
                        output_final_state=output_final_state, chunk_size=CHUNK)
    S = None if ht is None else ht.transpose(-1, -2)
    return finish_laid_out(o.to(lay.dtype), co, B, T, H), S


def prepare(obj, lay):
    """The family's runner for one call signature (``lay``: sizes and dtypes, from
    ``reference.validate``): slots that are plain inputs go to the kernel as they are, in their own
    dtype (DeltaNet: no PyTorch op besides the kernels); others are computed (``slots.CallSlots``).
    Returns ``fn(inputs, params, initial_state, output_final_state) -> (y [B,T,H,d], S_T [B,H,d,m] | None)``."""
    from ssmcraft.ops.common.slots import bindings, slot_runner
    binds = bindings(obj.ir)
    B, T, H = lay.B, lay.T, lay.H
    out_dtype = lay.out_dtype
    io = io_dtype(out_dtype)
    same = {s: binds[s].kind == "leaf" and binds[s] == binds["v"] for s in ("u", "q")}
    c, a, pb = binds["c"], binds.get("a"), binds["p"]
    # Gated DeltaNet's c = alpha beta with alpha the decay and beta p's scale: taken in the kernels
    c_is_a_ps = (c.kind == "product" and a is not None and a.kind == "leaf" and pb.kind == "scaled"
                 and {c.leaf, c.scale} == {a.leaf, pb.scale})

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        v = cs.get("v")
        u = None if same["u"] else cs.get("u")
        q = None if same["q"] else cs.get("q")
        ps, p = cs.split("p")
        o, ht = chunk_rank1(v, p.to(io), None if c_is_a_ps else _per_head(cs.get("c"), B, T, H, cs.device),
                            cs.get("oq"), u=u, q=q, a=_per_head(cs.get("a", 1.0), B, T, H, cs.device, one_is_none=True),
                            ps=ps,
                            initial_state=None if initial_state is None else initial_state.transpose(-1, -2),
                            output_final_state=output_final_state, chunk_size=CHUNK, cu_seqlens=cu_seqlens)
        return cs.finish(o).to(out_dtype), (None if ht is None else ht.transpose(-1, -2))
    return slot_runner(obj, lay, run)
