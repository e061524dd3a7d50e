"""Choose and run the fastest path for a compiled objective, and say which ran.

Order: the generated Triton kernel on CUDA tensors (or on CPU tensors when
``TRITON_INTERPRET=1`` is set and the objective asks for ``prefer="interpret"``), else
the vectorised PyTorch path. ``obj.prefer`` forces one ("reference", "torch", "triton",
"interpret"); a forced path that cannot run raises instead of falling back silently.
"""
from __future__ import annotations

from ssmcraft.errors import SsmcraftError


def run_fast(obj, inputs, params, initial_state, output_final_state):
    """Returns (y, S_T or None, backend name)."""
    from ssmcraft.kernels import reference as R
    prefer = obj.prefer
    if prefer == "reference":
        y, S = obj.reference(inputs, params, initial_state, output_final_state)
        return y, S, "reference-loop"
    triton_fn = _triton_path(obj, inputs, prefer)
    if triton_fn is not None:
        return triton_fn(obj, inputs, params, initial_state, output_final_state)
    if prefer in ("triton", "interpret"):
        raise SsmcraftError(f"{obj.name}: backend {prefer!r} was asked for but no Triton kernel can run here "
                            f"({_why_not_triton(obj, inputs)})")
    lay = R.layout(obj.ir, obj.spec, inputs, params, initial_state)
    y, S = R.vectorised(obj.module, obj.ir, lay)
    return y.to(lay.out_dtype), (S if output_final_state else None), "torch-vectorised"


def _triton_path(obj, inputs, prefer):
    try:
        from ssmcraft.kernels import triton_backend
    except ImportError:
        return None
    return triton_backend.select(obj, inputs, prefer)


def _why_not_triton(obj, inputs) -> str:
    try:
        from ssmcraft.kernels import triton_backend
    except ImportError as e:
        return f"triton backend unavailable: {e}"
    return triton_backend.why_not(obj, inputs)
