"""The chunked mini-batch family's recurrence as a plain loop: the readable twin of its kernels, in
their layout (FLA's), which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_minibatch(u, v, p, c, oq, a, h0, chunk_size):
    """H_t = a_t H_{t-1} - v_t (c_t . (H_c^T u_t - p_t))^T, H_c the state before t's chunk of
    ``chunk_size`` tokens; o_t = H_t^T oq_t. u, v, oq [B, T, H, K]; p [B, T, H, V]; c [B, T, H] or
    [B, T, H, V]; a [B, T, H] or None (= 1); h0 [B, H, K, V]. Returns (o [B, T, H, V], H_T)."""
    Hs, outs = h0, []
    c = c[..., None] if c.dim() == 3 else c
    for t in range(u.shape[1]):
        if t % chunk_size == 0:
            Hc = Hs
        at = 1.0 if a is None else a[:, t, :, None, None]
        rc = c[:, t] * (torch.einsum("bhk,bhkv->bhv", u[:, t], Hc) - p[:, t])
        Hs = at * Hs - v[:, t, :, :, None] * rc[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", Hs, oq[:, t]))
    return torch.stack(outs, 1), Hs
