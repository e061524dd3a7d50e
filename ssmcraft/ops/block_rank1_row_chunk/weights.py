"""The per-head chunk weights of the block rank-1 recurrence, differentiable: small Triton kernels with
their own backward (``kernels.block_weights_*``), or torch ops (``HOW``).

Over a chunk of C tokens (``s = 0 .. C-1``), with the per-head 2 x 2 transitions ``A_s``, ``Phi(k, j)``
the product of the transitions of steps ``j+1 .. k`` (states after step k from states after step j,
``Phi(k, k) = I``; the chunk's start is step 0, token s is step s+1)::

    G[s, s'] = e_s^T Phi(s, s'+1) w_s'     (s' < s)     g[b, s] = [Phi(s, 0)^T e_s]_b
    Hm[s, s'] = r_s^T Phi(s+1, s'+1) w_s'  (s' <= s)    h[b, s] = [Phi(s+1, 0)^T r_s]_b
    E[a, s'] = [Phi(C, s'+1) w_s']_a                     F[a, b] = Phi(C, 0)[a, b]

``L^{-1}``, with ``L`` the chunk's block bidiagonal matrix (2 (C+1) square, identity blocks on the
diagonal, ``-A_s`` below them: ``L X = input`` is the recurrence of the states after each step), has
``Phi(k, j)`` as its block (k, j); the weights need it only applied to the writes ``w_s'`` (placed at
block row s'+1) and to the start (the identity at block row 0): one batched unit-triangular solve with
C + 2 right sides (forward substitution: the products themselves, nothing inverted that could be
near-singular), then contractions with e and r. The kernels run the same substitution column by column:
one program per chunk, the C + 2 right sides on lanes, C + 1 steps of 2 x 2 products; their backward
recomputes the steps and runs the adjoint recurrence (``lambda_{k-1} = A_{k-1}^T lambda_k`` plus the
outputs' gradients at step k) in reverse.
Tokens past the sequence's end take ``A = I`` and ``e = w = r = 0``: the last chunk's end state is
the sequence's final state, and the padded tokens weigh nothing. Torch autograd takes the chunk kernels'
gradients of the weights back to the per-head coefficients (through the weights kernels' backward, or
through the torch ops).
"""
from __future__ import annotations

import torch

from ssmcraft.ops.block_rank1_row_chunk.kernels import block_weights_bwd_kernel, block_weights_fwd_kernel
from ssmcraft.ops.common.chunked import _per_head
from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import cdiv, pow2

# where the weights are formed: "triton" (``kernels.block_weights_fwd_kernel`` and its backward: one
# program per chunk, fp32) or "torch" (the batched triangular solve below, differentiable by torch autograd
# in any float dtype: the readable form the tests check the kernels with). As torch ops at B=8 T=2048 H=16
# C=16 on the H200 they took some 6 of the family's 10.1 ms fwd+bwd (tiny batched GEMMs and solves).
HOW = "triton"


class _WeightsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, co, B, T, H, C):
        """co: [10, B, T, H] fp32 (a00 a01 a10 a11 e0 e1 w0 w1 r0 r1). Returns G, Hm, g, h, E, F."""
        NC = max(1, cdiv(T, C))
        out = [torch.empty(B, H, NC, *s, device=co.device, dtype=torch.float32)
               for s in ((C, C), (C, C), (2, C), (2, C), (2, C), (4,))]
        launch(block_weights_fwd_kernel, (B * H, NC), co, *out, T, NC, B * T * H, H=H, C=C, CP=pow2(C + 2, 1),
               num_warps=1)
        ctx.save_for_backward(co)
        ctx.sizes = (B, T, H, C, NC)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        (co,) = ctx.saved_tensors
        B, T, H, C, NC = ctx.sizes
        grads = [torch.zeros(B, H, NC, *s, device=co.device, dtype=torch.float32) if g is None else g.contiguous()
                 for g, s in zip(grads, ((C, C), (C, C), (2, C), (2, C), (2, C), (4,)))]
        dco = torch.empty_like(co)
        launch(block_weights_bwd_kernel, (B * H, NC), co, *grads, dco, T, NC, B * T * H, H=H, C=C,
               CP=pow2(C + 2, 1), CK=pow2(C + 1, 1), num_warps=1)
        return dco, None, None, None, None


def chunk_weights(A, e, w, r, B: int, T: int, H: int, C: int, ref: torch.Tensor, dtype=torch.float32, how=None):
    """A: ``[[a00, a01], [a10, a11]]``; e, w, r: pairs; each entry ``[B, T, H]`` or a number.
    Returns (G, Hm ``[B, H, NC, C, C]``, g, h, E ``[B, H, NC, 2, C]``, F ``[B, H, NC, 4]``), ``dtype``
    (fp32 from the kernels), NC = ceil(T / C). ``how``: ``HOW`` when None."""
    NC = max(1, cdiv(T, C))
    pad = NC * C - T
    ph = lambda x: _per_head(x, B, T, H, ref.device).to(dtype)  # noqa: E731
    if (how or HOW) == "triton":
        co = torch.stack([ph(x) for x in (A[0][0], A[0][1], A[1][0], A[1][1], *e, *w, *r)]).float().contiguous()
        return _WeightsFunction.apply(co, B, T, H, C)
    At = torch.stack([torch.stack([ph(A[a][b]) for b in range(2)], -1) for a in range(2)], -2)   # [B, T, H, 2, 2]
    e, w, r = (torch.stack([ph(x[0]), ph(x[1])], -1) for x in (e, w, r))                          # [B, T, H, 2]
    if pad:
        eye = torch.eye(2, device=ref.device, dtype=dtype).expand(B, pad, H, 2, 2)
        At = torch.cat([At, eye], 1)
        e, w, r = (torch.cat([x, x.new_zeros(B, pad, H, 2)], 1) for x in (e, w, r))
    At = At.view(B, NC, C, H, 2, 2).permute(0, 3, 1, 4, 5, 2)                  # [B, H, NC, a, b, s]
    e, w, r = (x.view(B, NC, C, H, 2).permute(0, 3, 1, 2, 4) for x in (e, w, r))   # [B, H, NC, s, 2]
    # right sides: w_s' at block row s' + 1 (column s'), and the identity at block row 0 (columns C, C+1)
    Wr = torch.diag_embed(w.transpose(-1, -2), offset=-1)[..., :C].transpose(-3, -2)   # [.., k, a, s']
    I0 = torch.zeros(C + 1, 2, 2, device=ref.device, dtype=dtype)
    I0[0] = torch.eye(2, device=ref.device, dtype=dtype)
    rhs = torch.cat([Wr, I0.expand(B, H, NC, C + 1, 2, 2)], -1)                # [.., k, a, C + 2]
    # Y[k, a, s'] = [Phi(k, s'+1) w_s']_a (0 where k <= s'), Y[k, a, C + b] = Phi(k, 0)[a, b]
    n = 2 * (C + 1)
    sub = torch.diag_embed(At, offset=-1)                                        # [.., a, b, k, j]: A at k = j + 1
    eye = torch.eye(n, device=ref.device, dtype=dtype)
    L = eye - sub.permute(0, 1, 2, 5, 3, 6, 4).reshape(B, H, NC, n, n)
    Y = torch.linalg.solve_triangular(L, rhs.reshape(B, H, NC, n, C + 2), upper=False,
                                      unitriangular=True).view(B, H, NC, C + 1, 2, C + 2)
    # contractions over the two states, elementwise (as einsums they ran as batched GEMMs of 1 x 2 x C)
    e0, e1, r0, r1 = e[..., 0, None], e[..., 1, None], r[..., 0, None], r[..., 1, None]
    G = e0 * Y[..., :C, 0, :C] + e1 * Y[..., :C, 1, :C]
    Hm = r0 * Y[..., 1:, 0, :C] + r1 * Y[..., 1:, 1, :C]
    g = (e0 * Y[..., :C, 0, C:] + e1 * Y[..., :C, 1, C:]).transpose(-1, -2)
    h = (r0 * Y[..., 1:, 0, C:] + r1 * Y[..., 1:, 1, C:]).transpose(-1, -2)
    E = Y[..., C, :, :C]
    F = Y[..., C, :, C:].reshape(B, H, NC, 4)
    return G, Hm, g, h, E, F
