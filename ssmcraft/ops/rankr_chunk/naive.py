"""The chunked rank-r family's recurrence as a plain loop: the readable twin of its kernels, in their
layout (FLA's), which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_recurrent_rankr(v, u, p, oq, c, a, h0, ps=None):
    """The chunked rank-r family step by step (``ssmcraft.ops.rankr_chunk.chunk``): every term of a
    token reads the state the previous token left,

        H_t = a_t H - sum_i c_ti v_ti (u_ti^T H) + sum_i v_ti (ps_ti p_ti)^T,    o_t = H_t^T oq_t;

    u None means v, a and ps None mean 1. v, u [B, T, H, R, K]; p [B, T, H, R, V]; oq [B, T, H, K];
    c, ps [B, T, H, R] or [B, T, H] (the same for every term); a [B, T, H]; h0 [B, H, K, V].
    Returns (o [B, T, H, V], H_T [B, H, K, V])."""
    u = v if u is None else u
    R = v.shape[3]
    per_term = (lambda x: x if x.dim() == 4 else x[..., None].expand(*x.shape, R))
    c = per_term(c)
    p = p if ps is None else p * per_term(ps)[..., None]
    Hs, outs = h0, []
    for t in range(v.shape[1]):
        at = 1.0 if a is None else a[:, t, :, None, None]
        e = torch.einsum("bhik,bhkv->bhiv", u[:, t], Hs)                 # every term reads H_{t-1}
        Hs = (at * Hs - torch.einsum("bhi,bhik,bhiv->bhkv", c[:, t], v[:, t], e)
              + torch.einsum("bhik,bhiv->bhkv", v[:, t], p[:, t]))
        outs.append(torch.einsum("bhkv,bhk->bhv", Hs, oq[:, t]))
    return torch.stack(outs, 1), Hs
