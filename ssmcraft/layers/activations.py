"""How a projected input becomes the value its declaration promises.

Rule (``implied_activation``), first match wins:

1. ``activation:`` given in the spec: that function;
2. ``bounded: true`` (value in (0, 1)): sigmoid;
3. ``positive: true``: softplus;
4. otherwise the mixer's ``plain_activation`` (identity by default, ``silu`` as in Mamba-2/GLA
   keys and queries).

``normalize: true`` then divides by the L2 norm over the input's vector dimension (after
the elementwise function).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "identity": lambda x: x,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "softplus": F.softplus,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "relu": F.relu,
    "elu1": lambda x: F.elu(x) + 1.0,
}


def implied_activation(decl, plain: str = "identity") -> str:
    """The elementwise function for an ``InputDecl`` (see the module docstring)."""
    if decl.activation is not None:
        return decl.activation
    if decl.bounded:
        return "sigmoid"
    if decl.positive:
        return "softplus"
    return plain


def apply_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name](x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / ||x||`` over the last dimension (``eps`` keeps a zero vector finite)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` for ``y > 0`` (stable for small and large ``y``)."""
    return y + torch.log(-torch.expm1(-y))


def log_uniform(n: int, low: float, high: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` samples with log-uniform distribution on ``[low, high]``."""
    u = torch.rand(n, generator=generator)
    return torch.exp(u * (math.log(high) - math.log(low)) + math.log(low))
