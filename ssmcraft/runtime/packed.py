"""Packed calls (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): which path runs them.

Where Triton runs (``ssmcraft.runtime.dispatch.triton_mode``), the first kernel family in
``registry.order`` that runs the objective *and* packed calls (``KernelFamily.varlen`` is None) runs
the packed row natively, chunks never straddling a boundary; its backend name ends in ``+packed``
(``triton:keydecay-chunked+packed``). Where no family does, the call runs the PyTorch path once per
sequence, and the backend says so and why: ``torch-vectorised+per-sequence (no packed kernel:
rank1_row runs it unpacked only)``. On CPU tensors outside the interpreter the PyTorch path is the
fast path anyway (``torch-vectorised+per-sequence``); ``prefer="reference"`` runs the reference loop
per sequence (``reference-loop+per-sequence``). A forced Triton path (``prefer`` "triton" or
"interpret") with no family that runs packed calls raises, as an unpacked call would.

The choice is kept per call signature (``dispatch.signature``), as for unpacked calls; the offsets
are checked on every call (they are data, read to the host once: ``varlen.offsets``).
"""
from __future__ import annotations

from ssmcraft.errors import SsmcraftError
from ssmcraft.ops.common import varlen
from ssmcraft.ops.common.reference import validate
from ssmcraft.runtime import dispatch


def run_packed(obj, inputs, params, initial_state, output_final_state, cu_seqlens):
    """One packed call: (y [1, total_T, H, d], S_T [N, H, d, m] or None, backend name)."""
    cu = varlen.offsets(obj.name, cu_seqlens, inputs, initial_state)
    sig = ("packed", dispatch.signature(obj, inputs, params, initial_state))
    path = obj._paths.get(sig)
    if path is None:
        path = _choose(obj, inputs, params, initial_state)
        obj._paths[sig] = path
    return path(obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu)


def reference(obj, inputs, params, initial_state, output_final_state, cu_seqlens):
    """The reference loop over each sequence of a packed call: (y, S_T or None)."""
    cu = varlen.offsets(obj.name, cu_seqlens, inputs, initial_state)
    return varlen.per_sequence(obj.reference, inputs, params, initial_state, output_final_state, cu)


def _choose(obj, inputs, params, initial_state):
    lay = validate(obj.ir, obj.spec, inputs, params, varlen.first_rows(initial_state))   # raises a clear error
    if obj.prefer == "reference":
        return _split(dispatch._reference_path, "reference-loop+per-sequence")
    native, why = _native(obj, inputs)
    if native is not None:
        fn = native(obj, lay)
        name = f"{fn.backend}+packed"

        def packed(obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu):
            y, S, _ = fn(obj, inputs, params, initial_state, output_final_state, cu_seqlens=cu_seqlens)
            return y, S, name
        return packed
    if obj.prefer in ("triton", "interpret"):
        raise SsmcraftError(f"{obj.name}: backend {obj.prefer!r} was asked for a packed call (cu_seqlens) but no "
                            f"Triton kernel runs it here ({why})")
    mode, _ = _mode(obj, inputs)
    return _split(dispatch._torch_path, "torch-vectorised+per-sequence" + ("" if mode is None else f" (no packed kernel: {why})"))


def _mode(obj, inputs):
    try:
        from ssmcraft.ops.common.tuning import INTERPRET
    except ImportError:
        return None, "triton does not import"
    return dispatch.triton_mode(inputs, obj.prefer, INTERPRET)


def _native(obj, inputs):
    """(``specialise(obj, lay)`` of the family that runs this packed call natively, or None; why not)."""
    try:
        from ssmcraft.runtime import select
    except ImportError as e:
        return None, f"triton backend unavailable: {e}"
    return select.select_packed(obj, inputs, obj.prefer)


def _split(run, name: str):
    def path(obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu):
        y, S = varlen.per_sequence(lambda *a: run(obj, *a)[:2], inputs, params, initial_state, output_final_state, cu)
        return y, S, name
    return path
