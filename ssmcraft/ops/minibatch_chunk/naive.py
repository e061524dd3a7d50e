"""The chunked mini-batch family's recurrence as a plain loop: the readable twin of its kernels, in
their layout (FLA's), which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_minibatch(u, v, p, c, oq, a, h0, chunk_size, lam=None):
    """H_t = a_t H_{t-1} - v_t (c_t . (H_c^T u_t - p_t))^T - lam_t H_c, H_c the state before t's chunk
    of ``chunk_size`` tokens; o_t = H_t^T oq_t. u (or None: no prediction), v, oq [B, T, H, K];
    p [B, T, H, V]; c [B, T, H] or [B, T, H, V]; a, lam [B, T, H] or None (= 1, = 0);
    h0 [B, H, K, V]. Returns (o [B, T, H, V], H_T)."""
    Hs, outs = h0, []
    c = c[..., None] if c.dim() == 3 else c
    for t in range(v.shape[1]):
        if t % chunk_size == 0:
            Hc = Hs
        at = 1.0 if a is None else a[:, t, :, None, None]
        pred = 0.0 if u is None else torch.einsum("bhk,bhkv->bhv", u[:, t], Hc)
        rc = c[:, t] * (pred - p[:, t])
        Hs = at * Hs - v[:, t, :, :, None] * rc[:, :, None, :]
        if lam is not None:
            Hs = Hs - lam[:, t, :, None, None] * Hc
        outs.append(torch.einsum("bhkv,bhk->bhv", Hs, oq[:, t]))
    return torch.stack(outs, 1), Hs
