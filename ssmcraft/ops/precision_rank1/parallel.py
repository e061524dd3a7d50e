"""The precision's parallel form: every segment's first precision from the key covariance, which
is linear across segments, instead of from the previous chunk's precision.

Each sequence (of a packed row, or each batch row) is cut into segments of ``C`` tokens from its
first token; a segment holds one or a few of the kernels' chunks. With Gamma_j the product of
segment j's lam and W_j = diag(beta_t prod_{s > t in j} lam_s),

    R_{j+1} = Gamma_j R_j + K_j^T W_j K_j

is one float64 product per segment: ``CovarianceFunction`` (``kernels.covariance_fwd_kernel``, one
program per (sequence, head)) stores R_j at every segment's first token and the final covariance.
Each segment's precision P_j = R_j^-1 (``inverse``: batched Cholesky) then seeds that segment's
chunked float64 steps (``kernels.precision_fwd_kernel``, the segments as the sequences of a packed
row: every (segment, head) its own program). The backward is the precision kernels' adjoint per
segment in parallel, ending with the inverse's (dR = -P dP P, in the same program), then the scan's
in reverse (``covariance_bwd_kernel``).

Why the inverse and not the precision chained across the whole sequence: a chained precision
carries every chunk's rounding forward, divided by each later Gamma; the covariance's scan only adds
positive semidefinite terms. Float64 algebra of the kernels (``naive.chunked_precision``), m = 64,
T = 2048, unit keys, R_0 = I, every gain against the per-token solve:

    lam in        chained     segments of 16    32         64       (R_j's largest condition number)
    [0.9, 1]      1.4e-15     1.1e-15           1.1e-15    1.2e-15  (2e1)
    [0.6, 0.95]   2.6e-7      6.7e-9            6.7e-9     1.5e-8   (5e9)
    [0.5, 0.85]   3.4e-3      6.5e-5            6.5e-5     1.9e-4   (7e13)

Through the layer (fp32 I/O, T = 1024, lam in [0.5, 0.85]): y off by 5e-3 chained, 5e-5 with
segments of 16 or 32, 1.3e-4 with 64, 2.3e-3 with 128. An inverse is as accurate as R_j's condition
number lets a float64 solve be, the float64 reference's included; within a segment a chunk still
ends where its Gamma falls below ``GAMMA_MIN`` and the kernel chains the segment's chunks as the
sequential form does.
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common.launch import launch
from ssmcraft.ops.common.tuning import buffer, pow2
from ssmcraft.ops.precision_rank1.kernels import covariance_bwd_kernel, covariance_fwd_kernel


def segments(cu: list[int], C: int) -> tuple[list[int], list[int]]:
    """The segments of C tokens of a packed row whose sequences lie at offsets ``cu`` ([N + 1] ints),
    each sequence's first at its first token: (their offsets in the row, [n_segments + 1], sequence by
    sequence; the index of each sequence's first segment, [N + 1])."""
    starts, first = [], [0]
    for a, b in zip(cu[:-1], cu[1:]):
        starts += range(a, b, C)
        first.append(len(starts))
    return [*starts, cu[-1]], first


class CovarianceFunction(torch.autograd.Function):
    """(k [T, H, K] fp32, lam [T, H] fp32, beta [T, H] fp32 | None, R0 [N, H, K, K] float64, cu int32
    [N + 1] offsets of the sequences, first int32 [N + 1] (``segments``), the number of segments, C,
    poison) -> (R at every segment's first token [n_segments, H, K, K], R_T [N, H, K, K]), float64:
    ``kernels.covariance_fwd_kernel``, backward ``covariance_bwd_kernel``. ``poison``: every buffer
    starts as NaN (tests)."""

    @staticmethod
    def forward(ctx, k, lam, beta, r0, cu, first, n_seg: int, C: int, poison: bool):
        T, H, K = k.shape
        N = r0.shape[0]
        r = buffer((n_seg, H, K, K), k.device, torch.float64, poison)
        rt = buffer((N, H, K, K), k.device, torch.float64, poison)
        launch(covariance_fwd_kernel, (N * H,), k=k, lam=lam, beta=lam if beta is None else beta, r0=r0, r=r, rt=rt,
               cu=cu, so=first, H=H, K=K, BK=pow2(K), C=C, HAS_BETA=beta is not None)
        ctx.save_for_backward(k, lam, beta, r, cu, first)
        ctx.C, ctx.N, ctx.poison = C, N, poison
        ctx.set_materialize_grads(False)
        return r, rt

    @staticmethod
    def backward(ctx, dr, drt):
        k, lam, beta, r, cu, first = ctx.saved_tensors
        T, H, K = k.shape
        dev, poison = k.device, ctx.poison
        dk = buffer(k.shape, dev, k.dtype, poison)
        dlam = buffer(lam.shape, dev, lam.dtype, poison)
        dbeta = buffer(beta.shape, dev, beta.dtype, poison) if beta is not None else dlam
        dr0 = buffer((ctx.N, H, K, K), dev, torch.float64, poison)
        dr = torch.zeros_like(r) if dr is None else dr.contiguous()
        launch(covariance_bwd_kernel, (ctx.N * H,), k=k, lam=lam, beta=lam if beta is None else beta, r=r, dr=dr,
               drt=dr if drt is None else drt.contiguous(), dk=dk, dlam=dlam, dbeta=dbeta, dr0=dr0, cu=cu, so=first,
               H=H, K=K, BK=pow2(K), C=ctx.C, HAS_BETA=beta is not None, HAS_DRT=drt is not None)
        return dk, dlam, (dbeta if beta is not None else None), dr0, None, None, None, None, None


def inverse(R: torch.Tensor) -> torch.Tensor:
    """R^-1 of a batch of symmetric positive definite float64 matrices [n, H, K, K] (the lower
    triangle is read) by Cholesky (a batched factorization, then ``cholesky_inverse``): symmetric up
    to rounding (the precision kernel symmetrises it as it loads it); NaN where the factorization
    fails (R not positive definite in float64), as the sequential form's chunk step turns a negative
    pivot into NaN. Its gradient, dR = -P dP P, is taken in the precision kernels' backward
    (``chunk.PrecisionFunction`` with ``from_r``), where P is at hand."""
    L, info = torch.linalg.cholesky_ex(R)
    return torch.cholesky_inverse(L).masked_fill((info > 0)[..., None, None], float("nan"))
