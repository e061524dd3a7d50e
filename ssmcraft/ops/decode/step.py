"""One-token steps (decode): one fused Triton kernel per objective, for every structure class.

A recurrent step (``ObjectiveMixer.step``, generation) calls the objective with ``T = 1``. The
chunked families would launch their whole chunked pipeline (four to six kernels and the PyTorch
coefficient work) for one token; this family instead runs the fused sequential kernel of
``ssmcraft.ops.general.recurrent`` generated from the update in element form
(``ssmcraft.compiler.structure.element_form``): coefficients, state update and readout in one
launch, the state read once and written once. It is first in the dispatch order and takes only
``T = 1`` calls (``supports_inputs``); gradients flow as in ``general`` (its backward kernel).
"""
from __future__ import annotations

from ssmcraft.compiler.structure import element_form


BACKEND_NAME = "decode-fused"


def supports(ir) -> str | None:
    """Every structure class with a structured or element-wise readout (cheap: kind only; the
    kernel itself is generated on the first one-token call)."""
    if ir.kind not in ("scalar_decay", "diagonal_decay", "rank1", "rankr", "general", "nonlinear"):
        return f"structure {ir.kind!r} has no element form"
    if ir.states:
        return "several states: the general family's fused kernel runs their one-token calls"
    return None


def supports_inputs(ir, inputs, mode) -> str | None:
    """One-token calls whose update in element form the general generator can print (checked
    here, once per call signature, so that a refusal passes the call to the next family by name)."""
    from ssmcraft.ops.general import recurrent as general
    first = next(iter(inputs.values()))
    if first.dim() < 2 or first.shape[1] != 1:
        return f"only one-token calls (T = 1); this call has T = {first.shape[1] if first.dim() > 1 else '?'}"
    reason = general.supports(element_form(ir))
    return None if reason is None else f"no fused one-token kernel: {reason}"


def prepare(obj, lay):
    """The runner for one call signature (``lay`` from ``reference.validate``). Returns
    ``fn(inputs, params, initial_state, output_final_state) -> (y [B,1,H,d], S_T [B,H,d,m] fp32)``."""
    from ssmcraft.ops.general import recurrent as general
    return general.runner(obj, element_form(obj.ir), lay)       # one row block: all rows in one program
