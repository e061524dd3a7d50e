"""The precision family's layer as a plain loop over the covariance itself (a solve per token, no
Sherman-Morrison): the readable twin of its kernels, which its tests and its ``supports`` probe
compare against in float64."""
from __future__ import annotations

import torch


def naive_precision_rank1(k, x, q, lam, beta, eta, R0, S0):
    """R_t = lam_t R_{t-1} + beta_t k_t k_t^T,  g_t = eta_t R_t^{-1} k_t,
    S_t = S_{t-1} - (S_{t-1} k_t - x_t) g_t^T,  y_t = S_t q_t.
    k, q [B, T, H, m]; x [B, T, H, d]; lam, beta, eta [B, T, H] (beta, eta None = 1); R0 [B, H, m, m];
    S0 [B, H, d, m]. Returns (y [B, T, H, d], R_T, S_T)."""
    R, S, ys = R0, S0, []
    for t in range(k.shape[1]):
        kt = k[:, t]
        bt = 1.0 if beta is None else beta[:, t, :, None]
        R = lam[:, t, :, None, None] * R + (bt * kt)[..., :, None] * kt[..., None, :]
        g = (1.0 if eta is None else eta[:, t, :, None]) * torch.linalg.solve(R, kt)
        r = torch.einsum("bhdm,bhm->bhd", S, kt) - x[:, t]
        S = S - r[..., :, None] * g[..., None, :]
        ys.append(torch.einsum("bhdm,bhm->bhd", S, q[:, t]))
    return torch.stack(ys, 1), R, S
