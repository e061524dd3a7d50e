"""Packed calls (``cu_seqlens``, ``ssmcraft.ops.common.varlen``): which path runs them.

Where Triton runs (``ssmcraft.runtime.dispatch.triton_mode``), the first kernel family in
``registry.order`` that runs the objective *and* packed calls (``KernelFamily.varlen`` is None) runs
the packed row natively, chunks never straddling a boundary; its backend name ends in ``+packed``
(``triton:keydecay-chunked+packed``). Where no family does, each sequence runs as an unpacked call
of its own (the family kernel that runs it, as ``obj()`` would pick it), and the backend says so and
why: ``triton:<family>+per-sequence (no packed kernel: <family>: no packed-sequence (cu_seqlens)
kernels; ...)``. On CPU tensors outside the interpreter the PyTorch path runs the sequences as one
padded batch whose padded steps leave each state as it was (``torch-vectorised+padded``; a
mini-batch update runs per sequence, ``torch-vectorised+per-sequence``); ``prefer="reference"``
runs the reference loop per sequence (``reference-loop+per-sequence``).

The choice is kept per call signature (``dispatch.signature``), as for unpacked calls. The offsets
are checked on every call: the native path checks them as ``varlen.check`` says (no read of offsets
on a GPU by default: the chunked families build their tables on the device); every other path needs
them on the host and reads them once (``varlen.offsets``).
"""
from __future__ import annotations

import torch

from ssmcraft.ops.common import varlen
from ssmcraft.ops.common.reference import layout, validate, vectorised
from ssmcraft.runtime import dispatch


def run_packed(obj, inputs, params, initial_state, output_final_state, cu_seqlens):
    """One packed call: (y [1, total_T, H, d], S_T [N, H, d, m] or None, backend name)."""
    sig = ("packed", dispatch.signature(obj, inputs, params, initial_state))
    path = obj._paths.get(sig)
    if path is None:
        varlen.check(obj.name, cu_seqlens, inputs, initial_state)       # a clear error before any choice
        path = _choose(obj, inputs, params, initial_state)
        obj._paths[sig] = path
    return path(obj, inputs, params, initial_state, output_final_state, cu_seqlens)


def reference(obj, inputs, params, initial_state, output_final_state, cu_seqlens):
    """The reference loop over each sequence of a packed call: (y, S_T or None)."""
    cu = varlen.offsets(obj.name, cu_seqlens, inputs, initial_state)
    return varlen.per_sequence(obj.reference, inputs, params, initial_state, output_final_state, cu)


def _choose(obj, inputs, params, initial_state):
    lay = validate(obj.ir, obj.spec, inputs, params, varlen.first_rows(initial_state))   # raises a clear error
    if obj.prefer == "reference":
        return _host(_split(dispatch._reference_path, "reference-loop+per-sequence"))
    native, why = _native(obj, inputs)
    if native is not None:
        fn = native(obj, lay)
        name = f"{fn.backend}+packed"

        def packed(obj, inputs, params, initial_state, output_final_state, cu_seqlens):     # the family checks
            y, S, _ = fn(obj, inputs, params, initial_state, output_final_state, cu_seqlens=cu_seqlens)
            return y, S, name
        return packed
    mode, _ = _mode(obj, inputs)
    if mode is None:
        if getattr(obj.module, "MINIBATCH", 0):         # its chunks are laid out from each sequence's start
            return _host(_split(dispatch._torch_path, "torch-vectorised+per-sequence"))
        return _host(_padded)
    return _host(_each(f" (no packed kernel: {why})"))


def _host(path):
    """A path that needs the offsets on the host: ``path(..., cu_seqlens, cu)`` with ``cu`` read and
    checked once per call (``varlen.offsets``)."""
    def run(obj, inputs, params, initial_state, output_final_state, cu_seqlens):
        cu = varlen.offsets(obj.name, cu_seqlens, inputs, initial_state)
        return path(obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu)
    return run


def _padded(obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu):
    """The PyTorch path on the sequences as one batch ``[N, T_max]``: each padded past its end with
    copies of its tokens (finite values: no NaN reaches the gradients through the masked steps),
    whose steps leave the state as it was (``reference.vectorised``'s ``valid``). One loop over
    ``T_max`` steps for all sequences, as an unpacked batch runs."""
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if max(lens) == 0:          # no token at all: every final state is its initial state
        return _split(dispatch._reference_path, "reference-loop+per-sequence")(
            obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu)
    dev = next(iter(inputs.values())).device
    t = torch.arange(max(lens), device=dev)
    n = torch.tensor(lens, device=dev)[:, None]
    valid = t[None, :] < n                                                   # [N, T_max]
    src = torch.tensor(cu[:-1], device=dev)[:, None] + torch.minimum(t[None, :], (n - 1).clamp_min(0))
    src = src.clamp_max(cu[-1] - 1)                    # an empty sequence reads any token (never used)
    lay = layout(obj.ir, obj.spec, {k: v[0, src] for k, v in inputs.items()}, params, initial_state)
    y, S = vectorised(obj.module, obj.ir, lay, valid)
    return y[valid][None].to(lay.out_dtype), (S if output_final_state else None), "torch-vectorised+padded"


def _each(why: str):
    """A packed call as N calls of the unpacked fast path (``dispatch.run_fast``: the family kernel
    that runs each sequence); its backend name is theirs plus ``+per-sequence`` and ``why``. A
    zero-length sequence runs the reference loop, which returns its initial state."""
    def path(obj, inputs, params, initial_state, output_final_state, cu_seqlens, cu):
        names = []

        def one(ins, p, S0, ofs):
            if next(iter(ins.values())).shape[1] == 0:
                return obj.reference(ins, p, S0, ofs)
            y, S, name = dispatch.run_fast(obj, ins, p, S0, ofs)
            names.append(name)
            return y, S
        y, S = varlen.per_sequence(one, inputs, params, initial_state, output_final_state, cu)
        return y, S, f"{names[-1] if names else 'reference-loop'}+per-sequence{why}"
    return path


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
