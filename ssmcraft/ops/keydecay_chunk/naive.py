"""The key-decay family's recurrence as a plain loop: the readable twin of its chunked kernels, in
their layout (FLA's ``chunk_gla`` with scale 1), which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_recurrent_key_decay(q, k, v, g, h0):
    """h_t = diag(e^{g_t}) h_{t-1} + k_t v_t^T, o_t = h_t^T q_t in the kernels' layout: q, k, g
    [B, T, H, K], v [B, T, H, V], h0 [B, H, K, V]. Returns (o [B, T, H, V], h_T [B, H, K, V])."""
    h, outs = h0, []
    for t in range(q.shape[1]):
        h = torch.exp(g[:, t])[..., None] * h + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", h, q[:, t]))
    return torch.stack(outs, 1), h
