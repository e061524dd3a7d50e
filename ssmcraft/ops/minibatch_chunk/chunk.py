"""Chunked mini-batch regression steps (``approximation: {minibatch: C}`` on an explicit regression
update) on tensor cores.

The family: within chunk j of C tokens every gradient is taken at the chunk's start state ``S_c``
(the initial state for j = 0), with a per-head decay ``a`` applied at the running state:

    S_t = a_t S_{t-1} - (c_t . (S_c u_t - p_t)) v_t^T - lam_t S_c      S [d, m] = "V x K"
    y_t = S_t oq_t

DeltaNet's mini-batch form is u = v = k (oq = q), c = beta (per head or per row ``d``), p = x,
a = 1, lam = 0; a scalar decay (``alpha * S_prev``) gives a; weight decay's gradient, taken at S_c
like the data term's, gives lam (per head); a linear data term (``beta x k^T``, no prediction) has
no u (the residual is -p). Kernels keep the transpose ``H = S^T`` ([K, V]). Per chunk (local index
t, H0 the chunk's start state, g_t = sum_{r<=t} log a_r within the chunk, gl its last value,
Gam[t, s] = e^{g_t - g_s} for s <= t, 0 above, w_t = e^{g_t} - sum_{s<=t} Gam[t, s] lam_s the
weight of H0 in H_t, wl its last value):

    Rc  = c . (U H0 - P)                                    [C, V]   (the chunk's residuals, scaled)
    O   = diag(w) OQ H0 - (OQ V^T . Gam) Rc                 [C, V]
    H1  = wl H0 - Vbar^T Rc,  Vbar = diag(e^{gl - g}) V

so unlike the delta rule no triangular solve is needed: the residuals of a chunk read only H0.
Three kernels: ``minibatch_fwd_kernel`` (sequential over chunks, per value block: outputs, the
chunk start states for training, the final state), ``minibatch_bwd_state_kernel`` (reverse over
chunks: the state gradient at every chunk's end, and the initial state's) and
``minibatch_bwd_grad_kernel`` (parallel over chunks: every input's gradient). Each kernel forms g
from a by a cumulative sum over the chunk's rows; the decay's gradient is the reverse cumulative sum
of g's, divided by a (term by term in a chunk holding a decay below e^-3,
``common.tiles.pair_decay_grad``; log a floored at -80, ``tiles.log_decay``), and lam's is
-(Gam^T dw): no PyTorch op runs around the kernels.

Shapes (kernel level, FLA layout): u, v, oq [B, T, H, K]; p [B, T, H, V]; c [B, T, H] or
[B, T, H, V]; a [B, T, H] (>= 0); lam [B, T, H]; initial / final state [B, H, K, V] fp32; output [B, T, H, V]. I/O
in float32, bfloat16 or float16; states, residuals and reductions in float32.

Packed rows (``cu_seqlens``): B = 1 and N sequences laid end to end; every sequence's mini-batches
start at its first token (``common.rows``: no chunk straddles two sequences, and a sequence
shorter than a mini-batch is one partial chunk), so a packed call is N separate calls; states
``[N, H, K, V]``, chunk start states ``[B, H, NT, K, V]`` (NT: every sequence's chunks together).
"""
from __future__ import annotations

import sympy
import torch

from ssmcraft.ops.common.chunked import _key_block
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.leaves import call_inputs, laid_out_inputs
from ssmcraft.ops.common.tuning import INTERPRET, IO_DTYPES, buffer, cdiv, dot_precision, io_dtype, pow2
from ssmcraft.ops.common.varlen import chunks, offsets
from ssmcraft.ops.common.rows import packed_args, sequences
from ssmcraft.ops.minibatch_chunk.kernels import (minibatch_bwd_grad_kernel, minibatch_bwd_state_kernel,
                                                  minibatch_fwd_kernel)

POISON = False                      # tests: fill every buffer with NaN before the kernels write it
INTERPRET_BV: int | None = None     # value block of the sequential kernels under the interpreter
BACKEND_NAME = "minibatch-chunk"
CHUNKS = (16, 32, 64)               # mini-batch sizes the kernels take (tensor-core blocks of >= 16)


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _seq_opts(V: int) -> dict:
    """The sequential kernels' value block under the interpreter (autotuned on a GPU)."""
    return {"BV": INTERPRET_BV or pow2(V)} if INTERPRET else {}


def _fwd(u, v, p, c, oq, a, lam, h0, output_final_state, store_states, BT, packed=None):
    """``packed``: the ``Chunks`` of a packed row (B = 1, N sequences), else None (N = B)."""
    B, T, H, K = v.shape
    V = p.shape[-1]
    dt, dev = p.dtype, p.device
    N, NT, seq = sequences(B, T, BT, packed, v)
    o = _empty(B, T, H, V, device=dev, dtype=dt)
    hs = _empty(B, H, NT, K, V, device=dev, dtype=torch.float32) if store_states else o
    ht = _empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else o
    launch(minibatch_fwd_kernel, lambda meta: (cdiv(V, meta["BV"]), N * H),
           u=o if u is None else u, v=v, p=p, c=c, oq=oq, a=o if a is None else a, lam=o if lam is None else lam,
           h0=o if h0 is None else h0, o=o, hs=hs, ht=ht, T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=_key_block(K, dt),
           HAS_G=a is not None, HAS_L=lam is not None, HAS_U=u is not None, C_ROW=c.dim() == 4,
           STORE_H=store_states, HAS_H0=h0 is not None, STORE_HT=output_final_state, PREC=dot_precision(dt),
           **packed_args(seq, "cu", "co"), **_seq_opts(V))
    return o, (ht if output_final_state else None), hs


def _bwd(u, v, p, c, oq, a, lam, hs, do, dht, need_dh0, BT, packed=None):
    B, T, H, K = v.shape
    V = p.shape[-1]
    dt, dev = p.dtype, p.device
    N, NT, seq = sequences(B, T, BT, packed, v)
    BK = _key_block(K, dt)
    prec = dot_precision(dt)
    do = do.contiguous().to(dt)
    dhs = _empty(B, H, NT, K, V, device=dev, dtype=torch.float32)
    dh0 = _empty(N, H, K, V, device=dev, dtype=torch.float32) if need_dh0 else dhs
    flags = dict(HAS_G=a is not None, HAS_L=lam is not None, HAS_U=u is not None, C_ROW=c.dim() == 4)
    ins = dict(u=do if u is None else u, v=v, c=c, oq=oq, a=do if a is None else a, lam=do if lam is None else lam)
    launch(minibatch_bwd_state_kernel, lambda meta: (cdiv(V, meta["BV"]), N * H), **ins, do=do,
           dht=do if dht is None else dht.contiguous().float(), dhs=dhs, dh0=dh0, T=T, NT=NT, H=H, K=K, V=V,
           BT=BT, BK=BK, **flags, HAS_DHT=dht is not None, STORE_DH0=need_dh0, PREC=prec,
           **packed_args(seq, "cu", "co"), **_seq_opts(V))
    dv, doq = (_empty(*v.shape, device=dev, dtype=v.dtype) for _ in range(2))
    du, da, dlam = (None if x is None else _empty(*x.shape, device=dev, dtype=x.dtype) for x in (u, a, lam))
    dp = _empty(*p.shape, device=dev, dtype=p.dtype)
    dc = _empty(*c.shape, device=dev, dtype=c.dtype)
    launch(minibatch_bwd_grad_kernel, (NT, B * H), **ins, p=p, hs=hs, dhs=dhs, do=do, du=dv if du is None else du,
           dv=dv, dp=dp, dc=dc, doq=doq, da=dc if da is None else da, dlam=dc if dlam is None else dlam,
           T=T, NT=NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=pow2(V), **flags, PREC=prec,
           **packed_args(seq, "cu", "ci"))
    return du, dv, dp, dc, doq, da, dlam, (dh0 if need_dh0 else None)


class MinibatchChunkFunction(torch.autograd.Function):
    """(u|None, v, p, c, oq, a|None, lam|None, h0|None) -> (o, ht|None)."""

    @staticmethod
    def forward(ctx, u, v, p, c, oq, a, lam, h0, output_final_state, chunk_size, packed=None):
        train = any(ctx.needs_input_grad[:8])
        ctx.set_materialize_grads(False)
        o, ht, hs = _fwd(u, v, p, c, oq, a, lam, h0, output_final_state, train, chunk_size, packed)
        if train:
            ctx.save_for_backward(u, v, p, c, oq, a, lam, hs)
        ctx.chunk_size, ctx.packed = chunk_size, packed
        ctx.need_dh0 = h0 is not None and ctx.needs_input_grad[7]
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        u, v, p, c, oq, a, lam, hs = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(p)
        grads = _bwd(u, v, p, c, oq, a, lam, hs, do, dht, ctx.need_dh0, ctx.chunk_size, ctx.packed)
        return (*grads, None, None, None)


def chunk_minibatch(u, v, p, c, oq, *, a=None, lam=None, initial_state=None, output_final_state: bool = False,
                    chunk_size: int = 64, cu_seqlens=None):
    """H_t = a_t H_{t-1} - v_t (c_t . (H_c^T u_t - p_t))^T - lam_t H_c with H_c the state before t's
    chunk of ``chunk_size`` tokens;  o_t = H_t^T oq_t.

    Args:
        u:  read key [B, T, H, K] (the prediction ``H_c^T u``), or None: no prediction (the step
            inserts ``c . p`` along v, a linear data term).
        v:  erase key [B, T, H, K].
        p:  target [B, T, H, V].
        c:  step, per head [B, T, H] or per row [B, T, H, V].
        oq: readout key [B, T, H, K].
        a:  per-head decay [B, T, H], > 0, or None (= 1).
        lam: per-head decay of the chunk's start state [B, T, H] (weight decay's gradient ``lam H_c``,
            taken at H_c as every gradient of the chunk), or None (= 0).
        initial_state: [B, H, K, V] (any float dtype; kept fp32) or None.
        output_final_state: also return the state [B, H, K, V] (fp32).
        chunk_size: the mini-batch, 16, 32 or 64.
        cu_seqlens: int32/int64 offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, checked by ``ssmcraft.ops.common.varlen.offsets``); initial and final states
            are then [N, H, K, V], and every sequence's mini-batches start at its first token (as N
            separate calls take them).
    Returns:
        o [B, T, H, V] in p's dtype, final state [B, H, K, V] fp32 or None.
    """
    if chunk_size not in CHUNKS:
        raise ValueError(f"chunk_minibatch: chunk_size must be one of {CHUNKS}, got {chunk_size}")
    dt = p.dtype
    if dt not in IO_DTYPES:
        raise ValueError(f"chunk_minibatch: I/O dtype must be one of {IO_DTYPES}, got {dt}")
    B, T, H, K = v.shape
    V = p.shape[-1]
    packed = None
    if cu_seqlens is not None:
        cu = offsets("chunk_minibatch", cu_seqlens, {"v": v}, initial_state)
        packed = chunks(cu, cu_seqlens.to(v.device), chunk_size)
    N = B if packed is None else packed.N
    if T == 0:
        S = initial_state.float() if initial_state is not None else p.new_zeros(N, H, K, V, dtype=torch.float32)
        return p.new_zeros(B, 0, H, V), (S if output_final_state else None)
    key = lambda t: t.to(dt).contiguous()       # noqa: E731
    h0 = None if initial_state is None else initial_state.float().contiguous()
    opt = lambda t: None if t is None else t.contiguous()      # noqa: E731
    return MinibatchChunkFunction.apply(None if u is None else key(u), key(v), key(p), c.contiguous(), key(oq),
                                        opt(a), opt(lam), h0,
                                        output_final_state, chunk_size, packed)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def _leaf(ir, expr, dims_ok, what):
    """The input named by ``expr`` (a bare symbol) when its dims are one of ``dims_ok``."""
    if not isinstance(expr, sympy.Symbol) or expr.name not in ir.inputs:
        raise ValueError(f"{what} is {expr}, not one input")
    if tuple(ir.inputs[expr.name]) not in dims_ok:
        raise ValueError(f"{what} {expr.name} has dims {tuple(ir.inputs[expr.name])}")
    return expr.name


def _split_row_key(ir, expr, what):
    """(step, key): ``expr`` = step * key with the step a per-head or per-row input and the key an
    input over m."""
    d, m = ir.dims
    factors = sympy.Mul.make_args(sympy.factor_terms(expr))
    keys = [f for f in factors if isinstance(f, sympy.Symbol) and tuple(ir.inputs.get(f.name, ())) == (m,)]
    if len(keys) != 1:
        raise ValueError(f"{what} {expr} is not a step times one key over {m}")
    return _leaf(ir, sympy.Mul(*[f for f in factors if f is not keys[0]]), ((), (d,)), f"{what}'s step"), keys[0].name


def _split_insert(ir, G):
    """(step, key, target) of a step ``G`` = step * key * target with no prediction (a linear data
    term): the key an input over m, the target the first input over d (in declaration order) and the
    step the rest, a per-head or per-row input. Without a prediction the kernels scale the target by
    the step elementwise, so which of two per-row factors is called the target does not matter."""
    d, m = ir.dims
    if G == 0 or G.has(sympy.Symbol(f"{ir.state}_prev", real=True)):
        raise ValueError(f"the step {G} is not a step times a key times a target")
    factors = sympy.Mul.make_args(sympy.factor_terms(G))
    syms = {f.name: f for f in factors if isinstance(f, sympy.Symbol) and f.name in ir.inputs}
    keys = [n for n in syms if tuple(ir.inputs[n]) == (m,)]
    targets = [n for n in ir.inputs if n in syms and tuple(ir.inputs[n]) == (d,)]
    if len(keys) != 1 or not targets:
        raise ValueError(f"the step {G} is not a step times one key over {m} times a target over {d}")
    rest = sympy.Mul(*[f for f in factors if f not in (syms[keys[0]], syms[targets[0]])])
    return _leaf(ir, rest, ((), (d,)), "the step's scale"), keys[0], targets[0]


def match(ir) -> dict:
    """The slots of this family read off a mini-batch IR: input names ``u`` (None: no prediction),
    ``v, p, c, oq``, ``a`` (None: no decay) and ``lam`` (None: no decay of the chunk's start state),
    and whether the step is per row. ValueError says why it is not of the form."""
    d, m = ir.dims
    if not ir.minibatch or ir.states or ir.kind != "general":
        raise ValueError("not a one-state mini-batch update")
    if ir.minibatch not in CHUNKS:
        raise ValueError(f"mini-batch of {ir.minibatch}; the kernels take {CHUNKS}")
    if ir.minibatch_decay is None:
        raise ValueError("the update is not a decay of S_prev plus a step at the chunk's start")
    a = sympy.sympify(ir.minibatch_decay)
    decay = None if a == 1 else _leaf(ir, a, ((),), "the decay")
    anchor = sympy.Symbol(f"_{ir.state}_c", real=True)
    S_prev = sympy.Symbol(f"{ir.state}_prev", real=True)
    G = sympy.expand(ir.state_update - a * S_prev)
    # a gradient of the proximity taken at S_c (weight decay's lam S_c): a decay of the start state
    shrink = -sympy.diff(G, anchor)
    G = sympy.expand(G + shrink * anchor)
    lam = None if shrink == 0 else _leaf(ir, shrink, ((),), "the start state's decay")
    if G.has(anchor):
        raise ValueError(f"the step {G} reads S_c other than through one prediction")
    if not ir.state_reductions:
        c, v, p = _split_insert(ir, G)
        u = None
    elif len(ir.state_reductions) != 1:
        raise ValueError("not one prediction S_c u per token")
    else:
        red = ir.state_reductions[0]
        r = sympy.Symbol(red.name, real=True)
        u = sympy.cancel(red.body / anchor)
        if red.over != m or tuple(red.dims) != (d,) or u.has(anchor):
            raise ValueError(f"the prediction {red.body} is not S_c times a key over {m}")
        u = _leaf(ir, u, ((m,),), "the read key")
        erase = -sympy.diff(G, r)
        insert = sympy.expand(G + erase * r)
        if G.has(S_prev) or erase.has(r) or erase == 0:
            raise ValueError(f"the step {G} is not linear in the prediction")
        c, v = _split_row_key(ir, erase, "the erase")
        p = _leaf(ir, sympy.cancel(insert / erase), ((d,),), "the target")
    if len(ir.readout_reductions) != 1 or ir.readout != sympy.Symbol(ir.readout_reductions[0].name, real=True):
        raise ValueError(f"the readout {ir.readout} is not S q")
    ro = ir.readout_reductions[0]
    oq = _leaf(ir, sympy.cancel(ro.body / sympy.Symbol(ir.state, real=True)), ((m,),), "the readout key")
    return {"u": u, "v": v, "p": p, "c": c, "oq": oq, "a": decay, "lam": lam, "c_row": tuple(ir.inputs[c]) == (d,)}


def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    try:
        match(ir)
    except ValueError as e:
        return f"{ir.spec_name}: {e}"
    return None


def _run(names, get, C, initial_state, output_final_state, io, cu_seqlens=None):
    """The family on tensors ``get(name)`` in FLA layout; states in the API's [B, H, d, m] (``[N, H, d,
    m]`` with ``cu_seqlens``)."""
    opt = lambda n: None if names[n] is None else get(names[n])      # noqa: E731
    o, ht = chunk_minibatch(opt("u"), get(names["v"]), get(names["p"]).to(io), get(names["c"]), get(names["oq"]),
                            a=opt("a"), lam=opt("lam"),
                            initial_state=None if initial_state is None else initial_state.transpose(-1, -2),
                            output_final_state=output_final_state, chunk_size=C, cu_seqlens=cu_seqlens)
    return o, (None if ht is None else ht.transpose(-1, -2))


def forward(obj, lay, co, output_final_state):
    """Run the family on a reference layout (``ssmcraft.ops.common.reference.layout``): (y [B, T, H, d]
    in lay.dtype, S_T [B, H, d, m] fp32 or None); autograd reaches every input and lay.S0."""
    names = match(obj.ir)
    io = io_dtype(lay.out_dtype)
    get = laid_out_inputs(obj.ir, lay)
    o, S = _run(names, lambda n: get(n).to(io), obj.ir.minibatch, lay.S0, output_final_state, io)
    return o.to(lay.dtype), S


def prepare(obj, lay):
    """The runner for one call signature: the caller's inputs go to the kernels as they are; a packed
    call (``cu_seqlens=``) runs natively."""
    names = match(obj.ir)
    io = io_dtype(lay.out_dtype)
    out_dtype = lay.out_dtype

    def run(inputs, params, initial_state, output_final_state, cu_seqlens=None):
        o, S = _run(names, call_inputs(inputs), obj.ir.minibatch, initial_state, output_final_state, io, cu_seqlens)
        return o.to(out_dtype), S
    return run
