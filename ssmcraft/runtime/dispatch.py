"""Choose and run the fastest path for a compiled objective, and say which ran.

Order: the generated Triton kernel on CUDA tensors (or on CPU tensors when
``TRITON_INTERPRET=1`` is set and the objective asks for ``prefer="interpret"``), else
the vectorised PyTorch path. ``obj.prefer`` forces one ("reference", "torch", "triton",
"interpret"); a forced path that cannot run raises instead of falling back silently.

The choice is made once per *call signature* (each tensor's name, shape, dtype and device,
whether an initial state is given, ``prefer`` and ``TRITON_INTERPRET``) and kept on the
objective (``obj._paths``): a repeated call with the same signature does no sympy work, no
family probing and no validation beyond the signature itself. The family runners validate
the first call of each signature in full (``ssmcraft.kernels.reference.layout``).
"""
from __future__ import annotations

import os

from ssmcraft.errors import SsmcraftError


def _key(t):
    if isinstance(t, (tuple, list)):          # several states: a tuple of initial states
        return tuple(_key(x) for x in t)
    return (t.shape, t.dtype, t.device) if hasattr(t, "shape") else type(t)


def signature(obj, inputs, params, initial_state) -> tuple:
    """What the path choice depends on (cheap: no tensor data is read)."""
    ins = tuple((n, _key(t)) for n, t in inputs.items()) if isinstance(inputs, dict) else id(inputs)
    ps = tuple((n, _key(t)) for n, t in params.items()) if params else ()
    s0 = None if initial_state is None else _key(initial_state)
    return (obj.prefer, os.environ.get("TRITON_INTERPRET"), ins, ps, s0)


def run_fast(obj, inputs, params, initial_state, output_final_state):
    """Returns (y, S_T or None, backend name)."""
    sig = signature(obj, inputs, params, initial_state)
    path = obj._paths.get(sig)
    if path is None:
        path = _choose(obj, inputs, params, initial_state)
        obj._paths[sig] = path
    return path(obj, inputs, params, initial_state, output_final_state)


def _choose(obj, inputs, params, initial_state):
    """The runner for this call signature (validated once, here)."""
    from ssmcraft.kernels import reference as R
    prefer = obj.prefer
    if prefer == "reference":
        return _reference_path
    specialise = _triton_path(obj, inputs, prefer)
    if specialise is not None:
        return specialise(obj, R.validate(obj.ir, obj.spec, inputs, params, initial_state))
    if prefer in ("triton", "interpret"):
        raise SsmcraftError(f"{obj.name}: backend {prefer!r} was asked for but no Triton kernel can run here "
                            f"({_why_not_triton(obj, inputs)})")
    R.validate(obj.ir, obj.spec, inputs, params, initial_state)    # raises a clear error
    return _torch_path


def _reference_path(obj, inputs, params, initial_state, output_final_state):
    y, S = obj.reference(inputs, params, initial_state, output_final_state)
    return y, S, "reference-loop"


def _torch_path(obj, inputs, params, initial_state, output_final_state):
    from ssmcraft.kernels import reference as R
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
