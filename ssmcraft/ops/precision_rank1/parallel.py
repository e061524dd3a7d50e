"""The precision's chunk-parallel form: every chunk's first precision from the key covariance,
which is linear across chunks, instead of from the previous chunk's precision.

The sequence is cut into a fixed grid of chunks of ``C`` tokens (per sequence of a packed row). With
Gamma_j the product of chunk j's lam and W_j = diag(beta_t prod_{s > t in j} lam_s),

    R_{j+1} = Gamma_j R_j + K_j^T W_j K_j,   so   R_j = e^{E_j} R_0 + sum_{i < j} e^{E_j - E_{i+1}} K_i^T W_i K_i

(E_j = sum_{l < j} log Gamma_l): one batched product of a [J + 1, J] weight matrix with the chunks'
[K, K] terms, all in float64, no recurrence. Each chunk's precision P_j = R_j^-1 (Cholesky) then
seeds that chunk's float64 step (``kernels.precision_fwd_kernel``), every (sequence, chunk, head)
its own program; R_J is the final covariance. The backward is the kernels' chunk adjoint per chunk
in parallel, then the adjoint of the inverse and of the product above (the reverse scan: the
weight matrix transposed), by autograd.

Why the inverse and not the chained Woodbury steps: a precision chained over many chunks carries
every chunk's rounding forward, divided by each later Gamma, and the covariance form does not: at
m = 64, T = 2048, unit keys and lam in [0.6, 0.95] the chained form meets a negative pivot while
the inverse per chunk matches the per-token solve to ~7e-9 (lam in [0.9, 1]: 1.3e-5 against
1e-15). An inverse is as accurate as R_j's condition number lets any float64 solve be, the float64
reference's included; a chunk still ends early where its Gamma falls below ``GAMMA_MIN`` (the
kernel cuts it and chains its pieces, as the sequential form does).
"""
from __future__ import annotations

import torch


def grid(cu: list[int], C: int, device) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The fixed chunk grid of a packed row whose sequences lie at offsets ``cu`` ([N + 1] ints):
    (token index [N, J, C] (int64, ``cu[-1]`` past a sequence's end: a padding row), the chunks'
    offsets in the row ([n_chunks + 1] ints, sequence by sequence), which grid chunks are real
    [N, J] bool). J = the longest sequence's number of chunks."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    J = max(1, *((n + C - 1) // C for n in lengths))
    pos = torch.arange(J * C, device=device).view(1, J, C)
    bos = torch.tensor(cu[:-1], device=device).view(-1, 1, 1)
    n = torch.tensor(lengths, device=device).view(-1, 1, 1)
    idx = torch.where(pos < n, bos + pos, cu[-1])
    starts = [a + j for a, b in zip(cu[:-1], cu[1:]) for j in range(0, b - a, C)]
    real = (torch.arange(J, device=device).view(1, J) * C) < n.view(-1, 1)
    return idx, [*starts, cu[-1]], real


def boundary_covariances(k, lam, beta, R0, idx) -> torch.Tensor:
    """R at every grid chunk's first token and after the last (the module docstring's sum).
    k [T, H, K], lam [T, H], beta [T, H] | None (= 1), all float64; R0 [N, H, K, K] float64;
    ``idx`` from ``grid``. Returns R [N, H, J + 1, K, K] (padding chunks change nothing: R_J is every
    sequence's final covariance)."""
    H, K = k.shape[1:]
    pad = lambda t, v: torch.cat([t, torch.full((1, *t.shape[1:]), v, dtype=t.dtype, device=t.device)])  # noqa: E731
    kg = pad(k, 0.)[idx]                                         # [N, J, C, H, K]
    lg = pad(lam, 1.)[idx]                                       # [N, J, C, H]
    w = lg.new_ones(()) if beta is None else pad(beta, 0.)[idx]
    inc = torch.cumprod(lg.flip(2), 2).flip(2)                   # prod_{s >= t} lam_s within the chunk
    w = w * torch.cat([inc[:, :, 1:], torch.ones_like(inc[:, :, :1])], 2)
    term = torch.einsum("njchk,njch,njchl->nhjkl", kg, w, kg)     # [N, H, J, K, K]
    N, _, J = term.shape[:3]
    E = torch.cat([lg.new_zeros(N, H, 1), torch.cumsum(torch.log(lg).sum(2).transpose(1, 2), -1)], -1)  # [N, H, J + 1]
    later = torch.arange(J + 1, device=k.device)[:, None] > torch.arange(J, device=k.device)[None, :]
    weights = torch.exp((E[..., :, None] - E[..., None, 1:]).masked_fill(~later, float("-inf")))  # [N, H, J + 1, J]
    R = (weights @ term.reshape(N, H, J, K * K)).view(N, H, J + 1, K, K) + torch.exp(E)[..., None, None] * R0[:, :, None]
    return 0.5 * (R + R.transpose(-1, -2))


def precisions(R: torch.Tensor) -> torch.Tensor:
    """R^-1 of a batch of symmetric positive definite float64 matrices by Cholesky, exactly symmetric
    (the kernels rely on it); NaN where the factorization fails (R not positive definite in float64),
    as the sequential form's chunk step turns a negative pivot into NaN."""
    L, info = torch.linalg.cholesky_ex(R)
    P = torch.cholesky_inverse(L)
    P = 0.5 * (P + P.transpose(-1, -2))
    return torch.where((info > 0)[..., None, None], float("nan"), P)
