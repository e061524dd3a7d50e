"""The inputs of one call as the families that take the spec's inputs themselves (``minibatch_chunk``,
``mlp_memory``) pass them to their kernels, in FLA's layout (``[B, T, H, n]``, ``[B, T, H]`` for a
per-head one): from a reference layout (their ``forward``, an exported module's path) or from the
caller's tensors (their ``prepare``)."""
from __future__ import annotations

from ssmcraft.ops.common.tuning import IO_DTYPES


def laid_out_inputs(ir, lay):
    """``get(name)``: input ``name`` of the reference layout ``lay`` (``reference.layout``) in FLA's layout."""
    def get(n):
        t = lay.env[n]
        return t.reshape(lay.B, lay.T, lay.H) if not ir.inputs[n] else t.reshape(lay.B, lay.T, lay.H, -1)
    return get


def call_inputs(inputs: dict):
    """``get(name)``: the caller's input ``name`` as it is where its dtype is one the kernels read
    (``IO_DTYPES``), else in fp32 (an fp64 call)."""
    return lambda n: inputs[n] if inputs[n].dtype in IO_DTYPES else inputs[n].float()
