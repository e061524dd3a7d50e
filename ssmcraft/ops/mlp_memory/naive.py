"""The MLP memory's layer as a plain loop, by autograd's gradient of its loss: the readable twin of
its kernels, which its tests and its ``supports`` probe compare against in float64."""
from __future__ import annotations

import torch

ACTIVATIONS = {"silu": torch.nn.functional.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


# the data term as a function of the prediction p, the target x and the row weight w, per (batch, head):
# each sums over the output rows (the norm ones: a robust loss of the weighted residual's norm)
DATA = {
    "regression": lambda p, x, w: (w * (p - x).square()).sum(-1) / 2,
    "linear": lambda p, x, w: -(w * p * x).sum(-1),
    "huber": lambda p, x, w: (w * (torch.sqrt(1 + (p - x).square()) - 1)).sum(-1),
    "cauchy": lambda p, x, w: (w * torch.log1p((p - x).square())).sum(-1) / 2,
    "huber_norm": lambda p, x, w: torch.sqrt(1 + (w * (p - x).square()).sum(-1)) - 1,
    "cauchy_norm": lambda p, x, w: torch.log1p((w * (p - x).square()).sum(-1)) / 2,
}


def naive_mlp_memory(x, k, q, eta, W1, W2, act: str, w=None, decay=None, k2=None, x2=None, *, weight_decay=None,
                     data: str = "regression", minibatch: int = 0):
    """One joint gradient step per token of ``eta l(W2 act(W1 k), x, w)`` in (W1, W2) (``l`` the data
    term ``DATA[data]``; regression: ``1/2 sum_i w_i (W2 act(W1 k) - x)_i^2``), from the previous weights
    scaled by ``decay`` (alpha), minus ``weight_decay`` (lam) times the weights the gradient is taken
    at; with a second key and target ``k2, x2`` their loss joins the first's; ``y_t = W2_t act(W1_t q_t)``.
    The gradient is taken at the previous weights, or with ``minibatch`` C at the weights before the
    token's chunk of C (chunks from t = 0).
    x [B, T, H, d]; k, q [B, T, H, m]; eta, decay, weight_decay [B, T, H] or None (= 1, 1, 0);
    w [B, T, H, d] or None (= 1); W1 [B, H, h, m]; W2 [B, H, d, h].
    Returns (y [B, T, H, d], W1_T, W2_T)."""
    f = ACTIVATIONS[act]
    term = DATA[data]

    def loss(A, C, kt, xt, wt):
        p = torch.einsum("bhda,bha->bhd", C, f(torch.einsum("bham,bhm->bha", A, kt)))
        return term(p, xt, wt).sum()        # every (batch, head) its own: the gradient is per slice
    step = torch.func.grad(loss, argnums=(0, 1))      # differentiable, unlike a detached autograd.grad
    ys = []
    P1, P2 = W1, W2
    for t in range(k.shape[1]):
        if not minibatch or t % minibatch == 0:
            P1, P2 = W1, W2
        wt = 1.0 if w is None else w[:, t]
        gA, gC = step(P1, P2, k[:, t], x[:, t], wt)
        if k2 is not None:
            gA2, gC2 = step(P1, P2, k2[:, t], x2[:, t], wt)
            gA, gC = gA + gA2, gC + gC2
        e = 1.0 if eta is None else eta[:, t, :, None, None]
        c = 1.0 if decay is None else decay[:, t, :, None, None]
        lam = 0.0 if weight_decay is None else weight_decay[:, t, :, None, None]
        W1, W2 = c * W1 - lam * P1 - e * gA, c * W2 - lam * P2 - e * gC
        ys.append(torch.einsum("bhda,bha->bhd", W2, f(torch.einsum("bham,bhm->bha", W1, q[:, t]))))
    return torch.stack(ys, 1), W1, W2
