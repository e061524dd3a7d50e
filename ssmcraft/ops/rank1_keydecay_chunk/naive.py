"""The chunked rank-1 key-decay family's recurrence as a plain loop: the readable twin of its
kernels, in their layout (FLA's), which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_recurrent_rank1_keydecay(v, u, p, oq, c, a, h0):
    """H_t = diag(a_t) H - c_t v_t (u_t^T H) + v_t p_t^T, o_t = H_t^T oq_t, step by step in the
    kernels' layout (``ssmcraft.ops.rank1_keydecay_chunk.chunk``); u None means v. v, u, oq, a
    [B, T, H, K]; p [B, T, H, V]; c [B, T, H]; h0 [B, H, K, V].
    Returns (o [B, T, H, V], H_T [B, H, K, V])."""
    u = v if u is None else u
    Hs, outs = h0, []
    for t in range(v.shape[1]):
        e = torch.einsum("bhk,bhkv->bhv", u[:, t], Hs)
        Hs = (a[:, t, :, :, None] * Hs + v[:, t, :, :, None] * (p[:, t, :, None, :] - c[:, t, :, None, None] * e[:, :, None, :]))
        outs.append(torch.einsum("bhkv,bhk->bhv", Hs, oq[:, t]))
    return torch.stack(outs, 1), Hs
