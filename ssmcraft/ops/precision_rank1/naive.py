"""The precision family's layer as a plain loop over the covariance itself (a solve per token, no
Sherman-Morrison): the readable twin of its kernels, which its tests and its ``supports`` probe
compare against in float64; and the kernels' chunked algebra of the precision in plain PyTorch
(``chunked_precision``), which its tests check against that loop."""
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


def chunked_precision(k, lam, beta, eta, P0, chunk: int, gamma_min: float, segment: int | None = None):
    """The kernels' chunked algebra in plain PyTorch (one sequence and head at a time, float64 in,
    float64 out): chunks of at most ``chunk`` tokens, each ending before its Gamma (the product of
    its lam) falls below ``gamma_min``; per chunk A = diag(Gamma / beta) + K P K^T = L L^T,
    V = L^-1 K P, gains diag(eta / (beta diag(L))) V, P <- (P - V^T V) / Gamma_C (V^T V symmetrised,
    as the kernels do). ``segment``: the parallel form, where no chunk crosses a multiple of
    ``segment`` tokens and P restarts there from the covariance's inverse (R carried token by token
    from R_0 = P0^-1). k [B, T, H, m]; lam, beta, eta [B, T, H] (beta, eta None = 1); P0 [B, H, m, m].
    Returns (g [B, T, H, m], P_T [B, H, m, m])."""
    B, T, H, _ = k.shape
    one = torch.ones_like(lam)
    beta, eta = (one if beta is None else beta), (one if eta is None else eta)
    seg = T if segment is None else segment
    g, PT = torch.zeros_like(k), torch.empty_like(P0)
    for b in range(B):
        for h in range(H):
            P, R, s = P0[b, h], torch.linalg.inv(P0[b, h]), 0
            while s < T:
                if s % seg == 0 and s > 0:
                    P = torch.cholesky_inverse(torch.linalg.cholesky(0.5 * (R + R.T)))
                gam = torch.cumprod(lam[b, s:min(s + chunk, s + seg - s % seg), h], 0)
                n = max(1, int((gam >= gamma_min).cumprod(0).sum()))
                K, gam, bt = k[b, s:s + n, h], gam[:n], beta[b, s:s + n, h]
                L = torch.linalg.cholesky(torch.diag(gam / bt) + K @ P @ K.T)
                V = torch.linalg.solve_triangular(L, K @ P, upper=False)
                g[b, s:s + n, h] = (eta[b, s:s + n, h] / (bt * torch.diagonal(L)))[:, None] * V
                W = V.T @ V
                P = (P - 0.5 * (W + W.T)) / gam[-1]
                for t in range(s, s + n):
                    R = lam[b, t, h] * R + beta[b, t, h] * torch.outer(k[b, t, h], k[b, t, h])
                s += n
            PT[b, h] = P
    return g, PT


def segment_covariances(k, lam, beta, R0, cu: list[int], C: int):
    """The parallel form's covariance scan token by token: R_t = lam_t R_{t-1} + beta_t k_t k_t^T from
    each sequence's R0, recorded at every segment's first token (segments of C tokens from each
    sequence's first). k [T, H, m], lam, beta [T, H] (beta None = 1), R0 [N, H, m, m], ``cu`` the
    sequences' offsets ([N + 1] ints). Returns (R [n_segments, H, m, m], R_T [N, H, m, m])."""
    seg, fin = [], []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        R = R0[n]
        for t in range(a, b):
            if (t - a) % C == 0:
                seg.append(R)
            bt = 1.0 if beta is None else beta[t, :, None, None]
            R = lam[t, :, None, None] * R + bt * k[t, :, :, None] * k[t, :, None, :]
        fin.append(R)
    return (torch.stack(seg) if seg else R0.new_zeros(0, *R0.shape[1:])), torch.stack(fin)
