"""Family ``minibatch_chunk``: explicit regression steps taken in mini-batches (``approximation:
{minibatch: C}``), every gradient of a chunk at its start state, on tensor cores (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily, recorded_match
from ssmcraft.ops.minibatch_chunk import chunk

# exported with the roles ``chunk.match`` reads off the IR's sympy expressions recorded as data
FAMILY = KernelFamily(name="minibatch_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, varlen=None,
                      export_exclude=frozenset({"prepare", "supports", "match", "_leaf", "_split_row_key",
                                                "_split_insert"}),
                      export_tail=recorded_match(chunk.match, "the mini-batch kernels"))
