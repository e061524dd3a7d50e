"""The chunked rank-1 family's recurrence as a plain loop: the readable twin of its kernels, in their
layout (FLA's), which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_recurrent_rank1(v, u, q, p, oq, c, a, h0, ps=None):
    """The chunked rank-1 family step by step in its kernels' layout (``ssmcraft.ops.rank1_chunk.chunk``):
    H_t = a_t H - c_t v_t (u_t^T H) + q_t (ps_t p_t)^T, o_t = H_t^T oq_t; u, q None mean v, a and ps
    None mean 1. v, u, q, oq [B, T, H, K]; p [B, T, H, V]; c, a, ps [B, T, H]; h0 [B, H, K, V].
    Returns (o [B, T, H, V], H_T [B, H, K, V])."""
    u = v if u is None else u
    q = v if q is None else q
    p = p if ps is None else p * ps[..., None]
    Hs, outs = h0, []
    for t in range(v.shape[1]):
        at = 1.0 if a is None else a[:, t, :, None, None]
        e = torch.einsum("bhk,bhkv->bhv", u[:, t], Hs)
        Hs = at * Hs - c[:, t, :, None, None] * v[:, t, :, :, None] * e[:, :, None, :] + q[:, t, :, :, None] * p[:, t, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", Hs, oq[:, t]))
    return torch.stack(outs, 1), Hs
