"""The block rank-1 recurrence as a plain loop over its slots: the readable twin of the family's
kernels, and what the tests check the compiler's block stage (``ssmcraft.compiler.blockrank1``)
with against the derived update, in float64."""
from __future__ import annotations

import torch


def naive_block_rank1(co: dict, n_states: int, S0: tuple):
    """Per row of every state (math layout ``[B, H, d, m]``)::

        U = sum_b e_b X_b,  z = U u,  R = p q - c z v,  X_a' = sum_b a_ab X_b + w_a R
        y = oc ((sum_a r_a X_a') oq) + oh

    co: slot -> ``[B|1, T|1, H|1, r, c]`` (``r`` d or 1, ``c`` m or 1; what an objective's
    generated ``coefficients`` returns) or a number; an absent ``p``/``oh`` is 0. S0: one
    ``[B, H, d, m]`` per state. Returns (y ``[B, T, H, d]``, final states)."""
    T = max(x.shape[1] for x in co.values() if isinstance(x, torch.Tensor))
    at = lambda x, t: x[:, t if x.shape[1] > 1 else 0] if isinstance(x, torch.Tensor) else x  # noqa: E731
    X = list(S0)
    ys = []
    for t in range(T):
        s = {k: at(v, t) for k, v in co.items()}
        U = sum(s[f"e{b}"] * X[b] for b in range(n_states))
        z = (U * s["u"]).sum(-1, keepdim=True)
        R = s.get("p", 0) * s.get("q", 0) - s["c"] * z * s["v"]
        X = [sum(s[f"a{a}{b}"] * X[b] for b in range(n_states)) + s[f"w{a}"] * R for a in range(n_states)]
        read = sum(s[f"ro{a}"] * X[a] for a in range(n_states))
        y = s["oc"] * (read * s["oq"]).sum(-1, keepdim=True) + s.get("oh", 0)
        ys.append(y[..., 0])
    return torch.stack(ys, 1), tuple(X)
