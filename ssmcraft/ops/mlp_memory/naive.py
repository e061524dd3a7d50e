"""The MLP memory's layer as a plain loop, by autograd's gradient of its loss: the readable twin of
its kernels, which its tests and its ``supports`` probe compare against in float64."""
from __future__ import annotations

import torch

ACTIVATIONS = {"silu": torch.nn.functional.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


def naive_mlp_memory(x, k, q, eta, W1, W2, act: str, w=None, decay=None, k2=None, x2=None):
    """One joint gradient step per token of ``eta/2 sum_i w_i (W2 act(W1 k) - x)_i^2`` in (W1, W2), both
    at their previous values, from the previous weights scaled by ``decay`` (a scalar decay ``alpha``,
    or ``1 - lam`` for weight decay); with a second key and target ``k2, x2`` their loss joins the
    first's; ``y_t = W2_t act(W1_t q_t)``.
    x [B, T, H, d]; k, q [B, T, H, m]; eta, decay [B, T, H] or None (= 1); w [B, T, H, d] or None (= 1);
    W1 [B, H, h, m]; W2 [B, H, d, h].
    Returns (y [B, T, H, d], W1_T, W2_T)."""
    f = ACTIVATIONS[act]

    def loss(A, C, kt, xt, wt):
        r = torch.einsum("bhda,bha->bhd", C, f(torch.einsum("bham,bhm->bha", A, kt))) - xt
        return (wt * r.square()).sum() / 2  # every (batch, head) its own: the gradient is per slice
    step = torch.func.grad(loss, argnums=(0, 1))      # differentiable, unlike a detached autograd.grad
    ys = []
    for t in range(k.shape[1]):
        wt = 1.0 if w is None else w[:, t]
        gA, gC = step(W1, W2, k[:, t], x[:, t], wt)
        if k2 is not None:
            gA2, gC2 = step(W1, W2, k2[:, t], x2[:, t], wt)
            gA, gC = gA + gA2, gC + gC2
        e = 1.0 if eta is None else eta[:, t, :, None, None]
        c = 1.0 if decay is None else decay[:, t, :, None, None]
        W1, W2 = c * W1 - e * gA, c * W2 - e * gC
        ys.append(torch.einsum("bhda,bha->bhd", W2, f(torch.einsum("bham,bhm->bha", W1, q[:, t]))))
    return torch.stack(ys, 1), W1, W2
