"""Choose and run the fastest path for a compiled objective, and say which ran.

Order: the Triton kernel on CUDA tensors (or on CPU tensors when ``TRITON_INTERPRET=1`` is set
and the objective asks for ``prefer="interpret"``), else the vectorised PyTorch path.
``obj.prefer`` forces one ("reference", "torch", "triton", "interpret"); a forced path that
cannot run raises instead of falling back silently.

The choice is made once per *call signature* (each tensor's name, shape, dtype and device,
whether an initial state is given, ``prefer`` and ``TRITON_INTERPRET``) and kept on the
objective (``obj._paths``): a repeated call with the same signature does no sympy work, no
family probing and no validation beyond the signature itself. The family runners validate
the first call of each signature in full (``ssmcraft.ops.common.reference.layout``).

The same code runs an exported module's ``Objective`` (``ssmcraft.export.runtime``, which
bundles this module), so it imports only the standard library and the bundled ssmcraft
modules. Where the Triton kernel comes from is the objective's: ``obj.triton_runner(inputs,
params, initial_state)`` gives ``specialise(obj, lay) -> runner`` or None, and
``obj.why_not_triton(inputs, params, initial_state)`` says why none runs (``ssmcraft.runtime.select`` for a compiled objective, the inline kernel module for an
exported one). A runner is called as ``runner(obj, inputs, params, initial_state,
output_final_state) -> (y, S_T or None, backend)``.
"""
from __future__ import annotations

import os

from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common.reference import layout, validate, vectorised

PREFER = ("auto", "torch", "reference", "triton", "interpret")


def triton_mode(inputs, prefer: str, interpret: bool) -> tuple[str | None, str]:
    """("triton" | "interpret" | None, why not): whether ``prefer`` runs a Triton kernel on these
    tensors, ``interpret`` telling whether ``TRITON_INTERPRET=1`` was set when the kernels were
    imported."""
    tensors = [t for t in (inputs or {}).values() if hasattr(t, "device")]
    if not tensors:
        return None, "no input tensors"
    dev = tensors[0].device.type
    if any(t.device.type != dev for t in tensors):
        return None, "inputs are on different devices"
    if dev == "cuda":
        if prefer in ("auto", "triton"):
            return "triton", ""
        return None, f"prefer={prefer!r} does not select Triton for CUDA tensors"
    if dev == "cpu":
        if not interpret:
            return None, "CPU tensors: Triton runs them only under TRITON_INTERPRET=1 with prefer='interpret'"
        if prefer != "interpret":
            return None, f"CPU tensors under TRITON_INTERPRET=1 run the interpreter only with prefer='interpret' (prefer={prefer!r})"
        return "interpret", ""
    return None, f"no Triton backend for {dev} tensors"


def backend_name(mode: str, kernel: str) -> str:
    """``triton:<kernel>`` on CUDA, ``triton-interpret:<kernel>`` under the interpreter."""
    return f"{'triton' if mode == 'triton' else 'triton-interpret'}:{kernel}"


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
    prefer = obj.prefer
    if prefer == "reference":
        return _reference_path
    specialise = obj.triton_runner(inputs, params, initial_state)
    if specialise is not None:
        return specialise(obj, validate(obj.ir, obj.spec, inputs, params, initial_state))
    if prefer in ("triton", "interpret"):
        raise SsmcraftError(f"{obj.name}: backend {prefer!r} was asked for but no Triton kernel can run here "
                            f"({obj.why_not_triton(inputs, params, initial_state)})")
    validate(obj.ir, obj.spec, inputs, params, initial_state)    # raises a clear error
    return _torch_path


def _reference_path(obj, inputs, params, initial_state, output_final_state):
    y, S = obj.reference(inputs, params, initial_state, output_final_state)
    return y, S, "reference-loop"


def _torch_path(obj, inputs, params, initial_state, output_final_state):
    lay = layout(obj.ir, obj.spec, inputs, params, initial_state)
    y, S = vectorised(obj.module, obj.ir, lay)
    return y.to(lay.out_dtype), (S if output_final_state else None), "torch-vectorised"
