"""Learned objective parameters (the spec's ``params:``): initial values and sign constraints.

Each parameter is stored per head as a raw tensor ``[H, *shape]`` (shape sizes from the
layer's ``d`` and ``m``). A sign constraint is a reparametrisation, as Mamba stores ``A``:

- ``negative: true``: stored ``log(-value)``, used as ``-exp(raw)``;
- ``positive: true``: stored ``log(value)``, used as ``exp(raw)``;
- otherwise stored and used as is.

Initialisers (``init:``): ``zeros``, ``ones``, ``s4d_real`` (``-(j + 1)`` along the last
axis: Mamba's S4D-real ``A[i, j] = -(j + 1)``; ``-1`` for a scalar), ``retnet_decay``
(``1 - 2**(-5 - h)`` for head ``h``), ``{constant: c}``, ``{uniform: [a, b]}``,
``{normal: [mean, std]}``, ``{log_uniform: [a, b]}``. An initial value that violates the
declared sign is an error, never silently clipped.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ssmcraft.errors import SsmcraftError


def initial_value(decl, sizes: dict[str, int], heads: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The initial (constrained) value ``[heads, *shape]`` of a ``ParamDecl``."""
    shape = (heads, *(sizes[n] for n in decl.shape))
    init: Any = decl.init
    if isinstance(init, (int, float)) and not isinstance(init, bool):
        init = {"constant": float(init)}
    if init == "zeros":
        return torch.zeros(shape)
    if init == "ones":
        return torch.ones(shape)
    if init == "s4d_real":
        if not decl.shape:
            return -torch.ones(shape)
        return (-(torch.arange(shape[-1], dtype=torch.float32) + 1)).expand(shape).clone()
    if init == "retnet_decay":
        gamma = 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float32))
        return gamma.view(heads, *([1] * len(decl.shape))).expand(shape).clone()
    if isinstance(init, dict) and len(init) == 1:
        (form, args), = init.items()
        args = args if isinstance(args, (list, tuple)) else [args]
        if form == "constant":
            return torch.full(shape, float(args[0]))
        if form == "uniform":
            return torch.empty(shape).uniform_(float(args[0]), float(args[1]), generator=generator)
        if form == "normal":
            return torch.empty(shape).normal_(float(args[0]), float(args[1]), generator=generator)
        if form == "log_uniform":
            lo, hi = math.log(float(args[0])), math.log(float(args[1]))
            return torch.exp(torch.empty(shape).uniform_(lo, hi, generator=generator))
    raise SsmcraftError(f"param {decl.name}: unknown initialiser {decl.init!r}")


def to_raw(decl, value: torch.Tensor) -> torch.Tensor:
    """The stored tensor for a constrained ``value`` (inverse of ``from_raw``)."""
    if decl.negative:
        if not bool((value < 0).all()):
            raise SsmcraftError(f"param {decl.name}: declared negative but its init {decl.init!r} gives values >= 0")
        return torch.log(-value)
    if decl.positive:
        if not bool((value > 0).all()):
            raise SsmcraftError(f"param {decl.name}: declared positive but its init {decl.init!r} gives values <= 0")
        return torch.log(value)
    return value


def from_raw(decl, raw: torch.Tensor) -> torch.Tensor:
    """The value the recurrence sees, from the stored tensor."""
    if decl.negative:
        return -torch.exp(raw)
    if decl.positive:
        return torch.exp(raw)
    return raw
