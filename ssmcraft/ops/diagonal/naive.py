"""The diagonal family's recurrence as a plain loop over its slots: the readable twin of the
generated kernels, in their layout (the state transposed, ``[K, V]``, as FLA keeps it)."""
from __future__ import annotations

import torch


def naive_recurrent_diagonal(a, p, q, oq, h0, oc=None, oh=None):
    """h_t = a_t . h_{t-1} + q_t p_t^T,  o_t = oc_t . (h_t^T oq_t) + oh_t.

    a: the decay, broadcastable to ``[B, T, H, K, V]`` (a number, per head ``[B, T, H, 1, 1]``,
    over keys ``[B, T, H, K, 1]``, over values ``[B, T, H, 1, V]`` or over both); p ``[B, T, H, V]``;
    q, oq ``[B, T, H, K]``; oc, oh ``[B, T, H, V]`` or None (1 and 0); h0 ``[B, H, K, V]``.
    Returns (o ``[B, T, H, V]``, h_T ``[B, H, K, V]``)."""
    a = torch.as_tensor(a, dtype=h0.dtype)
    h, outs = h0, []
    for t in range(p.shape[1]):
        at = a[:, t] if a.dim() == 5 else a
        h = at * h + q[:, t, :, :, None] * p[:, t, :, None, :]
        o = torch.einsum("bhkv,bhk->bhv", h, oq[:, t])
        if oc is not None:
            o = oc[:, t] * o
        outs.append(o if oh is None else o + oh[:, t])
    return torch.stack(outs, 1), h
