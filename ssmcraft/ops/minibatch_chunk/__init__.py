"""Family ``minibatch_chunk``: explicit regression steps taken in mini-batches (``approximation:
{minibatch: C}``), every gradient of a chunk at its start state, on tensor cores (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.minibatch_chunk import chunk

FAMILY = KernelFamily(name="minibatch_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, varlen=None)
# not exported (no ``forward``): which inputs fill the slots is read off the IR's sympy expressions
# (``chunk.match``), which an exported module does not carry
