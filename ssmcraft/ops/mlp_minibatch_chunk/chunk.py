"""The MLP memory (``ssmcraft.ops.mlp_memory``) with mini-batches (``approximation: {minibatch: C}``) in
chunk-parallel form, TTT-MLP's dual form: every gradient of a chunk of C tokens is taken at its anchors
``(P1, P2)``, the weights before the chunk, so the chunk's steps are matrix products on tensor cores
and the chunks follow one another only through the anchors.

Per chunk, a row per token (K, Q [C, m]; X, w [C, d]; eta, c [C]; ``psi`` the data term, ``act`` the
activation, as the sequential family's)::

    Z = K P1^T,  A = act(Z),  R = A P2^T - X,  S = w . psi(R),  E = S P2          [C, h], [C, d]
    GZ = eta (E . act'(Z)),  SE = eta S        (token s's gradient at the anchors: GZ_s k_s^T, SE_s a_s^T)

The running weights are ``W_t = al_t P - sum_{s<=t} Dm[t, s] G_s``: with a decay of the running weights
(``W_t = c_t W_{t-1} - ...``), g = cumsum(log c) over the chunk, al_t = e^(g_t), Dm[t, s] = e^(g_t - g_s);
with weight decay at the anchors (``W_t = W_{t-1} - lam_t P - ...``), al = 1 - cumsum(lam), Dm = 1;
without either al = Dm = 1 (Dm lower triangular). The readout ``y_t = W2_t act(W1_t q_t)`` is then::

    Zq = al . Q P1^T - (Dm . Q K^T) GZ,   Aq = act(Zq),   Y = al . Aq P2^T - (Dm . Aq A^T) SE
    P1 <- aL P1 - GZ^T diag(dL) K,        P2 <- aL P2 - SE^T diag(dL) A     (aL, dL: al and Dm's last row)

and a second key and target add their own GZ2, SE2 terms to each sum. The backward runs the chunks in
reverse from the anchors the forward stored (``[B, H, NT, h, m]`` and ``[B, H, NT, d, h]`` fp32: one pair
per chunk; no replay), recomputing the chunk's products and taking their adjoint; the decay's
gradient goes through g. A decay may be 0 or tiny (a sigmoid gate's, e.g. 1e-9 at -20): log c is clamped
(``ssmcraft.ops.common.tiles.log_decay``), every exponent is a later sum minus an earlier one, the sums
are carried with their rounding error, and a chunk holding a decay below e^LOG_EXACT_DA takes its dc
term by term in a second launch (``kernels.mlp_chunk_exact_dc_kernel``), not as d log c / c. Kernels:
``kernels.py``.

Chunks are counted from each sequence's start: packed rows (``cu_seqlens``) run one program per
(sequence, head), as N separate calls. Mini-batches of ``MIN_C`` to ``MAX_C`` tokens run here (tiles of
a power of two >= C rows, the rows past C masked); a smaller one (tensor-core products need 16 rows)
or a larger one (the tiles' registers) runs on the sequential family, and this family's ``supports``
says why. Shapes and arguments: ``ssmcraft.ops.mlp_memory.recurrent.mlp_memory``'s.
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.rows import packed_args, sequences
from ssmcraft.ops.common.tuning import INTERPRET, buffer, dot_precision, pow2
from ssmcraft.ops.common.varlen import chunks, offsets
from ssmcraft.ops.family import match_reason
from ssmcraft.ops.mlp_memory.recurrent import (ACTIVATIONS, DATA, checked_args, final_cotangents, run_forward,
                                               runner)
from ssmcraft.ops.mlp_memory.recurrent import match as sequential_match
from ssmcraft.ops.mlp_minibatch_chunk.kernels import (mlp_chunk_bwd_kernel, mlp_chunk_exact_dc_kernel,
                                                  mlp_chunk_fwd_kernel)

POISON = False                      # tests: fill every buffer with NaN before the kernels write it
BACKEND_NAME = "mlp-minibatch-chunk"
MIN_C, MAX_C = 16, 64               # the mini-batches this family runs (``supports``)


def _empty(*shape, device, dtype):
    return buffer(shape, device, dtype, POISON)


class MLPChunkFunction(torch.autograd.Function):
    """(x, k, q, eta | None, w | None, decay | None, k2 | None, x2 | None, W1_0 [N, H, h, m] fp32,
    W2_0 [N, H, d, h] fp32) -> (y, W1_T | None, W2_T | None); ``C`` the mini-batch, ``at_anchor``: the decay
    is weight decay's, taken at the anchors; ``packed``: the ``Chunks`` (of C tokens) of a packed row
    (B = 1, N sequences), else None (N = B)."""

    @staticmethod
    def forward(ctx, x, k, q, eta, rw, dec, k2, x2, w1, w2, act, psi, C, at_anchor, output_final_state, packed=None):
        B, T, H, D = x.shape
        M, HID = k.shape[-1], w1.shape[-2]
        dev = x.device
        train = any(ctx.needs_input_grad[:10])
        two = k2 is not None
        N, NT, seq = sequences(B, T, C, packed, x)
        y = _empty(B, T, H, D, device=dev, dtype=x.dtype)
        ck1 = _empty(B, H, NT, HID, M, device=dev, dtype=torch.float32) if train else y
        ck2 = _empty(B, H, NT, D, HID, device=dev, dtype=torch.float32) if train else y
        w1t = _empty(N, H, HID, M, device=dev, dtype=torch.float32) if output_final_state else y
        w2t = _empty(N, H, D, HID, device=dev, dtype=torch.float32) if output_final_state else y
        launch(mlp_chunk_fwd_kernel, (N * H,), x=x, k=k, q=q, eta=y if eta is None else eta,
               rw=y if rw is None else rw, dec=y if dec is None else dec, k2=k2 if two else y, x2=x2 if two else y,
               w1=w1, w2=w2, y=y, w1t=w1t, w2t=w2t, ck1=ck1, ck2=ck2, T=T, NT=NT,
               **_consts(ctx, H, D, M, HID, C, act, psi, eta, rw, dec, at_anchor, two, x.dtype),
               STORE=train, STORE_T=output_final_state, **packed_args(seq, "cu", "co"))
        ctx.set_materialize_grads(False)
        ctx.packed, ctx.C = packed, C
        if train:
            ctx.save_for_backward(x, k, q, eta, rw, dec, k2, x2, ck1, ck2)
        return y, (w1t if output_final_state else None), (w2t if output_final_state else None)

    @staticmethod
    def backward(ctx, dy, dw1t, dw2t):
        x, k, q, eta, rw, dec, k2, x2, ck1, ck2 = ctx.saved_tensors
        B, T, H, D = x.shape
        M, HID = k.shape[-1], ck1.shape[-2]
        dev = x.device
        N, NT, seq = sequences(B, T, ctx.C, ctx.packed, x)
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        has_dht, dw1t, dw2t = final_cotangents(dw1t, dw2t, N, H, D, M, HID, dev)
        need_dh0 = ctx.needs_input_grad[8] or ctx.needs_input_grad[9]
        grad = lambda t: None if t is None else _empty(*t.shape, device=dev, dtype=t.dtype)     # noqa: E731
        dx, dk, dq, deta, drw, ddec, dk2, dx2 = (grad(t) for t in (x, k, q, eta, rw, dec, k2, x2))
        dw1 = _empty(N, H, HID, M, device=dev, dtype=torch.float32) if need_dh0 else dx
        dw2 = _empty(N, H, D, HID, device=dev, dtype=torch.float32) if need_dh0 else dx
        two = k2 is not None
        or_dx = lambda t: dx if t is None else t        # noqa: E731  (an unread pointer)
        # a decay of the running weights: the coefficients of its chunks that hold a tiny decay
        exact = dec is not None and not ctx.at_anchor
        C = ctx.C
        xs = _empty(B * H * NT, C, C, device=dev, dtype=torch.float32) if exact else dx
        xs0 = _empty(B * H * NT, 2, C, device=dev, dtype=torch.float32) if exact else dx
        launch(mlp_chunk_bwd_kernel, (N * H,), x=x, k=k, q=q, eta=or_dx(eta), rw=or_dx(rw), dec=or_dx(dec),
               k2=or_dx(k2), x2=or_dx(x2), dy=dy, ck1=ck1, ck2=ck2, dw1t=dw1t if has_dht else dx,
               dw2t=dw2t if has_dht else dx, dx=dx, dk=dk, dq=dq, deta=or_dx(deta), drw=or_dx(drw),
               ddec=or_dx(ddec), dk2=or_dx(dk2), dx2=or_dx(dx2), dw1=dw1, dw2=dw2, xs=xs, xs0=xs0, T=T, NT=NT,
               **_consts(ctx, H, D, M, HID, C, ctx.act, ctx.psi, eta, rw, dec, ctx.at_anchor, two, x.dtype),
               HAS_DHT=has_dht, STORE_DH0=need_dh0, **packed_args(seq, "cu", "co"))
        if exact:   # the chunks holding a tiny decay rewrite dc term by term
            launch(mlp_chunk_exact_dc_kernel, (N * H,), dec=dec, xs=xs, xs0=xs0, ddec=ddec, T=T, NT=NT, H=H, C=C,
                   BC=pow2(C), PREC=dot_precision(x.dtype), **packed_args(seq, "cu", "co"))
        return (dx, dk, dq, deta, drw, ddec, dk2, dx2, dw1 if need_dh0 else None, dw2 if need_dh0 else None,
                None, None, None, None, None, None)


def _consts(ctx, H, D, M, HID, C, act, psi, eta, rw, dec, at_anchor, two, dtype) -> dict:
    """Both kernels' sizes, blocks and modes (kept on ``ctx`` for the backward)."""
    ctx.act, ctx.psi, ctx.at_anchor = act, psi, at_anchor
    # the chunk's block: autotuned on a GPU (``kernels._chunk_rule``), the mini-batch's power of two here
    return dict(H=H, D=D, M=M, HID=HID, C=C, **({"BC": pow2(C)} if INTERPRET else {}), BD=pow2(D), BM=pow2(M),
                BH=pow2(HID), ACT=act, PSI=psi,
                HAS_ETA=eta is not None, HAS_RW=rw is not None, HAS_DEC=dec is not None, AT_ANCHOR=at_anchor,
                TWO=two, PREC=dot_precision(dtype))


def mlp_minibatch_chunk(x, k, q, eta=None, *, w=None, decay=None, weight_decay=None, k2=None, x2=None,
                        act: str = "silu", data: str = "regression", minibatch: int = MIN_C, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None):
    """``ssmcraft.ops.mlp_memory.recurrent.mlp_memory`` with ``minibatch`` C in [MIN_C, MAX_C] (same
    arguments, shapes and result; no ``chunk_size``: the chunk is the mini-batch), in the module
    docstring's chunk-parallel form. A decay is in [0, 1]."""
    decay, at_anchor = checked_args("mlp_minibatch_chunk", x, act, data, decay, weight_decay, k2, x2,
                                              minibatch)
    if not MIN_C <= minibatch <= MAX_C:
        raise ValueError(f"mlp_minibatch_chunk: minibatch must be in [{MIN_C}, {MAX_C}], got {minibatch}")
    W1, W2 = initial_state
    packed = None
    if cu_seqlens is not None:
        packed = chunks(offsets("mlp_minibatch_chunk", cu_seqlens, {"x": x}, initial_state),
                        cu_seqlens.to(x.device), minibatch)
    if x.shape[1] == 0:
        return x.new_zeros(x.shape), ((W1.float(), W2.float()) if output_final_state else None)
    head = (lambda t: t if t is None else t.contiguous())       # noqa: E731
    key = (lambda t: t if t is None else t.to(x.dtype).contiguous())     # noqa: E731
    y, w1t, w2t = MLPChunkFunction.apply(x.contiguous(), key(k), key(q), head(eta), head(w), head(decay), key(k2),
                                         key(x2), W1.float().contiguous(), W2.float().contiguous(),
                                         ACTIVATIONS[act], DATA[data], minibatch, at_anchor,
                                         output_final_state, packed)
    return y, ((w1t, w2t) if output_final_state else None)


# ----------------------------------------------------------------------------------------
# family interface (ssmcraft.runtime.select)
# ----------------------------------------------------------------------------------------

def match(ir) -> dict:
    """The sequential family's roles (``ssmcraft.ops.mlp_memory.recurrent.match``) of an IR with a
    mini-batch this family runs; ValueError says why it does not."""
    found = sequential_match(ir)
    C = found["minibatch"]
    if not C:
        raise ValueError("no mini-batch (approximation: {minibatch: C}): the sequential family runs it")
    if not MIN_C <= C <= MAX_C:
        why = "tensor-core products need 16 rows" if C < MIN_C else "the chunk's tiles would not fit in registers"
        raise ValueError(f"a mini-batch of {C} tokens, not in [{MIN_C}, {MAX_C}] ({why}): the sequential family "
                         "runs it")
    return found


def supports(ir) -> str | None:
    """None if this family runs ``ir``, else the reason it does not."""
    if not getattr(ir, "hidden", None):
        return f"{ir.spec_name}: no hidden dimension (not a deep memory)"
    return match_reason(ir, match)


def forward(obj, lay, co, output_final_state):
    """Run the family on a reference layout: (y [B, T, H, d] in lay.dtype, (states) fp32 or None)."""
    return run_forward(match(obj.ir), obj, lay, output_final_state, call=mlp_minibatch_chunk)


def prepare(obj, lay):
    """The runner for one call signature: the caller's inputs go to the kernels as they are; a packed
    call (``cu_seqlens=``) runs one program per sequence and head."""
    return runner(match(obj.ir), obj, lay, call=mlp_minibatch_chunk)
