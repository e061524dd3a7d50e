"""Chunked identity-minus-rank-1 recurrences with a decay per key channel and a per-head step
(a KDA-like layer), on tensor cores.

The family (``rank1`` IR, per-head step ``c``, decay ``a`` of dims ``(m,)``, insert key equal to
the erase key ``v``):

    S_t = S_{t-1} diag(a_t) - c_t (S_{t-1} u_t) v_t^T + p_t v_t^T        S [d, m] = "V x K"
    y_t = S_t oq_t

Kernels keep the transpose ``H = S^T`` ([K, V], FLA's layout):

    H_t = diag(a_t) H_{t-1} - c_t v_t (u_t^T H_{t-1}) + v_t p_t^T,     o_t = H_t^T oq_t

KDA (the composed ``diagonal_decay, regression, scalar step, decay_explicit``): u = a o k,
v = k, c = beta, p = beta x: H_t = (I - beta k k^T) diag(a_t) H_{t-1} + beta k x^T.

Algorithm (WY / UT transform, per chunk of BT tokens, local index t, state H0 at the chunk's
start; per key, g_t = sum_{r<=t} log a_r within the chunk, gp_t = g_{t-1}, gl = g at the last row):

    A  = strict_lower( c_t sum_k u_tk v_sk e^{gp_tk - g_sk} )           [BT, BT]
    M  = (I + A)^{-1}     (``ops.common.solvers``: block forward substitution on tensor cores)
    W  = M diag(c) (U o e^{gp}),   Up = M P
    Psi = Up - W H0                                                      [BT, V]
    O   = (OQ o e^g) H0 + L Psi,   L = lower( sum_k oq_tk v_sk e^{g_tk - g_sk} )
    H_C = diag(e^{gl}) H0 + (V o e^{gl - g})^T Psi

Stability. For 0 < a <= 1, g is non-increasing down the chunk, so every factor e^{gp_t - g_s}
and e^{g_t - g_s} with s <= t (s < t for A) has an exponent <= 0. A and L are never formed as
(x e^{g}) (y e^{-g})^T, whose second factor overflows: their sub-blocks of SUB = 16 rows
(``kernels.gated_lower``) take, for row block I and the columns before it, the reference
R_I = g at row SUB I - 1, ``(x e^{gx - R_I}) (y e^{R_I - g})^T`` (both exponents <= 0, a
tensor-core product), and the diagonal sub-blocks are summed column by column with the exact
exponent. With a leaf size below SUB (``LEAF_FWD``, ``LEAF_BWD``), each sub-block is halved down to
blocks of that many rows first: the second half against the first is a tensor-core product against g at the row between the halves
(both exponents <= 0 again), and only the LEAF x LEAF diagonal blocks are summed elementwise
(fewer exponentials and serial steps, a few more products). The backward's products against dA and dL (``gated_grads``) use the same references
(the row side) or g at the column block's last row (the column side); their diagonal sub-blocks
are summed ``DIAG_UNROLL`` in-block offsets per step, row and column side together.

Diagonal sub-blocks as products (``FAST_DIAG``). Where every |g - Rm| of a chunk program's rows and
keys stays within ``kernels.FAST_DIAG_SPAN`` (30; Rm = g at the middle row of each row's sub-block),
the diagonal sub-blocks are one tensor-core product each way, (x e^{gx - Rm}) (y e^{Rm - g})^T kept on
s < t (A) or s <= t (L), and likewise in the backward: factors up to e^30 each, so nothing overflows
(the upper entries discarded included) and each kept term carries the rounding of the off-diagonal
products. That holds whenever every decay of the chunk is above e^{-60 / SUB} (SUB / 2 steps from
the middle row: e^-3.75 at SUB = 16); a program holding a stronger one takes the halvings and
elementwise sums above (in the backward without halvings, one offset per step: fewer registers where
the products run).

Exponents are differences of chunk-long cumulative sums: a factor's relative error is about the fp32 ulp
of |g| (3e-5 at |g| ~ 300), far below the bf16 I/O's.

Backward, per chunk with dO and dH_C (gradient at the chunk's end):
    dPsi = L^T dO + (V o e^{gl - g}) dH_C,  dH0 = e^{gl} o dH_C + (OQ o e^g)^T dO - W^T dPsi
    dW = -dPsi H0^T,  dP = M^T dPsi,  dM = dPsi P^T + dW (diag(c) U e^{gp})^T,
    dA = -M^T dM M^T (strict lower), then u, v, c and g through A's, L's and W's entries, and
    d log a_r = sum_{t>=r} dg_t + sum_{t>r} dgp_t + dgl.

Operands formed in the kernels: u = a o v (KDA: the erase reads the decayed state) is read as
u e^{gp} = v e^{g}, so no u tensor exists and A shares L's exponentials; p = ps x with a per-head
ps (KDA's beta x) is scaled where it is read. The decay's gradient is formed as d log a, then
divided by a, except in a chunk holding a decay below e^-3, where d a is taken term by term, per key
(``common.tiles.key_decay_grad``: each factor's coefficient times the other decays in its span), so
that it stays exact at tiny decays and at a = 0, where d log a / a is not (log a is floored at -80,
``tiles.log_decay``). Elsewhere the absolute error of d log a / a is that of d log a over a, while any
parametrisation of a in (0, 1) (sigmoid, exp) multiplies it back by a factor of order a.

Kernels: ``rank1_keydecay_chunk_prep_kernel`` (parallel over chunks: g, A, M, W, Up, L), the
sequential ``rank1_keydecay_chunk_fwd_state_kernel`` (states across chunks, outputs; for
training the chunk states and Psi), ``rank1_keydecay_chunk_bwd_state_kernel`` (reverse
recurrence of dH, dPsi), then, parallel over chunks, ``rank1_keydecay_chunk_bwd_wy_kernel``
(the gradients through M, W and Up: dp, dc, du, a share of dv and d log a) and
``rank1_keydecay_chunk_bwd_out_kernel`` (through O and H_C: doq, the rest of dv and da); two
kernels keep fewer tiles live in each (the shares pass through fp32 buffers the size of v). Last,
``rank1_keydecay_chunk_bwd_da_kernel`` (per key block and chunk) rewrites da in the chunks holding a
decay below e^-3, from dA and dL (the two kernels' [BT]-per-row fp32 buffers) and the chunk states
and their gradients. Nothing of size [B, T, K, V] is stored.

Shapes (kernel level, FLA layout): v, u, oq, a [B, T, H, K]; p [B, T, H, V]; c [B, T, H];
initial_state / final state [B, H, K, V] (fp32); output [B, T, H, V]. I/O in float32,
bfloat16 or float16; the state, g and every reduction in float32. Takes a >= 0 (a <= 1 for
the stability above).

Packed rows (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): B = 1 and N sequences laid end to end;
the parallel kernels run one program per chunk of a sequence (``rows.seq_chunk``: no
chunk straddles two sequences, so g, A and L restart at each sequence's start), the state kernels
one per (sequence, head) over that sequence's chunks (``rows.seq_state``), from its own initial state
to its own final state ``[N, H, K, V]``. Chunk states are ``[B, H, NT, K, V]`` (NT: every sequence's
chunks together in a packed row).
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.chunked import _key_block, _value_block, _per_head, _split_p, key_size_reason, key_sizes, rank1_chunk_reason
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import INTERPRET, IO_DTYPES, buffer, cdiv, dot_precision, io_dtype
from ssmcraft.ops.common.readout import finish_laid_out
from ssmcraft.ops.common.rows import packed_args, packed_chunks, sequences
from ssmcraft.ops.rank1_keydecay_chunk.kernels import (U_GIVEN, U_IS_AV, rank1_keydecay_chunk_bwd_da_kernel,
                                                       rank1_keydecay_chunk_bwd_out_kernel,
                                                       rank1_keydecay_chunk_bwd_state_kernel,
                                                       rank1_keydecay_chunk_bwd_wy_kernel,
                                                       rank1_keydecay_chunk_fwd_state_kernel,
                                                       rank1_keydecay_chunk_prep_kernel)

INTERPRET_BV: int | None = None     # value-block size under the interpreter (tests set it small)
POISON = False                      # tests: fill every buffer with NaN before the kernels write it
# chunk size used by ``forward`` / ``prepare`` (tests set 16 / 32). With FAST_DIAG, 32 halves the
# masked [CHUNK, CHUNK] work of the three parallel kernels for twice the sequential state steps (H200,
# bf16, B=8 T=2048 H=16 d=m=64, fwd+bwd through obj(), one process: chunk 64 elementwise 2.911 ms,
# chunk 64 products 2.182, chunk 32 products 1.599; ``bench_kda.py --leaf 16/4/64/16/0,16/4/64/16/1,16/4/32/16/1``)
CHUNK = 32
SUB = 16                            # sub-block of the intra-chunk matrices
# rows of the diagonal blocks summed elementwise (SUB halved down to it), in the forward's prep and in
# the backward: halving cuts the backward's instructions (its limit) and lengthens the prep's chain
# (H200, bf16, B=8 T=2048 H=16 d=m=64: both at 16 fwd 0.83 / fwd+bwd 3.50 ms, both at 4 1.23 / 3.11)
LEAF_FWD = 16
LEAF_BWD = 4
# benchmarks: False skips ``rank1_keydecay_chunk_bwd_da_kernel``, the exact decay gradient in the chunks
# holding a tiny decay (its cost where none is; wrong gradients where one is)
EXACT_DECAY_GRAD = True
DIAG_UNROLL = 4                     # in-block offsets per step of the backward's diagonal block sums
# the diagonal sub-blocks as one tensor-core product per program where the decays allow it
# (``kernels.FAST_DIAG_SPAN``), in the forward's prep and in the backward; False: always the halvings
# and elementwise sums of LEAF_FWD / LEAF_BWD (timings at CHUNK). With it on, LEAF_BWD is unused:
# the backward's programs that turn the products away sum leaves of SUB rows
FAST_DIAG = True
MAX_K = 128                         # whole key rows live in registers in the parallel kernels
BACKEND_NAME = "rank1-keydecay-chunk"
AV = "av"                           # ``u=AV``: the erase's read key is u = a o v, formed in the kernels


def _bv(V: int, dtype) -> int:
    """Value block of the parallel kernels (and of the sequential ones under the interpreter)."""
    return _value_block(V, dtype, INTERPRET_BV)


def _diag(BT: int, backward: bool) -> dict:
    """The sub-block constexprs of the parallel kernels: SUB, the halvings inside a sub-block
    (LEVELS, down to blocks of ``LEAF_FWD`` or ``LEAF_BWD`` rows), FAST (``FAST_DIAG``) and, in the
    backward, UNROLL."""
    sub = min(SUB, BT)
    leaf = min(LEAF_BWD if backward else LEAF_FWD, sub)
    opts = {"SUB": sub, "LEVELS": (sub // leaf).bit_length() - 1, "FAST": FAST_DIAG}
    return {**opts, "UNROLL": min(DIAG_UNROLL, leaf)} if backward else opts


def _launch_opts(V: int, dtype) -> dict:
    """Config chosen by rule under the interpreter (multi-config autotune fails there)."""
    return {"BV": _bv(V, dtype)} if INTERPRET else {}


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _empty_like(t):
    return _empty(*t.shape, device=t.device, dtype=t.dtype)


def _u_mode(u) -> int:
    """``U_MODE`` of a call: u None stands for u = a o v (``chunk_rank1_keydecay``)."""
    return U_IS_AV.value if u is None else U_GIVEN.value


def _fwd(v, u, p, ps, oq, c, a, h0, output_final_state, store_states, BT, packed=None):
    """``packed``: the ``Chunks`` of a packed row (B = 1, N sequences), else None (N = B)."""
    B, T, H, K = v.shape
    V = p.shape[-1]
    dt, dev = p.dtype, p.device
    N, NT, seq = sequences(B, T, BT, packed, v)
    BK = _key_block(K, dt)
    prec = dot_precision(dt)
    g = _empty(B, T, H, K, device=dev, dtype=torch.float32)
    M = _empty(B, T, H, BT, device=dev, dtype=dt)
    L = _empty(B, T, H, BT, device=dev, dtype=dt)
    W = _empty(B, T, H, K, device=dev, dtype=dt)
    Up = _empty(B, T, H, V, device=dev, dtype=dt)
    launch(rank1_keydecay_chunk_prep_kernel, (NT, B * H), u=v if u is None else u, v=v, p=p, ps=c if ps is None else ps, oq=oq, c=c, a=a, g=g, M=M, W=W, Up=Up,
           L=L, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=_bv(V, dt), U_MODE=_u_mode(u), HAS_PS=ps is not None,
           **_diag(BT, False), PREC=prec, **packed_args(seq, "cu", "ci"))
    o = _empty(B, T, H, V, device=dev, dtype=dt)
    hs = _empty(B, H, NT, K, V, device=dev, dtype=dt) if store_states else o
    psi = _empty(B, T, H, V, device=dev, dtype=dt) if store_states else o
    ht = _empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else o
    # no h0 or no final state: a flag, not a zero state filled and read or a state written unread
    launch(rank1_keydecay_chunk_fwd_state_kernel, lambda meta: (cdiv(V, meta["BV"]), N * H),
           v=v, oq=oq, W=W, Up=Up, L=L, g=g, h0=o if h0 is None else h0, o=o, hs=hs, psi=psi, ht=ht,
           T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, STORE_H=store_states, HAS_H0=h0 is not None,
           STORE_HT=output_final_state, PREC=prec, **packed_args(seq, "cu", "co"), **_launch_opts(V, dt))
    return o, (ht if output_final_state else None), (g, M, L, W, hs, psi)


def _bwd(v, u, p, ps, oq, c, a, saved, do, dht, need_dh0, BT, packed=None):
    B, T, H, K = v.shape
    V = p.shape[-1]
    dt = p.dtype
    N, NT, seq = sequences(B, T, BT, packed, v)
    BK = _key_block(K, dt)
    prec = dot_precision(dt)
    g, M, L, W, hs, psi = saved
    do = do.contiguous().to(dt)
    dhs = _empty_like(hs)
    dpsi = _empty_like(psi)
    dh0 = _empty(N, H, K, V, device=v.device, dtype=torch.float32) if need_dh0 else dhs
    has_dht = dht is not None
    launch(rank1_keydecay_chunk_bwd_state_kernel, lambda meta: (cdiv(V, meta["BV"]), N * H),
           v=v, oq=oq, W=W, L=L, g=g, do=do, dht=dht.contiguous().float() if has_dht else do, dhs=dhs,
           dpsi=dpsi, dh0=dh0, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, HAS_DHT=has_dht, STORE_DH0=need_dh0,
           PREC=prec, **packed_args(seq, "cu", "co"), **_launch_opts(V, dt))
    dv, dp, doq, dc, da = (_empty_like(t) for t in (v, p, oq, c, a))
    du = dv if u is None else _empty_like(u)       # u = a o v: its gradient is folded into dv and da
    dps = dc if ps is None else _empty_like(ps)
    Ds = _empty(B, T, H, BT, device=v.device, dtype=torch.float32)       # dA, then dL, per chunk row
    dvs = _empty(B, T, H, K, device=v.device, dtype=torch.float32)       # the WY half's dv and d log a
    dlas = _empty(B, T, H, K, device=v.device, dtype=torch.float32)
    uu, pss = (v if u is None else u), (c if ps is None else ps)
    # the exact decay gradient reads dA and dL both: dL in a buffer of its own
    Dl = _empty_like(Ds) if EXACT_DECAY_GRAD else Ds
    launch(rank1_keydecay_chunk_bwd_wy_kernel, (NT, B * H),
           u=uu, v=v, p=p, ps=pss, c=c, a=a, g=g, M=M, hs=hs, dpsi=dpsi, Ds=Ds, du=du, dp=dp, dps=dps, dc=dc,
           dvs=dvs, dlas=dlas, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=_bv(V, dt), U_MODE=_u_mode(u),
           HAS_PS=ps is not None, PREC=prec, **_diag(BT, True), **packed_args(seq, "cu", "ci"))
    launch(rank1_keydecay_chunk_bwd_out_kernel, (NT, B * H),
           v=v, oq=oq, a=a, g=g, hs=hs, dhs=dhs, psi=psi, do=do, Ds=Dl, dvs=dvs, dlas=dlas, dv=dv, doq=doq, da=da,
           T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=_bv(V, dt), PREC=prec, **_diag(BT, True),
           **packed_args(seq, "cu", "ci"))
    if EXACT_DECAY_GRAD:    # d a rewritten term by term in the chunks holding a tiny decay
        launch(rank1_keydecay_chunk_bwd_da_kernel, lambda meta: (cdiv(K, meta["BK"]), NT, B * H),
               da=da, a=a, u=uu, v=v, c=c, oq=oq, M=M, hs=hs, dhs=dhs, psi=psi, dpsi=dpsi, do=do, Ds=Ds, Dl=Dl, T=T,
               NT=NT, H=H, K=K, V=V, BT=BT, BV=_bv(V, dt), U_MODE=_u_mode(u), PREC=prec,
               **packed_args(seq, "cu", "ci"), **({"BK": BK} if INTERPRET else {}))
    return dv, (None if u is None else du), dp, (None if ps is None else dps), doq, dc, da, (dh0 if need_dh0 else None)


class Rank1KeyDecayChunkFunction(torch.autograd.Function):
    """(v, u|None, p, ps|None, oq, c, a, h0|None) -> (o, ht|None); u None means u = a o v, ps None
    means 1. ps that is c (KDA's beta) is one autograd input passed twice: its two gradients sum."""

    @staticmethod
    def forward(ctx, v, u, p, ps, oq, c, a, h0, output_final_state, chunk_size, packed=None):
        train = any(ctx.needs_input_grad[:8])
        ctx.set_materialize_grads(False)     # an unused output's gradient stays None: no zero tensor read
        o, ht, saved = _fwd(v, u, p, ps, oq, c, a, h0, output_final_state, train, chunk_size, packed)
        if train:
            ctx.save_for_backward(v, u, p, ps, oq, c, a, *saved)
        ctx.chunk_size, ctx.packed = chunk_size, packed
        ctx.need_dh0 = h0 is not None and ctx.needs_input_grad[7]
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        v, u, p, ps, oq, c, a, *saved = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(p)
        return (*_bwd(v, u, p, ps, oq, c, a, saved, do, dht, ctx.need_dh0, ctx.chunk_size, ctx.packed), None, None, None)


def chunk_rank1_keydecay(v, p, c, oq, a, *, u=AV, ps=None, initial_state=None, output_final_state: bool = False,
                         chunk_size: int = 64, cu_seqlens=None):
    """H_t = diag(a_t) H_{t-1} - c_t v_t (u_t^T H_{t-1}) + v_t p_t^T;  o_t = H_t^T oq_t.

    KDA in FLA's convention: ``chunk_rank1_keydecay(k, x, beta, q, alpha, ps=beta)``:
    H_t = (I - beta k k^T) diag(alpha) H_{t-1} + beta k x^T.

    Args:
        v:  erase and insert key [B, T, H, K].
        p:  inserted value [B, T, H, V] (times ps where ps is given).
        ps: per-head scale of p [B, T, H] or None (= 1); taken in the kernels (KDA's beta x).
        c:  per-head step [B, T, H].
        oq: readout key [B, T, H, K].
        a:  per-key decay [B, T, H, K], in (0, 1] (the kernels take its log).
        u:  read key of the erase [B, T, H, K]; None means u = v; ``AV`` (the default) means
            u = a o v (KDA's order: decay, then erase), taken in the kernels.
        initial_state: [B, H, K, V] (any float dtype; kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: 16, 32 or 64.
        cu_seqlens: int32/int64 offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, checked by ``ssmcraft.ops.common.varlen.offsets``); initial and final states
            are then [N, H, K, V], and no chunk straddles two sequences.
    Every tensor is read in p's dtype (fp32, bf16 or fp16) and its gradient returned in it.
    Returns:
        o [B, T, H, V] in p's dtype, final state [B, H, K, V] fp32 or None.
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    dt = p.dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"chunk_rank1_keydecay: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    B, T, H, K = v.shape
    V = p.shape[-1]
    if K > MAX_K:
        raise ValueError(f"chunk_rank1_keydecay: K = {K} > {MAX_K} (whole key rows are held in registers)")
    packed = packed_chunks("chunk_rank1_keydecay", cu_seqlens, v, initial_state, chunk_size, "v")
    N = B if packed is None else packed.N
    if T == 0:
        S = initial_state.float() if initial_state is not None else p.new_zeros(N, H, K, V, dtype=torch.float32)
        return p.new_zeros(B, 0, H, V), (S if output_final_state else None)

    def prep(t, shape):
        """``t`` as a contiguous ``shape`` tensor in the I/O dtype (no op where it already is one)."""
        if t.shape != shape:
            t = t.expand(*shape)
        if t.dtype != dt:
            t = t.to(dt)
        return t.contiguous()
    kshape = (B, T, H, K)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    vv = prep(v, kshape)
    uu = None if isinstance(u, str) and u == AV else vv if u is None else prep(u, kshape)
    cc = prep(c, (B, T, H))
    pss = None if ps is None else cc if ps is c else prep(ps, (B, T, H))    # one tensor stays one
    return Rank1KeyDecayChunkFunction.apply(vv, uu, prep(p, (B, T, H, V)), pss,
                                            prep(oq, kshape), cc, prep(a, kshape), h0,
                                            output_final_state, chunk_size, packed)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not (a decay per key, and the insert
    key q the erase key v)."""
    why = rank1_chunk_reason(ir, ((ir.dims[1],),), f"per key ({ir.dims[1]},)")
    if why is None and _text(ir, "q") != _text(ir, "v"):
        return f"{ir.spec_name}: insert key q differs from the erase key v (only q = v is chunked here)"
    return why


def supports_sizes(ir, sizes: dict, mode: str) -> str | None:
    """Refuse a key dimension too large for the parallel kernels' register tiles."""
    return key_size_reason(ir, sizes, MAX_K)


def supports_inputs(ir, inputs, mode) -> str | None:
    """``supports_sizes`` on the sizes of these inputs (the Triton backend's hook)."""
    return supports_sizes(ir, key_sizes(ir, inputs), mode)


def _text(ir, slot: str) -> str:
    """A slot's expression as text without spaces (sympy in ssmcraft, text in an exported module)."""
    return str(ir.coefficient(slot).expr).replace(" ", "")


def _read_key_kind(ir) -> str:
    """How the erase's read key u relates to v and a in ``ir``: ``AV`` (u = a o v with a and v
    plain inputs, KDA), ``"v"`` (u = v) or ``"own"`` (any other expression: its own tensor)."""
    u, v, a = (_text(ir, s) for s in ("u", "v", "a"))
    leaves = {**ir.inputs, **ir.params}
    if a in leaves and v in leaves and sorted(u.split("*")) == sorted([a, v]):
        return AV
    return "v" if u == v else "own"


def _u_arg(kind: str, value):
    """The ``u`` argument of ``chunk_rank1_keydecay`` for a read key of ``kind`` (``_read_key_kind``)."""
    return AV if kind == AV else None if kind == "v" else value()


def forward(obj, lay, co, output_final_state):
    """Run the family on laid-out coefficients (see ssmcraft.ops.common.reference.layout).

    co: slot -> tensor [B|1, T|1, H|1, r, c] or number. Returns (y [B, T, H, d] in lay.dtype,
    S_T [B, H, d, m] fp32 or None); autograd reaches every slot tensor and lay.S0.
    """
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    io = io_dtype(lay.out_dtype)
    dev = next(t for t in co.values() if isinstance(t, torch.Tensor)).device

    def vec(x, n):
        if not isinstance(x, torch.Tensor):
            return torch.full((B, T, H, n), float(x), device=dev, dtype=io)
        return x.expand(B, T, H, *x.shape[3:]).reshape(B, T, H, -1).expand(B, T, H, n).to(io)
    h0 = None if lay.S0 is None else lay.S0.transpose(-1, -2)
    split = _split_p(obj.ir)
    if split is not None:           # p = s x with s per head: the scale is taken in the kernels
        ps, p = _per_head(lay.env[split[0]], B, T, H, dev).to(io), vec(lay.env[split[1]], d)
    else:
        ps, p = None, vec(co["p"], d)
    c = _per_head(co["c"], B, T, H, dev).to(io)
    o, ht = chunk_rank1_keydecay(vec(co["v"], m), p, c, vec(co["oq"], m), vec(co["a"], m),
                                 u=_u_arg(_read_key_kind(obj.ir), lambda: vec(co["u"], m)), ps=ps, initial_state=h0,
                                 output_final_state=output_final_state, chunk_size=CHUNK)
    return finish_laid_out(o.to(lay.dtype), co, B, T, H), (None if ht is None else ht.transpose(-1, -2))


def prepare(obj, lay):
    """The family's runner for one call signature (``lay``: sizes and dtypes, from
    ``reference.validate``): plain-input slots go to the kernels as they are (KDA: k, q, x, beta,
    alpha, with u = alpha k and beta x formed in the kernels), computed ones come from
    ``slots.CallSlots``.
    Returns ``fn(inputs, params, initial_state, output_final_state, cu_seqlens=None) -> (y [B,T,H,d],
    S_T [B,H,d,m] | None)``; with ``cu_seqlens`` a packed row (B = 1) and states [N, H, d, m]."""
    from ssmcraft.ops.common.slots import slot_runner
    B, T, H = lay.B, lay.T, lay.H
    out_dtype = lay.out_dtype
    io = io_dtype(out_dtype)
    read = _read_key_kind(obj.ir)

    def run(cs, initial_state, output_final_state, cu_seqlens=None):
        ps, p = cs.split("p")       # KDA's p = beta x: beta taken in the kernels (and beta is c: one tensor)
        o, ht = chunk_rank1_keydecay(cs.get("v"), p.to(io), _per_head(cs.get("c"), B, T, H, cs.device).to(io),
                                     cs.get("oq"), cs.get("a"), u=_u_arg(read, lambda: cs.get("u")), ps=ps,
                                     initial_state=None if initial_state is None else initial_state.transpose(-1, -2),
                                     output_final_state=output_final_state, chunk_size=CHUNK, cu_seqlens=cu_seqlens)
        return cs.finish(o).to(out_dtype), (None if ht is None else ht.transpose(-1, -2))
    return slot_runner(obj, lay, run, in_kernel=("u",) if read == AV else ())
