"""The per-row rank-1 family's recurrence as a plain loop: the readable twin of its kernels, in
their layout, which its tests compare against in float64."""
from __future__ import annotations

import torch


def naive_recurrent_rank1_row(u, v, q, oq, a, c, p, oc, oh, S0, key_decay=False):
    """s_t,i = a_i s_{t-1,i} - c_i (s_{t-1,i} . u_t) v_t + p_i q_t, y_t,i = oc_i (s_t,i . oq_t) + oh_i
    per state row i: u, v, q, oq [B, T, H, K]; a, c, p, oc, oh [B, T, H, V] (per row) or [B, T, H]
    (per head); ``key_decay``: a [B, T, H, K], s_t,i = a o s_{t-1,i} - ...; S0 [B, H, K, V] (FLA's
    layout). Returns (y [B, T, H, V], S_T [B, H, K, V])."""
    S = S0.transpose(-1, -2)                       # [B, H, V, K]
    ys = []
    row = lambda x, t: x[:, t, :, None, None] if x.dim() == 3 else x[:, t, :, :, None]  # noqa: E731
    for t in range(u.shape[1]):
        z = (S * u[:, t, :, None, :]).sum(-1, keepdim=True)
        S = (a[:, t, :, None, :] if key_decay else row(a, t)) * S - row(c, t) * z * v[:, t, :, None, :] + row(p, t) * q[:, t, :, None, :]
        ys.append(row(oc, t)[..., 0] * (S * oq[:, t, :, None, :]).sum(-1) + oh[:, t])
    return torch.stack(ys, 1), S.transpose(-1, -2)
