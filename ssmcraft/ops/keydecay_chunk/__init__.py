"""Family ``keydecay_chunk``: chunked recurrences whose decay varies over the key dimension at most
(GLA, RetNet, HGRN, linear attention), on tensor cores (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.keydecay_chunk import chunk

FAMILY = KernelFamily(name="keydecay_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward, supports_inputs=chunk.supports_inputs,
                      supports_sizes=chunk.supports_sizes, varlen=None)
