"""One-token steps (decode): one fused Triton kernel per objective, for every structure class.

A recurrent step (``ObjectiveMixer.step``, generation) calls the objective with ``T = 1``. The
chunked families would launch their whole chunked pipeline (four to six kernels and the PyTorch
coefficient work) for one token; this family instead runs the fused sequential kernel of
``ssmcraft.kernels.general`` generated from the update in element form
(``ssmcraft.compiler.structure.element_form``): coefficients, state update and readout in one
launch, the state read once and written once. It is first in the dispatch order and takes only
``T = 1`` calls (``supports_inputs``); gradients flow as in ``general`` (its backward kernel).
"""
from __future__ import annotations

import torch
import triton

BACKEND_NAME = "decode-fused"


def supports(ir) -> str | None:
    """Every structure class with a structured or element-wise readout (cheap: kind only; the
    kernel itself is generated on the first one-token call)."""
    if ir.kind not in ("scalar_decay", "diagonal_decay", "rank1", "rankr", "general", "nonlinear"):
        return f"structure {ir.kind!r} has no element form"
    if getattr(ir, "states", ()):
        return "several states: the general family's fused kernel runs their one-token calls"
    return None


def supports_inputs(ir, inputs, mode) -> str | None:
    first = next(iter(inputs.values()))
    if first.dim() < 2 or first.shape[1] != 1:
        return f"only one-token calls (T = 1); this call has T = {first.shape[1] if first.dim() > 1 else '?'}"
    return None


def prepare(obj, lay):
    """The runner for one call signature (``lay`` from ``reference.validate``). Returns
    ``fn(inputs, params, initial_state, output_final_state) -> (y [B,1,H,d], S_T [B,H,d,m] fp32)``."""
    from ssmcraft.compiler.structure import element_form
    from ssmcraft.kernels import general
    from ssmcraft.kernels.slots import CallSlots
    eir = element_form(obj.ir)
    reason = general.supports(eir)
    if reason is not None:
        from ssmcraft.errors import SsmcraftError
        raise SsmcraftError(f"{obj.name}: no fused one-token kernel: {reason}")
    names = [*eir.inputs, *eir.params]
    B, T, H, d, m = lay.B, lay.T, lay.H, lay.d, lay.m
    BV = triton.next_power_of_2(d)          # one row block: all rows in one program
    out_dtype = lay.out_dtype if lay.out_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32

    def fn(inputs, params, initial_state, output_final_state):
        cs = CallSlots(obj, {}, inputs, params, B, T, H, d, m)
        leaves = [cs.leaf(n).contiguous() for n in names]
        return general._GeneralFunction.apply(eir, (B, T, H, m, d, BV), out_dtype, output_final_state,
                                              initial_state, *leaves)
    return fn
