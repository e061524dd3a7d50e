"""A memory that is a two-layer MLP (``objectives/ttt_mlp.yaml``: TTT-MLP / Titans style), as one
fused sequential Triton kernel per direction.

The family: two weight states of different shapes, ``W1 [h, m]`` and ``W2 [d, h]`` (h a hidden width),
one joint gradient step per token of a data term ``eta l(W2 act(W1 k), x, w)`` at the previous
weights, read out as ``y = W2 act(W1 q)`` at the new ones::

    z = W1 k,  a = act(z),  r = W2 a - x,  s = w . psi(r),  e = W2^T s
    W1 <- c W1 - eta (e . act'(z)) k^T,     W2 <- c W2 - eta s a^T,     y = W2 act(W1 q)

with ``psi`` the data term's derivative at the prediction (``DATA``; ``naive.DATA`` writes each loss):
regression ``r``; linear ``-x`` (its gradient does not read the prediction); pseudo-Huber
``r / sqrt(1 + u)`` and Cauchy ``r / (1 + u)`` with ``u = r_i^2`` per output row, or with
``u = sum_i w_i r_i^2`` for a loss of the residual's norm (which couples the rows: one program holds
them all). A mini-batch (``approximation: {minibatch: C}``, ``ssmcraft.compiler.minibatch``) takes
the data gradient (and weight decay, a term that does not read the previous weights) at the anchors
``P``, the weights before the token's chunk of C (counted from each sequence's start), and a scalar
decay at the running weights: ``W <- c W - (1 - c') P - eta grad l(P)``.

with ``act`` one of ``silu``, ``tanh``, ``sigmoid``, ``eta`` one number per head and token (or 1),
``w`` a weight per output row and token (a per-channel step; or 1) and ``c`` the decay of the previous
weights, per head and token: 1, a scalar decay ``alpha`` (the proximity ``sq(W - alpha W_prev)/2``)
or ``1 - lam`` (weight decay, ``lam sq(W)/2``). With a second key and target ``(k2, x2)`` the step
also subtracts their terms, taken at the same previous weights (the gradient of both pairs' losses).

The general family's generated kernels keep every state on one ``[d, m]`` tile, so they cannot run
states of different shapes; this family is written for this one structure, and its ``supports``
checks exactly that: two states of shapes ``(h, m)`` and ``(d, h)`` over a hidden dimension, a
target over ``d`` (or two, with a second key; and at most one more input over ``d``, the row weight),
two or three inputs over ``m`` (the key or keys and the query that the readout reads), at most per-head
inputs besides, no params; then the objective's generated reference loop must equal the naive twin
(``naive.py``) on a small float64 case for one activation, one choice of target and row weight, of key
and query, of step, of decay and of data term, with the IR's mini-batch (``_probe``).
Anything else is refused with the reason.

Kernels (``kernels.py``), one program per (batch, head), both weights in registers in fp32: forward,
sequential over tokens; for training it also stores ``z, r, e`` per token ([B, T, H, h], [B, T, H, d],
[B, T, H, h], fp32; z and e as one [B, T, H, 2, h] in the fused form, ``FUSE``) and the weights after
every chunk's last token (``CHUNK`` tokens, ``DECAY_CHUNK`` with a decay; [B, H, NT, h, m] and [B, H,
NT, h, d]: W2 transposed, as the kernels read it). The backward walks each chunk back from its stored
end state: ``W_{t-1} = W_t + eta (...)`` from the stored vectors, an exact inverse of the step but for
rounding, which restarts at every chunk's stored end (no [CHUNK, h, m] scratch of states: at h = 2m =
128 the two weights are 16k floats a program). With a decay c the walk divides by it, ``W_{t-1} = (W_t +
eta (...)) / c``, in a chunk whose decays amplify rounding by at most 2^DIVIDE_BITS; in the others each
token's weights are replayed from the chunk's start. Work per token: the forward's three matrix-vector
products and two rank-1 updates; the backward's readout adjoint, the rank-1 walk back and the step's
adjoint. A mini-batch carries the anchors beside the running weights (two more tiles forward; backward,
their adjoint too, handed to the running weights' at the chunk's first token); its backward chunk is a
multiple of C, and each mini-batch replays its anchors from the chunk's start (about CHUNK / (2 C) more
steps a token).

Shapes: x, w [B, T, H, d]; k, q [B, T, H, m]; eta [B, T, H]; states (W1 [B, H, h, m], W2 [B, H, d, h]) as
the API carries them, fp32 in the kernels. I/O in float32, bfloat16 or float16.

Packed rows (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): B = 1 and N sequences laid end to end,
states ``[N, H, ...]``; one program per (sequence, head), its chunks counted from the sequence's first
token (``common.rows.seq_state``), so a packed call is N separate calls.
"""
from __future__ import annotations

import itertools

import torch

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.leaves import call_inputs, laid_out_inputs
from ssmcraft.ops.common.reference import initial_states
from ssmcraft.ops.common.rows import packed_args, sequences
from ssmcraft.ops.common.tuning import IO_DTYPES, buffer, io_dtype, pow2
from ssmcraft.ops.common.varlen import chunks, offsets
from ssmcraft.ops.family import match_reason
from ssmcraft.ops.mlp_memory.kernels import (CAUCHY, CAUCHY_NORM, HUBER, HUBER_NORM, LIN, REG, SIGMOID, SILU, TANH,
                                             mlp_memory_bwd_kernel, mlp_memory_fwd_kernel)

POISON = False                      # tests: fill every buffer with NaN before the kernels write it
BACKEND_NAME = "mlp-memory"
CHUNK = 64                          # tokens between the backward's restart states
# with a decay of the running weights the backward walks a chunk back dividing by its decays, or, where
# that would amplify rounding by more than 2^DIVIDE_BITS, replays each token's weights from the chunk's
# start (about DECAY_CHUNK / 2 steps a token): shorter chunks, at 4x the stored states of CHUNK's
DECAY_CHUNK = 16
# 6 bits: the walk's fp32 rounding grows by at most 64x (~1e-5 relative, far below what bf16 I/O rounds
# away); at decays sigmoid(N(2, 1)) (the benchmarks' draws) ~94% of 16-token chunks are walked
DIVIDE_BITS = 6.0
# the forward kernel's FUSE (its docstring): token t - 1's readout taken in the reductions of token t's
# gradient, z and e stored together; False: each readout after its step (the other form, kept to time
# against: ``benchmarks/bench_mlp_memory.py``)
FUSE = True
ACTIVATIONS = {"silu": SILU.value, "tanh": TANH.value, "sigmoid": SIGMOID.value}
# the data terms (``naive.DATA`` writes each loss): the kernels' ``PSI``, its derivative at the prediction
DATA = {"regression": REG.value, "linear": LIN.value, "huber": HUBER.value, "cauchy": CAUCHY.value,
        "huber_norm": HUBER_NORM.value, "cauchy_norm": CAUCHY_NORM.value}
# a per-head input as the factor c of the previous weights: ``decay`` (alpha, ``sq(W - alpha W_prev)/2``)
# or ``weight_decay`` (lam, ``lam sq(W)/2``: c = 1 - lam); ``mlp_memory``'s keyword of each
DECAYS = {"decay": lambda a: a, "weight_decay": lambda lam: 1 - lam}


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


def _ze_buffers(store, B, T, H, HID, dev, none, joint):
    """The forward's stored z and e of one key, fp32: ``[B, T, H, h]`` each, or (``joint``: the fused forward
    stores them together, ``kernels._put_ze``) one ``[B, T, H, 2, h]`` array as both; ``none`` for both
    when nothing is stored."""
    if not store:
        return none, none
    if joint:
        ze = _empty(B, T, H, 2, HID, device=dev, dtype=torch.float32)
        return ze, ze
    return (_empty(B, T, H, HID, device=dev, dtype=torch.float32),
            _empty(B, T, H, HID, device=dev, dtype=torch.float32))


def final_cotangents(dw1t, dw2t, N, H, D, M, HID, dev, w2_rows: bool = False):
    """A backward's cotangents of the final weights: (whether there are any, both fp32 and contiguous,
    ``[N, H, h, m]`` and ``[N, H, d, h]`` (``w2_rows``: W2 transposed, ``[N, H, h, d]``), zeros for a
    missing one; or None, None)."""
    if dw1t is None and dw2t is None:
        return False, None, None
    return (True, torch.zeros(N, H, HID, M, device=dev) if dw1t is None else dw1t.float().contiguous(),
            torch.zeros(N, H, *((HID, D) if w2_rows else (D, HID)), device=dev) if dw2t is None
            else dw2t.float().contiguous())


class MLPMemoryFunction(torch.autograd.Function):
    """(x, k, q, eta | None, w | None, decay | None, k2 | None, x2 | None, W1_0 [N, H, h, m] fp32,
    W2_0 transposed [N, H, h, d] fp32) -> (y, W1_T | None, W2_T transposed | None) (the kernels read W2
    as ``[h, d]``: ``kernels._w2t_offsets``);
    ``packed``: the ``Chunks`` (of ``chunk`` tokens) of a packed row (B = 1, N sequences), else None (N = B);
    ``mb``: the mini-batch (0: none; ``chunk`` is then a multiple of it), ``at_anchor``: the decay is
    weight decay's, taken at the mini-batch's anchors."""

    @staticmethod
    def forward(ctx, x, k, q, eta, rw, dec, k2, x2, w1, w2, act, psi, mb, at_anchor, output_final_state, chunk,
                packed=None):
        B, T, H, D = x.shape
        M, HID = k.shape[-1], w1.shape[-2]
        dev = x.device
        train = any(ctx.needs_input_grad[:10])
        two = k2 is not None
        N, NT, seq = sequences(B, T, chunk, packed, x)
        y = _empty(B, T, H, D, device=dev, dtype=x.dtype)
        ze = FUSE and not mb
        cz, ce = _ze_buffers(train, B, T, H, HID, dev, y, ze)
        cr = _empty(B, T, H, D, device=dev, dtype=torch.float32) if train else y
        cz2, ce2 = _ze_buffers(train and two, B, T, H, HID, dev, y, ze)
        cr2 = _empty(B, T, H, D, device=dev, dtype=torch.float32) if train and two else y
        ck1 = _empty(B, H, NT, HID, M, device=dev, dtype=torch.float32) if train else y
        ck2 = _empty(B, H, NT, HID, D, device=dev, dtype=torch.float32) if train else y
        w1t = _empty(N, H, HID, M, device=dev, dtype=torch.float32) if output_final_state else y
        w2t = _empty(N, H, HID, D, device=dev, dtype=torch.float32) if output_final_state else y
        launch(mlp_memory_fwd_kernel, (N * H,), x=x, k=k, q=q, eta=y if eta is None else eta,
               rw=y if rw is None else rw, dec=y if dec is None else dec, k2=k2 if two else y,
               x2=x2 if two else y, w1=w1, w2=w2, y=y, w1t=w1t, w2t=w2t, cz=cz, cr=cr, ce=ce, cz2=cz2, cr2=cr2,
               ce2=ce2, ck1=ck1, ck2=ck2, T=T, NT=NT, H=H, D=D, M=M, HID=HID,
               BD=pow2(D), BM=pow2(M), BH=pow2(HID), CHUNK=chunk, ACT=act, PSI=psi, HAS_ETA=eta is not None,
               HAS_RW=rw is not None, HAS_DEC=dec is not None, TWO=two, MB=mb, AT_ANCHOR=at_anchor, STORE=train,
               STORE_T=output_final_state, FUSE=FUSE, **packed_args(seq, "cu", "co"))
        ctx.set_materialize_grads(False)
        ctx.act, ctx.psi, ctx.mb, ctx.at_anchor, ctx.chunk, ctx.packed = act, psi, mb, at_anchor, chunk, packed
        ctx.ze = ze      # z and e stored together (the backward reads them as the forward laid them out)
        if train:
            # the initial weights: a decay's backward, and a mini-batch's, replay each chunk from its start
            ctx.save_for_backward(x, k, q, eta, rw, dec, k2, x2,
                                  *((w1, w2) if dec is not None or mb else (None, None)),
                                  cz, cr, ce, *((cz2, cr2, ce2) if two else (None, None, None)), ck1, ck2)
        return y, (w1t if output_final_state else None), (w2t if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dw1t, dw2t):
        x, k, q, eta, rw, dec, k2, x2, w1, w2, cz, cr, ce, cz2, cr2, ce2, ck1, ck2 = ctx.saved_tensors
        two = k2 is not None
        B, T, H, D = x.shape
        M, HID = k.shape[-1], cz.shape[-1]
        dev = x.device
        N, NT, seq = sequences(B, T, ctx.chunk, ctx.packed, x)
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        has_dht, dw1t, dw2t = final_cotangents(dw1t, dw2t, N, H, D, M, HID, dev, w2_rows=True)
        need_dh0 = ctx.needs_input_grad[8] or ctx.needs_input_grad[9]
        dx, dk, dq = _empty(*x.shape, device=dev, dtype=x.dtype), _empty(*k.shape, device=dev, dtype=k.dtype), \
            _empty(*q.shape, device=dev, dtype=q.dtype)
        deta = _empty(*eta.shape, device=dev, dtype=eta.dtype) if eta is not None else None
        drw = _empty(*rw.shape, device=dev, dtype=rw.dtype) if rw is not None else None
        ddec = _empty(*dec.shape, device=dev, dtype=dec.dtype) if dec is not None else None
        dk2 = _empty(*k2.shape, device=dev, dtype=k2.dtype) if two else None
        dx2 = _empty(*x2.shape, device=dev, dtype=x2.dtype) if two else None
        dw1 = _empty(N, H, HID, M, device=dev, dtype=torch.float32) if need_dh0 else dx
        dw2 = _empty(N, H, HID, D, device=dev, dtype=torch.float32) if need_dh0 else dx
        launch(mlp_memory_bwd_kernel, (N * H,), x=x, k=k, q=q, eta=dx if eta is None else eta,
               rw=dx if rw is None else rw, dec=dx if dec is None else dec, w1=dx if w1 is None else w1,
               w2=dx if w2 is None else w2, k2=k2 if two else dx, x2=x2 if two else dx, dy=dy, cz=cz, cr=cr, ce=ce,
               cz2=cz2 if two else dx, cr2=cr2 if two else dx,
               ce2=ce2 if two else dx, ck1=ck1, ck2=ck2, dw1t=dw1t if has_dht else dx,
               dw2t=dw2t if has_dht else dx, dx=dx, dk=dk, dq=dq, deta=dx if deta is None else deta,
               drw=dx if drw is None else drw, ddec=dx if ddec is None else ddec,
               dk2=dk2 if two else dx, dx2=dx2 if two else dx, dw1=dw1, dw2=dw2, T=T, NT=NT,
               BITS=float(DIVIDE_BITS), H=H, D=D, M=M, HID=HID, BD=pow2(D),
               BM=pow2(M), BH=pow2(HID), CHUNK=ctx.chunk, BC=pow2(ctx.chunk), ACT=ctx.act, PSI=ctx.psi,
               HAS_ETA=eta is not None, HAS_RW=rw is not None, HAS_DEC=dec is not None, TWO=two, MB=ctx.mb,
               AT_ANCHOR=ctx.at_anchor, HAS_DHT=has_dht, STORE_DH0=need_dh0, ZE=ctx.ze,
               **packed_args(seq, "cu", "co"))
        return (dx, dk, dq, deta, drw, ddec, dk2, dx2, dw1 if need_dh0 else None, dw2 if need_dh0 else None,
                None, None, None, None, None, None, None)


def checked_args(name, x, act, data, decay, weight_decay, k2, x2, minibatch):
    """``mlp_memory``'s arguments checked (ValueError, named by ``name``): (the decay c the kernels read,
    whether it is weight decay's, taken at a mini-batch's anchors)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"{name}: act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    if x.dtype not in IO_DTYPES:
        raise ValueError(f"{name}: I/O dtype must be one of {IO_DTYPES}, got {x.dtype}")
    if decay is not None and weight_decay is not None:
        raise ValueError(f"{name}: give decay or weight_decay, not both")
    if (k2 is None) != (x2 is None):
        raise ValueError(f"{name}: give both k2 and x2, or neither")
    if data not in DATA:
        raise ValueError(f"{name}: data must be one of {', '.join(DATA)}, got {data!r}")
    if not isinstance(minibatch, int) or minibatch < 0:
        raise ValueError(f"{name}: minibatch must be an int >= 0, got {minibatch!r}")
    if weight_decay is not None:
        # in fp32: 1 - lam rounded to bf16 would compound over the tokens (the kernels read c in fp32);
        # autograd carries lam's gradient through
        decay = DECAYS["weight_decay"](weight_decay.float())
    return decay, bool(minibatch) and weight_decay is not None


def mlp_memory(x, k, q, eta=None, *, w=None, decay=None, weight_decay=None, k2=None, x2=None, act: str = "silu",
               data: str = "regression", minibatch: int = 0, initial_state=None, output_final_state: bool = False,
               chunk_size: int | None = None, cu_seqlens=None):
    """The layer of the module docstring.

    Args:
        x: target [B, T, H, d]; k: key [B, T, H, m]; q: query [B, T, H, m].
        eta: step [B, T, H] or None (= 1).
        w: the loss's weight of each output row [B, T, H, d] (a per-channel step) or None (= 1).
        decay: a per-head decay alpha [B, T, H]: each step starts from alpha W_prev (the proximity
            ``sq(W - alpha W_prev)/2``); or None.
        weight_decay: a per-head lam [B, T, H]: each step includes lam W_prev (``lam sq(W)/2``), i.e. the
            decay 1 - lam; or None. At most one of the two.
        k2, x2: a second key [B, T, H, m] and target [B, T, H, d] (both or neither): the step takes the
            gradient of both pairs' losses (the same eta and w) at the previous weights.
        act: ``silu``, ``tanh`` or ``sigmoid``.
        data: the data term (``naive.DATA`` writes each): ``regression``, ``linear`` (``-sum_i w_i p_i x_i``
            of the prediction p), ``huber`` / ``cauchy`` (per output row, each weighted by w) or
            ``huber_norm`` / ``cauchy_norm`` (of the residual's w-weighted norm).
        minibatch: C > 0: the gradient (and weight decay) at the weights before each chunk of C tokens
            (counted from each sequence's start), a decay at the running weights; 0: at the previous weights.
        initial_state: (W1 [B, H, h, m], W2 [B, H, d, h]); required (it sets the hidden width h).
        output_final_state: also return (W1_T, W2_T) (fp32).
        chunk_size: tokens between the backward's restart states (default ``CHUNK``, ``DECAY_CHUNK`` with a
            decay of the running weights, which the backward replays from the chunk's start; with a mini-batch
            rounded down to a multiple of it, at least one mini-batch).
        cu_seqlens: int32/int64 offsets [N + 1] of N sequences packed in one row (B = 1, FLA's
            convention, checked by ``ssmcraft.ops.common.varlen.offsets``); states are then [N, H, ...]
            and every sequence starts from its own: the result equals N separate calls.
    Returns:
        y [B, T, H, d] in x's dtype, (W1_T, W2_T) or None.
    """
    decay, at_anchor = checked_args("mlp_memory", x, act, data, decay, weight_decay, k2, x2, minibatch)
    W1, W2 = initial_state
    chunk = chunk_size or (DECAY_CHUNK if decay is not None and not at_anchor else CHUNK)
    if minibatch:
        chunk = minibatch * max(1, chunk // minibatch)
    packed = None
    if cu_seqlens is not None:
        packed = chunks(offsets("mlp_memory", cu_seqlens, {"x": x}, initial_state), cu_seqlens.to(x.device), chunk)
    if x.shape[1] == 0:
        return x.new_zeros(x.shape), ((W1.float(), W2.float()) if output_final_state else None)
    head = (lambda t: t if t is None else t.contiguous())       # noqa: E731
    y, w1t, w2t = MLPMemoryFunction.apply(x.contiguous(), k.to(x.dtype).contiguous(), q.to(x.dtype).contiguous(),
                                          head(eta), head(w), head(decay),
                                          None if k2 is None else k2.to(x.dtype).contiguous(),
                                          None if x2 is None else x2.to(x.dtype).contiguous(), W1.float().contiguous(),
                                          W2.float().transpose(-1, -2).contiguous(),
                                          ACTIVATIONS[act], DATA[data], minibatch, at_anchor, output_final_state,
                                          chunk, packed)
    return y, ((w1t, w2t.transpose(-1, -2)) if output_final_state else None)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def _structure(ir) -> dict:
    """The roles the IR's declarations allow: state names ``W1`` (``(h, m)``) and ``W2`` (``(d, h)``),
    the target ``x``, the candidates for the key and query (the inputs over m) and for the step (the
    per-head inputs); ValueError says what does not fit. The update itself is checked by ``_probe``."""
    d, m = ir.dims
    hidden = tuple(getattr(ir, "hidden", None) or ())
    if len(ir.states) != 2 or len(hidden) != 1 or ir.params:
        raise ValueError("not two weight states over one hidden dimension, without params")
    h = hidden[0]
    shapes = {tuple(ir.shape_of(s)): s for s in ir.states}
    if set(shapes) != {(h, m), (d, h)}:
        raise ValueError(f"states {', '.join(f'{s} {tuple(ir.shape_of(s))}' for s in ir.states)}, not "
                         f"({h}, {m}) and ({d}, {h})")
    rows = [n for n, dims in ir.inputs.items() if tuple(dims) == (d,)]
    keys = [n for n, dims in ir.inputs.items() if tuple(dims) == (m,)]
    heads = [n for n, dims in ir.inputs.items() if tuple(dims) == ()]
    pairs = len(keys) - 1
    if (pairs not in (1, 2) or len(rows) not in (pairs, pairs + 1)
            or len(rows) + len(keys) + len(heads) != len(ir.inputs)):
        raise ValueError(f"inputs are not one or two targets (and a row weight) over {d}, as many keys and a query "
                         f"over {m} and per-head factors")
    return {"W1": shapes[(h, m)], "W2": shapes[(d, h)], "rows": rows, "keys": keys, "heads": heads, "h": h}


def _probe(ir, found) -> dict | str:
    """The IR's reference loop against the naive twin on a small float64 case (random weights, every
    role filled), for each activation, order of the keys and query, of the targets and row weight, step (1, or one
    per-head input), decay (none, or another per-head input as alpha or as weight decay's lam) and data
    term, with the IR's mini-batch: the roles that agree, or why none does."""
    from ssmcraft.compiler.api import generate_reference
    from ssmcraft.ops.common.reference import Layout, reference_loop
    from ssmcraft.ops.mlp_memory.naive import naive_mlp_memory
    d, m = ir.dims
    B, T, H, D, M, HID = 1, 4, 1, 2, 3, 5
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)     # noqa: E731
    val = {**{n: 0.2 + 0.6 * torch.rand(B, T, H, generator=gen, dtype=torch.float64) for n in found["heads"]},
           **{n: r(B, T, H, M) for n in found["keys"]},
           **{n: 0.5 + r(B, T, H, D).abs() for n in found["rows"]}}     # positive: either may be the row weight
    W = {found["W1"]: 0.5 * r(B, H, HID, M), found["W2"]: 0.5 * r(B, H, D, HID)}
    axes = (d, m, found["h"])
    sizes = {d: D, m: M, found["h"]: HID}
    env = {n: t.reshape(B, T, H, *(sizes[a] if a in ir.inputs[n] else 1 for a in axes)) for n, t in val.items()}
    module, _ = generate_reference(ir)
    y, ST, _ = reference_loop(module, Layout(env, B, T, H, D, M, torch.float64, torch.float64,
                                             tuple(W[s] for s in ir.states), {found["h"]: HID}))
    got = dict(zip(ir.states, ST))
    rows, heads, keys = found["rows"], found["heads"], found["keys"]
    decays = [(None, None), *((n, kind) for kind in DECAYS for n in heads)]
    # (k, k2, q) and (x, x2, w): the second pair and the row weight None where there is none
    key_roles = [(p[0], p[1] if len(p) == 3 else None, p[-1]) for p in itertools.permutations(keys)]
    row_roles = [(p[0], p[1] if len(keys) == 3 else None, p[-1] if len(p) == len(keys) else None)
                 for p in itertools.permutations(rows)]
    def twin(n, act, k, k2, q, x, x2, w, eta, dec, kind, data):
        """The naive twin on the first n tokens."""
        v = {name: t[:, :n] for name, t in val.items()}
        return naive_mlp_memory(v[x], v[k], v[q], v.get(eta), W[found["W1"]], W[found["W2"]], act, v.get(w),
                                v[dec] if kind == "decay" else None, v.get(k2), v.get(x2),
                                weight_decay=v[dec] if kind == "weight_decay" else None, data=data,
                                minibatch=ir.minibatch)

    close = lambda a, b: torch.allclose(a, b, rtol=1e-9, atol=1e-9)     # noqa: E731
    for act, (k, k2, q), (x, x2, w), eta, (dec, kind), data in itertools.product(
            ACTIVATIONS, key_roles, row_roles, (None, *heads), decays, DATA):
        if dec is not None and dec == eta:
            continue
        roles = (act, k, k2, q, x, x2, w, eta, dec, kind, data)
        # the first token's output first: a quarter of the work, and it tells most choices apart
        if not close(twin(1, *roles)[0], y[:, :1]):
            continue
        yn, W1, W2 = twin(T, *roles)
        if all(close(a, b) for a, b in ((y, yn), (got[found["W1"]], W1), (got[found["W2"]], W2))):
            return {"W1": found["W1"], "W2": found["W2"], "x": x, "w": w, "k": k, "q": q, "eta": eta, "act": act,
                    "decay": dec, "decay_kind": kind, "k2": k2, "x2": x2, "data": data, "minibatch": ir.minibatch}
    return (f"the update is not one joint gradient step of eta l(W2 act(W1 k), x, w) (l one of {', '.join(DATA)}; "
            f"plus one such term of a second key and target) from c W_prev - lam W_c, "
            f"read out as W2 act(W1 q), with act one of {', '.join(ACTIVATIONS)}, eta 1 or a per-head input, w 1 or "
            "an input, c 1 or a per-head alpha, lam 0 or a per-head input, and the gradient at W_c: the previous "
            "weights, or a mini-batch's anchors")


def match(ir) -> dict:
    """``_structure`` and ``_probe`` (once per IR); ValueError says why the family does not run it."""
    def check():
        try:
            return _probe(ir, _structure(ir))
        except ValueError as e:
            return str(e)
    out = ir.memo("mlp_memory", check)
    if isinstance(out, str):
        raise ValueError(out)
    return dict(out)


def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    if not getattr(ir, "hidden", None):
        return f"{ir.spec_name}: no hidden dimension (not a deep memory)"
    return match_reason(ir, match)


def _run(names, get, initial_state, output_final_state, io, cu_seqlens=None, call=None):
    """The family on tensors ``get(name)`` in the API layout; states in the IR's order (``names["order"]``),
    the declared initial ones (``names["initial"](N, H, d, m)``, N sequences) when the call gives none;
    ``call``: ``mlp_memory`` (None) or a function of its signature (the mini-batch chunk form's)."""
    x = get(names["x"])
    B, T, H, D = x.shape
    M = get(names["k"]).shape[-1]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    S0 = initial_state if initial_state is not None else names["initial"](N, H, D, M, x.device)
    st = dict(zip(names["order"], S0))
    opt = (lambda role: None if names[role] is None else get(names[role]))     # noqa: E731
    dec = {} if names["decay"] is None else {names["decay_kind"]: get(names["decay"])}
    y, fin = (call or mlp_memory)(x.to(io), get(names["k"]), get(names["q"]), opt("eta"), w=opt("w"), **dec, k2=opt("k2"),
                        x2=opt("x2"), act=names["act"], data=names["data"], minibatch=names["minibatch"],
                        initial_state=(st[names["W1"]], st[names["W2"]]), output_final_state=output_final_state,
                        cu_seqlens=cu_seqlens)
    if fin is None:
        return y, None
    out = {names["W1"]: fin[0], names["W2"]: fin[1]}
    return y, tuple(out[s] for s in names["order"])


def _names(ir, found: dict) -> dict:
    """The roles ``found`` (a ``match``), the states' order and their declared initial values."""
    return dict(found, order=ir.states,
                initial=lambda B, H, D, M, dev: initial_states(ir, B, H, D, M, device=dev, dtype=torch.float32))


def run_forward(found: dict, obj, lay, output_final_state, call=None):
    """``forward`` with the roles ``found`` and ``call`` (``_run``'s)."""
    y, S = _run(_names(obj.ir, found), laid_out_inputs(obj.ir, lay), lay.S0, output_final_state,
                io_dtype(lay.out_dtype), call=call)
    return y.to(lay.dtype), S


def runner(found: dict, obj, lay, call=None):
    """``prepare`` with the roles ``found`` and ``call`` (``_run``'s)."""
    names = _names(obj.ir, found)
    io = io_dtype(lay.out_dtype)
    out_dtype = lay.out_dtype

    def run(inputs, params, initial_state, output_final_state, cu_seqlens=None):
        y, S = _run(names, call_inputs(inputs), initial_state, output_final_state, io, cu_seqlens, call=call)
        return y.to(out_dtype), S
    return run


def forward(obj, lay, co, output_final_state):
    """Run the family on a reference layout: (y [B, T, H, d] in lay.dtype, (states) fp32 or None)."""
    return run_forward(match(obj.ir), obj, lay, output_final_state)


def prepare(obj, lay):
    """The runner for one call signature: the caller's inputs go to the kernels as they are; a packed
    call (``cu_seqlens=``) runs one program per sequence and head."""
    return runner(match(obj.ir), obj, lay)
