"""Family ``rank1_keydecay_chunk``: chunked identity-minus-rank-1 recurrences with a decay per key
channel and a per-head step (a KDA-like layer), on tensor cores (``chunk.py``)."""
from ssmcraft.ops.family import KernelFamily
from ssmcraft.ops.rank1_keydecay_chunk import chunk

FAMILY = KernelFamily(name="rank1_keydecay_chunk", backend=chunk.BACKEND_NAME, module=chunk,
                      supports=chunk.supports, prepare=chunk.prepare, forward=chunk.forward,
                      supports_inputs=chunk.supports_inputs, supports_sizes=chunk.supports_sizes, varlen=None)
