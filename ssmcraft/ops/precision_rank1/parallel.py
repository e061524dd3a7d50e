"""The precision's parallel form: every segment's first precision from the key covariance, which
is linear across segments, instead of from the previous chunk's precision.

The sequence is cut into a fixed grid of segments of ``C`` tokens (per sequence of a packed row; a
segment holds one or a few of the kernels' chunks). With Gamma_j the product of segment j's lam and
W_j = diag(beta_t prod_{s > t in j} lam_s),

    R_{j+1} = Gamma_j R_j + K_j^T W_j K_j,   so   R_j = e^{E_j} R_0 + sum_{i < j} e^{E_j - E_{i+1}} K_i^T W_i K_i

(E_j = sum_{l < j} log Gamma_l): one batched product of a [J + 1, J] weight matrix with the
segments' [K, K] terms, all in float64, no recurrence. Each segment's precision P_j = R_j^-1
(Cholesky) then seeds that segment's chunked float64 steps (``kernels.precision_fwd_kernel``, the
segments as the sequences of a packed row: every (segment, head) its own program); R_J is the final
covariance. The backward is the kernels' adjoint per segment in parallel, then the inverse's
(dR = -P dP P) and the product's (the reverse scan: the weight matrix transposed), by autograd.

Why the inverse and not the precision chained across the whole sequence: a chained precision
carries every chunk's rounding forward, divided by each later Gamma, and the covariance does not.
Float64, m = 64, T = 2048, unit keys, R_0 = I, every gain against the per-token solve:

    lam in        chained     segments of 16    32         64       (R_j's largest condition number)
    [0.9, 1]      1.3e-5      1.1e-15           1.1e-15    1.2e-15  (2e1)
    [0.6, 0.95]   NaN         6.7e-9            6.7e-9     1.6e-8   (5e9)
    [0.5, 0.85]   NaN         6.5e-5            6.5e-5     2.3e-4   (7e13)

(NaN: a negative pivot.) An inverse is as accurate as R_j's condition number lets a float64 solve
be, the float64 reference's included; within a segment a chunk still ends where its Gamma falls
below ``GAMMA_MIN`` and the kernel chains the segment's chunks as the sequential form does.
"""
from __future__ import annotations

import torch


def grid(cu: list[int], C: int, device) -> tuple[torch.Tensor, list[int], list[int] | None]:
    """The fixed segment grid of a packed row whose sequences lie at offsets ``cu`` ([N + 1] ints):
    (token index [N, J, C] (int64, ``cu[-1]`` past a sequence's end: a padding row), the segments'
    offsets in the row ([n_segments + 1] ints, sequence by sequence), the flat grid positions n J + j
    of the real segments in that order, or None when every grid segment is real). J = the longest
    sequence's number of segments."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    counts = [(n + C - 1) // C for n in lengths]
    J = max(1, *counts)
    pos = torch.arange(J * C, device=device).view(1, J, C)
    bos = torch.tensor(cu[:-1], device=device).view(-1, 1, 1)
    idx = torch.where(pos < torch.tensor(lengths, device=device).view(-1, 1, 1), bos + pos, cu[-1])
    starts = [a + j for a, b in zip(cu[:-1], cu[1:]) for j in range(0, b - a, C)]
    real = None if all(c == J for c in counts) else [n * J + j for n, c in enumerate(counts) for j in range(c)]
    return idx, [*starts, cu[-1]], real


def boundary_covariances(k, lam, beta, R0, idx) -> torch.Tensor:
    """R at every grid segment's first token and after the last (the module docstring's sum).
    k [T, H, K], lam [T, H], beta [T, H] | None (= 1), all float64; R0 [N, H, K, K] float64;
    ``idx`` from ``grid``. Returns R [N, H, J + 1, K, K] (padding segments change nothing: R_J is every
    sequence's final covariance), symmetric up to rounding: its Cholesky factor reads the lower triangle."""
    H, K = k.shape[1:]
    pad = lambda t, v: torch.cat([t, torch.full((1, *t.shape[1:]), v, dtype=t.dtype, device=t.device)])  # noqa: E731
    kg = pad(k, 0.)[idx]                                         # [N, J, C, H, K]
    lg = pad(lam, 1.)[idx]                                       # [N, J, C, H]
    w = lg.new_ones(()) if beta is None else pad(beta, 0.)[idx]
    inc = torch.cumprod(lg.flip(2), 2).flip(2)                   # prod_{s >= t} lam_s within the segment
    w = w * torch.cat([inc[:, :, 1:], torch.ones_like(inc[:, :, :1])], 2)
    term = torch.einsum("njchk,njch,njchl->nhjkl", kg, w, kg)     # [N, H, J, K, K]
    N, _, J = term.shape[:3]
    E = torch.cat([lg.new_zeros(N, H, 1), torch.cumsum(torch.log(lg).sum(2).transpose(1, 2), -1)], -1)  # [N, H, J + 1]
    later = torch.arange(J + 1, device=k.device)[:, None] > torch.arange(J, device=k.device)[None, :]
    weights = torch.exp((E[..., :, None] - E[..., None, 1:]).masked_fill(~later, float("-inf")))  # [N, H, J + 1, J]
    return (weights @ term.reshape(N, H, J, K * K)).view(N, H, J + 1, K, K) + torch.exp(E)[..., None, None] * R0[:, :, None]


class _Inverse(torch.autograd.Function):
    """R^-1 of a batch of symmetric positive definite float64 matrices [..., K, K] by Cholesky (a
    batched factorization, a batched triangular solve, a product), exactly symmetric (the kernels
    rely on it); NaN where the factorization fails (R not positive definite in float64), as the
    sequential form's chunk step turns a negative pivot into NaN. Backward: dR = -P dP P."""

    @staticmethod
    def forward(ctx, R):
        L, info = torch.linalg.cholesky_ex(R)
        eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device).expand_as(R)
        Li = torch.linalg.solve_triangular(L, eye, upper=False)
        P = Li.transpose(-1, -2) @ Li
        P = torch.where((info > 0)[..., None, None], float("nan"), 0.5 * (P + P.transpose(-1, -2)))
        ctx.save_for_backward(P)
        return P

    @staticmethod
    def backward(ctx, dP):
        P, = ctx.saved_tensors
        return -(P @ dP @ P)


def precisions(R: torch.Tensor) -> torch.Tensor:
    """``_Inverse`` of R [..., K, K] (float64, symmetric: its lower triangle is read)."""
    return _Inverse.apply(R)
